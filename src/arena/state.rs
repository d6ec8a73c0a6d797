//! The arena's bookkeeping: pure data (the plans that change it are in
//! `plan.rs`).
//!
//! Address space is counted in pages of one chunk each. A page is, at any
//! time, in exactly one of these places:
//! - inside a live allocation's reservation: *backing* it (mapped, below
//!   `start + backed`) or beyond its backed prefix (unmapped, or holding a
//!   *cached* pooled chunk that growth will adopt for free);
//! - inside a *retired* range (the old, still-mapped address of a moved
//!   allocation, unmapped later after a synchronize);
//! - *free*: unmapped, or holding a cached pooled chunk.
//!
//! Physical chunks are *backing* a live allocation, *cached* (pooled but
//! still mapped at a page where the next allocation can use it without a
//! driver call) or *pooled unmapped*. `held = backing + cached + pool` never
//! exceeds the capacity.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::alias::ShareGroups;
use super::page_table::PageTable;
pub(crate) use super::plan::{Plan, SET_ASIDE};
use super::small::SmallTable;
pub(crate) use super::stream::{Held, Pending};
use super::stream_reuse::{self, StreamReuse};
// Where the driver calls are batched; every caller knows it from here.
pub(crate) use super::txn::runs;
use crate::driver::{ChunkHandle, HostBuffer};
use crate::error::{Error, Result};
use crate::id::{IdParts, MAX_GENERATION};
use crate::va::FreeRanges;

/// One live allocation of whole chunks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Alloc {
    pub start: u64,
    pub reserved: u64,
    pub backed: u64,
    pub size: u64,
    pub growable: bool,
    pub pinned: bool,
    pub owner: Owner,
    /// The caller's tag (see `Arena::set_tag`); 0 by default.
    pub tag: u32,
    /// Set while the allocation sleeps (see `Arena::sleep`): it maps
    /// nothing then, and `backed` is 0.
    pub sleep: Option<Sleep>,
    /// Whether the caller promised no more work through it (see
    /// `Arena::quiesce_on_stream`).
    pub quiet: Quiet,
}

/// The caller's promise that no more device work uses an allocation
/// (`Arena::quiesce_on_stream`), and how far the arena knows it kept.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) enum Quiet {
    /// No promise: every allocation starts so; growth, sleep, `unquiesce`
    /// and a stream free end one.
    #[default]
    No,
    /// No work after the work queued before this event (on the promising
    /// stream), which is not yet seen complete.
    After(u64),
    /// That work has completed: no device work uses its pages, so the
    /// pages it gives up are idle at once.
    Yes,
}

impl Alloc {
    /// Whether the prefetcher keeps chunks mapped after its backed pages
    /// (see `Arena::set_prefetch`): a caller's growable allocation, awake,
    /// and not quiesced (a promise of no more work is one of no growth).
    pub fn maps_ahead(&self) -> bool {
        self.growable && self.owner.counts_live() && self.sleep.is_none() && self.quiet == Quiet::No
    }

    /// Whether no planner may move it: pinned, or asleep (its reservation
    /// must stay where the caller's pointers are).
    pub fn immovable(&self) -> bool {
        self.pinned || self.sleep.is_some() || matches!(self.owner, Owner::Pending | Owner::DmaBuf)
    }
}

/// What a sleeping allocation keeps of its backing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Sleep {
    /// The backed pages it had, and gets back on wake.
    pub backed: u64,
    /// Its pages that shared a chunk when it fell asleep: (page index,
    /// sharing group), so that it shares again when it wakes (see
    /// `arena/alias.rs`).
    pub shares: Vec<(u64, u64)>,
    /// When it fell asleep (a counter): each byte of a group's new chunk
    /// comes from the member that slept last with a backup covering it.
    pub seq: u64,
    /// Its first `size` bytes, when it slept with a backup. Shared, so that
    /// the state copies of the slow paths do not copy the bytes; freed when
    /// the last copy goes (on wake or free).
    ///
    /// A host buffer the driver lent (`Driver::alloc_host`): page-locked
    /// memory from `cuMemHostAlloc` on CUDA, so the device copies it by DMA
    /// without staging; ordinary memory on the host backend. The buffer
    /// keeps what freeing it needs (CUDA: the context) alive by itself.
    pub backup: Option<std::sync::Arc<HostBuffer>>,
}

/// Who an allocation of whole chunks belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Owner {
    /// A caller, through its id.
    User,
    /// The slab of this index (small allocations live inside it).
    Slab(u32),
    /// A small allocation resized beyond the small classes: the caller
    /// knows it by the small id of this small-table slot.
    Promoted(u32),
    /// Freed on a stream (`Arena::free_on_stream`), its event not yet
    /// complete: no id names it, and it keeps its pages and chunks where
    /// they are until the event completes (see [`Pending`]).
    Pending,
    /// Freed while a DMA-BUF of it is open (`Arena::dmabuf`): no id names
    /// it, and it keeps its pages and chunks where they are, out of every
    /// plan's reach, until the last DMA-BUF closes (see `arena/dmabuf.rs`).
    DmaBuf,
}

impl Owner {
    /// Whether the allocation counts in `live_count` and `live_bytes`.
    pub fn counts_live(self) -> bool {
        matches!(self, Owner::User | Owner::Promoted(_))
    }
}

#[derive(Clone, Debug)]
pub(crate) struct Slot {
    pub generation: u32,
    pub alloc: Option<Alloc>,
}

/// Everything the policy knows. Plans run on a clone (the page table's
/// segments are shared until written, see `page_table.rs`).
#[derive(Clone, Debug)]
pub(crate) struct State {
    pub chunk: u64,
    pub base: u64,
    pub pages: u64,
    pub cap_pages: u64,
    pub retain_bytes: u64,
    pub no_implicit_moves: bool,
    /// Placement ignores the pool (`ArenaConfig::deterministic_placement`).
    pub deterministic: bool,
    /// The chunk mapped at each page (backing, cached or retired), if any.
    pub mapped: PageTable,
    pub free: FreeRanges,
    pub slots: Vec<Slot>,
    pub free_slots: Vec<u32>,
    /// Live allocations by start page.
    pub by_start: BTreeMap<u64, u32>,
    /// Retired ranges: start page -> pages (all mapped).
    pub retired: BTreeMap<u64, u64>,
    pub retired_pages: u64,
    /// Pages holding a cached pooled chunk.
    pub cached: BTreeSet<u64>,
    /// Pooled chunks mapped nowhere.
    pub pool: Vec<ChunkHandle>,
    pub backed_pages: u64,
    pub live_bytes: u64,
    pub live_count: u64,
    pub peak_held_pages: u64,
    pub moves: u64,
    /// Small allocations and their slabs.
    pub small: SmallTable,
    /// Bytes copied by resizes of small allocations beyond their class.
    pub bytes_copied: u64,
    /// This arena's tag in its ids (see [`crate::Id`]).
    pub tag: u16,
    /// Reserved pages of sleeping allocations.
    pub asleep_pages: u64,
    /// Bytes held in sleeping allocations' backups.
    pub backup_bytes: u64,
    /// Stream-ordered frees waiting for their events, oldest first.
    pub pending: VecDeque<Pending>,
    /// Cached and retired pages that no device work can still use: their
    /// last users were freed on a stream whose event has completed, or
    /// the prefetcher mapped them ahead and nothing used them yet.
    /// Unmapping them needs no device synchronize. Always a subset of
    /// `cached` and of the retired ranges' pages.
    pub idle: BTreeSet<u64>,
    /// Cached and retired pages a stream-ordered shrink left
    /// (`Arena::resize_on_stream`), or a quiesced allocation gave up before
    /// its promise's event completed (`Arena::quiesce_on_stream`), and the
    /// event that will make them idle once it completes. A page leaves this map wherever it would
    /// leave `idle` ([`State::forget_idle`]): it backs an allocation
    /// again, or is unmapped.
    pub pending_idle: BTreeMap<u64, u64>,
    /// The allocation (slot) each retired range was left by, by start
    /// page: its stream-ordered free covers that range too.
    pub retired_owner: BTreeMap<u64, u32>,
    /// Chunks out of the books while `maintain` works on them outside the
    /// lock (being created, or taken from the pool to be mapped ahead).
    /// They count in `held_pages`, so the capacity holds them.
    pub inflight_pages: u64,
    /// Pages the prefetcher is mapping outside the lock: no plan may map
    /// them until it has committed (see `SET_ASIDE`).
    pub set_aside: BTreeSet<u64>,
    /// Prefetch targets in pages: (unmapped pooled chunks, mapped ahead of
    /// each awake growable allocation). See `Arena::set_prefetch`.
    pub prefetch: (u64, u64),
    /// Admission map-ahead target (see `Arena::set_admission_prefetch`).
    pub admit_ahead: super::admission_ahead::AdmitAhead,
    /// The admission windows `maintain` last predicted: plans take other
    /// idle cached chunks before theirs (a hint, possibly stale).
    pub admit_windows: Vec<std::ops::Range<u64>>,
    /// Set when an operation may have created work for the prefetcher
    /// (the background worker is woken, then it is cleared).
    pub prefetch_dirty: bool,
    /// Chunks that back pages of more than one live allocation, and how
    /// many backing pages map each (at least 2). A chunk backing one page
    /// is not listed.
    pub shared: BTreeMap<ChunkHandle, u32>,
    /// Same-stream reuse (see `stream_reuse.rs`).
    pub reuse: StreamReuse,
    /// The sum of `count - 1` over `shared`: backing pages that are not
    /// distinct chunks.
    pub shared_extra: u64,
    /// Sleepers' sharing groups.
    pub groups: ShareGroups,
}

/// A relocation that happened, reported to the move callback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoveEvent {
    /// The moved allocation.
    pub id: crate::Id,
    /// Its address before the move (still valid until retired ranges are released).
    pub old_ptr: u64,
    /// Its new address.
    pub new_ptr: u64,
    /// Its size in bytes at the moment of the move.
    pub size: u64,
}

impl State {
    /// An empty arena's state: `pages` free pages, nothing held.
    ///
    /// The page table holds a pointer per segment of pages until pages are
    /// mapped (see `page_table.rs`): a reservation whose segment pointers
    /// the process cannot get (a caller's `reserve_bytes` of petabytes with
    /// 4 KiB chunks) is `Error::OutOfMemory`, not an abort on a failed
    /// allocation.
    pub fn new(
        chunk: u64,
        base: u64,
        pages: u64,
        cap_pages: u64,
        retain_bytes: u64,
        no_implicit_moves: bool,
    ) -> crate::error::Result<State> {
        let too_big = || {
            crate::error::Error::OutOfMemory(format!(
                "the page table of a reservation of {pages} chunks cannot be allocated (use larger chunks or a smaller reserve)"
            ))
        };
        let mapped = PageTable::new(usize::try_from(pages).map_err(|_| too_big())?).ok_or_else(too_big)?;
        Ok(State {
            chunk,
            base,
            pages,
            cap_pages,
            retain_bytes,
            no_implicit_moves,
            deterministic: false,
            mapped,
            free: FreeRanges::with_range(0, pages),
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_start: Default::default(),
            retired: Default::default(),
            retired_pages: 0,
            cached: Default::default(),
            pool: Vec::new(),
            backed_pages: 0,
            live_bytes: 0,
            live_count: 0,
            peak_held_pages: 0,
            moves: 0,
            small: SmallTable::new(chunk),
            bytes_copied: 0,
            tag: 0,
            asleep_pages: 0,
            backup_bytes: 0,
            pending: VecDeque::new(),
            idle: BTreeSet::new(),
            pending_idle: BTreeMap::new(),
            retired_owner: BTreeMap::new(),
            inflight_pages: 0,
            set_aside: BTreeSet::new(),
            prefetch: (0, 0),
            admit_ahead: Default::default(),
            admit_windows: Vec::new(),
            prefetch_dirty: false,
            shared: Default::default(),
            reuse: StreamReuse::default(),
            shared_extra: 0,
            groups: Default::default(),
        })
    }

    /// The id of small slot `ss`.
    pub fn small_id(&self, ss: u32) -> crate::Id {
        let generation = self.small.slots[ss as usize].generation;
        crate::Id::compose(IdParts { small: true, generation, tag: self.tag, slot: ss })
    }

    /// Distinct chunks held: a shared chunk counts once.
    pub fn held_pages(&self) -> u64 {
        self.backing_chunks() + self.cached.len() as u64 + self.pool.len() as u64 + self.inflight_pages
    }

    /// Distinct chunks backing live allocations (and slabs).
    pub fn backing_chunks(&self) -> u64 {
        self.backed_pages - self.shared_extra
    }

    pub fn pooled_pages(&self) -> u64 {
        self.cached.len() as u64 + self.pool.len() as u64
    }

    /// The event whose stream may still be writing cached page `p`, for a
    /// new owner: a page in a free range (outside every reservation: a
    /// tail is its owner's, who orders its own work) that a stream-ordered
    /// shrink left (or a quiesced allocation gave up) before that event
    /// was seen complete, unless the event is on the stream of the
    /// operation under way (whose new work is ordered after it). A new
    /// owner adopting the page in place waits for the event first, as
    /// unmapping it elsewhere synchronizes first.
    pub fn busy_event(&self, p: u64) -> Option<u64> {
        let &event = self.pending_idle.get(&p)?;
        self.free.containing(p)?;
        let stream = self.pending.iter().find(|e| e.event == event)?.stream;
        (Some(stream) != self.reuse.op_stream).then_some(event)
    }

    /// Whether the page lies in a retired range.
    pub fn is_retired(&self, p: u64) -> bool {
        self.retired.range(..=p).next_back().is_some_and(|(&s, &l)| p < s + l)
    }

    /// The page stops being idle, or about to become idle: it backs an
    /// allocation again or is unmapped (new work may use its chunk).
    pub fn forget_idle(&mut self, p: u64) {
        self.idle.remove(&p);
        self.pending_idle.remove(&p);
    }

    /// `pages` just stopped backing an allocation whose promise was `quiet`
    /// (see `Arena::quiesce_on_stream`): those still mapped (cached or
    /// retired) become idle if the promise is known kept, or idle once its
    /// event completes.
    pub fn left_quiet(&mut self, quiet: Quiet, pages: std::ops::Range<u64>) {
        if quiet == Quiet::No {
            return;
        }
        for p in pages {
            if self.cached.contains(&p) || self.is_retired(p) {
                match quiet {
                    Quiet::Yes => {
                        self.idle.insert(p);
                    }
                    Quiet::After(event) => {
                        self.pending_idle.insert(p, event);
                    }
                    Quiet::No => {}
                }
            }
        }
    }

    /// Chunks an operation may still obtain: pooled ones and new ones up to the cap.
    pub fn obtainable_pages(&self) -> u64 {
        self.pooled_pages() + self.cap_pages.saturating_sub(self.held_pages()) + stream_reuse::takeable(self)
    }

    pub fn note_peak(&mut self) {
        self.peak_held_pages = self.peak_held_pages.max(self.held_pages());
    }

    pub fn addr(&self, page: u64) -> u64 {
        self.base + page * self.chunk
    }

    pub fn id_of(&self, slot: u32) -> crate::Id {
        let generation = self.slots[slot as usize].generation;
        crate::Id::compose(IdParts { small: false, generation, tag: self.tag, slot })
    }

    pub fn lookup(&self, id: crate::Id) -> Result<u32> {
        let IdParts { small, generation, tag, slot } = id.parts();
        match self.slots.get(slot as usize) {
            Some(Slot { generation: g, alloc: Some(a) })
                if *g == generation && a.owner == Owner::User && !small && tag == self.tag =>
            {
                Ok(slot)
            }
            _ => Err(Error::UnknownAllocation(id.get())),
        }
    }

    pub fn alloc(&self, slot: u32) -> &Alloc {
        self.slots[slot as usize].alloc.as_ref().expect("live slot")
    }

    pub fn alloc_mut(&mut self, slot: u32) -> &mut Alloc {
        self.slots[slot as usize].alloc.as_mut().expect("live slot")
    }

    /// Records a new allocation at `a.start` (whose pages must be free and backed).
    pub fn insert_alloc(&mut self, a: Alloc) -> u32 {
        self.free.remove(a.start, a.reserved);
        self.backed_pages += a.backed;
        if a.owner.counts_live() {
            self.live_bytes += a.size;
            self.live_count += 1;
        }
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.slots.push(Slot { generation: 1, alloc: None });
                (self.slots.len() - 1) as u32
            }
        };
        self.by_start.insert(a.start, slot);
        self.slots[slot as usize].alloc = Some(a);
        slot
    }

    /// Forgets an allocation: its backing chunks stay mapped as cached pool
    /// chunks and its reservation becomes free; a page whose chunk another
    /// allocation still maps is retired instead (still mapped, unmapped
    /// when retired memory is released).
    pub fn remove_alloc(&mut self, slot: u32) {
        let s = &mut self.slots[slot as usize];
        let a = s.alloc.take().expect("live slot");
        // A generation that would wrap retires the slot forever: ids are
        // never reused.
        if s.generation < MAX_GENERATION {
            s.generation += 1;
            self.free_slots.push(slot);
        }
        self.by_start.remove(&a.start);
        // Its old ranges stay retired, but a later owner of the slot must
        // not find them its own (its stream free would make them idle).
        if !self.retired_owner.is_empty() {
            self.retired_owner.retain(|_, o| *o != slot);
        }
        // A sleeping one maps nothing (`backed` is 0); its backup goes,
        // and so does its place in sharing groups.
        if let Some(sleep) = &a.sleep {
            self.asleep_pages -= a.reserved;
            self.backup_bytes -= sleep.backup.as_ref().map_or(0, |b| b.len() as u64);
            self.groups.leave(slot, &sleep.shares);
        }
        let mut still_shared = Vec::new();
        for p in a.start..a.start + a.backed {
            let h = self.mapped[p as usize].expect("backing page is mapped");
            if self.drop_ref(h) {
                still_shared.push(p);
            } else {
                self.cached.insert(p);
            }
        }
        self.backed_pages -= a.backed;
        if a.owner.counts_live() {
            self.live_bytes -= a.size;
            self.live_count -= 1;
        }
        self.prefetch_dirty = true;
        self.free.insert(a.start, a.reserved);
        self.retire_pages(&still_shared);
        self.left_quiet(a.quiet, a.start..a.start + a.backed);
    }

    /// Pages (sorted, free) that still map a chunk someone else backs
    /// become retired ranges.
    pub fn retire_pages(&mut self, pages: &[u64]) {
        for run in runs(pages) {
            let len = run.end - run.start;
            self.free.remove(run.start, len);
            self.retired.insert(run.start, len);
            self.retired_pages += len;
        }
    }

    /// The pages of `slot` from `new_backed` on stop backing it and become
    /// cached, except those whose chunk another allocation still maps:
    /// they are returned (sorted, still mapped), for the caller to retire
    /// or unmap.
    pub fn shrink_backing(&mut self, slot: u32, new_backed: u64) -> Vec<u64> {
        let a = self.alloc(slot).clone();
        let mut still_shared = Vec::new();
        for p in a.start + new_backed..a.start + a.backed {
            let h = self.mapped[p as usize].expect("backing page is mapped");
            if self.drop_ref(h) {
                still_shared.push(p);
            } else {
                self.cached.insert(p);
            }
        }
        self.backed_pages -= a.backed - new_backed;
        self.alloc_mut(slot).backed = new_backed;
        still_shared
    }

    /// Segments in address order: (start, pages, what).
    pub fn segments(&self) -> Vec<(u64, u64, Segment)> {
        let mut v: Vec<(u64, u64, Segment)> = Vec::with_capacity(self.by_start.len() * 2 + self.free.len());
        v.extend(self.by_start.iter().map(|(&s, &slot)| (s, self.alloc(slot).reserved, Segment::Alloc(slot))));
        v.extend(self.free.iter().map(|(s, l)| (s, l, Segment::Free)));
        v.extend(self.retired.iter().map(|(&s, &l)| (s, l, Segment::Retired)));
        v.sort_unstable_by_key(|&(s, _, _)| s);
        v
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Segment {
    Alloc(u32),
    Free,
    Retired,
}
