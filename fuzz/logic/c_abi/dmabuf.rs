//! The C ABI target's DMA-BUF calls (a child of `c_abi.rs`, which
//! dispatches to them): `vmm_arena_dmabuf_open` of a picked id (on an
//! arena made by `vmm_arena_testing_create_faulty`, whose host driver has
//! the DMA-BUF stand-in; the plain host backend answers UNSUPPORTED),
//! `vmm_arena_dmabuf_fd`, and `vmm_arena_dmabuf_close` of an open one.
//!
//! From the first one on, its allocation is exported until freed: sleep
//! passes it by and alloc_shared refuses it as a source. While one is open
//! it never moves; a free keeps its chunks mapped (counted in mapped_bytes,
//! which the step's `check` holds to the driver's chunks) until the last
//! one closes; the teardown closes them all before it frees.

use std::ptr::null_mut;

use super::{ffi, st, Bytes, Harness, ASLEEP, DRIVER, INVALID, OK, OOM, UNKNOWN, UNSUPPORTED};

/// An open DMA-BUF handle and the allocation it was made of.
pub(super) struct OpenDmaBuf {
    pub(super) handle: *mut ffi::vmm_arena_dmabuf,
    pub(super) id: u64,
}

impl Harness {
    /// One DMA-BUF call: open (`which` even) or close. Returns (what,
    /// status, allowed).
    pub(super) fn dmabuf(&mut self, b: &mut Bytes<'_>, which: u8) -> (&'static str, u32, Vec<u32>) {
        if which % 2 == 1 && !self.dmabufs.is_empty() {
            let i = b.below(self.dmabufs.len() as u64) as usize;
            let d = self.dmabufs.remove(i);
            let (mut fd, mut bytes) = (-1i32, 0u64);
            // SAFETY: a live DMA-BUF handle; out-parameters are ours.
            let s = st(unsafe { ffi::vmm_arena_dmabuf_fd(d.handle, &mut fd, &mut bytes) });
            assert!(s == OK && fd >= 0 && bytes > 0 && bytes % self.chunk == 0, "dmabuf_fd: {s} {fd} {bytes}");
            // SAFETY: a live handle, given up here.
            unsafe { ffi::vmm_arena_dmabuf_close(d.handle) };
            if !self.live.contains_key(&d.id) && !self.dmabufs.iter().any(|o| o.id == d.id) {
                // The last DMA-BUF of a freed allocation: the arena's next
                // operation gives its chunks back, a failed one included.
                self.reap_possible = true;
            }
            return ("dmabuf_close", OK, vec![OK]);
        }
        let id = self.pick_id(b);
        let null_out = b.below(16) == 0;
        let mut h: *mut ffi::vmm_arena_dmabuf = 0xA5A5 as *mut _;
        let out = if null_out { null_mut() } else { &mut h as *mut _ };
        // SAFETY: live handle; the out-parameter is ours or NULL.
        let status = st(unsafe { ffi::vmm_arena_dmabuf_open(self.a, id, out) });
        let allowed = match self.live.get(&id) {
            _ if null_out => vec![INVALID],
            None => vec![UNKNOWN, INVALID],
            // Small ones and sharers' are INVALID_ARGUMENT.
            Some(l) if l.asleep => vec![ASLEEP, INVALID],
            Some(_) if !self.faulty => vec![UNSUPPORTED, INVALID],
            Some(_) => vec![OK, INVALID, OOM, DRIVER],
        };
        if status == OK {
            self.dmabufs.push(OpenDmaBuf { handle: h, id });
            self.exported.insert(id);
        } else {
            assert_eq!(h, 0xA5A5 as *mut _, "dmabuf_open: out-parameter written on failure");
        }
        ("dmabuf_open", status, allowed)
    }
}
