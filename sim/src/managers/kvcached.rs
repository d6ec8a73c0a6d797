//! A model of kvcached (github.com/ovg-project/kvcached), the elastic KV
//! cache that keeps vLLM's paged blocks and backs the block pool with GPU
//! virtual memory. This file models its two lower layers, function by
//! function; `kvcached_pool.rs` models the vLLM block pool on top.
//!
//! - [`PageAllocator`] is `csrc/page_allocator.cpp`'s `PageAllocator`: page
//!   ids of one KV buffer, a free list and a list of pre-mapped reserved
//!   pages (`KVCACHED_MIN_RESERVED_PAGES` = 5, `KVCACHED_MAX_RESERVED_PAGES`
//!   = 10), `alloc_page` (reserved first, else map a free page),
//!   `free_pages` (park up to the maximum, unmap the rest), `trim` (unmap
//!   every reserved page) and the pre-allocation thread's work
//!   (`prealloc_worker`: map pages until the minimum is reserved).
//! - [`InternalPage`] is the same file's `InternalPage`: the blocks of one
//!   page and their free list (allocation takes from the front, frees are
//!   appended).
//! - [`BlockManager`] is `kvcached/kv_cache_manager.py`'s `KVCacheManager`:
//!   `_alloc` (whole pages of blocks, the partly used page chosen by
//!   `_pick_avail_page`, the page-aware allocation), `free` (a page whose
//!   last block goes back goes to `free_pages`), `available_size`,
//!   `get_page_occupancy`.
//!
//! A page id stands for one 2 MiB page in every KV buffer (`2 × layers`
//! of them): mapping one maps `2 × layers × 2 MiB` of physical memory
//! (`get_mapped_memory_size`). The driver calls are those of CUDA's
//! default layout (`KVCACHED_CONTIGUOUS_LAYOUT` is on for CUDA, `utils.py`):
//! one compound page of `2 × layers × 2 MiB` per page id, mapped by
//! `FTensor::map` (`cuMemUnmap` of the zero page, `cuMemCreate`, `cuMemMap`,
//! `cuMemSetAccess`) and unmapped by `FTensor::unmap` (`cuMemUnmap`, the zero
//! page mapped back with `cuMemMap` + `cuMemSetAccess`, and `cuMemRelease`
//! of the handle). They are counted in [`Calls`] with the chunks they cover,
//! so the profiles' per-chunk prices (the ones the arena is charged) apply.
//!
//! Two ways to run the pre-allocation thread: at once when it is triggered
//! (the default, the order `sim/crosscheck` transcribes), or, as in a
//! serving engine ([`PageAllocator::set_engine_threads`]), asynchronously:
//! triggered, it runs between the engine's steps
//! ([`PageAllocator::run_prealloc_thread`]), so a burst that needs more
//! pages than the reserve holds maps the rest on the caller's thread; and
//! with asynchronous scheduling, `unmap_pages` synchronizes the device
//! before it unmaps (a page may still be read by a step in flight).
//!
//! What the model leaves out: `group_indices_by_page` groups in the
//! order blocks first appear (the C++ returns a `std::unordered_map`,
//! whose iteration order is the hash table's: it decides only which freed
//! page is parked and where a page re-enters `avail_pages`); resizing
//! (`KVCACHED` memory limits) and reserved blocks (`try_to_reserve`,
//! unused by the vLLM integration) are not modelled.

use std::cell::Cell;
use std::collections::{HashMap, VecDeque};
use std::rc::Rc;

use crate::counted::Calls;

/// kvcached's page size (`KVCACHED_PAGE_SIZE_MB`, 2 by default).
pub const KVCACHED_PAGE_BYTES: u64 = 2 << 20;
/// `KVCACHED_MIN_RESERVED_PAGES`'s default.
pub const KVCACHED_MIN_RESERVED_PAGES: u64 = 5;
/// `KVCACHED_MAX_RESERVED_PAGES`'s default.
pub const KVCACHED_MAX_RESERVED_PAGES: u64 = 10;
/// `KVCACHED_GPU_UTILIZATION`'s default: the fraction of the device's
/// memory kvcached lets itself map (the rest is headroom).
pub const KVCACHED_GPU_UTILIZATION: f64 = 0.95;

/// The device memory several kvcached instances map pages from: what
/// `cudaMemGetInfo` answers them (`get_avail_physical_pages`).
#[derive(Clone, Debug)]
pub struct SharedHbm {
    total: u64,
    free: Rc<Cell<u64>>,
}

impl SharedHbm {
    /// A device of `total` bytes of which `free` are free for KV.
    pub fn new(total: u64, free: u64) -> SharedHbm {
        SharedHbm { total, free: Rc::new(Cell::new(free.min(total))) }
    }

    /// A device so large it never limits (the idle-footprint setting).
    pub fn unlimited() -> SharedHbm {
        SharedHbm::new(u64::MAX / 4, u64::MAX / 4)
    }

    pub fn free_bytes(&self) -> u64 {
        self.free.get()
    }

    pub fn total_bytes(&self) -> u64 {
        self.total
    }

    /// Takes `bytes` (a physical allocation); false if they are not free.
    pub fn take(&self, bytes: u64) -> bool {
        let f = self.free.get();
        if bytes > f {
            return false;
        }
        self.free.set(f - bytes);
        true
    }

    pub fn give_back(&self, bytes: u64) {
        self.free.set(self.free.get() + bytes);
    }
}

/// `InternalPage`: the blocks of one page (`get_block_range`) and the free
/// ones, in the order `alloc` hands them out.
#[derive(Clone, Debug)]
pub struct InternalPage {
    pub page_id: u64,
    start_block: u64,
    end_block: u64,
    free_list: VecDeque<u64>,
}

impl InternalPage {
    /// `InternalPage::get_block_range`: the blocks wholly inside the page.
    pub fn block_range(page_id: u64, page_size: u64, block_mem_size: u64) -> (u64, u64) {
        ((page_id * page_size).div_ceil(block_mem_size), (page_id + 1) * page_size / block_mem_size)
    }

    /// `InternalPage::init`: every block of the page free, in order.
    pub fn new(page_id: u64, page_size: u64, block_mem_size: u64) -> InternalPage {
        let (start_block, end_block) = Self::block_range(page_id, page_size, block_mem_size);
        InternalPage { page_id, start_block, end_block, free_list: (start_block..end_block).collect() }
    }

    /// `alloc`: the first `n` free blocks (the caller checked there are).
    fn alloc(&mut self, n: u64) -> Vec<u64> {
        assert!(self.free_list.len() as u64 >= n, "Not enough free blocks in page");
        self.free_list.drain(..n as usize).collect()
    }

    /// `free_batch`: appended to the free list.
    fn free_batch(&mut self, ids: &[u64]) {
        self.free_list.extend(ids.iter().copied());
    }

    pub fn num_free_blocks(&self) -> u64 {
        self.free_list.len() as u64
    }

    fn empty(&self) -> bool {
        self.num_free_blocks() == self.end_block - self.start_block
    }

    fn full(&self) -> bool {
        self.free_list.is_empty()
    }
}

/// `PageAllocator` (`csrc/page_allocator.cpp`) for one model instance.
#[derive(Debug)]
pub struct PageAllocator {
    page_size: u64,
    /// `num_layers × num_kv_buffers`: the 2 MiB pages one page id maps.
    buffers: u64,
    num_total_pages: u64,
    num_free_pages: u64,
    free_page_list: VecDeque<u64>,
    reserved_page_list: VecDeque<u64>,
    min_reserved_pages: u64,
    max_reserved_pages: u64,
    prealloc_needed: bool,
    /// The pre-allocation thread runs only when the engine lets it
    /// ([`PageAllocator::run_prealloc_thread`]), not at once.
    prealloc_async: bool,
    /// `unmap_pages` synchronizes the device first (asynchronous scheduling).
    sync_before_unmap: bool,
    hbm: SharedHbm,
    calls: Calls,
    /// The calls the pre-allocation thread made (off the scheduler's path).
    background_calls: Calls,
    peak_mapped_pages: u64,
}

impl PageAllocator {
    /// The constructor: every page of the virtual range free, none mapped;
    /// the reserve bounds capped by the pages there are.
    pub fn new(num_layers: u64, mem_size_per_layer: u64, hbm: SharedHbm) -> PageAllocator {
        Self::with_reserve(
            num_layers,
            mem_size_per_layer,
            hbm,
            KVCACHED_MIN_RESERVED_PAGES,
            KVCACHED_MAX_RESERVED_PAGES,
        )
    }

    /// As [`PageAllocator::new`] with the two environment variables set.
    pub fn with_reserve(num_layers: u64, mem_size_per_layer: u64, hbm: SharedHbm, min: u64, max: u64) -> PageAllocator {
        let pages = mem_size_per_layer / KVCACHED_PAGE_BYTES;
        PageAllocator {
            page_size: KVCACHED_PAGE_BYTES,
            buffers: 2 * num_layers,
            num_total_pages: pages,
            num_free_pages: pages,
            free_page_list: (0..pages).collect(),
            reserved_page_list: VecDeque::new(),
            min_reserved_pages: pages.min(min),
            max_reserved_pages: pages.min(max),
            prealloc_needed: false,
            prealloc_async: false,
            sync_before_unmap: false,
            hbm,
            calls: Calls::default(),
            background_calls: Calls::default(),
            peak_mapped_pages: 0,
        }
    }

    /// Runs the pre-allocation thread as a serving engine does: on its own
    /// thread between the engine's steps, not at once; and, under
    /// asynchronous scheduling, with the device synchronized before each
    /// `unmap_pages` (see the module documentation).
    pub fn set_engine_threads(&mut self, async_scheduling: bool) {
        self.prealloc_async = true;
        self.sync_before_unmap = async_scheduling;
    }

    /// The pre-allocation thread's turn (between the engine's steps): if
    /// triggered, it maps pages until the minimum is reserved, its calls
    /// off the caller's thread. Nothing to do where it runs at once.
    pub fn run_prealloc_thread(&mut self) {
        self.prealloc_worker();
    }

    /// Triggers the pre-allocation thread: at once, or at its next turn.
    fn trigger_prealloc(&mut self) {
        self.prealloc_needed = true;
        if !self.prealloc_async {
            self.prealloc_worker();
        }
    }

    /// Bytes of physical memory one page id maps (every KV buffer's page).
    pub fn page_bundle_bytes(&self) -> u64 {
        self.page_size * self.buffers
    }

    /// `alloc_page`: a reserved page if there is one (refilling the reserve
    /// once it runs under the minimum), else the first free page, mapped
    /// now; an error when no page is free or the device has no memory.
    pub fn alloc_page(&mut self) -> Result<u64, String> {
        if let Some(id) = self.reserved_page_list.pop_front() {
            self.num_free_pages -= 1;
            if (self.reserved_page_list.len() as u64) < self.min_reserved_pages {
                self.trigger_prealloc();
            }
            return Ok(id);
        }
        let Some(id) = self.free_page_list.pop_front() else {
            return Err("No free pages left".into());
        };
        self.num_free_pages -= 1;
        if let Err(e) = self.map_pages(&[id]) {
            self.free_page_list.push_front(id);
            self.num_free_pages += 1;
            return Err(format!("Failed to map page {id}: {e}"));
        }
        self.trigger_prealloc();
        Ok(id)
    }

    /// `free_pages`: parks pages in the reserve up to its maximum, unmaps
    /// the rest (appended to the free list).
    pub fn free_pages(&mut self, ids: &[u64]) {
        self.num_free_pages += ids.len() as u64;
        let room = self.max_reserved_pages.saturating_sub(self.reserved_page_list.len() as u64) as usize;
        let keep = room.min(ids.len());
        self.reserved_page_list.extend(ids[..keep].iter().copied());
        let unmap = &ids[keep..];
        if !unmap.is_empty() {
            self.unmap_pages(unmap);
            self.free_page_list.extend(unmap.iter().copied());
        }
    }

    /// `trim`: unmaps every reserved page.
    pub fn trim(&mut self) {
        let pages: Vec<u64> = self.reserved_page_list.drain(..).collect();
        if !pages.is_empty() {
            self.unmap_pages(&pages);
            self.free_page_list.extend(pages);
        }
    }

    /// `start_prealloc_thread`: the thread's first run.
    pub fn start_prealloc_thread(&mut self) {
        self.prealloc_needed = true;
        self.prealloc_worker();
    }

    /// One run of `prealloc_worker`: maps free pages (from the front of the
    /// free list) until the minimum is reserved, as far as free pages and
    /// the device's memory allow.
    fn prealloc_worker(&mut self) {
        if !self.prealloc_needed {
            return;
        }
        self.prealloc_needed = false;
        let want = self.min_reserved_pages.saturating_sub(self.reserved_page_list.len() as u64);
        let n = want.min(self.free_page_list.len() as u64).min(self.avail_physical_pages());
        let pages: Vec<u64> = self.free_page_list.drain(..n as usize).collect();
        if pages.is_empty() {
            return;
        }
        let before = self.calls;
        let mapped = self.map_pages(&pages);
        self.background_calls = self.background_calls.plus(&self.calls.since(&before));
        match mapped {
            Ok(()) => self.reserved_page_list.extend(pages),
            Err(_) => {
                for &p in pages.iter().rev() {
                    self.free_page_list.push_front(p);
                }
            }
        }
    }

    /// `map_pages` through `FTensor::map` in the contiguous layout: per
    /// page, the zero page unmapped, a compound page created, mapped and
    /// made accessible. All or nothing here (the device check comes first).
    fn map_pages(&mut self, ids: &[u64]) -> Result<(), String> {
        let bytes = ids.len() as u64 * self.page_bundle_bytes();
        if !self.hbm.take(bytes) {
            return Err("out of device memory".into());
        }
        let n = ids.len() as u64;
        let chunks = n * self.buffers;
        self.calls.unmap += n;
        self.calls.unmap_chunks += chunks;
        self.calls.create += n;
        self.calls.create_chunks += chunks;
        self.calls.map += n;
        self.calls.map_chunks += chunks;
        self.calls.set_access += n;
        self.calls.set_access_chunks += chunks;
        self.peak_mapped_pages = self.peak_mapped_pages.max(self.mapped_pages());
        Ok(())
    }

    /// `unmap_pages` through `FTensor::unmap`: per page, unmapped, the zero
    /// page mapped back (with access set), the handle released.
    fn unmap_pages(&mut self, ids: &[u64]) {
        let n = ids.len() as u64;
        let chunks = n * self.buffers;
        if self.sync_before_unmap {
            self.calls.synchronize += 1;
        }
        self.hbm.give_back(n * self.page_bundle_bytes());
        self.calls.unmap += n;
        self.calls.unmap_chunks += chunks;
        self.calls.map += n;
        self.calls.map_chunks += chunks;
        self.calls.set_access += n;
        self.calls.set_access_chunks += chunks;
        self.calls.release += n;
        self.calls.release_chunks += chunks;
    }

    /// `get_avail_physical_pages`: the device's free memory less the
    /// headroom `KVCACHED_GPU_UTILIZATION` keeps, in page ids.
    pub fn avail_physical_pages(&self) -> u64 {
        let headroom = (self.hbm.total_bytes() as f64 * (1.0 - KVCACHED_GPU_UTILIZATION)) as u64;
        self.hbm.free_bytes().saturating_sub(headroom) / self.page_size / self.buffers
    }

    /// `get_num_free_pages`: pages not in use (free or reserved).
    pub fn num_free_pages(&self) -> u64 {
        self.num_free_pages
    }

    /// `get_num_inuse_pages`: pages holding blocks (what kvcached publishes
    /// as its `used_size`).
    pub fn num_inuse_pages(&self) -> u64 {
        self.num_total_pages - self.num_free_pages
    }

    /// `get_num_reserved_pages`: mapped, parked pages.
    pub fn num_reserved_pages(&self) -> u64 {
        self.reserved_page_list.len() as u64
    }

    /// Page ids whose physical memory is mapped (in use or reserved).
    pub fn mapped_pages(&self) -> u64 {
        self.num_inuse_pages() + self.num_reserved_pages()
    }

    pub fn peak_mapped_pages(&self) -> u64 {
        self.peak_mapped_pages
    }

    pub fn calls(&self) -> Calls {
        self.calls
    }

    /// The calls the pre-allocation thread made.
    pub fn background_calls(&self) -> Calls {
        self.background_calls
    }

    /// The calls made on the caller's thread (all but the pre-allocation
    /// thread's): what an allocation or a free waits for.
    pub fn foreground_calls(&self) -> Calls {
        self.calls.since(&self.background_calls)
    }

    /// `get_page_id`.
    pub fn page_of(&self, block: u64, block_mem_size: u64) -> u64 {
        block * block_mem_size / self.page_size
    }

    /// `group_indices_by_page`, in the order blocks first appear.
    pub fn group_indices_by_page(&self, ids: &[u64], block_mem_size: u64) -> Vec<(u64, Vec<u64>)> {
        let mut out: Vec<(u64, Vec<u64>)> = Vec::new();
        let mut at: HashMap<u64, usize> = HashMap::new();
        for &b in ids {
            let p = self.page_of(b, block_mem_size);
            let i = *at.entry(p).or_insert_with(|| {
                out.push((p, Vec::new()));
                out.len() - 1
            });
            out[i].1.push(b);
        }
        out
    }
}

/// `KVCacheManager` (`kvcached/kv_cache_manager.py`): blocks of
/// `block_mem_size` bytes per KV buffer, carved out of pages.
#[derive(Debug)]
pub struct BlockManager {
    pub page_allocator: PageAllocator,
    pub block_mem_size: u64,
    blocks_per_page: u64,
    num_avail_blocks: u64,
    /// `avail_pages` (a dict: insertion order matters to `_pick_avail_page`).
    avail_order: Vec<u64>,
    avail_pages: HashMap<u64, InternalPage>,
    full_pages: HashMap<u64, InternalPage>,
}

impl BlockManager {
    /// `KVCacheManager.__init__` + `_post_init` with `reserve_null_block`
    /// (as vLLM's integration creates it): block 0 is allocated (mapping
    /// page 0) before the pre-allocation thread starts. `block_bytes` is
    /// `block_size × cell_size`, one block in one KV buffer.
    pub fn new(num_blocks: u64, block_bytes: u64, num_layers: u64, hbm: SharedHbm) -> Result<BlockManager, String> {
        Self::with_allocator(num_blocks, block_bytes, |mem| PageAllocator::new(num_layers, mem, hbm))
    }

    /// As [`BlockManager::new`] with a page allocator built by `make` from
    /// the per-buffer virtual size.
    pub fn with_allocator(
        num_blocks: u64,
        block_bytes: u64,
        make: impl FnOnce(u64) -> PageAllocator,
    ) -> Result<BlockManager, String> {
        if block_bytes > KVCACHED_PAGE_BYTES {
            return Err(format!("a block of {block_bytes} bytes does not fit a {KVCACHED_PAGE_BYTES}-byte page"));
        }
        let mut m = BlockManager {
            page_allocator: make(num_blocks * block_bytes),
            block_mem_size: block_bytes,
            blocks_per_page: KVCACHED_PAGE_BYTES / block_bytes,
            num_avail_blocks: 0,
            avail_order: Vec::new(),
            avail_pages: HashMap::new(),
            full_pages: HashMap::new(),
        };
        let null = m.alloc(1).ok_or("no room for the null block")?;
        if null != [0] {
            return Err(format!("null block is {null:?}, not block 0"));
        }
        m.page_allocator.start_prealloc_thread();
        Ok(m)
    }

    /// `InternalPage.get_num_blocks`.
    pub fn blocks_per_page(&self) -> u64 {
        self.blocks_per_page
    }

    /// `available_size`: free blocks on partly used pages, plus whole pages
    /// that are free both in the virtual range and on the device.
    pub fn available_size(&self) -> u64 {
        let pa = &self.page_allocator;
        let physical = pa.avail_physical_pages() + pa.num_reserved_pages();
        self.num_avail_blocks + pa.num_free_pages().min(physical) * self.blocks_per_page
    }

    /// `_alloc`: `need` blocks, all or nothing (`None`: not available).
    pub fn alloc(&mut self, need: u64) -> Option<Vec<u64>> {
        if self.available_size() < need {
            return None;
        }
        let mut out = Vec::with_capacity(need as usize);
        let mut remaining = need;
        while remaining > 0 {
            let mut page = if self.avail_order.is_empty() {
                match self.page_allocator.alloc_page() {
                    Ok(id) => {
                        let p = InternalPage::new(id, KVCACHED_PAGE_BYTES, self.block_mem_size);
                        self.num_avail_blocks += p.num_free_blocks();
                        p
                    }
                    Err(_) => {
                        // `_rollback_partial_alloc`.
                        self.free(&out);
                        return None;
                    }
                }
            } else {
                self.pick_avail_page(remaining)
            };
            let n = page.num_free_blocks().min(remaining);
            out.extend(page.alloc(n));
            self.insert_page(page);
            self.num_avail_blocks -= n;
            remaining -= n;
        }
        Some(out)
    }

    /// Puts a page back into `full_pages` or at the end of `avail_pages`.
    fn insert_page(&mut self, page: InternalPage) {
        if page.full() {
            self.full_pages.insert(page.page_id, page);
        } else {
            self.avail_order.push(page.page_id);
            self.avail_pages.insert(page.page_id, page);
        }
    }

    fn remove_avail(&mut self, id: u64) -> InternalPage {
        let at = self.avail_order.iter().position(|&p| p == id).expect("listed");
        self.avail_order.remove(at);
        self.avail_pages.remove(&id).expect("listed")
    }

    /// `_pick_avail_page` (page-aware allocation): the page with the fewest
    /// free blocks that still holds the whole run; if none does, the page
    /// with the most free blocks. Ties go to the first in `avail_pages`.
    fn pick_avail_page(&mut self, remaining: u64) -> InternalPage {
        let mut best: Option<(u64, u64)> = None;
        let mut fallback: Option<(u64, u64)> = None;
        for &id in &self.avail_order {
            let free = self.avail_pages[&id].num_free_blocks();
            if free >= remaining {
                if best.map_or(true, |(_, f)| free < f) {
                    best = Some((id, free));
                }
            } else if fallback.map_or(true, |(_, f)| free > f) {
                fallback = Some((id, free));
            }
        }
        let (id, _) = best.or(fallback).expect("avail_pages is not empty");
        self.remove_avail(id)
    }

    /// `free`: blocks go back to their pages; a page whose every block is
    /// free goes to the page allocator.
    pub fn free(&mut self, ids: &[u64]) {
        if ids.is_empty() {
            return;
        }
        let mut to_free = Vec::new();
        for (pid, idxs) in self.page_allocator.group_indices_by_page(ids, self.block_mem_size) {
            let mut page = match self.full_pages.remove(&pid) {
                Some(p) => p,
                None if self.avail_pages.contains_key(&pid) => self.remove_avail(pid),
                None => panic!("page {pid} not found in avail_pages or full_pages"),
            };
            self.num_avail_blocks += idxs.len() as u64;
            page.free_batch(&idxs);
            if page.empty() {
                self.num_avail_blocks -= page.num_free_blocks();
                to_free.push(page.page_id);
            } else {
                self.avail_order.push(pid);
                self.avail_pages.insert(pid, page);
            }
        }
        if !to_free.is_empty() {
            self.page_allocator.free_pages(&to_free);
        }
    }

    /// `trim`.
    pub fn trim(&mut self) {
        self.page_allocator.trim();
    }

    /// `get_page_occupancy`: blocks allocated on a page (0 if untracked).
    pub fn page_occupancy(&self, page: u64) -> u64 {
        let p = self.full_pages.get(&page).or_else(|| self.avail_pages.get(&page));
        p.map_or(0, |p| (p.end_block - p.start_block) - p.num_free_blocks())
    }

    /// `get_mapped_memory_size`: bytes of the pages in use (reserved pages
    /// not counted, as kvcached publishes it).
    pub fn inuse_bytes(&self) -> u64 {
        self.page_allocator.num_inuse_pages() * self.page_allocator.page_bundle_bytes()
    }

    /// Physical bytes mapped: pages in use and reserved pages.
    pub fn mapped_bytes(&self) -> u64 {
        self.page_allocator.mapped_pages() * self.page_allocator.page_bundle_bytes()
    }
}

#[cfg(test)]
#[path = "kvcached_tests.rs"]
mod tests;
