//! `arena-paged`: the arena's chunks as the blocks of vLLM's pool. The
//! policy is `vllm-paged`'s, so with every request arriving at once (no
//! step time can change what the scheduler sees) the two managers make the
//! same decisions: the same preemptions, prefix hits and steps. What
//! differs is memory: the arena maps a chunk when a block is first used,
//! reuses an evicted cached block where it lies, and calls the driver only
//! while its footprint grows.

use std::sync::atomic::AtomicU64;

use vmm_sim::managers::{self, ArenaOptions, BuildOptions, KvShape, Layout};
use vmm_sim::replay::{replay, RunResult, SchedConfig};
use vmm_sim::timing::Profile;
use vmm_sim::trace::Request;

const MIB: u64 = 1 << 20;

/// `requests` replayed by `name` (Llama-3-8B-shaped KV: 16 tokens of
/// 128 KiB to a 2 MiB chunk, as vLLM's blocks; max batch 8, whole
/// prompts, prefix caching on), every request completed intact.
fn replay_paged(name: &str, capacity: u64, requests: &[Request]) -> RunResult {
    replay_warm(name, capacity, 0, requests)
}

/// [`replay_paged`] with `warm` bytes mapped at start-up for arena-paged.
fn replay_warm(name: &str, capacity: u64, warm: u64, requests: &[Request]) -> RunResult {
    let shape = KvShape { kv_bytes_per_token: 128 << 10, layers: 32, layout: Layout::BlockInChunk, max_context: 8192 };
    let arena = ArenaOptions {
        paged_warm_bytes: warm,
        ..ArenaOptions::new(capacity, managers::arena_reserve(shape, capacity, 8))
    };
    let opts = BuildOptions { arena, prefix_caching: true, max_tokens: 64 };
    let mut m = managers::build(name, shape, opts).expect("manager");
    let cfg = SchedConfig {
        max_batch: 8,
        kv_bytes_per_token: shape.kv_bytes_per_token,
        profile: Profile::h200(),
        max_num_batched_tokens: 0,
    };
    let r = replay(m.as_mut(), requests, &cfg, &AtomicU64::new(0));
    assert_eq!((r.completed_requests, r.integrity_errors), (requests.len() as u64, 0), "{name}");
    r
}

/// 40 requests arriving at once, prompts of 520 to 1,119 tokens opening
/// with one of three shared 512-token system prompts, outputs of 16 to 63
/// tokens; in 160 MiB (79 usable blocks, 1,264 tokens) they preempt
/// each other and evict cached prefixes.
fn crowded() -> Vec<Request> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = |n: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % n
    };
    (0..40)
        .map(|i| {
            let prompt = 520 + next(600);
            let hashes: Vec<u64> =
                (0..prompt / 512).map(|j| if j == 0 { next(3) } else { 1000 + 10 * i + j }).collect();
            Request { arrival_s: 0.0, prompt, output: 16 + next(48), hash_ids: hashes.into() }
        })
        .collect()
}

#[test]
fn the_arena_under_the_block_pool_decides_as_vllm_does() {
    let reqs = crowded();
    let v = replay_paged("vllm-paged", 160 * MIB, &reqs);
    let a = replay_paged("arena-paged", 160 * MIB, &reqs);
    assert!(v.preemptions > 0, "the workload must preempt: {}", v.preemptions);
    assert!(v.prefix_hit_tokens > 0, "the workload must hit cached prefixes");
    let decisions = |r: &RunResult| (r.preemptions, r.prefix_hit_tokens, r.recomputed_tokens, r.steps, r.output_tokens);
    assert_eq!(decisions(&a), decisions(&v));
    let extra = |r: &RunResult, k: &str| r.extra.iter().find(|(key, _)| key == k).map(|(_, v)| v.clone());
    assert_eq!(extra(&a, "evicted_prefix_blocks"), extra(&v, "evicted_prefix_blocks"));
    assert_ne!(extra(&a, "evicted_prefix_blocks").as_deref(), Some("0"), "the workload must evict");
    // The pool is the capacity's whole chunks either way; the arena maps
    // only the blocks in use or cached.
    assert!(a.peak_physical_bytes <= v.peak_physical_bytes, "{} > {}", a.peak_physical_bytes, v.peak_physical_bytes);
}

#[test]
fn blocks_are_mapped_once_and_reused_where_they_lie() {
    let reqs = crowded();
    let a = replay_paged("arena-paged", 160 * MIB, &reqs);
    // The steps' calls (the arena's probe at creation is not a step's).
    let c = a.critical_calls.plus(&a.between_calls);
    // Every chunk the arena ever held was created and mapped once: freed
    // blocks stay mapped in the arena and evicted cached blocks are
    // reused in place, so nothing is unmapped or released while it runs.
    assert!(c.create > 0);
    assert_eq!(c.map, c.create, "{c:?}");
    assert_eq!((c.unmap, c.release), (0, 0), "{c:?}");
    assert_eq!(c.create_chunks * 2 * MIB, a.peak_physical_bytes, "{c:?}");
    // Blocks are read and written on the engine's one stream, which
    // orders a chunk's next owner after its old one: no event is recorded
    // or polled for that (each would be charged to the step).
    assert_eq!((c.event_record, c.event_query, c.event_destroy), (0, 0, 0), "{c:?}");
    // The footprint grows only while the cache fills: in the median
    // decode step, once live KV has peaked, no call.
    let w = a.warm_decode_step_calls;
    assert!(w.steps > 0);
    assert_eq!(w.total.median, 0, "{w:?}");
    assert!(w.total.zero_fraction > 0.99, "{w:?}");
}

#[test]
fn a_chunk_that_holds_no_whole_hash_tile_of_tokens_pads_to_a_power_of_two() {
    // Llama-3-70B's 320 KiB tokens: 6 fit in 2 MiB, 4 are used so that
    // blocks tile a 512-token hash block; a 20 MiB super-page holds 64.
    assert_eq!(managers::paged_block_tokens(2 * MIB, 320 << 10), Ok(4));
    assert_eq!(managers::paged_block_tokens(20 * MIB, 320 << 10), Ok(64));
    assert_eq!(managers::paged_block_tokens(2 * MIB, 128 << 10), Ok(16));
    assert!(managers::paged_block_tokens(MIB, 2 * MIB).is_err());
}

#[test]
fn a_start_up_pool_is_adopted_by_the_first_blocks_and_no_step_creates() {
    let reqs = crowded();
    let cold = replay_paged("arena-paged", 160 * MIB, &reqs);
    let warm = replay_warm("arena-paged", 160 * MIB, 160 * MIB, &reqs);
    let steps = |r: &RunResult| r.critical_calls.plus(&r.between_calls);
    assert!(steps(&cold).create > 0, "cold, the steps create the chunks");
    // Warm, the start-up pool (the capacity) serves every block: no step
    // creates or maps a chunk, and its steps are charged no driver time.
    let c = steps(&warm);
    assert_eq!((c.create, c.map, c.set_access, c.unmap, c.release), (0, 0, 0, 0, 0), "{c:?}");
    assert_eq!(warm.critical_path_alloc_s, 0.0);
    assert_eq!(warm.peak_physical_bytes, 160 * MIB);
    // The same decisions as vLLM's, whose pool is built at start-up too.
    let v = replay_paged("vllm-paged", 160 * MIB, &reqs);
    let decisions = |r: &RunResult| (r.preemptions, r.prefix_hit_tokens, r.recomputed_tokens, r.steps, r.output_tokens);
    assert_eq!(decisions(&warm), decisions(&v));
    // A pool smaller than the workload's peak: the first blocks adopt it,
    // later ones are created; nothing is created twice.
    let part = replay_warm("arena-paged", 160 * MIB, 32 * MIB, &reqs);
    let p = steps(&part);
    assert_eq!(p.create * 2 * MIB + 32 * MIB, part.peak_physical_bytes, "{p:?}");
    assert!(p.create < steps(&cold).create);
}
