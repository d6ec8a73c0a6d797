//! How the arena unmaps a run of pages.
//!
//! Every page is mapped by its own map call (one chunk each). NVIDIA's text
//! for `cuMemUnmap` requires "the entire contiguous address range that was
//! mapped to" and forbids sub-ranges; it does not say whether one call may
//! cover several adjacent, separately made mappings. The arena therefore
//! follows the strict reading — one unmap call per mapping — unless a probe
//! when the arena is created ([`probe`]: map two pages separately, unmap
//! both with one call) shows that the driver accepts spans; then a run of
//! pages is one call. The stats' `driver_unmaps` counts the calls made
//! either way, so the replay's time model prices the mode in use.

use crate::driver::{ChunkHandle, Driver};
use crate::error::Result;

use super::txn::{bump, Counters};

/// How a run of separately mapped pages is unmapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum UnmapMode {
    /// One call for the whole run (the driver accepted a span in the probe).
    Spans,
    /// One call per mapping (the strict reading; the default).
    PerMapping,
}

/// Finds out whether `drv` unmaps two adjacent, separately mapped pages
/// with one call: one chunk is created and mapped at `base` and at
/// `base + chunk` (a chunk may be mapped at several addresses), both are
/// unmapped at once, and the chunk is released. Anything that fails, or a
/// reservation of fewer than two pages, answers [`UnmapMode::PerMapping`],
/// which every driver accepts. Best effort: what the probe made is undone,
/// and its calls are not counted in the stats (they are no operation's).
pub(crate) fn probe(drv: &dyn Driver, base: u64, chunk: u64, pages: u64) -> UnmapMode {
    if pages < 2 {
        return UnmapMode::PerMapping;
    }
    let Ok(h) = drv.create(chunk) else { return UnmapMode::PerMapping };
    let mut mapped = Vec::new();
    for addr in [base, base + chunk] {
        if drv.map(addr, chunk, h, 0).is_ok() {
            mapped.push(addr);
        }
    }
    let mut mode = UnmapMode::PerMapping;
    if mapped.len() == 2 && drv.unmap(base, 2 * chunk).is_ok() {
        mode = UnmapMode::Spans;
        mapped.clear();
    }
    for addr in mapped {
        let _ = drv.unmap(addr, chunk);
    }
    let _ = drv.release(h);
    mode
}

/// Unmaps the pages holding `chunks` from `addr` (synchronizing is the
/// caller's), counting each successful call in `counts.unmaps`. With
/// [`UnmapMode::PerMapping`], a failed call maps the pages it had already
/// unmapped again (with their access), so on error the run is as it was
/// as far as the driver lets it be.
pub(crate) fn unmap_run(
    drv: &dyn Driver,
    counts: &Counters,
    mode: UnmapMode,
    addr: u64,
    chunk: u64,
    chunks: &[ChunkHandle],
) -> Result<()> {
    let n = chunks.len() as u64;
    if mode == UnmapMode::Spans || n <= 1 {
        drv.unmap(addr, n * chunk)?;
        bump(&counts.unmaps);
        return Ok(());
    }
    for i in 0..n {
        if let Err(e) = drv.unmap(addr + i * chunk, chunk) {
            let mut remapped = true;
            for (j, &h) in chunks[..i as usize].iter().enumerate() {
                let ok = drv.map(addr + j as u64 * chunk, chunk, h, 0).is_ok();
                if ok {
                    bump(&counts.maps);
                }
                remapped &= ok;
            }
            if i > 0 && remapped && drv.set_access(addr, i * chunk).is_ok() {
                bump(&counts.access_calls);
            }
            return Err(e);
        }
        bump(&counts.unmaps);
    }
    Ok(())
}

/// Unmaps `pages` pages from `addr`, best effort (teardown and undo paths,
/// where a failure has nothing better to report); counts successful calls
/// in `counts` when given.
pub(crate) fn unmap_pages(
    drv: &dyn Driver,
    counts: Option<&Counters>,
    mode: UnmapMode,
    addr: u64,
    chunk: u64,
    pages: u64,
) {
    if pages == 0 {
        return;
    }
    let count = |ok: bool| {
        if let (true, Some(c)) = (ok, counts) {
            bump(&c.unmaps);
        }
    };
    match mode {
        UnmapMode::Spans => count(drv.unmap(addr, pages * chunk).is_ok()),
        UnmapMode::PerMapping => {
            for i in 0..pages {
                count(drv.unmap(addr + i * chunk, chunk).is_ok());
            }
        }
    }
}
