//! The C ABI of device groups (`vmm_arena_group_*`): one arena per device
//! of a tensor-parallel group, allocations on every member at once, all or
//! nothing. See `vmm_arena::group` for the semantics; the conventions of
//! the rest of the header apply (statuses, out-parameters written only on
//! VMM_ARENA_OK, the panic boundary, last error).

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use arena::driver::fault::FaultDriver;
use arena::driver::host::HostDriver;
use arena::{Error, Group, GroupConfig, GroupError, GroupId};

use crate::{
    arena_config, boundary_with, c_stats, invalid, optional, put, read_config, required, vmm_arena_config,
    vmm_arena_id, vmm_arena_stats, vmm_arena_status,
};

/// vmm_arena_group_create flag: on the CUDA backend, every member's chunks
/// are made readable and writable from every other device of the group
/// (one access descriptor per device in each cuMemSetAccess; peer access
/// enabled through the runtime API does not reach these mappings). A pair
/// of devices without peer access is VMM_ARENA_ERR_UNSUPPORTED. No effect
/// on the host backend.
pub const VMM_ARENA_GROUP_PEER_ACCESS: u32 = 1u32;

const KNOWN_GROUP_FLAGS: u32 = VMM_ARENA_GROUP_PEER_ACCESS;

/// Names one group allocation for the group's lifetime; 0 is never issued
/// and an id is never reused.
pub type vmm_arena_group_id = u64;

/// Opaque device group: one arena per device.
///
/// Thread safety: a group may be used from many threads at once. Calls on
/// different group allocations run concurrently (each member arena
/// serializes its own calls); calls on one group allocation are serialized
/// by a lock of its own, so each sees the others' results whole. A
/// member's move callback must not call into the group (INVALID_ARGUMENT).
/// vmm_arena_group_destroy must not race with any other call on the group.
pub struct vmm_arena_group {
    pub(crate) group: Group,
    poisoned: AtomicBool,
    /// The fault injectors under a testing group, one per member.
    pub(crate) faults: Vec<Arc<FaultDriver<HostDriver>>>,
}

thread_local! {
    /// The member named by this thread's last failing group call; -1 when
    /// it named none.
    static LAST_MEMBER: Cell<i32> = const { Cell::new(-1) };
}

/// Runs a group function's body inside the panic boundary; a failure
/// records the member it names (or -1) for vmm_arena_group_last_member.
fn group_boundary(
    func: &'static str,
    group: *const vmm_arena_group,
    body: impl FnOnce() -> Result<(), GroupError>,
) -> vmm_arena_status {
    let mut member: Option<usize> = None;
    let status = boundary_with(
        func,
        || {
            // SAFETY: `group` is NULL or a live handle: every caller passes
            // its own `group` argument, which its contract requires to be so.
            if let Some(h) = unsafe { group.as_ref() } {
                h.poisoned.store(true, Ordering::SeqCst);
            }
        },
        "group",
        || {
            body().map_err(|e| {
                member = e.member;
                Error::from(e)
            })
        },
    );
    if status != vmm_arena_status::VMM_ARENA_OK {
        let m = member.and_then(|m| i32::try_from(m).ok()).unwrap_or(-1);
        let _ = LAST_MEMBER.try_with(|c| c.set(m));
    }
    status
}

fn plain(e: Error) -> GroupError {
    GroupError { member: None, error: e, undo_failures: Vec::new() }
}

/// The handle behind `group`, or INVALID_ARGUMENT for NULL. Its poison is
/// checked by [`vmm_arena_group::live`], after the call's own arguments.
///
/// # Safety
/// `group` is NULL or a handle from `vmm_arena_group_create` not yet
/// destroyed, and it outlives `'a`.
pub(crate) unsafe fn handle<'a>(group: *const vmm_arena_group) -> Result<&'a vmm_arena_group, GroupError> {
    // SAFETY: non-NULL means a live handle, per this function's contract.
    unsafe { group.as_ref() }.ok_or_else(|| plain(invalid("group is NULL")))
}

impl vmm_arena_group {
    /// The group, unless a caught panic poisoned it.
    pub(crate) fn live(&self) -> Result<&Group, GroupError> {
        if self.poisoned.load(Ordering::SeqCst) {
            return Err(plain(Error::Internal(
                "the group is poisoned by an earlier panic; only vmm_arena_group_destroy works".into(),
            )));
        }
        Ok(&self.group)
    }
}

fn group_id(raw: vmm_arena_group_id) -> Result<GroupId, GroupError> {
    GroupId::from_raw(raw).ok_or_else(|| plain(Error::UnknownAllocation(0)))
}

/// Checks that `ptrs` can take one address per member.
fn ptrs_out(ptrs: *mut u64, len: u32, members: usize) -> Result<std::ptr::NonNull<u64>, GroupError> {
    let p = required(ptrs, "out_ptrs").map_err(plain)?;
    if (len as usize) < members {
        return Err(plain(invalid(format!("out_ptrs_len {len} is below the group's {members} members"))));
    }
    Ok(p)
}

/// Writes one address per member.
///
/// # Safety
/// `p` has at least `ptrs.len()` writable `u64`s.
unsafe fn put_ptrs(p: std::ptr::NonNull<u64>, ptrs: &[u64]) {
    for (i, &v) in ptrs.iter().enumerate() {
        // SAFETY: `i < ptrs.len()`, within the caller's array.
        unsafe { p.as_ptr().add(i).write(v) };
    }
}

fn member_index(h: &vmm_arena_group, member: u32) -> Result<usize, GroupError> {
    let m = member as usize;
    if m >= h.group.len() {
        return Err(plain(invalid(format!("member {member} is not below the group's {} members", h.group.len()))));
    }
    Ok(m)
}

/// Publishes a new group handle.
///
/// # Safety
/// `out` is writable.
pub(crate) unsafe fn publish_group(
    group: Group,
    faults: Vec<Arc<FaultDriver<HostDriver>>>,
    out: std::ptr::NonNull<*mut vmm_arena_group>,
) {
    let h = Box::into_raw(Box::new(vmm_arena_group { group, poisoned: AtomicBool::new(false), faults }));
    // SAFETY: per this function's contract.
    unsafe { put(out, h) };
}

/// Creates a group of `count` members, member i on device devices[i]
/// (distinct ordinals; on the host backend any distinct values: N arenas
/// stand for N devices), each configured by `config` (its device field is
/// ignored). flags: VMM_ARENA_GROUP_PEER_ACCESS or 0; unknown bits are
/// INVALID_ARGUMENT, as are a NULL config, devices or out, count 0 and a
/// repeated device. A member that cannot be created fails the call with its
/// status (vmm_arena_group_last_member() names it) and the members made
/// before it are destroyed. *out receives the group on VMM_ARENA_OK; the
/// caller owns it and destroys it with vmm_arena_group_destroy.
///
/// # Safety
/// `config` is NULL or points to a config of at least its `struct_size`
/// bytes; `devices` is NULL or has `count` readable entries; `out` is NULL
/// or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_group_create(
    config: *const vmm_arena_config,
    devices: *const i32,
    count: u32,
    flags: u32,
    out: *mut *mut vmm_arena_group,
) -> vmm_arena_status {
    group_boundary("vmm_arena_group_create", std::ptr::null(), || {
        // SAFETY: per this function's contract.
        let c = unsafe { read_config(config) }.map_err(plain)?;
        let out = required(out, "out").map_err(plain)?;
        if devices.is_null() || !devices.is_aligned() {
            return Err(plain(invalid("devices is NULL or not aligned")));
        }
        if flags & !KNOWN_GROUP_FLAGS != 0 {
            return Err(plain(invalid(format!("unknown group flags {:#x}", flags & !KNOWN_GROUP_FLAGS))));
        }
        // SAFETY: non-NULL, aligned, `count` readable entries per this
        // function's contract (count 0 is an empty slice, refused below).
        let devices = unsafe { std::slice::from_raw_parts(devices, count as usize) }.to_vec();
        let cfg = arena_config(&c).map_err(plain)?;
        let group =
            Group::new(GroupConfig { arena: cfg, devices, peer_access: flags & VMM_ARENA_GROUP_PEER_ACCESS != 0 })?;
        // SAFETY: `out` was checked and is writable per this function's contract.
        unsafe { publish_group(group, Vec::new(), out) };
        Ok(())
    })
}

/// Like vmm_arena_group_create with a configuration of its own for each
/// member: configs[i] (its device field names member i's device, distinct;
/// each struct_size as for vmm_arena_create) configures member i, so
/// capacities, chunk sizes, retain and flags may differ (a device that also
/// holds other work, a member without VMM_ARENA_FLAG_NO_IMPLICIT_MOVES...).
/// The members should share a chunk size and a backend; nothing requires it.
/// Errors as vmm_arena_group_create.
///
/// # Safety
/// `configs` is NULL or has `count` readable configs, each at least its
/// `struct_size` bytes; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_group_create_with_configs(
    configs: *const vmm_arena_config,
    count: u32,
    flags: u32,
    out: *mut *mut vmm_arena_group,
) -> vmm_arena_status {
    group_boundary("vmm_arena_group_create_with_configs", std::ptr::null(), || {
        let out = required(out, "out").map_err(plain)?;
        if configs.is_null() || !configs.is_aligned() {
            return Err(plain(invalid("configs is NULL or not aligned")));
        }
        if flags & !KNOWN_GROUP_FLAGS != 0 {
            return Err(plain(invalid(format!("unknown group flags {:#x}", flags & !KNOWN_GROUP_FLAGS))));
        }
        let mut cfgs = Vec::with_capacity(count as usize);
        for i in 0..count as usize {
            // SAFETY: `configs` has `count` entries per this function's
            // contract; entry i starts at its own struct_size field.
            let c = unsafe { read_config(configs.add(i)) }.map_err(|e| GroupError { member: Some(i), ..plain(e) })?;
            cfgs.push(arena_config(&c).map_err(|e| GroupError { member: Some(i), ..plain(e) })?);
        }
        let group = Group::with_member_configs(cfgs, flags & VMM_ARENA_GROUP_PEER_ACCESS != 0)?;
        // SAFETY: `out` was checked and is writable per this function's contract.
        unsafe { publish_group(group, Vec::new(), out) };
        Ok(())
    })
}

/// A handle of member `member`'s own arena (*out), for everything the group
/// calls do not do: vmm_arena_pin/unpin of a shard, a move callback per
/// member (vmm_arena_set_move_callback), vmm_arena_export_open and
/// vmm_arena_dmabuf_open of a shard, vmm_arena_sleep/wake by tag,
/// vmm_arena_compact, vmm_arena_trim, vmm_arena_set_prefetch,
/// vmm_arena_stats_get, and allocations of the member's own. The member id
/// of a group allocation is vmm_arena_group_query's out_member_id.
///
/// The group keeps no group-wide sleep, wake, compact or trim: their undo
/// (a wake, a compaction back) can itself fail for memory or move things,
/// so all or nothing could not be promised; call them on every member
/// (the same calls on every member keep the members' placement the same).
/// Freeing or resizing a group allocation's shard through the member handle
/// breaks the group's all-or-nothing for that allocation.
///
/// The caller owns the handle and releases it with vmm_arena_destroy, which
/// for a member handle releases the handle only: the member's arena lives
/// until the group and every handle of it are destroyed. Any number of
/// handles of a member may exist.
///
/// # Safety
/// `group` is NULL or a live handle; `out` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_group_member(
    group: *mut vmm_arena_group,
    member: u32,
    out: *mut *mut crate::vmm_arena,
) -> vmm_arena_status {
    group_boundary("vmm_arena_group_member", group, || {
        let out = required(out, "out").map_err(plain)?;
        // SAFETY: per this function's contract.
        let h = unsafe { handle(group) }?;
        let g = h.live()?;
        if member as usize >= g.len() {
            return Err(plain(invalid(format!("member {member} of a group of {}", g.len()))));
        }
        let fault = h.faults.get(member as usize).cloned();
        // SAFETY: `out` was checked and is writable per this function's contract.
        unsafe { crate::publish_shared(g.member_shared(member as usize), fault, out) }.map_err(plain)
    })
}

/// Destroys every member (unmapping and releasing everything, as
/// vmm_arena_destroy does) and the group. NULL is fine.
///
/// # Safety
/// `group` is NULL or a live handle that no other thread is using, and is
/// not used again.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_group_destroy(group: *mut vmm_arena_group) {
    let _ = group_boundary("vmm_arena_group_destroy", std::ptr::null(), || {
        if !group.is_null() {
            // SAFETY: a live handle made by Box::into_raw in `publish_group`,
            // owned by the caller, who gives it up here.
            drop(unsafe { Box::from_raw(group) });
        }
        Ok(())
    });
}

/// The member index named by this thread's last failing vmm_arena_group_*
/// call, or -1. A call that failed in a member (any status that member's
/// arena returned, INVALID_ARGUMENT included, e.g. a size 0 that member 0
/// refuses) names that member k; a call refused before any member acted (a
/// NULL or misaligned pointer, unknown flags, out_ptrs_len below the member
/// count, a member index out of range, an unknown group id, a poisoned
/// group) names none: -1. Also -1 when no group call has failed on this
/// thread. vmm_arena_last_error() says how the call failed. A successful
/// call leaves it as it was.
#[no_mangle]
pub extern "C" fn vmm_arena_group_last_member() -> i32 {
    crate::guarded(-1, || LAST_MEMBER.try_with(Cell::get).unwrap_or(-1))
}

/// Number of members.
///
/// # Safety
/// `group` is NULL or a live handle; `out_count` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_group_member_count(
    group: *mut vmm_arena_group,
    out_count: *mut u32,
) -> vmm_arena_status {
    group_boundary("vmm_arena_group_member_count", group, || {
        let out = required(out_count, "out_count").map_err(plain)?;
        // SAFETY: per this function's contract.
        let h = unsafe { handle(group) }?;
        let n = h.live()?.len() as u32;
        // SAFETY: a checked out-parameter, writable per this function's contract.
        unsafe { put(out, n) };
        Ok(())
    })
}

/// Allocates `size` bytes on every member (as vmm_arena_alloc), all or
/// nothing: if member k fails, members 0..k-1 free what they allocated and
/// the call returns member k's status (vmm_arena_group_last_member() is k);
/// retired ranges an undone allocation released to make room are released
/// on every member, as vmm_arena_group_resize does.
/// out_ptrs receives each member's address, member order; out_ptrs_len
/// below the member count is INVALID_ARGUMENT.
///
/// # Safety
/// `group` is NULL or a live handle; `out_id` is NULL or writable;
/// `out_ptrs` is NULL or has `out_ptrs_len` writable entries.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_group_alloc(
    group: *mut vmm_arena_group,
    size: u64,
    out_id: *mut vmm_arena_group_id,
    out_ptrs: *mut u64,
    out_ptrs_len: u32,
) -> vmm_arena_status {
    group_boundary("vmm_arena_group_alloc", group, || {
        let oid = required(out_id, "out_id").map_err(plain)?;
        // SAFETY: per this function's contract.
        let h = unsafe { handle(group) }?;
        let optrs = ptrs_out(out_ptrs, out_ptrs_len, h.group.len())?;
        let (id, ptrs) = h.live()?.alloc(size)?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            put(oid, id.get());
            put_ptrs(optrs, &ptrs);
        }
        Ok(())
    })
}

/// vmm_arena_alloc_growable on every member, all or nothing (as
/// vmm_arena_group_alloc).
///
/// # Safety
/// As for `vmm_arena_group_alloc`.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_group_alloc_growable(
    group: *mut vmm_arena_group,
    size: u64,
    max_size: u64,
    out_id: *mut vmm_arena_group_id,
    out_ptrs: *mut u64,
    out_ptrs_len: u32,
) -> vmm_arena_status {
    group_boundary("vmm_arena_group_alloc_growable", group, || {
        let oid = required(out_id, "out_id").map_err(plain)?;
        // SAFETY: per this function's contract.
        let h = unsafe { handle(group) }?;
        let optrs = ptrs_out(out_ptrs, out_ptrs_len, h.group.len())?;
        let (id, ptrs) = h.live()?.alloc_growable(size, max_size)?;
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            put(oid, id.get());
            put_ptrs(optrs, &ptrs);
        }
        Ok(())
    })
}

/// Resizes every member's allocation (as vmm_arena_resize), all or nothing:
/// if member k fails, members 0..k-1 are resized back to the old size and
/// the call returns member k's status. A resize back is a shrink after a
/// growth, which makes no driver call that can fail: the sizes, contents
/// and mapped bytes are as before, though a member whose growth moved the
/// allocation keeps its new address (its move callback was told). Retired
/// ranges (old addresses of moved allocations) that an undone growth
/// released to make room cannot be mapped back: they are released on every
/// member then, so the members' free ranges stay alike. Shrinks never fail
/// part-way unless a member was changed through another path. out_ptrs
/// receives each member's (maybe new) address.
///
/// # Safety
/// `group` is NULL or a live handle; `out_ptrs` is NULL or has
/// `out_ptrs_len` writable entries.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_group_resize(
    group: *mut vmm_arena_group,
    id: vmm_arena_group_id,
    new_size: u64,
    out_ptrs: *mut u64,
    out_ptrs_len: u32,
) -> vmm_arena_status {
    group_boundary("vmm_arena_group_resize", group, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(group) }?;
        let optrs = ptrs_out(out_ptrs, out_ptrs_len, h.group.len())?;
        let ptrs = h.live()?.resize(group_id(id)?, new_size)?;
        // SAFETY: a checked out-parameter, writable per this function's contract.
        unsafe { put_ptrs(optrs, &ptrs) };
        Ok(())
    })
}

/// Frees the allocation on every member; its id is never valid again.
/// UNKNOWN_ALLOCATION for an id this group did not issue or already freed.
///
/// # Safety
/// `group` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_group_free(group: *mut vmm_arena_group, id: vmm_arena_group_id) -> vmm_arena_status {
    group_boundary("vmm_arena_group_free", group, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(group) }?;
        h.live()?.free(group_id(id)?)
    })
}

/// Member `member`'s address, size and own allocation id of a group
/// allocation (each out-parameter may be NULL). A member index not below
/// the member count is INVALID_ARGUMENT.
///
/// # Safety
/// `group` is NULL or a live handle; the out-parameters are NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_group_query(
    group: *mut vmm_arena_group,
    id: vmm_arena_group_id,
    member: u32,
    out_ptr: *mut u64,
    out_size: *mut u64,
    out_member_id: *mut vmm_arena_id,
) -> vmm_arena_status {
    group_boundary("vmm_arena_group_query", group, || {
        let optr = optional(out_ptr, "out_ptr").map_err(plain)?;
        let osize = optional(out_size, "out_size").map_err(plain)?;
        let oid = optional(out_member_id, "out_member_id").map_err(plain)?;
        // SAFETY: per this function's contract.
        let h = unsafe { handle(group) }?;
        let m = member_index(h, member)?;
        let g = h.live()?;
        let gid = group_id(id)?;
        let info = g.query(gid)?[m];
        let mid = g.member_ids(gid)?[m];
        // SAFETY: checked out-parameters, writable per this function's contract.
        unsafe {
            if let Some(p) = optr {
                put(p, info.ptr);
            }
            if let Some(p) = osize {
                put(p, info.size);
            }
            if let Some(p) = oid {
                put(p, mid.get());
            }
        }
        Ok(())
    })
}

/// Member `member`'s stats, as vmm_arena_stats_get (stats->struct_size
/// must be set by the caller).
///
/// # Safety
/// `group` is NULL or a live handle; `stats` is NULL or points to at least
/// `stats->struct_size` writable bytes starting with a `uint32_t struct_size`.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_group_stats_get(
    group: *mut vmm_arena_group,
    member: u32,
    stats: *mut vmm_arena_stats,
) -> vmm_arena_status {
    group_boundary("vmm_arena_group_stats_get", group, || {
        let out = required(stats, "stats").map_err(plain)?;
        // SAFETY: non-NULL and aligned; the caller's struct starts with its
        // uint32_t struct_size, and nothing past it is read.
        let size = unsafe { out.as_ptr().cast::<u32>().read() };
        if size as usize != std::mem::size_of::<vmm_arena_stats>() {
            return Err(plain(invalid(format!(
                "stats->struct_size is {size}, expected sizeof(vmm_arena_stats) = {}",
                std::mem::size_of::<vmm_arena_stats>()
            ))));
        }
        // SAFETY: per this function's contract.
        let h = unsafe { handle(group) }?;
        let m = member_index(h, member)?;
        let s =
            h.live()?.member(m).stats().map_err(|e| GroupError { member: Some(m), error: e, undo_failures: vec![] })?;
        // SAFETY: the caller's struct is struct_size = sizeof(vmm_arena_stats)
        // writable bytes, per this function's contract.
        unsafe { put(out, c_stats(&s)) };
        Ok(())
    })
}

/// A JSON object: "devices", "allocations" (each group allocation's "id",
/// "size" and every member's "ids") and "members" (each member's snapshot,
/// as vmm_arena_snapshot_json writes it). Buffer rules as for
/// vmm_arena_snapshot_json: written with its NUL if cap suffices, and
/// *out_len receives the size needed either way.
///
/// # Safety
/// `group` is NULL or a live handle; `buf` is NULL or has `cap` writable
/// bytes; `out_len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_group_snapshot_json(
    group: *mut vmm_arena_group,
    buf: *mut std::ffi::c_char,
    cap: usize,
    out_len: *mut usize,
) -> vmm_arena_status {
    group_boundary("vmm_arena_group_snapshot_json", group, || {
        let out = required(out_len, "out_len").map_err(plain)?;
        // SAFETY: per this function's contract.
        let h = unsafe { handle(group) }?;
        let json = h.live()?.snapshot_json()?;
        let needed = json.len() + 1;
        if cap >= needed {
            if buf.is_null() {
                return Err(plain(invalid(format!("buf is NULL while cap {cap} covers the {needed} bytes needed"))));
            }
            // SAFETY: `buf` has `cap >= json.len() + 1` writable bytes per
            // this function's contract, and cannot overlap a fresh String.
            unsafe {
                std::ptr::copy_nonoverlapping(json.as_ptr(), buf.cast::<u8>(), json.len());
                buf.add(json.len()).write(0);
            }
        }
        // SAFETY: a checked out-parameter, writable per this function's contract.
        unsafe { put(out, needed) };
        Ok(())
    })
}
