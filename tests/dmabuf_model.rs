//! Property test: DMA-BUF handles (on the host backend's stand-in) opened
//! and closed among random allocs, frees, resizes, sleeps and wakes,
//! compactions, trims and releases of retired memory, against a simple
//! model of what each open DMA-BUF must reach:
//! - while its allocation lives, a DMA-BUF reads exactly the allocation's
//!   bytes (it reaches the same chunks, which never move, sleep or shrink
//!   below it while it is open), and a write through it is seen through
//!   the allocation;
//! - once its allocation is freed, it keeps reading the bytes it had at the
//!   free, whatever the next allocations write (its chunks are never
//!   pooled or reused), and a write through it changes no live allocation;
//! - every allocation's own bytes (stamped through the arena) survive every
//!   operation;
//! - when every DMA-BUF is closed and everything freed and trimmed, the
//!   driver holds no chunk and no mapping;
//! - prepared resizes and frees committed or aborted at once succeed,
//!   whatever driver call fails, and any operation with an injected driver
//!   failure leaves the arena as it was.
//!
//! The model is `tests/common/dmabuf_harness.rs`, shared with the `ops`
//! fuzz target's DMA-BUF inputs.
//!
//! Each operation also runs the debug build's audit of who holds each chunk
//! (`arena/holds.rs`).

mod common;
#[path = "common/dmabuf_harness.rs"]
mod dmabuf_harness;

use dmabuf_harness::{DmaHarness, DmaOp as Op, C};
use proptest::prelude::*;
use vmm_arena::driver::fault::FaultKind;

fn plain() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1..=4u64).prop_map(|p| Op::Alloc(p * C)),
        1 => (1..C / 2).prop_map(Op::AllocSmall),
        2 => (1..=3u64, 0..=4u64).prop_map(|(p, e)| Op::AllocGrowable(p * C, (p + e) * C)),
        3 => any::<usize>().prop_map(Op::Free),
        3 => (any::<usize>(), 1..=6u64).prop_map(|(i, p)| Op::Resize(i, p * C)),
        3 => any::<usize>().prop_map(Op::Open),
        2 => any::<usize>().prop_map(Op::Close),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(i, s)| Op::WriteThrough(i, s)),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(i, s)| Op::Stamp(i, s)),
        1 => any::<bool>().prop_map(Op::Sleep),
        1 => Just(Op::Wake),
        1 => Just(Op::Compact),
        1 => Just(Op::Trim),
        1 => Just(Op::ReleaseRetired),
        1 => (any::<usize>(), 1..=6u64, any::<bool>()).prop_map(|(i, p, c)| Op::PrepareResize(i, p * C, c)),
        1 => (any::<usize>(), any::<bool>()).prop_map(|(i, c)| Op::PrepareFree(i, c)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => plain(),
        1 => (1..=6u64, any::<bool>(), plain()).prop_map(|(n, oom, op)| {
            let kind = if oom { FaultKind::OutOfMemory } else { FaultKind::Driver };
            Op::Faulty(n, kind, Box::new(op))
        }),
    ]
}

fn run(ops: Vec<Op>) {
    let mut h = DmaHarness::new(24, 40, 4);
    for op in &ops {
        h.apply(op);
    }
    h.teardown();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn dmabufs_reach_their_allocations_bytes_and_nothing_else(ops in prop::collection::vec(op(), 1..60)) {
        run(ops);
    }
}

/// The free of an allocation that had a DMA-BUF gives its chunks back to
/// the driver (never to the pool); a release that fails there is retried by
/// `trim`, not kept until the arena is dropped.
#[test]
fn a_failed_release_of_a_freed_dmabuf_allocation_is_retried_by_trim() {
    run(vec![
        Op::Alloc(C),
        Op::Alloc(2 * C),
        Op::Open(1),
        Op::Close(0),
        // Unmap 2 pages, then release the first chunk: that release fails.
        Op::Faulty(3, FaultKind::Driver, Box::new(Op::Free(1))),
    ]);
}
