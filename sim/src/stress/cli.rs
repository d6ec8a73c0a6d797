//! The command line of the `stress` program.

use super::*;
use crate::cli_args::{parse_bytes, BackendArg};

/// Several threads churn one arena and check every byte and every address;
/// exits non-zero on any error.
#[derive(Debug, Parser)]
#[command(name = "stress")]
pub struct Cli {
    /// Worker threads.
    #[arg(long, value_name = "N", default_value_t = 4, value_parser = clap::value_parser!(u64).range(1..))]
    pub threads: u64,
    /// How long the threads run.
    #[arg(long, value_name = "S", default_value_t = 5.0)]
    pub seconds: f64,
    /// Physical capacity (`256MiB`, `1.5G`, `512k`, plain bytes).
    #[arg(long, value_name = "BYTES", default_value = "256MiB", value_parser = parse_bytes)]
    pub capacity: u64,
    /// Reserved address space; 0: twice the capacity (tight, so implicit moves happen).
    #[arg(long, value_name = "BYTES", default_value = "0", value_parser = parse_bytes)]
    pub reserve: u64,
    /// Chunk size; 0: 2 MiB, or the driver's recommended granularity if larger.
    #[arg(long, value_name = "BYTES", default_value = "0", value_parser = parse_bytes)]
    pub chunk: u64,
    /// Largest allocation a thread asks for.
    #[arg(long, value_name = "BYTES", default_value = "16MiB", value_parser = parse_bytes)]
    pub max_alloc: u64,
    /// Most allocations a thread holds at once.
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..))]
    pub max_live: u64,
    /// Pooled memory kept after frees (beyond it chunks go back to the driver).
    #[arg(long, value_name = "BYTES", default_value = "64MiB", value_parser = parse_bytes)]
    pub retain: u64,
    /// Forbid the arena's implicit moves.
    #[arg(long)]
    pub no_implicit_moves: bool,
    /// Never pin allocations.
    #[arg(long)]
    pub no_pins: bool,
    /// Seed of the threads' random choices.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub seed: u64,
    /// The arena's backend.
    #[arg(long, value_enum, default_value_t = BackendArg::Host)]
    pub backend: BackendArg,
    /// Also write the report as JSON to PATH.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// Write the arena's snapshot (for `snapshot_svg`) to PATH at the end of the run.
    #[arg(long, value_name = "PATH")]
    pub snapshot: Option<PathBuf>,
}

impl Cli {
    /// The run this command line asks for.
    pub fn config(&self) -> Result<Config, String> {
        if self.max_alloc == 0 {
            return Err("--max-alloc must be positive".into());
        }
        Ok(Config {
            threads: self.threads as usize,
            seconds: self.seconds,
            capacity_bytes: self.capacity,
            reserve_bytes: self.reserve,
            chunk_bytes: self.chunk,
            max_alloc_bytes: self.max_alloc,
            max_live_per_thread: self.max_live as usize,
            retain_bytes: self.retain,
            no_implicit_moves: self.no_implicit_moves,
            pins: !self.no_pins,
            seed: self.seed,
            backend: self.backend.into(),
            snapshot: self.snapshot.clone(),
            progress: false,
        })
    }
}

/// The `stress` program (`src/bin/stress.rs`).
pub fn main() {
    let cli = Cli::parse();
    let cfg = match cli.config() {
        Ok(c) => Config { progress: std::io::stderr().is_terminal(), ..c },
        Err(e) => Cli::command().error(clap::error::ErrorKind::ValueValidation, e).exit(),
    };
    let json = cli.json;
    let report = match run(&cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("stress: {e}");
            std::process::exit(1);
        }
    };
    print!("{}", report.table());
    if let Some(path) = &json {
        if let Err(e) = std::fs::write(path, report.to_json()) {
            eprintln!("cannot write {}: {e}", path.display());
            std::process::exit(1);
        }
    }
    if report.errors > 0 {
        std::process::exit(1);
    }
}
