//! The block-in-chunk KV cache layout from C (see `vmm_arena::layout`):
//! one chunk of a request's allocation is one block of a paged-attention
//! block table, laid out layer-major inside the chunk.

use arena::layout::{BlockTable, ChunkLayout, KvGeometry};
use arena::Error;

use crate::boundary::{boundary, handle, id_arg, invalid, optional, put, required, with_raw_id};
use crate::{vmm_arena, vmm_arena_id, vmm_arena_status};

/// A model's KV cache shape: per token, every layer's key row and value
/// row of kv_heads × head_dim elements of dtype_bytes bytes each.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct vmm_arena_kv_geometry {
    /// transformer layers
    pub layers: u32,
    /// key/value heads per layer (grouped-query attention's KV heads)
    pub kv_heads: u32,
    /// elements per head
    pub head_dim: u32,
    /// bytes per element (2 for fp16/bf16, 1 for fp8)
    pub dtype_bytes: u32,
}

/// The block-in-chunk layout of a geometry in chunks of chunk_bytes. Inside
/// each chunk: layer 0's keys for block_tokens tokens
/// (`[block_tokens][kv_heads][head_dim]`, slab_bytes), then layer 0's
/// values, then layer 1's keys, and so on; unused_bytes at the end hold
/// nothing. Layer l's keys start at offset 2 × l × slab_bytes of every
/// chunk and its values slab_bytes later, so one layer's keys of every
/// request form one strided array `[chunks][block_tokens][kv_heads][head_dim]`
/// from the arena's base with a block stride of chunk_bytes: the shape
/// paged attention kernels take, indexed by vmm_arena_block_table's chunk
/// numbers. struct_size must be sizeof(vmm_arena_kv_layout).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct vmm_arena_kv_layout {
    /// sizeof(vmm_arena_kv_layout), set by the caller
    pub struct_size: u32,
    /// zero
    pub reserved0: u32,
    /// the chunk size: the block stride in bytes
    pub chunk_bytes: u64,
    /// tokens per chunk: the kernels' block size
    pub block_tokens: u64,
    /// bytes of one layer's keys (or values) in a chunk
    pub slab_bytes: u64,
    /// bytes of a chunk that hold keys and values (2 × layers × slab_bytes)
    pub used_bytes: u64,
    /// bytes at the end of each chunk that hold nothing
    pub unused_bytes: u64,
}

fn geometry(g: *const vmm_arena_kv_geometry) -> Result<KvGeometry, Error> {
    // SAFETY: NULL is refused; otherwise the caller's contract says it is a
    // readable vmm_arena_kv_geometry (plain integers, any bits valid).
    let g = unsafe { g.as_ref() }.ok_or_else(|| invalid("geometry is NULL"))?;
    Ok(KvGeometry { layers: g.layers, kv_heads: g.kv_heads, head_dim: g.head_dim, dtype_bytes: g.dtype_bytes })
}

/// The block-in-chunk layout of `geometry` in chunks of chunk_bytes (an
/// arena's chunk_bytes), with block_tokens tokens a chunk (0: as many as
/// fit; a kernel may need a power of two). out->struct_size must be set by
/// the caller.
///
/// INVALID_ARGUMENT for a NULL argument, a zero in the geometry, a zero
/// chunk, a chunk too small for one token of every layer, block_tokens
/// that do not fit, or a wrong struct_size.
///
/// # Safety
/// `geometry` is NULL or readable; `out` is NULL or points to at least
/// `out->struct_size` writable bytes starting with a `uint32_t struct_size`.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_kv_layout_get(
    geometry: *const vmm_arena_kv_geometry,
    chunk_bytes: u64,
    block_tokens: u64,
    out: *mut vmm_arena_kv_layout,
) -> vmm_arena_status {
    boundary("vmm_arena_kv_layout_get", std::ptr::null(), || {
        let g = self::geometry(geometry)?;
        let o = required(out, "out")?;
        // SAFETY: non-NULL and aligned; the caller's struct starts with its
        // uint32_t struct_size, and nothing past it is read.
        let size = unsafe { o.as_ptr().cast::<u32>().read() };
        if size as usize != std::mem::size_of::<vmm_arena_kv_layout>() {
            return Err(invalid(format!(
                "out->struct_size is {size}, expected sizeof(vmm_arena_kv_layout) = {}",
                std::mem::size_of::<vmm_arena_kv_layout>()
            )));
        }
        let l = ChunkLayout::with_block_tokens(g, chunk_bytes, block_tokens)?;
        let c = vmm_arena_kv_layout {
            struct_size: size,
            reserved0: 0,
            chunk_bytes: l.chunk_bytes(),
            block_tokens: l.block_tokens(),
            slab_bytes: l.slab_bytes(),
            used_bytes: l.used_bytes(),
            unused_bytes: l.unused_bytes(),
        };
        // SAFETY: the caller's struct is struct_size = sizeof(vmm_arena_kv_layout)
        // writable bytes, per this function's contract.
        unsafe { put(o, c) };
        Ok(())
    })
}

/// *out_offset receives the offset, from the start of a request's
/// allocation, of the key row (value 0) or value row (value 1) of `token`
/// (counted from the allocation's first token) in `layer`, in the layout
/// vmm_arena_kv_layout_get gives for the same geometry, chunk_bytes and
/// block_tokens: the row of kv_heads × head_dim elements a kernel writes
/// for that token. INVALID_ARGUMENT as there, for a layer out of range, a
/// value other than 0 or 1, or an offset beyond 2^64.
///
/// # Safety
/// `geometry` is NULL or readable; `out_offset` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_kv_token_offset(
    geometry: *const vmm_arena_kv_geometry,
    chunk_bytes: u64,
    block_tokens: u64,
    layer: u32,
    value: u32,
    token: u64,
    out_offset: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_kv_token_offset", std::ptr::null(), || {
        let g = self::geometry(geometry)?;
        let out = required(out_offset, "out_offset")?;
        if value > 1 {
            return Err(invalid(format!("value is {value}: 0 for keys, 1 for values")));
        }
        let l = ChunkLayout::with_block_tokens(g, chunk_bytes, block_tokens)?;
        let off = l.token_offset(layer, value == 1, token)?;
        // SAFETY: a checked out-parameter, writable per this function's contract.
        unsafe { put(out, off) };
        Ok(())
    })
}

/// The arena's virtual range: *out_base receives its base address (chunk
/// n of a block table starts at base + n × chunk_bytes) and *out_bytes its
/// size (either may be NULL). Both are fixed for the arena's life, so an
/// engine reads them once: the block-table entry of a one-chunk allocation
/// at ptr is (ptr − base) / chunk_bytes.
///
/// # Safety
/// `arena` is NULL or a live handle; `out_base` and `out_bytes` are NULL or
/// writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_va_range(
    arena: *mut vmm_arena,
    out_base: *mut u64,
    out_bytes: *mut u64,
) -> vmm_arena_status {
    boundary("vmm_arena_va_range", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let base = optional(out_base, "out_base")?;
        let bytes = optional(out_bytes, "out_bytes")?;
        let (b, n) = h.live()?.va_range();
        if let Some(p) = base {
            // SAFETY: a checked out-parameter, writable per this function's contract.
            unsafe { put(p, b) };
        }
        if let Some(p) = bytes {
            // SAFETY: a checked out-parameter, writable per this function's contract.
            unsafe { put(p, n) };
        }
        Ok(())
    })
}

/// The block table of allocation `id`: its chunk numbers in order, counted
/// from the arena's base (chunk n starts at base + n × chunk_bytes; the
/// base is vmm_arena_va_range's), each at most INT32_MAX, the
/// int32 entries paged attention kernels take. If cap is at least their
/// count, writes them into blocks; else (blocks may then be NULL) writes
/// nothing. Either way *out_count receives the count, and the status is OK.
///
/// The entries are consecutive (an allocation's chunks are contiguous in
/// the address space); growth appends entries, and a move changes them all
/// (the move callback says when: fetch the table again then). After a move
/// the old entries stay readable until retired memory is released, so a
/// kernel launched before the move still reads the right bytes.
///
/// INVALID_ARGUMENT for an allocation that does not start on a chunk (a
/// small one, at most half a chunk: allocate a KV cache in whole chunks,
/// or growable), an import, or a chunk number beyond INT32_MAX;
/// UNKNOWN_ALLOCATION; ASLEEP is not an error (a sleeping allocation keeps
/// its addresses).
///
/// # Safety
/// `arena` is NULL or a live handle; `blocks` is NULL or has `cap` writable
/// int32_t; `out_count` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn vmm_arena_block_table(
    arena: *mut vmm_arena,
    id: vmm_arena_id,
    blocks: *mut i32,
    cap: usize,
    out_count: *mut usize,
) -> vmm_arena_status {
    boundary("vmm_arena_block_table", arena, || {
        // SAFETY: per this function's contract.
        let h = unsafe { handle(arena) }?;
        let out = required(out_count, "out_count")?;
        let table = BlockTable::new(h.live()?, id_arg(id)).map_err(with_raw_id(id))?;
        let entries: Vec<i32> = table
            .blocks()
            .iter()
            .map(|&b| i32::try_from(b).map_err(|_| invalid(format!("chunk number {b} exceeds INT32_MAX"))))
            .collect::<Result<_, _>>()?;
        if cap >= entries.len() && !entries.is_empty() {
            if blocks.is_null() {
                return Err(invalid(format!("blocks is NULL while cap {cap} covers the {} entries", entries.len())));
            }
            // SAFETY: `blocks` has `cap >= entries.len()` writable int32_t
            // per this function's contract, and cannot overlap a fresh Vec.
            unsafe { std::ptr::copy_nonoverlapping(entries.as_ptr(), blocks, entries.len()) };
        }
        // SAFETY: a checked out-parameter, writable per this function's contract.
        unsafe { put(out, entries.len()) };
        Ok(())
    })
}
