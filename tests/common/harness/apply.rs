//! Applying an operation: the dispatch of every `Op` (an `Op::Faulty`
//! plans its failure for the operation it wraps), and the operations
//! simple enough to be judged where they are dispatched.

use vmm_arena::{Error, Id, Status};

use super::fault::Faulted;
use super::op::{tag_arg, Op};
use super::{count, Harness};

impl Harness {
    pub fn apply(&mut self, op: &Op) {
        match op {
            Op::Faulty(n, kind, inner) => {
                // Operations without driver calls run as they are.
                if matches!(
                    **inner,
                    Op::Pin(_)
                        | Op::Unpin(_)
                        | Op::Write(_)
                        | Op::BadId(_)
                        | Op::SetTag(..)
                        | Op::Unquiesce(_)
                        | Op::PrepareFree(_)
                        | Op::Faulty(..)
                ) {
                    return self.apply(inner);
                }
                self.fault = Some((*n, *kind));
                self.apply(inner);
                self.fault = None;
            }
            &Op::Alloc(size) => self.alloc(size, size, false, None),
            &Op::PrepareAlloc(size, max, growable) => self.prepare_alloc(size, max, growable),
            &Op::PrepareResize(i, size) => {
                if let Some(id) = self.nth(i) {
                    self.prepare_resize(id, size);
                }
            }
            &Op::PrepareFree(i) => {
                if let Some(id) = self.nth(i) {
                    self.prepare_free(id);
                }
            }
            &Op::Settle(i, commit) => self.settle(i, commit),
            &Op::AllocTagged(size, tag) => self.alloc(size, size, false, Some(tag)),
            &Op::AllocGrowable(size, max) => self.alloc(size, max, true, None),
            &Op::AllocShared { src, first, pages, extra } => self.alloc_shared(src, first, pages, extra),
            &Op::Free(i) => {
                let Some(id) = self.nth(i) else { return };
                let m = &self.live[&id];
                let (quiesced, alone) = (m.quiesced, self.mapped_alone(id, 0..m.chunks.len()));
                let idle0 = self.snap.stats["idle_cached_bytes"];
                let idle_checked = self.idle_checked();
                let (r, f) = self.call("free", false, |a| a.free(id));
                if let Faulted::RolledBack = f {
                    panic!("free failed with an injected failure: its give-back is best effort");
                }
                r.unwrap();
                let m = self.live.remove(&id).expect("live");
                count(match (m.asleep, m.chunks.iter().any(|&k| !self.awake_holders(k).is_empty())) {
                    (true, _) => "free asleep",
                    (false, true) => "free of a sharer",
                    (false, false) => "free",
                });
                if quiesced {
                    count("free of a quiesced allocation");
                }
                self.freed.push(id);
                assert_eq!(self.arena.free(id), Err(Error::UnknownAllocation(id.get())), "double free refused");
                assert_eq!(self.arena.query(id).unwrap_err().status(), Status::UnknownAllocation);
                self.ran_ok();
                self.check("free", &[]);
                if idle_checked {
                    // What it leaves cached is known idle iff it was quiesced.
                    let want = if quiesced { alone * self.c } else { 0 };
                    let now = self.snap.stats["idle_cached_bytes"];
                    assert!(now >= idle0, "free: made known-idle cached pages busy");
                    assert_eq!(now - idle0, want, "free: pages it left known idle (quiesced: {quiesced})");
                }
            }
            &Op::Resize(i, size) => {
                if let Some(id) = self.nth(i) {
                    self.resize(id, size, None);
                }
            }
            &Op::ResizeOnStream(i, size, stream) => {
                if let Some(id) = self.nth(i) {
                    self.resize(id, size, Some(stream));
                }
            }
            &Op::Quiesce(i, stream) => {
                if let Some(id) = self.nth(i) {
                    self.quiesce(id, stream);
                }
            }
            &Op::Unquiesce(i) => {
                let Some(id) = self.nth(i) else { return };
                self.arena.unquiesce(id).unwrap_or_else(|e| panic!("unquiesce of live {id}: {e}"));
                let m = self.live.get_mut(&id).unwrap();
                count(if std::mem::take(&mut m.quiesced) { "unquiesce ended a promise" } else { "unquiesce idle" });
                self.check("unquiesce", &[]);
            }
            &Op::Pin(i) | &Op::Unpin(i) => {
                let Some(id) = self.nth(i) else { return };
                let pin = matches!(op, Op::Pin(_));
                if pin && self.live[&id].asleep {
                    assert_eq!(self.arena.pin(id), Err(Error::Asleep(id.get())), "pin of a sleeper");
                    count("pin asleep");
                    return self.check("failed pin", &[]);
                }
                if pin { self.arena.pin(id) } else { self.arena.unpin(id) }.unwrap();
                self.live.get_mut(&id).unwrap().pinned = pin;
                assert_eq!(self.arena.query(id).unwrap().pinned, pin);
                self.check("pin", &[]);
            }
            Op::Compact => {
                let (r, f) = self.call("compact", false, |a| a.compact());
                if let Faulted::RolledBack = f {
                    return;
                }
                let report = r.unwrap();
                count(if report.moved_allocations > 0 { "compact moved" } else { "compact idle" });
                assert_eq!(report.largest_free_va_before, self.snap.stats["largest_free_va_bytes"]);
                let moved = self.movable_ids();
                let before = self.moves;
                self.ran_ok();
                self.check("compact", &moved);
                // A slab's move moves each of its objects (one event each).
                assert_eq!(self.moves - before, report.moved_allocations, "report counts every move, as events");
                assert_eq!(report.largest_free_va_after, self.snap.stats["largest_free_va_bytes"]);
                assert_eq!(self.snap.stats["retired_va_bytes"], 0, "compact releases the old ranges");
                assert!(
                    report.largest_free_va_after >= report.largest_free_va_before,
                    "compaction made the largest hole smaller: {report:?}"
                );
            }
            Op::ReleaseRetired => {
                let free_after = self.snap.free_after_release();
                let (r, f) = self.call("release_retired", false, |a| a.release_retired());
                if let Faulted::RolledBack = f {
                    return;
                }
                r.unwrap();
                count("release_retired");
                self.ran_ok();
                self.check("release_retired", &[]);
                assert_eq!(self.snap.stats["retired_va_bytes"], 0);
                assert_eq!(self.snap.free_pages(), free_after, "retired ranges become free");
            }
            &Op::Trim(keep) => {
                let c = self.c;
                let pooled = self.snap.stats["pooled_bytes"];
                let releases = self.arena.stats().unwrap().driver_releases;
                let (r, f) = self.call("trim", true, |a| a.trim(keep * c));
                if let Faulted::RolledBack = f {
                    return;
                }
                let released = r.unwrap();
                count("trim");
                self.ran_ok();
                self.check("trim", &[]);
                let now = self.snap.stats["pooled_bytes"];
                // What pooled_bytes counts, slabs of retired objects included.
                assert!(now <= keep * c, "trim keeps at most keep_bytes pooled: {now} > {}", keep * c);
                assert!(released <= pooled, "trim gave back more than was pooled");
                let s = self.arena.stats().unwrap();
                assert_eq!((s.driver_releases - releases) * c, released, "trim reports what it released");
                assert!(released >= pooled - now.min(pooled), "trim released less than the pool shrank");
            }
            &Op::Write(i) => {
                let Some(id) = self.nth(i) else { return };
                let m = &self.live[&id];
                if m.asleep {
                    assert_eq!(self.arena.write(id, 0, b"x"), Err(Error::Asleep(id.get())), "write to a sleeper");
                    let mut out = [0u8; 1];
                    assert_eq!(self.arena.read(id, 0, &mut out), Err(Error::Asleep(id.get())), "read of a sleeper");
                    count("write asleep");
                    return self.check("failed write", &[]);
                }
                if m.quiesced {
                    // The caller's promise: nothing goes through it until it
                    // grows. Its bytes are still checked (read) below.
                    count("write to a quiesced allocation skipped");
                    return self.check("write skipped", &[]);
                }
                let size = m.size;
                self.restamp(id, 0, size);
                self.check("write", &[]);
            }
            &Op::BadId(raw) => self.bad_id(raw),
            &Op::SetTag(i, tag) => {
                let Some(id) = self.nth(i) else { return };
                let m = self.live.get_mut(&id).unwrap();
                // Every allocation takes a tag; a small one in a slab of
                // another tag moves to a slab of the new one (a copy),
                // which a pinned or sleeping one refuses, and which needs
                // a slab's room.
                let moves = m.small && m.tag != tag;
                match self.arena.set_tag(id, tag) {
                    Ok(()) => {
                        assert!(!(moves && (m.pinned || m.asleep)), "a pinned or sleeping small allocation moved");
                        m.tag = tag;
                        count(match (m.small, moves, m.asleep) {
                            (true, true, _) => "set_tag small moved",
                            (true, false, _) => "set_tag small same tag",
                            (false, _, true) => "set_tag asleep",
                            (false, _, false) => "set_tag",
                        });
                    }
                    Err(e) => {
                        assert!(moves, "set_tag: {e}");
                        let expected = if m.pinned {
                            Status::Pinned
                        } else if m.asleep {
                            Status::Asleep
                        } else {
                            Status::OutOfMemory
                        };
                        let room = expected == Status::OutOfMemory && e.status() == Status::OutOfAddressSpace;
                        assert!(e.status() == expected || room, "set_tag of a small allocation: {e}");
                        count("set_tag small refused");
                    }
                }
                assert_eq!(self.arena.query(id).unwrap().tag, self.live[&id].tag);
                self.check("set_tag", &[id]);
            }
            Op::ResizeMany(picks) => self.resize_many(picks),
            &Op::Maintain { precreate, ahead } => self.maintain(precreate, ahead),
            &Op::Sleep(t, backup) => self.sleep(tag_arg(t), backup),
            &Op::Wake(t) => self.wake(tag_arg(t)),
        }
    }

    fn bad_id(&mut self, raw: u64) {
        let bad = match (raw % 3, self.freed.is_empty()) {
            (0, false) => self.freed[(raw / 3) as usize % self.freed.len()],
            // Made-up ids: a plain one, and one tagged as a small allocation's.
            (1, _) if raw % 2 == 0 => Id::from_raw(0xdead_0000_0001 + raw % 7).unwrap(),
            (1, _) => Id::from_raw((1 << 63) | (0x0bad_0000_0001 + raw % 7)).unwrap(),
            _ => match Id::from_raw(raw) {
                Some(id) => id,
                None => return,
            },
        };
        if self.live.contains_key(&bad) {
            return;
        }
        count("bad id refused");
        let c = self.c;
        for e in [
            self.arena.free(bad).unwrap_err(),
            self.arena.resize(bad, 1).unwrap_err(),
            self.arena.pin(bad).unwrap_err(),
            self.arena.query(bad).unwrap_err(),
            self.arena.write(bad, 0, b"x").unwrap_err(),
            self.arena.set_tag(bad, 1).unwrap_err(),
            self.arena.alloc_shared(bad, 0, c, c).unwrap_err(),
            self.arena.quiesce_on_stream(bad, 0).unwrap_err(),
            self.arena.unquiesce(bad).unwrap_err(),
        ] {
            assert_eq!(e, Error::UnknownAllocation(bad.get()));
        }
        self.check("bad id", &[]);
    }
}
