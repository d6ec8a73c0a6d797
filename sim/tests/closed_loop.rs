//! The anchor workload's parts (issue 38): the fixed-length prompt
//! generator with shared system prompts, the closed-loop client, and the
//! arena at super-page chunk sizes through the replay.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;

use vmm_sim::fixed_workload::{FixedWorkload, UNIQUE_ID_BASE};
use vmm_sim::managers::{self, ArenaOptions, BuildOptions, KvShape, Layout};
use vmm_sim::replay::{replay_arrivals, Arrivals, RunResult, SchedConfig};
use vmm_sim::timing::Profile;
use vmm_sim::trace::Request;

const MIB: u64 = 1 << 20;

fn workload(requests: usize, shared_prompts: u64) -> FixedWorkload {
    FixedWorkload { requests, prompt_tokens: 1024, output_tokens: 24, shared_prompts, shared_tokens: 512, seed: 5 }
}

#[test]
fn fixed_prompts_have_their_lengths_and_share_only_the_system_prompts() {
    let n = 300;
    let t = workload(n, 15).trace().unwrap();
    assert_eq!(t.requests.len(), n);
    let mut system: HashMap<u64, usize> = HashMap::new();
    let mut own: HashSet<u64> = HashSet::new();
    for q in &t.requests {
        assert_eq!((q.prompt, q.output, q.arrival_s), (1024, 24, 0.0));
        assert_eq!(q.hash_ids.len(), 2, "two blocks of 512 tokens");
        assert!(q.hash_ids[0] < UNIQUE_ID_BASE, "the first block is a system prompt's");
        *system.entry(q.hash_ids[0]).or_default() += 1;
        assert!(q.hash_ids[1] >= UNIQUE_ID_BASE);
        assert!(own.insert(q.hash_ids[1]), "a request's own block is no other's");
    }
    assert_eq!(system.len(), 15, "every one of the 15 system prompts is drawn");
    assert!(system.values().all(|&c| c >= 5), "drawn roughly uniformly: {system:?}");

    let u = workload(n, 0).trace().unwrap();
    let ids: HashSet<u64> = u.requests.iter().flat_map(|q| q.hash_ids.iter().copied()).collect();
    assert_eq!(ids.len(), 2 * n, "unique prompts share no block");
    assert!(ids.iter().all(|&i| i >= UNIQUE_ID_BASE));

    // The same seed gives the same workload; bad shapes are refused.
    assert_eq!(workload(n, 15).trace().unwrap().requests, t.requests);
    assert!(FixedWorkload { shared_tokens: 500, ..workload(4, 15) }.trace().is_err(), "not whole hash blocks");
    assert!(FixedWorkload { shared_tokens: 1024, ..workload(4, 15) }.trace().is_err(), "nothing of its own");
    assert!(FixedWorkload { output_tokens: 0, ..workload(4, 0) }.trace().is_err());
}

/// Llama-3-8B's 128 KiB a token, token-major.
fn shape() -> KvShape {
    KvShape { kv_bytes_per_token: 128 << 10, layers: 32, layout: Layout::TokenMajor, max_context: 4096 }
}

fn run(name: &str, chunk: u64, capacity: u64, requests: &[Request], arrivals: Arrivals) -> RunResult {
    let s = shape();
    let batch = 64;
    let arena = ArenaOptions {
        chunk_bytes: chunk,
        ..ArenaOptions::new(capacity, managers::arena_reserve_for_chunk(s, capacity, batch, chunk.max(2 * MIB)))
    };
    let opts = BuildOptions { arena, prefix_caching: true, max_tokens: 64 };
    let mut m = managers::build(name, s, opts).expect("manager");
    let cfg = SchedConfig {
        max_batch: batch,
        kv_bytes_per_token: s.kv_bytes_per_token,
        profile: Profile::h100(),
        max_num_batched_tokens: 0,
    };
    let r = replay_arrivals(m.as_mut(), requests, &cfg, arrivals, &AtomicU64::new(0));
    assert_eq!(r.integrity_errors, 0, "{name}: integrity errors");
    assert!(r.aborted.is_none(), "{name}: {:?}", r.aborted);
    assert_eq!(r.host_limit_failures, 0, "{name}: {:?}", r.first_host_limit);
    r
}

fn extra<'a>(r: &'a RunResult, k: &str) -> &'a str {
    r.extra.iter().find(|(x, _)| x == k).map_or("", |(_, v)| v.as_str())
}

#[test]
#[cfg_attr(miri, ignore)] // host backend: system calls
fn a_closed_loop_never_exceeds_its_concurrency_and_finishes_every_request() {
    let n = 40;
    let t = FixedWorkload { output_tokens: 200, ..workload(n, 15) }.trace().unwrap();
    // 8 requests of up to 1,224 tokens need 1.2 GiB, about 700 MiB where
    // their system prompts are shared: 512 MiB preempts.
    let capacity = 512 * MIB;
    for name in ["arena", "vllm-paged"] {
        let r = run(name, 0, capacity, &t.requests, Arrivals::ClosedLoop { concurrency: 8 });
        assert_eq!(r.peak_in_system, 8, "{name}: the client keeps exactly 8 in the system");
        assert_eq!(r.completed_requests, n as u64, "{name}: every request done");
        assert_eq!(r.output_tokens, 200 * n as u64, "{name}");
        assert!(r.preemptions > 0, "{name}: the capacity is below the demand");
        assert!(r.first_admission_hit_tokens > 0, "{name}: the system prompts are found cached");
        // Open loop, everything at time 0: the whole trace waits at once.
        let open = run(name, 0, capacity, &t.requests, Arrivals::Trace);
        assert_eq!(open.peak_in_system, n as u64, "{name}");
        assert_eq!(open.completed_requests, n as u64, "{name}");
    }
    // Unique prompts: nothing is found cached on first admission.
    let u = workload(n, 0).trace().unwrap();
    let r = run("arena", 0, capacity, &u.requests, Arrivals::ClosedLoop { concurrency: 8 });
    assert_eq!((r.completed_requests, r.first_admission_hit_tokens), (n as u64, 0));
}

#[test]
#[cfg_attr(miri, ignore)] // host backend: system calls
fn the_arena_replays_at_every_super_page_size() {
    let n = 24;
    let t = workload(n, 3).trace().unwrap();
    for mib in [4, 8, 16, 20] {
        let chunk = mib * MIB;
        let r = run("arena", chunk, 1024 * MIB, &t.requests, Arrivals::ClosedLoop { concurrency: 6 });
        assert_eq!(r.completed_requests, n as u64, "{mib} MiB");
        assert_eq!(r.peak_physical_bytes % chunk, 0, "{mib} MiB: whole chunks");
        assert_eq!(extra(&r, "chunk_bytes"), chunk.to_string(), "{mib} MiB: the arena's chunk");
        // A unit of one chunk (32, 64, 128 tokens) tiles a 512-token hash
        // block; a 20 MiB chunk's 160 tokens do not, so no prefix cache.
        let on = mib != 20;
        assert_eq!(
            extra(&r, "arena_prefix_caching").contains("\"on\""),
            on,
            "{mib} MiB: {}",
            extra(&r, "arena_prefix_caching")
        );
        assert_eq!(r.first_admission_hit_tokens > 0, on, "{mib} MiB");
    }
}
