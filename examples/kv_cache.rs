//! A growable KV cache: one growable allocation per request, grown as the
//! request decodes, moved by remapping when its reservation runs out, and
//! freed on the engine's stream.
//!
//! `cargo run --example kv_cache` runs it on the host backend (no GPU). On
//! a GPU machine, set `backend: Backend::Cuda` and pass the engine's CUDA
//! stream (its `CUstream` as a `u64`) to `free_on_stream`; the rest is the
//! same.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use vmm_arena::{Arena, ArenaConfig, Backend, Error, Id};

const MIB: u64 = 1 << 20;
/// KV bytes per token of llama3-8b (32 layers, K and V, 8 heads of 128, bf16).
const KV_PER_TOKEN: u64 = 128 << 10;
/// The engine's stream (0: the default stream; on the host backend a free
/// on the stream is a plain free).
const STREAM: u64 = 0;

fn main() -> Result<(), Error> {
    let arena = Arena::new(ArenaConfig { backend: Backend::Host, capacity_bytes: 256 * MIB, ..Default::default() })?;

    // The engine's table of KV pointers, kept right by the move callback
    // (it runs under the arena's lock: quick, and no call into the arena).
    let ptrs: Arc<Mutex<HashMap<Id, u64>>> = Arc::default();
    let table = Arc::clone(&ptrs);
    arena.set_move_callback(Some(Box::new(move |m| {
        table.lock().unwrap().insert(m.id, m.new_ptr);
    })))?;

    // Admission: back the prompt's KV, reserve room for 256 more tokens.
    let prompt_tokens = 100;
    let (kv, ptr) = arena.alloc_growable(prompt_tokens * KV_PER_TOKEN, (prompt_tokens + 256) * KV_PER_TOKEN)?;
    ptrs.lock().unwrap().insert(kv, ptr);
    for t in 0..prompt_tokens {
        arena.write(kv, t * KV_PER_TOKEN, &t.to_le_bytes())?;
    }
    println!("admitted: {} tokens at {ptr:#x}", prompt_tokens);

    // Decode: one token a step. Growth inside the reservation maps chunks
    // after the backed ones; the address never changes.
    let mut tokens = prompt_tokens;
    for _ in 0..256 {
        let at = arena.resize(kv, (tokens + 1) * KV_PER_TOKEN)?;
        assert_eq!(at, ptr, "growth inside the reservation is in place");
        arena.write(kv, tokens * KV_PER_TOKEN, &tokens.to_le_bytes())?;
        tokens += 1;
    }
    println!("decoded to {tokens} tokens in place ({} MiB backed)", arena.query(kv)?.mapped_bytes / MIB);

    // A neighbour allocated now takes the address space after the
    // reservation, so growing past the reservation moves the allocation: the same chunks are mapped
    // at a new address, no byte copied, and the callback is told.
    let (neighbour, _) = arena.alloc(64 * MIB)?;
    let moved_to = arena.resize(kv, (tokens + 512) * KV_PER_TOKEN)?;
    let known = ptrs.lock().unwrap()[&kv];
    println!("grew past the reservation: {ptr:#x} -> {moved_to:#x} (callback saw {known:#x})");
    assert_ne!(moved_to, ptr, "growth past the reservation moved");
    assert_eq!(known, moved_to);

    // Every token's KV is still there.
    for t in 0..tokens {
        let mut b = [0u8; 8];
        arena.read(kv, t * KV_PER_TOKEN, &mut b)?;
        assert_eq!(u64::from_le_bytes(b), t, "token {t}");
    }

    // The request ends: free on the stream that last used the KV. On CUDA
    // the chunks are reused once the stream's work up to here is done,
    // without a device synchronize.
    arena.free_on_stream(kv, STREAM)?;
    arena.free(neighbour)?;
    ptrs.lock().unwrap().remove(&kv);
    let s = arena.stats()?;
    println!(
        "freed: {} live allocations, {} MiB pooled for the next request",
        s.live_allocations,
        s.pooled_bytes / MIB
    );
    Ok(())
}
