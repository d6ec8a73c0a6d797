//! Driver calls with an undo log.
//!
//! An operation performs all of its driver calls through one [`Txn`]; each
//! reversible call records how to reverse it. If a later call fails, the
//! operation rolls the transaction back (in reverse order) and leaves its
//! bookkeeping untouched, so the arena is exactly as it was. That includes
//! the bytes: a copy first saves what its destination held, and the
//! rollback writes it back (a later step of the same operation may fail
//! after a copy landed in memory that the rollback gives back to another
//! allocation, e.g. a chunk another request of a `resize_many` gave up).
//! Chunk releases cannot be reversed and are therefore done only at the
//! very end of an operation, outside any transaction that may still fail.

use crate::driver::{ChunkHandle, Driver};
use crate::error::Result;
use crate::sync::{AtomicU64, Ordering};

use super::unmap::{unmap_pages, unmap_run, UnmapMode};

/// Successful driver calls, ever (the `driver_*` fields of the stats).
/// The arena keeps two: one for the callers' operations, one for
/// `maintain` and the background worker.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub creates: AtomicU64,
    pub releases: AtomicU64,
    pub maps: AtomicU64,
    pub unmaps: AtomicU64,
    pub access_calls: AtomicU64,
    pub syncs: AtomicU64,
    /// Stream events recorded (`cuEventRecord`) by stream-ordered frees.
    pub event_records: AtomicU64,
    /// Stream events recorded by stream-ordered shrinks.
    pub shrink_events: AtomicU64,
    /// Stream events recorded by `quiesce_on_stream`.
    pub quiesce_events: AtomicU64,
    /// Event polls (`cuEventQuery`).
    pub event_queries: AtomicU64,
    /// Blocking event waits (`cuEventSynchronize`).
    pub event_waits: AtomicU64,
}

impl Counters {
    /// The virtual-memory calls counted here (creates, releases, maps,
    /// unmaps, access calls, synchronizes; not event calls).
    pub fn vmm_calls(&self) -> u64 {
        let l = |c: &AtomicU64| c.load(Ordering::Relaxed);
        l(&self.creates) + l(&self.releases) + l(&self.maps) + l(&self.unmaps) + l(&self.access_calls) + l(&self.syncs)
    }
}

pub(crate) fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

enum Undo {
    Release(ChunkHandle),
    Unmap {
        page: u64,
        pages: u64,
    },
    Remap {
        page: u64,
        chunks: Vec<ChunkHandle>,
    },
    /// The bytes a copy overwrote at `addr`.
    Restore {
        addr: u64,
        bytes: Vec<u8>,
    },
}

/// A batch of driver calls that can be undone until it is committed.
pub(crate) struct Txn<'a> {
    drv: &'a dyn Driver,
    counts: &'a Counters,
    base: u64,
    chunk: u64,
    undo: Vec<Undo>,
    synced: bool,
    unmaps: UnmapMode,
}

impl<'a> Txn<'a> {
    pub fn new(drv: &'a dyn Driver, counts: &'a Counters, unmaps: UnmapMode, base: u64, chunk: u64) -> Txn<'a> {
        Txn { drv, counts, base, chunk, undo: Vec::new(), synced: false, unmaps }
    }

    pub fn addr(&self, page: u64) -> u64 {
        self.base + page * self.chunk
    }

    /// Synchronizes the device once per transaction, before the first unmap.
    pub fn sync(&mut self) -> Result<()> {
        if !self.synced {
            self.drv.synchronize()?;
            bump(&self.counts.syncs);
            self.synced = true;
        }
        Ok(())
    }

    /// Waits for a stream event (nothing to undo: waiting changes nothing
    /// of the arena's).
    pub fn wait_event(&mut self, event: u64) -> Result<()> {
        self.drv.wait_event(event)?;
        bump(&self.counts.event_waits);
        Ok(())
    }

    pub fn create(&mut self) -> Result<ChunkHandle> {
        let h = self.drv.create(self.chunk)?;
        bump(&self.counts.creates);
        self.undo.push(Undo::Release(h));
        Ok(h)
    }

    pub fn map(&mut self, page: u64, h: ChunkHandle) -> Result<()> {
        self.drv.map(self.addr(page), self.chunk, h, 0)?;
        bump(&self.counts.maps);
        self.undo.push(Undo::Unmap { page, pages: 1 });
        Ok(())
    }

    /// One access call for a contiguous run of freshly mapped pages.
    pub fn set_access(&mut self, page: u64, pages: u64) -> Result<()> {
        self.drv.set_access(self.addr(page), pages * self.chunk)?;
        bump(&self.counts.access_calls);
        Ok(())
    }

    /// Unmaps a run of pages (each one whole mapping) holding `chunks`,
    /// synchronizing first.
    pub fn unmap(&mut self, page: u64, chunks: Vec<ChunkHandle>) -> Result<()> {
        self.sync()?;
        self.unmap_idle(page, chunks)
    }

    /// Unmaps a run of pages known idle (see `State::idle`: no work can
    /// still use them), without synchronizing the device: one call, or one
    /// per page (see `unmap.rs`).
    pub fn unmap_idle(&mut self, page: u64, chunks: Vec<ChunkHandle>) -> Result<()> {
        unmap_run(self.drv, self.counts, self.unmaps, self.addr(page), self.chunk, &chunks)?;
        self.undo.push(Undo::Remap { page, chunks });
        Ok(())
    }

    /// Copies `len` bytes from `src` to `dst` (mapped, accessible, not
    /// overlapping), saving what `dst` held first so that a rollback puts
    /// it back: the destination may be memory that, once rolled back,
    /// belongs to another allocation again.
    pub fn copy(&mut self, dst: u64, src: u64, len: u64) -> Result<()> {
        let n = usize::try_from(len).map_err(|_| crate::error::Error::invalid("copy too large"))?;
        let mut saved = vec![0u8; n];
        self.drv.read(dst, &mut saved)?;
        self.drv.copy(dst, src, len)?;
        self.undo.push(Undo::Restore { addr: dst, bytes: saved });
        Ok(())
    }

    /// Makes the calls permanent.
    pub fn commit(mut self) {
        self.undo.clear();
    }

    /// Reverses every call made so far, newest first. Best effort: a failure
    /// here cannot be reported better than the error that caused the rollback.
    pub fn rollback(mut self) {
        while let Some(u) = self.undo.pop() {
            let _ = match u {
                Undo::Release(h) => release(self.drv, self.counts, h),
                Undo::Unmap { page, pages } => {
                    unmap_pages(self.drv, Some(self.counts), self.unmaps, self.addr(page), self.chunk, pages);
                    Ok(())
                }
                // Undone in reverse order, so the mappings at `addr` are
                // those the copy wrote through.
                Undo::Restore { addr, bytes } => self.drv.write(addr, &bytes),
                Undo::Remap { page, chunks } => {
                    let n = chunks.len() as u64;
                    let mut ok = true;
                    for (i, h) in chunks.into_iter().enumerate() {
                        let mapped = self.drv.map(self.addr(page + i as u64), self.chunk, h, 0).is_ok();
                        if mapped {
                            bump(&self.counts.maps);
                        }
                        ok &= mapped;
                    }
                    if ok {
                        let _ = self.set_access(page, n);
                    }
                    Ok(())
                }
            };
        }
    }
}

impl Drop for Txn<'_> {
    fn drop(&mut self) {
        debug_assert!(
            self.undo.is_empty() || std::thread::panicking(),
            "transaction neither committed nor rolled back"
        );
    }
}

/// Releases a chunk outside any transaction (irreversible).
pub(crate) fn release(drv: &dyn Driver, counts: &Counters, h: ChunkHandle) -> Result<()> {
    drv.release(h)?;
    bump(&counts.releases);
    Ok(())
}

/// Maximal runs of consecutive values in a sorted list.
pub(crate) fn runs(sorted: &[u64]) -> Vec<std::ops::Range<u64>> {
    let mut out: Vec<std::ops::Range<u64>> = Vec::new();
    for &p in sorted {
        match out.last_mut() {
            Some(r) if r.end == p => r.end += 1,
            _ => out.push(p..p + 1),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_groups_consecutive_pages() {
        assert_eq!(runs(&[1, 2, 3, 7, 9, 10]), vec![1..4, 7..8, 9..11]);
        assert!(runs(&[]).is_empty());
    }
}
