//! Two-phase operations (`prepare_alloc`, `prepare_resize`, `prepare_free`,
//! then `commit` or `abort`), interleaved with every other operation, with
//! the protocol's guarantee as the invariant:
//! - a prepare's outcome is predicted (the call's own arguments first:
//!   a small id, a size beyond the reservation, a shrink that would unmap
//!   chunks another awake allocation shares; then `Asleep`; a growth is a
//!   resize inside the reservation, out of memory only beyond the
//!   capacity), and a failed prepare leaves the arena as it was;
//! - a commit or abort of an operation whose allocation no other call
//!   changed since (the same size, awake, and for a shrink no newly shared
//!   chunk to drop) succeeds, whatever driver call fails in it (injected
//!   failures included: it makes none that can fail the call);
//! - after another call changed the allocation, it returns `Stale` and the
//!   arena is exactly as it was.

use vmm_arena::{Error, Id, Prepared, Status};

use super::super::common::Stamps;
use super::fault::Faulted;
use super::model::Model;
use super::{count, Harness};

/// What a pending prepared operation did, and the size it left.
#[derive(Clone, Copy, Debug)]
pub(super) enum Kind {
    Alloc,
    Grow { old: u64 },
    Shrink { to: u64 },
    Free,
}

pub(super) struct Pending {
    pub(super) prepared: Prepared,
    pub(super) kind: Kind,
    pub(super) id: Id,
    /// The allocation's size when the prepare returned.
    pub(super) size: u64,
    /// Whether it was asleep then (only a free may be prepared of a sleeper).
    pub(super) asleep: bool,
}

fn small_id(id: Id) -> bool {
    id.get() >> 63 == 1
}

impl Harness {
    /// Whether shrinking growable `id` to `to` bytes would drop a page whose
    /// chunk another awake allocation maps (the arena unmaps its page of it
    /// at once, a driver call a commit must not make).
    fn shrink_drops_shared(&self, id: Id, to: u64) -> bool {
        let m = &self.live[&id];
        let np = self.pages(to) as usize;
        m.growable
            && !m.asleep
            && np < m.chunks.len()
            && m.chunks[np..].iter().any(|&k| self.awake_holders(k).iter().any(|&(o, _)| o != id))
    }

    pub(super) fn prepare_alloc(&mut self, size: u64, max: u64, growable: bool) {
        if !growable && max != size {
            let e = self.arena.prepare_alloc(size, max, growable).unwrap_err();
            assert_eq!(e.status(), Status::InvalidArgument, "prepare_alloc, max_size > size, fixed: {e}");
            count("prepare_alloc refused a reservation without growth");
            return self.check("failed prepare_alloc", &[]);
        }
        let (np, obtainable) = (self.pages(size), self.obtainable());
        let (r, f) = self.call("prepare_alloc", false, |a| a.prepare_alloc(size, max, growable));
        if let Faulted::RolledBack = f {
            return;
        }
        match r {
            Ok((prepared, ptr)) => {
                count("prepare_alloc ok");
                assert!(np <= obtainable, "prepare_alloc of {np} pages beyond the capacity");
                assert_eq!(ptr % self.c, 0, "prepare_alloc places whole chunks");
                let id = prepared.id();
                assert!(!small_id(id), "prepare_alloc made a small allocation");
                let chunks = self.fresh_chunks(np);
                let m = Model {
                    size,
                    growable,
                    pinned: false,
                    small: false,
                    ptr,
                    reserved: 0,
                    stamps: Stamps::default(),
                    tag: 0,
                    asleep: false,
                    chunks,
                    slept: None,
                    quiesced: false,
                };
                assert!(self.live.insert(id, m).is_none(), "id {id} issued twice");
                self.restamp(id, 0, size);
                self.pending.push(Pending { prepared, kind: Kind::Alloc, id, size, asleep: false });
                self.ran_ok();
                // A prepare moves nothing.
                self.check("prepare_alloc", &[]);
            }
            Err(e) => {
                match e.status() {
                    Status::OutOfMemory => assert!(np > obtainable, "prepare_alloc: {e}"),
                    // Only compaction would make room: a prepare moves nothing.
                    Status::OutOfAddressSpace => assert!(np <= obtainable, "prepare_alloc: {e}"),
                    _ => panic!("prepare_alloc failed with {e:?}"),
                }
                count("prepare_alloc refused");
                self.check("failed prepare_alloc", &[]);
            }
        }
    }

    pub(super) fn prepare_resize(&mut self, id: Id, new_size: u64) {
        let m = &self.live[&id];
        let reserved = self.arena.query(id).unwrap().reserved_bytes;
        let (size, asleep) = (m.size, m.asleep);
        let np = self.pages(new_size);
        let want = if small_id(id) || np * self.c > reserved {
            Some(Status::InvalidArgument)
        } else if asleep {
            Some(Status::Asleep)
        } else if new_size <= size && self.shrink_drops_shared(id, new_size) {
            Some(Status::InvalidArgument)
        } else {
            None
        };
        let need = np.saturating_sub(self.pages(size));
        let obtainable = self.obtainable();
        if new_size > size {
            self.resized = Some((id, size));
        }
        let (r, f) = self.call("prepare_resize", false, |a| a.prepare_resize(id, new_size));
        self.resized = None;
        if let Faulted::RolledBack = f {
            assert!(want.is_none() && new_size > size, "prepare_resize: only a growth makes driver calls");
            return;
        }
        match (r, want) {
            (Err(e), Some(status)) => {
                assert_eq!(e.status(), status, "prepare_resize of {id} to {new_size}: {e}");
                count("prepare_resize refused");
                self.check("failed prepare_resize", &[]);
            }
            (Err(e), None) => {
                assert_eq!(e.status(), Status::OutOfMemory, "prepare_resize of {id} to {new_size}: {e}");
                assert!(need > obtainable, "prepare_resize: out of memory with {obtainable} obtainable: {e}");
                count("prepare_resize out of memory");
                self.check("failed prepare_resize", &[]);
            }
            (Ok(_), Some(status)) => panic!("prepare_resize of {id} to {new_size} succeeded; expected {status:?}"),
            (Ok((prepared, ptr)), None) => {
                assert_eq!(ptr, self.live[&id].ptr, "a prepare does not move its allocation");
                let kind = if new_size > size {
                    count("prepare_resize grew");
                    self.model_resized(id, new_size, false);
                    Kind::Grow { old: size }
                } else {
                    count("prepare_resize shrink checked");
                    Kind::Shrink { to: new_size }
                };
                let now = self.live[&id].size;
                // Only a growth runs as an operation that applies the
                // retain watermark; a shrink's checks only read.
                if matches!(kind, Kind::Grow { .. }) {
                    self.ran_ok();
                }
                self.pending.push(Pending { prepared, kind, id, size: now, asleep: false });
                self.check("prepare_resize", &[]);
            }
        }
    }

    pub(super) fn prepare_free(&mut self, id: Id) {
        match self.arena.prepare_free(id) {
            Ok(prepared) => {
                assert!(!small_id(id), "prepare_free of a small allocation");
                count("prepare_free");
                let (size, asleep) = (self.live[&id].size, self.live[&id].asleep);
                count(if asleep { "prepare_free asleep" } else { "prepare_free awake" });
                self.pending.push(Pending { prepared, kind: Kind::Free, id, size, asleep });
            }
            Err(e) => {
                assert!(small_id(id) && e.status() == Status::InvalidArgument, "prepare_free of {id}: {e}");
                count("prepare_free refused");
            }
        }
        self.check("prepare_free", &[]);
    }

    /// Commits or aborts the `i`th pending operation.
    pub(super) fn settle(&mut self, i: usize, commit: bool) {
        if self.pending.is_empty() {
            return;
        }
        let Pending { prepared, kind, id, size, asleep } = self.pending.remove(i % self.pending.len());
        // The size the settle shrinks to, if it does.
        let shrink_to = match (kind, commit) {
            (Kind::Shrink { to }, true) => Some(to),
            (Kind::Grow { old }, false) => Some(old),
            _ => None,
        };
        let stale = match self.live.get(&id) {
            None => true,
            Some(m) => {
                m.asleep != asleep || m.size != size || shrink_to.is_some_and(|to| self.shrink_drops_shared(id, to))
            }
        };
        let what = if commit { "commit" } else { "abort" };
        let old_size = self.live.get(&id).map(|m| m.size);
        if let (Some(_), Some(old)) = (shrink_to, old_size) {
            self.resized = Some((id, old));
        }
        let (r, _) = self.call(what, false, |a| if commit { a.commit(prepared) } else { a.abort(prepared) });
        self.resized = None;
        if stale {
            match r {
                Err(Error::Stale(_)) => {}
                other => panic!("{what} of {kind:?} on {id} after another call changed it: {other:?}"),
            }
            count("two-phase stale");
            return self.check("stale settle", &[]);
        }
        r.unwrap_or_else(|e| panic!("{what} of {kind:?} on {id}, unchanged since its prepare, failed: {e}"));
        count(match (kind, commit) {
            (Kind::Alloc, true) => "commit alloc",
            (Kind::Alloc, false) => "abort alloc",
            (Kind::Grow { .. }, true) => "commit growth",
            (Kind::Grow { .. }, false) => "abort growth",
            (Kind::Shrink { .. }, true) => "commit shrink",
            (Kind::Shrink { .. }, false) => "abort shrink",
            (Kind::Free, true) => "commit free",
            (Kind::Free, false) => "abort free",
        });
        let frees = matches!((kind, commit), (Kind::Free, true) | (Kind::Alloc, false));
        // Those that act (a free or a shrink) apply the retain watermark;
        // the others only check.
        if frees || shrink_to.is_some() {
            self.ran_ok();
        }
        if frees {
            self.live.remove(&id).expect("live");
            self.freed.push(id);
            assert_eq!(self.arena.query(id).unwrap_err().status(), Status::UnknownAllocation);
        } else if let Some(to) = shrink_to {
            self.model_resized(id, to, false);
            assert_eq!(self.arena.query(id).unwrap().ptr, self.live[&id].ptr, "a settle moves nothing");
        }
        self.check(what, &[]);
    }
}
