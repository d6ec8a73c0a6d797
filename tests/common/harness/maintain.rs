//! Applying `maintain` (with prefetch targets) and judging it, with the
//! stats read *while it runs*: `maintain` makes its creates and maps
//! without the arena's lock, so the fault driver's observer, called at
//! the entry of each of those calls, reads the stats exactly as another
//! thread could at that moment — deterministically, with no thread. Every
//! such read must keep the stats' rules: `peak_physical_bytes` never goes
//! down and covers `mapped_bytes + pooled_bytes`, the pool stays under the
//! retain watermark, the footprint under the capacity.

use std::sync::{Arc, Mutex};

use vmm_arena::driver::CallKind;
use vmm_arena::Status;

use super::{count, Harness};

/// What the observer saw: the highest peak read, the reads, and the rules
/// broken (judged once `maintain` returns, outside the driver call).
#[derive(Default)]
struct Seen {
    peak: u64,
    reads: u64,
    broken: Vec<String>,
}

impl Harness {
    pub(super) fn maintain(&mut self, precreate: u64, ahead: u64) {
        let c = self.c;
        self.arena.set_prefetch(precreate * c, ahead * c).unwrap();
        // Admission windows as well, derived from the same two numbers (so
        // that the op's encoding stays): none when `ahead` is 0, else
        // `ahead` windows of `precreate + 1` chunks for reservations of 4.
        let windows = ahead as u32;
        self.arena.set_admission_prefetch(4 * c, (precreate + 1) * c, windows).unwrap();
        let before = self.arena.stats().unwrap();
        let seen = Arc::new(Mutex::new(Seen { peak: before.peak_physical_bytes, ..Seen::default() }));
        // The watermark is judged where the last operation left it kept and
        // no give-back fails meanwhile (a failure keeps chunks pooled).
        let retain = self.cfg.retain_pages.filter(|_| !self.watermark_failed).map(|r| r * c);
        let cap = self.cfg.cap_pages * c;
        let failures0 = before.release_failures;
        let observer = {
            let (arena, seen) = (Arc::downgrade(&self.arena), seen.clone());
            Arc::new(move |kind: CallKind| {
                // Only these are made outside the lock (a round's work); an
                // unmap or a release may be the watermark's, under it.
                if !matches!(kind, CallKind::Create | CallKind::Map) {
                    return;
                }
                let Some(a) = arena.upgrade() else { return };
                // A round's calls are made without the lock; a rollback's
                // maps (a failed give-back of the watermark) under it, where
                // no other thread can read the stats either: skipped.
                let Some(s) = a.try_stats().unwrap() else { return };
                let mut seen = seen.lock().unwrap();
                seen.reads += 1;
                if s.peak_physical_bytes < seen.peak {
                    let msg = format!("peak_physical_bytes went down to {} from {}", s.peak_physical_bytes, seen.peak);
                    seen.broken.push(msg);
                }
                seen.peak = seen.peak.max(s.peak_physical_bytes);
                let held = s.mapped_bytes + s.pooled_bytes;
                if s.peak_physical_bytes < held {
                    seen.broken
                        .push(format!("peak_physical_bytes {} below what is held, {held}", s.peak_physical_bytes));
                }
                if held > cap {
                    seen.broken.push(format!("{held} bytes held over the capacity {cap}"));
                }
                if let Some(r) = retain.filter(|_| s.release_failures == failures0) {
                    if s.pooled_bytes > r {
                        seen.broken.push(format!("pooled_bytes {} above retain_bytes {r}", s.pooled_bytes));
                    }
                }
            })
        };
        self.fd.set_observer(Some(observer));
        let planned = self.fault.take();
        if let Some((n, kind)) = planned {
            self.fd.fail_nth(None, n, kind);
        }
        let r = self.arena.maintain();
        let fired = planned.is_some() && !self.fd.pending();
        // A failed poll of a pending stream event (on a GPU) reads as "not
        // complete yet", a failed destroy leaks one event: absorbed, and
        // counted nowhere.
        let absorbed_poll = fired && self.fd.last_injected_into_a_poll_or_destroy();
        self.fd.clear();
        self.fd.set_observer(None);
        self.arena.set_prefetch(0, 0).unwrap();
        self.arena.set_admission_prefetch(0, 0, 0).unwrap();
        let after = self.arena.stats().unwrap();
        let seen = std::mem::take(&mut *seen.lock().unwrap());
        assert!(seen.broken.is_empty(), "maintain: read while it ran: {:?}", seen.broken);
        assert!(after.peak_physical_bytes >= seen.peak, "maintain: the peak went down once it returned");
        match r {
            Ok(()) => count(if seen.reads > 0 { "maintain, read while it ran" } else { "maintain idle" }),
            Err(e) => {
                // Only an injected failure; it is counted, and what the
                // rounds before it did stays done.
                assert!(fired, "maintain failed without an injected failure: {e}");
                assert!(!absorbed_poll, "maintain failed on a fault it absorbs: {e}");
                assert_eq!(e.status(), Status::Driver, "maintain: an out of memory is no error: {e}");
                count("maintain failed by a fault");
            }
        }
        if absorbed_poll {
            count("maintain: fault absorbed (an event poll or destroy)");
        } else if fired {
            let counted =
                after.maintain_failures > before.maintain_failures || after.release_failures > before.release_failures;
            assert!(counted, "maintain: an injected failure that fired is counted");
            self.absorbed_now = after.release_failures > before.release_failures;
        }
        self.ran_ok();
        self.check("maintain", &[]);
    }
}
