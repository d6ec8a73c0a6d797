//! Contexts and pinned memory: the primary context retained once and made
//! current per call (restoring a caller's own context), and page-locked
//! host buffers that hold a share of it.
#![allow(unsafe_code)]

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::sync::Arc;

use cudarc::driver::sys;

use super::raw::Lib;
use crate::driver::HostMemory;
use crate::error::Result;
/// Restores the calling thread's previous context (none, or another one)
/// when dropped, unless it was ours already.
pub(super) struct CurrentCtx {
    lib: Lib,
    restore: Option<sys::CUcontext>,
}

impl Drop for CurrentCtx {
    fn drop(&mut self) {
        if let Some(prev) = self.restore.take() {
            // Best effort: failing to restore a foreign context must not
            // turn a finished call into an error, and Drop must not panic.
            let _ = self.lib.ctx_set_current(prev);
        }
    }
}

/// The device's primary context, retained once; released when the last
/// owner (the driver, or a pinned host buffer) drops it.
#[derive(Debug)]
pub(super) struct PrimaryContext {
    pub(super) lib: Lib,
    pub(super) device: sys::CUdevice,
    pub(super) ctx: sys::CUcontext,
}

// SAFETY: a context handle may be made current and used on any thread (the
// driver API is thread-safe); `PrimaryContext` only passes it to the driver.
unsafe impl Send for PrimaryContext {}
// SAFETY: as for `Send`: shared access only reads the plain fields.
unsafe impl Sync for PrimaryContext {}

impl PrimaryContext {
    /// Makes the context current on this thread until the guard drops.
    pub(super) fn enter(&self) -> Result<CurrentCtx> {
        let prev = self.lib.ctx_get_current()?;
        if prev == self.ctx {
            return Ok(CurrentCtx { lib: self.lib, restore: None });
        }
        self.lib.ctx_set_current(self.ctx)?;
        // The thread gets back what it had, also when that was no context:
        // left current, ours would outlive the last arena on this thread,
        // and once its last reference is released (the driver then resets
        // it) the thread's next driver call would fail with
        // CUDA_ERROR_CONTEXT_IS_DESTROYED.
        Ok(CurrentCtx { lib: self.lib, restore: Some(prev) })
    }
}

impl Drop for PrimaryContext {
    fn drop(&mut self) {
        let lib = self.lib;
        let device = self.device;
        // Best effort and never a panic: the release symbol was resolved by
        // `Lib::load`, and the guard catches anything unforeseen.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            let _ = lib.primary_ctx_release(device);
        }));
    }
}

/// Page-locked host memory from `cuMemHostAlloc`, zeroed when made, freed
/// with `cuMemFreeHost` on drop. It holds the context it belongs to, so the
/// memory stays valid as long as the buffer, whether or not the driver does.
#[derive(Debug)]
pub(super) struct PinnedHostMemory {
    ctx: Arc<PrimaryContext>,
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the buffer exclusively owns `len` bytes of host memory at `ptr`
// (like a `Box<[u8]>`); host memory may be used and freed from any thread,
// and the context it holds is `Send + Sync`.
unsafe impl Send for PinnedHostMemory {}
// SAFETY: shared access only reads the bytes (`bytes`); writing needs
// `&mut self`.
unsafe impl Sync for PinnedHostMemory {}

impl PinnedHostMemory {
    /// `len` (> 0) zeroed bytes of pinned memory owned by `ctx`.
    pub(super) fn new(ctx: &Arc<PrimaryContext>, len: usize) -> Result<PinnedHostMemory> {
        let ptr = {
            let _cur = ctx.enter()?;
            ctx.lib.mem_host_alloc(len)?
        };
        // SAFETY: `ptr` points to `len` writable bytes just allocated for
        // this buffer alone; zeroing makes every byte initialised, as
        // `bytes` requires.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(PinnedHostMemory { ctx: Arc::clone(ctx), ptr, len })
    }
}

impl HostMemory for PinnedHostMemory {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes (zeroed in `new`)
        // owned by `self` until `Drop`; the borrow of `self` bounds the slice.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn pinned(&self) -> bool {
        true
    }
}

impl Drop for PinnedHostMemory {
    fn drop(&mut self) {
        let (ctx, ptr) = (&self.ctx, self.ptr);
        // Best effort and never a panic. The context is alive (held by
        // `self.ctx`) and made current for the free, as cuMemFreeHost wants.
        // Should it fail, the memory goes when the context is destroyed.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            if let Ok(_cur) = ctx.enter() {
                let _ = ctx.lib.mem_free_host(ptr);
            }
        }));
    }
}
