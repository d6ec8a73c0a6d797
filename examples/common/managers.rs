//! KV-cache managers driven by the replay: vmm-arena (with and without
//! implicit moves) and the baselines — PyTorch's caching allocator (native
//! and expandable segments) holding each request's KV as contiguous tensors
//! grown by doubling with a copy, and vLLM's static block pool.
//!
//! Every manager runs on its own [`Counted`] host driver in sparse mode, with
//! the same device capacity, so driver calls and physical memory are counted
//! by the same code for all of them. Each token's KV slot receives a real
//! 8-byte tag written through the mapping; the replay reads every tag back
//! when the request finishes (or is preempted).
//!
//! Layouts: `token-major` is one allocation per request holding all layers of
//! each token; `per-layer` is one allocation per layer and per K/V (`2 ×
//! layers` allocations per request, as vAttention and kvcached lay out KV).
//! With `per-layer`, token `t`'s tag goes to allocation `t mod (2 × layers)`
//! at `t × bytes_per_token_per_allocation`, so every allocation receives tags
//! along its whole length and each token has exactly one tagged slot (writing
//! all 64 slots of a token would multiply the replay's time by 64 without
//! testing anything more).
//!
//! The host backend runs in sparse mode: a page of host memory exists only
//! where a tag was written. Freed KV is punched out of the host memory
//! (`discard`) when a manager's resident pages pass a budget, so that a long
//! replay's host memory stays bounded; this makes no driver call and changes
//! no figure of the report.

use std::collections::VecDeque;
use std::sync::Arc;

use vmm_arena::driver::host::{HostDriver, HostOptions};
use vmm_arena::driver::{ChunkHandle, Driver};
use vmm_arena::{Arena, ArenaConfig, Error, Id};

use super::caching::CachingAllocator;
use super::counted::{is_host_limit, Calls, Counted};

/// The host backend in sparse mode, counted, capped at `capacity`.
pub type Dev = Arc<Counted<HostDriver>>;

/// A fresh counted sparse host driver for a device of `capacity` bytes.
pub fn new_device(capacity: u64) -> Result<Dev, String> {
    let host = HostDriver::with_options(HostOptions { sparse: true }).map_err(|e| format!("host backend: {e}"))?;
    Ok(Arc::new(Counted::new(host, capacity)))
}

/// KV layout of a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    TokenMajor,
    PerLayer,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Layout::TokenMajor => "token-major",
            Layout::PerLayer => "per-layer",
        }
    }
}

/// The shape of one request's KV cache.
#[derive(Clone, Copy, Debug)]
pub struct KvShape {
    /// KV bytes per token, all layers, K and V.
    pub kv_bytes_per_token: u64,
    pub layers: u32,
    pub layout: Layout,
    /// Tokens a growable reservation is sized for (the model's context).
    pub max_context: u64,
}

impl KvShape {
    /// Allocations per request.
    pub fn n_allocs(&self) -> u64 {
        match self.layout {
            Layout::TokenMajor => 1,
            Layout::PerLayer => 2 * self.layers as u64,
        }
    }

    /// Bytes per token in each allocation.
    pub fn bpt(&self) -> u64 {
        (self.kv_bytes_per_token / self.n_allocs()).max(8)
    }

    /// Which allocation holds token `t`'s tag, and at which offset.
    pub fn slot(&self, t: u64) -> (usize, u64) {
        ((t % self.n_allocs()) as usize, t * self.bpt())
    }
}

/// A failed allocation or growth.
#[derive(Clone, Debug)]
pub struct Fail {
    /// Free physical capacity covered the request: it failed for layout
    /// (fragmentation), not for lack of memory.
    pub fragmentation: bool,
    /// The host backend hit a system limit (not a policy outcome): the
    /// replay's figures are not valid.
    pub host_limit: bool,
    pub message: String,
}

/// What the replay needs from a KV-cache manager. `seq` is the request's
/// index in the trace.
pub trait KvManager {
    fn name(&self) -> &'static str;
    /// Allocates room for `tokens` tokens of a new sequence; all or nothing.
    fn admit(&mut self, seq: usize, tokens: u64) -> Result<(), Fail>;
    /// Makes room for `tokens` tokens (more than now); `stored` hold data.
    fn grow(&mut self, seq: usize, tokens: u64, stored: u64) -> Result<(), Fail>;
    /// Frees the sequence's KV.
    fn free(&mut self, seq: usize);
    /// Writes token `t`'s tag through the mapping.
    fn write_tag(&mut self, seq: usize, t: u64, tag: u64) -> bool;
    /// Reads token `t`'s tag back.
    fn read_tag(&mut self, seq: usize, t: u64) -> Option<u64>;
    /// Physical memory held now.
    fn physical_bytes(&self) -> u64;
    fn peak_physical_bytes(&self) -> u64;
    fn calls(&self) -> Calls;
    fn bytes_copied(&self) -> u64;
    fn moves(&self) -> u64;
    /// Called after every step, when the device is idle between two forward
    /// passes: the point where an engine lets the arena unmap the old
    /// addresses of moved allocations.
    fn end_step(&mut self) {}
    /// Called every few steps: checks the host memory the simulation holds
    /// (not a figure of the report) and turns discarding on or off.
    fn housekeeping(&mut self) {}
    /// Manager-specific facts for the JSON report: (key, JSON value).
    fn extra(&self) -> Vec<(String, String)> {
        Vec::new()
    }
}

/// Host memory the simulation may keep resident per manager before freed KV
/// is discarded (see [`discard`]): a sixteenth of the device, at least
/// 512 MiB. Live tags need at most a 32nd with 128 KiB per token.
pub fn host_budget(capacity: u64) -> u64 {
    (capacity / 16).max(512 << 20)
}

/// Gives the host pages wholly inside `addr..addr+len` back to the kernel
/// (`madvise(MADV_REMOVE)` punches them out of the backing memfd). Called on
/// KV that is freed, after its tags were verified (its contents are dead),
/// while the manager's host memory is above [`host_budget`]. It makes no
/// driver call and changes no count; it only keeps the simulation's host
/// memory bounded: tags of reused memory land on new host pages whenever
/// the reuse is at another offset (a block split elsewhere, another layer's
/// allocation), until every page of the device would be resident.
pub fn discard(addr: u64, len: u64) {
    static PAGE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    // SAFETY: sysconf has no preconditions.
    let page = *PAGE.get_or_init(|| match unsafe { libc::sysconf(libc::_SC_PAGESIZE) } {
        p if p > 0 => p as u64,
        _ => 4096,
    });
    let start = addr.div_ceil(page) * page;
    let end = (addr + len) / page * page;
    if end > start {
        // SAFETY: the span lies inside a live, writable shared mapping that
        // this manager owns (freed KV of its own allocation); MADV_REMOVE
        // only replaces its contents with zeros. Errors are ignored: the
        // pages then simply stay resident.
        unsafe {
            libc::madvise(start as *mut libc::c_void, (end - start) as usize, libc::MADV_REMOVE);
        }
    }
}

fn slot_vec<T>(v: &mut Vec<Option<T>>, seq: usize) -> &mut Option<T> {
    if v.len() <= seq {
        v.resize_with(seq + 1, || None);
    }
    &mut v[seq]
}

// ---------------------------------------------------------------- vmm-arena

/// vmm-arena: one growable allocation per KV tensor, reserved for the
/// model's context, grown a chunk at a time (as vAttention maps pages).
pub struct ArenaMgr {
    name: &'static str,
    arena: Arena,
    dev: Dev,
    shape: KvShape,
    chunk: u64,
    capacity: u64,
    seqs: Vec<Option<ArenaSeq>>,
    release_errors: u64,
    last_release_error: Option<String>,
    discard: bool,
}

struct ArenaSeq {
    ids: Vec<Id>,
    /// Tokens every allocation has room for.
    cap: u64,
}

/// The arena's virtual range for a KV workload: the arena's default (4 ×
/// capacity) or, if more, room for two full batches of reservations. An
/// engine sizes its range for its batch (address space costs no memory);
/// with less, the reservations of a full batch exhaust the range although
/// physical memory is free.
pub fn arena_reserve(shape: KvShape, capacity: u64, max_batch: usize) -> u64 {
    const CHUNK: u64 = 2 << 20;
    let per_request = shape.n_allocs() * (shape.max_context * shape.bpt()).div_ceil(CHUNK) * CHUNK;
    (capacity / CHUNK * CHUNK).saturating_mul(4).max(2 * max_batch as u64 * per_request)
}

/// Options of the arena managers.
#[derive(Clone, Copy, Debug)]
pub struct ArenaOptions {
    pub capacity: u64,
    /// Virtual range (0: the arena's default, 4 × capacity).
    pub reserve: u64,
    /// Pooled bytes kept on free (`u64::MAX`: all).
    pub retain: u64,
    pub no_implicit_moves: bool,
}

impl ArenaMgr {
    pub fn new(name: &'static str, shape: KvShape, o: ArenaOptions) -> Result<ArenaMgr, String> {
        let dev = new_device(o.capacity)?;
        let cfg = ArenaConfig {
            capacity_bytes: o.capacity,
            reserve_bytes: o.reserve,
            retain_bytes: o.retain,
            no_implicit_moves: o.no_implicit_moves,
            ..ArenaConfig::default()
        };
        let arena = Arena::with_driver(dev.clone(), cfg).map_err(|e| format!("arena: {e}"))?;
        let chunk = arena.chunk_bytes();
        Ok(ArenaMgr {
            name,
            arena,
            dev,
            shape,
            chunk,
            capacity: o.capacity / chunk * chunk,
            seqs: Vec::new(),
            release_errors: 0,
            last_release_error: None,
            discard: false,
        })
    }

    pub fn arena(&self) -> &Arena {
        &self.arena
    }

    fn bytes_for(&self, tokens: u64) -> u64 {
        (tokens * self.shape.bpt()).div_ceil(self.chunk).max(1) * self.chunk
    }

    fn fail(&self, e: Error, needed: u64) -> Fail {
        let mapped = self.arena.stats().map(|s| s.mapped_bytes).unwrap_or(0);
        let message = e.to_string();
        let host_limit = is_host_limit(&e);
        let fragmentation = !host_limit
            && match e {
                Error::OutOfAddressSpace(_) => true,
                _ => self.capacity.saturating_sub(mapped) >= needed,
            };
        Fail { fragmentation, host_limit, message }
    }
}

impl KvManager for ArenaMgr {
    fn name(&self) -> &'static str {
        self.name
    }

    fn admit(&mut self, seq: usize, tokens: u64) -> Result<(), Fail> {
        let size = self.bytes_for(tokens);
        let max = size.max(self.bytes_for(self.shape.max_context));
        let n = self.shape.n_allocs() as usize;
        let mut ids = Vec::with_capacity(n);
        for k in 0..n {
            match self.arena.alloc_growable(size, max) {
                Ok((id, _)) => ids.push(id),
                Err(e) => {
                    let f = self.fail(e, (n - k) as u64 * size);
                    for id in ids {
                        let _ = self.arena.free(id);
                    }
                    return Err(f);
                }
            }
        }
        *slot_vec(&mut self.seqs, seq) = Some(ArenaSeq { ids, cap: size / self.shape.bpt() });
        Ok(())
    }

    fn grow(&mut self, seq: usize, tokens: u64, _stored: u64) -> Result<(), Fail> {
        let s = self.seqs[seq].as_ref().expect("live sequence");
        if tokens <= s.cap {
            return Ok(());
        }
        let new_size = self.bytes_for(tokens);
        let old_size = self.bytes_for(s.cap);
        let ids = s.ids.clone();
        for (k, &id) in ids.iter().enumerate() {
            if let Err(e) = self.arena.resize(id, new_size) {
                return Err(self.fail(e, (ids.len() - k) as u64 * (new_size - old_size)));
            }
        }
        self.seqs[seq].as_mut().expect("live").cap = new_size / self.shape.bpt();
        Ok(())
    }

    fn free(&mut self, seq: usize) {
        if let Some(s) = self.seqs[seq].take() {
            for id in s.ids {
                if self.discard {
                    if let Ok(q) = self.arena.query(id) {
                        discard(q.ptr, q.mapped_bytes);
                    }
                }
                self.arena.free(id).expect("free of a live allocation");
            }
        }
    }

    fn write_tag(&mut self, seq: usize, t: u64, tag: u64) -> bool {
        let (a, off) = self.shape.slot(t);
        let id = self.seqs[seq].as_ref().expect("live").ids[a];
        self.arena.write(id, off, &tag.to_le_bytes()).is_ok()
    }

    fn read_tag(&mut self, seq: usize, t: u64) -> Option<u64> {
        let (a, off) = self.shape.slot(t);
        let id = self.seqs[seq].as_ref().expect("live").ids[a];
        let mut b = [0u8; 8];
        self.arena.read(id, off, &mut b).ok()?;
        Some(u64::from_le_bytes(b))
    }

    fn physical_bytes(&self) -> u64 {
        self.dev.live_bytes()
    }

    fn peak_physical_bytes(&self) -> u64 {
        self.dev.peak_bytes()
    }

    fn calls(&self) -> Calls {
        self.dev.calls()
    }

    fn bytes_copied(&self) -> u64 {
        0
    }

    fn moves(&self) -> u64 {
        self.arena.stats().map(|s| s.moves).unwrap_or(0)
    }

    fn housekeeping(&mut self) {
        self.discard = self.dev.inner().allocated_file_bytes().unwrap_or(0) > host_budget(self.capacity);
    }

    fn end_step(&mut self) {
        // Old ranges of moved allocations stay mapped (and valid for kernels
        // still using them) until released; between steps nothing uses them.
        if let Err(e) = self.arena.release_retired() {
            self.release_errors += 1;
            self.last_release_error = Some(e.to_string());
        }
    }

    fn extra(&self) -> Vec<(String, String)> {
        let Ok(s) = self.arena.stats() else { return Vec::new() };
        vec![
            ("arena_peak_physical_bytes".into(), s.peak_physical_bytes.to_string()),
            ("arena_driver_creates".into(), s.driver_creates.to_string()),
            ("arena_driver_maps".into(), s.driver_maps.to_string()),
            ("arena_driver_unmaps".into(), s.driver_unmaps.to_string()),
            ("reserved_va_bytes".into(), s.reserved_va_bytes.to_string()),
            ("chunk_bytes".into(), s.chunk_bytes.to_string()),
            ("driver_syncs".into(), s.driver_syncs.to_string()),
            ("release_retired_errors".into(), self.release_errors.to_string()),
        ]
    }
}

// ------------------------------------------------ PyTorch caching allocator

/// A request's KV as contiguous tensors from PyTorch's caching allocator
/// (native or expandable segments). A contiguous cache without virtual
/// memory must grow by reallocation: each tensor starts with room for the
/// next power of two of tokens (at least 16) and doubles when full,
/// copying its stored KV into the new tensor (`driver.copy` of every stored
/// tag; `bytes_copied` counts the stored KV bytes a GPU would copy).
pub struct TorchMgr {
    name: &'static str,
    alloc: CachingAllocator<Dev>,
    dev: Dev,
    shape: KvShape,
    seqs: Vec<Option<Vec<(u64, u64)>>>,
    copied: u64,
    copy_errors: u64,
    capacity: u64,
    discard: bool,
}

fn pow2_tokens(tokens: u64) -> u64 {
    tokens.max(16).next_power_of_two()
}

impl TorchMgr {
    pub fn new(name: &'static str, shape: KvShape, capacity: u64, expandable: bool) -> Result<TorchMgr, String> {
        let dev = new_device(capacity)?;
        Ok(TorchMgr {
            name,
            alloc: CachingAllocator::new(dev.clone(), capacity, expandable),
            dev,
            shape,
            seqs: Vec::new(),
            copied: 0,
            copy_errors: 0,
            capacity,
            discard: false,
        })
    }

    /// `remaining`: bytes the operation still had to allocate when it failed.
    fn fail(oom: super::caching::Oom, remaining: u64) -> Fail {
        let free = oom.capacity.saturating_sub(oom.allocated_bytes);
        Fail {
            fragmentation: oom.driver_error.is_none() && free >= remaining.max(oom.size),
            host_limit: oom.driver_error.is_some(),
            message: format!(
                "out of memory: tried {} bytes; {} in use, {} reserved, largest free block {}{}",
                oom.size,
                oom.allocated_bytes,
                oom.reserved_bytes,
                oom.largest_free_block,
                oom.driver_error.map(|e| format!(" (driver: {e})")).unwrap_or_default()
            ),
        }
    }
}

impl KvManager for TorchMgr {
    fn name(&self) -> &'static str {
        self.name
    }

    fn admit(&mut self, seq: usize, tokens: u64) -> Result<(), Fail> {
        let cap = pow2_tokens(tokens);
        let n = self.shape.n_allocs() as usize;
        let mut v = Vec::with_capacity(n);
        for k in 0..n {
            match self.alloc.malloc(cap * self.shape.bpt()) {
                Ok(p) => v.push((p, cap)),
                Err(oom) => {
                    let remaining = (n - k) as u64 * oom.size;
                    for (p, _) in v {
                        self.alloc.free(p);
                    }
                    return Err(Self::fail(oom, remaining));
                }
            }
        }
        *slot_vec(&mut self.seqs, seq) = Some(v);
        Ok(())
    }

    fn grow(&mut self, seq: usize, tokens: u64, stored: u64) -> Result<(), Fail> {
        let n = self.shape.n_allocs();
        let bpt = self.shape.bpt();
        for a in 0..n as usize {
            let (old, cap) = self.seqs[seq].as_ref().expect("live")[a];
            if tokens <= cap {
                continue;
            }
            let mut new_cap = cap * 2;
            while new_cap < tokens {
                new_cap *= 2;
            }
            let new = self.alloc.malloc(new_cap * bpt).map_err(|oom| {
                let remaining = (n - a as u64) * oom.size;
                Self::fail(oom, remaining)
            })?;
            // Copy the stored KV: the tags are what this simulation stores.
            let mut t = a as u64;
            while t < stored {
                if self.dev.copy(new + t * bpt, old + t * bpt, 8).is_err() {
                    self.copy_errors += 1;
                }
                t += n;
            }
            self.copied += stored * bpt;
            if self.discard {
                discard(old, cap * bpt);
            }
            self.alloc.free(old);
            self.seqs[seq].as_mut().expect("live")[a] = (new, new_cap);
        }
        Ok(())
    }

    fn free(&mut self, seq: usize) {
        if let Some(v) = self.seqs[seq].take() {
            for (p, cap) in v {
                if self.discard {
                    discard(p, cap * self.shape.bpt());
                }
                self.alloc.free(p);
            }
        }
    }

    fn write_tag(&mut self, seq: usize, t: u64, tag: u64) -> bool {
        let (a, off) = self.shape.slot(t);
        let p = self.seqs[seq].as_ref().expect("live")[a].0;
        self.dev.write(p + off, &tag.to_le_bytes()).is_ok()
    }

    fn read_tag(&mut self, seq: usize, t: u64) -> Option<u64> {
        let (a, off) = self.shape.slot(t);
        let p = self.seqs[seq].as_ref().expect("live")[a].0;
        let mut b = [0u8; 8];
        self.dev.read(p + off, &mut b).ok()?;
        Some(u64::from_le_bytes(b))
    }

    fn physical_bytes(&self) -> u64 {
        self.dev.live_bytes()
    }

    fn peak_physical_bytes(&self) -> u64 {
        self.dev.peak_bytes()
    }

    fn calls(&self) -> Calls {
        self.dev.calls()
    }

    fn bytes_copied(&self) -> u64 {
        self.copied
    }

    fn housekeeping(&mut self) {
        self.discard = self.dev.inner().allocated_file_bytes().unwrap_or(0) > host_budget(self.capacity);
    }

    fn moves(&self) -> u64 {
        0
    }

    fn extra(&self) -> Vec<(String, String)> {
        let s = self.alloc.stats();
        vec![
            ("num_alloc_retries".into(), s.num_alloc_retries.to_string()),
            ("num_ooms".into(), s.num_ooms.to_string()),
            ("segment_allocs".into(), s.num_device_alloc.to_string()),
            ("segment_frees".into(), s.num_device_free.to_string()),
            ("peak_reserved_bytes".into(), s.peak_reserved_bytes.to_string()),
            ("copy_errors".into(), self.copy_errors.to_string()),
        ]
    }
}

// ------------------------------------------------------- vLLM block pool

/// vLLM's paged KV cache: at start-up every KV tensor is allocated for the
/// whole capacity (`vllm/v1/worker/gpu_model_runner.py`, one tensor per
/// layer holding K and V, or one tensor for the token-major layout), cut
/// into blocks of 16 tokens (`vllm/v1/core/block_pool.py`: block 0 is the
/// null block; `get_new_blocks` pops free blocks from the front of the free
/// queue and fails when too few are free; `free_blocks` appends a finished
/// request's blocks, last block first, as `single_type_kv_cache_manager.py`
/// frees `reversed(req_blocks)`). Nothing grows, nothing is returned. Prefix
/// caching is off (no manager here shares prefixes).
pub struct VllmMgr {
    dev: Dev,
    shape: KvShape,
    tensors: Vec<(u64, u64, ChunkHandle)>,
    num_blocks: u64,
    free_q: VecDeque<u32>,
    seqs: Vec<Option<Vec<u32>>>,
}

pub const VLLM_BLOCK_TOKENS: u64 = 16;

impl VllmMgr {
    pub fn new(shape: KvShape, capacity: u64) -> Result<VllmMgr, String> {
        let dev = new_device(capacity)?;
        let n_tensors = match shape.layout {
            Layout::TokenMajor => 1,
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
        Ok(VllmMgr { dev, shape, tensors, num_blocks, free_q: (1..num_blocks as u32).collect(), seqs: Vec::new() })
    }

    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    fn addr(&self, blocks: &[u32], t: u64) -> u64 {
        let (a, _) = self.shape.slot(t);
        let bpt = self.shape.bpt();
        let block = blocks[(t / VLLM_BLOCK_TOKENS) as usize] as u64;
        let pos = t % VLLM_BLOCK_TOKENS;
        match self.shape.layout {
            Layout::TokenMajor => self.tensors[0].0 + (block * VLLM_BLOCK_TOKENS + pos) * bpt,
            Layout::PerLayer => {
                let (l, kv) = (a / 2, a as u64 % 2);
                self.tensors[l].0 + (kv * self.num_blocks + block) * VLLM_BLOCK_TOKENS * bpt + pos * bpt
            }
        }
    }

    fn take(&mut self, n: u64) -> Result<Vec<u32>, Fail> {
        if n > self.free_q.len() as u64 {
            return Err(Fail {
                fragmentation: false,
                host_limit: false,
                message: format!("{n} blocks needed, {} free", self.free_q.len()),
            });
        }
        Ok(self.free_q.drain(..n as usize).collect())
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

    fn admit(&mut self, seq: usize, tokens: u64) -> Result<(), Fail> {
        let blocks = self.take(tokens.div_ceil(VLLM_BLOCK_TOKENS))?;
        *slot_vec(&mut self.seqs, seq) = Some(blocks);
        Ok(())
    }

    fn grow(&mut self, seq: usize, tokens: u64, _stored: u64) -> Result<(), Fail> {
        let have = self.seqs[seq].as_ref().expect("live").len() as u64;
        let need = tokens.div_ceil(VLLM_BLOCK_TOKENS);
        if need <= have {
            return Ok(());
        }
        let more = self.take(need - have)?;
        self.seqs[seq].as_mut().expect("live").extend(more);
        Ok(())
    }

    fn free(&mut self, seq: usize) {
        if let Some(blocks) = self.seqs[seq].take() {
            self.free_q.extend(blocks.into_iter().rev());
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

    fn physical_bytes(&self) -> u64 {
        self.dev.live_bytes()
    }

    fn peak_physical_bytes(&self) -> u64 {
        self.dev.peak_bytes()
    }

    fn calls(&self) -> Calls {
        self.dev.calls()
    }

    fn bytes_copied(&self) -> u64 {
        0
    }

    fn moves(&self) -> u64 {
        0
    }

    fn extra(&self) -> Vec<(String, String)> {
        vec![("num_blocks".into(), self.num_blocks.to_string()), ("block_tokens".into(), VLLM_BLOCK_TOKENS.to_string())]
    }
}

/// Every manager name the replay knows, in report order.
pub const ALL_MANAGERS: [&str; 5] = ["arena", "arena-no-moves", "pytorch-caching", "pytorch-expandable", "vllm-paged"];

/// Builds a manager by name.
pub fn build(name: &str, shape: KvShape, arena: ArenaOptions) -> Result<Box<dyn KvManager + Send>, String> {
    let cap = arena.capacity;
    Ok(match name {
        "arena" => Box::new(ArenaMgr::new("arena", shape, ArenaOptions { no_implicit_moves: false, ..arena })?),
        "arena-no-moves" => {
            Box::new(ArenaMgr::new("arena-no-moves", shape, ArenaOptions { no_implicit_moves: true, ..arena })?)
        }
        "pytorch-caching" => Box::new(TorchMgr::new("pytorch-caching", shape, cap, false)?),
        "pytorch-expandable" => Box::new(TorchMgr::new("pytorch-expandable", shape, cap, true)?),
        "vllm-paged" => Box::new(VllmMgr::new(shape, cap)?),
        other => return Err(format!("unknown manager {other:?} (known: {})", ALL_MANAGERS.join(", "))),
    })
}
