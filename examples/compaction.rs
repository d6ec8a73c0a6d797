//! Compaction and a snapshot: fragment the address space, see a large
//! allocation refused, compact (allocations move by remapping), and write
//! the arena's layout as JSON.
//!
//! `cargo run --example compaction [-- SNAPSHOT.json]` runs on the host
//! backend; `cargo run --release -p vmm-sim --bin snapshot_svg -- SNAPSHOT.json`
//! draws the snapshot as SVG.

use vmm_arena::{Arena, ArenaConfig, Backend, Error};

const MIB: u64 = 1 << 20;

fn main() -> Result<(), Error> {
    // A virtual range no larger than the capacity, and no implicit moves:
    // the address space fragments, and only `compact` moves.
    let arena = Arena::new(ArenaConfig {
        backend: Backend::Host,
        capacity_bytes: 64 * MIB,
        reserve_bytes: 64 * MIB,
        no_implicit_moves: true,
        ..Default::default()
    })?;

    // Fill with 4 MiB allocations, then free every other one: half the
    // memory is free, in 4 MiB holes.
    let mut ids = Vec::new();
    while let Ok((id, _)) = arena.alloc(4 * MIB) {
        ids.push(id);
    }
    for id in ids.iter().step_by(2) {
        arena.free(*id)?;
    }
    let s = arena.stats()?;
    println!(
        "{} allocations, {} MiB free in holes of at most {} MiB",
        s.live_allocations,
        s.free_va_bytes / MIB,
        s.largest_free_va_bytes / MIB
    );

    // 16 MiB fits the free memory but no hole.
    match arena.alloc(16 * MIB) {
        Err(e) => println!("16 MiB before compaction: {e}"),
        Ok(_) => panic!("the holes are 4 MiB: a 16 MiB allocation cannot fit"),
    }

    // Compaction slides the live allocations together by remapping their
    // chunks (each move would reach the move callback, if one were set).
    let report = arena.compact()?;
    println!(
        "compact: {} allocations moved ({} MiB remapped), largest hole {} -> {} MiB",
        report.moved_allocations,
        report.moved_bytes / MIB,
        report.largest_free_va_before / MIB,
        report.largest_free_va_after / MIB
    );
    let (big, ptr) = arena.alloc(16 * MIB)?;
    println!("16 MiB after compaction: at {ptr:#x}");

    // The layout: every range of the virtual space, what holds it, and the
    // stats, as JSON.
    let json = arena.snapshot_json()?;
    match std::env::args().nth(1) {
        Some(path) => {
            std::fs::write(&path, &json).expect("the snapshot file is writable");
            println!("snapshot written to {path} ({} bytes)", json.len());
        }
        None => println!("snapshot: {} bytes of JSON (pass a path to keep it)", json.len()),
    }
    arena.free(big)?;
    Ok(())
}
