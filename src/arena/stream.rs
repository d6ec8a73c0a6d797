//! Stream-ordered frees: `free_on_stream`, polling and waiting for their
//! events, and what a completed event makes known idle.
//!
//! A free on a stream records an event there (`cuEventRecord`) and makes the
//! id dead at once, but the memory stays where it is, unusable by anyone
//! else, until the event has completed: an allocation of whole chunks keeps
//! its reservation and its chunks mapped (owner `Owner::Pending`, immovable,
//! counted in `pending_free_bytes`), a small object stays taken in its slab.
//!
//! Events are polled (`cuEventQuery`, never blocking) at every
//! `free_on_stream` (oldest first, up to the first incomplete one), by
//! `maintain` and the worker (all of them), and by an operation that ran out
//! of memory or address space (all of them). Only when polling freed
//! nothing does that operation wait, for the oldest event, outside the lock
//! (`cuEventSynchronize`), and try again; never a device-wide synchronize.
//!
//! **Known idle.** When the event of a freed allocation has completed, no
//! work queued before the free can still use its pages: they become cached
//! pages marked idle (`State::idle`), and so do the retired ranges that
//! allocation left when it moved (only its own work used its old
//! addresses). Unmapping an idle page needs no synchronize: stealing its
//! chunk for another address, giving it back, or releasing an idle retired
//! range. A page stops being idle when it backs an allocation again. Plain
//! `free` and shrinking promise nothing about streams, so the pages they
//! leave are not idle and unmapping them synchronizes first, as before,
//! unless the allocation was quiesced (`quiesce.rs`: its promise's event
//! covers them).
//! (An idle page adopted by a later allocation and freed on a stream again
//! is covered by that free's event: work of an earlier owner is assumed
//! ordered before the later owner's, the same assumption that lets a plain
//! free's memory be adopted at once.)

use crate::error::Result;
use crate::sync::MutexGuard;
use crate::Id;

use super::alloc::{free_now, resize_target, sync_slab_pin, Target};
use super::pages_for;
use super::state::{Owner, Quiet, State};
use super::txn::bump;
use super::{Arena, Ctx, Inner, Shared, Touch};

/// How many events to poll.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Poll {
    /// Oldest first, stopping at the first incomplete one (frees on one
    /// stream complete in order): the cheap poll of `free_on_stream`.
    UntilIncomplete,
    /// Every pending event.
    All,
}

/// A stream-ordered free whose event has not been seen complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pending {
    /// The event recorded on the freeing stream (owned: destroyed when
    /// the entry goes).
    pub event: u64,
    /// The stream it was recorded on: events of one stream complete in
    /// the order they were recorded.
    pub stream: u64,
    pub what: Held,
    /// A thread waits for the event outside the lock (`stream::reclaim`):
    /// only that thread may destroy it and reap the entry.
    pub waited: bool,
}

/// What a [`Pending`] free keeps from reuse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Held {
    /// An allocation of whole chunks, in this slot, owner `Owner::Pending`.
    Chunks(u32),
    /// An object of this slab, kept taken (no small slot names it).
    Small { slab: u32, index: u32 },
    /// Pages a stream-ordered shrink dropped (`first..first + count`):
    /// nothing is held from reuse, but those of them still listed in
    /// `State::pending_idle` with this entry's event become idle when it
    /// completes.
    Pages { first: u64, count: u64 },
    /// A promise of no more work (`Arena::quiesce_on_stream`) through the
    /// allocation in `slot`: when the event completes, the allocation (if
    /// it still holds `Quiet::After` this event) becomes `Quiet::Yes`, and
    /// the pages it gave up meanwhile (listed in `State::pending_idle` with
    /// this event, wherever it lay when it gave them up: a move may have
    /// taken it elsewhere) become idle.
    Quiet { slot: u32 },
}

impl Arena {
    /// Frees like [`Arena::free`], but ordered after the work queued so far
    /// on `stream` (a `CUstream`; 0 is the legacy default stream): the id is
    /// dead at once, and the memory is neither unmapped nor handed to
    /// another address before that work has completed. The arena records an
    /// event on the stream and polls it; it waits for such events (oldest
    /// first, never with a device-wide synchronize) only when nothing else
    /// can serve a request. Once the event has completed, the memory's
    /// chunks are known idle: reusing them elsewhere, or giving them back,
    /// needs no device synchronize (see docs/design/driver_work.md, "Stream-ordered frees").
    ///
    /// On a backend without asynchronous streams (the host) it is
    /// [`Arena::free`], and so it is for an exported allocation and for an
    /// import ([`Arena::export`], [`Arena::import`]): their free synchronizes
    /// the device before it unmaps, which orders it after `stream`'s work. Errors: as `free` (`UnknownAllocation`); a failure
    /// to record the event is `Error::Driver` and frees nothing.
    pub fn free_on_stream(&self, id: Id, stream: u64) -> Result<()> {
        self.run(Touch::Nothing, |inner, ctx, _| {
            // An exported allocation's chunks never go back to the pool, and
            // an import is unmapped and closed: both are freed at once, after
            // the device synchronize their free makes before unmapping (it
            // orders the unmap after the work on every stream, `stream`'s
            // included). No event is recorded.
            #[cfg(unix)]
            if let Some(r) = super::export::free_shared(inner, ctx, id) {
                return r;
            }
            let target = inner.st.resolve(id)?;
            // Quiesced, and known kept: no work uses it, nothing to wait for.
            if let Target::Chunks(slot) = target {
                if inner.st.alloc(slot).quiet == Quiet::Yes {
                    free_now(&mut inner.st, target);
                    return Ok(());
                }
            }
            let Some(event) = ctx.drv.record_event(stream)? else {
                free_now(&mut inner.st, target);
                return Ok(());
            };
            bump(&ctx.counts.event_records);
            hold(&mut inner.st, target, event, stream);
            reap(&mut inner.st, ctx, Poll::UntilIncomplete);
            Ok(())
        })
    }
}

impl Arena {
    /// Resizes like [`Arena::resize`]; a shrink is also ordered after the
    /// work queued so far on `stream` (a `CUstream`; 0 is the legacy
    /// default stream). The dropped part is given up as `resize` gives it
    /// up (growth of this allocation may take it back at once; another
    /// address may take its chunks after a device synchronize, as for any
    /// cached chunk), and once that work has completed the arena knows it
    /// idle: another address takes its chunks, and the pool or the driver
    /// gets them back, without a synchronize. That is what a caller that
    /// shrinks often (a prefix cache evicting the tails of its entries)
    /// needs so as never to drain the device.
    ///
    /// Growth of whole chunks is work ordered on `stream`: it may take
    /// memory freed or shrunk on the same stream at once, with no event
    /// wait and no synchronize (as [`Arena::alloc_on_stream`] does).
    ///
    /// The arena records an event on `stream` only for a shrink that
    /// leaves pages behind; an unchanged size, a small allocation,
    /// an exported allocation or an import, and a backend without
    /// asynchronous streams (the host) resize exactly as `resize` does.
    /// Errors: as `resize`; a failure to record the event is
    /// `Error::Driver` and changes nothing.
    pub fn resize_on_stream(&self, id: Id, new_size: u64, stream: u64) -> Result<u64> {
        self.resize_ordered(id, new_size, Some(stream))
    }

    /// The body of [`Arena::resize`] (`stream` None) and of
    /// [`Arena::resize_on_stream`].
    pub(super) fn resize_ordered(&self, id: Id, new_size: u64, stream: Option<u64>) -> Result<u64> {
        self.resize_checked(id, new_size, stream, |_| Ok(()))
    }

    /// [`Arena::resize_ordered`] after `precondition` holds, checked under
    /// the same lock as the resize (a two-phase commit's "unchanged since
    /// the prepare"); when it fails, nothing is done.
    pub(super) fn resize_checked(
        &self,
        id: Id,
        new_size: u64,
        stream: Option<u64>,
        precondition: impl Fn(&Inner) -> Result<()>,
    ) -> Result<u64> {
        let np = pages_for(new_size, self.chunk, "new_size")?;
        self.run(Touch::Nothing, |inner, ctx, events| {
            precondition(inner)?;
            #[cfg(unix)]
            inner.shares.check_resize(&inner.st, id, np)?;
            let target = inner.st.resolve(id)?;
            // The pages a shrink of whole chunks on a stream leaves behind.
            let dropped = match (&target, stream) {
                (_, None) | (&Target::Small(_), _) => None,
                (&Target::Chunks(slot), Some(_)) => {
                    let a = inner.st.alloc(slot);
                    #[cfg(unix)]
                    let exported = inner.shares.is_exported(slot);
                    #[cfg(not(unix))]
                    let exported = false;
                    // A quiesced allocation's promise covers its dropped pages.
                    let quiet = a.quiet != Quiet::No;
                    (a.sleep.is_none() && np < a.backed && !exported && !quiet).then(|| (a.start + np, a.backed - np))
                }
            };
            // Recorded first: a failed record changes nothing.
            let event = match (dropped, stream) {
                (Some(_), Some(stream)) => ctx.drv.record_event(stream)?,
                _ => None,
            };
            let st = &mut inner.st;
            let mut tx = ctx.txn(st);
            // Growth of whole chunks may reuse memory given up on `stream`
            // (see `stream_reuse.rs`).
            if let Target::Chunks(_) = target {
                st.reuse.op_stream = stream;
            }
            let resized = resize_target(st, &mut tx, target, id, np, new_size, events);
            st.reuse.op_stream = None;
            match resized {
                Ok(ptr) => {
                    tx.commit();
                    if let (Some(event), Some((first, count)), Some(stream)) = (event, dropped, stream) {
                        bump(&ctx.counts.shrink_events);
                        // Pages another holder still maps were unmapped
                        // (growable) or retired; the rest are cached.
                        for p in first..first + count {
                            if st.cached.contains(&p) || st.is_retired(p) {
                                st.pending_idle.insert(p, event);
                            }
                        }
                        st.pending.push_back(Pending {
                            event,
                            stream,
                            what: Held::Pages { first, count },
                            waited: false,
                        });
                        reap(st, ctx, Poll::UntilIncomplete);
                    }
                    Ok(ptr)
                }
                Err(e) => {
                    tx.rollback();
                    if let Some(event) = event {
                        // A failed destroy leaks one event, nothing of the arena's.
                        let _ = ctx.drv.destroy_event(event);
                    }
                    Err(e)
                }
            }
        })
    }
}

/// The bookkeeping of a stream-ordered free: `target` stops being named by
/// its id but keeps its memory until `event` completes.
fn hold(st: &mut State, target: Target, event: u64, stream: u64) {
    let what = match target {
        Target::Chunks(slot) => {
            let a = st.alloc(slot).clone();
            if let Owner::Promoted(ss) = a.owner {
                st.small.drop_slot(ss);
            }
            // Dead to callers: no longer live, no id resolves to it.
            st.live_bytes -= a.size;
            st.live_count -= 1;
            let m = st.alloc_mut(slot);
            m.owner = Owner::Pending;
            m.pinned = false;
            // The free's own event covers all its work.
            m.quiet = Quiet::No;
            Held::Chunks(slot)
        }
        Target::Small(ss) => {
            let (slab, index) = st.small.hold(ss).expect("resolve gives Small only for objects in slabs");
            sync_slab_pin(st, slab);
            st.small.drop_slot(ss);
            Held::Small { slab, index }
        }
    };
    st.pending.push_back(Pending { event, stream, what, waited: false });
    st.prefetch_dirty = true;
}

/// Distinct chunks held only by pending frees of whole chunks (a chunk
/// shared with a live allocation backs that one; see `Arena::alloc_shared`).
pub(super) fn pending_chunks(st: &State) -> u64 {
    let pages_of = pending_pages_per_chunk(st);
    pages_of.iter().filter(|(h, &n)| st.shared.get(h).map_or(true, |&all| all == n)).count() as u64
}

/// The backing pages of an entry (pending frees of whole chunks only).
fn held_pages(st: &State, p: &Pending) -> std::ops::Range<u64> {
    match p.what {
        Held::Chunks(slot) => {
            let a = st.alloc(slot);
            a.start..a.start + a.backed
        }
        _ => 0..0,
    }
}

/// For each chunk backing pages held by pending frees, how many such pages.
fn pending_pages_per_chunk(st: &State) -> std::collections::HashMap<crate::driver::ChunkHandle, u32> {
    let mut pages_of: std::collections::HashMap<crate::driver::ChunkHandle, u32> = Default::default();
    for p in &st.pending {
        for page in held_pages(st, p) {
            *pages_of.entry(st.mapped[page as usize].expect("backing page is mapped")).or_default() += 1;
        }
    }
    pages_of
}

/// For each pending entry, whether its completion gives a chunk back: it
/// holds a chunk that no live allocation maps (every page backed by it is
/// held by pending frees). Only frees of whole chunks can.
fn returns_memory(st: &State) -> Vec<bool> {
    let pending_pages = pending_pages_per_chunk(st);
    st.pending
        .iter()
        .map(|p| {
            held_pages(st, p).any(|page| {
                let h = st.mapped[page as usize].expect("backing page is mapped");
                st.shared.get(&h).map_or(true, |&all| all == pending_pages[&h])
            })
        })
        .collect()
}

/// Polls pending events and gives back the memory of completed frees.
/// Returns how many frees completed (completed shrinks, which only make
/// known idle what was reusable already, are not counted). A failed poll counts as "not complete yet"
/// (the event is polled again later; nothing is lost).
pub(super) fn reap(st: &mut State, ctx: &Ctx<'_>, poll: Poll) -> usize {
    let mut done = 0;
    let mut i = 0;
    // Streams with an incomplete event: their later events are not
    // complete either (a stream completes its events in order), so they
    // are not polled. A caller that shrinks often on one stream leaves
    // many events pending: each poll costs one query per stream, not one
    // per event.
    let mut incomplete: Vec<u64> = Vec::new();
    while i < st.pending.len() {
        let p = st.pending[i];
        if p.waited || incomplete.contains(&p.stream) {
            // Another thread waits on it outside the lock and reaps it,
            // or an earlier event of its stream is not complete.
            i += 1;
            continue;
        }
        bump(&ctx.counts.event_queries);
        if ctx.drv.event_complete(p.event).unwrap_or(false) {
            st.pending.remove(i);
            complete(st, ctx, p);
            // A shrink's or a quiesced allocation's pages were reusable
            // already: only frees count.
            done += !matches!(p.what, Held::Pages { .. } | Held::Quiet { .. }) as usize;
        } else if poll == Poll::UntilIncomplete {
            break;
        } else {
            incomplete.push(p.stream);
            i += 1;
        }
    }
    done
}

/// The event of `p` has completed: its memory becomes reusable, and known idle.
fn complete(st: &mut State, ctx: &Ctx<'_>, p: Pending) {
    // A failed destroy leaks one event, nothing of the arena's.
    let _ = ctx.drv.destroy_event(p.event);
    // Old addresses of chunks reused on its stream: no work uses them now.
    super::stream_reuse::complete(st, p.event);
    match p.what {
        Held::Chunks(slot) => {
            let a = st.alloc(slot).clone();
            // Its own retired ranges: only its work used those addresses.
            let retired: Vec<(u64, u64)> = st
                .retired_owner
                .iter()
                .filter(|&(_, &o)| o == slot)
                .filter_map(|(&s, _)| st.retired.get(&s).map(|&l| (s, l)))
                .collect();
            for (s, l) in retired {
                st.idle.extend(s..s + l);
            }
            st.remove_alloc(slot);
            st.idle.extend(a.start..a.start + a.backed);
        }
        Held::Small { slab, index } => {
            if let Some(empty_slab) = st.small.free_held(slab, index) {
                st.remove_alloc(empty_slab);
            }
        }
        Held::Quiet { slot } => {
            // The promise is known kept, if it still holds (the slot may
            // have been freed, or hold another allocation by now).
            if let Some(a) = st.slots.get_mut(slot as usize).and_then(|s| s.alloc.as_mut()) {
                if a.quiet == Quiet::After(p.event) {
                    a.quiet = Quiet::Yes;
                }
            }
            // Its pages given up meanwhile, found by the event: a move
            // may have taken it away from where it was quiesced.
            let given_up: Vec<u64> =
                st.pending_idle.iter().filter(|&(_, &e)| e == p.event).map(|(&page, _)| page).collect();
            mark_idle(st, p.event, given_up);
        }
        Held::Pages { first, count } => mark_idle(st, p.event, first..first + count),
    }
    st.prefetch_dirty = true;
}

/// The pages of `pages` still listed with `event` in `State::pending_idle`
/// (still as a shrink or a quiesced allocation left them: see
/// `State::forget_idle`) become idle.
fn mark_idle(st: &mut State, event: u64, pages: impl IntoIterator<Item = u64>) {
    for page in pages {
        if st.pending_idle.get(&page) == Some(&event) {
            st.pending_idle.remove(&page);
            st.idle.insert(page);
        }
    }
}

/// Makes memory of stream-ordered frees available to an operation that ran
/// out of it (of memory where `memory`, else of address space): polls
/// every event, and if none has completed, waits for the oldest one not
/// already waited for that can help, outside the lock. Returns whether
/// anything became available (the operation should try again).
///
/// Out of memory, only a free that gives chunks back helps: one whose
/// chunks all back live allocations too (a prefix shared with
/// `alloc_shared`) returns none, and waiting for it would drain the device
/// for nothing. Out of address space, every free of whole chunks helps
/// (its reservation comes back).
pub(super) fn reclaim<'a>(
    sh: &'a Shared,
    mut inner: MutexGuard<'a, Inner>,
    ctx: &Ctx<'_>,
    memory: bool,
) -> Result<(MutexGuard<'a, Inner>, bool)> {
    if inner.st.pending.is_empty() {
        return Ok((inner, false));
    }
    if reap(&mut inner.st, ctx, Poll::All) > 0 {
        sh.round_done.notify_all();
        return Ok((inner, true));
    }
    // A shrink's event frees nothing: never worth a wait.
    let returning = if memory { returns_memory(&inner.st) } else { Vec::new() };
    let helps = |(k, p): (usize, &Pending)| match p.what {
        Held::Pages { .. } | Held::Quiet { .. } => false,
        Held::Chunks(_) => !memory || returning[k],
        Held::Small { .. } => true,
    };
    if !inner.st.pending.iter().enumerate().any(helps) {
        return Ok((inner, false));
    }
    let Some(i) = inner.st.pending.iter().enumerate().position(|(k, p)| !p.waited && helps((k, p))) else {
        // Every one is being waited for by another thread: wait for it to reap.
        let inner = sh.wait_round(inner)?;
        return Ok((inner, true));
    };
    let event = inner.st.pending[i].event;
    inner.st.pending[i].waited = true;
    drop(inner);
    let waited = ctx.drv.wait_event(event);
    let mut inner = sh.inner.lock().map_err(|_| super::poisoned())?;
    // The entry is still there: only the thread that marked it removes it.
    let i = inner.st.pending.iter().position(|p| p.event == event && p.waited).expect("waited-for entry stays");
    inner.st.pending[i].waited = false;
    waited?;
    bump(&ctx.counts.event_waits);
    let p = inner.st.pending.remove(i).expect("index just found");
    complete(&mut inner.st, ctx, p);
    sh.round_done.notify_all();
    Ok((inner, true))
}

/// Waits for every pending free, oldest first, and gives its memory back
/// (for `sleep`, which must give every pooled chunk back). Under the lock:
/// sleep synchronizes the device anyway.
pub(super) fn drain(st: &mut State, ctx: &Ctx<'_>) -> Result<()> {
    while let Some(i) = st.pending.iter().position(|p| !p.waited) {
        let p = st.pending[i];
        ctx.drv.wait_event(p.event)?;
        bump(&ctx.counts.event_waits);
        st.pending.remove(i);
        complete(st, ctx, p);
    }
    // Nothing may keep the chunks alive through an old address.
    super::stream_reuse::unmap_completed(st, ctx);
    Ok(())
}
