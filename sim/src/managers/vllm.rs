//! vLLM's paged block pool, preallocated, with automatic prefix caching.

use super::*;

/// vLLM's paged KV cache: at start-up every KV tensor is allocated for the
/// whole capacity (`vllm/v1/worker/gpu_model_runner.py`, one tensor per
/// layer holding K and V, or one tensor for the token-major layout), cut
/// into blocks of 16 tokens (`vllm/v1/core/block_pool.py`: block 0 is the
/// null block; `get_new_blocks` pops free blocks from the front of the free
/// queue and fails when too few are free; `free_blocks` appends a finished
/// request's blocks, last block first, as `single_type_kv_cache_manager.py`
/// frees `reversed(req_blocks)`). Nothing grows, nothing is returned.
///
/// Automatic prefix caching, on by default as in vLLM: a request reuses the
/// longest chain of cached blocks of its prompt (Mooncake `hash_ids`, 512
/// tokens each, chained on their predecessors), always computing at least
/// its last prompt token (hits are whole 16-token blocks of the first
/// `prompt - 1` tokens). Blocks of finished requests stay cached, in the
/// free queue, until popped for reuse in LRU order (eviction); a hit on a
/// free cached block takes it out of the queue. Traces without hashes
/// share nothing.
pub struct VllmMgr {
    dev: Dev,
    shape: KvShape,
    tensors: Vec<(u64, u64, ChunkHandle)>,
    num_blocks: u64,
    prefix_caching: bool,
    /// Free blocks, least recently freed first. Entries are deleted lazily:
    /// one counts only while its stamp is the block's `free_stamp`.
    free_q: VecDeque<(u32, u64)>,
    free_stamp: Vec<u64>,
    next_stamp: u64,
    n_free: u64,
    refs: Vec<u32>,
    /// Cached prompt blocks: hash id -> its 16-token blocks, in order. vLLM
    /// hashes every 16-token block on its predecessors; evicting one cuts
    /// the chain there, so an entry is a prefix of the hash block's blocks.
    cache: std::collections::HashMap<u64, Vec<u32>>,
    /// The cached hash block (and index in it) a block holds.
    block_hash: Vec<Option<(u64, u32)>>,
    seqs: Vec<Option<Vec<u32>>>,
    /// Chunked prefill: running requests whose prompt has full hash blocks
    /// not computed yet (their hashes, and the count of full blocks).
    uncached: std::collections::HashMap<usize, (std::sync::Arc<[u64]>, usize)>,
    hit_blocks: u64,
    evicted_blocks: u64,
    /// Blocks mapped by more than one running request, once per extra one.
    shared_live_blocks: u64,
    capacity: u64,
    discard: bool,
}

pub const VLLM_BLOCK_TOKENS: u64 = 16;

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
        let nb = num_blocks as usize;
        let mut m = VllmMgr {
            dev,
            shape,
            tensors,
            num_blocks,
            prefix_caching,
            free_q: VecDeque::with_capacity(nb),
            free_stamp: vec![0; nb],
            next_stamp: 1,
            n_free: 0,
            refs: vec![0; nb],
            cache: Default::default(),
            block_hash: vec![None; nb],
            seqs: Vec::new(),
            uncached: Default::default(),
            hit_blocks: 0,
            evicted_blocks: 0,
            shared_live_blocks: 0,
            capacity,
            discard: false,
        };
        for b in 1..num_blocks as u32 {
            m.push_free(b);
        }
        Ok(m)
    }

    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    fn push_free(&mut self, b: u32) {
        self.free_stamp[b as usize] = self.next_stamp;
        self.free_q.push_back((b, self.next_stamp));
        self.next_stamp += 1;
        self.n_free += 1;
    }

    fn unfree(&mut self, b: u32) {
        debug_assert!(self.free_stamp[b as usize] != 0);
        self.free_stamp[b as usize] = 0;
        self.n_free -= 1;
    }

    fn addr(&self, blocks: &[u32], t: u64) -> u64 {
        let (a, _) = self.shape.slot(t);
        let bpt = self.shape.bpt();
        let block = blocks[(t / VLLM_BLOCK_TOKENS) as usize] as u64;
        let pos = t % VLLM_BLOCK_TOKENS;
        match self.shape.layout {
            Layout::TokenMajor | Layout::BlockInChunk => self.tensors[0].0 + (block * VLLM_BLOCK_TOKENS + pos) * bpt,
            Layout::PerLayer => {
                let (l, kv) = (a / 2, a as u64 % 2);
                self.tensors[l].0 + (kv * self.num_blocks + block) * VLLM_BLOCK_TOKENS * bpt + pos * bpt
            }
        }
    }

    /// Pops `n` free blocks, least recently freed first, evicting the
    /// cached prefixes they held.
    fn take(&mut self, n: u64) -> Result<Vec<u32>, Fail> {
        if n > self.n_free {
            return Err(Fail {
                fragmentation: false,
                host_limit: false,
                message: format!("{n} blocks needed, {} free", self.n_free),
            });
        }
        let mut out = Vec::with_capacity(n as usize);
        while (out.len() as u64) < n {
            let (b, stamp) = self.free_q.pop_front().expect("n_free counts the queue's live entries");
            if self.free_stamp[b as usize] != stamp {
                continue; // taken by a hit since it was freed
            }
            self.unfree(b);
            if let Some((h, i)) = self.block_hash[b as usize] {
                // Evicted: the cached chain of this hash block ends before it.
                let entry = self.cache.get_mut(&h).expect("a hashed block's entry");
                for x in entry.drain(i as usize..) {
                    self.block_hash[x as usize] = None;
                    self.evicted_blocks += 1;
                }
                if entry.is_empty() {
                    self.cache.remove(&h);
                }
            }
            out.push(b);
        }
        Ok(out)
    }

    /// The cached blocks a new request of `q` can use: whole 16-token
    /// blocks of its first `prompt - 1` tokens, along the longest chain of
    /// cached hash blocks.
    fn lookup(&self, q: &Request) -> Vec<u32> {
        let mut hit = Vec::new();
        if !self.prefix_caching {
            return hit;
        }
        let max_blocks = (q.prompt.saturating_sub(1) / VLLM_BLOCK_TOKENS) as usize;
        let per_hash = (HASH_BLOCK_TOKENS / VLLM_BLOCK_TOKENS) as usize;
        for j in 0..q.full_hash_blocks() as usize {
            let Some(blocks) = self.cache.get(&q.hash_ids[j]) else { break };
            let take = blocks.len().min(max_blocks - hit.len());
            hit.extend_from_slice(&blocks[..take]);
            if hit.len() == max_blocks || blocks.len() < per_hash {
                break;
            }
        }
        hit
    }

    /// Caches a request's first `computed` full hash blocks (`blocks` are
    /// its blocks, `hashes` its prompt's), as vLLM caches a block once it
    /// is computed. A cut chain is completed with the request's blocks;
    /// blocks already cached are left (calling again with more is fine).
    fn cache_computed(&mut self, blocks: &[u32], hashes: &[u64], computed: usize) {
        let per_hash = (HASH_BLOCK_TOKENS / VLLM_BLOCK_TOKENS) as usize;
        for (j, &h) in hashes[..computed].iter().enumerate() {
            let own = &blocks[j * per_hash..(j + 1) * per_hash];
            let entry = self.cache.entry(h).or_default();
            if entry.len() == per_hash || own[..entry.len()] != entry[..] {
                continue; // complete, or computed apart from this request
            }
            for (i, &b) in own.iter().enumerate().skip(entry.len()) {
                if self.block_hash[b as usize].is_some() {
                    break; // another prefix's cached block (cannot happen: blocks are new)
                }
                self.block_hash[b as usize] = Some((h, i as u32));
                entry.push(b);
            }
        }
    }

    /// Drops a request's references; blocks nobody uses go to the free
    /// queue, last block first (so a request's tail is evicted first).
    fn release(&mut self, blocks: Vec<u32>) {
        for b in blocks.into_iter().rev() {
            let r = &mut self.refs[b as usize];
            *r -= 1;
            if *r > 0 {
                self.shared_live_blocks -= 1;
            }
            if *r == 0 {
                if self.discard && self.block_hash[b as usize].is_none() {
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
                self.push_free(b);
            }
        }
        if self.free_q.len() > 2 * self.num_blocks as usize + 1024 {
            let stamps = &self.free_stamp;
            self.free_q.retain(|&(b, s)| stamps[b as usize] == s);
        }
    }
}

impl Drop for VllmMgr {
    fn drop(&mut self) {
        for &(base, size, h) in &self.tensors {
            let _ = self.dev.unmap(base, size);
            let _ = self.dev.release(h);
            let _ = self.dev.free_reservation(base, size);
        }
    }
}

impl KvManager for VllmMgr {
    fn name(&self) -> &'static str {
        "vllm-paged"
    }

    fn admit(&mut self, seq: usize, tokens: u64, q: &Request) -> Result<u64, Fail> {
        let need = tokens.div_ceil(VLLM_BLOCK_TOKENS);
        let hit = self.lookup(q);
        let hit_free = hit.iter().filter(|&&b| self.refs[b as usize] == 0).count() as u64;
        let fresh = need - hit.len() as u64;
        if fresh > self.n_free - hit_free {
            return Err(Fail {
                fragmentation: false,
                host_limit: false,
                message: format!("{fresh} blocks needed, {} free", self.n_free - hit_free),
            });
        }
        for &b in &hit {
            if self.refs[b as usize] == 0 {
                self.unfree(b);
            } else {
                self.shared_live_blocks += 1;
            }
            self.refs[b as usize] += 1;
        }
        let new = self.take(fresh)?;
        for &b in &new {
            self.refs[b as usize] = 1;
        }
        self.hit_blocks += hit.len() as u64;
        let hit_tokens = hit.len() as u64 * VLLM_BLOCK_TOKENS;
        let mut blocks = hit;
        blocks.extend(new);
        if self.prefix_caching {
            // The full hash blocks computed in this step (the whole prompt's,
            // or, with chunked prefill, those inside its first chunk).
            let full = q.full_hash_blocks() as usize;
            let computed = full.min((tokens / HASH_BLOCK_TOKENS) as usize);
            self.cache_computed(&blocks, &q.hash_ids, computed);
            if computed < full {
                self.uncached.insert(seq, (q.hash_ids.clone(), full));
            }
        }
        *slot_vec(&mut self.seqs, seq) = Some(blocks);
        Ok(hit_tokens)
    }

    fn grow(&mut self, seq: usize, tokens: u64, _stored: u64) -> Result<(), Fail> {
        let have = self.seqs[seq].as_ref().expect("live").len() as u64;
        let need = tokens.div_ceil(VLLM_BLOCK_TOKENS);
        if need > have {
            let more = self.take(need - have)?;
            for &b in &more {
                self.refs[b as usize] = 1;
            }
            self.seqs[seq].as_mut().expect("live").extend(more);
        }
        // Chunked prefill: the hash blocks this chunk computes are cached.
        if let Some((hashes, full)) = self.uncached.get(&seq).cloned() {
            let computed = full.min((tokens / HASH_BLOCK_TOKENS) as usize);
            let blocks = self.seqs[seq].take().expect("live");
            self.cache_computed(&blocks, &hashes, computed);
            self.seqs[seq] = Some(blocks);
            if computed == full {
                self.uncached.remove(&seq);
            }
        }
        Ok(())
    }

    fn free(&mut self, seq: usize) {
        self.uncached.remove(&seq);
        if let Some(blocks) = self.seqs[seq].take() {
            self.release(blocks);
        }
    }

    fn write_tag(&mut self, seq: usize, t: u64, tag: u64) -> bool {
        let addr = self.addr(self.seqs[seq].as_ref().expect("live"), t);
        self.dev.write(addr, &tag.to_le_bytes()).is_ok()
    }

    fn read_tag(&mut self, seq: usize, t: u64) -> Option<u64> {
        let addr = self.addr(self.seqs[seq].as_ref().expect("live"), t);
        let mut b = [0u8; 8];
        self.dev.read(addr, &mut b).ok()?;
        Some(u64::from_le_bytes(b))
    }

    fn counting_device(&self) -> Option<&Dev> {
        Some(&self.dev)
    }

    fn bytes_copied(&self) -> u64 {
        0
    }

    fn moves(&self) -> u64 {
        0
    }

    fn housekeeping(&mut self) {
        self.discard = self.dev.inner().allocated_file_bytes().unwrap_or(0) > host_budget(self.capacity);
    }

    fn gpu_finished_step(&mut self) {
        self.dev.finish_gpu_step();
    }

    fn extra(&self) -> Vec<(String, String)> {
        vec![
            ("num_blocks".into(), self.num_blocks.to_string()),
            ("block_tokens".into(), VLLM_BLOCK_TOKENS.to_string()),
            ("prefix_caching".into(), self.prefix_caching.to_string()),
            ("prefix_hit_blocks".into(), self.hit_blocks.to_string()),
            ("evicted_prefix_blocks".into(), self.evicted_blocks.to_string()),
            ("cached_prefixes".into(), self.cache.len().to_string()),
        ]
    }

    fn shared_live_bytes(&self) -> u64 {
        self.shared_live_blocks * VLLM_BLOCK_TOKENS * self.shape.kv_bytes_per_token
    }

    fn prefix_hit(&mut self, _seq: usize, q: &Request) -> u64 {
        self.lookup(q).len() as u64 * VLLM_BLOCK_TOKENS
    }
}
