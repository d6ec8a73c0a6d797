//! The C ABI target's `vmm_arena_resize_many` and `vmm_arena_maintain`
//! calls (a child of `c_abi.rs`, which dispatches to them).
//!
//! - resize_many of 1 to 4 picked ids: all or nothing, every byte
//!   included. A refusal leaves the snapshot as it was (but for chunks
//!   held for a later call, which any call may give back); the step's
//!   `check` then reads every tagged allocation's first and last byte (a
//!   failed batch that left a copy in a chunk it gave back to another
//!   allocation shows there).
//! - maintain with prefetch targets of 0 to 3 chunks each (set back to
//!   none after it): `check` holds the stats to their rules after it (the
//!   peak never goes down, the retain watermark holds).

use super::{ffi, st, strip_driver, Bytes, Harness, ASLEEP, INVALID, OK, OOAS, OOM, PINNED, UNKNOWN};

impl Harness {
    /// `vmm_arena_resize_many` of `n` picked ids and sizes: (status, allowed).
    pub(super) fn resize_many(&mut self, b: &mut Bytes<'_>, n: usize) -> (u32, Vec<u32>) {
        let ids: Vec<u64> = (0..n).map(|_| self.pick_id(b)).collect();
        let sizes: Vec<u64> = (0..n).map(|_| self.pick_size(b)).collect();
        let mut out = vec![0xA5A5u64; n];
        let before = strip_driver(&self.snapshot());
        let stats0 = self.stats();
        let injected0 = if self.faulty { self.calls().1 } else { 0 };
        // SAFETY: live handle; `ids` and `sizes` have `n` readable
        // elements, `out` `n` writable ones.
        let status =
            st(unsafe { ffi::vmm_arena_resize_many(self.a, ids.as_ptr(), sizes.as_ptr(), n, out.as_mut_ptr()) });
        let fired = self.faulty && self.calls().1 > injected0;
        let bad_size = sizes.iter().any(|&s| s == 0 || s.checked_add(self.chunk - 1).is_none());
        let twice = (1..n).any(|i| ids[..i].contains(&ids[i]));
        let live: Vec<Option<&super::Live>> = ids.iter().map(|id| self.live.get(id)).collect();
        let allowed = if bad_size || twice {
            vec![INVALID]
        } else if live.iter().any(Option::is_none) {
            vec![UNKNOWN, INVALID]
        } else if live.iter().flatten().any(|l| l.asleep) {
            vec![ASLEEP, INVALID]
        } else if live.iter().flatten().any(|l| l.pinned || self.exported.contains(&l.id)) {
            // (An allocation that had a DMA-BUF is pinned while one is open.)
            vec![OK, INVALID, OOM, OOAS, PINNED]
        } else {
            vec![OK, INVALID, OOM, OOAS]
        };
        if status == OK {
            for (&id, &size) in ids.iter().zip(&sizes) {
                let l = self.live.get_mut(&id).expect("live");
                l.size = size;
                // Its bytes past the old size are unknown, and its address
                // follows from the move events (checked in `check`).
                l.tag = None;
            }
        } else {
            assert!(out.iter().all(|&p| p == 0xA5A5), "resize_many: out-parameters written on failure");
            if !fired && self.reap_possible {
                // Chunks held for a later call (a freed allocation's last
                // DMA-BUF closed, or a committed free that could not give
                // them back) go back at any call, a refused one included:
                // only the live allocations are held to unchanged.
                let now = self.stats();
                assert_eq!(
                    (now.live_allocations, now.live_bytes),
                    (stats0.live_allocations, stats0.live_bytes),
                    "resize_many: a refused batch changed the live allocations"
                );
            } else if !fired {
                assert_eq!(strip_driver(&self.snapshot()), before, "resize_many: a refused batch changed the arena");
            }
        }
        (status, allowed)
    }

    /// `vmm_arena_maintain` with prefetch targets from the input.
    pub(super) fn maintain(&mut self, b: &mut Bytes<'_>) -> (u32, Vec<u32>) {
        let (pre, ahead) = (b.below(4) * self.chunk, b.below(4) * self.chunk);
        // SAFETY: live handle.
        let set = st(unsafe { ffi::vmm_arena_set_prefetch(self.a, pre, ahead) });
        assert_eq!(set, OK, "set_prefetch");
        // SAFETY: live handle.
        let status = st(unsafe { ffi::vmm_arena_maintain(self.a) });
        // SAFETY: live handle.
        let unset = st(unsafe { ffi::vmm_arena_set_prefetch(self.a, 0, 0) });
        assert_eq!(unset, OK, "set_prefetch back to none");
        (status, vec![OK])
    }
}
