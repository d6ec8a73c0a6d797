//! Measures the CUDA virtual memory calls the arena is built on, on a real GPU.
//!
//! ```text
//! gpu_measure [--out DIR] [--device N] [--quick]
//! ```
//!
//! Measures, with [`CudaDriver`] directly (no arena policy in the way):
//! - the latency (median, p99) of each driver call for one chunk (2 MiB, or
//!   the device's recommended granularity if larger): `cuMemCreate`,
//!   `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`,
//!   `cuMemAddressReserve` / `cuMemAddressFree` (one chunk and 8 GiB), and
//!   `cuCtxSynchronize` on an idle device;
//! - `cuMemSetAccess` (and `cuMemUnmap`) over spans of 1, 8, 64 and 512 chunks;
//! - moving 2 MiB .. 4 GiB by remapping (map the same chunks at a second
//!   reserved range + one `cuMemSetAccess`: the arena's move) against copying
//!   the same bytes with `cuMemcpyDtoD` (timed until complete), as a ratio;
//! - and, through an [`Arena`] over the same device, alloc/free pairs on the
//!   pooled path, with the driver calls they made (expected: none).
//! - and the attention kernels of `sim/gpu/attention.cu` (decode and a
//!   prefill-shaped launch over paged, token-major and per-layer KV; see
//!   `attention.rs`), checked against a CPU reference, timed with events;
//!   their efficiencies join `kv-profile.json` (`attn_eff_*`, with sources).
//!
//! Prints a Markdown report; with `--out DIR` also writes `gpu-measure.json`
//! and `gpu-measure.md` there, and `kv-profile.json`: the measured driver
//! prices as a profile for `kv_serving --profile-file` (medians; the
//! access and unmap calls split into a part per call and a part per chunk,
//! fitted over the spans, see `sim/src/timing.rs`). Where CUDA cannot run it says so and exits 0
//! (writing a JSON with `"status": "unsupported"` when `--out` is given).
//! `--quick` cuts repetitions and sizes, for a smoke run.

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use vmm_arena::driver::cuda::CudaDriver;

mod attention;
mod measure;
mod report;
mod stats;

use report::{Report, UnsupportedJson};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Measures the CUDA virtual memory calls the arena is built on; prints a
/// Markdown report (exits 0, saying so, where CUDA cannot run).
#[derive(Debug, Parser)]
#[command(name = "gpu_measure")]
struct Args {
    /// Also write gpu-measure.json and gpu-measure.md into DIR.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// CUDA device ordinal.
    #[arg(long, value_name = "N", default_value_t = 0)]
    device: i32,
    /// Fewer repetitions and sizes, for a smoke run.
    #[arg(long)]
    quick: bool,
}

fn write_out(dir: &Option<PathBuf>, json: &str, md: &str) {
    let Some(dir) = dir else { return };
    let result = std::fs::create_dir_all(dir)
        .and_then(|_| std::fs::write(dir.join("gpu-measure.json"), json))
        .and_then(|_| std::fs::write(dir.join("gpu-measure.md"), md));
    if let Err(e) = result {
        eprintln!("gpu_measure: cannot write to {}: {e}", dir.display());
        std::process::exit(1);
    }
}

fn main() {
    let args = Args::parse();
    let driver = match CudaDriver::new(args.device) {
        Ok(d) => d,
        Err(e) => {
            println!("gpu_measure: CUDA is unsupported here, nothing measured: {e}");
            let doc = UnsupportedJson { status: "unsupported", reason: e.to_string() };
            let json = serde_json::to_string_pretty(&doc).expect("plain data serializes") + "\n";
            let md = format!("# CUDA VMM measurements\n\nNot run: CUDA is unsupported here: {e}\n");
            write_out(&args.out, &json, &md);
            return;
        }
    };
    let mut report = Report {
        device: driver.device_name().to_string(),
        driver_version: driver.driver_version(),
        quick: args.quick,
        ..Report::default()
    };
    let start = Instant::now();
    if let Err(e) = measure::run(&driver, args.device, args.quick, &mut report) {
        eprintln!("gpu_measure: a driver call failed: {e}");
        std::process::exit(1);
    }
    // The attention kernels: a failure here (no module loading, say) leaves
    // the driver figures standing, and says why.
    // cudarc panics on a function the loaded libcuda lacks: that is a
    // "not measured" too.
    let attn = std::panic::catch_unwind(|| attention::measure(args.device, args.quick))
        .unwrap_or_else(|_| Err("the driver library lacks a function the kernels need (see the panic above)".into()));
    report.seconds = start.elapsed().as_secs_f64();
    let mut md = report.markdown();
    md.push_str("\n## Attention kernels by KV layout (sim/gpu/attention.cu)\n\n");
    match &attn {
        Ok(m) => {
            md.push_str(&format!(
                "Outputs match the CPU reference (largest difference {:.1e}).\n\n\
                 | launch | paged us | token-major us | per-layer us |\n|---|---:|---:|---:|\n\
                 | {} | {:.1} | {:.1} | {:.1} |\n| {} | {:.1} | {:.1} | {:.1} |\n",
                m.max_error,
                m.decode,
                m.decode_s[0] * 1e6,
                m.decode_s[1] * 1e6,
                m.decode_s[2] * 1e6,
                m.prefill,
                m.prefill_s[0] * 1e6,
                m.prefill_s[1] * 1e6,
                m.prefill_s[2] * 1e6
            ));
        }
        Err(e) => md.push_str(&format!("Not measured: {e}\n")),
    }
    print!("{md}");
    write_out(&args.out, &report.json(), &md);
    if let Some(dir) = &args.out {
        match report.kv_profile() {
            Ok(p) => {
                let p = match &attn {
                    Ok(m) => with_fields(&p, m.profile_fields(&report.device)),
                    Err(_) => p,
                };
                if let Err(e) = std::fs::write(dir.join("kv-profile.json"), p) {
                    eprintln!("gpu_measure: cannot write kv-profile.json: {e}");
                    std::process::exit(1);
                }
            }
            // Measured but not fittable: the report stands; say why.
            Err(e) => eprintln!("gpu_measure: no kv-profile.json: {e}"),
        }
    }
}

/// A profile JSON object with `fields` added.
fn with_fields(json: &str, fields: Vec<(String, serde_json::Value)>) -> String {
    let mut v: serde_json::Value = serde_json::from_str(json).expect("our own JSON");
    let o = v.as_object_mut().expect("a profile is an object");
    for (k, x) in fields {
        o.insert(k, x);
    }
    serde_json::to_string_pretty(&v).expect("plain data serializes") + "\n"
}
