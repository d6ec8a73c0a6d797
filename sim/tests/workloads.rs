//! The simulator's workload code (`sim/src/`), run small: the
//! KV-serving replay for every manager and both layouts, the fragmentation
//! scenario, the PyTorch caching-allocator model's rules, and the parsing of
//! the shared traces (skipped with a message where `../shared` is missing).

use std::sync::atomic::AtomicU64;

use vmm_sim::caching::CachingAllocator;
use vmm_sim::managers::{
    self, new_device, ArenaMgr, ArenaMode, ArenaOptions, BuildOptions, KvShape, Layout, ALL_MANAGERS,
};
use vmm_sim::replay::{replay, RunResult, SchedConfig};
use vmm_sim::timing::Profile;
use vmm_sim::{scenario, trace};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn shape(layout: Layout) -> KvShape {
    // A small model: 16 KiB per token over 4 layers (per-layer: 8 allocations
    // of 2 KiB per token), context 4096.
    KvShape { kv_bytes_per_token: 16 << 10, layers: 4, layout, max_context: 4096 }
}

fn run(name: &str, layout: Layout, capacity: u64, requests: &[trace::Request]) -> RunResult {
    let s = shape(layout);
    let max_batch = 64;
    let reserve = managers::arena_reserve(s, capacity, max_batch);
    let arena = ArenaOptions::new(capacity, reserve);
    let max_tokens = requests.iter().map(|q| q.output).max().unwrap_or(1);
    let opts = BuildOptions { arena, prefix_caching: true, max_tokens };
    let mut m = managers::build(name, s, opts).expect("manager");
    let cfg = SchedConfig {
        max_batch,
        kv_bytes_per_token: s.kv_bytes_per_token,
        profile: Profile::h200(),
        max_num_batched_tokens: 0,
    };
    replay(m.as_mut(), requests, &cfg, &AtomicU64::new(0))
}

fn check_all(layout: Layout, capacity: u64, n: usize) -> Vec<RunResult> {
    let t = trace::synthetic(n, 3);
    let mut out = Vec::new();
    for name in ALL_MANAGERS {
        let r = run(name, layout, capacity, &t.requests);
        println!(
            "{layout:?} {name}: done {} rejected {} preempted {} frag {} peak phys {} copied {} moves {}",
            r.completed_requests,
            r.rejected_requests,
            r.preemptions,
            r.fragmentation_failures,
            r.peak_physical_bytes,
            r.bytes_copied,
            r.moves
        );
        assert_eq!(r.integrity_errors, 0, "{name}: integrity errors");
        assert_eq!(r.host_limit_failures, 0, "{name}: {:?}", r.first_host_limit);
        assert!(r.aborted.is_none(), "{name}: {:?}", r.aborted);
        assert_eq!(r.completed_requests + r.rejected_requests, n as u64, "{name}: every request ends");
        assert!(r.peak_physical_bytes <= capacity, "{name}: physical memory above the device's capacity");
        assert!(r.tags_written > 0);
        out.push(r);
    }
    out
}

#[test]
fn tiny_replay_token_major_keeps_every_tag() {
    let rs = check_all(Layout::TokenMajor, 4 * GIB, 60);
    for r in &rs {
        assert_eq!(r.rejected_requests, 0, "{}: nothing is too large for 4 GiB", r.name);
    }
    let arena = &rs[0];
    let torch = rs.iter().find(|r| r.name == "pytorch-caching").unwrap();
    assert!(torch.bytes_copied > 0, "doubling copies");
    assert_eq!(arena.bytes_copied, 0, "the arena never copies");
    let vllm = rs.iter().find(|r| r.name == "vllm-paged").unwrap();
    assert_eq!(vllm.peak_physical_bytes, 4 * GIB, "vLLM holds the whole capacity");
    // The arena rows: `arena` frees each request's one allocation on the
    // stream (one event each, 60 requests, no preemption), moves its
    // prefetch between steps and never drains on the critical path; between
    // steps only `release_retired` may synchronize, once per moved
    // allocation's old range at most (a live allocation's old addresses are
    // not known idle). `arena-sync` records no event and creates nothing
    // between steps (no prefetch).
    let sync = rs.iter().find(|r| r.name == "arena-sync").unwrap();
    assert_eq!((arena.preemptions, sync.preemptions), (0, 0));
    assert_eq!(arena.critical_calls.event_record + arena.between_calls.event_record, 60);
    assert_eq!((arena.critical_path_syncs, arena.critical_path_event_waits), (0, 0));
    assert_eq!(arena.between_steps_drains, arena.between_calls.synchronize, "no event wait between steps");
    assert!(arena.between_steps_drains <= arena.moves, "{} drains, {} moves", arena.between_steps_drains, arena.moves);
    assert!(arena.between_calls.create > 0, "maintain creates ahead between steps");
    assert_eq!((sync.critical_calls.event_record + sync.between_calls.event_record, sync.between_calls.create), (0, 0));
}

#[test]
fn tiny_replay_per_layer_keeps_every_tag() {
    check_all(Layout::PerLayer, 4 * GIB, 40);
}

#[test]
fn replay_under_pressure_preempts_and_the_arena_never_fragments() {
    // 160 MiB holds about 10,000 tokens of 16 KiB: the synthetic load needs more.
    let rs = check_all(Layout::TokenMajor, 160 * MIB, 80);
    let arena = &rs[0];
    assert!(rs.iter().any(|r| r.preemptions > 0), "the capacity is small enough to preempt");
    assert_eq!(arena.fragmentation_failures, 0, "arena: {:?}", arena.first_fragmentation);
}

/// 48 requests over a tree of hash chains (3 first blocks, 2 variants of
/// each second and third, then a block of their own; some prompts end on
/// a block boundary, where hits stop one unit short), arriving 20 ms apart
/// on a device of 1 GiB at 128 KiB per token (a chunk is one 16-token
/// unit): the arena's prefix cache shares and evicts all the time.
fn chain_tree_trace() -> Vec<trace::Request> {
    (0..48u64)
        .map(|i| {
            let b0 = 1 + i % 3;
            let b1 = 10 * b0 + (i / 3) % 2;
            let b2 = 10 * b1 + (i / 6) % 2;
            let blocks = 2 + i % 3;
            let ids: Vec<u64> = [b0, b1, b2, 1000 + i][..blocks as usize].to_vec();
            let extra = if i % 4 == 0 { 0 } else { 37 * (i % 7) };
            trace::Request {
                arrival_s: 0.02 * i as f64,
                prompt: 512 * blocks + extra,
                output: 20 + 7 * (i % 9),
                hash_ids: ids.into(),
            }
        })
        .collect()
}

#[test]
fn arena_prefix_cache_under_pressure_keeps_its_books_and_every_tag() {
    let reqs = chain_tree_trace();
    let shape = KvShape { kv_bytes_per_token: 128 << 10, layers: 32, layout: Layout::TokenMajor, max_context: 8192 };
    let capacity = GIB;
    let arena = ArenaOptions {
        capacity,
        reserve: managers::arena_reserve(shape, capacity, 16),
        retain: u64::MAX,
        no_implicit_moves: false,
        precreate_bytes: 0,
        map_ahead_bytes: 0,
        chunk_bytes: 0,
        paged_warm_bytes: 0,
    };
    let cfg = SchedConfig {
        max_batch: 16,
        kv_bytes_per_token: shape.kv_bytes_per_token,
        profile: Profile::h200(),
        max_num_batched_tokens: 0,
    };
    let mut m = ArenaMgr::new("arena", shape, arena, ArenaMode::Stream).unwrap().with_prefix_cache(true);
    let r = replay(&mut m, &reqs, &cfg, &AtomicU64::new(0));
    let extra = |k: &str| r.extra.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()).unwrap();
    println!(
        "arena: hit {:.3}, evicted {}, take-overs {}, preemptions {}, peak shared live {}",
        r.prefix_hit_rate,
        extra("evicted_prefix_units"),
        extra("take_overs"),
        r.preemptions,
        r.peak_shared_live_bytes
    );
    assert_eq!((r.integrity_errors, r.completed_requests), (0, 48), "every tag read back through shared chunks");
    assert!(r.prefix_hit_tokens > 0 && extra("evicted_prefix_units") != "0", "it shares and evicts");
    assert!(extra("take_overs") != "0", "and admissions take entries over");
    assert!(r.peak_shared_live_bytes > 0, "running requests shared chunks");
    for k in ["cascade_evictions", "source_mismatches", "uncached_after_gap", "prefix_cache_errors"] {
        assert_eq!(extra(k), "0", "{k}");
    }
    assert_eq!(r.bytes_copied, 0);
    // First admissions are a part of all admissions: every request has
    // one, and only re-admissions after a preemption are left out.
    let requested: u64 = reqs.iter().map(|q| q.prompt).sum();
    assert_eq!(r.first_admission_prompt_tokens, requested);
    assert_eq!(r.prompt_tokens > requested, r.preemptions > 0);
    assert!(r.first_admission_hit_tokens <= r.prefix_hit_tokens);
    assert!(r.first_admission_hit_tokens > 0);
    let p = m.prefix_cache().expect("on");
    p.books.check().unwrap();
    // Nothing runs now: the arena maps exactly the cached units' chunks.
    let s = m.arena().stats().unwrap();
    assert_eq!(s.mapped_bytes, p.books.cached_units() * (2 << 20));
    assert_eq!(p.books.queued_units(), p.books.cached_units());
    let footprint: u64 = extra("peak_footprint_bytes").parse().unwrap();
    assert!(footprint >= r.peak_distinct_live_bytes && footprint <= capacity);
    // vLLM on the same trace, for the record (not a pass condition).
    let v = run_shape("vllm-paged", shape, capacity, &reqs);
    println!("vllm-paged: hit {:.3}, preemptions {}", v.prefix_hit_rate, v.preemptions);
    assert_eq!(v.integrity_errors, 0);
    // Per-layer: the arena's cache is off (a chunk is not whole units), and
    // the replay runs as without it.
    let per_layer = KvShape { layout: Layout::PerLayer, ..shape };
    let r = run_shape("arena", per_layer, capacity, &reqs);
    let extra = |k: &str| r.extra.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()).unwrap();
    assert_eq!(extra("arena_prefix_caching"), "\"off: one allocation per request only\"");
    assert_eq!((r.integrity_errors, r.prefix_hit_tokens), (0, 0));
}

/// The chain-tree trace through the `arena` manager (1 GiB, prefix cache
/// on, batch 16), configured by `configure`; the books are checked after.
fn chain_tree_arena_run(configure: impl FnOnce(ArenaMgr) -> ArenaMgr) -> RunResult {
    let reqs = chain_tree_trace();
    let shape = KvShape { kv_bytes_per_token: 128 << 10, layers: 32, layout: Layout::TokenMajor, max_context: 8192 };
    let capacity = GIB;
    let cfg = SchedConfig {
        max_batch: 16,
        kv_bytes_per_token: shape.kv_bytes_per_token,
        profile: Profile::h200(),
        max_num_batched_tokens: 0,
    };
    let arena = ArenaOptions::new(capacity, managers::arena_reserve(shape, capacity, 16));
    let m = ArenaMgr::new("arena", shape, arena, ArenaMode::Stream).unwrap().with_prefix_cache(true);
    let mut m = configure(m);
    let r = replay(&mut m, &reqs, &cfg, &AtomicU64::new(0));
    m.prefix_cache().expect("on").books.check().unwrap();
    r
}

/// The arena's admissions prepared between steps (`prepare_admissions`)
/// give every request the outcome admission would have given it: the same
/// hits, failures and preemptions as without preparing, every tag intact,
/// nothing prepared left unused; and the admissions' chunk maps leave the
/// critical path.
#[test]
fn prepared_admissions_keep_the_outcomes_and_leave_the_critical_path() {
    let with = chain_tree_arena_run(|m| m);
    let without = chain_tree_arena_run(ArenaMgr::without_prepared_admissions);
    let extra = |r: &RunResult, k: &str| r.extra.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()).unwrap();
    println!(
        "prepared {} (failed {}), critical maps {} vs {}, drains between {} vs {}",
        extra(&with, "prepared_admissions"),
        extra(&with, "prepared_admission_failures"),
        with.critical_calls.map_chunks,
        without.critical_calls.map_chunks,
        with.between_steps_drains,
        without.between_steps_drains
    );
    for r in [&with, &without] {
        assert_eq!((r.integrity_errors, r.completed_requests), (0, 48));
    }
    let outcome = |r: &RunResult| {
        (r.prefix_hit_tokens, r.prompt_tokens, r.preemptions, r.admission_failures, r.growth_failures, r.steps)
    };
    assert_eq!(outcome(&with), outcome(&without), "the same outcomes");
    assert_eq!(extra(&with, "prefix_hits"), extra(&without, "prefix_hits"), "each hit counted once");
    assert_eq!(extra(&with, "evicted_prefix_units"), extra(&without, "evicted_prefix_units"));
    assert_eq!(with.peak_distinct_live_bytes, without.peak_distinct_live_bytes, "prepared sharing not counted early");
    assert_ne!(extra(&with, "prepared_admissions"), "0");
    assert_eq!(extra(&with, "prepared_admissions_stale"), "0", "the replay admits what it prepared");
    assert_eq!(extra(&without, "prepared_admissions"), "0");
    assert!(
        with.critical_calls.map_chunks < without.critical_calls.map_chunks,
        "admissions map their chunks between steps"
    );
    // (The totals differ a little: chunks land elsewhere, and `maintain`
    // finds other pages to map ahead.)
    assert!(with.between_calls.map_chunks > without.between_calls.map_chunks, "moved between steps");
}

/// Admissions mapped over several steps (staging, the `arena-staged`
/// row): every request completes with every tag intact and its prefix
/// hits counted once; staged admissions happen, their driver work stays
/// off the critical path (fewer chunk maps there than when each admission
/// is prepared whole in the step before it), and the between-steps work
/// drains the GPU less often.
#[test]
fn staged_admissions_keep_every_tag_and_leave_the_critical_path() {
    let staged = chain_tree_arena_run(ArenaMgr::with_staged_admissions);
    let whole = chain_tree_arena_run(|m| m);
    let extra = |r: &RunResult, k: &str| r.extra.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()).unwrap();
    println!(
        "staged {} (waits {}, given up {}), critical maps {} vs {} (between {} vs {}), drains between {} vs {}, waiting for KV {}",
        extra(&staged, "staged_admissions"),
        extra(&staged, "staged_admission_waits"),
        extra(&staged, "staged_admissions_given_up"),
        staged.critical_calls.map_chunks,
        whole.critical_calls.map_chunks,
        staged.between_calls.map_chunks,
        whole.between_calls.map_chunks,
        staged.between_steps_drains,
        whole.between_steps_drains,
        staged.admissions_waiting_for_kv,
    );
    for r in [&staged, &whole] {
        assert_eq!((r.integrity_errors, r.completed_requests, r.rejected_requests), (0, 48, 0));
    }
    assert_eq!(extra(&staged, "staging"), "true");
    assert_eq!(extra(&whole, "staging"), "false");
    assert_ne!(extra(&staged, "staged_admissions"), "0");
    assert_eq!(extra(&staged, "prefix_cache_errors"), "0");
    assert!(staged.prefix_hit_tokens > 0, "hits still found");
    // Off the critical path: a smaller share of its mapping is there (it
    // maps more in all, for the admissions it gives up).
    let share = |r: &RunResult| {
        r.critical_calls.map_chunks as f64 / (r.critical_calls.map_chunks + r.between_calls.map_chunks) as f64
    };
    assert!(share(&staged) < share(&whole), "off the critical path");
    // Staging takes idle chunks only; what still drains between steps is
    // the rest (a prefix hit mapped over cached chunks, `release_retired`).
    assert!(staged.between_steps_drains < whole.between_steps_drains, "fewer drains between steps");
}

fn run_shape(name: &str, s: KvShape, capacity: u64, requests: &[trace::Request]) -> RunResult {
    let arena = ArenaOptions {
        capacity,
        reserve: managers::arena_reserve(s, capacity, 16),
        retain: u64::MAX,
        no_implicit_moves: false,
        precreate_bytes: 0,
        map_ahead_bytes: 0,
        chunk_bytes: 0,
        paged_warm_bytes: 0,
    };
    let opts = BuildOptions { arena, prefix_caching: true, max_tokens: 100 };
    let mut m = managers::build(name, s, opts).expect("manager");
    let cfg = SchedConfig {
        max_batch: 16,
        kv_bytes_per_token: s.kv_bytes_per_token,
        profile: Profile::h200(),
        max_num_batched_tokens: 0,
    };
    replay(m.as_mut(), requests, &cfg, &AtomicU64::new(0))
}

#[test]
fn fragmentation_scenario_fails_the_caching_model_and_not_the_arena() {
    let out = scenario::run_all(256 * MIB, 32 * MIB);
    for o in &out {
        println!("{o:?}");
        assert_eq!(o.integrity_errors, 0, "{}", o.name);
        assert!(o.free_total > o.request, "{}: the free total covers the request", o.name);
    }
    let by = |n: &str| out.iter().find(|o| o.name == n).unwrap();
    assert!(!by("pytorch-caching").succeeded, "the caching allocator fails");
    assert!(by("pytorch-caching").largest_hole < 32 * MIB);
    assert!(by("arena").succeeded);
    let tight = by("arena (VA = capacity)");
    assert!(tight.succeeded && tight.moves > 0, "succeeds by moving: {tight:?}");
    assert!(tight.largest_hole < 32 * MIB);
    assert!(!by("arena-no-moves (VA = capacity)").succeeded, "without moves the hole is too small");
}

#[test]
fn caching_model_follows_pytorch_sizes_and_splits() {
    let dev = new_device(GIB).unwrap();
    let mut a = CachingAllocator::new(dev.clone(), GIB, false);
    // 3 MiB: large pool, a 20 MiB segment (kLargeBuffer), split (17 MiB > 1 MiB remain).
    let p1 = a.malloc(3 * MIB).unwrap();
    assert_eq!(a.stats().reserved_bytes, 20 * MIB);
    let p2 = a.malloc(3 * MIB).unwrap();
    assert_eq!(p2, p1 + 3 * MIB, "best fit in the same segment, right after");
    assert_eq!(a.stats().reserved_bytes, 20 * MIB);
    // 16 MiB >= kMinLargeAlloc: no cached block fits (14 MiB remain in the
    // first segment), so a segment of its own, rounded up to 2 MiB.
    let p3 = a.malloc(15 * MIB + 1).unwrap();
    assert_eq!(a.stats().reserved_bytes, 20 * MIB + 16 * MIB);
    a.free(p3);
    // 15.5 MiB: best fit is the cached 16 MiB block (not the 14 MiB one);
    // 0.5 MiB would remain (not > 1 MiB), so no split.
    let p4 = a.malloc(15 * MIB + MIB / 2).unwrap();
    assert_eq!(p4, p3);
    assert_eq!(a.stats().allocated_bytes, 6 * MIB + 16 * MIB);
    // Small pool: 2 MiB segments, 512-byte rounding, split down to 512 bytes.
    let s1 = a.malloc(100).unwrap();
    assert_eq!(a.stats().reserved_bytes, 36 * MIB + 2 * MIB);
    let s2 = a.malloc(600 << 10).unwrap();
    assert_eq!(s2, s1 + 512);
    a.free(p1);
    a.free(p2);
    a.free(s1);
    a.free(s2);
    a.check_invariants();
    // Coalesced back into one free 20 MiB block, one free small segment.
    assert_eq!(a.largest_free_block(), 20 * MIB);
    a.empty_cache();
    assert_eq!(a.stats().reserved_bytes, 16 * MIB, "only the segment in use stays");
    a.free(p4);
    a.empty_cache();
    assert_eq!(dev.live_bytes(), 0);
}

#[test]
fn caching_model_releases_cached_segments_and_retries_on_oom() {
    let dev = new_device(100 * MIB).unwrap();
    let mut a = CachingAllocator::new(dev.clone(), 100 * MIB, false);
    let x = a.malloc(40 * MIB).unwrap();
    let y = a.malloc(40 * MIB).unwrap();
    a.free(x);
    a.free(y);
    // 60 MiB: no cached block fits, cudaMalloc fails (80 MiB held), the cache
    // is released, the retry succeeds.
    let z = a.malloc(60 * MIB).unwrap();
    assert_eq!(a.stats().num_alloc_retries, 1);
    assert_eq!(a.stats().reserved_bytes, 60 * MIB);
    let err = a.malloc(50 * MIB).unwrap_err();
    assert!(!err.is_fragmentation(), "40 MiB are free: a real out-of-memory");
    a.free(z);
}

#[test]
fn expandable_model_maps_20_mib_pages_and_unmaps_free_pages_on_oom() {
    let dev = new_device(200 * MIB).unwrap();
    let mut a = CachingAllocator::new(dev.clone(), 200 * MIB, true);
    let p = a.malloc(3 * MIB).unwrap();
    assert_eq!(a.stats().reserved_bytes, 20 * MIB, "one 20 MiB page");
    assert_eq!(dev.calls().create, 1);
    let q = a.malloc(30 * MIB).unwrap();
    assert_eq!(q, p + 3 * MIB, "one segment, contiguous");
    assert_eq!(a.stats().reserved_bytes, 40 * MIB, "17 MiB free + one more page");
    a.free(q);
    a.check_invariants();
    // 199 MiB: 180 MiB more to map, only 160 MiB obtainable: the OOM retry
    // unmaps the free page, then the retry still fails (two pages short).
    assert!(a.malloc(199 * MIB).is_err());
    assert_eq!(a.stats().reserved_bytes, 20 * MIB, "the fully free page was released");
    a.check_invariants();
    let r = a.malloc(150 * MIB).unwrap();
    assert_eq!(r, p + 3 * MIB);
    a.free(r);
    a.free(p);
    a.check_invariants();
}

#[test]
fn caching_models_keep_their_invariants_under_random_churn() {
    for expandable in [false, true] {
        let dev = new_device(512 * MIB).unwrap();
        let mut a = CachingAllocator::new(dev.clone(), 512 * MIB, expandable);
        let mut rng = vmm_sim::util::Rng::new(11);
        let mut live: Vec<u64> = Vec::new();
        for i in 0..4000 {
            if live.is_empty() || rng.f64() < 0.55 {
                let size = match rng.next_u64() % 3 {
                    0 => rng.next_u64() % MIB + 1,
                    1 => rng.next_u64() % (9 * MIB) + MIB,
                    _ => rng.next_u64() % (40 * MIB) + 10 * MIB,
                };
                if let Ok(p) = a.malloc(size) {
                    live.push(p);
                }
            } else {
                let k = (rng.next_u64() % live.len() as u64) as usize;
                a.free(live.swap_remove(k));
            }
            if i % 97 == 0 {
                a.check_invariants();
            }
            assert!(dev.live_bytes() <= 512 * MIB);
        }
        for p in live {
            a.free(p);
        }
        a.check_invariants();
        a.empty_cache();
        assert_eq!(dev.live_bytes(), 0, "expandable={expandable}: everything released");
    }
}

#[test]
fn shared_traces_parse() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    for (file, min_prompt_mean) in [("azure_conv_2023.csv", 500.0), ("mooncake_conversation.jsonl", 5000.0)] {
        let path = dir.join(file);
        if !path.exists() {
            println!("skipped: {} is missing (the shared traces live beside the project)", path.display());
            continue;
        }
        let t = trace::load(&path, Some(200)).expect("trace parses");
        assert_eq!(t.requests.len(), 200, "{file}");
        assert!(t.requests.windows(2).all(|w| w[0].arrival_s <= w[1].arrival_s), "{file}: arrival order");
        let ((pm, _, _), (om, _, _)) = t.stats();
        assert!(pm > min_prompt_mean && om > 10.0, "{file}: prompt mean {pm}, output mean {om}");
    }
}

/// vLLM refuses an admission whose fresh blocks exceed its free ones
/// (evictable cached blocks included) before it evicts anything; the
/// arena's prefix cache must too, or a request that cannot fit empties the
/// cache (the hits of every later request lost) and still fails. 2 MiB
/// chunks at 128 KiB per token: a unit is a chunk, a hash block 32.
#[test]
fn an_admission_that_cannot_fit_evicts_nothing() {
    let (c, bpt) = (2 * MIB, 128 << 10);
    let (arena, mut p) = prefix_cache_on_a_mock(48, 1024);
    let max = 128 * c;
    let a = req(520, &[1]);
    let (id, _) = p.admit(&arena, 520 * bpt, max, &a, u64::MAX, false).unwrap();
    p.release(&arena, id, false);
    assert_eq!(p.books.queued_units(), 32, "its hash block is cached");
    // 64 fresh units; 16 chunks free and 32 evictable.
    let b = req(1024, &[7, 8]);
    let e = p.admit(&arena, 1024 * bpt, max, &b, u64::MAX, false).unwrap_err();
    assert!(matches!(e, vmm_arena::Error::OutOfMemory(_)), "{e}");
    assert_eq!(p.books.queued_units(), 32, "nothing evicted for an admission that cannot fit");
    // One that fits evicts what it needs (24 units past the 16 free).
    let f = req(640, &[9]);
    let (id, _) = p.admit(&arena, 640 * bpt, max, &f, u64::MAX, false).unwrap();
    assert!(p.books.queued_units() <= 8, "evicted for it");
    p.release(&arena, id, false);
    p.books.check().unwrap();
}

/// An admission begun over an entry it took over (the entry is exactly its
/// hit) and then given up (a staged admission the queue moved past) leaves
/// the entry an entry: its units stay cached with their holder, so the next
/// request hits them. Giving it up used to drop the entry's books outright,
/// leaving cached units whose holder was gone (the next lookup panicked).
#[test]
fn a_given_up_admission_over_a_taken_over_entry_keeps_the_entry() {
    let (c, bpt) = (2 * MIB, 128 << 10);
    let (arena, mut p) = prefix_cache_on_a_mock(256, 4096);
    let max = 128 * c;
    // A's entry: exactly its hash block (32 units).
    let a = req(512, &[1]);
    let (id, _) = p.admit(&arena, 513 * bpt, max, &a, u64::MAX, false).unwrap();
    p.release(&arena, id, false);
    // B hits all of it (its prompt goes on): it takes the entry over.
    let b = req(1024, &[1, 2]);
    let (bid, hit) = p.begin(&arena, 1025 * bpt, max, &b, false, 16 * c).unwrap();
    assert_eq!((bid, hit), (id, 512), "the entry, taken over");
    p.give_up(&arena, bid, false);
    p.books.check().unwrap();
    assert_eq!(p.hit_tokens(&b), 512, "A's block is still cached");
    let (cid, hit) = p.admit(&arena, 1025 * bpt, max, &b, u64::MAX, false).unwrap();
    assert_eq!(hit, 512);
    p.release(&arena, cid, false);
    p.books.check().unwrap();
}

/// An arena of `capacity` 2 MiB chunks (and `reserve` of address space) on
/// the mock driver with streams, and the prefix cache on it, freeing on
/// stream 0 (128 KiB per token: a 16-token unit is one chunk).
fn prefix_cache_on_a_mock(
    capacity: u64,
    reserve: u64,
) -> (vmm_arena::Arena, vmm_sim::arena_prefix_cache::ArenaPrefixCache) {
    let c = 2 * MIB;
    let d = std::sync::Arc::new(vmm_arena::driver::mock::MockDriver::with_streams(c, 1 << 40));
    let cfg = vmm_arena::ArenaConfig {
        capacity_bytes: capacity * c,
        reserve_bytes: reserve * c,
        chunk_bytes: c,
        ..Default::default()
    };
    let arena = vmm_arena::Arena::with_driver(d, cfg).unwrap();
    let mut p = vmm_sim::arena_prefix_cache::ArenaPrefixCache::new(c, 128 << 10).unwrap();
    p.stream = Some(0);
    (arena, p)
}

/// A request of `prompt` tokens and hash blocks `ids`, arriving at 0.
fn req(prompt: u64, ids: &[u64]) -> trace::Request {
    trace::Request { arrival_s: 0.0, prompt, output: 1, hash_ids: ids.into() }
}
