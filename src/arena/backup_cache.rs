//! Sleep backups kept across sleep cycles (`Arena::set_backup_cache`).
//!
//! A sleep with a backup copies each sleeper's bytes into a host buffer the
//! driver lends (`Driver::alloc_host`: page-locked memory from
//! `cuMemHostAlloc` on CUDA), and a wake frees it. In an RL loop that
//! sleeps and wakes the same tensors every step, those page-locked
//! allocations and frees are most of a wake's cost (users of other sleep
//! tools report resume times falling several-fold when the pinned buffer is
//! kept). With the cache on, a wake keeps each spent buffer here instead of
//! freeing it, and the next sleep takes one of exactly the size it needs:
//! after the first cycle of a steady loop, sleeps allocate no host memory.
//! Exact sizes keep a backup's length its sleeper's size, which the wake
//! and the stats rely on. `Arena::release_backup_cache` gives the host
//! memory back; turning the cache off does too.

use std::collections::BTreeMap;

use crate::driver::HostBuffer;

/// Spent backup buffers, by length.
#[derive(Debug, Default)]
pub(crate) struct BackupCache {
    /// Whether wakes keep their spent buffers here.
    pub keep: bool,
    by_len: BTreeMap<usize, Vec<HostBuffer>>,
    bytes: u64,
}

impl BackupCache {
    /// A kept buffer of exactly `len` bytes, if any.
    pub fn take(&mut self, len: usize) -> Option<HostBuffer> {
        let list = self.by_len.get_mut(&len)?;
        let buf = list.pop()?;
        if list.is_empty() {
            self.by_len.remove(&len);
        }
        self.bytes -= len as u64;
        Some(buf)
    }

    /// Keeps `buf` for a later sleep (dropped, that is freed, when the
    /// cache is off).
    pub fn put(&mut self, buf: HostBuffer) {
        if !self.keep {
            return;
        }
        self.bytes += buf.len() as u64;
        self.by_len.entry(buf.len()).or_default().push(buf);
    }

    /// Frees every kept buffer; returns their bytes.
    pub fn clear(&mut self) -> u64 {
        self.by_len.clear();
        std::mem::take(&mut self.bytes)
    }

    /// Bytes kept.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn takes_only_exact_sizes_and_counts_bytes() {
        let mut c = BackupCache { keep: true, ..Default::default() };
        c.put(HostBuffer::pageable(100).unwrap());
        c.put(HostBuffer::pageable(100).unwrap());
        c.put(HostBuffer::pageable(64).unwrap());
        assert_eq!(c.bytes(), 264);
        assert!(c.take(99).is_none());
        assert_eq!(c.take(100).map(|b| b.len()), Some(100));
        assert_eq!(c.bytes(), 164);
        assert_eq!(c.clear(), 164);
        assert!(c.take(64).is_none());
        let mut off = BackupCache::default();
        off.put(HostBuffer::pageable(8).unwrap());
        assert_eq!(off.bytes(), 0, "a cache that is off keeps nothing");
    }
}
