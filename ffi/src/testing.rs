//! Testing hooks for the C test programs: not part of the ABI contract and
//! left out of the generated header (declare them yourself; they may change
//! in any version). They make the statuses that the host backend cannot
//! produce on demand (`VMM_ARENA_ERR_DRIVER`, a caught panic) reachable from
//! C, so the boundary's behaviour is tested where it matters.

use std::sync::Arc;

use arena::driver::fault::{FaultDriver, FaultKind};
use arena::driver::host::HostDriver;
use arena::driver::CallKind;
use arena::{Arena, Error, Group};

use crate::group::{publish_group, vmm_arena_group};
use crate::{arena_config, boundary, handle, invalid, publish, read_config, required, vmm_arena, vmm_arena_config};
use crate::{vmm_arena_backend, vmm_arena_status};

/// Like `vmm_arena_create`, on the host backend wrapped in a fault injector
/// (`config->backend` must be `VMM_ARENA_BACKEND_HOST`), with the host
/// driver's DMA-BUF stand-in on (`vmm_arena_dmabuf_open` works; read and
/// write through a DMA-BUF with `vmm_arena_testing_dmabuf_io`).
///
/// # Safety
/// As for `vmm_arena_create`.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_testing_create_faulty(
    config: *const vmm_arena_config,
    out: *mut *mut vmm_arena,
) -> vmm_arena_status {
    boundary("vmm_arena_testing_create_faulty", std::ptr::null(), || {
        // SAFETY: per this function's contract.
        let c = unsafe { read_config(config) }?;
        let out = required(out, "out")?;
        if c.backend != vmm_arena_backend::VMM_ARENA_BACKEND_HOST as u32 {
            return Err(invalid("a faulty arena needs the host backend"));
        }
        let host = match c.flags & crate::VMM_ARENA_FLAG_EXPORTABLE {
            0 => HostDriver::new()?,
            _ => HostDriver::with_exportable_chunks(Default::default())?,
        };
        let fault = Arc::new(FaultDriver::new(host.with_dmabuf_standin()));
        let arena = Arena::with_driver(Arc::clone(&fault), arena_config(&c)?)?;
        // SAFETY: `out` was checked and is writable per this function's contract.
        unsafe { publish(arena, Some(fault), out) }
    })
}

/// Makes the `n`th driver call from now (1-based) of `call_kind` fail:
/// `call_kind` 0 = any call, 1.. = reserve, free_reservation, create,
/// release, map, set_access, unmap, synchronize, data, event, host_alloc,
/// share; `fault` 0 = out of memory, 1 = a driver error. `n` 0 clears the
/// plan. INVALID_ARGUMENT for an arena not made by
/// `vmm_arena_testing_create_faulty`.
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_testing_fail_nth(
    arena: *mut vmm_arena,
    call_kind: u32,
    n: u64,
    fault: u32,
) -> vmm_arena_status {
    boundary("vmm_arena_testing_fail_nth", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let f = h.fault.as_ref().ok_or_else(|| invalid("not a faulty arena"))?;
        let kind = match call_kind {
            0 => None,
            k => Some(*CallKind::ALL.get(k as usize - 1).ok_or_else(|| invalid("unknown call kind"))?),
        };
        let fault = *FaultKind::ALL.get(fault as usize).ok_or_else(|| invalid("unknown fault kind"))?;
        if n == 0 {
            f.clear();
        } else {
            f.fail_nth(kind, n, fault);
        }
        Ok(())
    })
}

/// Chunks and mappings alive on the driver's side of a faulty arena.
///
/// # Safety
/// `arena` is NULL or a live handle; the out-parameters are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_testing_driver_objects(
    arena: *mut vmm_arena,
    out_chunks: *mut u64,
    out_mappings: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_testing_driver_objects", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let (oc, om) = (required(out_chunks, "out_chunks")?, required(out_mappings, "out_mappings")?);
        let f = h.fault.as_ref().ok_or_else(|| invalid("not a faulty arena"))?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            crate::put(oc, f.live_chunks() as u64);
            crate::put(om, f.live_mappings() as u64);
        }
        Ok(())
    })
}

/// Panics inside the boundary, as a bug in the library would: returns
/// `VMM_ARENA_ERR_INTERNAL` and poisons the arena (when not NULL).
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_testing_panic(arena: *mut vmm_arena) -> vmm_arena_status {
    boundary("vmm_arena_testing_panic", arena, || -> Result<(), Error> {
        panic!("vmm_arena_testing_panic was called");
    })
}

/// Driver calls made through a faulty arena's injector so far (every kind,
/// counted whether they failed or not), and failures injected so far: a
/// test counts the calls of an operation, then fails each in turn, and
/// checks that the planned failure did fire.
///
/// # Safety
/// `arena` is NULL or a live handle; the out-parameters are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_testing_driver_calls(
    arena: *mut vmm_arena,
    out_calls: *mut u64,
    out_injected: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_testing_driver_calls", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let (oc, oi) = (required(out_calls, "out_calls")?, required(out_injected, "out_injected")?);
        let f = h.fault.as_ref().ok_or_else(|| invalid("not a faulty arena"))?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            crate::put(oc, f.total_calls());
            crate::put(oi, f.injected());
        }
        Ok(())
    })
}

/// Like `vmm_arena_group_create` with `count` members on the host backend,
/// each wrapped in a fault injector of its own (`config->backend` must be
/// `VMM_ARENA_BACKEND_HOST`).
///
/// # Safety
/// As for `vmm_arena_group_create`.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_testing_group_create_faulty(
    config: *const vmm_arena_config,
    count: u32,
    out: *mut *mut vmm_arena_group,
) -> vmm_arena_status {
    boundary("vmm_arena_testing_group_create_faulty", std::ptr::null(), || {
        // SAFETY: per this function's contract.
        let c = unsafe { read_config(config) }?;
        let out = required(out, "out")?;
        if c.backend != vmm_arena_backend::VMM_ARENA_BACKEND_HOST as u32 {
            return Err(invalid("a faulty group needs the host backend"));
        }
        let cfg = arena_config(&c)?;
        let mut faults = Vec::new();
        let mut arenas = Vec::new();
        for _ in 0..count {
            let fault = Arc::new(FaultDriver::new(HostDriver::new()?));
            arenas.push(Arena::with_driver(Arc::clone(&fault), cfg)?);
            faults.push(fault);
        }
        let group = Group::from_arenas(arenas)?;
        // SAFETY: `out` was checked and is writable per this function's contract.
        unsafe { publish_group(group, faults, out) };
        Ok(())
    })
}

/// The fault injector of member `member` of a faulty group.
///
/// # Safety
/// `group` is NULL or a live handle.
unsafe fn member_fault<'a>(group: *mut vmm_arena_group, member: u32) -> Result<&'a FaultDriver<HostDriver>, Error> {
    // SAFETY: per this function's contract.
    let h = unsafe { group.as_ref() }.ok_or_else(|| invalid("group is NULL"))?;
    h.faults.get(member as usize).map(|f| &**f).ok_or_else(|| invalid("not a faulty group, or no such member"))
}

/// `vmm_arena_testing_fail_nth` for member `member` of a faulty group.
///
/// # Safety
/// `group` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_testing_group_fail_nth(
    group: *mut vmm_arena_group,
    member: u32,
    call_kind: u32,
    n: u64,
    fault: u32,
) -> vmm_arena_status {
    boundary("vmm_arena_testing_group_fail_nth", std::ptr::null(), || {
        // SAFETY: per this function's contract.
        let f = unsafe { member_fault(group, member) }?;
        let kind = match call_kind {
            0 => None,
            k => Some(*CallKind::ALL.get(k as usize - 1).ok_or_else(|| invalid("unknown call kind"))?),
        };
        let fault = *FaultKind::ALL.get(fault as usize).ok_or_else(|| invalid("unknown fault kind"))?;
        if n == 0 {
            f.clear();
        } else {
            f.fail_nth(kind, n, fault);
        }
        Ok(())
    })
}

/// Driver calls so far, failures injected so far, and chunks and mappings
/// alive, of member `member` of a faulty group (every out-parameter required).
///
/// # Safety
/// `group` is NULL or a live handle; the out-parameters are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_testing_group_driver_state(
    group: *mut vmm_arena_group,
    member: u32,
    out_calls: *mut u64,
    out_injected: *mut u64,
    out_chunks: *mut u64,
    out_mappings: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_testing_group_driver_state", std::ptr::null(), || {
        let (oc, oi) = (required(out_calls, "out_calls")?, required(out_injected, "out_injected")?);
        let (ok, om) = (required(out_chunks, "out_chunks")?, required(out_mappings, "out_mappings")?);
        // SAFETY: per this function's contract.
        let f = unsafe { member_fault(group, member) }?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            crate::put(oc, f.total_calls());
            crate::put(oi, f.injected());
            crate::put(ok, f.live_chunks() as u64);
            crate::put(om, f.live_mappings() as u64);
        }
        Ok(())
    })
}

/// Reads (`write` 0) or writes (`write` 1) `len` bytes at `offset` of the
/// memory a stand-in DMA-BUF of a faulty arena reaches, as a device
/// registered with it would.
///
/// # Safety
/// `arena` is NULL or a live handle; `buf` is NULL or has `len` bytes,
/// writable when reading.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_testing_dmabuf_io(
    arena: *mut vmm_arena,
    fd: i32,
    offset: u64,
    buf: *mut u8,
    len: usize,
    write: u32,
) -> vmm_arena_status {
    boundary("vmm_arena_testing_dmabuf_io", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let f = h.fault.as_ref().ok_or_else(|| invalid("not a faulty arena"))?;
        let p = required(buf, "buf")?;
        if fd < 0 {
            return Err(invalid("fd is negative"));
        }
        // SAFETY: the caller keeps `fd` open for this call; it is only borrowed.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        // SAFETY: `buf` has `len` bytes per this function's contract.
        let bytes = unsafe { std::slice::from_raw_parts_mut(p.as_ptr(), len) };
        match write {
            0 => f.inner().standin_dmabuf_read(fd, offset, bytes)?,
            _ => f.inner().standin_dmabuf_write(fd, offset, bytes)?,
        }
        Ok(())
    })
}
