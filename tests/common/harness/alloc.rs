//! Applying `alloc`, `alloc_growable` and `alloc_shared` to the arena and
//! the model, and judging their outcome.

use vmm_arena::{Error, Status};

use super::super::common::Stamps;
use super::fault::Faulted;
use super::model::Model;
use super::{adoption_calls, count, Harness};

impl Harness {
    /// `tag`: made with `alloc_tagged` (fixed-size only here).
    pub(super) fn alloc(&mut self, size: u64, max: u64, growable: bool, tag: Option<u32>) {
        let small = !growable && size <= self.small_max();
        // Pages the request needs at most (a small one: a new slab).
        let (np, nr) = if small { (1, 1) } else { (self.pages(size), self.pages(max)) };
        let obtainable = self.obtainable();
        // Adoption in place is judged only where no failure is planned.
        let (clean, over) = (self.fault.is_none(), self.over_watermark());
        let calls0 = adoption_calls(&self.snap, over);
        let (r, f) = self.call("alloc", false, |a| match (growable, tag) {
            (true, _) => a.alloc_growable(size, max),
            (false, Some(t)) => a.alloc_tagged(size, t),
            (false, None) => a.alloc(size),
        });
        if let Faulted::RolledBack = f {
            return;
        }
        match r {
            Ok((id, ptr)) => {
                if small && tag.is_some_and(|t| t != 0) {
                    count("alloc small tagged");
                }
                count(match (small, self.moved_so_far()) {
                    (true, 0) => "alloc small ok",
                    (false, 0) => "alloc ok",
                    _ => "alloc ok, after moving others",
                });
                assert!(np <= obtainable || small, "alloc of {np} pages succeeded beyond the capacity");
                assert_eq!(ptr % if small { 256 } else { self.c }, 0, "alignment of {size} bytes at {ptr:#x}");
                let chunks = if small { Vec::new() } else { self.fresh_chunks(np) };
                let m = Model {
                    size,
                    growable,
                    pinned: false,
                    small,
                    ptr,
                    reserved: 0,
                    stamps: Stamps::default(),
                    tag: tag.unwrap_or(0),
                    asleep: false,
                    chunks,
                    slept: None,
                    quiesced: false,
                };
                assert!(self.live.insert(id, m).is_none(), "id {id} issued twice");
                assert!(!self.freed.contains(&id), "id {id} reused");
                // A reservation inside a free range of cached chunks takes
                // them where they lie: no driver call at all.
                let reserved = self.arena.query(id).unwrap().reserved_bytes;
                let adopts = clean && !small && self.cached_free_covers(ptr, reserved);
                self.restamp(id, 0, size);
                let moved_others = if self.cfg.no_implicit_moves { vec![] } else { self.movable_ids() };
                self.ran_ok();
                self.check("alloc", &moved_others);
                if adopts {
                    count("alloc adopted cached chunks in place");
                    let calls = adoption_calls(&self.snap, over);
                    assert_eq!(calls, calls0, "alloc of {reserved} bytes at {ptr:#x} over cached chunks called the driver (creates, maps, unmaps, releases, access calls, syncs)");
                }
            }
            Err(e) => {
                count(match e.status() {
                    Status::OutOfMemory => "alloc out of memory",
                    _ => "alloc out of address space",
                });
                match e.status() {
                    Status::OutOfMemory => {
                        assert!(np > obtainable, "OutOfMemory for {np} pages while {obtainable} are obtainable: {e}")
                    }
                    Status::OutOfAddressSpace => {
                        assert!(np <= obtainable, "capacity short too: must be OutOfMemory");
                        assert!(
                            self.oas_justified(nr, |_, pinned| pinned),
                            "OutOfAddressSpace for {nr} pages though a window can be evacuated: {e}\n{:?}",
                            self.snap.ranges
                        );
                    }
                    _ => panic!("alloc failed with {e:?}"),
                }
                self.check("failed alloc", &[]);
            }
        }
    }

    pub(super) fn alloc_shared(&mut self, src_i: usize, first: u64, pages: u64, extra: u64) {
        let Some(src) = self.nth(src_i) else { return };
        let c = self.c;
        let m = &self.live[&src];
        let whole = if m.small { 0 } else { m.size / c };
        if whole == 0 {
            // Nothing of a whole chunk to share (a small allocation, or one
            // under a chunk): refused before any driver call.
            let e = self.arena.alloc_shared(src, 0, c, c).unwrap_err();
            assert_eq!(e.status(), Status::InvalidArgument, "alloc_shared of {src} without a whole chunk: {e}");
            count("alloc_shared invalid");
            return self.check("failed alloc_shared", &[]);
        }
        let first = first % whole;
        let pages = 1 + pages % (whole - first);
        let (bytes, max) = (pages * c, (pages + extra) * c);
        if m.asleep {
            assert_eq!(self.arena.alloc_shared(src, first * c, bytes, max), Err(Error::Asleep(src.get())));
            count("alloc_shared asleep");
            return self.check("failed alloc_shared", &[]);
        }
        let (r, f) = self.call("alloc_shared", false, |a| a.alloc_shared(src, first * c, bytes, max));
        if let Faulted::RolledBack = f {
            return;
        }
        match r {
            Ok((id, ptr)) => {
                count(if self.moved_so_far() == 0 {
                    "alloc_shared ok"
                } else {
                    "alloc_shared ok, after moving others"
                });
                assert_eq!(ptr % c, 0, "alignment of a share at {ptr:#x}");
                let m = &self.live[&src];
                let (lo, hi) = (first * c, first * c + bytes);
                let marks = m
                    .stamps
                    .marks
                    .iter()
                    .filter(|(o, b)| *o >= lo && o + b.len() as u64 <= hi)
                    .map(|(o, b)| (o - lo, b.clone()))
                    .collect();
                let share = Model {
                    size: bytes,
                    growable: true,
                    pinned: false,
                    small: false,
                    ptr,
                    reserved: 0,
                    stamps: Stamps { seed: 0, marks },
                    tag: 0,
                    asleep: false,
                    chunks: m.chunks[first as usize..(first + pages) as usize].to_vec(),
                    slept: None,
                    quiesced: false,
                };
                assert!(self.live.insert(id, share).is_none(), "id {id} issued twice");
                assert!(!self.freed.contains(&id), "id {id} reused");
                let moved_others = if self.cfg.no_implicit_moves { vec![] } else { self.movable_ids() };
                self.ran_ok();
                // The share reads src's bytes; then a write through it is
                // seen through src.
                self.check("alloc_shared", &moved_others);
                self.restamp(id, 0, c);
                self.check("write", &[]);
            }
            Err(e) => {
                count("alloc_shared out of address space");
                assert_eq!(e.status(), Status::OutOfAddressSpace, "alloc_shared creates no chunk: {e}");
                assert!(
                    self.oas_justified(pages + extra, |_, pinned| pinned),
                    "OutOfAddressSpace for a share of {} pages though a window can be evacuated: {e}",
                    pages + extra
                );
                self.check("failed alloc_shared", &[]);
            }
        }
    }
}
