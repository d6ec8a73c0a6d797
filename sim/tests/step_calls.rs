//! Driver calls per decode step (`vmm_sim::step_calls`) on a hand-made
//! workload whose calls can be counted by hand: three requests, each
//! arriving after the one before has finished, each of 20 prompt tokens
//! and 10 output tokens (Llama-3-8B's 128 KiB per token, token-major: 16
//! tokens per 2 MiB chunk); and, with the prefix cache on, three
//! requests of unique 600-token prompts in an arena that holds one at a
//! time, each admission adopting the previous request's prefix entry in
//! place.

use std::sync::atomic::AtomicU64;

use vmm_sim::managers::{self, ArenaOptions, BuildOptions, KvShape, Layout};
use vmm_sim::replay::{replay, RunResult, SchedConfig};
use vmm_sim::timing::Profile;
use vmm_sim::trace::Request;

const GIB: u64 = 1 << 30;

/// `requests` replayed by manager `name` (Llama-3-8B-shaped KV, max batch
/// 4, h200 profile, whole prompts), every one completed intact.
fn replay_small(
    name: &str,
    capacity: u64,
    precreate_bytes: u64,
    prefix_caching: bool,
    requests: &[Request],
) -> RunResult {
    let shape = KvShape { kv_bytes_per_token: 128 << 10, layers: 32, layout: Layout::TokenMajor, max_context: 8192 };
    let arena = ArenaOptions {
        precreate_bytes,
        map_ahead_bytes: 0,
        ..ArenaOptions::new(capacity, managers::arena_reserve(shape, capacity, 4))
    };
    let opts = BuildOptions { arena, prefix_caching, max_tokens: 10 };
    let mut m = managers::build(name, shape, opts).expect("manager");
    let cfg = SchedConfig {
        max_batch: 4,
        kv_bytes_per_token: shape.kv_bytes_per_token,
        profile: Profile::h200(),
        max_num_batched_tokens: 0,
    };
    let r = replay(m.as_mut(), requests, &cfg, &AtomicU64::new(0));
    assert_eq!((r.completed_requests, r.integrity_errors), (requests.len() as u64, 0), "{name}");
    r
}

fn run(name: &str, precreate_bytes: u64) -> RunResult {
    let requests: Vec<Request> = (0..3)
        .map(|i| Request { arrival_s: 100.0 * i as f64, prompt: 20, output: 10, hash_ids: Vec::new().into() })
        .collect();
    let r = replay_small(name, GIB, precreate_bytes, false, &requests);
    assert_eq!(r.output_tokens, 30, "{name}");
    r
}

#[test]
fn vllm_makes_no_call_in_any_step() {
    // Its block pool is created and mapped whole when it is built.
    let r = run("vllm-paged", 0);
    let s = r.decode_step_calls;
    assert_eq!(s.steps, 30, "10 tokens a request, one a step, one request at a time");
    for d in s.by_kind() {
        assert_eq!((d.max, d.zero_fraction), (0, 1.0));
    }
}

#[test]
fn the_arena_calls_the_driver_only_to_admit_the_first_request() {
    // Nothing prefetched: the first admission (21 tokens: the prompt and
    // room for the first token) creates and maps 2 chunks (32 tokens, room
    // for all 30 the request stores, so its growth calls nothing). When it
    // ends, its range stays mapped in the arena's pool, and the next two
    // admissions (the same size) take it whole: no call.
    let r = run("arena", 0);
    let s = r.decode_step_calls;
    assert_eq!(s.steps, 30);
    assert!((s.total.zero_fraction - 29.0 / 30.0).abs() < 1e-12, "{:?}", s.total);
    assert_eq!((s.create.max, s.map.max), (2, 2));
    assert!(s.set_access.max >= 1);
    assert_eq!((s.unmap.max, s.release.max), (0, 0));
    assert_eq!(s.total.median, 0);
    // Warm steps: the second and third requests' (their live KV never
    // passes the first one's peak of 30 tokens); none calls the driver.
    let w = r.warm_decode_step_calls;
    assert_eq!(w.steps, 20);
    assert_eq!((w.total.max, w.total.zero_fraction), (0, 1.0));
}

#[test]
fn the_arenas_prefetch_calls_between_steps_of_the_first_request_only() {
    // With 8 MiB of chunks kept created (4 chunks), the pool is filled
    // between steps, which adds calls to the first request's steps; the
    // later requests still take the freed range whole.
    let r = run("arena", 8 << 20);
    let w = r.warm_decode_step_calls;
    assert_eq!(w.steps, 20);
    assert_eq!(w.total.max, 0, "{w:?}");
    assert!(r.decode_step_calls.total.max > 5);
}

/// A request of the prefix-cache runs: prompt tokens, output tokens,
/// hash ids.
type Req = (u64, u64, &'static [u64]);

/// `requests`, one after the other, prefix caching on, in an arena of
/// `chunks` chunks.
fn run_prefix_entries(chunks: u64, requests: &[Req]) -> RunResult {
    let requests: Vec<Request> = requests
        .iter()
        .enumerate()
        .map(|(i, &(prompt, output, hash_ids))| Request {
            arrival_s: 100.0 * i as f64,
            prompt,
            output,
            hash_ids: hash_ids.to_vec().into(),
        })
        .collect();
    replay_small("arena", chunks * (2 << 20), 0, true, &requests)
}

fn extra(r: &RunResult, k: &str) -> String {
    r.extra.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()).unwrap_or_default()
}

#[test]
fn admissions_adopt_the_previous_requests_prefix_entry_in_place() {
    // Three requests of 600 prompt tokens (one full hash block, unique to
    // each) and 10 output tokens in an arena of 48 chunks: each needs 39
    // (38 at admission), and the one before it is a prefix entry of 32
    // chunks (its hash block) with its 7 others cached in its tail.
    let r = run_prefix_entries(48, &[(600, 10, &[1000]), (600, 10, &[1001]), (600, 10, &[1002])]);
    let extra = |k: &str| extra(&r, k);
    assert_eq!(extra("take_overs"), "2", "the second and third admissions take the entry before them over");
    assert_eq!(extra("prefix_hits"), "0", "unique prompts");
    // Only the first request's steps call the driver; the entries' chunks
    // are adopted where they lie (no unmap anywhere).
    let w = r.warm_decode_step_calls;
    assert_eq!(w.steps, 20, "{w:?}");
    assert_eq!((w.total.max, w.total.zero_fraction), (0, 1.0), "{w:?}");
    assert_eq!(r.decode_step_calls.unmap.max, 0);
    // The calls by engine action add up to the driver's count, all of them
    // from the first admission and its growth.
    let phases: serde_json::Value = serde_json::from_str(&extra("arena_calls_by_phase")).expect("JSON");
    let maps: u64 = phases.as_object().expect("object").values().map(|p| p["map_chunks"].as_u64().unwrap()).sum();
    assert_eq!(maps.to_string(), extra("arena_driver_maps"));
    assert_eq!(phases["free"]["map_chunks"], 0);
    assert_eq!(phases["upkeep"]["unmap_chunks"], 0);
}

#[test]
fn with_memory_full_an_admission_takes_the_oldest_entry_over_rather_than_map_elsewhere() {
    // 80 chunks. A (600 tokens, one hash block) becomes an entry of 32
    // chunks, 7 more cached in its tail; B (300 tokens, no full hash
    // block: nothing cached) takes 20 chunks more and leaves them cached
    // where it was; C (600 tokens, another hash block) needs 38 at
    // admission: free memory (80 - 32) would serve it, but only 21 of it
    // is neither backing nor cached, so a new allocation would map chunks
    // (created or taken from B's range). It takes A's entry over instead.
    let (a, b, c): (Req, Req, Req) = ((600, 10, &[1000]), (300, 10, &[]), (600, 10, &[1002]));
    let r = run_prefix_entries(80, &[a, b, c]);
    assert_eq!(extra(&r, "take_overs"), "1", "C takes A's entry over");
    assert_eq!(extra(&r, "prefix_hits"), "0");
    // C adopts A's 32 chunks where they lie: it maps only the 7 beyond
    // them (A's tail went to B), and creates nothing.
    let ab = run_prefix_entries(80, &[a, b]);
    let count = |r: &RunResult, k: &str| extra(r, k).parse::<u64>().expect("a count");
    assert_eq!(count(&r, "arena_driver_creates"), count(&ab, "arena_driver_creates"));
    let c_maps = count(&r, "arena_driver_maps") - count(&ab, "arena_driver_maps");
    assert!(c_maps <= 39 - 32, "C mapped {c_maps} chunks");
}
