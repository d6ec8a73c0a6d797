//! The KV-serving replay's step-time model and the metrics built on it,
//! against expectations computed by hand on tiny traces (see each test).

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use vmm_sim::counted::Calls;
use vmm_sim::managers::{self, ArenaOptions, BuildOptions, KvShape, Layout};
use vmm_sim::replay::{replay, RunResult, SchedConfig};
use vmm_sim::timing::{Profile, StepWork};
use vmm_sim::trace::Request;

/// Round numbers: 1 TB/s at full efficiency, 1 PFLOP/s at MFU 0.5, a 1 B
/// parameter model in BF16 (2 GB of weights), 1 ms of CPU per step, and a
/// driver table of 100 / 1 / 10 / 20 µs (create / map / access / unmap).
fn profile() -> Profile {
    Profile {
        name: "test".into(),
        hbm_bytes_per_s: 1e12,
        hbm_efficiency: 1.0,
        peak_flops: 1e15,
        prefill_mfu: 0.5,
        params: 1e9,
        bytes_per_param: 2.0,
        cpu_step_s: 1e-3,
        create_s: 100e-6,
        map_s: 1e-6,
        set_access_s: 10e-6,
        unmap_s: 20e-6,
        set_access_call_s: 0.0,
        unmap_call_s: 0.0,
        release_s: 0.0,
        reserve_s: 0.0,
        synchronize_s: 0.0,
        event_record_s: 0.0,
        event_query_s: 0.0,
        event_destroy_s: 0.0,
        // No attention FLOPs: the tests here price the rest of the model
        // (tests/attention_model.rs prices attention).
        layers: 0,
        heads: 0,
        kv_heads: 0,
        head_dim: 0,
        ..Profile::h200()
    }
}

fn req(arrival_s: f64, prompt: u64, output: u64, hashes: &[u64]) -> Request {
    Request { arrival_s, prompt, output, hash_ids: Arc::from(hashes) }
}

fn run(name: &str, kvpt: u64, capacity: u64, requests: &[Request]) -> RunResult {
    run_chunked(name, kvpt, capacity, requests, 0)
}

/// `requests` replayed on `name` with prefix caching off (whole prompts a
/// step), on the arena options given; checks nothing itself.
fn run_without_prefix_caching(name: &str, kvpt: u64, arena: ArenaOptions, requests: &[Request]) -> RunResult {
    let shape = KvShape { kv_bytes_per_token: kvpt, layers: 1, layout: Layout::TokenMajor, max_context: 4096 };
    let mut m = managers::build(name, shape, BuildOptions { arena, prefix_caching: false, max_tokens: 1 }).unwrap();
    let cfg = SchedConfig { max_batch: 8, kv_bytes_per_token: kvpt, profile: profile(), max_num_batched_tokens: 0 };
    replay(m.as_mut(), requests, &cfg, &AtomicU64::new(0))
}

/// The value of the run's extra field `k` (panics when it is missing).
fn extra_field(r: &RunResult, k: &str) -> String {
    r.extra.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()).unwrap()
}

/// [`run`] with chunked prefill of `budget` tokens a step (0: whole prompts).
fn run_chunked(name: &str, kvpt: u64, capacity: u64, requests: &[Request], budget: u64) -> RunResult {
    run_mapping_ahead(name, kvpt, capacity, requests, budget, managers::DEFAULT_MAP_AHEAD)
}

/// [`run_chunked`] with `map_ahead` bytes mapped ahead of each tensor.
fn run_mapping_ahead(
    name: &str,
    kvpt: u64,
    capacity: u64,
    requests: &[Request],
    budget: u64,
    map_ahead: u64,
) -> RunResult {
    let shape = KvShape { kv_bytes_per_token: kvpt, layers: 1, layout: Layout::TokenMajor, max_context: 4096 };
    let arena = ArenaOptions {
        map_ahead_bytes: map_ahead,
        ..ArenaOptions::new(capacity, managers::arena_reserve(shape, capacity, 8))
    };
    let opts = BuildOptions { arena, prefix_caching: true, max_tokens: 16 };
    let mut m = managers::build(name, shape, opts).expect("manager");
    let cfg =
        SchedConfig { max_batch: 8, kv_bytes_per_token: kvpt, profile: profile(), max_num_batched_tokens: budget };
    let r = replay(m.as_mut(), requests, &cfg, &AtomicU64::new(0));
    assert_eq!(r.integrity_errors, 0, "{name}: every tag read back");
    assert!(r.aborted.is_none());
    r
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1e-6)
}

/// Each cost of the rule, alone (`timing.rs`):
/// step = max(gpu, cpu) + critical alloc, or gpu + cpu with a synchronize,
/// plus between-steps time beyond the GPU's; gpu = max(memory, compute).
#[test]
fn step_rule_charges_each_cost() {
    let p = profile();
    // Driver time: 3 chunks created (300 µs), 2 mapped (2 µs), 4 under
    // access calls (40 µs), 1 unmapped (20 µs).
    let c = Calls { create_chunks: 3, map_chunks: 2, set_access_chunks: 4, unmap_chunks: 1, ..Calls::default() };
    assert!(close(p.driver_s(&c), 362e-6));
    // Linear layers of 1000 tokens: 1000 x 2e9 FLOPs / 5e14 FLOP/s = 4 ms.
    assert!(close(p.linear_s(1000), 4e-3));
    // Memory of a decode with 1 GB of KV: (2 GB + 1 GB) / 1 TB/s = 3 ms;
    // none if the step computes nothing.
    let decode = StepWork { decoding: true, decode_kv_bytes: 1_000_000_000, ..Default::default() };
    assert!(close(p.memory_s(&decode), 3e-3));
    assert_eq!(p.memory_s(&StepWork { decode_kv_bytes: 1_000_000_000, ..Default::default() }), 0.0);
    // A copy of 0.5 GB reads and writes it: 1 ms.
    assert!(close(p.copy_s(500_000_000), 1e-3));

    // 1000 prompt tokens fused with that decode: max(3 ms memory, 4 ms compute).
    let gpu_only = StepWork { prefill_tokens: 1000, ..decode };
    assert!(close(p.step(&gpu_only).total_s, 4e-3), "max(4 ms GPU, 1 ms CPU)");
    let cpu_bound = StepWork { alloc_critical_s: 2e-3, ..Default::default() };
    assert!(close(p.step(&cpu_bound).total_s, 3e-3), "max(0 GPU, 1 ms CPU) + 2 ms of driver calls");
    let synced = StepWork { critical_syncs: 1, ..gpu_only };
    assert!(close(p.step(&synced).total_s, 5e-3), "a synchronize loses the overlap: 4 + 1 ms");
    let hidden = StepWork { alloc_between_s: 3e-3, ..gpu_only };
    let t = p.step(&hidden);
    assert!(close(t.total_s, 4e-3) && close(t.alloc_hidden_s, 3e-3) && t.alloc_charged_s == 0.0, "{t:?}");
    let excess = StepWork { alloc_between_s: 9e-3, ..gpu_only };
    let t = p.step(&excess);
    assert!(close(t.total_s, 9e-3) && close(t.alloc_hidden_s, 4e-3) && close(t.alloc_charged_s, 5e-3), "{t:?}");
}

/// Three requests at time 0 on `ideal-contiguous` (no driver calls), 1 MB
/// of KV per token:
/// - A: prompt 1000, 2 tokens; B: prompt 2000, 1 token; C: prompt 510,
///   3 tokens (its tensor, room for 512, doubles in step 3 with a copy of
///   its 512 stored tokens).
/// - step 1: prefill 3510 tokens and 3 decoded (3513 x 4 µs = 14.052 ms
///   of compute) against 3510 MB of KV and 2 GB of weights read (5.51 ms):
///   14.052 ms; B finishes;
/// - step 2: decode (1001 + 511) MB + 2 GB = 3.512 ms; A finishes;
/// - step 3: decode 512 MB + 2 GB = 2.512 ms, copy 2 x 512 MB = 1.024 ms:
///   3.536 ms; C finishes.
#[test]
fn three_requests_take_the_hand_computed_step_times() {
    let mb = 1_000_000;
    let r = run(
        "ideal-contiguous",
        mb,
        100_000 * mb,
        &[req(0.0, 1000, 2, &[]), req(0.0, 2000, 1, &[]), req(0.0, 510, 3, &[])],
    );
    let steps = [14.052e-3, 3.512e-3, 3.536e-3];
    assert_eq!(r.steps, 3);
    assert!(close(r.simulated_seconds, steps.iter().sum()), "{}", r.simulated_seconds);
    assert!(close(r.step_time_max_s, 14.052e-3) && close(r.step_time_p50_s, 3.536e-3), "{r:?}");
    assert_eq!((r.output_tokens, r.bytes_copied, r.prefill_tokens), (6, 512 * mb, 3510));
    assert!(close(r.tokens_per_s, 6.0 / steps.iter().sum::<f64>()));
    // Every first token comes at the end of step 1.
    assert!(close(r.ttft_mean_s, 14.052e-3) && close(r.ttft_p99_s, 14.052e-3));
    // TPOT: A 3.512 ms (one more token), C (3.512 + 3.536) / 2 ms; B has none.
    assert!(close(r.tpot_mean_s, (3.512e-3 + (3.512e-3 + 3.536e-3) / 2.0) / 2.0), "{}", r.tpot_mean_s);
    assert_eq!((r.critical_path_alloc_s, r.critical_path_syncs), (0.0, 0));
}

/// One request on the arena as engines drove it before (`arena-sync`),
/// 1 MiB of KV per token and 2 MiB chunks:
/// prompt 1, 3 tokens. Admission maps one chunk (create 100 + map 1 +
/// access 10 µs); step 2 grows to a second chunk (the same); nothing else
/// calls the driver (the free keeps its chunks pooled). Step 1: one prompt
/// token and one decoded (8 µs of compute, under the read of 1 MiB and
/// 2 GB), + 111 µs; step 2: decode of 2 MiB + 111 µs; step 3: decode of 3 MiB.
#[test]
fn driver_calls_on_the_critical_path_are_charged() {
    let mib = 1 << 20;
    let r = run("arena-sync", mib, 64 * mib, &[req(0.0, 1, 3, &[])]);
    let decode = |kv: u64| (2e9 + kv as f64) / 1e12;
    let steps = [decode(mib) + 111e-6, decode(2 * mib) + 111e-6, decode(3 * mib)];
    assert!(close(r.critical_path_alloc_s, 222e-6), "{}", r.critical_path_alloc_s);
    assert!(close(r.simulated_seconds, steps.iter().sum()), "{} vs {steps:?}", r.simulated_seconds);
    // Step 2 reads 1 MiB more than step 1, with the same driver time.
    assert!(close(r.step_time_max_s, steps[1]));
    assert_eq!((r.critical_path_syncs, r.overlapped_alloc_s), (0, 0.0));
}

/// vLLM's prefix cache on five requests one after another (each ends
/// before the next arrives), 1 KiB of KV per token: 16-token blocks of
/// 16 KiB, a 2 MiB pool of 128 blocks (block 0 is the null block), taken
/// from the front of the free queue, freed to its back last block first.
/// Hash blocks are 512 tokens = 32 blocks.
/// - R1 [h1 h2], 1024 tokens (65 blocks): no hit; caches h1, h2.
/// - R2 [h1 h3]: h1 hits (512 tokens); caches h3.
/// - R3 [h1 h2]: h1 and 31 blocks of h2 (hits stop below the last token): 1008.
/// - R4, 980 tokens, no hashes, takes 62 blocks in LRU order: the 27 never
///   used, R1's tail and h2's last block (h2 is cut to 31), R2's tail, and
///   all of h3 (used by R2, before R3 used h2): 33 cached blocks evicted.
/// - R5 [h1 h2]: h1 and the 31 blocks of h2 still cached: 1008.
#[test]
fn prefix_hits_follow_the_chain_and_lru_eviction() {
    let reqs = [
        req(0.0, 1024, 1, &[1, 2]),
        req(10.0, 1024, 1, &[1, 3]),
        req(20.0, 1024, 1, &[1, 2]),
        req(30.0, 980, 1, &[]),
        req(40.0, 1024, 1, &[1, 2]),
    ];
    let r = run("vllm-paged", 1024, 2 << 20, &reqs);
    let extra = |k: &str| extra_field(&r, k);
    assert_eq!(extra("num_blocks"), "128");
    assert_eq!(r.prefix_hit_tokens, 512 + 1008 + 1008);
    assert_eq!(r.prompt_tokens, 4 * 1024 + 980);
    assert_eq!(extra("evicted_prefix_blocks"), "33", "h2's last block and all of h3");
    assert_eq!(extra("cached_prefixes"), "2", "h1 and h2 (made whole again by R5)");
    assert_eq!(r.prefill_tokens, 4 * 1024 + 980 - 2528);
    assert!(close(r.prefix_hit_rate, 2528.0 / 5076.0));
    // Without prefix caching nothing hits.
    let off = run_without_prefix_caching("vllm-paged", 1024, ArenaOptions::new(2 << 20, 0), &reqs);
    assert_eq!((off.prefix_hit_tokens, off.integrity_errors), (0, 0));
}

/// The arena's prefix cache on six requests one after another, 128 KiB of
/// KV per token: a 2 MiB chunk is one 16-token unit, a 512-token hash
/// block 32 chunks; a device of 128 chunks. Each request's entry is shrunk
/// to its cached units when it ends.
/// - R1 [h1 h2], 1024 tokens (65 chunks): no hit; caches h1, h2; kept: 64.
/// - R2 [h1 h3]: h1 (512 tokens, 32 chunks shared from R1); caches h3
///   (33 new chunks); kept: 64, of which 32 are R1's.
/// - R3 [h1 h2]: h1 and 31 units of h2 (hits stop below the last token):
///   1008; it caches nothing of its own, so it is freed (a duplicate).
/// - R4, 980 tokens, no hashes: 62 chunks, 32 free: 30 units evicted in LRU
///   order: h2's last (R1's entry cut to 63), then h3's last 29, tail first
///   (R2's cut to 35: h1 and h3's first 3).
/// - R5 [h1 h2]: 1008 again from R1's 63, which are all R1's entry holds:
///   it takes the entry over (nothing mapped again); completes h2 with its
///   own unit.
/// - R6 [h1 h3]: h1 and the 3 units of h3 left (560 tokens): all of R2's
///   entry, taken over; completes h3.
///
/// Every hit token's tag is read back through the shared chunks.
#[test]
fn arena_prefix_cache_shares_chunks_evicts_lru_and_cuts_chains() {
    let reqs = [
        req(0.0, 1024, 1, &[1, 2]),
        req(10.0, 1024, 1, &[1, 3]),
        req(20.0, 1024, 1, &[1, 2]),
        req(30.0, 980, 1, &[]),
        req(40.0, 1024, 1, &[1, 2]),
        req(50.0, 1024, 1, &[1, 3]),
    ];
    let mib = 1u64 << 20;
    let r = run("arena", 128 << 10, 256 * mib, &reqs);
    let extra = |k: &str| extra_field(&r, k);
    assert_eq!(extra("arena_prefix_caching"), "\"on\"");
    assert_eq!(r.prefix_hit_tokens, 512 + 1008 + 1008 + 560);
    assert_eq!(r.prompt_tokens, 5 * 1024 + 980);
    assert_eq!(extra("prefix_hits"), "4");
    assert_eq!(extra("evicted_prefix_units"), "30", "h2's last unit and h3's last 29");
    assert_eq!(extra("prefix_duplicates_freed"), "1", "R3");
    assert_eq!(extra("prefix_entries_now"), "2", "R1's (R5's since), R2's (R6's since)");
    assert_eq!(extra("take_overs"), "2", "R5, R6");
    assert_eq!(extra("cached_prefixes"), "3");
    assert_eq!(extra("cached_units_now"), "96");
    // Chunks mapped by several entries: h1 (both entries).
    assert_eq!(extra("shared_bytes_now"), (32 * 2 * mib).to_string());
    for k in ["cascade_evictions", "source_mismatches", "uncached_after_gap", "prefix_cache_errors"] {
        assert_eq!(extra(k), "0", "{k}");
    }
    assert_eq!((r.bytes_copied, r.peak_shared_live_bytes), (0, 0), "nothing copied, one request at a time");
    // R4 fills the device exactly: 66 chunks of entries + its 62.
    assert_eq!(r.peak_physical_bytes, 256 * mib);
    assert_eq!(
        extra("peak_footprint_bytes"),
        (65 * 2 * mib).to_string(),
        "one request's 65 chunks, the cache left out"
    );
    assert_eq!(r.final_physical_bytes, 256 * mib, "the pool keeps what it created (retain all)");
    // Off: the same replay computes every prompt token.
    let arena = ArenaOptions {
        capacity: 256 * mib,
        reserve: 0,
        retain: u64::MAX,
        no_implicit_moves: false,
        precreate_bytes: 0,
        map_ahead_bytes: 0,
        chunk_bytes: 0,
        paged_warm_bytes: 0,
    };
    let off = run_without_prefix_caching("arena", 128 << 10, arena, &reqs);
    assert_eq!((off.prefix_hit_tokens, off.integrity_errors), (0, 0));
}

/// Two requests at once sharing h1 (32 chunks): the second maps the
/// first's chunks while both run, so the distinct live KV is the sum less
/// 32 chunks, and the arena maps them once.
#[test]
fn distinct_live_kv_counts_a_shared_prefix_once() {
    let mib = 1u64 << 20;
    let reqs = [req(0.0, 600, 40, &[1]), req(0.001, 600, 20, &[1])];
    for name in ["arena", "vllm-paged"] {
        let r = run(name, 128 << 10, 256 * mib, &reqs);
        assert_eq!(r.prefix_hit_tokens, 512, "{name}");
        assert_eq!(r.peak_shared_live_bytes, 64 * mib, "{name}");
        assert_eq!(r.peak_distinct_live_bytes, r.peak_live_bytes - 64 * mib, "{name}");
    }
    let r = run("arena", 128 << 10, 256 * mib, &reqs);
    let extra = |k: &str| extra_field(&r, k);
    assert_eq!(extra("peak_shared_bytes"), (64 * mib).to_string());
    let footprint: u64 = extra("peak_footprint_bytes").parse().unwrap();
    assert!(
        footprint >= r.peak_distinct_live_bytes && footprint <= r.peak_distinct_live_bytes + 2 * 2 * mib,
        "{footprint} vs {}",
        r.peak_distinct_live_bytes
    );
}

/// A forced preemption on `ideal-contiguous`, 1000 bytes per token, a
/// capacity of 50,000 bytes. A (prompt 15, 10 tokens) and B (prompt 15,
/// 5 tokens) start with room for 16 tokens each (32,000 bytes). In step 2
/// A's tensor doubles to 32 tokens: 32,000 more do not fit, so B (admitted
/// last) is preempted after one token. B comes back when A ends and
/// recomputes its 15 + 1 tokens: 46 prompt tokens computed in all.
#[test]
fn recompute_after_a_preemption_is_charged_as_prefill() {
    let r = run("ideal-contiguous", 1000, 50_000, &[req(0.0, 15, 10, &[]), req(0.0, 15, 5, &[])]);
    assert_eq!((r.preemptions, r.completed_requests), (1, 2));
    assert_eq!(r.recomputed_tokens, 16);
    assert_eq!(r.prefill_tokens, 46);
    assert!(r.gpu_seconds >= profile().linear_s(46));
}

/// One request of 100 prompt tokens and one output token: inside its step
/// it holds 101 tokens of KV; at the end of the step it is gone.
#[test]
fn peak_live_is_instantaneous() {
    let r = run("ideal-contiguous", 1000, 1_000_000, &[req(0.0, 100, 1, &[])]);
    assert_eq!(r.peak_live_bytes, 101 * 1000);
    assert_eq!(r.peak_live_end_of_step_bytes, 0);
}

/// Bounded host memory: on a 24 GiB machine, a 1000 GiB device with 256
/// long requests at once could keep more tags resident than half the
/// machine holds, and is refused up front with the limit named; the
/// default 64 GiB run is accepted.
#[test]
fn replays_that_cannot_bound_host_memory_are_refused() {
    let ram = 24 << 30;
    let shape = KvShape { kv_bytes_per_token: 128 << 10, layers: 32, layout: Layout::TokenMajor, max_context: 131072 };
    let reqs: Vec<Request> = (0..3000).map(|i| req(i as f64, 8000, 500, &[])).collect();
    let names: Vec<String> = ["arena", "vllm-paged"].map(String::from).to_vec();
    let e = managers::check_host_memory(ram, shape, 1000 << 30, &reqs, 256, &names, true, 2).unwrap_err();
    assert!(e.contains("12.0 GiB"), "names the limit: {e}");
    managers::check_host_memory(ram, shape, 64 << 30, &reqs, 256, &names, true, 2).expect("64 GiB fits");
    // With prefix caching on a trace with hashes, every cached block counts.
    let hashed: Vec<Request> = (0..10).map(|i| req(i as f64, 1024, 10, &[i, i + 100])).collect();
    let only_vllm = vec!["vllm-paged".to_string()];
    assert!(managers::check_host_memory(ram, shape, 2000 << 30, &hashed, 256, &only_vllm, true, 1).is_err());
    managers::check_host_memory(ram, shape, 2000 << 30, &hashed, 256, &only_vllm, false, 1).expect("short requests");
}

/// The counted driver's stream events (`counted.rs`): an event recorded in
/// step k completes when the GPU has finished step k; a poll changes
/// nothing; a wait blocks only on an incomplete event and then drains the
/// GPU (every event recorded so far completes), as a synchronize does.
#[test]
fn events_complete_when_the_gpu_finishes_their_step() {
    use vmm_arena::driver::Driver;
    let dev = managers::new_device(64 << 20).unwrap();
    let e1 = dev.record_event(0).unwrap().expect("the model has streams");
    assert!(!dev.event_complete(e1).unwrap(), "not within the step that recorded it");
    assert!(!dev.event_complete(e1).unwrap(), "a poll changes nothing");
    assert_eq!(dev.events_outstanding(), (1, 1));
    dev.finish_gpu_step();
    assert!(dev.event_complete(e1).unwrap(), "the GPU finished step 0");
    // Step 1: e2 and e3; a wait on e2 blocks and drains: e3 completes too.
    let e2 = dev.record_event(0).unwrap().unwrap();
    let e3 = dev.record_event(0).unwrap().unwrap();
    dev.wait_for_event(e2).unwrap();
    assert!(dev.event_complete(e3).unwrap());
    // e4, recorded after the drain in the same step, is pending again.
    let e4 = dev.record_event(0).unwrap().unwrap();
    assert!(!dev.event_complete(e4).unwrap());
    dev.synchronize().unwrap();
    assert!(dev.event_complete(e4).unwrap(), "a synchronize drains the GPU");
    dev.wait_for_event(e1).unwrap(); // complete: does not block
    for e in [e1, e2, e3, e4] {
        dev.destroy_event(e).unwrap();
    }
    assert!(dev.destroy_event(e1).is_err() && dev.event_complete(e2).is_err(), "destroyed events are unknown");
    assert_eq!(dev.events_outstanding(), (0, 0));
    // Every call counts, the refused ones too: 7 polls (e1 three times, e3,
    // e4 twice, destroyed e2) and 5 destroys (one refused).
    let c = dev.calls();
    assert_eq!(
        (c.event_record, c.event_query, c.event_wait, c.event_wait_blocked, c.event_destroy, c.synchronize),
        (4, 7, 2, 1, 5, 1),
        "{c:?}"
    );
    assert_eq!(c.drains(), 2, "one blocking wait and one synchronize");
    assert_eq!(c.management(), 0, "events are not memory management");
}

/// The rule's event terms: event calls are priced per call; a blocking wait
/// on the critical path loses the overlap like a synchronize; a drain
/// between steps hides none of that step's between-steps driver time.
#[test]
fn drains_and_event_calls_are_charged() {
    let p = Profile { event_record_s: 3e-6, event_query_s: 0.5e-6, event_destroy_s: 1e-6, ..profile() };
    let c = Calls {
        event_record: 2,
        event_query: 4,
        event_wait: 2,
        event_wait_blocked: 1,
        event_destroy: 2,
        ..Calls::default()
    };
    // 2 x 3 + (4 + 2) x 0.5 + 2 x 1 = 11 µs.
    assert!(close(p.driver_s(&c), 11e-6), "{}", p.driver_s(&c));
    let gpu_only = StepWork { decoding: true, decode_kv_bytes: 1_000_000_000, ..Default::default() };
    assert!(close(p.step(&gpu_only).total_s, 3e-3));
    let waited = StepWork { critical_blocking_waits: 1, ..gpu_only };
    assert!(close(p.step(&waited).total_s, 4e-3), "3 ms GPU + 1 ms CPU");
    let hidden = StepWork { alloc_between_s: 2e-3, ..gpu_only };
    assert!(close(p.step(&hidden).total_s, 3e-3));
    let drained = StepWork { between_drains: 1, ..hidden };
    let t = p.step(&drained);
    assert!(close(t.total_s, 5e-3) && t.alloc_hidden_s == 0.0 && close(t.alloc_charged_s, 2e-3), "{t:?}");
}

/// A replay on an arena row with prefetch off (`precreate` and `map_ahead`
/// 0), 1 MiB of KV per token, 2 MiB chunks, a device of 4 chunks.
fn run_tight(name: &str) -> RunResult {
    let mib = 1 << 20;
    let shape = KvShape { kv_bytes_per_token: mib, layers: 1, layout: Layout::TokenMajor, max_context: 8 };
    let arena = ArenaOptions {
        precreate_bytes: 0,
        map_ahead_bytes: 0,
        ..ArenaOptions::new(8 * mib, managers::arena_reserve(shape, 8 * mib, 8))
    };
    let mut m = managers::build(name, shape, BuildOptions { arena, prefix_caching: false, max_tokens: 1 }).unwrap();
    let cfg = SchedConfig { max_batch: 8, kv_bytes_per_token: mib, profile: profile(), max_num_batched_tokens: 0 };
    let r = replay(m.as_mut(), &[req(0.0, 3, 5, &[]), req(0.0, 3, 5, &[])], &cfg, &AtomicU64::new(0));
    assert_eq!((r.integrity_errors, r.completed_requests), (0, 2), "{name}");
    r
}

/// `arena-sync` (plain free) under pressure. A and B (prompt 3, 5 tokens
/// each) are admitted with room for 4 tokens: 2 chunks each (2 creates,
/// 2 maps, one access call each), the device is full. Step 2: A needs a
/// third chunk, none is left: B (admitted last) is preempted, its 2 chunks
/// pooled, still mapped at B's address. A's retry steals one: the arena
/// synchronizes (B's kernels might still use it) and unmaps B's range (one
/// call, 2 chunks), maps one chunk and sets access. Step 4: A's fourth chunk
/// is B's other one, pooled unmapped: a map and an access call. B comes back
/// when A ends and adopts A's old, still mapped chunks: no call.
#[test]
fn plain_frees_under_pressure_synchronize_to_steal() {
    let r = run_tight("arena-sync");
    let c = r.critical_calls;
    assert_eq!(r.preemptions, 1);
    assert_eq!(
        (c.create, c.map, c.set_access, c.set_access_chunks, c.unmap, c.unmap_chunks),
        (4, 6, 4, 6, 1, 2),
        "{c:?}"
    );
    assert_eq!((r.critical_path_syncs, r.critical_path_event_waits, c.event_record), (1, 0, 0));
    assert_eq!(r.between_calls.management() + r.between_calls.drains(), 0, "nothing between steps");
}

/// The same load on `arena`: B's preemption frees it on the engine's
/// stream, and A's retry, ordered on the same stream, takes one of B's
/// chunks at once (B's queued work runs first): a map and an access call
/// at A's address, no event wait, no synchronize. The unmap of that
/// chunk's old address waits for the free's event: `maintain` makes it
/// between steps, with no synchronize. Step 4: A's
/// fourth chunk is B's other one, known idle by then: an unmap with no
/// synchronize, a map and an access call. B comes back when A ends and
/// takes A's allocation over where it is (same stream, same
/// reservation): no call. Three frees on the stream record three events.
/// One unmapped chunk on the critical path and no drain, where
/// `arena-sync` unmaps two after a synchronize: less simulated time.
#[test]
fn stream_frees_are_reused_within_their_step_on_the_same_stream() {
    let r = run_tight("arena");
    let c = r.critical_calls;
    assert_eq!(r.preemptions, 1);
    assert_eq!(
        (c.create, c.map, c.set_access, c.set_access_chunks, c.unmap, c.unmap_chunks),
        (4, 6, 4, 6, 1, 1),
        "{c:?}"
    );
    assert_eq!((r.critical_path_syncs, r.critical_path_event_waits, c.event_record), (0, 0, 3));
    assert_eq!(r.between_calls.drains(), 0, "nothing waits between steps either: {:?}", r.between_calls);
    assert_eq!((r.between_calls.unmap, r.between_calls.unmap_chunks), (1, 1), "the deferred unmap");
    let sync = run_tight("arena-sync");
    assert!(r.simulated_seconds < sync.simulated_seconds, "{} vs {}", r.simulated_seconds, sync.simulated_seconds);
}

/// `arena` with its default prefetch (4 chunks created ahead, one mapped
/// ahead of each tensor) on the one-request load of
/// `driver_calls_on_the_critical_path_are_charged`: admission still
/// creates, maps and sets access on its chunk (111 µs: nothing was ready
/// yet). Between step 1 and 2, `maintain` creates the 4 chunks and one more
/// mapped ahead of the tensor (5 creates, a map, an access call: 511 µs,
/// under the GPU's 2 ms). Step 2's growth adopts that chunk: no call; after
/// it, `maintain` maps a pooled chunk ahead and creates one to refill the
/// pool (111 µs, hidden). Step 3's free on the stream records an event.
/// So 111 µs charged instead of 222, 622 µs hidden, 7 chunks created.
/// (With a chunk mapped ahead, `--map-ahead 2MiB`, and without admission
/// map-ahead, whose windows would move pooled chunks for an admission that
/// never comes: see the test after the next ones.)
#[test]
fn prefetch_moves_driver_work_between_steps() {
    let mib = 1 << 20;
    let r = run_mapping_ahead("arena-no-admission-ahead", mib, 64 * mib, &[req(0.0, 1, 3, &[])], 0, 2 * mib);
    let decode = |kv: u64| (2e9 + kv as f64) / 1e12;
    let steps = [decode(mib) + 111e-6, decode(2 * mib), decode(3 * mib)];
    assert!(close(r.critical_path_alloc_s, 111e-6), "{}", r.critical_path_alloc_s);
    assert!(close(r.overlapped_alloc_s, 622e-6), "{}", r.overlapped_alloc_s);
    assert!(close(r.simulated_seconds, steps.iter().sum()), "{} vs {steps:?}", r.simulated_seconds);
    let (c, b) = (r.critical_calls, r.between_calls);
    assert_eq!((c.create, c.map, c.set_access, c.event_record), (1, 1, 1, 1), "{c:?}");
    assert_eq!((b.create, b.map, b.set_access, b.drains()), (6, 2, 2, 0), "{b:?}");
    assert_eq!(r.peak_physical_bytes, 14 * mib);
    assert_eq!((r.critical_path_creates, r.critical_path_creates_warm), (1, 0));
}

/// The driver tables BENCHMARKS.md's sensitivity rows use (every driver
/// call free; access and unmap priced per call) load, override exactly
/// the driver prices, and carry a source for every value they set.
#[test]
fn the_committed_driver_tables_load() {
    let base = Profile::h200();
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/profiles/");
    let zero = Profile::with_overrides(&base, &std::fs::read_to_string(format!("{dir}zero-driver-cost.json")).unwrap())
        .unwrap();
    assert_eq!((zero.create_s, zero.map_s, zero.set_access_s, zero.unmap_s, zero.release_s), (0.0, 0.0, 0.0, 0.0, 0.0));
    let call =
        Profile::with_overrides(&base, &std::fs::read_to_string(format!("{dir}per-call-access-unmap.json")).unwrap())
            .unwrap();
    assert_eq!(
        (call.set_access_s, call.set_access_call_s, call.unmap_s, call.unmap_call_s),
        (0.0, 36e-6, 0.0, 25.6e-6)
    );
    for p in [&zero, &call] {
        assert_eq!(
            (p.hbm_bytes_per_s, p.peak_flops, p.cpu_step_s),
            (base.hbm_bytes_per_s, base.peak_flops, base.cpu_step_s)
        );
        for k in ["create_s", "set_access_call_s", "unmap_s", "release_s"] {
            assert!(!p.source(k).starts_with("assumed: given by a profile file"), "{k}: {}", p.source(k));
        }
    }
    assert!(call.source("set_access_call_s").contains("bench_vmm"));
}

/// Chunked prefill, 1000 tokens a step, on vLLM's pool (no driver calls),
/// 1 KiB of KV per token: A (prompt 2500, 2 tokens) and B (prompt 300, 1
/// token) arrive at 0.
/// - step 1: A's first chunk, 1000 tokens (4 ms); the budget is spent, B
///   waits; nobody decodes;
/// - step 2: A's second chunk, 1000 tokens (4 ms);
/// - step 3: A's last 500 tokens and its first token; B is admitted into
///   the 500 left, computes its 300 and its only token: 802 tokens of
///   compute (3.208 ms), more than the read of 2800 KiB and 2 GB; B ends;
/// - step 4: A decodes its second token (2501 KiB) and ends.
#[test]
fn chunked_prefill_spreads_a_prompt_over_steps_within_the_budget() {
    let kib = 1024;
    let reqs = [req(0.0, 2500, 2, &[]), req(0.0, 300, 1, &[])];
    let r = run_chunked("vllm-paged", kib, 64 << 20, &reqs, 1000);
    let decode = |kv: u64| (2e9 + kv as f64) / 1e12;
    let steps = [4e-3, 4e-3, 3.208e-3, decode(2501 * kib)];
    assert_eq!((r.steps, r.prefill_tokens, r.output_tokens), (4, 2800, 3));
    assert!(close(r.simulated_seconds, steps.iter().sum()), "{} vs {steps:?}", r.simulated_seconds);
    // Both first tokens come at the end of step 3.
    let first = steps[..3].iter().sum::<f64>();
    assert!(close(r.ttft_mean_s, first) && close(r.ttft_p99_s, first), "{}", r.ttft_mean_s);
    assert_eq!((r.completed_requests, r.preemptions), (2, 0));
    // Whole prompts: both prefill in step 1.
    let w = run_chunked("vllm-paged", kib, 64 << 20, &reqs, 0);
    assert_eq!((w.steps, w.prefill_tokens), (2, 2800));
}

/// Chunked prefill caches a hash block once a chunk has computed it: B
/// (the same two hash blocks as A) arrives with A but is admitted only in
/// step 2, into the budget A's last chunk leaves, and then hits both
/// blocks (1008 tokens: hits stop below the last prompt token), as with
/// whole prompts. vLLM's pool and the arena (128 KiB a token: a 16-token
/// unit is one 2 MiB chunk) alike; the arena grows A's second chunk
/// between steps.
#[test]
fn chunked_prefill_hits_what_earlier_chunks_computed() {
    let kvpt = 128 << 10;
    let reqs = [req(0.0, 1024, 2, &[1, 2]), req(0.0, 1024, 2, &[1, 2])];
    for name in ["vllm-paged", "arena"] {
        let r = run_chunked(name, kvpt, 512 << 20, &reqs, 600);
        assert_eq!((r.prefix_hit_tokens, r.prefill_tokens, r.steps), (1008, 1024 + 16, 3), "{name}");
        assert_eq!((r.completed_requests, r.preemptions), (2, 0), "{name}");
        let w = run_chunked(name, kvpt, 512 << 20, &reqs, 0);
        assert_eq!((w.prefix_hit_tokens, w.prefill_tokens), (1008, 1040), "{name}: whole prompts");
        if name == "arena" {
            let prepared = r.extra.iter().find(|(k, _)| k == "prepared_growths").map(|(_, v)| v.clone());
            assert_eq!(prepared.as_deref(), Some("1"), "A's second chunk, grown between steps 1 and 2");
            assert!(r.between_calls.map_chunks > 0);
        }
    }
}

/// [`run_chunked`] with a batch limit and the prefix caches on or off.
fn run_batch(
    name: &str,
    kvpt: u64,
    capacity: u64,
    reqs: &[Request],
    budget: u64,
    batch: usize,
    prefix: bool,
) -> RunResult {
    let shape = KvShape { kv_bytes_per_token: kvpt, layers: 1, layout: Layout::TokenMajor, max_context: 4096 };
    let arena = ArenaOptions::new(capacity, managers::arena_reserve(shape, capacity, batch));
    let opts = BuildOptions { arena, prefix_caching: prefix, max_tokens: 16 };
    let mut m = managers::build(name, shape, opts).expect("manager");
    let cfg =
        SchedConfig { max_batch: batch, kv_bytes_per_token: kvpt, profile: profile(), max_num_batched_tokens: budget };
    let r = replay(m.as_mut(), reqs, &cfg, &AtomicU64::new(0));
    assert_eq!(r.integrity_errors, 0, "{name}: every tag read back");
    r
}

/// A request whose KV cannot fit even alone (4,001 tokens of 32 KiB on a
/// 64 MiB device: 2,048) is rejected with chunked prefill as with whole
/// prompts, although its first chunk fits: its own later chunk fails
/// while it runs alone. (It used to preempt itself and be admitted again
/// until the replay gave up.)
#[test]
fn a_request_larger_than_the_device_is_rejected_under_chunked_prefill() {
    let reqs = [req(0.0, 4000, 2, &[])];
    for (name, budget) in [("vllm-paged", 0), ("vllm-paged", 1000), ("arena", 0), ("arena", 1000)] {
        let r = run_batch(name, 32 << 10, 64 << 20, &reqs, budget, 8, true);
        assert_eq!((r.rejected_requests, r.completed_requests), (1, 0), "{name}, budget {budget}");
        assert!(r.aborted.is_none() && r.steps < 10, "{name}, budget {budget}: {} steps, {:?}", r.steps, r.aborted);
    }
}

/// The batch limit holds under chunked prefill: a request that ends in a
/// step holds its place until the step has run (its KV is freed then), so
/// with room for one request B waits for A's last step, as with whole
/// prompts: 3 steps.
#[test]
fn chunked_prefill_keeps_the_batch_limit() {
    let reqs = [req(0.0, 10, 2, &[]), req(0.0, 10, 1, &[])];
    for budget in [0, 1000] {
        let r = run_batch("vllm-paged", 1024, 64 << 20, &reqs, budget, 1, true);
        assert_eq!((r.steps, r.completed_requests), (3, 2), "budget {budget}");
    }
}

/// Recomputation counts only tokens computed before: B (1,500 tokens)
/// computes a first chunk of 999 beside A, cannot grow, preempts itself,
/// and comes back as memory allows; its last 501 tokens were never
/// computed before. Every prompt token is computed once, plus the
/// recomputations: prefill - recomputed = 1,000 + 1,500.
#[test]
fn recomputation_counts_only_tokens_computed_before() {
    // vLLM's pool of 2 MiB at 1 KiB a token: 127 blocks of 16 tokens.
    let reqs = [req(0.0, 1000, 50, &[]), req(0.0, 1500, 1, &[])];
    let r = run_batch("vllm-paged", 1024, 2 << 20, &reqs, 1000, 8, false);
    assert_eq!((r.completed_requests, r.rejected_requests), (2, 0));
    assert!(r.preemptions >= 1 && r.recomputed_tokens > 0, "{} preemptions", r.preemptions);
    assert_eq!(
        r.prefill_tokens - r.recomputed_tokens,
        2500,
        "{} computed, {} again",
        r.prefill_tokens,
        r.recomputed_tokens
    );
}

/// Staged admissions are for whole prompts: under chunked prefill a
/// prompt's chunks are grown between steps anyway, so `arena-staged`
/// admits as `arena` does (staging keyed by a chunk's token count, which
/// changes with every plan, gave its mapping up step after step).
#[test]
fn staging_is_off_under_chunked_prefill() {
    let reqs: Vec<Request> = (0..12).map(|i| req(0.0, 3000 + 100 * i, 20, &[i % 3 + 1, 10 + i])).collect();
    let kvpt = 128 << 10;
    let a = run_batch("arena", kvpt, 1 << 30, &reqs, 1000, 8, true);
    let s = run_batch("arena-staged", kvpt, 1 << 30, &reqs, 1000, 8, true);
    assert_eq!((s.steps, s.prefix_hit_tokens, s.preemptions), (a.steps, a.prefix_hit_tokens, a.preemptions));
    assert_eq!(s.admissions_waiting_for_kv, 0);
    let staging = s.extra.iter().find(|(k, _)| k == "staging").map(|(_, v)| v.clone());
    assert_eq!(staging.as_deref(), Some("false"));
}

/// Admission map-ahead: a request that arrives while another decodes (the
/// queue empty at the step's end, so nothing is prepared) is admitted on a
/// decode step; with the `arena` row's windows, `maintain` mapped pooled
/// chunks at its place between steps, sized to the recent admission (one
/// of 4 MiB: two chunks), so its admission maps two chunks fewer on the
/// critical path than without them.
#[test]
fn an_admission_on_a_decode_step_adopts_chunks_mapped_between_steps() {
    let mib = 1 << 20;
    let requests = [req(0.0, 2, 40, &[]), req(0.05, 6, 2, &[])];
    let with = run("arena", mib, 64 * mib, &requests);
    let without = run("arena-no-admission-ahead", mib, 64 * mib, &requests);
    // Last sized after both admissions: the 90th percentile of 4 and 8 MiB.
    assert_eq!(extra_field(&with, "admission_window_target"), format!("[{}, 1]", 8 * mib));
    assert_eq!(extra_field(&without, "admission_window_target"), "[0, 0]");
    let (w, wo) = (with.critical_calls, without.critical_calls);
    assert_eq!(wo.map_chunks - w.map_chunks, 2, "with {w:?}, without {wo:?}");
    assert!(with.between_calls.map_chunks >= without.between_calls.map_chunks + 2);
    assert_eq!(with.peak_physical_bytes, without.peak_physical_bytes, "the same chunks held");
}

/// With no chunk mapped ahead (the default), the `arena` row makes the
/// next step's decode growth between steps: a request decoding across
/// chunk boundaries (2 tokens a chunk here) maps on the critical path
/// only what its admission needs, and every later chunk between steps.
#[test]
fn decode_growth_is_made_between_steps_with_nothing_mapped_ahead() {
    let mib = 1 << 20;
    let r = run("arena-no-admission-ahead", mib, 64 * mib, &[req(0.0, 1, 8, &[])]);
    let (c, b) = (r.critical_calls, r.between_calls);
    assert_eq!(c.map_chunks, 1, "the admission's chunk only: {c:?}");
    assert!(b.map_chunks >= 4, "the growth's chunks, between steps: {b:?}");
    assert_eq!(extra_field(&r, "prepared_decode_growths"), "4");
    let ahead = run_mapping_ahead("arena-no-admission-ahead", mib, 64 * mib, &[req(0.0, 1, 8, &[])], 0, 2 * mib);
    assert_eq!(extra_field(&ahead, "prepared_decode_growths"), "0", "with a chunk mapped ahead, none");
}
