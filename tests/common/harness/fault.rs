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
        let polls0 = event_looks(&self.arena);
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
                // which reads as not complete yet (polled again later), or
                // the destroy of a completed one (one event leaked).
                let s = self.arena.stats().unwrap();
                if self.fd.last_injected_into_a_poll_or_destroy() {
                    count("fault absorbed (an event poll or destroy)");
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
            Err(_) if self.fd.last_injected_into_a_poll_or_destroy() => {
                // A failed poll reads as "not complete yet", a failed
                // destroy leaks one event: the call went on and failed for
                // a reason of its own, judged as usual.
                count("fault absorbed (an event poll or destroy), the call failed otherwise");
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
                    let polled = self.backend == Backend::Cuda && event_looks(&self.arena) > polls0;
                    let pre = explained_by_event_polls(pre, &now, polled, self.c)
                        .unwrap_or_else(|why| panic!("{what}: a failed call changed the arena: {why}"));
                    assert_eq!(now, pre, "{what}: a failed call changed the arena");
                }
                assert!(self.events.lock().unwrap().is_empty(), "{what}: a failed call reported moves");
                self.check(what, &[]);
                (r, Faulted::RolledBack)
            }
        }
    }
}

/// Event polls and waits so far: a call that made any may have seen
/// stream events complete.
pub(super) fn event_looks(arena: &Arena) -> u64 {
    let s = arena.stats().unwrap();
    s.event_polls + s.event_waits
}

/// The snapshot from before a failed call, with the changes an event poll
/// or wait inside that call may have made applied, or why `now` differs
/// otherwise. Every arena call first polls its pending stream events (on a
/// GPU, the only backend here whose events can be pending), and a poll that
/// finds an event complete acts on it even if the call then fails. The
/// events this harness makes are those of `resize_on_stream` shrinks and
/// `quiesce_on_stream`; their completion makes cached pages known idle
/// (`idle_cached_bytes` grows, by whole chunks), and the old addresses
/// that same-stream reuse kept mapped for a completed event may be
/// unmapped by a call that looks at events, also one that then fails
/// (`deferred_unmap_pages` falls: housekeeping of pages no work uses). It
/// changes nothing else a snapshot shows. Anything else (another change, a
/// change with no poll, or in any other field) is left for the caller's
/// equality check to report.
pub(super) fn explained_by_event_polls(
    mut pre: Snap,
    now: &Snap,
    polled: bool,
    chunk: u64,
) -> std::result::Result<Snap, String> {
    const IDLE: &str = "idle_cached_bytes";
    // Old addresses whose event has completed (now, or at an earlier
    // call's poll) may be unmapped by any call that looks at events
    // (`stream_reuse::unmap_completed`, also before a failure): never more.
    if now.deferred_unmap_pages > pre.deferred_unmap_pages {
        return Err(format!(
            "deferred_unmap_pages went from {} to {}: a failed call only unmaps them",
            pre.deferred_unmap_pages, now.deferred_unmap_pages
        ));
    }
    pre.deferred_unmap_pages = now.deferred_unmap_pages;
    let (before, after) = (pre.stats[IDLE], now.stats[IDLE]);
    if after == before {
        return Ok(pre);
    }
    if !polled {
        return Err(format!("{IDLE} went from {before} to {after}, and the call polled no event"));
    }
    if after < before || (after - before) % chunk != 0 {
        return Err(format!("{IDLE} went from {before} to {after}: a completed event only adds whole chunks"));
    }
    pre.stats.insert(IDLE.into(), after);
    Ok(pre)
}
