//! Zero-copy sharing: one physical chunk mapped into several allocations
//! ([`super::Arena::alloc_shared`]).
//!
//! The books count, for every chunk that backs pages of more than one live
//! allocation, how many backing pages map it (`State::shared`); a chunk
//! backing one page is not listed, so nothing changes for arenas that never
//! share. A page that stops backing its allocation (free, shrink, sleep)
//! drops one reference: the chunk becomes pooled only when no other
//! allocation maps it, else the page keeps its mapping as a retired page
//! (free, or a shrink that gives the page up) or is unmapped at once (a
//! growable allocation's shrink, whose page stays in its reservation).
//!
//! Sleepers keep sharing across sleep and wake through *groups*: a sleeper
//! page whose chunk was shared when it fell asleep joins the chunk's group.
//! The group remembers the chunk while an awake allocation still maps it
//! (the waker maps it again, as it is now); once nobody awake maps it, the
//! group has no chunk, and the first of its members to wake gets a new one,
//! which the later ones map too.

use std::collections::BTreeMap;

use super::alloc::Target;
use super::moves::make_room;
use super::state::MoveEvent;
use super::state::{Plan, Sleep, State};
use super::txn::Txn;
use super::{pages_for, Arena, Touch};
use crate::driver::ChunkHandle;
use crate::error::{Error, Result};
use crate::Id;

impl Arena {
    /// Zero-copy sharing: a new growable allocation of `bytes` bytes,
    /// reserving `max_size`, whose pages are `src`'s chunks of
    /// `src_offset..src_offset + bytes`, mapped a second time (nothing is
    /// copied; a write through either address is seen through the other).
    /// Returns its id and address.
    ///
    /// `src_offset` and `bytes` are multiples of the chunk size, `bytes > 0`,
    /// the range lies inside `src`'s size (only whole chunks of it are
    /// shared), `src` is not a small allocation and `max_size >= bytes`,
    /// else `Error::InvalidArgument`; a sleeping `src` is `Error::Asleep`.
    /// The new allocation grows, shrinks, moves, pins, sleeps and frees like
    /// any growable allocation, and `src` keeps behaving as before. A chunk
    /// mapped by several allocations stays until the last of them no longer
    /// maps it, and counts once in `mapped_bytes` (`shared_bytes` counts
    /// it too); `live_bytes` counts each allocation's size.
    ///
    /// It creates no chunk, so it never runs out of memory; it may move
    /// other allocations (`src` too) to find address space, as `alloc` does.
    pub fn alloc_shared(&self, src: Id, src_offset: u64, bytes: u64, max_size: u64) -> Result<(Id, u64)> {
        let chunk = self.chunk;
        if bytes == 0 {
            return Err(Error::invalid("alloc_shared of 0 bytes"));
        }
        if bytes % chunk != 0 || src_offset % chunk != 0 {
            return Err(Error::invalid(format!(
                "alloc_shared: src_offset {src_offset} and bytes {bytes} must be multiples of the chunk size {chunk}"
            )));
        }
        if max_size < bytes {
            return Err(Error::invalid(format!("max_size {max_size} < bytes {bytes}")));
        }
        let reserved = pages_for(max_size, chunk, "max_size")?;
        self.run(Touch::Nothing, |inner, ctx, events| {
            #[cfg(unix)]
            inner.shares.check_share_source(&inner.st, src)?;
            let st = &mut inner.st;
            let slot = match st.resolve(src)? {
                Target::Chunks(slot) => slot,
                Target::Small(_) => {
                    return Err(Error::invalid(
                        "alloc_shared: src is a small allocation, which shares its slab's chunk",
                    ))
                }
            };
            let a = st.alloc(slot);
            if src_offset.checked_add(bytes).map_or(true, |end| end > a.size) {
                return Err(Error::invalid(format!(
                    "alloc_shared: {src_offset}+{bytes} exceeds src's {} bytes",
                    a.size
                )));
            }
            if a.sleep.is_some() {
                return Err(Error::Asleep(src.get()));
            }
            let mut tx = ctx.txn(st);
            match alloc_shared_pages(st, &mut tx, slot, src_offset / chunk, bytes / chunk, reserved, events) {
                Ok(new) => {
                    tx.commit();
                    Ok((st.id_of(new), st.addr(st.alloc(new).start)))
                }
                Err(e) => {
                    tx.rollback();
                    Err(e)
                }
            }
        })
    }
}

/// One sharing group of sleepers' pages.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Group {
    /// The chunk an awake allocation maps, if one still does.
    pub chunk: Option<ChunkHandle>,
    /// Sleepers' pages in the group: (slot, page index).
    pub members: Vec<(u32, u64)>,
}

/// The sleepers' sharing groups.
#[derive(Clone, Debug, Default)]
pub(crate) struct ShareGroups {
    pub by_id: BTreeMap<u64, Group>,
    /// The group of each chunk that an awake allocation maps.
    pub of_chunk: BTreeMap<ChunkHandle, u64>,
    next: u64,
    /// Sleeps so far (each sleeper's `seq`).
    pub sleeps: u64,
}

impl ShareGroups {
    /// The group of `h`, made if it has none.
    fn group_of(&mut self, h: ChunkHandle) -> u64 {
        if let Some(&g) = self.of_chunk.get(&h) {
            return g;
        }
        self.next += 1;
        let g = self.next;
        self.by_id.insert(g, Group { chunk: Some(h), members: Vec::new() });
        self.of_chunk.insert(h, g);
        g
    }

    /// No awake allocation maps `h` any more.
    fn chunk_gone(&mut self, h: ChunkHandle) {
        if let Some(g) = self.of_chunk.remove(&h) {
            self.by_id.get_mut(&g).expect("group of a chunk").chunk = None;
        }
    }

    /// Sleeper `slot` leaves its groups (it wakes or is freed); a group
    /// left without members goes.
    pub fn leave(&mut self, slot: u32, shares: &[(u64, u64)]) {
        for &(i, g) in shares {
            let grp = self.by_id.get_mut(&g).expect("a sleeper's group");
            grp.members.retain(|&m| m != (slot, i));
            if grp.members.is_empty() {
                if let Some(h) = grp.chunk {
                    self.of_chunk.remove(&h);
                }
                self.by_id.remove(&g);
            }
        }
    }
}

impl State {
    /// One backing page stops mapping `h`. True when another backing page
    /// still maps it (the chunk is not the caller's to pool).
    pub fn drop_ref(&mut self, h: ChunkHandle) -> bool {
        match self.shared.get_mut(&h) {
            Some(n) => {
                *n -= 1;
                if *n == 1 {
                    self.shared.remove(&h);
                }
                self.shared_extra -= 1;
                true
            }
            None => {
                self.groups.chunk_gone(h);
                false
            }
        }
    }

    /// One more backing page maps `h`, which backs a page already.
    pub fn add_ref(&mut self, h: ChunkHandle) {
        *self.shared.entry(h).or_insert(1) += 1;
        self.shared_extra += 1;
    }

    /// Whether page `p`'s chunk backs another page too.
    pub fn page_shared(&self, p: u64) -> bool {
        self.mapped[p as usize].is_some_and(|h| self.shared.contains_key(&h))
    }
}

/// Places a new growable allocation of `pages` pages (reserving `reserved`)
/// that maps `src`'s chunks from its page `first` on: best fit, else after
/// releasing retired ranges and compacting (which may move `src`; its
/// chunks are the same wherever it is). No chunk is created, so it never
/// runs out of memory. On error the state is unchanged and the caller rolls
/// `tx` back.
pub(super) fn alloc_shared_pages(
    st: &mut State,
    tx: &mut Txn<'_>,
    src: u32,
    first: u64,
    pages: u64,
    reserved: u64,
    events: &mut Vec<MoveEvent>,
) -> Result<u32> {
    if reserved > st.pages {
        return Err(Error::OutOfAddressSpace(format!(
            "a reservation of {} bytes exceeds the whole virtual range",
            reserved * st.chunk
        )));
    }
    let place = |st: &mut State, tx: &mut Txn<'_>, t: u64| -> Result<u32> {
        let s = st.alloc(src).start + first;
        let known: Vec<ChunkHandle> =
            (s..s + pages).map(|p| st.mapped[p as usize].expect("backing page is mapped")).collect();
        let mut plan = Plan::new(st, &known, t..t + pages, t..t + reserved)?;
        plan.execute(st, tx)?;
        plan.apply(st);
        let a = super::state::Alloc {
            start: t,
            reserved,
            backed: pages,
            size: pages * st.chunk,
            growable: true,
            pinned: false,
            owner: super::state::Owner::User,
            tag: 0,
            sleep: None,
            quiet: Default::default(),
        };
        let slot = st.insert_alloc(a);
        for h in known {
            st.add_ref(h);
        }
        Ok(slot)
    };
    if let Some(t) = st.free.best_fit(reserved) {
        return place(st, tx, t);
    }
    let mut sim = st.clone();
    let mut evs = Vec::new();
    let t = make_room(&mut sim, tx, reserved, None, &mut evs)?;
    let slot = place(&mut sim, tx, t)?;
    *st = sim;
    events.extend(evs);
    Ok(slot)
}

/// The books of putting `slot` to sleep, its pages already unmapped:
/// each page drops its reference; a page whose chunk was shared joins the
/// chunk's group. Returns the chunks nobody maps any more (to release).
pub(super) fn sleep_books(
    st: &mut State,
    slot: u32,
    backup: Option<std::sync::Arc<crate::driver::HostBuffer>>,
) -> Vec<ChunkHandle> {
    let a = st.alloc(slot).clone();
    let mut doomed = Vec::new();
    let mut shares = Vec::new();
    for i in 0..a.backed {
        let p = a.start + i;
        let h = st.mapped[p as usize].take().expect("backing page");
        if st.shared.contains_key(&h) || st.groups.of_chunk.contains_key(&h) {
            let g = st.groups.group_of(h);
            st.groups.by_id.get_mut(&g).expect("just made").members.push((slot, i));
            shares.push((i, g));
        }
        if !st.drop_ref(h) {
            doomed.push(h);
        }
    }
    st.backed_pages -= a.backed;
    st.asleep_pages += a.reserved;
    st.backup_bytes += backup.as_ref().map_or(0, |b| b.len() as u64);
    st.groups.sleeps += 1;
    let seq = st.groups.sleeps;
    let m = st.alloc_mut(slot);
    m.sleep = Some(Sleep { backed: a.backed, backup, shares, seq });
    m.backed = 0;
    doomed
}

/// New chunks that waking `targets` needs: a page of no group needs one,
/// a group without a chunk needs one for all its waking members.
pub(super) fn wake_needs(st: &State, targets: &[u32]) -> u64 {
    let mut groups = std::collections::BTreeSet::new();
    let mut n = 0;
    for &slot in targets {
        let z = st.alloc(slot).sleep.as_ref().expect("asleep");
        n += z.backed - z.shares.len() as u64;
        for &(_, g) in &z.shares {
            if st.groups.by_id[&g].chunk.is_none() {
                groups.insert(g);
            }
        }
    }
    n + groups.len() as u64
}

/// What waking one sleeper wrote where: the pages that got a new chunk
/// and receive its own backup, and the group pages that got a new chunk
/// (each receives, byte by byte, the newest backup of a member covering it:
/// [`group_sources`]).
pub(super) struct Woken {
    pub own_pages: Vec<u64>,
    pub group_pages: Vec<(u64, u64)>,
}

/// Maps `slot`'s pages again (its groups' chunks where an awake allocation
/// maps them, new ones elsewhere) and wakes it in the books.
pub(super) fn wake_one(st: &mut State, tx: &mut Txn<'_>, slot: u32) -> Result<Woken> {
    let a = st.alloc(slot).clone();
    let z = a.sleep.as_ref().expect("asleep");
    let group_at: BTreeMap<u64, u64> = z.shares.iter().copied().collect();
    let sources: Vec<Option<ChunkHandle>> =
        (0..z.backed).map(|i| group_at.get(&i).and_then(|g| st.groups.by_id[g].chunk)).collect();
    let mut plan = Plan::with_sources(st, &sources, a.start..a.start + z.backed, a.start..a.start + a.reserved)?;
    plan.execute(st, tx)?;
    plan.apply(st);
    let mut woken = Woken { own_pages: Vec::new(), group_pages: Vec::new() };
    for i in 0..z.backed {
        let p = a.start + i;
        let h = st.mapped[p as usize].expect("just mapped");
        match (group_at.get(&i), sources[i as usize]) {
            (Some(_), Some(known)) => st.add_ref(known),
            (Some(&g), None) => {
                // The group's new chunk: its later wakers map this one.
                st.groups.by_id.get_mut(&g).expect("a sleeper's group").chunk = Some(h);
                st.groups.of_chunk.insert(h, g);
                woken.group_pages.push((i, g));
            }
            (None, _) => woken.own_pages.push(i),
        }
    }
    st.groups.leave(slot, &z.shares);
    st.backed_pages += z.backed;
    st.asleep_pages -= a.reserved;
    st.backup_bytes -= z.backup.as_ref().map_or(0, |b| b.len() as u64);
    let m = st.alloc_mut(slot);
    m.backed = z.backed;
    m.sleep = None;
    Ok(woken)
}

/// One piece of a group's new chunk: bytes `from..to` of the chunk come
/// from the backup of sleeper `slot`, at the same offsets of its page `page`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct GroupPiece {
    pub slot: u32,
    pub page: u64,
    pub from: u64,
    pub to: u64,
}

/// Where a group's new chunk gets its bytes (from the books before the
/// wake): each byte from the backup of the member that slept last with a
/// backup covering that byte. A backup holds its sleeper's `size` bytes,
/// so a member whose size ends inside the shared page covers only a prefix
/// of the chunk: the newest backup gives its prefix, and an older one that
/// covers more gives the bytes after it, and so on. (Backups taken in one
/// sleep agree wherever they overlap; across sleeps the newer is the later
/// state of the chunk.)
pub(super) fn group_sources(before: &State, g: u64) -> Vec<GroupPiece> {
    let c = before.chunk;
    let mut members: Vec<(u64, u32, u64, u64)> = before.groups.by_id[&g]
        .members
        .iter()
        .filter_map(|&(slot, i)| {
            let z = before.alloc(slot).sleep.as_ref()?;
            let b = z.backup.as_ref()?;
            let covers = (b.len() as u64).saturating_sub(i * c).min(c);
            Some((z.seq, slot, i, covers))
        })
        .collect();
    members.sort_unstable_by_key(|&(seq, ..)| std::cmp::Reverse(seq));
    let mut pieces = Vec::new();
    let mut covered = 0;
    for (_, slot, page, covers) in members {
        if covers > covered {
            pieces.push(GroupPiece { slot, page, from: covered, to: covers });
            covered = covers;
        }
        if covered == c {
            break;
        }
    }
    pieces
}
