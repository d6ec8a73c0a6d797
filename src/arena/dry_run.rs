//! A driver that does nothing and never fails, for running an operation's
//! planning on a copy of the books first: its refusals (out of memory, out
//! of address space, pinned) then come before any real driver call, so a
//! refusal never needs a rollback (whose own calls could fail and leave
//! the arena unlike its books). Plans depend on the books only, so the
//! real run meets no refusal the dry run did not.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::driver::{ChunkHandle, Driver, Granularity};
use crate::error::Result;

/// Hands out handles from 2^63 up (apart from any real driver's, which the
/// copied books hold), accepts every call and moves no byte.
#[derive(Debug)]
pub(super) struct DryRun {
    next: AtomicU64,
    chunk: u64,
}

impl DryRun {
    pub(super) fn new(chunk: u64) -> DryRun {
        DryRun { next: AtomicU64::new(1 << 63), chunk }
    }
}

impl Driver for DryRun {
    fn name(&self) -> &'static str {
        "dry run"
    }
    fn granularity(&self) -> Result<Granularity> {
        Ok(Granularity { minimum: self.chunk, recommended: self.chunk })
    }
    fn total_memory(&self) -> Result<u64> {
        Ok(u64::MAX)
    }
    fn reserve(&self, _size: u64, _align: u64) -> Result<u64> {
        Ok(0)
    }
    fn free_reservation(&self, _base: u64, _size: u64) -> Result<()> {
        Ok(())
    }
    fn create(&self, _size: u64) -> Result<ChunkHandle> {
        Ok(ChunkHandle(self.next.fetch_add(1, Ordering::Relaxed)))
    }
    fn release(&self, _chunk: ChunkHandle) -> Result<()> {
        Ok(())
    }
    fn map(&self, _addr: u64, _size: u64, _chunk: ChunkHandle, _offset: u64) -> Result<()> {
        Ok(())
    }
    fn set_access(&self, _addr: u64, _size: u64) -> Result<()> {
        Ok(())
    }
    fn unmap(&self, _addr: u64, _size: u64) -> Result<()> {
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn read(&self, _addr: u64, _dst: &mut [u8]) -> Result<()> {
        Ok(())
    }
    fn write(&self, _addr: u64, _src: &[u8]) -> Result<()> {
        Ok(())
    }
    fn copy(&self, _dst: u64, _src: u64, _len: u64) -> Result<()> {
        Ok(())
    }
}
