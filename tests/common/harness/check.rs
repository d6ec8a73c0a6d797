//! The checks made after every operation (listed in the module doc), and
//! the oracle that judges an out-of-address-space.

use std::collections::{BTreeMap, BTreeSet};

use vmm_arena::{Id, MoveEvent};

use super::super::common::{evacuation_exists, Snap};
use super::{Backend, Harness, Probe};

impl Harness {
    /// Checks every invariant after an operation; `may_move` are the ids
    /// that were allowed to move during it.
    pub fn check(&mut self, what: &str, may_move: &[Id]) {
        let c = self.c;
        let snap = Snap::of(&self.arena);
        snap.check_structure(self.arena.va_range());
        let s = &snap.stats;
        assert_eq!(s["chunk_bytes"], c);
        assert_eq!(s["capacity_bytes"], self.cfg.cap_pages * c);
        assert_eq!(s["live_allocations"], self.live.len() as u64, "{what}: live_allocations");
        assert_eq!(s["live_bytes"], self.live.values().map(|m| m.size).sum::<u64>(), "{what}: live_bytes");
        // resize_on_stream records an event only on a GPU (the host has no
        // asynchronous streams, the mock's are off here): else it is resize.
        assert_eq!(s["stream_shrinks"], self.stream_shrinks, "{what}: stream_shrinks");
        // So does quiesce_on_stream (a promise the host and the mock know
        // kept at once).
        assert_eq!(s["quiesces"], self.quiesces, "{what}: quiesces");
        assert_eq!(self.arena.stats().unwrap().quiesces, self.quiesces, "{what}: quiesces in the stats");
        // Reference counts: awake holders of each model chunk.
        let mut refs: BTreeMap<u64, u64> = BTreeMap::new();
        for m in self.live.values().filter(|m| !m.asleep) {
            assert_eq!(m.chunks.len() as u64, if m.small { 0 } else { self.pages(m.size) }, "{what}: model chunks");
            for &k in &m.chunks {
                *refs.entry(k).or_default() += 1;
            }
        }
        let idle_slabs = snap.slabs().filter(|r| r.used == 0).count() as u64;
        let asleep_slabs = snap.slabs().filter(|r| r.asleep).count() as u64;
        assert_eq!(
            s["mapped_bytes"],
            (refs.len() as u64 + s["small_slabs"] - idle_slabs - asleep_slabs) * c,
            "{what}: mapped_bytes (a shared chunk once)"
        );
        assert_eq!(s["shared_bytes"], refs.values().filter(|&&n| n > 1).count() as u64 * c, "{what}: shared_bytes");
        assert_eq!(
            snap.slabs().map(|r| r.used).sum::<u64>(),
            self.live.values().filter(|m| m.small).count() as u64,
            "{what}: objects in slabs"
        );
        assert!(s["peak_physical_bytes"] >= self.snap.stats["peak_physical_bytes"], "{what}: the peak went down");
        if let (Some(r), false) = (self.cfg.retain_pages, self.watermark_failed) {
            // What pooled_bytes counts, slabs of retired objects included.
            assert!(
                s["pooled_bytes"] <= r * c,
                "{what}: pooled_bytes {} above retain_bytes {}",
                s["pooled_bytes"],
                r * c
            );
        }
        assert_eq!(self.fd.live_chunks() as u64, (s["mapped_bytes"] + s["pooled_bytes"]) / c, "{what}: chunks");
        assert_eq!(self.fd.live_mappings() as u64, snap.mapped_pages(), "{what}: driver mappings vs mapped pages");
        let inner = match &self.probe {
            Probe::Host(d) => Some((d.live_chunks(), d.live_mappings(), d.released_but_mapped())),
            Probe::Mock(d) => Some((d.live_chunks(), d.live_mappings(), d.released_but_mapped())),
            Probe::None => None,
        };
        // No chunk given back while still mapped (its memory would outlive
        // the release).
        let inner = inner.map(|(chunks, mappings, released)| {
            assert_eq!(released, 0, "{what}: a chunk was released while still mapped");
            (chunks, mappings)
        });
        if let Some(inner) = inner {
            assert_eq!(inner, (self.fd.live_chunks(), self.fd.live_mappings()), "{what}: the driver's own count");
        }
        let stats = self.arena.stats().unwrap();
        assert_eq!(stats.mapped_bytes, s["mapped_bytes"]);
        assert_eq!(stats.pooled_bytes, s["pooled_bytes"]);
        assert_eq!(stats.free_va_bytes, s["free_va_bytes"]);
        assert_eq!(stats.shared_bytes, s["shared_bytes"]);

        // Moves: the callback's events chain each id from its old address
        // to its new one.
        let events: Vec<MoveEvent> = std::mem::take(&mut *self.events.lock().unwrap());
        assert_eq!(s["moves"] - self.moves, events.len() as u64, "{what}: one event per counted move");
        self.moves = s["moves"];
        let mut now: BTreeMap<Id, u64> = self.live.iter().map(|(&id, m)| (id, m.ptr)).collect();
        for e in &events {
            assert!(may_move.contains(&e.id), "{what}: {} moved but was not allowed to: {e:?}", e.id);
            let cur = now.get_mut(&e.id).unwrap_or_else(|| panic!("{what}: event for a dead id {e:?}"));
            assert_eq!(e.old_ptr, *cur, "{what}: event's old address is not the last known one");
            assert_ne!(e.old_ptr, e.new_ptr);
            // The size at the moment of the move: a resized allocation may
            // move (with its slab) before its size changes.
            let ok_size = e.size == self.live[&e.id].size
                || self.resized == Some((e.id, e.size))
                || self.resized_many.contains(&(e.id, e.size));
            assert!(ok_size, "{what}: event size {e:?}");
            *cur = e.new_ptr;
        }
        // Who shares with whom, as the model's chunks say: the awake
        // holders of each model chunk (`awake_holders`, for every chunk at
        // once).
        let mut holders: BTreeMap<u64, Vec<Id>> = BTreeMap::new();
        for (&id, m) in self.live.iter().filter(|(_, m)| !m.asleep) {
            for &k in &m.chunks {
                holders.entry(k).or_default().push(id);
            }
        }
        let sharers: BTreeMap<Id, (u64, BTreeSet<u64>)> = self
            .live
            .iter()
            .filter(|(_, m)| !m.asleep && !m.small)
            .map(|(&id, m)| {
                let mut pages = 0;
                let mut with = BTreeSet::new();
                for k in &m.chunks {
                    let mut others = holders[k].iter().filter(|&&o| o != id).map(|o| o.get()).peekable();
                    pages += u64::from(others.peek().is_some());
                    with.extend(others);
                }
                (id, (pages * c, with))
            })
            .collect();
        let by_id = snap.live_by_id();
        let mut small_extents = Vec::new();
        let mut pinned_slabs = Vec::new();
        let raw = self.backend == Backend::Host;
        for (&id, m) in self.live.iter_mut() {
            let info = self.arena.query(id).unwrap();
            assert_eq!((info.size, info.pinned, info.growable), (m.size, m.pinned, m.growable), "{what}: {id}");
            assert_eq!((info.tag, info.asleep), (m.tag, m.asleep), "{what}: {id}");
            match by_id.get(&id.get()) {
                Some(r) => {
                    assert!(!m.small, "{what}: small {id} has chunks of its own");
                    assert_eq!((info.ptr, info.reserved_bytes, info.mapped_bytes), (r.addr, r.bytes, r.mapped_bytes));
                    assert_eq!((r.size, r.pinned, r.growable), (m.size, m.pinned, m.growable), "{what}: {id}");
                    let (shared, with) = sharers.get(&id).cloned().unwrap_or_default();
                    assert_eq!(r.shared_bytes, shared, "{what}: shared bytes of {id}");
                    assert_eq!(
                        r.shares_with.iter().copied().collect::<BTreeSet<u64>>(),
                        with,
                        "{what}: sharers of {id}"
                    );
                }
                None => {
                    assert!(m.small, "{what}: live {id} missing from the snapshot");
                    let slab =
                        snap.slab_at(info.ptr).unwrap_or_else(|| panic!("{what}: small {id} outside every slab"));
                    assert_eq!(info.reserved_bytes, slab.class_bytes, "{what}: small {id} reserves its class");
                    assert!(info.size <= slab.class_bytes);
                    assert_eq!((info.ptr - slab.addr) % slab.class_bytes, 0, "{what}: small {id} on a boundary");
                    assert!(!m.pinned || slab.pinned, "{what}: the slab of a pinned object is pinned");
                    if m.pinned {
                        pinned_slabs.push(slab.addr);
                    }
                    small_extents.push((info.ptr, info.reserved_bytes));
                }
            }
            assert_eq!(info.ptr, now[&id], "{what}: {id} changed address without (or unlike) a move event");
            assert!(!(m.pinned && info.ptr != m.ptr), "{what}: pinned {id} moved");
            m.ptr = info.ptr;
            m.reserved = info.reserved_bytes;
            if m.asleep {
                continue; // its bytes are verified when it wakes
            }
            m.stamps.verify(&self.arena, id, what);
            if raw {
                // SAFETY: host backend; `m.ptr` is the allocation's current
                // address (queried just now), every stamp lies below its
                // size, and this thread is the arena's only user.
                unsafe { m.stamps.verify_raw(m.ptr, what) };
            }
        }
        for slab in snap.slabs() {
            assert_eq!(
                slab.pinned,
                pinned_slabs.contains(&slab.addr),
                "{what}: a slab is pinned iff an object in it is"
            );
        }
        self.check_old_addresses(what, &snap, &events);
        small_extents.sort_unstable();
        for w in small_extents.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0, "{what}: small allocations overlap: {w:?}");
        }
        assert_eq!(by_id.len(), self.live.values().filter(|m| !m.small).count(), "{what}: unknown allocations");
        self.snap = snap;
    }

    /// Old addresses of moved allocations stay readable, with the bytes
    /// they had, until the arena releases retired memory — which only the
    /// operations that need address space (and `release_retired`) may do.
    fn check_old_addresses(&mut self, what: &str, snap: &Snap, events: &[MoveEvent]) {
        let c = self.c;
        for e in events {
            let Some(m) = self.live.get(&e.id) else { continue };
            // Moves by remapping only: a small object's copy leaves a
            // retired object, not an alias, and slabs' objects churn.
            if m.small || e.old_ptr % c != 0 || !snap.retired_covers(e.old_ptr, c) {
                continue;
            }
            let batch_old = self.resized_many.iter().find(|&&(id, _)| id == e.id).map(|&(_, old)| old);
            let len = match (self.resized, batch_old) {
                (Some((id, old)), _) if id == e.id => old.min(e.size),
                (_, Some(old)) => old.min(e.size),
                _ => e.size,
            };
            self.views.push((e.id, e.old_ptr, len));
        }
        let may_release = matches!(
            what,
            "alloc"
                | "alloc_shared"
                | "resize"
                | "resize_on_stream"
                | "resize_many"
                | "wake"
                | "compact"
                | "release_retired"
                | "sleep"
                | "set_tag" // a small allocation's new slab needs address space
                | "prepare_alloc"
                | "prepare_resize"
                | "teardown"
        );
        let mut kept = Vec::new();
        for (id, old_ptr, len) in std::mem::take(&mut self.views) {
            let Some(m) = self.live.get(&id) else { continue };
            // Bytes beyond a shrink are no longer the allocation's, anywhere.
            let len = len.min(m.size);
            if !snap.retired_covers(old_ptr, len.div_ceil(c) * c) {
                assert!(may_release, "{what}: released the old range {old_ptr:#x} of live {id}");
                continue;
            }
            if self.backend == Backend::Host && !m.asleep {
                // SAFETY: host backend; the pages below `len` at `old_ptr` are
                // in retired ranges (checked just above), which stay mapped,
                // and this thread is the arena's only user.
                unsafe { m.stamps.verify_raw_below(old_ptr, len, &format!("{what}: old address of {id}")) };
            }
            kept.push((id, old_ptr, len));
        }
        self.views = kept;
    }

    /// Whether an out-of-address-space for `n` pages is justified, given the
    /// state before the call and the allocations that may not move.
    pub(super) fn oas_justified(&self, n: u64, immovable: impl Fn(u64, bool) -> bool) -> bool {
        let free = self.snap.free_after_release();
        if n > self.cfg.reserve_pages {
            return true;
        }
        if self.cfg.no_implicit_moves {
            return free.iter().all(|&(_, l)| l < n);
        }
        let live: Vec<(u64, u64, bool)> =
            self.snap.live_pages().into_iter().map(|(id, s, l, pinned)| (s, l, immovable(id, pinned))).collect();
        !evacuation_exists(self.cfg.reserve_pages, n, &free, &live)
    }
}
