//! The C ABI of tags, sleep and wake. Conventions as in the rest of the header.

use super::*;

/// Sets an allocation's tag (0 by default), which vmm_arena_sleep and
/// vmm_arena_wake select by; works on a sleeping allocation too.
///
/// Sleep and wake (e.g. an inference engine giving its GPU memory to a
/// training step, then resuming): a sleeping allocation is live: it counts
/// in live_allocations and live_bytes, its id, size, address and
/// reservation stay (so pointers held elsewhere, by kernels or CUDA graphs,
/// are valid again after wake), and its reservation is not free address
/// space; it maps nothing and counts nothing in mapped_bytes. It must not be
/// touched. resize (growing or shrinking) and pin return
/// VMM_ARENA_ERR_ASLEEP; query, unpin, set_tag and free work (free drops its
/// backup). Compaction never moves it; like a pinned allocation, it can be
/// why a request gets OUT_OF_ADDRESS_SPACE.
///
/// Every allocation takes a tag, whatever its size or history. One of whole
/// chunks keeps its place (asleep or pinned too). A small allocation (in a
/// slab: at most half a chunk, from vmm_arena_alloc or
/// vmm_arena_alloc_tagged) shares its slab only with allocations of its
/// tag, so a new tag moves it: its bytes are copied into a slab of the new
/// tag, as a resize past its size class does (the address changes, the
/// move callback reports it, bytes_copied counts it). That move is refused
/// for a pinned one (VMM_ARENA_ERR_PINNED) and a sleeping one
/// (VMM_ARENA_ERR_ASLEEP) and needs a slab's room (OUT_OF_MEMORY or
/// OUT_OF_ADDRESS_SPACE); on any error nothing changed. Setting the tag it
/// has is a no-op. Small allocations sleep with their slab.
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_set_tag(arena: *mut vmm_arena, id: vmm_arena_id, tag: u32) -> vmm_arena_status {
    boundary("vmm_arena_set_tag", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        h.live()?.set_tag(id_arg(id), tag).map_err(with_raw_id(id))
    })
}

/// Puts every awake allocation with this tag (VMM_ARENA_ALL_TAGS: all) to
/// sleep: waits for the device, copies each one's bytes to host memory when
/// flags has VMM_ARENA_SLEEP_BACKUP (else its contents are lost), unmaps it,
/// gives its chunks back to the driver, then gives back every pooled chunk
/// whatever retain_bytes says. Pinned allocations sleep too. Already
/// sleeping ones are left as they are. Unknown flag bits are
/// INVALID_ARGUMENT. All or nothing: on failure nothing has slept.
///
/// Backups are host memory from the backend: page-locked (cuMemHostAlloc)
/// on CUDA, ordinary memory where that much cannot be pinned and on the
/// host backend. One that cannot be had fails the sleep, nothing slept.
///
/// Retired ranges (the old addresses of moved allocations) are all
/// unmapped, after the device wait, as vmm_arena_release_retired does: one
/// may still map a sleeper's or a pooled chunk, and the driver frees no
/// chunk that is still mapped. The arena may release them whenever it has
/// synchronized; only the old addresses the move callback reported stop
/// being mapped.
///
/// The chunks are given back after the point of no return (a released
/// chunk cannot be had back): a chunk the driver refuses to release stays
/// pooled (held, not leaked: pooled_bytes counts it), and
/// vmm_arena_trim or the next sleep gives it back. The sleepers have slept,
/// so the call returns VMM_ARENA_OK: an error would say they had not.
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_sleep(arena: *mut vmm_arena, tag: u32, flags: u32) -> vmm_arena_status {
    boundary("vmm_arena_sleep", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        if flags & !VMM_ARENA_SLEEP_BACKUP != 0 {
            return Err(Error::InvalidArgument(format!("unknown sleep flags {flags:#x}")));
        }
        h.live()?.sleep(tag, flags)
    })
}

/// Wakes every sleeping allocation with this tag (or all), each at its own
/// address: its chunks are new (or pooled) and receive the backed-up bytes
/// (without a backup it holds whatever the driver gives). All or nothing: on
/// failure (e.g. OUT_OF_MEMORY) every one of them is still asleep, its
/// backup intact.
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_wake(arena: *mut vmm_arena, tag: u32) -> vmm_arena_status {
    boundary("vmm_arena_wake", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        h.live()?.wake(tag)
    })
}

/// Keeps spent sleep backups for the next sleep (keep = 1), or stops and
/// frees what is kept (keep = 0; other values are INVALID_ARGUMENT). With
/// it on, a wake keeps each backup buffer it has written back (page-locked
/// host memory on CUDA) instead of freeing it, and a sleep takes a kept
/// buffer of exactly the size it needs before asking the driver for one: a
/// loop that sleeps and wakes the same allocations allocates host memory in
/// its first cycle only. What is kept is the last cycle's backups; give it
/// back with vmm_arena_release_backup_cache. Off by default.
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_set_backup_cache(arena: *mut vmm_arena, keep: u32) -> vmm_arena_status {
    boundary("vmm_arena_set_backup_cache", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        if keep > 1 {
            return Err(Error::InvalidArgument(format!("keep is {keep}: 0 or 1")));
        }
        h.live()?.set_backup_cache(keep == 1)
    })
}

/// Frees the kept backup buffers (see vmm_arena_set_backup_cache);
/// *out_released (may be NULL) receives their bytes. The cache stays on if
/// it was.
///
/// # Safety
/// `arena` is NULL or a live handle; `out_released` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_release_backup_cache(
    arena: *mut vmm_arena,
    out_released: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_release_backup_cache", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = optional(out_released, "out_released")?;
        let released = h.live()?.release_backup_cache()?;
        if let Some(o) = out {
            // SAFETY: a checked out-parameter, writable per this function's contract.
            unsafe { put(o, released) };
        }
        Ok(())
    })
}

/// Copies len bytes at offset of a sleeping allocation's backup (the bytes
/// it had when it fell asleep with VMM_ARENA_SLEEP_BACKUP) into dst,
/// without waking it; a small allocation's bytes come from its slab's
/// backup. INVALID_ARGUMENT when it has no backup (it is awake, or slept
/// without VMM_ARENA_SLEEP_BACKUP), when offset + len exceeds its size, or
/// dst is NULL with len > 0; UNKNOWN_ALLOCATION for an unknown id. Reads
/// only: nothing in the arena changes; dst is written only on OK.
///
/// # Safety
/// `arena` is NULL or a live handle; `dst` is NULL or points to `len`
/// writable bytes.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_read_backup(
    arena: *mut vmm_arena,
    id: vmm_arena_id,
    offset: u64,
    dst: *mut c_void,
    len: usize,
) -> vmm_arena_status {
    boundary("vmm_arena_read_backup", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        if dst.is_null() && len > 0 {
            return Err(Error::InvalidArgument("dst is NULL".into()));
        }
        if len > isize::MAX as usize {
            return Err(Error::InvalidArgument(format!("len {len} exceeds any allocation")));
        }
        let out: &mut [u8] = if len == 0 {
            &mut []
        } else {
            // SAFETY: dst is not NULL and points to len writable bytes (at
            // most isize::MAX), per this function's contract.
            unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), len) }
        };
        // read_backup writes `out` only once every check has passed.
        h.live()?.read_backup(id_arg(id), offset, out).map_err(with_raw_id(id))
    })
}
