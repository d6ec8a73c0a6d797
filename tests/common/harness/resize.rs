//! Applying `resize`, `resize_on_stream` (the same model) and
//! `quiesce_on_stream` to the arena and the model, and judging their
//! outcome.

use vmm_arena::{Arena, Error, Id, Status};

use super::super::common::Growth;
use super::fault::Faulted;
use super::{adoption_calls, count, Backend, Harness};

impl Harness {
    /// `resize`, or `resize_on_stream` on `stream`: the same model.
    pub(super) fn resize(&mut self, id: Id, new_size: u64, stream: Option<u64>) {
        let what = if stream.is_some() { "resize_on_stream" } else { "resize" };
        let call = move |a: &Arena| match stream {
            None => a.resize(id, new_size),
            Some(s) => a.resize_on_stream(id, new_size, s),
        };
        let m = &self.live[&id];
        if m.asleep {
            // Refused before any driver call: a planned failure cannot fire.
            assert_eq!(call(&self.arena), Err(Error::Asleep(id.get())), "{what} of a sleeper");
            count("resize asleep");
            return self.check("failed resize", &[]);
        }
        let (old_size, old_ptr, reserved, pinned, growable, small, quiesced) =
            (m.size, m.ptr, m.reserved, m.pinned, m.growable, m.small, m.quiesced);
        // A shrink's dropped pages that no one else maps: left cached, and
        // known idle if the allocation is quiesced (see `idle_checked`).
        let (np, have) = (self.pages(new_size), m.chunks.len());
        let dropped_alone = if np < have as u64 { self.mapped_alone(id, np as usize..have) } else { 0 };
        let idle0 = self.snap.stats["idle_cached_bytes"];
        let idle_checked = np <= have as u64 && self.idle_checked();
        let obtainable = self.obtainable();
        let mut growth: Option<Growth> = None;
        // What the resize needs: whether it must move, the pages a new place
        // needs at most, and whether that place is a small one.
        let (needs_move, need_pages, window, to_small) = if small {
            let needs_move = new_size > reserved;
            let to_small = new_size <= self.small_max();
            let need = match (needs_move, to_small) {
                (false, _) => 0,
                (true, true) => 1,
                (true, false) => self.pages(new_size),
            };
            (needs_move, need, if to_small { 1 } else { self.pages(new_size) }, to_small)
        } else {
            let (backed, np) = (self.pages(old_size), self.pages(new_size));
            let start = (old_ptr - self.snap.base) / self.c;
            let g = Growth::of(
                &self.snap,
                id.get(),
                start,
                reserved / self.c,
                np,
                self.cfg.reserve_pages,
                self.cfg.no_implicit_moves,
            );
            growth = Some(g);
            (g.must_move(), np.saturating_sub(backed), np, false)
        };
        // Growth within a reservation whose tail holds a cached chunk on
        // every page adopts them where they lie (judged where no failure
        // is planned).
        let tail_cached = !small
            && new_size > old_size
            && self.fault.is_none()
            && self.backend != Backend::Cuda
            && self.snap.live().any(|r| {
                r.id == id.get()
                    && r.mapped_bytes + r.pooled_mapped_bytes == r.bytes
                    && self.pages(new_size) * self.c <= r.bytes
            });
        let over = self.over_watermark();
        let calls0 = adoption_calls(&self.snap, over);
        self.resized = Some((id, old_size));
        let (r, f) = self.call(what, false, call);
        if let Faulted::RolledBack = f {
            self.resized = None;
            return;
        }
        match r {
            Ok(ptr) => {
                count(match (needs_move, self.moved_so_far()) {
                    (false, _) => "resize in place",
                    (true, 1) if small => "resize small by copying",
                    (true, 1) => "resize by moving",
                    (true, _) => "resize by moving, after moving others",
                });
                // (Where the oracle cannot decide whether the neighbours can
                // move away, the address check below still holds it to account.)
                let undecided = growth.is_some_and(|g| g.undecided);
                assert!(!(needs_move && pinned) || undecided, "a pinned allocation grew where it had to move");
                if !small {
                    assert!(need_pages <= obtainable, "grew beyond the capacity");
                }
                if !needs_move && growth.map_or(true, |g| g.stays) {
                    assert_eq!(ptr, old_ptr, "growth within the reservation (or shrinking) must not move");
                }
                if pinned {
                    assert_eq!(ptr, old_ptr, "a pinned allocation grows in place or not at all");
                }
                let shrank = !small && np < self.pages(old_size);
                // Only a GPU records an event: for a shrink of whole chunks
                // whose pages no promise of no more work covers already.
                if stream.is_some() && self.backend == Backend::Cuda && shrank && !quiesced {
                    self.stream_shrinks += 1;
                }
                if stream.is_some() && shrank {
                    count("resize_on_stream shrank whole chunks");
                }
                if shrank && quiesced {
                    count("shrink of a quiesced allocation");
                }
                // Growth ends the promise, within its pages too (new bytes are
                // for new work).
                let grew = !small && new_size > old_size;
                if grew && quiesced {
                    count("quiesced allocation grew");
                }
                let still_small = small && (to_small || !needs_move);
                self.model_resized(id, new_size, still_small);
                let info = self.arena.query(id).unwrap();
                assert_eq!(info.ptr, ptr);
                assert!(info.reserved_bytes >= new_size, "after a resize the reservation covers the size");
                if growable && !needs_move {
                    assert!(info.reserved_bytes >= reserved, "shrinking a growable keeps its reservation");
                }
                let moved: Vec<Id> = if self.cfg.no_implicit_moves { vec![id] } else { self.movable_ids() };
                // Neighbours may move out of the way unless it grows into
                // free (or retired) pages.
                let others_may_move = growth.map_or(needs_move, |g| !g.stays);
                let moved = if others_may_move { moved } else { vec![] };
                self.ran_ok();
                self.check(what, &moved);
                if tail_cached {
                    count("growth adopted its cached tail");
                    assert_eq!(ptr, old_ptr, "{what}: growth into a cached tail moved");
                    assert_eq!(
                        adoption_calls(&self.snap, over),
                        calls0,
                        "{what}: growth of {id} into its cached tail called the driver"
                    );
                }
                if idle_checked {
                    let want = if quiesced { dropped_alone * self.c } else { 0 };
                    let now = self.snap.stats["idle_cached_bytes"];
                    assert!(now >= idle0, "{what}: a shrink made known-idle cached pages busy");
                    assert_eq!(now - idle0, want, "{what}: pages a shrink left known idle (quiesced: {quiesced})");
                }
            }
            Err(e) => {
                count(match e.status() {
                    Status::Pinned => "resize pinned",
                    Status::OutOfMemory => "resize out of memory",
                    _ => "resize out of address space",
                });
                match e.status() {
                    Status::Pinned => assert!(pinned && needs_move, "Pinned error though no move was needed: {e}"),
                    Status::OutOfMemory => {
                        let undecided = growth.is_some_and(|g| g.undecided);
                        assert!(!(pinned && needs_move) || undecided, "must be Pinned first");
                        assert!(need_pages > obtainable, "OutOfMemory though capacity covers it: {e}")
                    }
                    Status::OutOfAddressSpace => {
                        assert!(needs_move && !pinned && need_pages <= obtainable, "unexpected {e:?}");
                        let me = id.get();
                        // Chunks grow in place or move themselves: they may
                        // not be moved away to make room. A small one's slab
                        // may.
                        assert!(
                            self.oas_justified(window, |other, pinned| pinned || (other == me && !small)),
                            "OutOfAddressSpace growing to {window} pages though a window can be evacuated: {e}\n{:?}",
                            self.snap.ranges
                        );
                    }
                    _ => panic!("resize failed with {e:?}"),
                }
                self.check("failed resize", &[]);
            }
        }
        self.resized = None;
    }

    /// `quiesce_on_stream`: `Ok` for every awake allocation (a small one's
    /// and a repeated call's change nothing), `Asleep` for a sleeper; the
    /// promise holds until the allocation grows or sleeps.
    pub(super) fn quiesce(&mut self, id: Id, stream: u64) {
        let m = &self.live[&id];
        let (asleep, small, again) = (m.asleep, m.small, m.quiesced);
        let q0 = self.arena.stats().unwrap().quiesces;
        if asleep {
            // Refused before any driver call: a planned failure cannot fire.
            assert_eq!(self.arena.quiesce_on_stream(id, stream), Err(Error::Asleep(id.get())), "quiesce of a sleeper");
            count("quiesce asleep");
            assert_eq!(self.arena.stats().unwrap().quiesces, q0, "quiesce of a sleeper counted");
            return self.check("failed quiesce", &[]);
        }
        let (r, f) = self.call("quiesce_on_stream", false, |a| a.quiesce_on_stream(id, stream));
        if let Faulted::RolledBack = f {
            // (`call` checked that nothing changed, the count included.)
            return count("quiesce rolled back after a fault");
        }
        r.unwrap_or_else(|e| panic!("quiesce_on_stream of awake {id}: {e}"));
        count(match (small, again) {
            (true, _) => "quiesce small",
            (false, true) => "quiesce again",
            (false, false) => "quiesce",
        });
        // One event at most: only a GPU records one, and only for a promise
        // that does not hold already (of an allocation of whole chunks).
        let counted = self.arena.stats().unwrap().quiesces - q0;
        let want = u64::from(self.backend == Backend::Cuda && !small && !again);
        assert_eq!(counted, want, "quiesce_on_stream of {id} (small {small}, again {again}) counted {counted}");
        self.quiesces += want;
        if !small {
            self.live.get_mut(&id).unwrap().quiesced = true;
        }
        self.ran_ok();
        self.check("quiesce_on_stream", &[]);
    }
}
