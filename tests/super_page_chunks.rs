//! Super-pages: chunks of 2, 4, 8, 16 and 20 MiB (the sizes the replay's
//! `--chunk-mib` measures; 20 MiB is not a power of two) on the host
//! backend, and the block-in-chunk layout's geometry at each size.

use vmm_arena::driver::host::{HostDriver, HostOptions};
use vmm_arena::layout::{ChunkLayout, KvGeometry};
use vmm_arena::{Arena, ArenaConfig};

const MIB: u64 = 1 << 20;
const SIZES_MIB: [u64; 5] = [2, 4, 8, 16, 20];

/// Llama-3-8B: 32 layers, 8 KV heads of 128, bf16 (128 KiB a token).
const LLAMA3_8B: KvGeometry = KvGeometry { layers: 32, kv_heads: 8, head_dim: 128, dtype_bytes: 2 };

fn arena(chunk: u64) -> Arena {
    let host = HostDriver::with_options(HostOptions { sparse: true }).unwrap();
    let cfg =
        ArenaConfig { capacity_bytes: 6 * chunk, reserve_bytes: 16 * chunk, chunk_bytes: chunk, ..Default::default() };
    Arena::with_driver(host, cfg).unwrap()
}

#[test]
#[cfg_attr(miri, ignore)] // host backend: system calls
fn every_super_page_size_allocates_grows_moves_and_gives_back() {
    for mib in SIZES_MIB {
        let c = mib * MIB;
        let a = arena(c);
        assert_eq!(a.chunk_bytes(), c, "{mib} MiB");
        let (base, len) = a.va_range();
        assert_eq!((base % c, len % c), (0, 0), "{mib} MiB: the range is chunk-aligned");

        // A growable KV tensor: grown a token at a time past a chunk, it
        // maps whole chunks and keeps its bytes.
        let (x, px) = a.alloc_growable(128 << 10, 4 * c).unwrap();
        assert_eq!(px % c, 0, "{mib} MiB");
        a.write(x, 0, b"head").unwrap();
        a.resize(x, c + 4).unwrap();
        a.write(x, c, b"next").unwrap();
        assert_eq!(a.stats().unwrap().mapped_bytes, 2 * c, "{mib} MiB: two whole chunks mapped");

        // Another allocation blocks in-place growth: x moves, its bytes follow.
        let (y, _) = a.alloc(c).unwrap();
        a.write(y, c - 4, b"tail").unwrap();
        a.resize(x, 3 * c).unwrap();
        let mut buf = [0u8; 4];
        a.read(x, 0, &mut buf).unwrap();
        assert_eq!(&buf, b"head", "{mib} MiB");
        a.read(x, c, &mut buf).unwrap();
        assert_eq!(&buf, b"next", "{mib} MiB");
        a.read(y, c - 4, &mut buf).unwrap();
        assert_eq!(&buf, b"tail", "{mib} MiB");

        // Past the capacity (6 chunks: 3 + 1 live): refused, nothing changes.
        let before = a.stats().unwrap();
        assert!(a.resize(x, 6 * c).is_err(), "{mib} MiB: over capacity");
        let after = a.stats().unwrap();
        assert_eq!((before.live_bytes, before.mapped_bytes), (after.live_bytes, after.mapped_bytes));

        a.free(x).unwrap();
        a.free(y).unwrap();
        let s = a.stats().unwrap();
        assert_eq!((s.live_allocations, s.live_bytes), (0, 0), "{mib} MiB");
    }
}

#[test]
fn block_in_chunk_holds_sixteen_tokens_per_two_mib_at_every_size() {
    for mib in SIZES_MIB {
        let l = ChunkLayout::new(LLAMA3_8B, mib * MIB).unwrap();
        assert_eq!(l.block_tokens(), 8 * mib, "{mib} MiB: 128 KiB tokens fill the chunk");
        assert_eq!(l.unused_bytes(), 0, "{mib} MiB: nothing left over");
        // A 1,024-token prompt plus its first token rounds to whole chunks.
        assert_eq!(l.blocks_for_tokens(1025), 1025u64.div_ceil(8 * mib), "{mib} MiB");
        let last = l.token_offset(31, true, 8 * mib - 1).unwrap();
        assert!(last < mib * MIB, "{mib} MiB: the last token's last value lies inside the chunk");
    }
}
