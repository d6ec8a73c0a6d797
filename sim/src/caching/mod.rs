//! A model of PyTorch's native CUDA caching allocator, with and without
//! expandable segments, run on the same [`Driver`] interface as vmm-arena so
//! that its driver calls and its physical memory are counted the same way.
//!
//! Source: pytorch/pytorch `c10/cuda/CUDACachingAllocator.cpp`
//! (`DeviceCachingAllocator` and `ExpandableSegment`), default configuration
//! (no `max_split_size_mb`, no `roundup_power2_divisions`, no garbage
//! collection threshold, one stream, no CUDA graph pools). What is modeled,
//! function by function:
//!
//! - `round_size`: requests round up to a multiple of `kMinBlockSize` (512 B);
//! - `get_pool`: sizes up to `kSmallSize` (1 MiB) use the small pool, larger
//!   ones the large pool;
//! - `get_allocation_size`: a new segment is `kSmallBuffer` (2 MiB) for a
//!   small request, `kLargeBuffer` (20 MiB) below `kMinLargeAlloc` (10 MiB),
//!   else the size rounded up to `kRoundLarge` (2 MiB);
//! - `get_free_block`: best fit — the smallest free block of the pool whose
//!   size covers the request, lowest address among equals (`lower_bound` on a
//!   set ordered by (size, address)); with expandable segments, the walk
//!   continues while the next block's "expandable size" (its size plus an
//!   unmapped block right after it) is smaller;
//! - `should_split`: a small-pool block (or any block with expandable
//!   segments) splits when at least 512 B remain; a large block only when
//!   more than `kSmallSize` (1 MiB) remains;
//! - `free_block` / `try_merge_blocks`: a freed block coalesces with free
//!   neighbours of the same segment (and the same mapped state);
//! - `malloc`: free block, else `alloc_block` (`cudaMalloc` of the
//!   allocation size: here reserve + create + map + set_access of one
//!   segment-sized chunk), else `release_cached_blocks` (every free block
//!   that is a whole segment is `cudaFree`d: unmap + release + free
//!   reservation; with expandable segments, every fully free page is
//!   unmapped and released) and `alloc_block` once more, else out of memory.
//!   (`release_available_cached_blocks` is a no-op without `max_split_size`.)
//! - expandable segments (`find_expandable_block`, `map_block`,
//!   `unmap_block`, `ExpandableSegment::map/unmap`): one segment per pool
//!   reserving 1.125 × the device memory of address space, backed by
//!   `kLargeBuffer` (20 MiB) pages in the large pool and `kSmallBuffer`
//!   (2 MiB) pages in the small one, each page one `cuMemCreate` and one
//!   `cuMemMap`, one `cuMemSetAccess` per mapped range; new pages go at the
//!   lowest address with enough free or unmapped room after it; pages are
//!   unmapped and released only by the out-of-memory retry.

use std::collections::{BTreeSet, HashMap};

use vmm_arena::driver::{ChunkHandle, Driver};
use vmm_arena::Error;

use super::counted::is_host_limit;

mod expandable;

pub const K_MIN_BLOCK_SIZE: u64 = 512;
pub const K_SMALL_SIZE: u64 = 1 << 20;
pub const K_SMALL_BUFFER: u64 = 2 << 20;
pub const K_LARGE_BUFFER: u64 = 20 << 20;
pub const K_MIN_LARGE_ALLOC: u64 = 10 << 20;
pub const K_ROUND_LARGE: u64 = 2 << 20;

const SMALL: usize = 0;
const LARGE: usize = 1;

type Idx = usize;

#[derive(Clone, Debug)]
struct Block {
    ptr: u64,
    size: u64,
    requested: u64,
    pool: usize,
    allocated: bool,
    mapped: bool,
    prev: Option<Idx>,
    next: Option<Idx>,
    /// Native segment or expandable segment index (by `expandable`).
    seg: usize,
}

#[derive(Debug, Default)]
struct Pool {
    /// Free mapped blocks by (size, address).
    blocks: BTreeSet<(u64, u64, Idx)>,
    /// Unmapped blocks of expandable segments by address.
    unmapped: BTreeSet<(u64, Idx)>,
}

/// Where a block sorts among blocks of equal size. PyTorch compares raw
/// device addresses; the host's `mmap` places segments wherever it likes
/// (top down, varying between runs), so the model orders segments by their
/// creation instead (as a fresh device's `cudaMalloc` tends to hand out
/// increasing addresses) and blocks inside a segment by offset: the same
/// trace then gives the same figures on every run.
fn order_key(rank: u64, base: u64, ptr: u64) -> u64 {
    (rank << 44) | (ptr - base)
}

#[derive(Debug)]
struct NativeSeg {
    /// Order of creation: segments compare by it, then by offset (below).
    rank: u64,
    base: u64,
    size: u64,
    handle: ChunkHandle,
}

#[derive(Debug)]
struct ExpSeg {
    rank: u64,
    base: u64,
    page: u64,
    max_handles: u64,
    handles: Vec<Option<ChunkHandle>>,
}

/// Why an allocation failed, with the numbers an out-of-memory report gives.
#[derive(Clone, Debug)]
pub struct Oom {
    /// The rounded request.
    pub size: u64,
    /// Bytes of blocks in use ("allocated by PyTorch").
    pub allocated_bytes: u64,
    /// Bytes of segments held ("reserved by PyTorch").
    pub reserved_bytes: u64,
    /// The device memory.
    pub capacity: u64,
    /// Largest free block left in the request's pool.
    pub largest_free_block: u64,
    /// The driver's error, when a driver call failed for another reason.
    pub driver_error: Option<String>,
}

impl Oom {
    /// Free device memory (capacity minus bytes in use) covered the request:
    /// the failure is fragmentation, not a full device.
    pub fn is_fragmentation(&self) -> bool {
        self.capacity.saturating_sub(self.allocated_bytes) >= self.size
    }
}

/// Counters of the model (PyTorch's `DeviceStats` names).
#[derive(Clone, Copy, Debug, Default)]
pub struct CachingStats {
    pub num_alloc_retries: u64,
    pub num_ooms: u64,
    pub num_device_alloc: u64,
    pub num_device_free: u64,
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    pub peak_reserved_bytes: u64,
}

/// The caching allocator (see the module documentation).
#[derive(Debug)]
pub struct CachingAllocator<D: Driver> {
    drv: D,
    expandable: bool,
    capacity: u64,
    slab: Vec<Option<Block>>,
    free_slots: Vec<Idx>,
    pools: [Pool; 2],
    active: HashMap<u64, Idx>,
    native: Vec<Option<NativeSeg>>,
    free_native: Vec<usize>,
    exp: Vec<Option<ExpSeg>>,
    next_rank: u64,
    stats: CachingStats,
}

fn round_size(size: u64) -> u64 {
    if size < K_MIN_BLOCK_SIZE {
        K_MIN_BLOCK_SIZE
    } else {
        size.div_ceil(K_MIN_BLOCK_SIZE) * K_MIN_BLOCK_SIZE
    }
}

fn get_allocation_size(size: u64) -> u64 {
    if size <= K_SMALL_SIZE {
        K_SMALL_BUFFER
    } else if size < K_MIN_LARGE_ALLOC {
        K_LARGE_BUFFER
    } else {
        size.div_ceil(K_ROUND_LARGE) * K_ROUND_LARGE
    }
}

impl<D: Driver> CachingAllocator<D> {
    /// A caching allocator over `drv` for a device of `capacity` bytes
    /// (`drv` must fail creates beyond it, as a GPU does).
    pub fn new(drv: D, capacity: u64, expandable: bool) -> Self {
        CachingAllocator {
            drv,
            expandable,
            capacity,
            slab: Vec::new(),
            free_slots: Vec::new(),
            pools: [Pool::default(), Pool::default()],
            active: HashMap::new(),
            native: Vec::new(),
            free_native: Vec::new(),
            exp: Vec::new(),
            next_rank: 0,
            stats: CachingStats::default(),
        }
    }

    pub fn driver(&self) -> &D {
        &self.drv
    }

    pub fn stats(&self) -> CachingStats {
        self.stats
    }

    pub fn is_expandable(&self) -> bool {
        self.expandable
    }

    /// Total bytes of free mapped blocks (cached but unused).
    pub fn free_cached_bytes(&self) -> u64 {
        self.pools.iter().flat_map(|p| p.blocks.iter()).map(|&(s, _, _)| s).sum()
    }

    /// Largest free mapped block of either pool.
    pub fn largest_free_block(&self) -> u64 {
        self.pools.iter().filter_map(|p| p.blocks.last()).map(|&(s, _, _)| s).max().unwrap_or(0)
    }

    fn b(&self, i: Idx) -> &Block {
        self.slab[i].as_ref().expect("live block")
    }

    fn bm(&mut self, i: Idx) -> &mut Block {
        self.slab[i].as_mut().expect("live block")
    }

    fn new_block(&mut self, b: Block) -> Idx {
        match self.free_slots.pop() {
            Some(i) => {
                self.slab[i] = Some(b);
                i
            }
            None => {
                self.slab.push(Some(b));
                self.slab.len() - 1
            }
        }
    }

    fn delete_block(&mut self, i: Idx) {
        self.slab[i] = None;
        self.free_slots.push(i);
    }

    /// The block's place in address order (see [`order_key`]).
    fn ord(&self, i: Idx) -> u64 {
        let b = self.b(i);
        if self.expandable {
            let s = self.exp[b.seg].as_ref().expect("live segment");
            order_key(s.rank, s.base, b.ptr)
        } else {
            let s = self.native[b.seg].as_ref().expect("live segment");
            order_key(s.rank, s.base, b.ptr)
        }
    }

    fn insert_free(&mut self, i: Idx) {
        let b = self.b(i);
        let key = (b.size, self.ord(i), i);
        let pool = b.pool;
        let fresh = self.pools[pool].blocks.insert(key);
        debug_assert!(fresh);
    }

    fn remove_free(&mut self, i: Idx) {
        let b = self.b(i);
        let key = (b.size, self.ord(i), i);
        let pool = b.pool;
        self.pools[pool].blocks.remove(&key);
    }

    fn insert_unmapped(&mut self, i: Idx) {
        let b = self.b(i);
        let key = (self.ord(i), i);
        let pool = b.pool;
        self.pools[pool].unmapped.insert(key);
    }

    fn remove_unmapped(&mut self, i: Idx) {
        let b = self.b(i);
        let key = (self.ord(i), i);
        let pool = b.pool;
        self.pools[pool].unmapped.remove(&key);
    }

    /// Allocates `orig_size` bytes; returns the address.
    pub fn malloc(&mut self, orig_size: u64) -> Result<u64, Oom> {
        let size = round_size(orig_size);
        let pool = if size <= K_SMALL_SIZE { SMALL } else { LARGE };
        let alloc_size = get_allocation_size(size);
        let mut driver_error = None;
        let mut found = self.get_free_block(pool, size);
        if found.is_none() {
            found = match self.alloc_block(pool, size, alloc_size) {
                Ok(b) => Some(b),
                Err(e) => {
                    if is_host_limit(&e) {
                        driver_error = Some(e.to_string());
                    }
                    // release_available_cached_blocks: false without max_split_size.
                    self.release_cached_blocks();
                    self.stats.num_alloc_retries += 1;
                    match self.alloc_block(pool, size, alloc_size) {
                        Ok(b) => Some(b),
                        Err(e) => {
                            if is_host_limit(&e) {
                                driver_error = Some(e.to_string());
                            }
                            None
                        }
                    }
                }
            };
        }
        let Some(block) = found else {
            self.stats.num_ooms += 1;
            return Err(Oom {
                size,
                allocated_bytes: self.stats.allocated_bytes,
                reserved_bytes: self.stats.reserved_bytes,
                capacity: self.capacity,
                largest_free_block: self.pools[pool].blocks.last().map_or(0, |k| k.0),
                driver_error,
            });
        };
        let split = self.should_split(block, size);
        Ok(self.alloc_found_block(block, size, orig_size, split))
    }

    /// Frees the block at `ptr` (which must come from [`Self::malloc`]).
    pub fn free(&mut self, ptr: u64) {
        let i = self.active.remove(&ptr).expect("free of an unknown pointer");
        let size = self.b(i).size;
        self.bm(i).allocated = false;
        self.stats.allocated_bytes -= size;
        self.free_block(i);
    }

    /// `emptyCache()`: releases every cached segment (or page) that holds
    /// nothing.
    pub fn empty_cache(&mut self) {
        self.release_cached_blocks();
    }

    fn get_free_block(&mut self, pool: usize, size: u64) -> Option<Idx> {
        let mut it = self.pools[pool].blocks.range((size, 0, 0)..);
        let &(_, _, mut cur) = it.next()?;
        if self.expandable {
            let exp_size = |s: &Self, i: Idx| {
                let b = s.b(i);
                b.size + b.next.map_or(0, |n| if s.b(n).mapped { 0 } else { s.b(n).size })
            };
            for &(_, _, n) in it {
                if exp_size(self, n) < exp_size(self, cur) {
                    cur = n;
                } else {
                    break;
                }
            }
        }
        self.remove_free(cur);
        Some(cur)
    }

    fn should_split(&self, i: Idx, size: u64) -> bool {
        let b = self.b(i);
        let remaining = b.size - size;
        if b.pool == SMALL || self.expandable {
            remaining >= K_MIN_BLOCK_SIZE
        } else {
            remaining > K_SMALL_SIZE
        }
    }

    fn alloc_found_block(&mut self, i: Idx, size: u64, orig: u64, split: bool) -> u64 {
        let mut block = i;
        if split {
            let rem = self.b(i).clone();
            let nb = self.new_block(Block {
                ptr: rem.ptr,
                size,
                requested: 0,
                pool: rem.pool,
                allocated: false,
                mapped: true,
                prev: rem.prev,
                next: Some(i),
                seg: rem.seg,
            });
            if let Some(p) = rem.prev {
                self.bm(p).next = Some(nb);
            }
            {
                let r = self.bm(i);
                r.prev = Some(nb);
                r.ptr += size;
                r.size -= size;
            }
            self.insert_free(i);
            block = nb;
        }
        let b = self.bm(block);
        b.allocated = true;
        b.requested = orig;
        let (ptr, bsize) = (b.ptr, b.size);
        self.active.insert(ptr, block);
        self.stats.allocated_bytes += bsize;
        ptr
    }

    fn free_block(&mut self, i: Idx) {
        let (prev, next) = (self.b(i).prev, self.b(i).next);
        self.try_merge_blocks(i, prev);
        self.try_merge_blocks(i, next);
        self.insert_free(i);
    }

    /// Merges free `src` into `dst` (neither is in a pool set as a key that
    /// changes: `dst` is out of its set; `src` is taken out here).
    fn try_merge_blocks(&mut self, dst: Idx, src: Option<Idx>) -> u64 {
        let Some(src) = src else { return 0 };
        let s = self.b(src).clone();
        if s.allocated || s.mapped != self.b(dst).mapped {
            return 0;
        }
        if s.mapped {
            self.remove_free(src);
        } else {
            self.remove_unmapped(src);
        }
        if self.b(dst).prev == Some(src) {
            let d = self.bm(dst);
            d.ptr = s.ptr;
            d.prev = s.prev;
            if let Some(p) = s.prev {
                self.bm(p).next = Some(dst);
            }
        } else {
            self.bm(dst).next = s.next;
            if let Some(n) = s.next {
                self.bm(n).prev = Some(dst);
            }
        }
        self.bm(dst).size += s.size;
        self.delete_block(src);
        s.size
    }

    /// `alloc_block`: a new segment (native) or new pages of the expandable
    /// segment. `Err` carries the driver's error (out of memory when full).
    fn alloc_block(&mut self, pool: usize, size: u64, alloc_size: u64) -> Result<Idx, Error> {
        if self.expandable {
            return self.try_allocate_expandable_block(pool, size);
        }
        // cudaMalloc(alloc_size).
        let base = self.drv.reserve(alloc_size, K_ROUND_LARGE)?;
        let h = match self.drv.create(alloc_size) {
            Ok(h) => h,
            Err(e) => {
                let _ = self.drv.free_reservation(base, alloc_size);
                return Err(e);
            }
        };
        let mapped = self.drv.map(base, alloc_size, h, 0).and_then(|_| self.drv.set_access(base, alloc_size));
        if let Err(e) = mapped {
            let _ = self.drv.unmap(base, alloc_size);
            let _ = self.drv.release(h);
            let _ = self.drv.free_reservation(base, alloc_size);
            return Err(e);
        }
        let seg = NativeSeg { rank: self.next_rank, base, size: alloc_size, handle: h };
        self.next_rank += 1;
        let si = match self.free_native.pop() {
            Some(si) => {
                self.native[si] = Some(seg);
                si
            }
            None => {
                self.native.push(Some(seg));
                self.native.len() - 1
            }
        };
        self.stats.reserved_bytes += alloc_size;
        self.stats.peak_reserved_bytes = self.stats.peak_reserved_bytes.max(self.stats.reserved_bytes);
        self.stats.num_device_alloc += 1;
        Ok(self.new_block(Block {
            ptr: base,
            size: alloc_size,
            requested: 0,
            pool,
            allocated: false,
            mapped: true,
            prev: None,
            next: None,
            seg: si,
        }))
    }

    fn release_cached_blocks(&mut self) {
        // synchronize_and_free_events (cudaFree synchronizes too).
        let _ = self.drv.synchronize();
        self.release_blocks(LARGE);
        self.release_blocks(SMALL);
    }

    fn release_blocks(&mut self, pool: usize) {
        let all: Vec<Idx> = self.pools[pool].blocks.iter().map(|&(_, _, i)| i).collect();
        let mut to_unmap = Vec::new();
        for i in all {
            if self.expandable {
                to_unmap.push(i);
            } else if self.b(i).prev.is_none() && self.b(i).next.is_none() {
                self.release_block(i);
            }
        }
        for i in to_unmap {
            self.unmap_block(i);
            let b = self.b(i);
            if b.prev.is_none() && b.next.is_none() {
                self.release_expandable_segment(i);
            }
        }
    }

    fn release_block(&mut self, i: Idx) {
        self.remove_free(i);
        let si = self.b(i).seg;
        let seg = self.native[si].take().expect("live segment");
        self.free_native.push(si);
        let _ = self.drv.unmap(seg.base, seg.size);
        let _ = self.drv.release(seg.handle);
        let _ = self.drv.free_reservation(seg.base, seg.size);
        self.stats.reserved_bytes -= seg.size;
        self.stats.num_device_free += 1;
        self.delete_block(i);
    }

    /// Checks the block lists against the pool sets (for tests).
    pub fn check_invariants(&self) {
        for (i, b) in self.slab.iter().enumerate() {
            let Some(b) = b else { continue };
            if let Some(n) = b.next {
                let nb = self.b(n);
                assert_eq!(nb.prev, Some(i), "next.prev");
                assert_eq!(b.ptr + b.size, nb.ptr, "contiguous");
                assert!(b.allocated || nb.allocated || b.mapped != nb.mapped, "free neighbours not merged");
            }
            let in_blocks = self.pools[b.pool].blocks.contains(&(b.size, self.ord(i), i));
            let in_unmapped = self.pools[b.pool].unmapped.contains(&(self.ord(i), i));
            match (b.allocated, b.mapped) {
                (true, _) => assert!(!in_blocks && !in_unmapped && self.active.get(&b.ptr) == Some(&i)),
                (false, true) => assert!(in_blocks && !in_unmapped, "free block {i} not in its pool"),
                (false, false) => assert!(!in_blocks && in_unmapped),
            }
        }
    }
}

impl<D: Driver> Drop for CachingAllocator<D> {
    fn drop(&mut self) {
        let _ = self.drv.synchronize();
        for seg in self.native.iter().flatten() {
            let _ = self.drv.unmap(seg.base, seg.size);
            let _ = self.drv.release(seg.handle);
            let _ = self.drv.free_reservation(seg.base, seg.size);
        }
        for seg in self.exp.iter().flatten() {
            for (p, h) in seg.handles.iter().enumerate() {
                if let Some(h) = h {
                    let _ = self.drv.unmap(seg.base + p as u64 * seg.page, seg.page);
                    let _ = self.drv.release(*h);
                }
            }
            let _ = self.drv.free_reservation(seg.base, seg.max_handles * seg.page);
        }
    }
}
