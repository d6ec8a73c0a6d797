//! The block-in-chunk KV cache layout: one chunk of an allocation is one
//! block of a paged-attention block table.
//!
//! A request's KV cache is one (growable) allocation. Inside each of its
//! chunks the cache is laid out layer-major: layer 0's keys for the chunk's
//! `block_tokens` tokens, then layer 0's values, then layer 1's keys, and so
//! on; each of these slabs is `[block_tokens][kv_heads][head_dim]` elements.
//! So for one layer, the keys of all requests form one strided array
//! `[chunks][block_tokens][kv_heads][head_dim]` whose block stride is the
//! chunk size, starting at `base + k_offset(layer)` (the arena's base
//! address): the shape paged attention kernels take, indexed by a block
//! table of chunk numbers counted from the arena's base. The kernels then
//! read whole blocks as they would from their own paged cache, and the
//! arena keeps its per-request growth, release and compaction.
//!
//! [`ChunkLayout`] is the arithmetic (pure); [`BlockTable`] is one
//! allocation's block table, kept valid across growth ([`BlockTable::refresh`]
//! or [`BlockTable::update`] after a resize) and across moves
//! ([`BlockTable::on_move`], called from the arena's move callback, says
//! which entries changed).
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use vmm_arena::layout::{BlockTable, ChunkLayout, KvGeometry};
//! use vmm_arena::{Arena, ArenaConfig};
//!
//! // A Llama-3-8B-shaped cache: 32 layers, 8 KV heads of 128, 2-byte dtype.
//! let geometry = KvGeometry { layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2 };
//! let layout = ChunkLayout::new(geometry, 2 << 20)?;
//! assert_eq!(layout.block_tokens(), 16);
//! assert_eq!(layout.v_offset(1)?, 3 * 16 * 8 * 128 * 2);
//! assert_eq!(layout.unused_bytes(), 0);
//!
//! let arena = Arena::new(ArenaConfig { capacity_bytes: 64 << 20, ..Default::default() })?;
//! let (kv, _) = arena.alloc_growable(layout.bytes_for_tokens(20)?, 16 << 20)?;
//! let table = Arc::new(Mutex::new(BlockTable::new(&arena, kv)?));
//! assert_eq!(table.lock().unwrap().len(), 2); // 20 tokens: two 16-token blocks
//! let seen = table.clone();
//! arena.set_move_callback(Some(Box::new(move |e| {
//!     // The changed entries would be re-uploaded to the device here.
//!     let _changed = seen.lock().unwrap().on_move(e).expect("a chunk-aligned allocation");
//! })))?;
//! arena.resize(kv, layout.bytes_for_tokens(40)?)?; // grows in place
//! let changed = table.lock().unwrap().refresh(&arena)?;
//! assert_eq!(changed, 2..3); // one block appended
//! # Ok::<(), vmm_arena::Error>(())
//! ```

use std::ops::Range;

use crate::error::{Error, Result};
use crate::{Arena, Id, MoveEvent};

/// The shape of a model's KV cache (per token: every layer's key and value
/// rows of `kv_heads × head_dim` elements of `dtype_bytes` each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvGeometry {
    /// Transformer layers holding a KV cache.
    pub layers: u32,
    /// Key/value heads (after grouped-query sharing).
    pub kv_heads: u32,
    /// Elements per head.
    pub head_dim: u32,
    /// Bytes per element (2 for fp16/bf16, 1 for fp8).
    pub dtype_bytes: u32,
}

impl KvGeometry {
    /// Bytes of one token's key (or value) in one layer.
    pub fn row_bytes(&self) -> u64 {
        self.kv_heads as u64 * self.head_dim as u64 * self.dtype_bytes as u64
    }

    /// Bytes of one token's keys and values across all layers.
    pub fn token_bytes(&self) -> u64 {
        // At most 2^32 · 2^96: computed in u128 by `check`, which refuses
        // what does not fit in u64 before anything uses this.
        2 * self.layers as u64 * self.row_bytes()
    }

    fn check(&self) -> Result<()> {
        let Self { layers, kv_heads, head_dim, dtype_bytes } = *self;
        if layers == 0 || kv_heads == 0 || head_dim == 0 || dtype_bytes == 0 {
            return Err(Error::invalid(format!(
                "KV geometry has a zero: layers {layers}, kv_heads {kv_heads}, head_dim {head_dim}, dtype_bytes {dtype_bytes}"
            )));
        }
        let token = 2 * layers as u128 * kv_heads as u128 * head_dim as u128 * dtype_bytes as u128;
        if token > u64::MAX as u128 {
            return Err(Error::invalid(format!("a token of this KV geometry takes {token} bytes, beyond 64 bits")));
        }
        Ok(())
    }
}

/// Where each layer's keys and values lie inside a chunk (see the module's
/// documentation). Pure arithmetic: it holds no memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ChunkLayout {
    geometry: KvGeometry,
    chunk_bytes: u64,
    block_tokens: u64,
}

impl ChunkLayout {
    /// The layout with as many tokens per chunk as fit.
    /// `InvalidArgument` for a zero in the geometry, a zero chunk, or a
    /// chunk too small for one token of every layer.
    pub fn new(geometry: KvGeometry, chunk_bytes: u64) -> Result<ChunkLayout> {
        ChunkLayout::with_block_tokens(geometry, chunk_bytes, 0)
    }

    /// The layout with `block_tokens` tokens per chunk (0: as many as fit),
    /// for kernels that take only some block sizes (e.g. powers of two).
    /// `InvalidArgument` as [`ChunkLayout::new`], and when that many tokens
    /// do not fit in a chunk.
    pub fn with_block_tokens(geometry: KvGeometry, chunk_bytes: u64, block_tokens: u64) -> Result<ChunkLayout> {
        geometry.check()?;
        if chunk_bytes == 0 {
            return Err(Error::invalid("chunk_bytes is 0"));
        }
        let fit = chunk_bytes / geometry.token_bytes();
        if fit == 0 {
            return Err(Error::invalid(format!(
                "a chunk of {chunk_bytes} bytes holds no token of {} bytes (every layer's key and value): use a larger chunk",
                geometry.token_bytes()
            )));
        }
        let block_tokens = match block_tokens {
            0 => fit,
            t if t > fit => {
                return Err(Error::invalid(format!(
                    "{t} tokens a block do not fit in a chunk of {chunk_bytes} bytes (at most {fit} of {} bytes)",
                    geometry.token_bytes()
                )))
            }
            t => t,
        };
        Ok(ChunkLayout { geometry, chunk_bytes, block_tokens })
    }

    /// The layout for `arena`'s chunk size (as many tokens as fit).
    pub fn for_arena(arena: &Arena, geometry: KvGeometry) -> Result<ChunkLayout> {
        ChunkLayout::new(geometry, arena.chunk_bytes())
    }

    /// The model geometry.
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    /// The chunk size: the block stride in bytes.
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    /// Tokens per chunk: the kernels' block size.
    pub fn block_tokens(&self) -> u64 {
        self.block_tokens
    }

    /// Bytes of one layer's keys (or values) in a chunk:
    /// `block_tokens × kv_heads × head_dim × dtype_bytes`.
    pub fn slab_bytes(&self) -> u64 {
        self.block_tokens * self.geometry.row_bytes()
    }

    /// Offset inside a chunk of `layer`'s keys.
    pub fn k_offset(&self, layer: u32) -> Result<u64> {
        self.check_layer(layer)?;
        Ok(2 * layer as u64 * self.slab_bytes())
    }

    /// Offset inside a chunk of `layer`'s values (right after its keys).
    pub fn v_offset(&self, layer: u32) -> Result<u64> {
        Ok(self.k_offset(layer)? + self.slab_bytes())
    }

    /// Bytes of a chunk that hold keys and values.
    pub fn used_bytes(&self) -> u64 {
        2 * self.geometry.layers as u64 * self.slab_bytes()
    }

    /// Bytes at the end of each chunk that hold nothing.
    pub fn unused_bytes(&self) -> u64 {
        self.chunk_bytes - self.used_bytes()
    }

    /// Chunks (blocks) that hold `tokens` tokens.
    pub fn blocks_for_tokens(&self, tokens: u64) -> u64 {
        tokens.div_ceil(self.block_tokens)
    }

    /// Allocation size for `tokens` tokens: whole chunks.
    /// `InvalidArgument` when it does not fit in 64 bits.
    pub fn bytes_for_tokens(&self, tokens: u64) -> Result<u64> {
        self.blocks_for_tokens(tokens)
            .checked_mul(self.chunk_bytes)
            .ok_or_else(|| Error::invalid(format!("{tokens} tokens take more than 2^64 bytes")))
    }

    /// Offset, from the start of an allocation, of the key (`value: false`)
    /// or value row of `token` (counted from the allocation's first token)
    /// in `layer`.
    pub fn token_offset(&self, layer: u32, value: bool, token: u64) -> Result<u64> {
        let slab = if value { self.v_offset(layer)? } else { self.k_offset(layer)? };
        let (block, within) = (token / self.block_tokens, token % self.block_tokens);
        block
            .checked_mul(self.chunk_bytes)
            .and_then(|b| b.checked_add(slab + within * self.geometry.row_bytes()))
            .ok_or_else(|| Error::invalid(format!("token {token} lies beyond 2^64 bytes")))
    }

    fn check_layer(&self, layer: u32) -> Result<()> {
        if layer >= self.geometry.layers {
            return Err(Error::invalid(format!("layer {layer} of a {}-layer geometry", self.geometry.layers)));
        }
        Ok(())
    }
}

/// One allocation's block table: the numbers of its chunks, in order,
/// counted from the arena's base (chunk `n` starts at `base + n × chunk`).
/// Entries are at most `i32::MAX`, so they fit the `int32` tables kernels
/// take.
///
/// An allocation's chunks are contiguous in the address space, so the
/// entries are consecutive numbers; they all change when it moves, and
/// growth appends entries. After a move the old entries stay readable until
/// the arena releases retired ranges (see [`Arena::release_retired`]): a
/// kernel launched with the old table before the move is still correct.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockTable {
    id: Id,
    base: u64,
    chunk_bytes: u64,
    blocks: Vec<u32>,
}

impl BlockTable {
    /// The table of allocation `id` as it is now. `InvalidArgument` for an
    /// allocation that does not start on a chunk (a small one, at most half
    /// a chunk, lives in a slab: allocate KV caches with
    /// [`ChunkLayout::bytes_for_tokens`] or as growable) or lies outside
    /// the arena's range (an import); the arena's errors otherwise.
    pub fn new(arena: &Arena, id: Id) -> Result<BlockTable> {
        let info = whole_chunks(arena, id)?;
        BlockTable::from_address(id, arena.va_range().0, arena.chunk_bytes(), info.ptr, info.size)
    }

    /// The table of allocation `id` at `ptr`, of `size` bytes, in an arena
    /// of `base` and `chunk_bytes` (no arena call).
    pub fn from_address(id: Id, base: u64, chunk_bytes: u64, ptr: u64, size: u64) -> Result<BlockTable> {
        if chunk_bytes == 0 {
            return Err(Error::invalid("chunk_bytes is 0"));
        }
        let mut t = BlockTable { id, base, chunk_bytes, blocks: Vec::new() };
        t.blocks = t.entries_at(ptr, size)?;
        Ok(t)
    }

    /// The allocation it describes.
    pub fn id(&self) -> Id {
        self.id
    }

    /// The arena's base address: chunk `n` starts at `base + n × chunk_bytes`.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// The arena's chunk size: the block stride.
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_bytes
    }

    /// Its entries: chunk numbers from the arena's base, in order.
    pub fn blocks(&self) -> &[u32] {
        &self.blocks
    }

    /// Number of entries (blocks).
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether it has no entry (never, for a live allocation).
    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Applies a move reported by the arena's move callback (no arena
    /// call, so it may run inside the callback). Returns the range of
    /// entries that changed or were added (empty when the move was of
    /// another allocation); entries beyond the new [`BlockTable::len`] were
    /// removed. On error the table is unchanged.
    pub fn on_move(&mut self, event: &MoveEvent) -> Result<Range<usize>> {
        if event.id != self.id {
            return Ok(self.len()..self.len());
        }
        self.update(event.new_ptr, event.size)
    }

    /// Sets the allocation's address and size (e.g. from a resize's return
    /// value); returns the entries that changed or were added, as
    /// [`BlockTable::on_move`]. On error the table is unchanged.
    pub fn update(&mut self, ptr: u64, size: u64) -> Result<Range<usize>> {
        let new = self.entries_at(ptr, size)?;
        let common = self.blocks.len().min(new.len());
        let first = (0..common).find(|&i| self.blocks[i] != new[i]).unwrap_or(common);
        let end = if new.len() > common {
            new.len()
        } else {
            (first..common).rfind(|&i| self.blocks[i] != new[i]).map_or(first, |i| i + 1)
        };
        self.blocks = new;
        Ok(first..end)
    }

    /// Reads the allocation's address and size from the arena and applies
    /// them ([`BlockTable::update`]): the call to make after a resize. Not
    /// from inside the move callback (arena calls fail there).
    pub fn refresh(&mut self, arena: &Arena) -> Result<Range<usize>> {
        let (base, _) = arena.va_range();
        if base != self.base || arena.chunk_bytes() != self.chunk_bytes {
            return Err(Error::invalid("the block table belongs to another arena"));
        }
        let info = whole_chunks(arena, self.id)?;
        self.update(info.ptr, info.size)
    }

    /// The entries of an allocation at `ptr` of `size` bytes.
    fn entries_at(&self, ptr: u64, size: u64) -> Result<Vec<u32>> {
        let chunk = self.chunk_bytes;
        let offset = ptr
            .checked_sub(self.base)
            .ok_or_else(|| Error::invalid(format!("address {ptr:#x} lies below the arena's base {:#x}", self.base)))?;
        if offset % chunk != 0 {
            return Err(Error::invalid(format!(
                "allocation at {ptr:#x} does not start on a chunk of {chunk} bytes (a small allocation in a slab?): \
                 a block table needs whole chunks"
            )));
        }
        let first = offset / chunk;
        let n = size.div_ceil(chunk);
        let last = first + n.saturating_sub(1);
        if last > i32::MAX as u64 {
            return Err(Error::invalid(format!("chunk number {last} does not fit an int32 block table")));
        }
        Ok((first..first + n).map(|c| c as u32).collect())
    }
}

/// `id`'s facts, refused unless it holds whole chunks of its own (a small
/// allocation shares its slab's chunk with others).
fn whole_chunks(arena: &Arena, id: Id) -> Result<crate::AllocInfo> {
    let info = arena.query(id)?;
    let chunk = arena.chunk_bytes();
    if info.reserved_bytes < chunk || info.reserved_bytes % chunk != 0 {
        return Err(Error::invalid(format!(
            "allocation {:#x} of {} bytes shares a chunk in a slab: a block table needs whole chunks \
             (allocate with ChunkLayout::bytes_for_tokens, or growable)",
            id.get(),
            info.size
        )));
    }
    Ok(info)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA_8B: KvGeometry = KvGeometry { layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2 };

    #[test]
    fn llama_shapes() {
        let l = ChunkLayout::new(LLAMA_8B, 2 << 20).unwrap();
        assert_eq!((l.block_tokens(), l.unused_bytes(), l.slab_bytes()), (16, 0, 16 * 2048));
        assert_eq!(l.k_offset(0).unwrap(), 0);
        assert_eq!(l.v_offset(0).unwrap(), 32 << 10);
        assert_eq!(l.k_offset(31).unwrap(), 62 * (32 << 10));
        assert_eq!(l.v_offset(31).unwrap() + l.slab_bytes(), 2 << 20);
        assert!(l.k_offset(32).is_err());
        // 70B-shaped: 80 layers fit 6 tokens in 2 MiB, 64 in 20 MiB exactly.
        let g70 = KvGeometry { layers: 80, ..LLAMA_8B };
        let small = ChunkLayout::new(g70, 2 << 20).unwrap();
        assert_eq!((small.block_tokens(), small.unused_bytes()), (6, (2 << 20) - 6 * 320 * 1024));
        let big = ChunkLayout::new(g70, 20 << 20).unwrap();
        assert_eq!((big.block_tokens(), big.unused_bytes()), (64, 0));
    }

    #[test]
    fn offsets_tile_the_chunk_without_overlap() {
        for (g, chunk) in [
            (LLAMA_8B, 2u64 << 20),
            (KvGeometry { layers: 3, kv_heads: 5, head_dim: 7, dtype_bytes: 4 }, 64 << 10),
            (KvGeometry { layers: 1, kv_heads: 1, head_dim: 1, dtype_bytes: 1 }, 4096),
        ] {
            let l = ChunkLayout::new(g, chunk).unwrap();
            let mut spans: Vec<(u64, u64)> = (0..g.layers)
                .flat_map(|layer| [l.k_offset(layer).unwrap(), l.v_offset(layer).unwrap()])
                .map(|o| (o, o + l.slab_bytes()))
                .collect();
            spans.sort();
            assert_eq!(spans[0].0, 0);
            assert!(spans.windows(2).all(|w| w[0].1 == w[1].0));
            assert_eq!(spans.last().unwrap().1, l.used_bytes());
            assert_eq!(l.used_bytes() + l.unused_bytes(), chunk);
            assert!(l.unused_bytes() < g.token_bytes(), "another token would have fit");
        }
    }

    #[test]
    fn token_offsets_walk_blocks() {
        let l = ChunkLayout::new(LLAMA_8B, 2 << 20).unwrap();
        assert_eq!(l.token_offset(0, false, 0).unwrap(), 0);
        assert_eq!(l.token_offset(0, false, 1).unwrap(), 2048);
        assert_eq!(l.token_offset(2, true, 17).unwrap(), (2 << 20) + l.v_offset(2).unwrap() + 2048);
        assert_eq!(l.blocks_for_tokens(0), 0);
        assert_eq!(l.blocks_for_tokens(16), 1);
        assert_eq!(l.blocks_for_tokens(17), 2);
        assert_eq!(l.bytes_for_tokens(33).unwrap(), 3 << 21);
        assert!(l.bytes_for_tokens(u64::MAX).is_err());
    }

    #[test]
    fn refuses_what_does_not_fit() {
        let bad = |r: Result<ChunkLayout>| matches!(r, Err(Error::InvalidArgument(_)));
        assert!(bad(ChunkLayout::new(KvGeometry { layers: 0, ..LLAMA_8B }, 2 << 20)));
        assert!(bad(ChunkLayout::new(LLAMA_8B, 0)));
        assert!(bad(ChunkLayout::new(LLAMA_8B, (128 << 10) - 1)));
        assert!(bad(ChunkLayout::with_block_tokens(LLAMA_8B, 2 << 20, 17)));
        let huge = KvGeometry { layers: u32::MAX, kv_heads: u32::MAX, head_dim: u32::MAX, dtype_bytes: 2 };
        assert!(bad(ChunkLayout::new(huge, 2 << 20)));
        let eight = ChunkLayout::with_block_tokens(LLAMA_8B, 2 << 20, 8).unwrap();
        assert_eq!((eight.block_tokens(), eight.unused_bytes()), (8, 1 << 20));
    }

    #[test]
    fn table_updates_say_what_changed() {
        let id = Id::from_raw(7).unwrap();
        let (base, chunk) = (1 << 30, 1 << 21);
        let mut t = BlockTable::from_address(id, base, chunk, base + 3 * chunk, 2 * chunk).unwrap();
        assert_eq!(t.blocks(), &[3, 4]);
        assert_eq!(t.update(base + 3 * chunk, 2 * chunk + 1).unwrap(), 2..3); // grew
        assert_eq!(t.blocks(), &[3, 4, 5]);
        assert_eq!(t.update(base + 3 * chunk, 3 * chunk).unwrap(), 3..3); // nothing changed
        let other = MoveEvent { id: Id::from_raw(8).unwrap(), old_ptr: 0, new_ptr: base, size: chunk };
        assert_eq!(t.on_move(&other).unwrap(), 3..3);
        let mine = MoveEvent { id, old_ptr: base + 3 * chunk, new_ptr: base, size: 3 * chunk };
        assert_eq!(t.on_move(&mine).unwrap(), 0..3);
        assert_eq!(t.blocks(), &[0, 1, 2]);
        assert_eq!(t.update(base, chunk).unwrap(), 1..1); // shrank: len says so
        assert_eq!(t.blocks(), &[0]);
        // Refusals leave the table as it was.
        for (ptr, size) in [(base + 5, chunk), (base - chunk, chunk), (base + ((i32::MAX as u64) << 21), 2 * chunk)] {
            assert!(matches!(t.update(ptr, size), Err(Error::InvalidArgument(_))));
            assert_eq!(t.blocks(), &[0]);
        }
    }
}
