//! vLLM's paged block pool, preallocated, with automatic prefix caching.

use super::paged::{BlockMemory, PagedMgr};
use super::*;

/// vLLM's paged KV cache: at start-up every KV tensor is allocated for the
/// whole capacity (`vllm/v1/worker/gpu_model_runner.py`, one tensor per
/// layer holding K and V, or one tensor for the token-major layout), cut
/// into blocks of 16 tokens. Nothing grows, nothing is returned. The pool's
/// policy is `paged.rs`'s.
pub type VllmMgr = PagedMgr<Preallocated>;

pub const VLLM_BLOCK_TOKENS: u64 = 16;

/// vLLM's KV tensors, mapped whole at start-up.
pub struct Preallocated {
    dev: Dev,
    shape: KvShape,
    tensors: Vec<(u64, u64, ChunkHandle)>,
    num_blocks: u64,
}

impl VllmMgr {
    pub fn new(shape: KvShape, capacity: u64, prefix_caching: bool) -> Result<VllmMgr, String> {
        let dev = new_device(capacity)?;
        let n_tensors = match shape.layout {
            Layout::TokenMajor | Layout::BlockInChunk => 1,
            Layout::PerLayer => shape.layers as u64,
        };
        let per_block = VLLM_BLOCK_TOKENS * shape.bpt() * (shape.n_allocs() / n_tensors);
        let per_tensor_room = capacity / n_tensors / (2 << 20) * (2 << 20);
        let num_blocks = per_tensor_room / per_block;
        if num_blocks < 2 {
            return Err(format!("capacity {capacity} holds no block of {per_block} bytes per tensor"));
        }
        let size = (num_blocks * per_block).div_ceil(2 << 20) * (2 << 20);
        let mut tensors = Vec::new();
        for _ in 0..n_tensors {
            let base = dev.reserve(size, 2 << 20).map_err(|e| e.to_string())?;
            let h = dev.create(size).map_err(|e| e.to_string())?;
            dev.map(base, size, h, 0).map_err(|e| e.to_string())?;
            dev.set_access(base, size).map_err(|e| e.to_string())?;
            tensors.push((base, size, h));
        }
        let mem = Preallocated { dev, shape, tensors, num_blocks };
        PagedMgr::with_memory("vllm-paged", mem, shape, VLLM_BLOCK_TOKENS, num_blocks, capacity, prefix_caching)
    }
}

impl BlockMemory for Preallocated {
    fn dev(&self) -> &Dev {
        &self.dev
    }

    fn back(&mut self, _b: u32) -> Result<(), Fail> {
        Ok(())
    }

    fn unback(&mut self, b: u32, discard_pages: bool) {
        if !discard_pages {
            return;
        }
        // Dead KV (no prefix cache keeps it): give its host pages back.
        let len = VLLM_BLOCK_TOKENS * self.shape.bpt();
        for (base, _, _) in &self.tensors {
            match self.shape.layout {
                Layout::TokenMajor | Layout::BlockInChunk => discard(base + b as u64 * len, len),
                Layout::PerLayer => {
                    for kv in 0..2 {
                        discard(base + (kv * self.num_blocks + b as u64) * len, len);
                    }
                }
            }
        }
    }

    fn backed(&self, _b: u32) -> bool {
        true
    }

    fn addr(&self, b: u32, pos: u64, a: usize) -> u64 {
        let bpt = self.shape.bpt();
        let block = b as u64;
        match self.shape.layout {
            Layout::TokenMajor | Layout::BlockInChunk => self.tensors[0].0 + (block * VLLM_BLOCK_TOKENS + pos) * bpt,
            Layout::PerLayer => {
                let (l, kv) = (a / 2, a as u64 % 2);
                self.tensors[l].0 + (kv * self.num_blocks + block) * VLLM_BLOCK_TOKENS * bpt + pos * bpt
            }
        }
    }
}

impl Drop for Preallocated {
    fn drop(&mut self) {
        for &(base, size, h) in &self.tensors {
            let _ = self.dev.unmap(base, size);
            let _ = self.dev.release(h);
            let _ = self.dev.free_reservation(base, size);
        }
    }
}
