//! kvcached's vLLM block pool: `ElasticBlockPool`
//! (`kvcached/integration/vllm/patches.py`), which replaces vLLM's
//! `BlockPool` and takes its blocks from a [`BlockManager`], and the calls
//! vLLM's scheduler makes on it for a request (`KVCacheManager` in
//! `vllm/v1/core/kv_cache_manager.py`: `get_computed_blocks`,
//! `allocate_slots`, `free`), as [`KvcachedPool`].
//!
//! Prefix caching: every full 16-token block of a request is cached under
//! its hash once computed (prompt blocks and decoded ones, as vLLM V1
//! does). A finished request's cached blocks stay, unreferenced, in the
//! LRU `_evictable_blocks` (its blocks are freed last first, as vLLM frees
//! `reversed(blocks)`, so its tail is evicted first); others are freed to
//! kvcached at once. The evictable pool is capped at `max_cached_blocks`
//! (`KVCACHED_MAX_CACHED_TOKENS` / 16, 16,000 tokens by default): past it,
//! `free_blocks` evicts the excess page-aware (`_page_aligned_victims`:
//! pages whose every allocated block is evictable, cheapest first, then
//! LRU); when an allocation finds too few free blocks it evicts in LRU
//! order (`get_new_blocks`).

use std::collections::{BTreeMap, HashMap};

use super::kvcached::BlockManager;

/// vLLM's block size, tokens.
pub const KVCACHED_BLOCK_TOKENS: u64 = 16;

/// `ElasticBlockPool`.
#[derive(Debug)]
pub struct ElasticBlockPool {
    pub mgr: BlockManager,
    num_gpu_blocks: u64,
    /// -1: unlimited; 0: cache nothing once free; > 0: the cap.
    pub max_cached_blocks: i64,
    enable_prefix_cache: bool,
    ref_cnt: Vec<u32>,
    /// `_cached_blocks`: hash -> blocks holding it, in insertion order.
    cached: HashMap<u64, Vec<u64>>,
    /// `_block_id_to_key`.
    block_key: HashMap<u64, u64>,
    /// `_evictable_blocks` (an OrderedDict): stamp -> block, and back.
    evictable: BTreeMap<u64, u64>,
    evictable_stamp: HashMap<u64, u64>,
    next_stamp: u64,
    pub evicted_blocks: u64,
}

impl ElasticBlockPool {
    /// `__init__`: `num_gpu_blocks` virtual blocks (block 0, the null
    /// block, is the manager's).
    pub fn new(mgr: BlockManager, num_gpu_blocks: u64, enable_prefix_cache: bool, max_cached_blocks: i64) -> Self {
        ElasticBlockPool {
            mgr,
            num_gpu_blocks,
            max_cached_blocks,
            enable_prefix_cache,
            ref_cnt: vec![0; num_gpu_blocks as usize],
            cached: HashMap::new(),
            block_key: HashMap::new(),
            evictable: BTreeMap::new(),
            evictable_stamp: HashMap::new(),
            next_stamp: 0,
            evicted_blocks: 0,
        }
    }

    pub fn num_gpu_blocks(&self) -> u64 {
        self.num_gpu_blocks
    }

    /// Blocks cached and referenced by nobody.
    pub fn num_evictable(&self) -> u64 {
        self.evictable.len() as u64
    }

    /// `get_cached_block`: the first block cached under `hash`.
    pub fn get_cached_block(&self, hash: u64) -> Option<u64> {
        if !self.enable_prefix_cache {
            return None;
        }
        self.cached.get(&hash).and_then(|v| v.first().copied())
    }

    fn remove_cached_block(&mut self, key: u64, block: u64) {
        if let Some(v) = self.cached.get_mut(&key) {
            v.retain(|&b| b != block);
            if v.is_empty() {
                self.cached.remove(&key);
            }
        }
    }

    /// `cache_full_blocks`: blocks `num_cached..num_full` of a request
    /// cached under their hashes.
    pub fn cache_full_blocks(&mut self, hashes: &[u64], blocks: &[u64], num_cached: usize, num_full: usize) {
        if !self.enable_prefix_cache || num_cached >= num_full {
            return;
        }
        for (i, &b) in blocks[num_cached..num_full].iter().enumerate() {
            let key = hashes[num_cached + i];
            if let Some(prev) = self.block_key.get(&b).copied() {
                if prev != key {
                    self.remove_cached_block(prev, b);
                }
            }
            let v = self.cached.entry(key).or_default();
            if !v.contains(&b) {
                v.push(b);
            }
            self.block_key.insert(b, key);
        }
    }

    fn evictable_ids(&self) -> Vec<u64> {
        self.evictable.values().copied().collect()
    }

    fn pop_evictable(&mut self, b: u64) -> bool {
        match self.evictable_stamp.remove(&b) {
            Some(s) => {
                self.evictable.remove(&s);
                true
            }
            None => false,
        }
    }

    /// `_page_aligned_victims`: evictable blocks grouped by page; pages
    /// whose allocated blocks are all evictable, fewest blocks first (ties:
    /// the page whose most recently used block is oldest), taken while
    /// they fit in `n`.
    fn page_aligned_victims(&self, n: u64) -> Vec<u64> {
        let bids = self.evictable_ids();
        let rank: HashMap<u64, usize> = bids.iter().enumerate().map(|(i, &b)| (b, i)).collect();
        let by_page = self.mgr.page_allocator.group_indices_by_page(&bids, self.mgr.block_mem_size);
        let mut pages: Vec<(usize, usize, Vec<u64>)> = by_page
            .into_iter()
            .filter(|(p, ids)| ids.len() as u64 >= self.mgr.page_occupancy(*p))
            .map(|(_, ids)| (ids.len(), ids.iter().map(|b| rank[b]).max().unwrap_or(0), ids))
            .collect();
        pages.sort_by_key(|p| (p.0, p.1));
        let mut victims = Vec::new();
        for (cost, _, ids) in pages {
            if (victims.len() + cost) as u64 > n {
                break;
            }
            victims.extend(ids);
        }
        victims
    }

    /// `_evict_blocks_from_pool`: evicts `n` evictable blocks (page-aware
    /// victims first, topped up in LRU order, or LRU only) and frees them
    /// to kvcached in one call.
    pub fn evict_blocks_from_pool(&mut self, n: u64, page_aware: bool) -> u64 {
        let n = n.min(self.evictable.len() as u64);
        if n == 0 {
            return 0;
        }
        let mut ordered = if page_aware { self.page_aligned_victims(n) } else { Vec::new() };
        if page_aware {
            let chosen: std::collections::HashSet<u64> = ordered.iter().copied().collect();
            ordered.extend(self.evictable_ids().into_iter().filter(|b| !chosen.contains(b)));
        } else {
            ordered = self.evictable_ids();
        }
        let mut ids = Vec::with_capacity(n as usize);
        for &b in &ordered[..n as usize] {
            self.pop_evictable(b);
            if let Some(k) = self.block_key.remove(&b) {
                self.remove_cached_block(k, b);
            }
            ids.push(b);
        }
        self.evicted_blocks += ids.len() as u64;
        self.mgr.free(&ids);
        ids.len() as u64
    }

    /// `get_num_free_blocks`: kvcached's available blocks plus evictable.
    pub fn get_num_free_blocks(&self) -> u64 {
        self.mgr.available_size() + if self.enable_prefix_cache { self.evictable.len() as u64 } else { 0 }
    }

    /// `get_new_blocks`: `n` blocks with a reference each, evicting in LRU
    /// order what kvcached is short of (two tries); `None` when the pool
    /// cannot (vLLM's scheduler then preempts or waits).
    pub fn get_new_blocks(&mut self, n: u64) -> Option<Vec<u64>> {
        if n > self.get_num_free_blocks() {
            return None;
        }
        let mut got = None;
        for _ in 0..2 {
            if self.enable_prefix_cache {
                let free = self.mgr.available_size();
                if free < n && !self.evictable.is_empty() {
                    self.evict_blocks_from_pool(n - free, false);
                }
            }
            got = self.mgr.alloc(n);
            if got.is_some() {
                break;
            }
        }
        let ids = got?;
        for &b in &ids {
            self.ref_cnt[b as usize] = 1;
        }
        Some(ids)
    }

    /// `touch`: a cache hit takes a reference (out of the evictable pool).
    pub fn touch(&mut self, blocks: &[u64]) {
        if !self.enable_prefix_cache {
            return;
        }
        for &b in blocks {
            self.ref_cnt[b as usize] += 1;
            self.pop_evictable(b);
        }
    }

    /// `free_blocks`: drops a reference from each block, in order; cached
    /// blocks nobody holds become evictable, others go back to kvcached;
    /// then the evictable pool is trimmed to its cap, page-aware.
    pub fn free_blocks(&mut self, ordered: &[u64]) {
        if !self.enable_prefix_cache {
            self.mgr.free(ordered);
            return;
        }
        let mut uncached = Vec::new();
        for &b in ordered {
            let r = &mut self.ref_cnt[b as usize];
            *r -= 1;
            if *r == 0 {
                if self.block_key.contains_key(&b) {
                    if !self.evictable_stamp.contains_key(&b) {
                        self.evictable.insert(self.next_stamp, b);
                        self.evictable_stamp.insert(b, self.next_stamp);
                        self.next_stamp += 1;
                    }
                } else {
                    uncached.push(b);
                }
            }
        }
        if !uncached.is_empty() {
            self.mgr.free(&uncached);
        }
        if self.max_cached_blocks >= 0 && self.evictable.len() as i64 > self.max_cached_blocks {
            let excess = self.evictable.len() as u64 - self.max_cached_blocks as u64;
            self.evict_blocks_from_pool(excess, true);
        }
    }

    /// `reset_prefix_cache`: every evictable block freed, the cache emptied.
    pub fn reset_prefix_cache(&mut self) {
        let ids = self.evictable_ids();
        self.evictable.clear();
        self.evictable_stamp.clear();
        self.mgr.free(&ids);
        self.cached.clear();
        self.block_key.clear();
    }
}

/// A request as vLLM's scheduler drives the pool: its blocks, the hashes
/// of its full blocks (prompt and output), the tokens computed.
#[derive(Clone, Debug)]
struct Seq {
    blocks: Vec<u64>,
    hashes: std::sync::Arc<[u64]>,
    cached_blocks: usize,
}

/// vLLM's `KVCacheManager` over an [`ElasticBlockPool`], one request at a
/// time; `hashes[i]` is the hash of the request's block `i` (vLLM chains
/// each on its predecessor, so equal hashes mean equal prefixes).
#[derive(Debug)]
pub struct KvcachedPool {
    pub pool: ElasticBlockPool,
    seqs: HashMap<u64, Seq>,
    pub hit_tokens: u64,
    pub prompt_tokens: u64,
}

impl KvcachedPool {
    pub fn new(pool: ElasticBlockPool) -> KvcachedPool {
        KvcachedPool { pool, seqs: HashMap::new(), hit_tokens: 0, prompt_tokens: 0 }
    }

    /// `get_computed_blocks`: the longest chain of cached blocks of the
    /// prompt, at most `(prompt - 1) / 16` blocks (the last prompt token is
    /// always computed).
    pub fn computed_blocks(&self, hashes: &[u64], prompt: u64) -> Vec<u64> {
        let max = ((prompt.saturating_sub(1)) / KVCACHED_BLOCK_TOKENS) as usize;
        let mut hit = Vec::new();
        for &h in hashes.iter().take(max) {
            match self.pool.get_cached_block(h) {
                Some(b) => hit.push(b),
                None => break,
            }
        }
        hit
    }

    /// Admits request `id` with a `prompt`-token prompt (`allocate_slots`
    /// for the whole prompt): its hit touched, its other blocks new, its
    /// full prompt blocks cached. Returns the hit tokens, or `None` (and
    /// nothing changed) when the pool has too few blocks.
    pub fn admit(&mut self, id: u64, hashes: std::sync::Arc<[u64]>, prompt: u64) -> Option<u64> {
        let hit = self.computed_blocks(&hashes, prompt);
        let need = prompt.div_ceil(KVCACHED_BLOCK_TOKENS) - hit.len() as u64;
        // vLLM counts the hit's evictable blocks out of the free ones.
        let hit_evictable = hit.iter().filter(|b| self.pool.evictable_stamp.contains_key(b)).count() as u64;
        if need > self.pool.get_num_free_blocks() - hit_evictable {
            return None;
        }
        self.pool.touch(&hit);
        let Some(new) = self.pool.get_new_blocks(need) else {
            self.pool.free_blocks(&hit.iter().rev().copied().collect::<Vec<_>>());
            return None;
        };
        let hit_blocks = hit.len();
        let mut blocks = hit;
        blocks.extend(new);
        let full = ((prompt / KVCACHED_BLOCK_TOKENS) as usize).min(hashes.len());
        self.pool.cache_full_blocks(&hashes, &blocks, hit_blocks, full);
        self.seqs.insert(id, Seq { blocks, hashes, cached_blocks: full.max(hit_blocks) });
        let hit_tokens = hit_blocks as u64 * KVCACHED_BLOCK_TOKENS;
        self.hit_tokens += hit_tokens;
        self.prompt_tokens += prompt;
        Some(hit_tokens)
    }

    /// A decode step of request `id` computing its token `tokens - 1`
    /// (`allocate_slots` for one token): a block more when it starts one,
    /// the block it fills cached. False (nothing changed) when the pool
    /// has no block.
    pub fn decode(&mut self, id: u64, tokens: u64) -> bool {
        let s = self.seqs.get(&id).expect("live request");
        let need = tokens.div_ceil(KVCACHED_BLOCK_TOKENS) as usize;
        if need > s.blocks.len() {
            let Some(new) = self.pool.get_new_blocks((need - s.blocks.len()) as u64) else { return false };
            self.seqs.get_mut(&id).expect("live").blocks.extend(new);
        }
        let s = self.seqs.get_mut(&id).expect("live");
        let full = ((tokens / KVCACHED_BLOCK_TOKENS) as usize).min(s.hashes.len());
        if full > s.cached_blocks {
            let (hashes, blocks, from) = (s.hashes.clone(), s.blocks.clone(), s.cached_blocks);
            s.cached_blocks = full;
            self.pool.cache_full_blocks(&hashes, &blocks, from, full);
        }
        true
    }

    /// `free`: the request's blocks released, last block first.
    pub fn finish(&mut self, id: u64) {
        if let Some(s) = self.seqs.remove(&id) {
            let rev: Vec<u64> = s.blocks.iter().rev().copied().collect();
            self.pool.free_blocks(&rev);
        }
    }

    pub fn running(&self) -> usize {
        self.seqs.len()
    }
}
