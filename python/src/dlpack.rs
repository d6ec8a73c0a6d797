//! DLPack: the C structs of the protocol (dlpack.h, versions 0.x and 1.0),
//! the context each view keeps alive, and the deleters and capsule
//! destructors that release a view exactly once.

use std::ffi::{c_void, CStr};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyCapsule;

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
/// `t` came from [`capsule`] and is released once.
pub(crate) unsafe extern "C" fn versioned_deleter(t: *mut DLManagedTensorVersioned) {
    if t.is_null() {
        return;
    }
    // SAFETY: made by Box::into_raw in `capsule`, released once.
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

/// What a view is of.
pub(crate) enum Viewed {
    /// A growable buffer (its id): the view pins it.
    Buffer(u64),
    /// The arena's whole reserved range (`Arena.range_view`): pins nothing,
    /// counted so that `close` waits for it.
    Range,
}

/// What one view keeps alive: its shape, the arena, and the buffer's pin.
pub(crate) struct ViewCtx {
    pub(crate) shape: [i64; 1],
    pub(crate) shared: Arc<Shared>,
    pub(crate) viewed: Viewed,
}

/// The consumer's release of a view: unpins the buffer when it was the last.
///
/// # Safety
/// `t` came from [`capsule`] and is released once.
pub(crate) unsafe extern "C" fn view_deleter(t: *mut DLManagedTensor) {
    if t.is_null() {
        return;
    }
    // SAFETY: made by Box::into_raw in `capsule`, released once (the
    // consumer's contract).
    let t = unsafe { Box::from_raw(t) };
    // SAFETY: manager_ctx is the Box<ViewCtx> made alongside it, released
    // with its tensor, once.
    unsafe { release_view_ctx(t.manager_ctx) };
}

/// Drops one view's context: the buffer's (or the range's) view count goes
/// down by one (a buffer is unpinned when it was its last). A panic stays on this side of the C
/// boundary.
///
/// # Safety
/// `ctx` is the `Box<ViewCtx>` that [`capsule`] made for the view,
/// released once.
pub(crate) unsafe fn release_view_ctx(ctx: *mut c_void) {
    // SAFETY: the caller's contract.
    let ctx = unsafe { Box::from_raw(ctx.cast::<ViewCtx>()) };
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match ctx.viewed {
        Viewed::Buffer(id) => {
            let _ = ctx.shared.change(id, |p| p.views = p.views.saturating_sub(1));
        }
        Viewed::Range => {
            let _ = ctx.shared.range_views.fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1));
        }
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
/// [`capsule`] with a `T` that `deleter` releases under `name`.
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

/// A DLPack capsule viewing `ctx.shape[0]` bytes at `data` on `device` as a
/// 1-D uint8 array, no copy; DLPack 1.0 (a writable view) when `versioned`.
/// `ctx` is released by the consumer's deleter, or by the capsule's
/// destructor when no consumer takes it, or here on failure: the view count
/// the caller raised for it always comes down once.
pub(crate) fn capsule(
    py: Python<'_>,
    data: u64,
    device: DLDevice,
    ctx: ViewCtx,
    versioned: bool,
) -> PyResult<Bound<'_, PyAny>> {
    let ctx = Box::into_raw(Box::new(ctx));
    // SAFETY: ctx is a live Box until the deleter frees it.
    let shape = unsafe { (*ctx).shape.as_mut_ptr() };
    let tensor = DLTensor {
        data: data as *mut c_void,
        device,
        ndim: 1,
        dtype: DLDataType { code: 1, bits: 8, lanes: 1 }, // kDLUInt, 8 bits
        shape,
        strides: std::ptr::null_mut(),
        byte_offset: 0,
    };
    let cap = if versioned {
        let t = Box::into_raw(Box::new(DLManagedTensorVersioned {
            version: [1, 0],
            manager_ctx: ctx.cast(),
            deleter: Some(versioned_deleter),
            flags: 0,
            dl_tensor: tensor,
        }));
        // SAFETY: a valid pointer, a static name and a destructor that
        // releases the tensor unless a consumer took it.
        let cap = unsafe {
            pyo3::ffi::PyCapsule_New(t.cast(), DLTENSOR_VERSIONED.as_ptr(), Some(versioned_capsule_destructor))
        };
        if cap.is_null() {
            // SAFETY: not handed to anyone.
            unsafe { versioned_deleter(t) };
            return Err(PyErr::fetch(py));
        }
        cap
    } else {
        let t = Box::into_raw(Box::new(DLManagedTensor {
            dl_tensor: tensor,
            manager_ctx: ctx.cast(),
            deleter: Some(view_deleter),
        }));
        // SAFETY: as above, legacy name.
        let cap = unsafe { pyo3::ffi::PyCapsule_New(t.cast(), DLTENSOR.as_ptr(), Some(capsule_destructor)) };
        if cap.is_null() {
            // SAFETY: not handed to anyone.
            unsafe { view_deleter(t) };
            return Err(PyErr::fetch(py));
        }
        cap
    };
    // SAFETY: a new reference just made.
    let cap = unsafe { Bound::from_owned_ptr(py, cap) };
    let _: &Bound<'_, PyCapsule> = cap.downcast()?;
    Ok(cap)
}
