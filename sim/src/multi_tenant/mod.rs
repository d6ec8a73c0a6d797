//! Several models' KV caches share one arena as load shifts between them.
//!
//! ```text
//! multi_tenant [--trace-a PATH] [--trace-b PATH] [--trace-c PATH] [--tenants 2|3] [--limit N]
//!              [--kv-a BYTES] [--kv-b BYTES] [--kv-c BYTES] [--shift SECONDS] [--capacity BYTES]
//!              [--retain BYTES] [--trim-every SECONDS] [--trim-keep BYTES] [--step-ms MS] [--max-batch N] [--phases N] [--seed N]
//!              [--backend host|host-sparse] [--mode stream|sync] [--precreate BYTES] [--map-ahead BYTES]
//!              [--json PATH] [--snapshot PATH] [--snapshot-at SECONDS]
//! ```
//!
//! Each tenant is one model served from the same arena: every request gets a
//! growable allocation holding its KV cache (`kv bytes per token` × tokens,
//! reserved up to prompt + output tokens), grown one token per decode step and
//! freed when the request ends. A one-u64 tag is written into every token's
//! slot and all of them are verified before the free.
//!
//! Load shifts: tenant *i*'s requests arrive from `i × shift` seconds on (by
//! default `shift` is half of tenant A's arrival span), at the trace's own
//! timestamps. So A is busy first and idle later, B the reverse (and C, with
//! `--tenants 3`, last). Traces are either format of `../shared/traces/`
//! (Azure CSV: `arrived_at` s, `num_prefill_tokens`, `num_decode_tokens`;
//! Mooncake JSONL: `timestamp` ms, `input_length`, `output_length`); without
//! `--trace-X` a tenant replays seeded synthetic load (A Azure-like at 5.5
//! req/s, B Mooncake-like at 3.4 req/s, C Azure-like at 2 req/s).
//!
//! Scheduling is per tenant, the same continuous batching as `kv_serving`:
//! each 30 ms step admits waiting requests in arrival order while their
//! prompt fits (leaving 1% of the capacity as headroom), then appends one
//! token to every running request; an append that cannot be served preempts
//! that tenant's most recently admitted request (freed and re-queued).
//!
//! Printed: a per-phase table of each tenant's mapped bytes (mean / peak), the
//! pooled and held bytes and the driver creates/releases, then the shared
//! arena against static partitioning (each tenant holding its own peak, as a
//! preallocated per-model pool does): peak, time-weighted mean, and the idle
//! footprint before and after `trim(0)`.
//!
//! `--snapshot PATH` writes the arena's snapshot (`Arena::snapshot_json`, for
//! the `snapshot_svg` program) at `--snapshot-at` simulated seconds, by default
//! in the middle of the time when tenants A and B both receive requests.
//!
//! The default backend is `host-sparse` (chunks are not committed, so a
//! replay whose KV exceeds this machine's RAM still runs; only the tagged
//! pages are touched). The backend runs under the counting driver of
//! `sim/src/counted.rs`, which also models stream events: an event recorded
//! during a step completes when the GPU has finished that step (the next
//! step begins), so memory freed on the stream is not reusable within the
//! step that freed it.
//!
//! `--mode stream` (the default) drives the arena as issue 11 has engines
//! do: frees on the engine's stream (`free_on_stream`), prefetch targets
//! (`--precreate`, `--map-ahead`) kept by `maintain` between steps, while
//! the GPU computes, and each tenant's decode step grown with one
//! `resize_many`. `--mode sync` is the arena as engines drove it before:
//! plain free, no prefetch, one `resize` per request. The report counts the
//! driver calls made inside the steps (the engine's critical path) apart
//! from those made between steps, and the device synchronizes and blocking
//! event waits among them.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::time::Instant;

use clap::{CommandFactory, Parser, ValueEnum};
use serde::{Deserialize, Serialize};
use vmm_arena::driver::host::{HostDriver, HostOptions};
use vmm_arena::{Arena, ArenaConfig, Backend, Error, Id};

use crate::counted::{Calls, Counted};

mod cli;
mod load;
mod report;
mod simulate;

pub use crate::cli_args::{parse_bytes, BackendArg};
pub use cli::{main, Cli};
pub use load::{load_trace, synthetic};
pub use simulate::run;

const KIB: u64 = 1 << 10;
const GIB: u64 = 1 << 30;

/// One request of a tenant's stream (arrival relative to the stream's start).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Request {
    pub arrive_s: f64,
    pub prompt: u64,
    pub output: u64,
}

/// Seeded synthetic load: Poisson arrivals, log-normal prompt and output lengths.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Synthetic {
    pub rate_per_s: f64,
    pub prompt_median: f64,
    pub prompt_sigma: f64,
    pub prompt_max: u64,
    pub output_median: f64,
    pub output_sigma: f64,
    pub output_max: u64,
}

impl Synthetic {
    /// Azure conversation 2023: prompt median 1020 (mean 1155), output median 129 (mean 211), 5.5 req/s.
    pub const AZURE: Synthetic = Synthetic {
        rate_per_s: 5.5,
        prompt_median: 1020.0,
        prompt_sigma: 0.5,
        prompt_max: 8192,
        output_median: 129.0,
        output_sigma: 0.99,
        output_max: 2048,
    };
    /// Mooncake conversation: prompt median 6909 (mean 12035), output median 350, 3.4 req/s.
    pub const MOONCAKE: Synthetic = Synthetic {
        rate_per_s: 3.4,
        prompt_median: 6909.0,
        prompt_sigma: 1.05,
        prompt_max: 126_000,
        output_median: 350.0,
        output_sigma: 0.35,
        output_max: 1200,
    };
}

/// Where a tenant's requests come from.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    Trace(PathBuf),
    Synthetic(Synthetic),
}

/// One tenant (one model).
#[derive(Clone, Debug, PartialEq)]
pub struct TenantSpec {
    pub name: String,
    pub kv_bytes_per_token: u64,
    pub source: Source,
}

/// How the engine drives the arena (see the module documentation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    #[default]
    Stream,
    Sync,
}

/// The stream the engines' kernels run on (the model does not tell streams apart).
const ENGINE_STREAM: u64 = 0;

/// Everything a run needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub tenants: Vec<TenantSpec>,
    /// Requests per tenant.
    pub limit: usize,
    /// Seconds between tenants' starts; `None`: half of tenant A's arrival span.
    pub shift_s: Option<f64>,
    pub capacity_bytes: u64,
    pub chunk_bytes: u64,
    pub retain_bytes: u64,
    /// Every this many simulated seconds the engine calls `trim(trim_keep_bytes)`; 0: never.
    pub trim_every_s: f64,
    pub trim_keep_bytes: u64,
    pub step_ms: f64,
    pub max_batch: usize,
    pub phases: usize,
    pub seed: u64,
    pub backend: Backend,
    pub mode: Mode,
    /// `Mode::Stream`'s prefetch targets (`Arena::set_prefetch`).
    pub precreate_bytes: u64,
    pub map_ahead_bytes: u64,
    pub snapshot: Option<PathBuf>,
    /// Simulated time of the snapshot; `None`: the middle of the time when A and B both receive requests.
    pub snapshot_at_s: Option<f64>,
    /// Show a progress bar of the simulated time on standard error.
    pub progress: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            tenants: vec![
                TenantSpec {
                    name: "A llama3-70b".into(),
                    kv_bytes_per_token: 320 * KIB,
                    source: Source::Synthetic(Synthetic::AZURE),
                },
                TenantSpec {
                    name: "B llama3-8b".into(),
                    kv_bytes_per_token: 128 * KIB,
                    source: Source::Synthetic(Synthetic::MOONCAKE),
                },
            ],
            limit: 1000,
            shift_s: None,
            capacity_bytes: 80 * GIB,
            chunk_bytes: 0,
            retain_bytes: u64::MAX,
            trim_every_s: 10.0,
            trim_keep_bytes: 4 * GIB,
            step_ms: 30.0,
            max_batch: 256,
            phases: 6,
            seed: 42,
            backend: Backend::HostSparse,
            mode: Mode::Stream,
            precreate_bytes: 8 << 20,
            map_ahead_bytes: 2 << 20,
            snapshot: None,
            snapshot_at_s: None,
            progress: false,
        }
    }
}

/// Figures of one tenant.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TenantReport {
    pub name: String,
    pub source: String,
    pub kv_bytes_per_token: u64,
    pub start_s: f64,
    pub requests: u64,
    pub completed: u64,
    pub skipped_too_large: u64,
    pub preemptions: u64,
    pub tokens_written: u64,
    pub peak_mapped_bytes: u64,
    pub mean_mapped_bytes: f64,
    pub mean_queue_s: f64,
    pub max_queue_s: f64,
    pub integrity_errors: u64,
}

/// Figures of one phase (a window of simulated time).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PhaseReport {
    pub name: String,
    pub from_s: f64,
    pub to_s: f64,
    pub steps: u64,
    pub mean_mapped: Vec<f64>,
    pub peak_mapped: Vec<u64>,
    pub mean_running: Vec<f64>,
    pub peak_pooled: u64,
    pub mean_held: f64,
    pub peak_held: u64,
    pub creates: u64,
    pub releases: u64,
}

/// Everything a run measured.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Report {
    pub tenants: Vec<TenantReport>,
    pub phases: Vec<PhaseReport>,
    pub capacity_bytes: u64,
    pub chunk_bytes: u64,
    pub retain_bytes: u64,
    pub trim_every_s: f64,
    pub trim_keep_bytes: u64,
    pub periodic_trims: u64,
    pub periodic_trimmed_bytes: u64,
    pub backend: String,
    pub steps: u64,
    pub sim_seconds: f64,
    /// Arena: high-water mark of physical memory held (mapped + pooled).
    pub shared_peak_bytes: u64,
    /// Arena: time-weighted mean of held bytes.
    pub shared_mean_held: f64,
    /// Static partitioning: each tenant holds its own peak all the time.
    pub static_bytes: u64,
    pub idle_held_before_trim: u64,
    pub idle_held_after_trim: u64,
    pub trimmed_bytes: u64,
    pub moves: u64,
    pub driver_creates: u64,
    pub driver_releases: u64,
    pub driver_maps: u64,
    pub driver_unmaps: u64,
    pub driver_access_calls: u64,
    pub mode: Mode,
    /// Driver calls made inside the steps (admission, growth, free: the
    /// engines' critical path) and between them (`maintain`,
    /// `release_retired`), counted by the driver.
    pub critical_calls: Calls,
    pub between_calls: Calls,
    /// Chunk creations inside steps that needed no more KV than an earlier
    /// step (warm steps).
    pub critical_creates_warm: u64,
    /// Steps where the tenants' mapped bytes did not add up to the arena's `mapped_bytes`.
    pub accounting_errors: u64,
    pub integrity_errors: u64,
    pub wall_seconds: f64,
}
