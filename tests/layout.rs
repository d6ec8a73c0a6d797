//! The block-in-chunk layout over a real arena (host backend): a request's
//! block table stays right across compaction, growth that moves, growth in
//! place and shrinking, for chunk sizes from 2 to 20 MiB; the bytes written
//! through the allocation are found through the table.

use std::ops::Range;
use std::sync::{Arc, Mutex};

use vmm_arena::layout::{BlockTable, ChunkLayout, KvGeometry};
use vmm_arena::{Arena, ArenaConfig, Backend, Error, Id, MoveEvent};

const MIB: u64 = 1 << 20;
const LLAMA_8B: KvGeometry = KvGeometry { layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2 };

/// The marker written for `token`'s key (`value: false`) or value in `layer`.
fn marker(token: u64, layer: u32, value: bool) -> u64 {
    token * 1000 + layer as u64 * 2 + value as u64
}

/// The rows checked: the first and last token of each block, in the first
/// layer's keys and the last layer's values.
fn probes(layout: &ChunkLayout, tokens: u64) -> Vec<(u64, u32, bool)> {
    let last = layout.geometry().layers - 1;
    (0..tokens)
        .filter(|t| t % layout.block_tokens() == 0 || t % layout.block_tokens() == layout.block_tokens() - 1)
        .flat_map(|t| [(t, 0, false), (t, last, true)])
        .collect()
}

fn write_markers(arena: &Arena, kv: Id, layout: &ChunkLayout, tokens: Range<u64>) {
    for (t, layer, value) in probes(layout, tokens.end).into_iter().filter(|p| tokens.contains(&p.0)) {
        let off = layout.token_offset(layer, value, t).unwrap();
        arena.write(kv, off, &marker(t, layer, value).to_le_bytes()).unwrap();
    }
}

/// Reads every marker through the block table: the address a paged kernel
/// computes, `base + table[t / block_tokens] × chunk + slab + row`.
fn check_through_table(arena: &Arena, table: &BlockTable, layout: &ChunkLayout, tokens: u64) {
    let (base, _) = arena.va_range();
    let row = layout.geometry().row_bytes();
    for (t, layer, value) in probes(layout, tokens) {
        let slab = if value { layout.v_offset(layer) } else { layout.k_offset(layer) }.unwrap();
        let block = table.blocks()[(t / layout.block_tokens()) as usize] as u64;
        let addr = base + block * layout.chunk_bytes() + slab + (t % layout.block_tokens()) * row;
        // SAFETY: host backend: the table's chunks are the live allocation's
        // mapped pages (checked against `query` before every call), the row
        // lies inside its chunk, and this thread is the arena's only user.
        let got = unsafe { (addr as *const u64).read_unaligned() };
        assert_eq!(got, marker(t, layer, value), "token {t} layer {layer} value {value} through block {block}");
    }
}

/// The table a fresh query gives: what the maintained one must equal.
fn expected(arena: &Arena, kv: Id) -> Vec<u32> {
    BlockTable::new(arena, kv).unwrap().blocks().to_vec()
}

fn scenario(chunk: u64) {
    let arena = Arena::new(ArenaConfig {
        backend: Backend::HostSparse,
        capacity_bytes: 24 * chunk,
        reserve_bytes: 24 * chunk,
        chunk_bytes: chunk,
        ..Default::default()
    })
    .unwrap();
    let layout = ChunkLayout::for_arena(&arena, LLAMA_8B).unwrap();
    assert_eq!(layout.block_tokens(), 16 * chunk / (2 * MIB));
    let bt = layout.block_tokens();

    let (filler, _) = arena.alloc(4 * chunk).unwrap(); // pages 0..4
    let mut tokens = 2 * bt + 1;
    let size = layout.bytes_for_tokens(tokens).unwrap();
    let (kv, ptr) = arena.alloc_growable(size, size).unwrap(); // pages 4..7
    let (_neighbour, _) = arena.alloc(chunk).unwrap(); // page 7
    let table = Arc::new(Mutex::new(BlockTable::new(&arena, kv).unwrap()));
    let changes: Arc<Mutex<Vec<Range<usize>>>> = Arc::default();
    {
        let (table, changes) = (table.clone(), changes.clone());
        arena
            .set_move_callback(Some(Box::new(move |e: &MoveEvent| {
                let r = table.lock().unwrap().on_move(e).unwrap();
                if !r.is_empty() {
                    changes.lock().unwrap().push(r);
                }
            })))
            .unwrap();
    }
    let (base, _) = arena.va_range();
    assert_eq!(table.lock().unwrap().blocks(), &[4, 5, 6]);
    assert_eq!(ptr, base + 4 * chunk);
    write_markers(&arena, kv, &layout, 0..tokens);
    check_through_table(&arena, &table.lock().unwrap(), &layout, tokens);

    // Compaction moves the neighbour to page 0 and the cache to 1..4.
    arena.free(filler).unwrap();
    let report = arena.compact().unwrap();
    assert_eq!(report.moved_allocations, 2);
    assert_eq!(changes.lock().unwrap().drain(..).collect::<Vec<_>>(), std::iter::once(0..3).collect::<Vec<_>>());
    assert_eq!(table.lock().unwrap().blocks(), &[1, 2, 3]);
    assert_eq!(table.lock().unwrap().blocks(), expected(&arena, kv));
    check_through_table(&arena, &table.lock().unwrap(), &layout, tokens);

    // Growth past the reservation with a wall after it: the cache moves
    // (reported with its new size), and refresh finds nothing more to change.
    let (_wall, _) = arena.alloc(chunk).unwrap(); // page 4
    tokens = 5 * bt + 3;
    let grown = arena.resize(kv, layout.bytes_for_tokens(tokens).unwrap()).unwrap();
    assert_ne!(grown, base + chunk, "the cache moved");
    assert_eq!(changes.lock().unwrap().drain(..).collect::<Vec<_>>(), std::iter::once(0..6).collect::<Vec<_>>());
    assert_eq!(table.lock().unwrap().refresh(&arena).unwrap(), 6..6);
    assert_eq!(table.lock().unwrap().blocks(), expected(&arena, kv));
    write_markers(&arena, kv, &layout, 2 * bt + 1..tokens);
    check_through_table(&arena, &table.lock().unwrap(), &layout, tokens);
    arena.release_retired().unwrap();
    check_through_table(&arena, &table.lock().unwrap(), &layout, tokens);

    // Growth in place: one block appended, no move reported.
    let first = table.lock().unwrap().blocks()[0];
    tokens = 6 * bt + 2;
    assert_eq!(arena.resize(kv, layout.bytes_for_tokens(tokens).unwrap()).unwrap(), grown);
    assert_eq!(table.lock().unwrap().refresh(&arena).unwrap(), 6..7);
    assert!(changes.lock().unwrap().is_empty());
    let blocks = table.lock().unwrap().blocks().to_vec();
    assert_eq!(blocks, (first..first + 7).collect::<Vec<_>>());
    assert_eq!(blocks, expected(&arena, kv));
    write_markers(&arena, kv, &layout, 5 * bt + 3..tokens);
    check_through_table(&arena, &table.lock().unwrap(), &layout, tokens);

    // Shrinking: entries go, none changes.
    tokens = 2 * bt;
    arena.resize(kv, layout.bytes_for_tokens(tokens).unwrap()).unwrap();
    assert_eq!(table.lock().unwrap().refresh(&arena).unwrap(), 2..2);
    assert_eq!(table.lock().unwrap().len(), 2);
    check_through_table(&arena, &table.lock().unwrap(), &layout, tokens);
}

#[test]
fn block_table_follows_compaction_growth_and_moves() {
    scenario(2 * MIB);
}

/// Super-pages: the same with 4, 8, 16 and 20 MiB chunks (block sizes of
/// 32, 64, 128 and 160 tokens for this geometry).
#[test]
fn block_table_follows_moves_with_super_pages() {
    for mib in [4, 8, 16, 20] {
        scenario(mib * MIB);
    }
}

#[test]
fn refuses_allocations_that_are_not_whole_chunks() {
    let arena = Arena::new(ArenaConfig { capacity_bytes: 16 * MIB, ..Default::default() }).unwrap();
    // Objects in a slab share its chunk, the first one (chunk-aligned) too.
    for _ in 0..2 {
        let (small, _) = arena.alloc(4096).unwrap();
        assert!(matches!(BlockTable::new(&arena, small), Err(Error::InvalidArgument(_))));
    }
    let (kv, _) = arena.alloc(2 * MIB).unwrap();
    let mut t = BlockTable::new(&arena, kv).unwrap();
    arena.free(kv).unwrap();
    assert!(matches!(t.refresh(&arena), Err(Error::UnknownAllocation(_))));
    assert_eq!(t.len(), 1, "a failed refresh leaves the table");
    let other = Arena::new(ArenaConfig { capacity_bytes: 16 * MIB, ..Default::default() }).unwrap();
    assert!(matches!(t.refresh(&other), Err(Error::InvalidArgument(_))));
}
