//! The step-time model's attention, roofline, layout, release and
//! contention terms, against expectations computed by hand.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use vmm_sim::attention::{causal_pairs, AttnLayout};
use vmm_sim::counted::Calls;
use vmm_sim::managers::{self, ArenaOptions, BuildOptions, KvShape, Layout};
use vmm_sim::replay::{replay, SchedConfig};
use vmm_sim::timing::{Profile, StepWork};
use vmm_sim::trace::Request;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * b.abs().max(1e-9)
}

/// Round numbers: 1 TB/s, 5e14 FLOP/s reached (1 PFLOP/s at MFU 0.5), a
/// 1 B parameter model in BF16 (2 GB of weights: 2 ms to read; 4 µs of
/// linear FLOPs a token), and Llama-3-8B's attention shape: 4 x 32 x 32 x
/// 128 = 524,288 FLOPs a (query, key) pair, 1.048576 ns each.
fn profile() -> Profile {
    Profile {
        hbm_bytes_per_s: 1e12,
        hbm_efficiency: 1.0,
        peak_flops: 1e15,
        prefill_mfu: 0.5,
        params: 1e9,
        bytes_per_param: 2.0,
        cpu_step_s: 1e-3,
        ..Profile::h200()
    }
}

const PAIR_S: f64 = 524_288.0 / 5e14;

#[test]
fn causal_prefill_attention_adds_to_the_linear_layers() {
    let p = profile();
    // 1000 prompt tokens, nothing cached: 1000 x 4 µs + 500,500 pairs.
    let mut w = StepWork::default();
    w.add_prefill(0, 1000);
    assert_eq!((w.prefill_tokens, w.prefill_attn_pairs), (1000, 500_500));
    assert!(close(p.compute_s(&w), 4e-3 + 500_500.0 * PAIR_S), "{}", p.compute_s(&w));
    // The weights are read too (2 ms), under the compute.
    assert!(close(p.gpu_s(&w), 4e-3 + 500_500.0 * PAIR_S));
    // The last 600 over a cached prefix of 400: they attend to 401..=1000
    // keys, 500,500 - 80,200 = 420,300 pairs.
    let mut s = StepWork::default();
    s.add_prefill(400, 1000);
    assert_eq!((s.prefill_tokens, s.prefill_attn_pairs), (600, 420_300));
    assert_eq!(causal_pairs(400, 1000), 420_300);
    assert!(close(p.compute_s(&s), 600.0 * 4e-6 + 420_300.0 * PAIR_S));
}

#[test]
fn decode_is_the_larger_of_memory_and_compute() {
    let p = profile();
    // Batch 8 at context 1000, 1 MB of KV each: memory 2 ms + 8 MB / 1 TB/s;
    // compute 8 x 4 µs + 8,000 pairs.
    let mut small = StepWork::default();
    for _ in 0..8 {
        small.add_decode(1000, 1_000_000);
    }
    assert!(close(p.memory_s(&small), 2.008e-3));
    assert!(close(p.compute_s(&small), 32e-6 + 8000.0 * PAIR_S));
    assert!(close(p.gpu_s(&small), 2.008e-3), "memory-bound");
    // Batch 1000 at context 10, 10 kB each: memory 2 ms + 10 MB / 1 TB/s =
    // 2.01 ms; compute 1000 x 4 µs + 10,000 pairs: compute-bound.
    let mut big = StepWork::default();
    for _ in 0..1000 {
        big.add_decode(10, 10_000);
    }
    assert!(close(p.gpu_s(&big), 4e-3 + 10_000.0 * PAIR_S), "{}", p.gpu_s(&big));
    // On the h200 profile with Llama-3-8B, decode turns compute-bound
    // between batch 114 and 116 (16 GB at 4.3 TB/s against 2 x 8e9 FLOPs
    // a token at 494.5 TFLOP/s: batch 115.0).
    let h = Profile::h200();
    let step = |b: u64| {
        let mut w = StepWork::default();
        for _ in 0..b {
            w.add_decode(0, 0);
        }
        (h.memory_s(&w), h.compute_s(&w))
    };
    let (m, c) = step(114);
    assert!(m > c);
    let (m, c) = step(116);
    assert!(c > m);
}

#[test]
fn a_fused_step_reads_the_weights_once() {
    let p = profile();
    // 100 prompt tokens and 4 decoding requests (context 0, 1 MB each).
    let mut w = StepWork::default();
    w.add_prefill(0, 100);
    for _ in 0..4 {
        w.add_decode(0, 1_000_000);
    }
    // Memory: 2 ms of weights once + 4 MB; compute: 104 x 4 µs + 5,050 pairs.
    assert!(close(p.memory_s(&w), 2.004e-3));
    assert!(close(p.gpu_s(&w), 2.004e-3), "not 2 ms of weights for the prefill and 2 more for the decode");
}

#[test]
fn a_layouts_efficiency_divides_the_attention_part_only() {
    let base = profile();
    let mut w = StepWork::default();
    w.add_prefill(0, 1000);
    w.add_decode(5000, 1_000_000_000);
    // Dense: memory 2 ms + 1 ms; compute 1001 x 4 µs + (500,500 + 5,000) pairs.
    let dense_compute = 1001.0 * 4e-6 + 505_500.0 * PAIR_S;
    assert!(close(base.memory_s(&w), 3e-3) && close(base.compute_s(&w), dense_compute));
    // Token-major at half a dense kernel's speed for decode and 0.8 for
    // prefill: the KV read doubles (weights do not), decode attention
    // FLOPs double, prefill attention FLOPs take 1/0.8.
    let tm = Profile { attn_eff_decode_token_major: 0.5, attn_eff_prefill_token_major: 0.8, ..base.clone() };
    assert!(close(tm.memory_s(&w), 2e-3 + 2e-3));
    assert!(close(tm.compute_s(&w), 1001.0 * 4e-6 + 500_500.0 * PAIR_S / 0.8 + 5000.0 * PAIR_S / 0.5));
    // The same constants leave a paged layout alone.
    let paged = Profile { attn_layout: AttnLayout::Paged, ..tm.clone() };
    assert!(close(paged.memory_s(&w), 3e-3) && close(paged.compute_s(&w), dense_compute));
    let paged_slow = Profile { attn_eff_decode_paged: 0.5, ..paged };
    assert!(close(paged_slow.memory_s(&w), 4e-3));
}

#[test]
fn release_is_priced_and_concurrent_calls_contend() {
    let p = Profile { create_s: 0.0, release_s: 10e-6, ..profile() };
    let c = Calls { release_chunks: 3, unmap_chunks: 1, unmap: 1, ..Calls::default() };
    // 3 releases x 10 µs + 1 unmap x 25.6 µs.
    assert!(close(p.driver_s(&c), 30e-6 + 25.6e-6), "{}", p.driver_s(&c));
    // Four threads at once: 1/1.94 of the serial time (kvcached's
    // bench_map_parallelism), not 1/4.
    let four = Profile { driver_threads: 4, ..p.clone() };
    assert!(close(four.driver_s(&c), (30e-6 + 25.6e-6) / 1.94));
    assert!(close(four.serial_driver_s(&c), p.driver_s(&c)));
}

/// The replay charges attention: one request of 1000 prompt tokens and one
/// output token on `ideal-contiguous` (no driver calls), 1000 bytes of KV
/// a token. Its only step computes 1000 prompt tokens and decodes one over
/// 1000 stored: compute 1001 x 4 µs + (500,500 + 1,000) pairs, against a
/// memory time of 2 ms + 1 MB / 1 TB/s.
#[test]
fn the_replay_charges_prefill_and_decode_attention() {
    let shape = KvShape { kv_bytes_per_token: 1000, layers: 1, layout: Layout::TokenMajor, max_context: 4096 };
    let arena = ArenaOptions::new(1 << 30, managers::arena_reserve(shape, 1 << 30, 8));
    let opts = BuildOptions { arena, prefix_caching: false, max_tokens: 16 };
    let mut m = managers::build("ideal-contiguous", shape, opts).expect("manager");
    let cfg = SchedConfig { max_batch: 8, kv_bytes_per_token: 1000, profile: profile(), max_num_batched_tokens: 0 };
    let q = Request { arrival_s: 0.0, prompt: 1000, output: 1, hash_ids: Arc::from(&[][..]) };
    let r = replay(m.as_mut(), &[q], &cfg, &AtomicU64::new(0));
    let want = 1001.0 * 4e-6 + 501_500.0 * PAIR_S;
    assert_eq!(r.steps, 1);
    assert!(close(r.simulated_seconds, want), "{} vs {want}", r.simulated_seconds);
}
