//! The command line of the `multi_tenant` program.

use super::*;
use crate::cli_args::{parse_bytes, BackendArg};

/// Several models' KV caches share one arena as load shifts between them;
/// compares the shared arena with static per-model partitions.
#[derive(Debug, Parser)]
#[command(name = "multi_tenant")]
pub struct Cli {
    /// Tenant A's trace (Azure CSV or Mooncake JSONL); without it, synthetic Azure-like load at 5.5 req/s.
    #[arg(long, value_name = "PATH")]
    pub trace_a: Option<PathBuf>,
    /// Tenant B's trace; without it, synthetic Mooncake-like load at 3.4 req/s.
    #[arg(long, value_name = "PATH")]
    pub trace_b: Option<PathBuf>,
    /// Tenant C's trace; without it, synthetic Azure-like load at 2 req/s.
    #[arg(long, value_name = "PATH")]
    pub trace_c: Option<PathBuf>,
    /// Number of tenants.
    #[arg(long, value_name = "1|2|3", default_value_t = 2, value_parser = clap::value_parser!(u64).range(1..=3))]
    pub tenants: u64,
    /// Requests per tenant.
    #[arg(long, value_name = "N", default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..))]
    pub limit: u64,
    /// Tenant A's KV bytes per token (`320KiB`: llama3-70b).
    #[arg(long, value_name = "BYTES", default_value = "320KiB", value_parser = parse_bytes)]
    pub kv_a: u64,
    /// Tenant B's KV bytes per token (`128KiB`: llama3-8b).
    #[arg(long, value_name = "BYTES", default_value = "128KiB", value_parser = parse_bytes)]
    pub kv_b: u64,
    /// Tenant C's KV bytes per token (`512KiB`: llama2-7b).
    #[arg(long, value_name = "BYTES", default_value = "512KiB", value_parser = parse_bytes)]
    pub kv_c: u64,
    /// Seconds between tenants' starts [default: half of tenant A's arrival span].
    #[arg(long, value_name = "SECONDS")]
    pub shift: Option<f64>,
    /// Physical capacity of the device.
    #[arg(long, value_name = "BYTES", default_value = "80GiB", value_parser = parse_bytes)]
    pub capacity: u64,
    /// Chunk size; 0: 2 MiB, or the driver's recommended granularity if larger.
    #[arg(long, value_name = "BYTES", default_value = "0", value_parser = parse_bytes)]
    pub chunk: u64,
    /// Pooled memory kept after frees (beyond it chunks go back to the driver) [default: all].
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub retain: Option<u64>,
    /// Every this many simulated seconds the engine calls trim(--trim-keep); 0: never.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    pub trim_every: f64,
    /// What the periodic trim keeps pooled.
    #[arg(long, value_name = "BYTES", default_value = "4GiB", value_parser = parse_bytes)]
    pub trim_keep: u64,
    /// Simulated milliseconds per scheduler step.
    #[arg(long, value_name = "MS", default_value_t = 30.0)]
    pub step_ms: f64,
    /// Most running requests per tenant.
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_batch: u64,
    /// Phases (windows of simulated time) the table reports.
    #[arg(long, value_name = "N", default_value_t = 6)]
    pub phases: u64,
    /// Seed of the synthetic load and the tags.
    #[arg(long, value_name = "N", default_value_t = 42)]
    pub seed: u64,
    /// The arena's backend (host-sparse commits no chunk, so replays larger than RAM run).
    #[arg(long, value_enum, default_value_t = BackendArg::HostSparse)]
    pub backend: BackendArg,
    /// How engines drive the arena: stream (free on the stream, prefetch
    /// kept by maintain between steps, batch growth) or sync (as before).
    #[arg(long, value_enum, default_value_t = Mode::Stream)]
    pub mode: Mode,
    /// Stream mode: created, unmapped chunks kept pooled.
    #[arg(long, value_name = "BYTES", default_value = "8MiB", value_parser = parse_bytes)]
    pub precreate: u64,
    /// Stream mode: bytes kept mapped past each request's KV.
    #[arg(long, value_name = "BYTES", default_value = "2MiB", value_parser = parse_bytes)]
    pub map_ahead: u64,
    /// Also write the report as JSON to PATH.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// Write the arena's snapshot (for `snapshot_svg`) to PATH.
    #[arg(long, value_name = "PATH")]
    pub snapshot: Option<PathBuf>,
    /// Simulated time of the snapshot [default: the middle of the time when A and B both receive requests].
    #[arg(long, value_name = "SECONDS")]
    pub snapshot_at: Option<f64>,
}

impl Cli {
    /// The run this command line asks for.
    pub fn config(&self) -> Result<Config, String> {
        if self.step_ms.is_nan() || self.step_ms <= 0.0 {
            return Err("--step-ms must be positive".into());
        }
        let traces = [&self.trace_a, &self.trace_b, &self.trace_c];
        let kv = [self.kv_a, self.kv_b, self.kv_c];
        let names = ["A", "B", "C"];
        let models = |b: u64| match b {
            x if x == 128 * KIB => " llama3-8b",
            x if x == 320 * KIB => " llama3-70b",
            x if x == 512 * KIB => " llama2-7b",
            _ => "",
        };
        let synth = [Synthetic::AZURE, Synthetic::MOONCAKE, Synthetic { rate_per_s: 2.0, ..Synthetic::AZURE }];
        let defaults = Config::default();
        Ok(Config {
            tenants: (0..self.tenants as usize)
                .map(|i| TenantSpec {
                    name: format!("{}{}", names[i], models(kv[i])),
                    kv_bytes_per_token: kv[i],
                    source: match traces[i] {
                        Some(p) => Source::Trace(p.clone()),
                        None => Source::Synthetic(synth[i]),
                    },
                })
                .collect(),
            limit: self.limit as usize,
            shift_s: self.shift,
            capacity_bytes: self.capacity,
            chunk_bytes: self.chunk,
            retain_bytes: self.retain.unwrap_or(defaults.retain_bytes),
            trim_every_s: self.trim_every,
            trim_keep_bytes: self.trim_keep,
            step_ms: self.step_ms,
            max_batch: self.max_batch as usize,
            phases: self.phases as usize,
            seed: self.seed,
            backend: self.backend.into(),
            mode: self.mode,
            precreate_bytes: self.precreate,
            map_ahead_bytes: self.map_ahead,
            snapshot: self.snapshot.clone(),
            snapshot_at_s: self.snapshot_at,
            progress: false,
        })
    }
}

/// The `multi_tenant` program (`src/bin/multi_tenant.rs`).
pub fn main() {
    let cli = Cli::parse();
    let cfg = match cli.config() {
        Ok(c) => Config { progress: std::io::stderr().is_terminal(), ..c },
        Err(e) => Cli::command().error(clap::error::ErrorKind::ValueValidation, e).exit(),
    };
    let report = match run(&cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("multi_tenant: {e}");
            std::process::exit(1);
        }
    };
    print!("{}", report.table());
    if let Some(path) = &cli.json {
        if let Err(e) = std::fs::write(path, report.to_json()) {
            eprintln!("cannot write {}: {e}", path.display());
            std::process::exit(1);
        }
    }
    if report.integrity_errors > 0 || report.accounting_errors > 0 {
        eprintln!(
            "multi_tenant: {} integrity errors, {} accounting errors",
            report.integrity_errors, report.accounting_errors
        );
        std::process::exit(1);
    }
}
