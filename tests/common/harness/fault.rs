//! Injected driver failures: one arena call run with the planned failure,
//! and the judgment of one that fired (returned as the call's error with
//! the arena left exactly as it was, or absorbed by a give-back).

use vmm_arena::driver::fault::FaultKind;
use vmm_arena::{Arena, Status};

use super::super::common::{self, Snap};
use super::{count, Backend, Harness};

fn status_of(kind: FaultKind) -> Status {
    match kind {
        FaultKind::OutOfMemory => Status::OutOfMemory,
        FaultKind::Driver => Status::Driver,
    }
}

/// Whether an operation's injected failure fired, and how it ended.
pub(super) enum Faulted {
    /// No failure fired: judge the operation as usual.
    No,
    /// It fired and the operation failed with it: the arena was checked
    /// unchanged; the operation's handler stops.
    RolledBack,
}

impl Harness {
    /// Runs one arena call with the planned failure, if any.
    pub(super) fn call<T>(
        &mut self,
        what: &str,
        trim: bool,
        f: impl FnOnce(&Arena) -> vmm_arena::Result<T>,
    ) -> (vmm_arena::Result<T>, Faulted) {
        let Some((n, kind)) = self.fault.take() else { return (f(&self.arena), Faulted::No) };
        let failures0 = self.snap.stats["release_failures"];
        let polls0 = self.arena.stats().unwrap().event_polls;
        self.fd.fail_nth(None, n, kind);
        let r = f(&self.arena);
        let fired = !self.fd.pending();
        self.fd.clear();
        if !fired {
            count("fault planned beyond the operation's calls");
            return (r, Faulted::No);
        }
        match &r {
            Ok(_) => {
                // Only a give-back after the operation's own change may fail
                // without failing the call, and (on a GPU, the only backend
                // here whose events are pending) a poll of a pending event,
                // which reads as not complete yet (polled again later).
                let s = self.arena.stats().unwrap();
                if self.backend == Backend::Cuda && s.release_failures == failures0 && s.event_polls > polls0 {
                    count("fault absorbed (an event poll)");
                    return (r, Faulted::No);
                }
                count("fault absorbed (give-back kept pooled)");
                assert_eq!(
                    s.release_failures,
                    failures0 + 1,
                    "{what}: a fault that fired without failing the call is counted"
                );
                self.absorbed_now = true;
                (r, Faulted::No)
            }
            Err(e) => {
                assert_eq!(e.status(), status_of(kind), "{what}: the call fails with the injected failure: {e}");
                let now = Snap::of(&self.arena).without_driver_counters();
                let pre = self.snap.clone().without_driver_counters();
                if trim {
                    count("trim failed by a fault");
                    // Documented: released chunks stay released; nothing else changes.
                    // (Chunks cached in a growable's reservation tail are pooled: trim gives them back.)
                    let live = |s: &Snap| {
                        s.live().map(|r| common::Range { pooled_mapped_bytes: 0, ..r.clone() }).collect::<Vec<_>>()
                    };
                    assert_eq!(live(&now), live(&pre), "{what}: a failed trim changed an allocation");
                    assert!(now.stats["pooled_bytes"] <= pre.stats["pooled_bytes"]);
                } else {
                    count("operation rolled back after a fault");
                    assert_eq!(now, pre, "{what}: a failed call changed the arena");
                }
                assert!(self.events.lock().unwrap().is_empty(), "{what}: a failed call reported moves");
                self.check(what, &[]);
                (r, Faulted::RolledBack)
            }
        }
    }
}
