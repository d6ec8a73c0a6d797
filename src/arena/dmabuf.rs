//! DMA-BUF handles: one descriptor for an allocation's backed bytes
//! (`cuMemGetHandleForAddressRange`), for RDMA stacks to register (NIXL,
//! UCX, Mooncake's transfer engine).
//!
//! A DMA-BUF reaches the *physical* chunks behind the range when it was
//! made, not the addresses: if those chunks went back to the pool, the
//! next allocation they back would be readable and writable through it
//! (and through any network card registration made from it). So a
//! [`DmaBuf`] is a handle, closed by dropping it, and the arena keeps its
//! chunks out of reach while any is open:
//! - the allocation is *exported* from the first DMA-BUF on (the
//!   bookkeeping of `arena/export.rs`): pinned while a DMA-BUF or an export
//!   is open, never asleep (`sleep` leaves it awake), never shrunk below
//!   the chunks handed out (`InvalidArgument`), its chunks never pooled;
//! - a `free` while a DMA-BUF is open keeps the chunks mapped where they
//!   are, in an allocation no id names (`Owner::DmaBuf`, still counted in
//!   `mapped_bytes` and against the capacity); the first operation after
//!   the last DMA-BUF closes (an alloc, free, resize, trim...; not `stats`
//!   or `query`) unmaps them and gives them back to the driver, never to
//!   the pool.
//!
//! Closing a handle is the caller's word that no device reaches the memory
//! through it any more: deregister the memory (`ibv_dereg_mr`) first.
//! Dropping the arena releases every chunk, held ones included: close the
//! DMA-BUFs before.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

use crate::error::Result;
use crate::Id;

use super::export::free_exported;
use super::state::{Owner, State};
use super::{Arena, Ctx, Inner};

/// An open DMA-BUF of an allocation ([`Arena::dmabuf`]). The descriptor
/// is this value's (close-on-exec); dropping it closes the descriptor and
/// lets the arena reuse the chunks once no other DMA-BUF of them is open.
#[derive(Debug)]
pub struct DmaBuf {
    fd: OwnedFd,
    bytes: u64,
    _pin: Arc<()>,
    _hold: Arc<()>,
}

impl DmaBuf {
    /// The descriptor to register (borrowed: it stays this handle's).
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Bytes it spans: the allocation's backed chunks when it was made.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Arena {
    /// A DMA-BUF of an allocation's backed chunks (see the module docs):
    /// **GPU only**, `Unsupported` on the host backend (whose test
    /// stand-in, `HostDriver::with_dmabuf_standin`, keeps the same books).
    /// Errors as [`Arena::export`] (small allocations, imports, sharers,
    /// `Asleep`), and the driver's; on error nothing changed.
    pub fn dmabuf(&self, id: Id) -> Result<DmaBuf> {
        let chunk = self.chunk;
        let (fd, layout, pin, hold) =
            self.hand_out(id, "given a DMA-BUF", |ctx, sim, a| ctx.drv.dmabuf_fd(sim.addr(a.start), a.backed * chunk))?;
        Ok(DmaBuf { fd, bytes: layout.chunk_count * chunk, _pin: pin, _hold: hold })
    }

    /// A DMA-BUF descriptor the caller owns, with no handle to close: the
    /// arena cannot know when the device is done with it, so the allocation
    /// stays pinned and its chunks stay out of reuse (a free keeps them)
    /// until the arena is dropped. Prefer [`Arena::dmabuf`].
    pub fn dmabuf_fd(&self, id: Id) -> Result<OwnedFd> {
        let DmaBuf { fd, _pin, _hold, .. } = self.dmabuf(id)?;
        let mut inner = self.lock()?;
        inner.shares.kept.push((_pin, _hold));
        Ok(fd)
    }
}

/// The books of a free while a DMA-BUF is open: no id names the allocation
/// any more, and it keeps its pages and chunks until [`reap`] finishes it.
pub(super) fn hold(st: &mut State, slot: u32) {
    let a = st.alloc(slot);
    st.live_bytes -= a.size;
    st.live_count -= 1;
    let m = st.alloc_mut(slot);
    m.owner = Owner::DmaBuf;
    st.prefetch_dirty = true;
}

/// Finishes the frees whose last DMA-BUF has closed: unmaps their chunks
/// and gives them back to the driver. One that fails stays held, retried
/// by the next call.
pub(super) fn reap(inner: &mut Inner, ctx: &Ctx<'_>) {
    let ready: Vec<u32> = inner.shares.held.iter().copied().filter(|&s| !inner.shares.dmabuf_open(s)).collect();
    for slot in ready {
        let _ = free_exported(inner, ctx, slot);
    }
}
