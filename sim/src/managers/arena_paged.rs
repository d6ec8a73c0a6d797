//! `arena-paged`: the arena under vLLM's block pool. Each block is one
//! arena chunk holding its tokens of every layer (the block-in-chunk
//! layout, `vmm_arena::layout`), and a paged kernel reads a request through
//! its block table (chunk numbers from the arena's base), so a request's
//! chunks need not be contiguous: a chunk is used where it lies. Which
//! block a request gets, which cached block is evicted and when admission
//! fails are decided by the one policy of `paged.rs`, as for `vllm-paged`;
//! only the memory differs:
//!
//! - a block gets its chunk when first taken (`Arena::alloc` of one chunk:
//!   a chunk the arena holds mapped at a free address is adopted where it
//!   lies, with no driver call; otherwise one is created and mapped), and
//!   gives it back (`Arena::free`) when freed holding nothing cached. An
//!   evicted cached block is reused in place: its chunk stays where it is,
//!   and the new owner's block table names it;
//! - every read and write of KV is on the engine's one stream, so a chunk's
//!   next owner is ordered after its old owner's queued work by the stream
//!   itself, as a vLLM block reused at once is: the plain `free`/`alloc`
//!   pair is the right one, and `free_on_stream` (an event recorded per
//!   free, polled per alloc) would only pay for an ordering the stream
//!   already gives. A second stream reading KV would need it;
//! - between steps, while the GPU computes, the blocks the next step's
//!   growth and admissions will take get their chunks (driver calls there
//!   are hidden up to the step's GPU time). No chunk is created ahead
//!   beyond those (no `set_prefetch`): with memory full the prefetcher
//!   would unmap free cached chunks to keep its target, and every one of
//!   them is a block a later request adopts with no call;
//! - memory not used by live or cached KV stays with the arena (pooled,
//!   mapped), where `trim` or the retain limit gives it back to the driver;
//! - with `--paged-warm W` the arena maps W bytes before the first request
//!   and keeps them pooled (start-up work, not charged, as vLLM's pool is
//!   built before serving): the first blocks adopt them instead of being
//!   created in a step; by default (0) every chunk is created when first
//!   needed.

use super::paged::{BlockMemory, PagedMgr};
use super::*;

/// The arena's chunks as a block pool's memory (see the module docs).
pub struct ArenaBlocks {
    arena: Arena,
    dev: Dev,
    chunk: u64,
    /// Bytes of one token's KV (all layers) inside a block's chunk.
    token_bytes: u64,
    /// Each block's allocation and address, while it has a chunk.
    held: Vec<Option<(Id, u64)>>,
    back_ahead_failures: u64,
    last_error: Option<String>,
}

pub type ArenaPagedMgr = PagedMgr<ArenaBlocks>;

/// Tokens of `token_bytes` per block of a `chunk`-byte chunk: the most
/// that fit, rounded down to a power of two so that blocks tile a hash
/// block (a remainder of the chunk is padding; none for Llama-3-8B's
/// 128 KiB tokens, 16 to a 2 MiB chunk as in vLLM's blocks).
pub fn paged_block_tokens(chunk: u64, token_bytes: u64) -> Result<u64, String> {
    let fit = (chunk / token_bytes.max(1)).min(HASH_BLOCK_TOKENS);
    if fit == 0 {
        return Err(format!("a {chunk}-byte chunk holds no {token_bytes}-byte token"));
    }
    Ok(1 << fit.ilog2())
}

impl ArenaPagedMgr {
    /// The arena of `o.capacity` bytes under a pool of as many blocks as
    /// whole chunks fit in it (block 0 is the null block, as in vLLM's).
    pub fn new(shape: KvShape, o: ArenaOptions, prefix_caching: bool) -> Result<ArenaPagedMgr, String> {
        // One-chunk allocations never move, whatever `no_implicit_moves`.
        let (arena, dev) = o.arena()?;
        if o.paged_warm_bytes > 0 {
            // The start-up pool: mapped once, freed, kept pooled (the
            // arena retains all) where the first blocks adopt it.
            let warm = o.paged_warm_bytes.min(o.capacity);
            let (id, _) = arena.alloc(warm).map_err(|e| format!("arena-paged start-up pool of {warm} bytes: {e}"))?;
            arena.free(id).map_err(|e| format!("arena-paged start-up pool: {e}"))?;
        }
        let chunk = arena.chunk_bytes();
        let block_tokens = paged_block_tokens(chunk, shape.kv_bytes_per_token)?;
        let num_blocks = o.capacity / chunk;
        // One tag slot per token, at its token's place in the block.
        let shape = KvShape { layout: Layout::BlockInChunk, ..shape };
        let mem = ArenaBlocks {
            arena,
            dev,
            chunk,
            token_bytes: shape.kv_bytes_per_token,
            held: vec![None; num_blocks as usize],
            back_ahead_failures: 0,
            last_error: None,
        };
        PagedMgr::with_memory("arena-paged", mem, shape, block_tokens, num_blocks, o.capacity, prefix_caching)
    }
}

impl ArenaBlocks {
    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    /// Block `b`'s entry in a block table: its chunk's number from the
    /// arena's base.
    pub fn chunk_index(&self, b: u32) -> Option<u64> {
        let (_, addr) = self.held[b as usize]?;
        Some((addr - self.arena.va_range().0) / self.chunk)
    }
}

impl BlockMemory for ArenaBlocks {
    fn dev(&self) -> &Dev {
        &self.dev
    }

    fn back(&mut self, b: u32) -> Result<(), Fail> {
        if self.held[b as usize].is_some() {
            return Ok(()); // an evicted cached block, reused where it lies
        }
        match self.arena.alloc(self.chunk) {
            Ok(placed) => {
                self.held[b as usize] = Some(placed);
                Ok(())
            }
            Err(e) => {
                let host_limit = is_host_limit(&e);
                Err(Fail { fragmentation: false, host_limit, message: format!("arena-paged block {b}: {e}") })
            }
        }
    }

    fn unback(&mut self, b: u32, discard_pages: bool) {
        let Some((id, addr)) = self.held[b as usize].take() else { return };
        if discard_pages {
            discard(addr, self.chunk);
        }
        // Stream order keeps the next owner after this one's queued work
        // (module docs). A free of a live id does not fail.
        if let Err(e) = self.arena.free(id) {
            self.last_error = Some(e.to_string());
        }
    }

    fn backed(&self, b: u32) -> bool {
        self.held[b as usize].is_some()
    }

    fn addr(&self, b: u32, pos: u64, _a: usize) -> u64 {
        let (_, addr) = self.held[b as usize].expect("a block in use has a chunk");
        addr + pos * self.token_bytes
    }

    fn back_ahead_failed(&mut self, f: Fail) {
        self.back_ahead_failures += 1;
        self.last_error = Some(f.message);
    }

    fn extra(&self) -> Vec<(String, String)> {
        let mut v = vec![("back_ahead_failures".to_string(), self.back_ahead_failures.to_string())];
        if let Some(e) = &self.last_error {
            v.push(("last_error".into(), serde_json::to_string(e).unwrap_or_default()));
        }
        if let Ok(s) = self.arena.stats() {
            v.push(("arena_peak_physical_bytes".into(), s.peak_physical_bytes.to_string()));
            v.push(("arena_pooled_bytes".into(), s.pooled_bytes.to_string()));
        }
        v
    }
}
