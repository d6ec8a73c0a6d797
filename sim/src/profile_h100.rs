//! The `h100` GPU profile of the step-time model (`timing.rs`): an H100
//! SXM5 80 GB, the GPU of the published TensorRT-LLM VMM-arena measurement
//! (NVIDIA/TensorRT-LLM pull request 15931: Llama-3.1-8B, concurrency 256)
//! that `kv_serving`'s closed-loop workload reproduces.
//!
//! Every constant's source is in [`Profile::sources`]; where a figure is
//! carried over from the H200 or A100 measurements the other profiles use,
//! the source says so and why.

use super::timing::Profile;

/// The fields whose source differs from the `h200` profile's, and theirs.
const H100_SOURCES: [(&str, &str); 13] = [
    (
        "hbm_bytes_per_s",
        "NVIDIA H100 Tensor Core GPU data sheet, H100 SXM: GPU memory 80 GB HBM3, bandwidth 3.35 TB/s",
    ),
    (
        "hbm_efficiency",
        "carried over from H200 (about 4.3 of 4.8 TB/s reached by device copies, design brief): the same GH100 \
         memory system with HBM3 instead of HBM3e; no published H100 device-copy figure is cited here",
    ),
    (
        "peak_flops",
        "NVIDIA H100 Tensor Core GPU data sheet, H100 SXM: BF16 Tensor Core 1,979 TFLOPS with sparsity, so 989 TFLOPS dense",
    ),
    ("prefill_mfu", "assumed: 0.5, as the h200 profile (typical of large-batch prefill in published serving benchmarks)"),
    ("cpu_step_s", "assumed: 2 ms, as the h200 profile (the order engines report for scheduling and input preparation)"),
    (
        "create_s",
        "carried over (as the h200 profile): kvcached benchmarks/bench_vmm/README.md, A100 sample, 2 MiB pages: \
         mem_create avg 193.32 us; driver calls are host-side driver work, no H100 figure is published; gpu_measure on an H100 replaces it",
    ),
    ("map_s", "carried over (as create_s): kvcached bench_vmm A100 sample: mem_map avg 1.45 us"),
    (
        "set_access_s",
        "carried over (as create_s): kvcached bench_vmm A100 sample: set_access avg 35.99 us, all charged per chunk",
    ),
    ("unmap_s", "carried over (as create_s): kvcached bench_vmm A100 sample: mem_unmap avg 25.63 us, all charged per chunk"),
    (
        "release_s",
        "assumed: 25.6 us a chunk, priced as mem_unmap (no published cuMemRelease figure), as the h200 profile",
    ),
    ("reserve_s", "carried over (as create_s): kvcached bench_vmm: address_reserve (8 GB) 19 us"),
    ("synchronize_s", "assumed: 5 us for the call itself, as the h200 profile"),
    (
        "driver_parallel_fraction",
        "carried over: kvcached benchmarks/bench_map_parallelism/README.md (L40S): 4 processes map 1.94x faster than 1; \
         Amdahl fit f = (1 - 1/1.94) / (1 - 1/4)",
    ),
];

impl Profile {
    /// An H100 SXM5 80 GB: its own bandwidth and peak from NVIDIA's data
    /// sheet; the rest carried over from `h200` (see the sources).
    pub fn h100() -> Profile {
        let mut p = Profile { name: "h100".into(), hbm_bytes_per_s: 3.35e12, peak_flops: 989e12, ..Profile::h200() };
        for (k, v) in H100_SOURCES {
            p.sources.insert(k.to_string(), v.to_string());
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_h100_constant_has_a_source_of_its_own_where_it_differs() {
        let p = Profile::h100();
        let h200 = Profile::h200();
        assert_eq!(p.hbm_bytes_per_s, 3.35e12);
        assert!(p.source("hbm_bytes_per_s").contains("3.35 TB/s"));
        assert!(p.source("peak_flops").contains("H100"));
        // Every field has a source, and none still names the H200's own figures as the H100's.
        let fields = serde_json::to_value(&p).unwrap();
        for k in fields.as_object().unwrap().keys() {
            assert_ne!(p.source(k), "assumed", "{k} has no source");
        }
        for (k, _) in H100_SOURCES {
            assert_ne!(p.source(k), h200.source(k), "{k}: the h100 source is its own");
        }
        assert_eq!(Profile::named("h100").unwrap(), p);
    }
}
