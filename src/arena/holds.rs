//! Who holds a physical chunk, and an audit of it (DESIGN.md, "Who holds a
//! chunk").
//!
//! The bugs of this kind all had one shape: a path put a chunk in the pool
//! (free for the next allocation) or released it while something else
//! still reached it. A chunk is *free to hand out* only from the pool or a
//! cached page; the audit checks, from the books alone, that no chunk there
//! has any other hold: it backs no live allocation's page (a caller's, a
//! slab, a promoted small object, one freed on a stream and waiting for its
//! event, one freed while a DMA-BUF is open), no exported allocation or
//! DMA-BUF reaches it, it is pooled or cached once, and a cached page lies
//! outside every backed prefix. A retired or deferred old address may
//! still map it: the free or shrink that pooled it was the caller's word
//! that no work uses those bytes any more.
//!
//! It runs after every operation in debug builds (`cargo test`), so the
//! model, the fault matrix and the fuzz replays check it on every step; a
//! violation panics with what holds the chunk. Release builds skip it.

use std::collections::{BTreeMap, BTreeSet};

use crate::driver::ChunkHandle;

use super::state::Owner;
use super::Inner;

/// One hold on a chunk, as the audit reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Hold {
    /// Backs page `page` of the allocation in `slot` (its owner says whose).
    Backing { slot: u32, page: u64, owner: Owner },
    /// Mapped at a cached page: pooled, adoptable where it lies.
    Cached { page: u64 },
    /// In the pool, mapped nowhere.
    Pooled,
    /// Mapped at a retired (old) page.
    Retired { page: u64 },
    /// Mapped at a page same-stream reuse left behind (`stream_reuse.rs`).
    Deferred { page: u64 },
    /// Reached by an open export or DMA-BUF of the allocation in `slot`.
    Exported { slot: u32 },
}

/// Every hold the books record, by chunk.
fn holds(inner: &Inner) -> BTreeMap<ChunkHandle, Vec<Hold>> {
    let st = &inner.st;
    let mut by: BTreeMap<ChunkHandle, Vec<Hold>> = BTreeMap::new();
    for (i, s) in st.slots.iter().enumerate() {
        let Some(a) = s.alloc.as_ref() else { continue };
        for page in a.start..a.start + a.backed {
            if let Some(h) = st.mapped[page as usize] {
                by.entry(h).or_default().push(Hold::Backing { slot: i as u32, page, owner: a.owner });
                #[cfg(unix)]
                if inner.shares.is_exported(i as u32) {
                    by.entry(h).or_default().push(Hold::Exported { slot: i as u32 });
                }
            }
        }
    }
    for &page in &st.cached {
        if let Some(h) = st.mapped[page as usize] {
            by.entry(h).or_default().push(Hold::Cached { page });
        }
    }
    for &h in &st.pool {
        by.entry(h).or_default().push(Hold::Pooled);
    }
    for (&s, &l) in &st.retired {
        for page in s..s + l {
            if let Some(h) = st.mapped[page as usize] {
                by.entry(h).or_default().push(Hold::Retired { page });
            }
        }
    }
    for &page in st.reuse.deferred.keys() {
        if let Some(h) = st.mapped[page as usize] {
            by.entry(h).or_default().push(Hold::Deferred { page });
        }
    }
    by
}

/// Checks that every chunk free to hand out (pooled, or cached) has no
/// other hold: `Err` names the chunk and what holds it.
pub(super) fn audit(inner: &Inner) -> Result<(), String> {
    let st = &inner.st;
    let by = holds(inner);
    let mut cached_pages = BTreeSet::new();
    for (h, list) in &by {
        let pooled = list.iter().filter(|x| **x == Hold::Pooled).count();
        let cached: Vec<u64> =
            list.iter().filter_map(|x| if let Hold::Cached { page } = x { Some(*page) } else { None }).collect();
        // A pooled chunk may still be mapped at a retired or deferred old
        // address (unmapped when retired memory is released; the caller
        // gave those bytes up with the free or shrink that pooled it),
        // never held by an allocation, a cached page or an export.
        let owned = |x: &&Hold| matches!(x, Hold::Backing { .. } | Hold::Exported { .. } | Hold::Cached { .. });
        if pooled > 1 || (pooled == 1 && list.iter().any(|x| owned(&x))) {
            return Err(format!("pooled chunk {h:?} has other holds: {list:?}"));
        }
        if cached.is_empty() {
            continue;
        }
        cached_pages.extend(cached.iter().copied());
        // A cached chunk may alias its own retired or deferred old address
        // (unmapped before it goes anywhere else), never a backing page or
        // an export.
        if let Some(x) = list.iter().find(|x| matches!(x, Hold::Backing { .. } | Hold::Exported { .. } | Hold::Pooled))
        {
            return Err(format!("cached chunk {h:?} (page {}) is also held: {x:?} (all: {list:?})", cached[0]));
        }
        if cached.len() > 1 {
            return Err(format!("chunk {h:?} is cached at several pages: {cached:?}"));
        }
    }
    // A cached page lies outside every live allocation's backed prefix.
    for (i, s) in st.slots.iter().enumerate() {
        let Some(a) = s.alloc.as_ref() else { continue };
        if let Some(p) = cached_pages.range(a.start..a.start + a.backed).next() {
            return Err(format!("cached page {p} lies in the backed prefix of slot {i}"));
        }
    }
    Ok(())
}
