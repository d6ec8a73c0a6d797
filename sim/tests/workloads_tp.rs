//! The tensor-parallel managers of `kv_serving --tp` (`sim/src/tp.rs`),
//! run small under memory pressure: every shard's tags survive, every request
//! ends, the arena group never fails for fragmentation (its failures are
//! devices without room), and the per-device PyTorch models, fed the same
//! requests and the same per-device activation noise, do.

use std::sync::atomic::AtomicU64;

use vmm_sim::managers::{self, KvShape, Layout};
use vmm_sim::replay::{replay, RunResult, SchedConfig};
use vmm_sim::timing::Profile;
use vmm_sim::{tp, trace};

const MIB: u64 = 1 << 20;

fn run(name: &str, capacity: u64, noise: tp::Noise) -> RunResult {
    let shape = KvShape { kv_bytes_per_token: 64 << 10, layers: 4, layout: Layout::TokenMajor, max_context: 4096 };
    let members = 4;
    let t = trace::synthetic(100, 5);
    let reserve = managers::arena_reserve(shape, capacity, 64);
    let mut m = tp::build(name, shape, members, capacity, reserve, u64::MAX, noise).expect("manager");
    let cfg = SchedConfig {
        max_batch: 64,
        kv_bytes_per_token: shape.kv_bytes_per_token / 4,
        profile: Profile::h200(),
        max_num_batched_tokens: 0,
    };
    let r = replay(m.as_mut(), &t.requests, &cfg, &AtomicU64::new(0));
    let x = |k: &str| r.extra.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()).unwrap_or_default();
    println!(
        "{name}: done {} preempted {} frag {} failures {} by member {} bucket {} activation {} (frag {})",
        r.completed_requests,
        r.preemptions,
        r.fragmentation_failures,
        x("tp_failures"),
        x("tp_failures_by_member"),
        x("tp_bucket_failures"),
        x("tp_activation_failures"),
        x("tp_activation_fragmentation")
    );
    assert_eq!(r.integrity_errors, 0, "{name}: every shard of every token keeps its tag");
    assert_eq!(r.host_limit_failures, 0, "{name}: {:?}", r.first_host_limit);
    assert_eq!(r.completed_requests + r.rejected_requests, t.requests.len() as u64, "{name}: every request ends");
    assert!(r.peak_physical_bytes <= capacity + noise.max_bytes(), "{name}: a device above its capacity");
    r
}

#[test]
fn the_group_never_fragments_and_per_device_caching_models_do() {
    let noise = tp::Noise { mean_bytes: 24 * MIB, spread: 0.5, tensors: 4, seed: 9 };
    let capacity = 160 * MIB;
    let arena = run("arena", capacity, noise);
    let torch = run("pytorch-caching", capacity, noise);
    let x = |r: &RunResult, k: &str| r.extra.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()).unwrap();
    assert_eq!(arena.fragmentation_failures, 0, "the arena group fails only where a device lacks memory");
    assert_eq!(x(&arena, "tp_activation_fragmentation"), "0");
    assert!(torch.preemptions > 0 || torch.admission_failures > 0, "the run is under pressure");
    assert!(torch.fragmentation_failures > 0, "the per-device caching models fragment");
    assert!(arena.preemptions <= torch.preemptions);
    // A shard shape that does not split is refused.
    let odd = KvShape { kv_bytes_per_token: 100, layers: 1, layout: Layout::TokenMajor, max_context: 64 };
    assert!(tp::shard_shape(odd, 3).is_err());
    let per_layer = KvShape { layout: Layout::PerLayer, ..odd };
    assert!(tp::shard_shape(per_layer, 2).is_err());
}
