//! The C ABI of compaction, releasing retired ranges and trimming the pool, stats,
//! the move callback and the snapshot. Conventions as in the rest of the header.

use super::*;

/// Moves unpinned allocations by remapping to close address-space holes.
/// report may be NULL. On failure the arena is exactly as it was; the plan
/// depends on the arena's books alone, so tensor-parallel ranks with
/// VMM_ARENA_FLAG_DETERMINISTIC_PLACEMENT keep the same offsets if a rank
/// whose compaction failed calls it again (every rank compacts; a failed
/// one retries, or the engine stops).
///
/// # Safety
/// `arena` is NULL or a live handle; `report` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_compact(
    arena: *mut vmm_arena,
    report: *mut vmm_arena_compact_report,
) -> vmm_arena_status {
    boundary("vmm_arena_compact", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = optional(report, "report")?;
        let r = h.live()?.compact()?;
        if let Some(p) = out {
            let r = vmm_arena_compact_report {
                moved_allocations: r.moved_allocations,
                moved_bytes: r.moved_bytes,
                largest_free_va_before: r.largest_free_va_before,
                largest_free_va_after: r.largest_free_va_after,
            };
            // SAFETY: a checked out-parameter, writable per this function's contract.
            unsafe { put(p, r) };
        }
        Ok(())
    })
}

/// Unmaps the old ranges of moved allocations (CUDA: after synchronizing
/// the device). The arena also does this by itself when it needs their
/// address space, with the same synchronization.
///
/// # Safety
/// `arena` is NULL or a live handle.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_release_retired(arena: *mut vmm_arena) -> vmm_arena_status {
    boundary("vmm_arena_release_retired", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        h.live()?.release_retired()
    })
}

/// Gives pooled physical chunks back to the driver until at most keep_bytes
/// stay pooled. out_released (may be NULL) receives the bytes released.
/// Pooled is what pooled_bytes counts: a slab holding only retired objects
/// is given back too when the other pooled chunks are not enough (its
/// retired objects are released then, after synchronizing the device).
/// The retain watermark counts them the same way. Chunks a prefetch round
/// has in flight (vmm_arena_maintain or the background thread) count as
/// pooled too: trim waits for that round to land (one create or one map
/// round at most) and gives them back as well.
///
/// # Safety
/// `arena` is NULL or a live handle; `out_released` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_trim(
    arena: *mut vmm_arena,
    keep_bytes: u64,
    out_released: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_trim", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = optional(out_released, "out_released")?;
        let released = h.live()?.trim(keep_bytes)?;
        if let Some(p) = out {
            // SAFETY: a checked out-parameter, writable per this function's contract.
            unsafe { put(p, released) };
        }
        Ok(())
    })
}

/// stats->struct_size must be set by the caller.
///
/// # Safety
/// `arena` is NULL or a live handle; `stats` is NULL or points to at least
/// `stats->struct_size` writable bytes starting with a `uint32_t struct_size`.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_stats_get(arena: *mut vmm_arena, stats: *mut vmm_arena_stats) -> vmm_arena_status {
    boundary("vmm_arena_stats_get", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = required(stats, "stats")?;
        // SAFETY: non-NULL and aligned; the caller's struct starts with its
        // uint32_t struct_size, and nothing past it is read.
        let size = unsafe { out.as_ptr().cast::<u32>().read() };
        if size as usize != std::mem::size_of::<vmm_arena_stats>() {
            return Err(invalid(format!(
                "stats->struct_size is {size}, expected sizeof(vmm_arena_stats) = {}",
                std::mem::size_of::<vmm_arena_stats>()
            )));
        }
        let c = c_stats(&h.live()?.stats()?);
        // SAFETY: the caller's struct is struct_size = sizeof(vmm_arena_stats)
        // writable bytes, per this function's contract.
        unsafe { put(out, c) };
        Ok(())
    })
}

/// Installs the move callback; fn == NULL removes the callback. The arena
/// calls it under its lock, so once this returns the previous callback is
/// not running and will not run again.
///
/// # Safety
/// `arena` is NULL or a live handle; `fn` (if not NULL) and `user` follow
/// the rules of `vmm_arena_move_fn` for as long as they stay installed.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_set_move_callback(
    arena: *mut vmm_arena,
    r#fn: vmm_arena_move_fn,
    user: *mut c_void,
) -> vmm_arena_status {
    boundary("vmm_arena_set_move_callback", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let a = h.live()?;
        let cb = r#fn.map(|f| {
            let cb = CMoveCallback { f, user, owner: arena as usize };
            Box::new(move |e: &MoveEvent| cb.call(e)) as Box<dyn FnMut(&MoveEvent) + Send>
        });
        a.set_move_callback(cb)
    })
}

/// A JSON object of every range (live, free, retired) and the stats. If cap
/// is at least the size needed, writes it with its terminating NUL; else
/// (buf may then be NULL) writes nothing. Either way *out_len receives the
/// size needed, NUL included, and the status is VMM_ARENA_OK.
///
/// # Safety
/// `arena` is NULL or a live handle; `buf` is NULL or has `cap` writable
/// bytes; `out_len` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_snapshot_json(
    arena: *mut vmm_arena,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> vmm_arena_status {
    boundary("vmm_arena_snapshot_json", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = required(out_len, "out_len")?;
        let json = h.live()?.snapshot_json()?;
        let needed = json.len() + 1;
        if cap >= needed {
            if buf.is_null() {
                return Err(invalid(format!("buf is NULL while cap {cap} covers the {needed} bytes needed")));
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
