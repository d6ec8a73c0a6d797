//! The replay's step-time model: how long one continuous-batching step takes
//! on a GPU, and what each KV-cache manager adds to it.
//!
//! A step's time is
//!
//! ```text
//! gpu   = prefill + decode + copies
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
//! - **Prefill**: `2 × parameters` FLOPs per computed prompt token (the
//!   usual estimate for a dense decoder, see the design brief) at
//!   `prefill_mfu` of the GPU's dense BF16 peak. Recomputation after a
//!   preemption is prefill again; prompt tokens found in a prefix cache are
//!   not computed.
//! - **Decode**: a memory-bound roofline. Every weight and the KV of every
//!   running request are read once per step, at `hbm_efficiency` of the HBM
//!   bandwidth.
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
//! - **Events**: recording, polling and destroying a stream event are
//!   priced per call (`event_*_s`), wherever they happen.
//!
//! Profiles `h200` (default) and `a100` ship here; a JSON file can override
//! any field (`--profile-file`).

use serde::{Deserialize, Serialize};

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
}

impl Default for Profile {
    fn default() -> Profile {
        Profile::h200()
    }
}

/// Profile names [`Profile::named`] knows.
pub const PROFILES: [&str; 2] = ["h200", "a100"];

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
            release_s: 0.0,
            reserve_s: 19e-6,
            synchronize_s: 5e-6,
            event_record_s: 3e-6,
            event_query_s: 0.5e-6,
            event_destroy_s: 1e-6,
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
        for (k, val) in fields {
            if !target.contains_key(&k) {
                return Err(format!("profile JSON: unknown field {k:?}"));
            }
            target.insert(k, val);
        }
        let p: Profile = serde_json::from_value(v).map_err(|e| format!("profile JSON: {e}"))?;
        p.check()?;
        Ok(p)
    }

    fn check(&self) -> Result<(), String> {
        let positive = [
            ("hbm_bytes_per_s", self.hbm_bytes_per_s),
            ("hbm_efficiency", self.hbm_efficiency),
            ("peak_flops", self.peak_flops),
            ("prefill_mfu", self.prefill_mfu),
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
        Ok(())
    }

    fn bandwidth(&self) -> f64 {
        self.hbm_bytes_per_s * self.hbm_efficiency
    }

    /// Seconds to compute the prompt KV of `tokens` tokens.
    pub fn prefill_s(&self, tokens: u64) -> f64 {
        tokens as f64 * 2.0 * self.params / (self.peak_flops * self.prefill_mfu)
    }

    /// Seconds of one decode step reading the weights and `kv_bytes` of KV
    /// (0 when no request decodes).
    pub fn decode_s(&self, kv_bytes: u64, decoding: bool) -> f64 {
        if !decoding {
            return 0.0;
        }
        (self.params * self.bytes_per_param + kv_bytes as f64) / self.bandwidth()
    }

    /// Seconds of device-to-device copies of `bytes`.
    pub fn copy_s(&self, bytes: u64) -> f64 {
        2.0 * bytes as f64 / self.bandwidth()
    }

    /// Driver time of the calls in `c` (a difference of two snapshots).
    pub fn driver_s(&self, c: &Calls) -> f64 {
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
    /// KV bytes read by the decode (every running request's stored KV).
    pub decode_kv_bytes: u64,
    pub decoding: bool,
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
        self.prefill_s(w.prefill_tokens) + self.decode_s(w.decode_kv_bytes, w.decoding) + self.copy_s(w.copied_bytes)
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
