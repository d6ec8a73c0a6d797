//! Hand-computed expectations of the kvcached model. Geometry: one layer
//! (two KV buffers), blocks of 512 KiB, so four blocks per 2 MiB page and a
//! page id maps 4 MiB.

use super::super::kvcached_pool::{ElasticBlockPool, KvcachedPool};
use super::*;

const BLOCK: u64 = 512 << 10;

fn manager(pages: u64, min: u64, max: u64) -> BlockManager {
    BlockManager::with_allocator(pages * 4, BLOCK, |mem| {
        PageAllocator::with_reserve(1, mem, SharedHbm::unlimited(), min, max)
    })
    .expect("manager")
}

#[test]
fn blocks_per_page_follow_the_geometry() {
    let m = manager(8, 0, 0);
    assert_eq!(m.blocks_per_page(), 4);
    assert_eq!(m.page_allocator.page_bundle_bytes(), 4 << 20);
    // Qwen3-4B: 16 tokens × 8 KV heads × 128 × 2 bytes = 32 KiB per block
    // and buffer: 64 blocks a page; 36 layers: a page id maps 144 MiB.
    let q = BlockManager::new(14_000, 32 << 10, 36, SharedHbm::unlimited()).unwrap();
    assert_eq!(q.blocks_per_page(), 64);
    assert_eq!(q.page_allocator.page_bundle_bytes(), 144 << 20);
}

#[test]
fn a_page_stays_mapped_while_one_block_survives_and_goes_with_its_last() {
    let mut m = manager(8, 0, 0);
    // The null block took page 0's block 0.
    assert_eq!(m.page_allocator.num_inuse_pages(), 1);
    assert_eq!(m.alloc(3), Some(vec![1, 2, 3]));
    assert_eq!(m.alloc(4), Some(vec![4, 5, 6, 7]));
    assert_eq!(m.page_allocator.num_inuse_pages(), 2);
    m.free(&[4, 5, 6]);
    // Block 7 pins page 1.
    assert_eq!(m.page_allocator.num_inuse_pages(), 2);
    assert_eq!(m.page_occupancy(1), 1);
    assert_eq!(m.mapped_bytes(), 2 * (4 << 20));
    let before = m.page_allocator.calls();
    m.free(&[7]);
    // Its last block gone, page 1 is unmapped (no reserve here).
    assert_eq!(m.page_allocator.num_inuse_pages(), 1);
    assert_eq!(m.mapped_bytes(), 4 << 20);
    let c = m.page_allocator.calls().since(&before);
    assert_eq!((c.unmap, c.map, c.set_access, c.release), (1, 1, 1, 1));
    assert_eq!(c.release_chunks, 2);
}

#[test]
fn the_reserve_is_refilled_to_its_minimum_and_parks_up_to_its_maximum() {
    let mut m = manager(20, 5, 10);
    // Page 0 (null block) mapped on the slow path, then the thread's
    // first run maps pages 1..=5 into the reserve.
    assert_eq!(m.page_allocator.num_inuse_pages(), 1);
    assert_eq!(m.page_allocator.num_reserved_pages(), 5);
    assert_eq!(m.page_allocator.calls().create, 6);
    // Page 0 was mapped on the caller's path, the reserve by the thread.
    assert_eq!(m.page_allocator.foreground_calls().create, 1);
    assert_eq!(m.alloc(3), Some(vec![1, 2, 3]));
    // Page 1 comes from the reserve (4 left < 5): page 6 is mapped into it.
    assert_eq!(m.alloc(4), Some(vec![4, 5, 6, 7]));
    assert_eq!(m.page_allocator.num_reserved_pages(), 5);
    assert_eq!(m.page_allocator.calls().create, 7);
    assert_eq!(m.page_allocator.mapped_pages(), 7);
    // Page 1 freed: parked (5 < 10), not unmapped.
    m.free(&[4, 5, 6, 7]);
    assert_eq!(m.page_allocator.num_reserved_pages(), 6);
    assert_eq!(m.page_allocator.calls().unmap, 7); // the maps' zero-page unmaps only
    assert_eq!(m.page_allocator.calls().release, 0);
    // Six pages from the reserve: it refills to 5 after each dip under 5.
    let got = m.alloc(24).unwrap();
    assert_eq!(got.len(), 24);
    assert_eq!(m.page_allocator.num_reserved_pages(), 5);
    assert_eq!(m.page_allocator.num_inuse_pages(), 7);
    // Its six pages freed: five parked (the reserve reaches 10), one unmapped.
    m.free(&got);
    assert_eq!(m.page_allocator.num_reserved_pages(), 10);
    assert_eq!(m.page_allocator.calls().release, 1);
    // trim unmaps the reserve.
    m.trim();
    assert_eq!(m.page_allocator.num_reserved_pages(), 0);
    assert_eq!(m.page_allocator.mapped_pages(), 1);
    assert_eq!(m.page_allocator.calls().release, 11);
}

#[test]
fn page_aware_allocation_picks_the_fullest_page_that_fits() {
    let mut m = manager(8, 0, 0);
    let a = m.alloc(3).unwrap(); // page 0: 1..=3
    let b = m.alloc(4).unwrap(); // page 1: 4..=7
    let c = m.alloc(4).unwrap(); // page 2: 8..=11
    assert_eq!((a, b.clone(), c.clone()), (vec![1, 2, 3], vec![4, 5, 6, 7], vec![8, 9, 10, 11]));
    m.free(&[4, 5, 6]); // page 1: 3 free
    m.free(&[8]); // page 2: 1 free
                  // One block: page 2 (1 free) beats page 1 (3 free).
    assert_eq!(m.alloc(1), Some(vec![8]));
    // Three blocks: page 1 holds them all.
    assert_eq!(m.alloc(3), Some(vec![4, 5, 6]));
    // Five blocks: no page holds them; a fresh page (4), then a fresh one.
    let five = m.alloc(5).unwrap();
    assert_eq!(five, vec![12, 13, 14, 15, 16]);
    assert_eq!(m.page_allocator.num_inuse_pages(), 5);
}

#[test]
fn capped_cache_evicts_the_page_it_can_empty() {
    let m = manager(8, 0, 0);
    let mut p = KvcachedPool::new(ElasticBlockPool::new(m, 32, true, 3));
    // Request 1: 3 blocks on page 0 (1..=3); request 2: 4 blocks on page 1.
    let h1: std::sync::Arc<[u64]> = vec![11, 12, 13].into();
    let h2: std::sync::Arc<[u64]> = vec![21, 22, 23, 24].into();
    assert_eq!(p.admit(1, h1.clone(), 48), Some(0));
    assert_eq!(p.admit(2, h2, 64), Some(0));
    p.finish(1);
    assert_eq!(p.pool.num_evictable(), 3);
    // Request 2's 4 blocks make 7 evictable, over the cap of 3: 4 are
    // evicted, page-aware: page 1 (4 blocks, all evictable) goes whole.
    p.finish(2);
    assert_eq!(p.pool.num_evictable(), 3);
    assert_eq!(p.pool.mgr.page_allocator.num_inuse_pages(), 1);
    // Request 1's prompt is still cached: a hit of 2 blocks (the last
    // token is always computed).
    assert_eq!(p.admit(3, h1, 48), Some(32));
}

#[test]
fn with_engine_threads_a_burst_past_the_reserve_maps_on_the_callers_thread() {
    // 16 pages, reserve 5 to 10: after start, page 0 holds the null block
    // and pages 1-5 are reserved.
    let mut m = manager(16, 5, 10);
    assert_eq!(m.page_allocator.num_reserved_pages(), 5);
    m.page_allocator.set_engine_threads(true);
    let (fg, bg) = (m.page_allocator.foreground_calls(), m.page_allocator.background_calls());
    // Page 0's 3 free blocks, then 7 pages: 5 from the reserve, 2 mapped
    // now, on the caller's thread (the thread refills the reserve later).
    let blocks = m.alloc(3 + 7 * 4).expect("room");
    assert_eq!(m.page_allocator.foreground_calls().since(&fg).create, 2);
    assert_eq!(m.page_allocator.background_calls().since(&bg).create, 0);
    assert_eq!(m.page_allocator.num_reserved_pages(), 0);
    // Its turn between steps: it maps the minimum back, off the caller's thread.
    m.page_allocator.run_prealloc_thread();
    assert_eq!(m.page_allocator.num_reserved_pages(), 5);
    assert_eq!(m.page_allocator.background_calls().since(&bg).create, 5);
    assert_eq!(m.page_allocator.foreground_calls().since(&fg).create, 2);
    assert_eq!(blocks.len(), 31);
}

#[test]
fn under_asynchronous_scheduling_unmap_pages_synchronizes_first() {
    let mut m = manager(16, 5, 10);
    m.page_allocator.set_engine_threads(true);
    let blocks = m.alloc(3 + 7 * 4).expect("room");
    m.page_allocator.run_prealloc_thread();
    // Freeing the 7 pages: 5 fill the reserve to its maximum (10), 2 are
    // unmapped in one `unmap_pages`, the device synchronized before it.
    let fg = m.page_allocator.foreground_calls();
    m.free(&blocks[3..]);
    let d = m.page_allocator.foreground_calls().since(&fg);
    assert_eq!((d.unmap, d.release, d.synchronize), (2, 2, 1));
    assert_eq!(m.page_allocator.num_reserved_pages(), 10);
}

#[test]
fn without_asynchronous_scheduling_unmaps_do_not_synchronize() {
    let mut m = manager(16, 0, 0);
    m.page_allocator.set_engine_threads(false);
    let blocks = m.alloc(3 + 2 * 4).expect("room");
    let fg = m.page_allocator.foreground_calls();
    m.free(&blocks[3..]);
    let d = m.page_allocator.foreground_calls().since(&fg);
    assert_eq!((d.unmap, d.synchronize), (2, 0));
}
