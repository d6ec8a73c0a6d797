//! `quiesce_on_stream`: the caller's promise that no more device work uses
//! an allocation, which lets the pages it gives up later be known idle at
//! once.
//!
//! A finished request's KV kept as a prefix-cache entry is the case this is
//! for: nothing reads or writes it through its own addresses again (a new
//! request that reuses its prefix maps its chunks at another address, with
//! `alloc_shared`), but the arena cannot know that. Without the promise,
//! the pages an eviction frees are known idle only once an event recorded
//! *at the eviction* completes, and an eviction is made when memory is
//! needed now: the arena must wait for that event, or synchronize before
//! it unmaps the pages. With it, the event is the one recorded when the
//! request finished, long complete by then.
//!
//! The promise is kept in `Alloc::quiet`: `After(event)` until the event is
//! seen complete (a `Held::Quiet` entry among the pending events, polled
//! like every other), then `Yes`. Pages the allocation gives up (a free, a
//! shrink, the old range of a move) become idle at once under `Yes`, and
//! under `After` are listed in `State::pending_idle` with the event, so
//! they become idle when it completes. Growth (any larger size, batched
//! by `resize_many` too) ends the promise (it is for new work), and so do
//! sleep (waking restores the bytes), `unquiesce`, and a stream free
//! (whose own event covers everything).

use crate::error::{Error, Result};
use crate::Id;

use super::alloc::Target;
use super::state::{Held, Pending, Quiet};
use super::stream::{reap, Poll};
use super::txn::bump;
use super::{Arena, Touch};

impl Arena {
    /// Promises that no more device work uses allocation `id` after the
    /// work queued so far on `stream` (a `CUstream`; 0 is the legacy
    /// default stream), until the allocation grows (to any larger size,
    /// within its chunks too: new bytes are new work): the caller neither
    /// reads nor writes its memory through its addresses again (another
    /// allocation mapping the same chunks with [`Arena::alloc_shared`]
    /// reads them through its own). The arena records an event on the
    /// stream; once it has completed, whatever the allocation gives up (a
    /// [`free`](Arena::free) or [`free_on_stream`](Arena::free_on_stream),
    /// a shrink, the old range of a move) is known idle at once: another
    /// address takes its chunks, and the pool or the driver gets them
    /// back, without a device synchronize or an event wait. A
    /// `free_on_stream` of it then records no event and frees at once.
    ///
    /// The allocation stays usable: its contents stay, it may be queried,
    /// pinned, shared, moved, shrunk and freed as before. Growing it ends
    /// the promise (its new pages are for new work), and so do
    /// [`sleep`](Arena::sleep) and [`unquiesce`](Arena::unquiesce) (for a
    /// caller that uses it again without growing it). A second call while a promise holds
    /// changes nothing (the first event covers the same work). Queueing
    /// work through it anyway, before it grows, is a contract violation:
    /// the arena may unmap its memory while that work runs.
    ///
    /// A small allocation (inside a slab shared with others), an exported
    /// allocation or an import, and every allocation on a backend without
    /// asynchronous streams: nothing to record (on the host every call has
    /// completed when it returns, and the promise holds at once there).
    /// Errors: `UnknownAllocation`; `Asleep` for a sleeping allocation (it
    /// maps nothing; a small one too); a failure to record the event is `Error::Driver` and
    /// changes nothing.
    pub fn quiesce_on_stream(&self, id: Id, stream: u64) -> Result<()> {
        self.run(Touch::Nothing, |inner, ctx, _| {
            #[cfg(unix)]
            if let Some(import) = inner.shares.import_of(&inner.st, id) {
                return import.map(|_| ());
            }
            let slot = match inner.st.resolve(id)? {
                Target::Chunks(slot) => slot,
                Target::Small(ss) if super::alloc::small_asleep(&inner.st, ss) => return Err(Error::Asleep(id.get())),
                Target::Small(_) => return Ok(()),
            };
            #[cfg(unix)]
            if inner.shares.is_exported(slot) {
                return Ok(());
            }
            let st = &mut inner.st;
            let a = st.alloc(slot);
            if a.sleep.is_some() {
                return Err(Error::Asleep(id.get()));
            }
            if a.quiet != Quiet::No {
                return Ok(());
            }
            let Some(event) = ctx.drv.record_event(stream)? else {
                st.alloc_mut(slot).quiet = Quiet::Yes;
                return Ok(());
            };
            bump(&ctx.counts.quiesce_events);
            st.alloc_mut(slot).quiet = Quiet::After(event);
            st.pending.push_back(Pending { event, stream, what: Held::Quiet { slot }, waited: false });
            reap(st, ctx, Poll::UntilIncomplete);
            Ok(())
        })
    }

    /// Ends the promise of [`quiesce_on_stream`](Arena::quiesce_on_stream):
    /// the caller is about to queue work through the allocation again
    /// without growing it (a prefix-cache entry taken over by a new
    /// request, which writes into the pages it keeps). What the allocation
    /// gave up before stays as the promise made it; what it gives up from
    /// now on is known idle only as any allocation's is. No driver call;
    /// without a promise (or for a small allocation, an exported one, an
    /// import, a sleeper) it changes nothing. Errors: `UnknownAllocation`.
    pub fn unquiesce(&self, id: Id) -> Result<()> {
        self.run(Touch::Nothing, |inner, _, _| {
            #[cfg(unix)]
            if let Some(import) = inner.shares.import_of(&inner.st, id) {
                return import.map(|_| ());
            }
            if let Target::Chunks(slot) = inner.st.resolve(id)? {
                inner.st.alloc_mut(slot).quiet = Quiet::No;
            }
            Ok(())
        })
    }
}
