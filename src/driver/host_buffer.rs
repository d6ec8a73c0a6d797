//! Host memory that a backend lends for copies to and from the device: the
//! backups of sleeping allocations ([`crate::Arena::sleep`]).
//!
//! A [`HostBuffer`] owns its bytes and frees them when dropped, however long
//! it outlives the call that made it. What the bytes are depends on the
//! backend, through [`Driver::alloc_host`](super::Driver::alloc_host):
//! ordinary (pageable) memory by default, page-locked memory from
//! `cuMemHostAlloc` on CUDA, which the device copies at full bus speed
//! without staging. The policy sees only bytes.

use crate::error::{Error, Result};

/// The memory behind a [`HostBuffer`], as a backend provides it.
///
/// Implementations free their memory in `Drop`, which must not panic, and
/// keep alive whatever the freeing needs (a CUDA context, for pinned memory).
pub trait HostMemory: Send + Sync + std::fmt::Debug {
    /// The bytes, all initialised.
    fn bytes(&self) -> &[u8];

    /// The bytes, writable.
    fn bytes_mut(&mut self) -> &mut [u8];

    /// Whether the memory is page-locked (the device copies it without staging).
    fn pinned(&self) -> bool;
}

/// Ordinary heap memory: the default backing.
impl HostMemory for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        self
    }
    fn pinned(&self) -> bool {
        false
    }
}

/// An owned run of host bytes from a backend, zeroed when made; freed on drop.
pub struct HostBuffer(Box<dyn HostMemory>);

impl HostBuffer {
    /// Wraps a backend's memory.
    pub fn new(memory: Box<dyn HostMemory>) -> HostBuffer {
        HostBuffer(memory)
    }

    /// `len` zeroed bytes of ordinary heap memory, or `Error::OutOfMemory`
    /// when the host has none (never an abort).
    pub fn pageable(len: usize) -> Result<HostBuffer> {
        let mut v = Vec::new();
        v.try_reserve_exact(len)
            .map_err(|_| Error::OutOfMemory(format!("no host memory for a buffer of {len} bytes")))?;
        v.resize(len, 0);
        Ok(HostBuffer(Box::new(v)))
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        self.0.bytes()
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        self.0.bytes_mut()
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether it holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the memory is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.0.pinned()
    }
}

impl std::fmt::Debug for HostBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostBuffer").field("len", &self.len()).field("pinned", &self.is_pinned()).finish()
    }
}

/// Equal when the bytes are (where the memory lives does not matter).
impl PartialEq for HostBuffer {
    fn eq(&self, other: &HostBuffer) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for HostBuffer {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pageable_buffers_are_zeroed_writable_and_compare_by_bytes() {
        let mut a = HostBuffer::pageable(5).unwrap();
        assert_eq!((a.len(), a.is_pinned(), a.as_slice()), (5, false, &[0u8; 5][..]));
        a.as_mut_slice().copy_from_slice(b"hello");
        let b = HostBuffer::new(Box::new(b"hello".to_vec()));
        assert_eq!(a, b);
        assert!(HostBuffer::pageable(0).unwrap().is_empty());
    }

    #[test]
    fn an_impossible_size_is_out_of_memory_not_an_abort() {
        assert!(matches!(HostBuffer::pageable(usize::MAX), Err(Error::OutOfMemory(_))));
    }
}
