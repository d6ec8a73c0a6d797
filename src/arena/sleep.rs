//! Tags, sleep and wake: giving a tagged group's physical memory back to
//! the driver while its ids, addresses and reservations stay.

use crate::driver::{ChunkHandle, HostBuffer};
use crate::error::{Error, Result};
use crate::Id;

use super::alias;
use super::alloc::{copy_small, small_ptr, Target};
use super::backup_cache::BackupCache;
use super::moves::release_retired_into;
use super::state::{self, Alloc, Owner, State};
use super::txn;
use super::{Arena, Ctx, Inner, Touch, ALL_TAGS, SLEEP_BACKUP};

impl Arena {
    /// Sets an allocation's tag (0 by default, or the one it was allocated
    /// with: [`Arena::alloc_tagged`]), which [`Arena::sleep`] and
    /// [`Arena::wake`] select by. Every allocation takes a tag, whatever its
    /// size or history.
    ///
    /// An allocation of whole chunks keeps its place; this works asleep or
    /// pinned too. A small allocation (in a slab: at most half a chunk,
    /// made by [`Arena::alloc`] or [`Arena::alloc_tagged`]) shares its slab
    /// only with allocations of its tag, so a new tag moves it: its bytes
    /// are copied into a slab of the new tag (as a resize past its size
    /// class does: the address changes, the move callback fires, the copy
    /// counts in `bytes_copied`). That move is refused for a pinned one
    /// (`Error::Pinned`) and a sleeping one (`Error::Asleep`), and needs a
    /// slab's room (`Error::OutOfMemory`); on any error nothing changed.
    /// Setting the tag it has already is a no-op.
    pub fn set_tag(&self, id: Id, tag: u32) -> Result<()> {
        self.run(Touch::Nothing, |inner, ctx, events| {
            #[cfg(unix)]
            inner.shares.check_tag(&inner.st, id)?;
            let st = &mut inner.st;
            match st.resolve(id)? {
                Target::Chunks(slot) => {
                    st.alloc_mut(slot).tag = tag;
                    Ok(())
                }
                Target::Small(ss) => {
                    let s = st.small.slab_of(ss).expect("resolve gives Small only for objects in slabs");
                    if s.tag == tag {
                        return Ok(());
                    }
                    let size = st.small.size_of(ss);
                    let mut tx = ctx.txn(st);
                    match copy_small(st, &mut tx, ss, id, size, tag, events) {
                        Ok(_) => {
                            tx.commit();
                            Ok(())
                        }
                        Err(e) => {
                            tx.rollback();
                            Err(e)
                        }
                    }
                }
            }
        })
    }

    /// Puts every awake allocation with tag `tag` ([`ALL_TAGS`]: every tag;
    /// an allocation tagged `ALL_TAGS` is selected by every tag) to sleep,
    /// giving its physical memory back to the driver; ids, sizes, addresses
    /// and reservations stay.
    ///
    /// In order: waits for the device; with [`SLEEP_BACKUP`] in `flags`,
    /// copies each one's `size` bytes into a host buffer the driver lends
    /// (see below); unmaps every retired range (a retired range may still
    /// map one of their chunks or a pooled one, and a mapped chunk's memory
    /// is not given back); unmaps them and every cached pooled chunk; then
    /// releases their chunks and every pooled chunk, whatever
    /// `retain_bytes` says. Pinned allocations sleep too, already sleeping
    /// ones are left as they are. Small allocations sleep with their slab:
    /// a slab holds one tag's allocations only (see [`Arena::set_tag`]), and
    /// sleeps and wakes as one allocation of that tag.
    ///
    /// All or nothing: a failure of any call up to the unmaps (a backup
    /// buffer refused included) undoes them (remaps, frees the buffers) and
    /// nothing has slept. The releases come after that point and cannot be
    /// undone: a release that fails keeps its chunk pooled and counts in
    /// `release_failures` (like the retain watermark), and the sleep has
    /// succeeded; [`Arena::trim`] or the next sleep gives the chunk back.
    ///
    /// The backups are [`Driver::alloc_host`](crate::driver::Driver::alloc_host)
    /// buffers, filled and emptied with the driver's `read` and `write`:
    /// page-locked memory from `cuMemHostAlloc` on CUDA (ordinary memory if
    /// that much cannot be pinned), ordinary memory on the host backend.
    ///
    /// Unknown bits in `flags`: `Error::InvalidArgument`.
    pub fn sleep(&self, tag: u32, flags: u32) -> Result<()> {
        if flags & !SLEEP_BACKUP != 0 {
            return Err(Error::invalid(format!("unknown sleep flags {:#x}", flags & !SLEEP_BACKUP)));
        }
        self.run(Touch::Everything, |inner, ctx, _| {
            // Frees ordered on streams give their memory back too.
            super::stream::drain(&mut inner.st, ctx)?;
            sleep_tag(inner, ctx, tag, flags & SLEEP_BACKUP != 0)
        })
    }

    /// Wakes every sleeping allocation with tag `tag` ([`ALL_TAGS`]: every
    /// tag), each at its own address: chunks are taken from the pool or
    /// created, mapped where its backing was, made accessible (one call per
    /// run of pages), and its backup, if it has one, written back through
    /// the driver. Without a backup its contents are whatever the driver
    /// gives.
    ///
    /// All or nothing: on failure (`OutOfMemory` when the capacity is taken,
    /// or a driver error) every one of them is still asleep with its backup
    /// intact.
    pub fn wake(&self, tag: u32) -> Result<()> {
        self.run(Touch::Everything, |inner, ctx, _| wake_tag(&mut inner.st, ctx, tag, &mut inner.backups))
    }

    /// Keeps spent sleep backups for the next sleep (`keep`), or stops and
    /// frees what is kept. With it on, a wake keeps each backup buffer it
    /// has written back (page-locked host memory on CUDA) instead of
    /// freeing it, and a sleep takes a kept buffer of exactly the size it
    /// needs before asking the driver for one: a loop that sleeps and wakes
    /// the same allocations allocates host memory in its first cycle only.
    /// The kept memory is the last cycle's backups; give it back with
    /// [`Arena::release_backup_cache`]. Off by default.
    pub fn set_backup_cache(&self, keep: bool) -> Result<()> {
        let mut inner = self.lock()?;
        inner.backups.keep = keep;
        if !keep {
            inner.backups.clear();
        }
        Ok(())
    }

    /// Frees the kept backup buffers (see [`Arena::set_backup_cache`]);
    /// returns their bytes. The cache stays on if it was.
    pub fn release_backup_cache(&self) -> Result<u64> {
        Ok(self.lock()?.backups.clear())
    }

    /// Bytes of host memory the backup cache keeps.
    pub fn backup_cache_bytes(&self) -> Result<u64> {
        Ok(self.lock()?.backups.bytes())
    }

    /// Copies bytes of a sleeping allocation's backup (the bytes it had when
    /// it fell asleep with [`SLEEP_BACKUP`]) at `offset` into `out`, without
    /// waking it. A small allocation's bytes are read from its slab's backup.
    /// `Error::InvalidArgument` when it has no backup (it is awake, or slept
    /// without [`SLEEP_BACKUP`]) or the span exceeds its size;
    /// `Error::UnknownAllocation` for an unknown id. Reads only.
    pub fn read_backup(&self, id: Id, offset: u64, out: &mut [u8]) -> Result<()> {
        let inner = self.lock()?;
        let st = &inner.st;
        #[cfg(unix)]
        if inner.shares.span(st, id).is_some() {
            return Err(Error::invalid(format!("allocation {:#x} is an import: it never sleeps", id.get())));
        }
        // (the slot holding the backup, where the allocation starts in it, its size)
        let (slot, start, size) = match st.resolve(id)? {
            Target::Chunks(slot) => (slot, 0, st.alloc(slot).size),
            Target::Small(ss) => {
                let slab =
                    st.small.slab_of(ss).ok_or_else(|| Error::Internal("a small allocation without a slab".into()))?;
                let base = st.addr(st.alloc(slab.alloc_slot).start);
                (slab.alloc_slot, small_ptr(st, ss) - base, st.small.size_of(ss))
            }
        };
        let end = offset.checked_add(out.len() as u64).filter(|&end| end <= size).ok_or_else(|| {
            Error::invalid(format!("span {offset}+{} exceeds the allocation's {size} bytes", out.len()))
        })?;
        let backup = st.alloc(slot).sleep.as_ref().and_then(|s| s.backup.as_ref()).ok_or_else(|| {
            Error::invalid(format!(
                "allocation {:#x} has no sleep backup (it is awake, or slept without SLEEP_BACKUP)",
                id.get()
            ))
        })?;
        let range = usize::try_from(start + offset).ok().zip(usize::try_from(start + end).ok());
        let bytes = range
            .and_then(|(from, to)| backup.as_slice().get(from..to))
            .ok_or_else(|| Error::Internal("a backup shorter than its allocation".into()))?;
        out.copy_from_slice(bytes);
        Ok(())
    }
}

/// Whether `a` is a caller's allocation of whole chunks, or a slab of small
/// ones, that `tag` selects: its own tag, or any when either is
/// [`ALL_TAGS`] (an allocation tagged `ALL_TAGS` sleeps and wakes with
/// every tag).
fn tagged(a: &Alloc, tag: u32) -> bool {
    (a.owner.counts_live() || matches!(a.owner, Owner::Slab(_)))
        && (tag == ALL_TAGS || a.tag == tag || a.tag == ALL_TAGS)
}

/// [`Arena::sleep`]: the reversible part (synchronize, backups, unmaps) on a
/// copy of the state, then the releases, best effort.
fn sleep_tag(inner: &mut Inner, ctx: &Ctx<'_>, tag: u32, backup: bool) -> Result<()> {
    // An exported allocation never sleeps: its chunks may be mapped in
    // another process, which a wake's new chunks would not reach.
    #[cfg(unix)]
    let exported = |s: u32| inner.shares.is_exported(s);
    #[cfg(not(unix))]
    let exported = |_: u32| false;
    let targets: Vec<u32> = inner
        .st
        .by_start
        .values()
        .copied()
        .filter(|&s| inner.st.alloc(s).sleep.is_none() && tagged(inner.st.alloc(s), tag) && !exported(s))
        // A slab of retired objects only backs nothing: releasing retired
        // memory below frees it.
        .filter(|&s| match inner.st.alloc(s).owner {
            Owner::Slab(i) => inner.st.small.slab(i).used > inner.st.small.slab(i).retired,
            _ => true,
        })
        .collect();
    let st = &mut inner.st;
    let nothing_held = st.retired.is_empty() && st.small.nothing_retired() && st.pooled_pages() == 0;
    if targets.is_empty() && nothing_held {
        return Ok(());
    }
    let mut sim = st.clone();
    let mut tx = ctx.txn(st);
    let cache = &mut inner.backups;
    // Buffers taken from the backup cache, by index into `backups`: a
    // failed sleep puts them back, so the cache is as it was too.
    let mut from_cache: Vec<usize> = Vec::new();
    let mut backups: Vec<Option<std::sync::Arc<HostBuffer>>> = Vec::new();
    let done = (|| {
        tx.sync()?;
        if backup {
            for &slot in &targets {
                let a = sim.alloc(slot);
                let len = usize::try_from(a.size).map_err(|_| Error::OutOfMemory("backup too large".into()))?;
                let mut buf = match cache.take(len) {
                    Some(b) => {
                        from_cache.push(backups.len());
                        b
                    }
                    None => ctx.drv.alloc_host(len)?,
                };
                let read = ctx.drv.read(sim.addr(a.start), buf.as_mut_slice());
                backups.push(Some(std::sync::Arc::new(buf)));
                read?;
            }
        } else {
            backups.resize(targets.len(), None);
        }
        // Retired ranges may map the sleepers' chunks (a moved allocation's
        // old range): those mappings would keep the memory alive. All of
        // them go, as when the arena needs their address space.
        release_retired_into(&mut sim, &mut tx)?;
        let mut pages: Vec<u64> = targets
            .iter()
            .flat_map(|&s| {
                let a = sim.alloc(s);
                a.start..a.start + a.backed
            })
            .chain(sim.cached.iter().copied())
            .collect();
        pages.sort_unstable();
        for run in state::runs(&pages) {
            let hs: Vec<_> = run.clone().map(|p| sim.mapped[p as usize].expect("page is mapped")).collect();
            tx.unmap(run.start, hs)?;
        }
        Ok::<_, Error>(())
    })();
    if let Err(e) = done {
        tx.rollback();
        for i in from_cache {
            if let Some(buf) = backups[i].take().and_then(|b| std::sync::Arc::try_unwrap(b).ok()) {
                cache.put(buf);
            }
        }
        return Err(e);
    }
    tx.commit();
    // Apply (infallible): the sleepers keep their reservations and map
    // nothing; every chunk they had and every pooled chunk is to release.
    // A chunk that an awake allocation also maps is not released (see
    // `alias::sleep_books`).
    let mut doomed: Vec<ChunkHandle> = Vec::new();
    for (&slot, backup) in targets.iter().zip(backups) {
        // Waking restores its bytes and its caller's work: no promise of
        // none survives a sleep.
        sim.alloc_mut(slot).quiet = Default::default();
        doomed.extend(alias::sleep_books(&mut sim, slot, backup));
    }
    for p in std::mem::take(&mut sim.cached) {
        doomed.push(sim.mapped[p as usize].take().expect("cached page is mapped"));
    }
    // Nothing cached or retired is left to be idle.
    sim.idle.clear();
    sim.pending_idle.clear();
    doomed.append(&mut sim.pool);
    *st = sim;
    for h in doomed {
        if txn::release(ctx.drv, ctx.counts, h).is_err() {
            inner.st.pool.push(h);
            inner.release_failures += 1;
        }
    }
    Ok(())
}

/// [`Arena::wake`]: every sleeper's chunks planned, mapped and made
/// accessible on a copy of the state, then the backups written; the copy
/// replaces the state only if every call succeeded.
fn wake_tag(st: &mut State, ctx: &Ctx<'_>, tag: u32, cache: &mut BackupCache) -> Result<()> {
    let targets: Vec<u32> =
        st.by_start.values().copied().filter(|&s| st.alloc(s).sleep.is_some() && tagged(st.alloc(s), tag)).collect();
    if targets.is_empty() {
        return Ok(());
    }
    // Out of memory is decided before any driver call: a refusal after some
    // sleepers were mapped would need a rollback, whose own driver calls
    // may fail and leave the arena unlike its books. Every pooled or cached
    // chunk can serve (none is cached inside a sleeper's reservation), and
    // new ones up to the capacity.
    // Pages that map again a chunk an awake allocation maps need none, and
    // a group of sleepers that shared a chunk needs one for all of them.
    // Slabs holding only retired objects count too (they are pooled in the
    // stats, and `alloc` counts them): releasing retired memory, below,
    // gives their chunks back to the pool.
    let needed = alias::wake_needs(st, &targets);
    let short = needed > st.obtainable_pages();
    if short && needed > st.obtainable_pages() + st.small.reclaimable_slabs() {
        return Err(Error::OutOfMemory(format!(
            "waking needs {needed} chunks of {} bytes; {} are obtainable under the capacity",
            st.chunk,
            st.obtainable_pages() + st.small.reclaimable_slabs()
        )));
    }
    let mut sim = st.clone();
    let mut tx = ctx.txn(st);
    let done = (|| {
        // Unmaps (undone by the rollback) and bookkeeping on the copy.
        if short {
            release_retired_into(&mut sim, &mut tx)?;
        }
        // Nothing is cached inside a sleeper's reservation (sleep unmapped
        // it all, and nothing else maps there): every page gets its group's
        // chunk, or a pooled, stolen or new one.
        let mut woken = Vec::with_capacity(targets.len());
        for &slot in &targets {
            woken.push(alias::wake_one(&mut sim, &mut tx, slot)?);
        }
        // The backups (in the books before the wake), to the pages that got
        // a new chunk: a page mapping a chunk again keeps its bytes as they
        // are now.
        let c = st.chunk;
        for (&slot, w) in targets.iter().zip(&woken) {
            let a = st.alloc(slot);
            if let Some(b) = a.sleep.as_ref().and_then(|s| s.backup.as_ref()) {
                for run in state::runs(&w.own_pages) {
                    let (from, to) = ((run.start * c) as usize, ((run.end * c) as usize).min(b.len()));
                    if from < to {
                        ctx.drv.write(st.addr(a.start + run.start), &b.as_slice()[from..to])?;
                    }
                }
            }
            for &(i, g) in &w.group_pages {
                for piece in alias::group_sources(st, g) {
                    let src = st.alloc(piece.slot);
                    let b = src.sleep.as_ref().and_then(|s| s.backup.as_ref()).expect("a backup");
                    let at = piece.page * c;
                    let bytes = &b.as_slice()[(at + piece.from) as usize..(at + piece.to) as usize];
                    ctx.drv.write(st.addr(a.start + i) + piece.from, bytes)?;
                }
            }
        }
        Ok::<_, Error>(())
    })();
    match done {
        Ok(()) => {
            tx.commit();
            // The woken allocations' backups are spent: kept for the next
            // sleep when the cache is on (the old books held the last
            // references), else freed.
            let spent: Vec<std::sync::Arc<HostBuffer>> =
                targets.iter().filter_map(|&s| st.alloc(s).sleep.as_ref().and_then(|z| z.backup.clone())).collect();
            *st = sim;
            for b in spent {
                if let Ok(buf) = std::sync::Arc::try_unwrap(b) {
                    cache.put(buf);
                }
            }
            Ok(())
        }
        Err(e) => {
            tx.rollback();
            Err(e)
        }
    }
}
