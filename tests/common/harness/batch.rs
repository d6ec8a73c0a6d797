//! Applying `resize_many` to the arena and the model, and judging its
//! outcome: all or nothing, every byte included. On any failure (an
//! injected one or the arena's own refusal) the arena must be exactly as
//! it was, and `check` then reads every live allocation's stamps: a batch
//! that failed after one request's copy landed in a chunk another request
//! gave up shows there.

use vmm_arena::{Error, Id, Status};

use super::super::common::Snap;
use super::fault::{event_looks, explained_by_event_polls, Faulted};
use super::{count, Backend, Harness};

impl Harness {
    /// `resize_many` of the `i`th live allocations (each at most once: a
    /// repeated pick is dropped) to the sizes given.
    pub(super) fn resize_many(&mut self, picks: &[(usize, u64)]) {
        let mut reqs: Vec<(Id, u64)> = Vec::new();
        for &(i, size) in picks {
            let Some(id) = self.nth(i) else { return };
            if !reqs.iter().any(|&(r, _)| r == id) {
                reqs.push((id, size));
            }
        }
        if reqs.is_empty() {
            return;
        }
        let asleep = reqs.iter().any(|(id, _)| self.live[id].asleep);
        // A lower bound on what the batch must find: growth of whole
        // chunks beyond what every shrink gives up (pages no other awake
        // allocation maps), under what is obtainable now.
        // (A small allocation moving to another class may need a new slab:
        // one page at most, counted only in the upper bound.)
        let (mut need, mut gives, mut slabs) = (0u64, 0u64, 0u64);
        for &(id, size) in &reqs {
            let m = &self.live[&id];
            let np = self.pages(size);
            if m.small {
                if size > m.reserved && size > self.small_max() {
                    need += np;
                } else if size > m.reserved {
                    slabs += 1;
                }
                continue;
            }
            let have = m.chunks.len() as u64;
            if np > have {
                need += np - have;
            } else {
                gives += self.mapped_alone(id, np as usize..have as usize);
            }
        }
        let obtainable = self.obtainable();
        let pre = self.snap.clone().without_driver_counters();
        let watermark_failed = self.watermark_failed;
        let polls0 = event_looks(&self.arena);
        self.resized_many = reqs.iter().map(|&(id, _)| (id, self.live[&id].size)).collect();
        let (r, f) = self.call("resize_many", false, |a| a.resize_many(&reqs));
        if let Faulted::RolledBack = f {
            self.resized_many.clear();
            // `call` checked the arena unchanged, every byte included.
            return count("resize_many rolled back after a fault");
        }
        match r {
            Ok(ptrs) => {
                assert!(!asleep, "resize_many resized a sleeper");
                assert_eq!(ptrs.len(), reqs.len());
                count(if reqs.len() > 1 { "resize_many" } else { "resize_many of one" });
                for (&(id, new_size), &ptr) in reqs.iter().zip(&ptrs) {
                    self.batch_member_resized(id, new_size);
                    assert_eq!(self.arena.query(id).unwrap().ptr, ptr, "resize_many: the address it returned");
                }
                let moved = self.movable_ids();
                self.ran_ok();
                self.check("resize_many", &moved);
            }
            Err(e) => {
                count(match e.status() {
                    Status::OutOfMemory => "resize_many out of memory",
                    Status::OutOfAddressSpace => "resize_many out of address space",
                    Status::Pinned => "resize_many pinned",
                    Status::Asleep => "resize_many asleep",
                    _ => "resize_many refused",
                });
                match &e {
                    Error::Asleep(raw) => {
                        assert!(reqs.iter().any(|(id, _)| id.get() == *raw && self.live[id].asleep), "{e}")
                    }
                    Error::OutOfMemory(_) => {
                        assert!(
                            need + slabs > obtainable + gives,
                            "resize_many: OutOfMemory though the capacity covers it: {e}"
                        )
                    }
                    Error::Pinned(raw) => {
                        assert!(reqs.iter().any(|(id, _)| id.get() == *raw && self.live[id].pinned), "{e}")
                    }
                    Error::OutOfAddressSpace(_) => {}
                    _ => panic!("resize_many failed with {e:?}"),
                }
                // All or nothing: the books, and (in `check`) every byte;
                // only an event poll inside the call may have made cached
                // pages known idle (on CUDA, where events can be pending).
                if !watermark_failed {
                    let now = Snap::of(&self.arena).without_driver_counters();
                    let polled = self.backend == Backend::Cuda && event_looks(&self.arena) > polls0;
                    let pre = explained_by_event_polls(pre, &now, polled, self.c)
                        .unwrap_or_else(|why| panic!("a failed resize_many changed the arena: {why}"));
                    assert_eq!(now, pre, "a failed resize_many changed the arena");
                }
                assert!(self.events.lock().unwrap().is_empty(), "a failed resize_many reported moves");
                self.check("failed resize_many", &[]);
            }
        }
        self.resized_many.clear();
    }

    /// The model of one request of a successful batch (as `resize` models
    /// a successful resize).
    fn batch_member_resized(&mut self, id: Id, new_size: u64) {
        let small_max = self.small_max();
        let m = &self.live[&id];
        let still_small = m.small && (new_size <= m.reserved || new_size <= small_max);
        self.model_resized(id, new_size, still_small);
    }

    /// The books of a successful resize of `id` to `new_size` (`still_small`:
    /// it stays in a slab): its size, its quiesce promise (growth of whole
    /// chunks ends it), its chunks (a shrink drops the tail, growth adds
    /// new ones, a small allocation promoted to chunks gets new ones: its
    /// bytes were copied), and stamps on its new bytes (none through a
    /// quiesced allocation).
    pub(super) fn model_resized(&mut self, id: Id, new_size: u64, still_small: bool) {
        let np = self.pages(new_size);
        let m = self.live.get_mut(&id).unwrap();
        let old_size = m.size;
        let grew = !m.small && new_size > old_size;
        m.size = new_size;
        m.small = still_small;
        m.quiesced &= !grew;
        let write_new = new_size > old_size && !m.quiesced;
        m.stamps.truncate(old_size.min(new_size));
        let have = m.chunks.len() as u64;
        if still_small {
            m.chunks.clear();
        } else if np < have {
            m.chunks.truncate(np as usize);
        } else if np > have {
            let more = self.fresh_chunks(np - have);
            self.live.get_mut(&id).unwrap().chunks.extend(more);
        }
        if write_new {
            self.restamp(id, old_size, new_size);
        }
    }
}
