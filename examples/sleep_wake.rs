//! Sleep and wake: an inference tenant gives its memory back while a
//! trainer uses it, then gets its weights back at the same addresses.
//!
//! `cargo run --example sleep_wake` runs on the host backend. On CUDA the
//! backups are page-locked host buffers and the copies are device copies.

use vmm_arena::{Arena, ArenaConfig, Backend, Error, SLEEP_BACKUP};

const MIB: u64 = 1 << 20;
const WEIGHTS: u32 = 1;
const KV: u32 = 2;

fn main() -> Result<(), Error> {
    let arena = Arena::new(ArenaConfig { backend: Backend::Host, capacity_bytes: 128 * MIB, ..Default::default() })?;

    // The tenant: weights (kept across the sleep) and a KV cache (dropped).
    let (w, w_ptr) = arena.alloc(40 * MIB)?;
    arena.set_tag(w, WEIGHTS)?;
    let pattern: Vec<u8> = (0..40 * MIB).map(|i| (i % 251) as u8).collect();
    arena.write(w, 0, &pattern)?;
    let (kv, kv_ptr) = arena.alloc_growable(32 * MIB, 64 * MIB)?;
    arena.set_tag(kv, KV)?;
    println!("tenant holds {} MiB", arena.stats()?.mapped_bytes / MIB);

    // Sleep: the KV's chunks go back to the driver, its bytes are dropped;
    // the weights are copied to host memory first. The allocations keep
    // their ids and addresses (the addresses are not backed while asleep).
    arena.sleep(KV, 0)?;
    arena.sleep(WEIGHTS, SLEEP_BACKUP)?;
    arena.trim(0)?; // give back what the pool kept too
    let s = arena.stats()?;
    println!(
        "asleep: {} MiB mapped, {} MiB held by the arena",
        s.mapped_bytes / MIB,
        (s.mapped_bytes + s.pooled_bytes) / MIB
    );

    // The trainer uses the whole capacity through the same arena.
    let (t, _) = arena.alloc(120 * MIB)?;
    arena.write(t, 0, &[7u8; 4096])?;
    arena.free(t)?;
    println!("trainer used 120 MiB and freed it");

    // Wake: chunks mapped at the old addresses again, the weights' bytes
    // copied back; the KV comes back at its old address with whatever the
    // driver gives (its bytes were dropped: the engine recomputes them).
    arena.wake(WEIGHTS)?;
    arena.wake(KV)?;
    assert_eq!(arena.query(w)?.ptr, w_ptr);
    assert_eq!(arena.query(kv)?.ptr, kv_ptr);
    let mut back = vec![0u8; pattern.len()];
    arena.read(w, 0, &mut back)?;
    assert!(back == pattern, "the weights came back byte for byte");
    println!("awake: weights intact at {w_ptr:#x}, KV back at {kv_ptr:#x}");

    arena.free(kv)?;
    arena.free(w)?;
    Ok(())
}
