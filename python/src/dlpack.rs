//! DLPack: the C structs of the protocol (dlpack.h, versions 0.x and 1.0),
//! the context each view keeps alive, and the deleters and capsule
//! destructors that release a view exactly once.

use std::ffi::{c_void, CStr};
use std::sync::Arc;

use super::Shared;

pub(crate) const KDLCPU: i32 = 1;
pub(crate) const KDLCUDA: i32 = 2;

#[repr(C)]
pub(crate) struct DLDevice {
    pub(crate) device_type: i32,
    pub(crate) device_id: i32,
}

#[repr(C)]
pub(crate) struct DLDataType {
    pub(crate) code: u8,
    pub(crate) bits: u8,
    pub(crate) lanes: u16,
}

#[repr(C)]
pub(crate) struct DLTensor {
    pub(crate) data: *mut c_void,
    pub(crate) device: DLDevice,
    pub(crate) ndim: i32,
    pub(crate) dtype: DLDataType,
    pub(crate) shape: *mut i64,
    pub(crate) strides: *mut i64,
    pub(crate) byte_offset: u64,
}

#[repr(C)]
pub(crate) struct DLManagedTensor {
    pub(crate) dl_tensor: DLTensor,
    pub(crate) manager_ctx: *mut c_void,
    pub(crate) deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
pub(crate) struct DLManagedTensorVersioned {
    pub(crate) version: [u32; 2],
    pub(crate) manager_ctx: *mut c_void,
    pub(crate) deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    pub(crate) flags: u64,
    pub(crate) dl_tensor: DLTensor,
}

/// The release of a versioned view (DLPack 1.0).
///
/// # Safety
/// `t` came from `Buffer::__dlpack__` and is released once.
pub(crate) unsafe extern "C" fn versioned_deleter(t: *mut DLManagedTensorVersioned) {
    if t.is_null() {
        return;
    }
    // SAFETY: made by Box::into_raw in __dlpack__, released once.
    let t = unsafe { Box::from_raw(t) };
    // SAFETY: manager_ctx is the Box<ViewCtx> made alongside it, released
    // with its tensor, once.
    unsafe { release_view_ctx(t.manager_ctx) };
}

pub(crate) const DLTENSOR_VERSIONED: &CStr = c"dltensor_versioned";

/// The destructor of a versioned capsule no consumer took.
pub(crate) unsafe extern "C" fn versioned_capsule_destructor(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: as capsule_destructor, for the versioned name.
    unsafe { release_untaken_capsule(capsule, DLTENSOR_VERSIONED, versioned_deleter) }
}

/// What one view keeps alive: its shape and the buffer's pin.
pub(crate) struct ViewCtx {
    pub(crate) shape: [i64; 1],
    pub(crate) shared: Arc<Shared>,
    pub(crate) id: u64,
}

/// The consumer's release of a view: unpins the buffer when it was the last.
///
/// # Safety
/// `t` came from `Buffer::__dlpack__` and is released once.
pub(crate) unsafe extern "C" fn view_deleter(t: *mut DLManagedTensor) {
    if t.is_null() {
        return;
    }
    // SAFETY: made by Box::into_raw in __dlpack__, released once (the
    // consumer's contract).
    let t = unsafe { Box::from_raw(t) };
    // SAFETY: manager_ctx is the Box<ViewCtx> made alongside it, released
    // with its tensor, once.
    unsafe { release_view_ctx(t.manager_ctx) };
}

/// Drops one view's context: the buffer's view count goes down by one
/// (unpinned when it was the last). A panic stays on this side of the C
/// boundary.
///
/// # Safety
/// `ctx` is the `Box<ViewCtx>` that `Buffer::__dlpack__` made for the view,
/// released once.
pub(crate) unsafe fn release_view_ctx(ctx: *mut c_void) {
    // SAFETY: the caller's contract.
    let ctx = unsafe { Box::from_raw(ctx.cast::<ViewCtx>()) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = ctx.shared.change(ctx.id, |p| p.views = p.views.saturating_sub(1));
    }));
}

pub(crate) const DLTENSOR: &CStr = c"dltensor";

/// The capsule's destructor: a capsule no consumer took (still named
/// "dltensor") releases its view.
pub(crate) unsafe extern "C" fn capsule_destructor(capsule: *mut pyo3::ffi::PyObject) {
    // SAFETY: called by Python with the capsule; its name decides whether a
    // consumer owns the tensor now ("used_dltensor").
    unsafe { release_untaken_capsule(capsule, DLTENSOR, view_deleter) }
}

/// A capsule still named `name` (no consumer took its tensor) releases its
/// tensor with `deleter`; a renamed one ("used_...") is the consumer's, and
/// the name check's error is cleared.
///
/// # Safety
/// `capsule` is a capsule being destroyed by Python, made by
/// `Buffer::__dlpack__` with a `T` that `deleter` releases under `name`.
pub(crate) unsafe fn release_untaken_capsule<T>(
    capsule: *mut pyo3::ffi::PyObject,
    name: &CStr,
    deleter: unsafe extern "C" fn(*mut T),
) {
    // SAFETY: the caller's contract: a live capsule; under `name` its
    // pointer is the `T` that `deleter` releases, released here once.
    unsafe {
        if pyo3::ffi::PyCapsule_IsValid(capsule, name.as_ptr()) == 1 {
            let t = pyo3::ffi::PyCapsule_GetPointer(capsule, name.as_ptr()).cast::<T>();
            deleter(t);
        } else {
            pyo3::ffi::PyErr_Clear();
        }
    }
}
