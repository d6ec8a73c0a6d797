//! A paged KV cache over the arena: an engine's block pool in which each
//! block is one chunk, read by a paged-attention kernel through a block
//! table of chunk numbers (the block-in-chunk layout). A request's blocks
//! need not be contiguous, so a chunk is used where it lies: once the pool
//! has served its peak, admitting, growing and finishing requests makes no
//! driver call, and memory the pool no longer needs goes back on `trim`.
//! (DESIGN.md, "A block table over chunks"; the replay's `arena-paged` row.)
//!
//! `cargo run --example block_pool` runs it on the host backend (no GPU).

use vmm_arena::layout::{ChunkLayout, KvGeometry};
use vmm_arena::{Arena, ArenaConfig, Backend, Error, Id};

const MIB: u64 = 1 << 20;

/// A block: its allocation and its block-table entry (the chunk's number
/// from the arena's base).
struct Block {
    id: Id,
    chunk: u32,
}

struct Pool<'a> {
    arena: &'a Arena,
    layout: ChunkLayout,
}

impl Pool<'_> {
    /// A block for one request: a chunk the arena holds mapped at a free
    /// address is adopted where it lies; only a pool that never held this
    /// many blocks creates one.
    fn take(&self) -> Result<Block, Error> {
        let (id, ptr) = self.arena.alloc(self.layout.chunk_bytes())?;
        let chunk = (ptr - self.arena.va_range().0) / self.layout.chunk_bytes();
        Ok(Block { id, chunk: chunk as u32 })
    }

    /// All KV work is on the engine's one stream, which orders the chunk's
    /// next owner after this one's queued reads: a plain free (with KV read
    /// on a second stream, `free_on_stream` instead).
    fn give_back(&self, b: Block) -> Result<(), Error> {
        self.arena.free(b.id)
    }

    /// Writes the key row of `token` of `layer` where the kernel reads it.
    fn write_key(&self, table: &[Block], layer: u32, token: u64, row: &[u8]) -> Result<(), Error> {
        let block = &table[(token / self.layout.block_tokens()) as usize];
        let within = self.layout.token_offset(layer, false, token % self.layout.block_tokens())?;
        self.arena.write(block.id, within, row)
    }
}

fn driver_calls(arena: &Arena) -> Result<u64, Error> {
    let s = arena.stats()?;
    Ok(s.driver_creates + s.driver_maps + s.driver_unmaps + s.driver_releases + s.driver_access_calls)
}

/// Admits requests of `prompts` tokens, decodes `decode` tokens each, and
/// finishes them; returns the most blocks held at once.
fn serve(pool: &Pool, prompts: &[u64], decode: u64) -> Result<usize, Error> {
    let bt = pool.layout.block_tokens();
    let mut tables: Vec<(Vec<Block>, u64)> = Vec::new();
    for &p in prompts {
        let table = (0..p.div_ceil(bt)).map(|_| pool.take()).collect::<Result<Vec<_>, _>>()?;
        for t in 0..p {
            pool.write_key(&table, 0, t, &t.to_le_bytes())?;
        }
        tables.push((table, p));
    }
    let mut peak: usize = tables.iter().map(|(t, _)| t.len()).sum();
    for _ in 0..decode {
        for (table, tokens) in &mut tables {
            if *tokens % bt == 0 {
                table.push(pool.take()?); // a new block every 16 tokens
            }
            pool.write_key(table, 0, *tokens, &tokens.to_le_bytes())?;
            *tokens += 1;
        }
        peak = peak.max(tables.iter().map(|(t, _)| t.len()).sum::<usize>());
    }
    if let Some((table, _)) = tables.first() {
        let entries: Vec<u32> = table.iter().take(8).map(|b| b.chunk).collect();
        println!("  first request's block table (first 8 entries): {entries:?}");
    }
    for (table, _) in tables {
        for b in table {
            pool.give_back(b)?;
        }
    }
    Ok(peak)
}

fn main() -> Result<(), Error> {
    let arena = Arena::new(ArenaConfig { backend: Backend::Host, capacity_bytes: 512 * MIB, ..Default::default() })?;
    // Llama-3-8B: 32 layers, 8 KV heads of 128, bf16: 16 tokens a 2 MiB chunk.
    let geometry = KvGeometry { layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2 };
    let layout = ChunkLayout::for_arena(&arena, geometry)?;
    println!(
        "block-in-chunk: {} tokens a {} MiB block, layer 1's keys at +{} KiB, {} bytes unused",
        layout.block_tokens(),
        layout.chunk_bytes() / MIB,
        layout.k_offset(1)? >> 10,
        layout.unused_bytes()
    );
    let pool = Pool { arena: &arena, layout };

    let first = [300, 120, 700, 64];
    let peak = serve(&pool, &first, 100)?;
    let cold = driver_calls(&arena)?;
    println!("first wave: {peak} blocks at its peak, {cold} driver calls (each chunk created and mapped once)");

    // Other requests, in a different order, needing no more blocks at once:
    // every block is a chunk already mapped, adopted where it lies.
    let second = [500, 80, 200, 300, 40];
    let peak2 = serve(&pool, &second, 60)?;
    let warm = driver_calls(&arena)? - cold;
    println!("second wave: {peak2} blocks at its peak, {warm} driver calls");
    assert!(peak2 <= peak);
    assert_eq!(warm, 0, "a warm pool makes no driver call");

    // Memory goes back to the driver when the engine asks.
    let given = arena.trim(0)?;
    println!("trim: {} MiB given back, {} MiB still pooled", given / MIB, arena.stats()?.pooled_bytes / MIB);
    Ok(())
}
