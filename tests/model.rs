//! Property test: random operation sequences against a simple model.
//!
//! Each case builds a small arena (64 KiB chunks, a few dozen of them, so
//! that capacity and address space run short and compaction happens) on the
//! host backend or on the in-memory mock, runs a random sequence of every
//! public operation, and after each one checks what the model
//! (`tests/common/harness/`, shared with the `ops` fuzz target) says,
//! among which:
//! - the snapshot's ranges tile the reserved range (live ranges never
//!   overlap and lie inside it) and the stats agree with them and with the
//!   model (live allocations, live bytes, mapped bytes = whole chunks of each
//!   size, mapped + pooled <= capacity, free and largest free VA);
//! - every live allocation's stamped bytes survive every resize, move and
//!   compaction, read through the arena and, on the host, through the raw
//!   pointer;
//! - out-of-memory exactly when the request exceeds capacity minus mapped;
//!   out-of-address-space, with implicit moves allowed, only when no window
//!   can be evacuated (a brute-force oracle, `common::evacuation_exists`)
//!   and, for a resize, neither can the pages after the allocation (so it
//!   would grow in place); with them disallowed only when no free range fits;
//! - PINNED only when a pinned allocation can grow neither into free or
//!   retired pages nor by its unpinned neighbours moving away; growth into
//!   free or retired pages never moves the allocation;
//! - pinned allocations never move; with `no_implicit_moves` nothing but the
//!   resized allocation moves during alloc and resize; a slab is pinned
//!   exactly while one of its objects is;
//! - the old address of a moved allocation stays readable (on the host,
//!   through the raw pointer) until retired memory is released, which only
//!   alloc, resize, compact and `release_retired` may do (`free` and `trim`
//!   with any retain watermark never release a live allocation's old range);
//! - adoption in place (host and mock): an allocation whose reservation
//!   lies in a free range of cached chunks, and a growth within a
//!   reservation whose tail is all cached chunks, make no driver call (but
//!   the give-back of pooled memory left over the retain watermark by an
//!   earlier failed one);
//! - `compact` reports as moved allocations exactly the moves it made;
//! - the move callback's events chain each moved allocation from its old
//!   address to its new one, and their count is the `moves` stat's increase;
//! - `resize_on_stream` resizes exactly as `resize` (its model) on the
//!   host and on the mock, and its `stream_shrinks` stays 0 there;
//! - `quiesce_on_stream`: `Ok` awake, `Asleep` asleep; `quiesces` counts
//!   nothing on the host and the mock (and never a small allocation's or a
//!   repeated call's); the harness writes nothing through a quiesced
//!   allocation until it grows or is unquiesced (`unquiesce`); every check
//!   above still holds after it; a
//!   free or shrink of a quiesced allocation leaves its unshared pages
//!   known idle (`idle_cached_bytes`), of any other allocation none;
//! - `resize_many`: all or nothing, every byte included (after a failed
//!   batch, injected or refused, the arena is exactly as it was and every
//!   allocation's stamps are read);
//! - the retain watermark: `pooled_bytes <= retain_bytes` after every
//!   operation and `pooled_bytes <= keep_bytes` after a `trim`, slabs of
//!   retired objects included (they are pooled);
//! - `maintain` with prefetch targets, the stats read inside its driver
//!   calls made without the lock (as another thread could read them):
//!   `peak_physical_bytes` never goes down, the watermark and the capacity
//!   hold;
//! - two-phase operations (prepare, then commit or abort) interleaved with
//!   every other operation: a prepare's outcome as predicted; after a
//!   successful prepare and no other call on its allocation, commit and
//!   abort succeed whatever driver call fails; after one, `Stale` with
//!   nothing changed;
//! - sharing (`alloc_shared`): reference counts in the model, a shared
//!   chunk counted once, the bytes checked through every holder after
//!   every operation (moves and compaction included), sleep and wake
//!   keeping the contract's sharing rules.
//!
//! `PROPTEST_CASES=1000 cargo test --test model` runs a longer search.
//!
//! On a GPU, `VMM_ARENA_TEST_BACKEND=cuda cargo test --release --test model
//! cuda` runs the same model on device 0 with 2 MiB chunks (sizes are drawn
//! in chunks, so the cases scale). There every byte is checked through
//! `Arena::read`, that is `cuMemcpy`; the raw-pointer reads are host-only.
//! Without the variable that test is skipped; with it and no usable GPU it
//! fails.

mod common;
#[path = "common/harness/mod.rs"]
mod harness;

use std::sync::Arc;

use common::{Snap, CUDA_CHUNK};
use harness::{Backend, Config, Harness, Op, OUTCOMES};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use vmm_arena::driver::fault::FaultKind;
use vmm_arena::driver::host::HostDriver;
use vmm_arena::driver::Driver;
use vmm_arena::{Arena, ArenaConfig, Status};

/// The chunk size on the host and the mock (and in the regressions).
const C: u64 = common::HOST_CHUNK;

fn report(backend: Backend) {
    eprintln!("{backend:?} outcomes over all cases: {:?}", OUTCOMES.lock().unwrap());
}

fn chunk_of(backend: Backend) -> u64 {
    match backend {
        Backend::Host | Backend::Mock => C,
        Backend::Cuda => CUDA_CHUNK,
    }
}

/// A size in bytes of 1..=`max_pages` chunks of `c`, not chunk-aligned in general.
fn size(c: u64, max_pages: u64) -> impl Strategy<Value = u64> {
    (1..=max_pages, 1..=c, 0..4u8).prop_map(move |(p, b, whole)| (p - 1) * c + if whole == 0 { c } else { b })
}

/// Operations on an arena with chunks of `c` (small sizes: up to half a
/// chunk), one in twelve with one of its driver calls failing.
fn op(c: u64) -> impl Strategy<Value = Op> {
    let faulty = prop::option::weighted(1.0 / 12.0, (1..=12u64, any::<bool>()));
    (plain_op(c), faulty).prop_map(|(op, fault)| match fault {
        Some((n, oom)) => {
            let kind = if oom { FaultKind::OutOfMemory } else { FaultKind::Driver };
            Op::Faulty(n, kind, Box::new(op))
        }
        None => op,
    })
}

fn plain_op(c: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => size(c, 8).prop_map(Op::Alloc),
        4 => (1..=c / 2).prop_map(Op::Alloc),
        2 => (1..=c / 2, 0..=2u32).prop_map(|(s, t)| Op::AllocTagged(s, t)),
        1 => size(c, 40).prop_map(Op::Alloc),
        4 => (size(c, 6), 0..=12u64).prop_map(move |(s, extra)| Op::AllocGrowable(s, s + extra * c)),
        5 => any::<usize>().prop_map(Op::Free),
        6 => (any::<usize>(), size(c, 16)).prop_map(|(i, s)| Op::Resize(i, s)),
        3 => (any::<usize>(), 1..=c / 2).prop_map(|(i, s)| Op::Resize(i, s)),
        1 => (any::<usize>(), size(c, 40)).prop_map(|(i, s)| Op::Resize(i, s)),
        // Streams 0..=2: the null, legacy and per-thread default streams,
        // each a valid CUstream on a GPU too (3 would not be).
        3 => (any::<usize>(), size(c, 16), 0..3u64).prop_map(|(i, s, st)| Op::ResizeOnStream(i, s, st)),
        1 => (any::<usize>(), 1..=c / 2, 0..3u64).prop_map(|(i, s, st)| Op::ResizeOnStream(i, s, st)),
        2 => (any::<usize>(), 0..3u64).prop_map(|(i, st)| Op::Quiesce(i, st)),
        1 => any::<usize>().prop_map(Op::Unquiesce),
        2 => any::<usize>().prop_map(Op::Pin),
        2 => any::<usize>().prop_map(Op::Unpin),
        1 => Just(Op::Compact),
        1 => Just(Op::ReleaseRetired),
        1 => (0..8u64).prop_map(Op::Trim),
        2 => any::<usize>().prop_map(Op::Write),
        1 => any::<u64>().prop_map(Op::BadId),
        3 => (any::<usize>(), 0..8u64, 0..8u64, 0..=6u64)
            .prop_map(|(src, first, pages, extra)| Op::AllocShared { src, first, pages, extra }),
        2 => (any::<usize>(), 0..=2u32).prop_map(|(i, t)| Op::SetTag(i, t)),
        2 => (0..=3u32, any::<bool>()).prop_map(|(t, b)| Op::Sleep(t, b)),
        2 => (0..=3u32).prop_map(Op::Wake),
        2 => prop::collection::vec((any::<usize>(), prop_oneof![size(c, 16), 1..=c / 2]), 1..5)
            .prop_map(Op::ResizeMany),
        1 => (0..4u64, 0..4u64).prop_map(|(precreate, ahead)| Op::Maintain { precreate, ahead }),
        // Fixed-size prepares reserve more only now and then (refused).
        2 => (size(c, 6), 0..=6u64, any::<bool>())
            .prop_map(move |(s, extra, g)| Op::PrepareAlloc(s, if g || extra == 6 { s + extra * c } else { s }, g)),
        3 => (any::<usize>(), size(c, 12)).prop_map(|(i, s)| Op::PrepareResize(i, s)),
        1 => any::<usize>().prop_map(Op::PrepareFree),
        4 => (any::<usize>(), any::<bool>()).prop_map(|(i, commit)| Op::Settle(i, commit)),
    ]
}

fn config() -> impl Strategy<Value = Config> {
    (
        16..=48u64,
        0..=3u64,
        prop_oneof![Just(None), Just(Some(0)), Just(Some(1)), Just(Some(4))],
        prop::bool::weighted(0.2),
    )
        .prop_flat_map(|(cap, r, retain, nim)| {
            // Reservation from a bit under the capacity to twice it.
            let lo = cap * 3 / 4;
            (lo..=cap * 2).prop_map(move |reserve| Config {
                cap_pages: cap,
                reserve_pages: if r == 0 { cap * 2 } else { reserve },
                retain_pages: retain,
                no_implicit_moves: nim,
            })
        })
}

fn run(backend: Backend, cfg: Config, ops: Vec<Op>) {
    let cuda: Option<Arc<dyn Driver>> = (backend == Backend::Cuda).then(|| common::cuda_device() as Arc<dyn Driver>);
    let mut h = Harness::new(backend, chunk_of(backend), cfg, cuda);
    for op in &ops {
        h.apply(op);
    }
    // Tear down: free everything, trim; the arena is empty again.
    h.teardown();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn host_backend_matches_the_model(cfg in config(), ops in prop::collection::vec(op(C), 1..80)) {
        run(Backend::Host, cfg, ops);
    }

    #[test]
    fn mock_backend_matches_the_model(cfg in config(), ops in prop::collection::vec(op(C), 1..80)) {
        run(Backend::Mock, cfg, ops);
    }
}

/// The model on device 0, with 2 MiB chunks: arenas of 16 to 48 of them
/// (at most 96 MiB), fewer cases than on the host (each costs thousands of
/// `cuMemcpy` calls); `PROPTEST_CASES` overrides the count here too. Runs
/// only with `VMM_ARENA_TEST_BACKEND=cuda`.
#[test]
fn cuda_backend_matches_the_model() {
    if !common::cuda_selected("cuda_backend_matches_the_model") {
        return;
    }
    // Once, here: a missing GPU fails the test plainly, not as a case to shrink.
    common::cuda_device();
    proptest!(
        ProptestConfig { cases: 16, ..ProptestConfig::default() },
        |(cfg in config(), ops in prop::collection::vec(op(CUDA_CHUNK), 1..80))| {
            run(Backend::Cuda, cfg, ops);
        }
    );
    // Alone in the process (filtered by name), the counters are CUDA's only.
    report(Backend::Cuda);
}

#[test]
fn outcomes_are_reached() {
    // A fixed-seed search that checks the generator reaches every
    // interesting path (counters are shared with the property tests when
    // they run in the same process, which only adds to them).
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = (config(), prop::collection::vec(op(C), 40..80));
    for _ in 0..128 {
        let (cfg, ops) = strategy.new_tree(&mut runner).unwrap().current();
        run(Backend::Mock, cfg, ops);
    }
    report(Backend::Mock);
    let seen = OUTCOMES.lock().unwrap();
    for what in [
        "alloc ok, after moving others",
        "alloc out of address space",
        "alloc out of memory",
        "compact moved",
        "resize by moving",
        "resize small by copying",
        "alloc small ok",
        "alloc adopted cached chunks in place",
        "growth adopted its cached tail",
        "resize in place",
        "resize pinned",
        "resize out of address space",
        "resize_on_stream shrank whole chunks",
        "quiesce",
        "quiesce again",
        "quiesce small",
        "free of a quiesced allocation",
        "shrink of a quiesced allocation",
        "quiesced allocation grew",
        "write to a quiesced allocation skipped",
        "unquiesce ended a promise",
        "alloc_shared ok",
        "alloc_shared invalid",
        "free of a sharer",
        "sleep of sharers",
        "sleep kept a chunk an awake allocation maps",
        "resize_many",
        "resize_many out of memory",
        "maintain, read while it ran",
        "sleep of small allocations with backup",
        "set_tag small moved",
        "alloc small tagged",
        "set_tag small refused",
        "prepare_alloc ok",
        "prepare_resize grew",
        "prepare_resize shrink checked",
        "prepare_resize refused",
        "commit alloc",
        "abort alloc",
        "commit growth",
        "abort growth",
        "commit shrink",
        "commit free",
        "abort free",
        "two-phase stale",
    ] {
        assert!(seen.get(what).copied().unwrap_or(0) > 0, "the search never reached: {what}");
    }
}

// ------------------------------------------------------------------------
// Regressions: bugs the property test found, as fixed scenarios.

fn arena(cap_pages: u64, reserve_pages: u64, no_implicit_moves: bool) -> (Arena, Arc<HostDriver>) {
    let d = Arc::new(HostDriver::new().unwrap());
    let cfg = ArenaConfig {
        capacity_bytes: cap_pages * C,
        reserve_bytes: reserve_pages * C,
        chunk_bytes: C,
        no_implicit_moves,
        ..ArenaConfig::default()
    };
    (Arena::with_driver(d.clone(), cfg).unwrap(), d)
}

/// `trim` released chunks that were still mapped at a moved allocation's
/// retired (old) range: the memory did not go back, and a later rollback
/// that had to map the retired range again failed, losing a mapping.
#[test]
fn regression_trim_releases_retired_ranges_that_hold_its_chunks() {
    let (a, d) = arena(8, 8, true);
    let (x, _) = a.alloc_growable(C, C).unwrap();
    let (_y, _) = a.alloc(C).unwrap();
    a.write(x, 0, b"x").unwrap();
    a.resize(x, 2 * C).unwrap(); // moves: page 0 is retired, still mapping x's chunk
    assert_eq!(a.stats().unwrap().retired_va_bytes, C);
    a.free(x).unwrap();
    assert_eq!(a.trim(0).unwrap(), 2 * C);
    let s = a.stats().unwrap();
    assert_eq!((s.retired_va_bytes, s.pooled_bytes), (0, 0), "the retired range went with the chunks");
    assert_eq!(d.allocated_file_bytes().unwrap(), C, "only y's memory is still held");
    assert_eq!((d.live_chunks(), d.live_mappings()), (1, 1));
    // The failing sequence: an alloc that releases retired ranges, then fails
    // and rolls back, must leave the arena consistent.
    let (z, _) = a.alloc_growable(C, C).unwrap();
    a.resize(z, 2 * C).unwrap(); // z moves, its old page is retired
    a.free(z).unwrap();
    a.trim(0).unwrap();
    assert_eq!(a.alloc(7 * C).unwrap_err().status(), Status::OutOfAddressSpace);
    a.release_retired().unwrap();
    let snap = Snap::of(&a);
    snap.check_structure(a.va_range());
    assert_eq!(d.live_mappings() as u64, snap.mapped_pages());
}

/// An allocation whose new reservation held pooled chunks beyond its
/// backed size failed with out-of-memory when the capacity was otherwise
/// used up, though those chunks were obtainable.
#[test]
fn regression_alloc_uses_pooled_chunks_inside_its_own_reservation() {
    let (a, d) = arena(5, 12, false);
    let (x, _) = a.alloc_growable(C, C).unwrap(); // page 0
    let (b, _) = a.alloc(2 * C).unwrap(); // pages 1..3
    let (_c, _) = a.alloc(C).unwrap(); // page 3
    a.resize(x, 2 * C).unwrap(); // x moves to 4..6; page 0 retired
    a.free(b).unwrap(); // pages 1, 2 cached
    a.release_retired().unwrap(); // free [0, 3): page 0 unmapped, 1 and 2 cached
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes, s.capacity_bytes), (3 * C, 2 * C, 5 * C));
    // Best fit puts the reservation of 3 pages at [0, 3): page 0 needs a
    // chunk, and the only ones left are cached in its own tail.
    let (g, ptr) = a.alloc_growable(C, 3 * C).unwrap();
    assert_eq!(ptr, a.va_range().0);
    a.write(g, 0, b"g").unwrap();
    assert_eq!(a.resize(g, 2 * C).unwrap(), ptr);
    assert_eq!(a.stats().unwrap().mapped_bytes, 5 * C);
    assert_eq!(d.live_chunks(), 5);
}

/// Compaction moved an allocation boxed in by pinned neighbours into the
/// largest hole, making the largest free range smaller.
#[test]
fn regression_compaction_never_shrinks_the_largest_free_range() {
    let (a, _d) = arena(8, 8, false);
    let (big, _) = a.alloc(5 * C).unwrap();
    let (p1, _) = a.alloc(C).unwrap();
    let (x, px) = a.alloc(C).unwrap();
    let (p2, _) = a.alloc(C).unwrap();
    a.pin(p1).unwrap();
    a.pin(p2).unwrap();
    a.free(big).unwrap();
    let r = a.compact().unwrap();
    assert!(r.largest_free_va_after >= r.largest_free_va_before, "{r:?}");
    assert_eq!((r.moved_allocations, a.query(x).unwrap().ptr), (0, px), "moving x would only fragment");
    // With p1 unpinned, p1 and x slide down and the free space becomes one range.
    a.unpin(p1).unwrap();
    let r = a.compact().unwrap();
    assert_eq!(r.moved_allocations, 2, "{r:?}");
    assert_eq!(r.largest_free_va_after, a.stats().unwrap().free_va_bytes, "{r:?}");
}

/// A small allocation resized out of its slab emptied the slab, whose chunk
/// then stayed pooled above the `retain_bytes` watermark (a free applies it,
/// that resize did not; since small objects are retired when they move, it
/// is the release of retired memory that empties the slab, and it must
/// apply the watermark too).
#[test]
fn regression_resize_out_of_a_slab_applies_the_watermark() {
    let d = Arc::new(HostDriver::new().unwrap());
    let cfg = ArenaConfig {
        capacity_bytes: 8 * C,
        reserve_bytes: 8 * C,
        chunk_bytes: C,
        retain_bytes: 0,
        ..ArenaConfig::default()
    };
    let a = Arena::with_driver(d.clone(), cfg).unwrap();
    let (x, _) = a.alloc(300).unwrap();
    a.write(x, 0, b"small").unwrap();
    a.resize(x, 3 * C).unwrap(); // beyond every class: promoted to chunks, by copying
    let mut out = [0u8; 5];
    a.read(x, 0, &mut out).unwrap();
    assert_eq!(&out, b"small");
    // The old place is retired (a kernel may still use it) and holds its
    // slab until retired memory is released; then the slab goes back.
    a.release_retired().unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.small_slabs, s.mapped_bytes, s.pooled_bytes), (0, 3 * C, 0), "the empty slab went back");
    assert_eq!(d.live_chunks(), 3);
}

// `regression_trim_counts_what_releasing_retired_ranges_adds_to_the_pool`
// lived here: its `trim` released retired small objects of a live
// allocation. That contract changed (issue 16): see
// `tests/contract_regressions.rs`, `trim_gives_back_at_most_what_was_pooled`.

/// A slab holding only retired small objects (old places of copy-resized
/// ones) kept its chunk from an alloc that needed it: out of memory while
/// releasing retired memory, as the arena does for address space, would
/// have covered the request.
#[test]
fn regression_alloc_reclaims_slabs_of_retired_small_objects() {
    let (a, d) = arena(3, 8, false);
    let (x, _) = a.alloc(100).unwrap(); // slab 1
    a.write(x, 0, b"x").unwrap();
    a.resize(x, C / 4).unwrap(); // copied into slab 2; slab 1 holds only x's retired old place
    let (g, pg) = a.alloc_growable(C / 2 + 1, 2 * C).unwrap(); // the third chunk
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes), (2 * C, C), "slab 1 backs nothing live: pooled");
    // Growth needs slab 1's chunk back.
    assert_eq!(a.resize(g, C + 1).unwrap(), pg);
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.retired_va_bytes, s.small_slabs), (3 * C, 0, 1));
    // So does an alloc.
    a.free(g).unwrap(); // two chunks pooled
    a.resize(x, C / 2).unwrap(); // copied into slab 3; slab 2 holds only a retired object
    let (y, _) = a.alloc(3 * C / 2).unwrap(); // the pooled chunk and slab 2's
    a.write(y, 0, b"y").unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.retired_va_bytes, s.small_slabs), (3 * C, 0, 1));
    let mut out = [0u8; 1];
    a.read(x, 0, &mut out).unwrap();
    assert_eq!(&out, b"x");
    assert_eq!(d.live_chunks() as u64, (s.mapped_bytes + s.pooled_bytes) / C);
}
