//! The paged block pool with automatic prefix caching, as vLLM runs it,
//! over two ways of holding a block's memory ([`BlockMemory`]): vLLM's
//! tensors preallocated for the whole capacity (`vllm.rs`), and the arena's
//! chunks, one per block, mapped as blocks are first used and given back
//! to the arena when freed (`arena_paged.rs`). One policy decides which
//! block a request gets, which cached block is evicted and when admission
//! fails, so the two differ only in what their memory costs.
//!
//! The policy (`vllm/v1/core/block_pool.py`): block 0 is the null block;
//! `get_new_blocks` pops free blocks from the front of the free queue and
//! fails when too few are free; `free_blocks` appends a finished request's
//! blocks, last block first, as `single_type_kv_cache_manager.py` frees
//! `reversed(req_blocks)`.
//!
//! Automatic prefix caching, on by default as in vLLM: a request reuses the
//! longest chain of cached blocks of its prompt (Mooncake `hash_ids`, 512
//! tokens each, chained on their predecessors), always computing at least
//! its last prompt token (hits are whole blocks of the first `prompt - 1`
//! tokens). Blocks of finished requests stay cached, in the free queue,
//! until popped for reuse in LRU order (eviction); a hit on a free cached
//! block takes it out of the queue. Traces without hashes share nothing.

use super::*;

/// Where a pool's blocks live. Block numbers are the pool's (1 to
/// `num_blocks - 1`); the memory decides where each one is.
pub trait BlockMemory {
    /// The counting device the memory lives on.
    fn dev(&self) -> &Dev;
    /// Block `b`, just taken from the free queue, will hold KV: give it
    /// memory if it has none (a cached block evicted for reuse has some).
    /// `Err` leaves `b` without memory.
    fn back(&mut self, b: u32) -> Result<(), Fail>;
    /// Whether `b` has memory now.
    fn backed(&self, b: u32) -> bool;
    /// Block `b` went free holding no cached KV: its memory may go.
    /// `discard`: its host pages may be given back (see [`discard`]).
    fn unback(&mut self, b: u32, discard: bool);
    /// The address of token `pos` of block `b` in allocation `a` of a token
    /// ([`KvShape::slot`]).
    fn addr(&self, b: u32, pos: u64, a: usize) -> u64;
    /// Between steps, [`BlockMemory::back`] failed for a block the next
    /// step takes (it is backed when taken then).
    fn back_ahead_failed(&mut self, f: Fail) {
        let _ = f;
    }
    /// Facts for the report.
    fn extra(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

/// A paged KV cache: vLLM's block pool over `M`.
pub struct PagedMgr<M: BlockMemory> {
    name: &'static str,
    mem: M,
    shape: KvShape,
    block_tokens: u64,
    num_blocks: u64,
    prefix_caching: bool,
    /// Free blocks, least recently freed first. Entries are deleted lazily:
    /// one counts only while its stamp is the block's `free_stamp`.
    free_q: VecDeque<(u32, u64)>,
    free_stamp: Vec<u64>,
    next_stamp: u64,
    n_free: u64,
    refs: Vec<u32>,
    /// Cached prompt blocks: hash id -> its blocks, in order. vLLM hashes
    /// every block on its predecessors; evicting one cuts the chain there,
    /// so an entry is a prefix of the hash block's blocks.
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
    /// Blocks the next step takes that are known while it is prepared
    /// (its growth and the admissions of the queue's front).
    next_take: u64,
}

impl<M: BlockMemory> PagedMgr<M> {
    /// A pool of `num_blocks` blocks of `block_tokens` tokens (block 0 is
    /// the null block) over `mem`, on a device of `capacity` bytes.
    pub fn with_memory(
        name: &'static str,
        mem: M,
        shape: KvShape,
        block_tokens: u64,
        num_blocks: u64,
        capacity: u64,
        prefix_caching: bool,
    ) -> Result<PagedMgr<M>, String> {
        if num_blocks < 2 {
            return Err(format!("capacity {capacity} holds no block of {block_tokens} tokens"));
        }
        if block_tokens == 0 || HASH_BLOCK_TOKENS % block_tokens != 0 {
            return Err(format!("blocks of {block_tokens} tokens do not tile a hash block of {HASH_BLOCK_TOKENS}"));
        }
        let nb = num_blocks as usize;
        let mut m = PagedMgr {
            name,
            mem,
            shape,
            block_tokens,
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
            next_take: 0,
        };
        for b in 1..num_blocks as u32 {
            m.push_free(b);
        }
        Ok(m)
    }

    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    pub fn block_tokens(&self) -> u64 {
        self.block_tokens
    }

    pub fn memory(&self) -> &M {
        &self.mem
    }

    /// The blocks of a running request, in order (its block table).
    pub fn blocks(&self, seq: usize) -> Option<&[u32]> {
        self.seqs.get(seq)?.as_deref()
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
        self.mem.addr(blocks[(t / self.block_tokens) as usize], t % self.block_tokens, a)
    }

    /// Pops `n` free blocks, least recently freed first, evicting the
    /// cached prefixes they held, and gives each memory.
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
        for k in 0..out.len() {
            if let Err(f) = self.mem.back(out[k]) {
                // Nothing is handed out: the blocks go back to the queue's
                // tail, free, holding nothing cached (what they held was
                // evicted), so without memory.
                for &b in &out {
                    self.mem.unback(b, self.discard);
                    self.push_free(b);
                }
                return Err(f);
            }
        }
        Ok(out)
    }

    /// The cached blocks a new request of `q` can use: whole blocks of its
    /// first `prompt - 1` tokens, along the longest chain of cached hash
    /// blocks.
    fn lookup(&self, q: &Request) -> Vec<u32> {
        let mut hit = Vec::new();
        if !self.prefix_caching {
            return hit;
        }
        let max_blocks = (q.prompt.saturating_sub(1) / self.block_tokens) as usize;
        let per_hash = (HASH_BLOCK_TOKENS / self.block_tokens) as usize;
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
        let per_hash = (HASH_BLOCK_TOKENS / self.block_tokens) as usize;
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
    /// queue, last block first (so a request's tail is evicted first), and
    /// those holding nothing cached give their memory up.
    fn release(&mut self, blocks: Vec<u32>) {
        for b in blocks.into_iter().rev() {
            let r = &mut self.refs[b as usize];
            *r -= 1;
            if *r > 0 {
                self.shared_live_blocks -= 1;
            }
            if *r == 0 {
                if self.block_hash[b as usize].is_none() {
                    self.mem.unback(b, self.discard);
                }
                self.push_free(b);
            }
        }
        if self.free_q.len() > 2 * self.num_blocks as usize + 1024 {
            let stamps = &self.free_stamp;
            self.free_q.retain(|&(b, s)| stamps[b as usize] == s);
        }
    }

    /// Gives memory now to those of the next `n` blocks the free queue
    /// hands out that have none, so that the step taking them makes no
    /// driver call. Which block a request gets is unchanged: the queue's
    /// order decides, as without this.
    fn back_ahead(&mut self, n: u64) {
        let mut next = Vec::new();
        for &(b, stamp) in &self.free_q {
            if next.len() as u64 == n {
                break;
            }
            if self.free_stamp[b as usize] == stamp {
                next.push(b);
            }
        }
        for b in next {
            if !self.mem.backed(b) {
                if let Err(f) = self.mem.back(b) {
                    self.mem.back_ahead_failed(f);
                    return;
                }
            }
        }
    }
}

impl<M: BlockMemory + Send> KvManager for PagedMgr<M> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn admit(&mut self, seq: usize, tokens: u64, q: &Request) -> Result<u64, Fail> {
        let need = tokens.div_ceil(self.block_tokens);
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
        let new = match self.take(fresh) {
            Ok(new) => new,
            Err(f) => {
                // Undo the hits' references: the admission did not happen.
                self.release(hit);
                return Err(f);
            }
        };
        for &b in &new {
            self.refs[b as usize] = 1;
        }
        self.hit_blocks += hit.len() as u64;
        let hit_tokens = hit.len() as u64 * self.block_tokens;
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
        let need = tokens.div_ceil(self.block_tokens);
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
        self.mem.dev().write(addr, &tag.to_le_bytes()).is_ok()
    }

    fn read_tag(&mut self, seq: usize, t: u64) -> Option<u64> {
        let addr = self.addr(self.seqs[seq].as_ref().expect("live"), t);
        let mut b = [0u8; 8];
        self.mem.dev().read(addr, &mut b).ok()?;
        Some(u64::from_le_bytes(b))
    }

    fn counting_device(&self) -> Option<&Dev> {
        Some(self.mem.dev())
    }

    fn bytes_copied(&self) -> u64 {
        0
    }

    fn moves(&self) -> u64 {
        0
    }

    fn prepare_admissions(&mut self, front: &[(usize, u64, &Request)], _budget: &StepBudget<'_>) {
        // The blocks the front's admissions take, in order, while they fit
        // (admission stops at the first that does not).
        let mut left = self.n_free.saturating_sub(self.next_take);
        for &(_, tokens, q) in front {
            let hit = self.lookup(q);
            let hit_free = hit.iter().filter(|&&b| self.refs[b as usize] == 0).count() as u64;
            let fresh = tokens.div_ceil(self.block_tokens) - hit.len() as u64;
            if fresh + hit_free > left {
                break;
            }
            left -= fresh + hit_free;
            self.next_take += fresh;
        }
    }

    fn prefix_hit(&mut self, _seq: usize, q: &Request) -> u64 {
        self.lookup(q).len() as u64 * self.block_tokens
    }

    fn prepare_growth(&mut self, grows: &[(usize, u64, u64)], _budget: &StepBudget<'_>) {
        self.prepare_decode_growth(grows);
    }

    fn prepare_decode_growth(&mut self, grows: &[(usize, u64, u64)]) {
        for &(seq, tokens, _) in grows {
            let have = self.seqs.get(seq).and_then(|s| s.as_ref()).map_or(0, |b| b.len() as u64);
            self.next_take += tokens.div_ceil(self.block_tokens).saturating_sub(have);
        }
    }

    fn between_steps(&mut self) {
        let n = std::mem::take(&mut self.next_take);
        self.back_ahead(n);
    }

    fn housekeeping(&mut self) {
        self.discard = self.mem.dev().inner().allocated_file_bytes().unwrap_or(0) > host_budget(self.capacity);
    }

    fn gpu_finished_step(&mut self) {
        self.mem.dev().finish_gpu_step();
    }

    fn extra(&self) -> Vec<(String, String)> {
        let mut v = vec![
            ("num_blocks".into(), self.num_blocks.to_string()),
            ("block_tokens".into(), self.block_tokens.to_string()),
            ("prefix_caching".into(), self.prefix_caching.to_string()),
            ("prefix_hit_blocks".into(), self.hit_blocks.to_string()),
            ("evicted_prefix_blocks".into(), self.evicted_blocks.to_string()),
            ("cached_prefixes".into(), self.cache.len().to_string()),
        ];
        v.extend(self.mem.extra());
        v
    }

    fn shared_live_bytes(&self) -> u64 {
        self.shared_live_blocks * self.block_tokens * self.shape.kv_bytes_per_token
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Memory whose `back` fails while `fail` is set, recording what is
    /// backed.
    struct Flaky {
        dev: Dev,
        held: Vec<bool>,
        fail: bool,
    }

    impl BlockMemory for Flaky {
        fn dev(&self) -> &Dev {
            &self.dev
        }
        fn back(&mut self, b: u32) -> Result<(), Fail> {
            if self.fail && !self.held[b as usize] {
                return Err(Fail { fragmentation: false, host_limit: true, message: "injected".into() });
            }
            self.held[b as usize] = true;
            Ok(())
        }
        fn unback(&mut self, b: u32, _discard: bool) {
            self.held[b as usize] = false;
        }
        fn backed(&self, b: u32) -> bool {
            self.held[b as usize]
        }
        fn addr(&self, _b: u32, _pos: u64, _a: usize) -> u64 {
            0
        }
    }

    fn pool(num_blocks: u64) -> PagedMgr<Flaky> {
        let shape =
            KvShape { kv_bytes_per_token: 128 << 10, layers: 32, layout: Layout::BlockInChunk, max_context: 4096 };
        let dev = new_device(64 << 20).expect("device");
        let mem = Flaky { dev, held: vec![false; num_blocks as usize], fail: false };
        PagedMgr::with_memory("flaky", mem, shape, 16, num_blocks, 64 << 20, true).expect("pool")
    }

    fn req(prompt: u64, hashes: &[u64]) -> Request {
        Request { arrival_s: 0.0, prompt, output: 1, hash_ids: hashes.to_vec().into() }
    }

    fn free_and_unreferenced(p: &PagedMgr<Flaky>) -> u64 {
        (1..p.num_blocks as usize).filter(|&b| p.refs[b] == 0).count() as u64
    }

    #[test]
    fn an_admission_whose_memory_fails_takes_nothing() {
        let mut p = pool(32);
        assert_eq!(p.admit(0, 100, &req(100, &[])).map_err(|f| f.message), Ok(0));
        assert_eq!(p.n_free, 24);
        p.mem.fail = true;
        assert!(p.admit(1, 160, &req(160, &[])).is_err());
        assert_eq!((p.n_free, free_and_unreferenced(&p)), (24, 24));
        assert!(p.blocks(1).is_none());
        assert_eq!(p.mem.held.iter().filter(|&&h| h).count(), 7, "only the first request's blocks have memory");
        p.mem.fail = false;
        assert_eq!(p.admit(1, 160, &req(160, &[])).map_err(|f| f.message), Ok(0));
        assert_eq!(p.blocks(1).map(|b| b.len()), Some(10));
    }

    #[test]
    fn a_failed_admission_gives_its_prefix_hits_back_still_cached() {
        let mut p = pool(64);
        let q = req(601, &[7]);
        assert_eq!(p.admit(0, 601, &q).map_err(|f| f.message), Ok(0));
        p.free(0);
        // 32 blocks cached (one 512-token hash block), the other 6 freed.
        assert_eq!(p.mem.held.iter().filter(|&&h| h).count(), 32);
        assert_eq!(p.n_free, 63);
        p.mem.fail = true;
        assert!(p.admit(1, 601, &q).is_err());
        assert_eq!((p.n_free, free_and_unreferenced(&p)), (63, 63));
        assert_eq!(p.shared_live_blocks, 0);
        assert_eq!(p.cache.get(&7).map(Vec::len), Some(32), "the hits stay cached");
        p.mem.fail = false;
        assert_eq!(p.admit(1, 601, &q).map_err(|f| f.message), Ok(512));
    }

    #[test]
    fn blocks_backed_ahead_are_the_ones_the_next_step_takes() {
        let mut p = pool(32);
        p.next_take = 5;
        p.between_steps();
        let ahead: Vec<u32> = (0..32).filter(|&b| p.mem.held[b as usize]).collect();
        assert_eq!(ahead, vec![1, 2, 3, 4, 5]);
        assert_eq!(p.admit(0, 80, &req(80, &[])).map_err(|f| f.message), Ok(0));
        assert_eq!(p.blocks(0), Some(&[1, 2, 3, 4, 5][..]));
    }
}
