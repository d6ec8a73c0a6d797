//! The replay's step-time model: how long one continuous-batching step takes
//! on a GPU, and what each KV-cache manager adds to it.
//!
//! A step's time is
//!
//! ```text
//! mem   = weights (once a step) + decode KV / e_decode(layout)
//! comp  = linear FLOPs (2 x params a token computed, prefill and decode)
//!         + prefill attention / e_prefill(layout) + decode attention / e_decode(layout)
//! gpu   = max(mem, comp) + copies           (one fused step: roofline)
//! cpu   = cpu_step_s                        (scheduling, input preparation)
//! step  = max(gpu, cpu) + alloc_critical    no drain on the critical path
//! step  = gpu + cpu + alloc_critical        a drain on the critical path
//!         + max(0, alloc_between - gpu)     driver work between steps, beyond what the GPU hides
//!         + alloc_between                   instead, when a drain happens between steps
//! ```
//!
//! A *drain* is a call that makes the CPU wait for the GPU: a device
//! synchronize, or a wait on a stream event that has not completed yet
//! (`counted.rs` models when events complete: at the end of the step that
//! recorded them).
//!
//! - **Linear layers**: `2 × parameters` FLOPs per token computed, prompt
//!   or decode (the usual estimate for a dense decoder, see the design
//!   brief) at `prefill_mfu` of the GPU's dense BF16 peak. Recomputation
//!   after a preemption is prefill again; prompt tokens found in a prefix
//!   cache are not computed.
//! - **Attention** (`attention.rs`): causal prefill attention, a suffix
//!   over a cached prefix included, and decode attention over each
//!   decoding request's context, `4 × layers × heads × head_dim` FLOPs a
//!   (query, key) pair; decode attention also reads every decoding
//!   request's KV. Each KV layout (`attn_layout`) has an attention
//!   efficiency for prefill and one for decode that divide the attention
//!   part only (1: as fast as a dense kernel).
//! - **Roofline of a fused step**: the weights are read once a step,
//!   whatever mix of prompt chunks and decoding tokens it computes; the
//!   step takes the larger of its memory time (weights and KV at
//!   `hbm_efficiency` of the HBM bandwidth) and its compute time. Decode
//!   turns compute-bound once `2 × params × batch` FLOPs outlast the weight
//!   read.
//! - **Copies**: a device-to-device copy reads and writes its bytes:
//!   `2 × bytes / (bandwidth × hbm_efficiency)`.
//! - **Allocator time on the critical path**: every driver call a manager
//!   makes inside admission, growth or free runs on the engine thread while
//!   it prepares the step; it is priced by the profile's table. A call
//!   covering several chunks (one access call over a run, a 20 MiB segment
//!   of the caching allocator) is priced by its size: the per-2-MiB cost
//!   times the chunks it covers. That is conservative for batched calls
//!   (only per-chunk costs are published) and charges every manager alike.
//!   A profile may split `cuMemSetAccess` and `cuMemUnmap` into a part per
//!   call and a part per chunk (`set_access_call_s`, `unmap_call_s`), as
//!   `gpu_measure` fits them on a GPU (`fit_span_cost`).
//! - **Drains**: an engine overlaps its CPU work for the next step with
//!   the GPU's current one. A device synchronize, or a blocking event wait,
//!   on the critical path makes the CPU wait until the GPU drains: that step
//!   loses the overlap, and its CPU time adds to its GPU time instead of
//!   hiding under it.
//! - **Between steps**: a manager's `between_steps` hook runs while the GPU
//!   computes the step; its driver time is hidden up to that step's GPU
//!   time and only the excess is charged. A drain there makes the CPU wait
//!   for the GPU's end before its remaining calls: conservatively, none of
//!   that step's between-steps driver time is hidden then.
//! - **Concurrent driver calls**: where several threads or processes
//!   make driver calls at once (the members of a tensor-parallel group,
//!   `driver_threads`), their summed time is scaled by Amdahl's law with
//!   `driver_parallel_fraction` (`attention::concurrent_s`).
//! - **Events**: recording, polling and destroying a stream event are
//!   priced per call (`event_*_s`), wherever they happen.
//!
//! Profiles `h200` (default) and `a100` ship here, `h100` in `profile_h100.rs`; a JSON file can override
//! any field (`--profile-file`), as a number or as `{"value": x, "source":
//! "..."}`. Every constant carries its source ([`Profile::sources`]); a
//! constant without one is marked `assumed`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::attention::{causal_pairs, concurrent_s, AttentionShape, AttnLayout};
use super::counted::Calls;

/// The constants of the model. Sources are given per field.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    /// HBM bandwidth, bytes/s (H200: 4.8 TB/s; A100 80 GB: 2.0 TB/s; the
    /// vendors' data sheets, as quoted in the design brief).
    pub hbm_bytes_per_s: f64,
    /// Fraction of the bandwidth reached by streaming reads and copies
    /// (H200: about 4.3 of 4.8 TB/s reached by device copies, design brief).
    pub hbm_efficiency: f64,
    /// Dense BF16 peak, FLOP/s (H200: 989 T; A100: 312 T; data sheets).
    pub peak_flops: f64,
    /// Model FLOPs utilisation of prefill. An assumption: 0.5 is typical of
    /// large-batch prefill in published serving benchmarks; override it.
    pub prefill_mfu: f64,
    /// Model parameters (Llama-3-8B: 8.0 B, design brief).
    pub params: f64,
    /// Bytes per parameter (BF16: 2).
    pub bytes_per_param: f64,
    /// CPU time of a step (scheduling, input preparation), overlapped with
    /// the GPU unless a synchronize drains the pipeline. An assumption
    /// (a few ms is the order engines report); override it.
    pub cpu_step_s: f64,
    /// Driver costs per 2 MiB chunk, seconds (A100: kvcached's VMM
    /// benchmark, the design brief's table; no H200 figures exist yet, so
    /// the `h200` profile uses the same table until a GPU run measures one).
    pub create_s: f64,
    pub map_s: f64,
    pub set_access_s: f64,
    pub unmap_s: f64,
    /// The part of a `cuMemSetAccess` / `cuMemUnmap` call's cost paid once
    /// per call, whatever its size; the fields above are then the part that
    /// grows with each 2 MiB it covers. 0 in the shipped profiles: the
    /// published tables time one chunk per call, so they cannot tell the
    /// two parts apart, and charging all of it per chunk is the
    /// conservative reading. `gpu_measure` times both calls over spans of
    /// 1 to 512 chunks and fits the two parts (`fit_span_cost`); its
    /// `kv-profile.json` sets them.
    pub set_access_call_s: f64,
    pub unmap_call_s: f64,
    /// `cuMemRelease` was not measured by that benchmark: 0 unless overridden.
    pub release_s: f64,
    /// `cuMemAddressReserve` (once per range; 19 µs for 8 GB).
    pub reserve_s: f64,
    /// The call itself of a device synchronize (its real cost, the loss of
    /// overlap, is charged by the rule above).
    pub synchronize_s: f64,
    /// Stream events, per call: `cuEventCreate` + `cuEventRecord` (the CUDA
    /// backend creates an event per record), `cuEventQuery`, and
    /// `cuEventDestroy`; a wait's own call costs a query (its real cost, if
    /// it blocks, is the drain). Assumptions — the design brief has no event
    /// figures; these are the order of CUDA's per-call overheads (a few µs
    /// for an enqueue, under one for a query); override them.
    pub event_record_s: f64,
    pub event_query_s: f64,
    pub event_destroy_s: f64,
    /// The model's attention shape (`attention.rs`): layers, query heads,
    /// KV heads, head dimension.
    pub layers: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// The KV layout the replayed manager gives attention kernels.
    pub attn_layout: AttnLayout,
    /// Attention efficiency of each layout against a dense kernel, for
    /// decode and for prefill attention (the time of the attention part
    /// is divided by it).
    pub attn_eff_decode_token_major: f64,
    pub attn_eff_prefill_token_major: f64,
    pub attn_eff_decode_per_layer: f64,
    pub attn_eff_prefill_per_layer: f64,
    pub attn_eff_decode_paged: f64,
    pub attn_eff_prefill_paged: f64,
    /// Threads (or processes) making driver calls at once (1: none at
    /// once), and the fraction of their work that overlaps.
    pub driver_threads: u32,
    pub driver_parallel_fraction: f64,
    /// Where each constant comes from, by field name ("assumed: ..." where
    /// no measurement backs it).
    pub sources: BTreeMap<String, String>,
}

/// The built-in profiles' sources, by field.
const SOURCES: [(&str, &str); 34] = [
    ("hbm_bytes_per_s", "vendor data sheets: H200 4.8 TB/s, A100 80 GB 2.0 TB/s (design brief)"),
    ("hbm_efficiency", "H200: about 4.3 of 4.8 TB/s reached by device copies (design brief); A100: assumed 0.9"),
    ("peak_flops", "vendor data sheets: dense BF16, H200 989 TFLOPS, A100 312 TFLOPS"),
    ("prefill_mfu", "assumed: 0.5, typical of large-batch prefill in published serving benchmarks"),
    ("params", "Llama-3-8B 8.0 B (design brief); kv_serving sets the model preset's"),
    ("bytes_per_param", "BF16: 2 bytes"),
    ("cpu_step_s", "assumed: 2 ms, the order engines report for scheduling and input preparation"),
    ("create_s", "kvcached benchmarks/bench_vmm/README.md, A100 sample, 1 thread, 2 MiB pages: mem_create avg 193.32 us"),
    ("map_s", "kvcached benchmarks/bench_vmm/README.md, A100 sample: mem_map avg 1.45 us"),
    ("set_access_s", "kvcached benchmarks/bench_vmm/README.md, A100 sample: set_access avg 35.99 us, all charged per chunk"),
    ("unmap_s", "kvcached benchmarks/bench_vmm/README.md, A100 sample: mem_unmap avg 25.63 us, all charged per chunk"),
    ("set_access_call_s", "0: the published table times one chunk a call and cannot split call from chunk; per-chunk reading (PyTorch CUDACachingAllocator.cpp: map/unmap cost grows with the chunks)"),
    ("unmap_call_s", "0: as set_access_call_s"),
    ("release_s", "assumed: 25.6 us a chunk, priced as mem_unmap (no published cuMemRelease figure; gpu_measure measures it)"),
    ("reserve_s", "kvcached benchmarks/bench_vmm/README.md: address_reserve (8 GB) 19 us"),
    ("synchronize_s", "assumed: 5 us for the call itself"),
    ("event_record_s", "assumed: 3 us (cuEventCreate + cuEventRecord), the order of CUDA's enqueue overhead"),
    ("event_query_s", "assumed: 0.5 us"),
    ("event_destroy_s", "assumed: 1 us"),
    ("layers", "meta-llama/Meta-Llama-3-8B config.json: num_hidden_layers 32 (kv_serving sets the model preset's)"),
    ("heads", "meta-llama/Meta-Llama-3-8B config.json: num_attention_heads 32"),
    ("kv_heads", "meta-llama/Meta-Llama-3-8B config.json: num_key_value_heads 8"),
    ("head_dim", "meta-llama/Meta-Llama-3-8B config.json: hidden_size 4096 / 32 heads = 128"),
    ("attn_layout", "set per manager by kv_serving (vllm-paged: paged; others: --layout)"),
    ("attn_eff_decode_token_major", "assumed: 1 (unmeasured; kvcached bench_layout measured a layout of this shape at +56 % flash_fwd_splitkv time, i.e. about 0.64; gpu_measure measures it)"),
    ("attn_eff_prefill_token_major", "assumed: 1 (unmeasured; gpu_measure measures it)"),
    ("attn_eff_decode_per_layer", "assumed: 1 (one layer's tokens contiguous, as a dense kernel reads them)"),
    ("attn_eff_prefill_per_layer", "assumed: 1 (as attn_eff_decode_per_layer)"),
    ("attn_eff_decode_paged", "assumed: 1 (published: 0-10 % below dense, FlashInfer 0.2 '90 % of dense' at page size 1, flashinfer #637 1-2 %; gpu_measure measures it)"),
    ("attn_eff_prefill_paged", "assumed: 1 (flashinfer #637: 1-2 % between ragged and paged prefill; FlashAttention PR #2468 on B200: page 16/64 17-24 % slower; gpu_measure measures it)"),
    ("driver_threads", "1: the replay makes its calls from one thread; a tensor-parallel group sets its members"),
    ("driver_parallel_fraction", "kvcached benchmarks/bench_map_parallelism/README.md: 4 processes map 1.94x faster than 1 (L40S, contiguous layout; 1.11x non-contiguous); Amdahl fit f = (1 - 1/1.94) / (1 - 1/4)"),
    ("name", "profile name"),
    ("sources", "this table"),
];

impl Default for Profile {
    fn default() -> Profile {
        Profile::h200()
    }
}

/// Profile names [`Profile::named`] knows.
pub const PROFILES: [&str; 3] = ["h200", "a100", "h100"];

impl Profile {
    pub fn h200() -> Profile {
        Profile {
            name: "h200".into(),
            hbm_bytes_per_s: 4.8e12,
            hbm_efficiency: 4.3 / 4.8,
            peak_flops: 989e12,
            prefill_mfu: 0.5,
            params: 8.0e9,
            bytes_per_param: 2.0,
            cpu_step_s: 2e-3,
            create_s: 193e-6,
            map_s: 1.45e-6,
            set_access_s: 36e-6,
            unmap_s: 25.6e-6,
            set_access_call_s: 0.0,
            unmap_call_s: 0.0,
            release_s: 25.6e-6,
            reserve_s: 19e-6,
            synchronize_s: 5e-6,
            event_record_s: 3e-6,
            event_query_s: 0.5e-6,
            event_destroy_s: 1e-6,
            layers: AttentionShape::LLAMA3_8B.layers,
            heads: AttentionShape::LLAMA3_8B.heads,
            kv_heads: AttentionShape::LLAMA3_8B.kv_heads,
            head_dim: AttentionShape::LLAMA3_8B.head_dim,
            attn_layout: AttnLayout::TokenMajor,
            attn_eff_decode_token_major: 1.0,
            attn_eff_prefill_token_major: 1.0,
            attn_eff_decode_per_layer: 1.0,
            attn_eff_prefill_per_layer: 1.0,
            attn_eff_decode_paged: 1.0,
            attn_eff_prefill_paged: 1.0,
            driver_threads: 1,
            driver_parallel_fraction: (1.0 - 1.0 / 1.94) / (1.0 - 1.0 / 4.0),
            sources: SOURCES.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        }
    }

    pub fn a100() -> Profile {
        Profile {
            name: "a100".into(),
            hbm_bytes_per_s: 2.0e12,
            hbm_efficiency: 0.9,
            peak_flops: 312e12,
            ..Profile::h200()
        }
    }

    pub fn named(name: &str) -> Result<Profile, String> {
        match name {
            "h200" => Ok(Profile::h200()),
            "a100" => Ok(Profile::a100()),
            "h100" => Ok(Profile::h100()),
            other => Err(format!("unknown GPU profile {other:?} (known: {})", PROFILES.join(", "))),
        }
    }

    /// `base` with the fields of a JSON object overridden (unknown fields
    /// are an error, so a typo does not go unnoticed).
    pub fn with_overrides(base: &Profile, json: &str) -> Result<Profile, String> {
        let mut v = serde_json::to_value(base).map_err(|e| e.to_string())?;
        let o: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("profile JSON: {e}"))?;
        let serde_json::Value::Object(fields) = o else { return Err("profile JSON: not an object".into()) };
        let target = v.as_object_mut().expect("a profile serializes to an object");
        let mut sources = base.sources.clone();
        for (k, val) in fields {
            if !target.contains_key(&k) || k == "sources" {
                return Err(format!("profile JSON: unknown field {k:?}"));
            }
            // `{"value": x, "source": "..."}`, or a bare value (then assumed).
            let (val, source) = match val {
                serde_json::Value::Object(mut o) if o.contains_key("value") => {
                    let source = match o.remove("source") {
                        Some(serde_json::Value::String(s)) if !s.trim().is_empty() => s,
                        _ => return Err(format!("profile JSON: {k:?} has a value but no \"source\" string")),
                    };
                    if let Some(extra) = o.keys().find(|x| *x != "value") {
                        return Err(format!("profile JSON: {k:?}: unknown key {extra:?}"));
                    }
                    (o.remove("value").expect("checked"), source)
                }
                other => (other, "assumed: given by a profile file without a source".to_string()),
            };
            sources.insert(k.clone(), source);
            target.insert(k, val);
        }
        let mut p: Profile = serde_json::from_value(v).map_err(|e| format!("profile JSON: {e}"))?;
        p.sources = sources;
        p.check()?;
        Ok(p)
    }

    fn check(&self) -> Result<(), String> {
        let positive = [
            ("hbm_bytes_per_s", self.hbm_bytes_per_s),
            ("hbm_efficiency", self.hbm_efficiency),
            ("peak_flops", self.peak_flops),
            ("prefill_mfu", self.prefill_mfu),
            ("attn_eff_decode_token_major", self.attn_eff_decode_token_major),
            ("attn_eff_prefill_token_major", self.attn_eff_prefill_token_major),
            ("attn_eff_decode_per_layer", self.attn_eff_decode_per_layer),
            ("attn_eff_prefill_per_layer", self.attn_eff_prefill_per_layer),
            ("attn_eff_decode_paged", self.attn_eff_decode_paged),
            ("attn_eff_prefill_paged", self.attn_eff_prefill_paged),
        ];
        for (k, v) in positive {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("profile: {k} must be positive, is {v}"));
            }
        }
        let costs = [
            self.params,
            self.bytes_per_param,
            self.cpu_step_s,
            self.create_s,
            self.map_s,
            self.set_access_s,
            self.unmap_s,
            self.set_access_call_s,
            self.unmap_call_s,
            self.release_s,
            self.reserve_s,
            self.synchronize_s,
            self.event_record_s,
            self.event_query_s,
            self.event_destroy_s,
        ];
        if costs.iter().any(|v| !(v.is_finite() && *v >= 0.0)) {
            return Err("profile: sizes and costs must be finite and not negative".into());
        }
        if !(0.0..=1.0).contains(&self.driver_parallel_fraction) {
            return Err(format!(
                "profile: driver_parallel_fraction must be in [0, 1], is {}",
                self.driver_parallel_fraction
            ));
        }
        Ok(())
    }

    /// The source of field `k` ("assumed" when none is known).
    pub fn source(&self, k: &str) -> &str {
        self.sources.get(k).map_or("assumed", String::as_str)
    }

    /// Every constant with its value and source, one a line (`--help`).
    pub fn describe(&self) -> String {
        let v = serde_json::to_value(self).expect("a profile serializes");
        let mut out = String::new();
        for (k, val) in v.as_object().expect("an object") {
            if k == "sources" {
                continue;
            }
            out.push_str(&format!("  {k} = {val}\n      source: {}\n", self.source(k)));
        }
        out
    }

    /// The attention shape of the model the profile describes.
    pub fn attention_shape(&self) -> AttentionShape {
        AttentionShape { layers: self.layers, heads: self.heads, kv_heads: self.kv_heads, head_dim: self.head_dim }
    }

    /// The attention efficiencies (decode, prefill) of the profile's layout.
    pub fn attn_efficiency(&self) -> (f64, f64) {
        match self.attn_layout {
            AttnLayout::TokenMajor => (self.attn_eff_decode_token_major, self.attn_eff_prefill_token_major),
            AttnLayout::PerLayer => (self.attn_eff_decode_per_layer, self.attn_eff_prefill_per_layer),
            AttnLayout::Paged => (self.attn_eff_decode_paged, self.attn_eff_prefill_paged),
        }
    }

    fn bandwidth(&self) -> f64 {
        self.hbm_bytes_per_s * self.hbm_efficiency
    }

    fn flops_per_s(&self) -> f64 {
        self.peak_flops * self.prefill_mfu
    }

    /// Seconds of the linear layers' FLOPs for `tokens` tokens computed
    /// (prompt or decode): `2 × params` each.
    pub fn linear_s(&self, tokens: u64) -> f64 {
        tokens as f64 * 2.0 * self.params / self.flops_per_s()
    }

    /// Seconds of attention FLOPs over `pairs` (query, key) pairs at
    /// efficiency `eff`.
    pub fn attention_flops_s(&self, pairs: u64, eff: f64) -> f64 {
        pairs as f64 * self.attention_shape().flops_per_pair() / (self.flops_per_s() * eff)
    }

    /// Seconds to read the weights once.
    pub fn weights_s(&self) -> f64 {
        self.params * self.bytes_per_param / self.bandwidth()
    }

    /// Memory time of a step: the weights once (if it computes anything)
    /// and the decoding requests' KV through the layout.
    pub fn memory_s(&self, w: &StepWork) -> f64 {
        if w.prefill_tokens == 0 && !w.decoding {
            return 0.0;
        }
        let (e_dec, _) = self.attn_efficiency();
        self.weights_s() + w.decode_kv_bytes as f64 / (self.bandwidth() * e_dec)
    }

    /// Compute time of a step: linear layers, prefill and decode attention.
    pub fn compute_s(&self, w: &StepWork) -> f64 {
        let (e_dec, e_pre) = self.attn_efficiency();
        self.linear_s(w.prefill_tokens + w.decode_tokens)
            + self.attention_flops_s(w.prefill_attn_pairs, e_pre)
            + self.attention_flops_s(w.decode_context_tokens, e_dec)
    }

    /// Seconds of device-to-device copies of `bytes`.
    pub fn copy_s(&self, bytes: u64) -> f64 {
        2.0 * bytes as f64 / self.bandwidth()
    }

    /// Driver time of the calls in `c` (a difference of two snapshots).
    pub fn driver_s(&self, c: &Calls) -> f64 {
        concurrent_s(self.serial_driver_s(c), self.driver_threads, self.driver_parallel_fraction)
    }

    /// Driver time of the calls in `c` made one after another.
    pub fn serial_driver_s(&self, c: &Calls) -> f64 {
        c.create_chunks as f64 * self.create_s
            + c.map_chunks as f64 * self.map_s
            + c.set_access_chunks as f64 * self.set_access_s
            + c.unmap_chunks as f64 * self.unmap_s
            + c.set_access as f64 * self.set_access_call_s
            + c.unmap as f64 * self.unmap_call_s
            + c.release_chunks as f64 * self.release_s
            + c.reserve as f64 * self.reserve_s
            + c.synchronize as f64 * self.synchronize_s
            + c.event_record as f64 * self.event_record_s
            + (c.event_query + c.event_wait) as f64 * self.event_query_s
            + c.event_destroy as f64 * self.event_destroy_s
    }
}

/// What happened in one step, as the model needs it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepWork {
    /// Prompt tokens computed (prefill and recompute, less prefix hits).
    pub prefill_tokens: u64,
    /// (query, key) pairs of the prompt tokens computed: causal over
    /// their request's positions, a cached prefix included
    /// ([`StepWork::add_prefill`]).
    pub prefill_attn_pairs: u64,
    /// KV bytes read by the decode (every running request's stored KV).
    pub decode_kv_bytes: u64,
    pub decoding: bool,
    /// Tokens decoded, and the context they attend to (summed).
    pub decode_tokens: u64,
    pub decode_context_tokens: u64,
    /// Bytes copied by the manager on the device.
    pub copied_bytes: u64,
    /// Driver time of calls made on the critical path (admission, growth, free).
    pub alloc_critical_s: f64,
    /// Synchronizes among those calls.
    pub critical_syncs: u64,
    /// Waits on events not yet complete among those calls.
    pub critical_blocking_waits: u64,
    /// Driver time of calls made between steps (`between_steps`).
    pub alloc_between_s: f64,
    /// Drains (synchronizes, blocking waits) among the between-steps calls.
    pub between_drains: u64,
}

impl StepWork {
    /// Prompt positions `from..to` of a request computed (positions below
    /// `from` cached or computed before).
    pub fn add_prefill(&mut self, from: u64, to: u64) {
        self.prefill_tokens += to.saturating_sub(from);
        self.prefill_attn_pairs += causal_pairs(from, to);
    }

    /// One token decoded over `context` stored tokens of `kv_bytes`.
    pub fn add_decode(&mut self, context: u64, kv_bytes: u64) {
        self.decoding = true;
        self.decode_tokens += 1;
        self.decode_context_tokens += context;
        self.decode_kv_bytes += kv_bytes;
    }
}

/// A step's time and how it splits.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTime {
    pub total_s: f64,
    pub gpu_s: f64,
    /// Allocator time charged: on the critical path, plus the between-steps
    /// time the GPU did not hide.
    pub alloc_charged_s: f64,
    /// Between-steps allocator time hidden under the GPU.
    pub alloc_hidden_s: f64,
}

impl Profile {
    /// The GPU time of a step's work.
    pub fn gpu_s(&self, w: &StepWork) -> f64 {
        self.memory_s(w).max(self.compute_s(w)) + self.copy_s(w.copied_bytes)
    }

    /// The step-time rule of the module documentation.
    pub fn step(&self, w: &StepWork) -> StepTime {
        let gpu_s = self.gpu_s(w);
        let drained = w.critical_syncs + w.critical_blocking_waits > 0;
        let base = if drained { gpu_s + self.cpu_step_s } else { gpu_s.max(self.cpu_step_s) };
        let hidden = if w.between_drains > 0 { 0.0 } else { w.alloc_between_s.min(gpu_s) };
        let excess = w.alloc_between_s - hidden;
        StepTime {
            total_s: base + w.alloc_critical_s + excess,
            gpu_s,
            alloc_charged_s: w.alloc_critical_s + excess,
            alloc_hidden_s: hidden,
        }
    }
}

/// Measured driver prices (`gpu_measure`'s `kv-profile.json`), as
/// overrides of a base profile: the driver fields only, under their
/// [`Profile`] names, so [`Profile::with_overrides`] loads them.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DriverPrices {
    pub name: String,
    pub create_s: f64,
    pub map_s: f64,
    pub set_access_s: f64,
    pub set_access_call_s: f64,
    pub unmap_s: f64,
    pub unmap_call_s: f64,
    pub release_s: f64,
    pub reserve_s: f64,
    pub synchronize_s: f64,
}

impl DriverPrices {
    /// The JSON object `--profile-file` takes.
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).expect("plain data serializes") + "\n"
    }
}

/// A call's cost split into a part per call and a part per 2 MiB chunk it
/// covers.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SpanCost {
    pub call_s: f64,
    pub chunk_s: f64,
}

/// Fits `seconds = call_s + chunk_s × chunks` to measured (chunks,
/// seconds) points by least squares, neither part below 0. With one span
/// size only the two parts cannot be told apart: all of it is charged per
/// chunk, the conservative reading the shipped profiles make. `None`
/// without a point, or with a point that is not a finite, non-negative
/// time over at least one chunk.
pub fn fit_span_cost(points: &[(u64, f64)]) -> Option<SpanCost> {
    if points.is_empty() || points.iter().any(|&(n, s)| n == 0 || !(s.is_finite() && s >= 0.0)) {
        return None;
    }
    let k = points.len() as f64;
    let (sx, sy) = points.iter().fold((0.0, 0.0), |(a, b), &(n, s)| (a + n as f64, b + s));
    let (mx, my) = (sx / k, sy / k);
    let sxx: f64 = points.iter().map(|&(n, _)| (n as f64 - mx).powi(2)).sum();
    // Through the origin: every second per chunk.
    let per_chunk_only = || {
        let xy: f64 = points.iter().map(|&(n, s)| n as f64 * s).sum();
        let xx: f64 = points.iter().map(|&(n, _)| (n as f64).powi(2)).sum();
        SpanCost { call_s: 0.0, chunk_s: xy / xx }
    };
    if sxx == 0.0 {
        return Some(per_chunk_only());
    }
    let sxy: f64 = points.iter().map(|&(n, s)| (n as f64 - mx) * (s - my)).sum();
    let chunk_s = sxy / sxx;
    let call_s = my - chunk_s * mx;
    Some(if chunk_s < 0.0 {
        // Larger spans measured no dearer: the cost is all per call.
        SpanCost { call_s: my, chunk_s: 0.0 }
    } else if call_s < 0.0 {
        per_chunk_only()
    } else {
        SpanCost { call_s, chunk_s }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_replace_fields_and_refuse_unknown_ones() {
        let p = Profile::with_overrides(&Profile::h200(), r#"{"create_s": 7.6e-6, "name": "mine"}"#).unwrap();
        assert_eq!((p.create_s, p.name.as_str(), p.map_s), (7.6e-6, "mine", 1.45e-6));
        assert!(Profile::with_overrides(&Profile::h200(), r#"{"creat_s": 1}"#).unwrap_err().contains("creat_s"));
        assert!(Profile::with_overrides(&Profile::h200(), r#"{"peak_flops": 0}"#).is_err());
    }

    #[test]
    fn span_costs_split_into_a_part_per_call_and_a_part_per_chunk() {
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        // Exactly 20 µs a call plus 1 µs a chunk.
        let pts: Vec<(u64, f64)> = [1u64, 8, 64, 512].iter().map(|&n| (n, 20e-6 + n as f64 * 1e-6)).collect();
        let f = fit_span_cost(&pts).unwrap();
        assert!(close(f.call_s, 20e-6) && close(f.chunk_s, 1e-6), "{f:?}");
        // One span size: all of it per chunk.
        let f = fit_span_cost(&[(1, 36e-6), (1, 36e-6)]).unwrap();
        assert!(close(f.call_s, 0.0) && close(f.chunk_s, 36e-6), "{f:?}");
        // Large spans no dearer than small ones: all of it per call.
        let f = fit_span_cost(&[(1, 30e-6), (512, 29e-6)]).unwrap();
        assert!(close(f.call_s, 29.5e-6) && f.chunk_s == 0.0, "{f:?}");
        // A negative intercept: through the origin instead.
        let f = fit_span_cost(&[(1, 0.0), (2, 10e-6)]).unwrap();
        assert!(f.call_s == 0.0 && close(f.chunk_s, 20e-6 / 5.0), "{f:?}");
        assert_eq!(fit_span_cost(&[]), None);
        assert_eq!(fit_span_cost(&[(0, 1e-6)]), None);
        assert_eq!(fit_span_cost(&[(4, f64::NAN)]), None);
    }

    #[test]
    fn measured_prices_load_over_a_base_profile() {
        let m = DriverPrices {
            name: "measured: test".into(),
            create_s: 1e-6,
            map_s: 2e-6,
            set_access_s: 3e-6,
            set_access_call_s: 4e-6,
            unmap_s: 5e-6,
            unmap_call_s: 6e-6,
            release_s: 7e-6,
            reserve_s: 8e-6,
            synchronize_s: 9e-6,
        };
        let base = Profile::h200();
        let p = Profile::with_overrides(&base, &m.json()).unwrap();
        let got = (p.create_s, p.map_s, p.set_access_s, p.set_access_call_s, p.unmap_s, p.unmap_call_s);
        assert_eq!(got, (1e-6, 2e-6, 3e-6, 4e-6, 5e-6, 6e-6));
        assert_eq!((p.release_s, p.reserve_s, p.synchronize_s, p.name.as_str()), (7e-6, 8e-6, 9e-6, "measured: test"));
        assert_eq!(
            (p.peak_flops, p.cpu_step_s, p.event_record_s),
            (base.peak_flops, base.cpu_step_s, base.event_record_s)
        );
    }

    #[test]
    fn per_call_parts_are_charged_per_call() {
        let p = Profile {
            set_access_s: 1e-6,
            unmap_s: 2e-6,
            set_access_call_s: 10e-6,
            unmap_call_s: 20e-6,
            ..Profile::with_overrides(&Profile::h200(), include_str!("../profiles/zero-driver-cost.json")).unwrap()
        };
        let c = Calls { set_access: 2, set_access_chunks: 100, unmap: 3, unmap_chunks: 50, ..Calls::default() };
        let want = 2.0 * 10e-6 + 100.0 * 1e-6 + 3.0 * 20e-6 + 50.0 * 2e-6;
        assert!((p.driver_s(&c) - want).abs() < 1e-15, "{} vs {want}", p.driver_s(&c));
    }
}
