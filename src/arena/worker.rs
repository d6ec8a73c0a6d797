//! The background worker (`ArenaConfig::background`,
//! `VMM_ARENA_FLAG_BACKGROUND`): a thread of the arena's own that runs
//! [`maintain`](super::prefetch) whenever there may be work, so that chunk
//! creation, map-ahead and the reaping of stream-ordered frees happen off
//! the callers' threads.
//!
//! It sleeps on a condition variable. A caller's operation that may have
//! made work (growth used mapped-ahead or pooled chunks, a free, a
//! stream-ordered free) wakes it once, when it is waiting: a futex wake on
//! the caller's thread, never a driver call. While stream-ordered frees are
//! pending it also wakes every [`POLL_INTERVAL`] to poll their events (they
//! complete with no notification). When a `maintain` did nothing (the
//! targets are met, or out of reach under the capacity), it waits for the
//! next wake rather than spin. A driver failure counts in
//! `maintain_failures` (by `maintain`) and the worker goes on.
//!
//! `Drop` sets `stop_worker` under the lock, wakes it and joins it; the
//! worker checks the flag before every round, so it stops after at most the
//! round in progress.

use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::sync::thread;

use super::prefetch::maintain;
use super::Shared;

/// How often pending stream-ordered frees are polled while nothing else
/// wakes the worker.
const POLL_INTERVAL: Duration = Duration::from_micros(500);

/// Starts the worker on `sh`.
pub(super) fn start(sh: Arc<Shared>) -> Result<thread::JoinHandle<()>> {
    thread::Builder::new()
        .name("vmm-arena-worker".into())
        .spawn(move || work(&sh))
        .map_err(|e| Error::Internal(format!("the background worker could not start: {e}")))
}

/// Stops the worker and waits for it. Never panics.
pub(super) fn stop(sh: &Shared, handle: thread::JoinHandle<()>) {
    match sh.inner.lock() {
        Ok(mut g) => g.stop_worker = true,
        Err(p) => p.into_inner().stop_worker = true,
    }
    sh.work.notify_all();
    // A worker that panicked has nothing left to join; nothing to report.
    let _ = handle.join();
}

fn work(sh: &Shared) {
    let mut idle = false;
    loop {
        {
            let Ok(mut inner) = sh.inner.lock() else { return };
            if inner.stop_worker {
                return;
            }
            // Work made since the last look (an operation's, or
            // set_prefetch's): look again instead of sleeping.
            if idle && inner.st.prefetch_dirty {
                inner.st.prefetch_dirty = false;
                idle = false;
            }
            if idle {
                inner.worker_waiting = true;
                let poll = !inner.st.pending.is_empty();
                let woken = if poll {
                    sh.work.wait_timeout(inner, POLL_INTERVAL).map(|(g, _)| g).ok()
                } else {
                    sh.work.wait(inner).ok()
                };
                let Some(mut inner) = woken else { return };
                inner.worker_waiting = false;
                if inner.stop_worker {
                    return;
                }
            }
        }
        // Errors are counted by `maintain`; the worker carries on.
        idle = !matches!(maintain(sh), Ok(true));
    }
}
