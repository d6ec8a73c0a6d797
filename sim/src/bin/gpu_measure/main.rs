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
//! - and the decode attention kernels of `sim/gpu/attention.cu` over five KV
//!   addressings (dense, paged, block-in-chunk, token-major, per-layer; see
//!   `attention.rs`), checked against a CPU reference, timed interleaved
//!   with events and judged against a device copy's bandwidth; the valid
//!   efficiencies join `kv-profile.json` (`attn_eff_decode_*`, with sources).
//!   A kernel that fails to load or verify makes the run exit 1 with no
//!   `attn_eff_*` written (`--kernels-optional` accepts a driver that cannot
//!   load modules at all, as the libcuda stand-in; the run says so).
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
mod attention_layout;
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
    /// Swap in a deliberately slow or broken `paged` attention kernel, to
    /// show that the checks reject it (no `attn_eff_*` is written).
    #[arg(long, value_enum, default_value = "none")]
    kernel_variant: attention_layout::Variant,
    /// A layout whose attention bandwidth is below this fraction of a device
    /// copy's is marked invalid and its efficiency not written.
    #[arg(long, default_value_t = 0.6)]
    min_bandwidth_fraction: f64,
    /// Accept a driver that cannot load modules at all (the libcuda
    /// stand-in): the kernels are reported not measured and the run exits 0.
    #[arg(long)]
    kernels_optional: bool,
    /// Measure only the attention kernels (no driver call latencies): for
    /// the GPU check's runs of the deliberately slow and broken variants.
    #[arg(long)]
    attention_only: bool,
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
    if args.attention_only {
        eprintln!("gpu_measure: --attention-only: driver call latencies not measured");
    } else if let Err(e) = measure::run(&driver, args.device, args.quick, &mut report) {
        eprintln!("gpu_measure: a driver call failed: {e}");
        std::process::exit(1);
    }
    // The attention kernels. cudarc panics on a function the loaded libcuda
    // lacks: a failure too.
    let attn = std::panic::catch_unwind(|| {
        attention::measure(args.device, args.quick, args.kernel_variant, args.min_bandwidth_fraction)
    })
    .unwrap_or_else(|_| {
        Err(attention::AttnError::Failed(
            "the driver library lacks a function the kernels need (see the panic above)".into(),
        ))
    });
    report.seconds = start.elapsed().as_secs_f64();
    let mut md = report.markdown();
    md.push_str("\n## Decode attention by KV layout (sim/gpu/attention.cu)\n\n");
    let mut failed = None;
    match &attn {
        Ok(m) => {
            md.push_str(&m.markdown());
            if args.quick {
                md.push_str("\n(--quick: K/V small enough to sit in L2; bandwidths are not judged meaningfully.)\n");
            }
            if args.kernel_variant != attention_layout::Variant::None {
                md.push_str(&format!(
                    "\nKernel variant {:?} in place of paged: no attn_eff_* written.\n",
                    args.kernel_variant
                ));
            }
        }
        Err(attention::AttnError::NoModules(e)) if args.kernels_optional => {
            md.push_str(&format!("Not measured: this driver cannot load modules ({e}).\n"))
        }
        Err(attention::AttnError::NoModules(e) | attention::AttnError::Failed(e)) => {
            md.push_str(&format!("FAILED: {e}\n"));
            failed = Some(e.clone());
        }
    }
    write_out(&args.out, &report.json(), &md);
    if let Some(dir) = &args.out {
        match report.kv_profile() {
            Ok(p) => {
                let p = match &attn {
                    Ok(m) if args.kernel_variant == attention_layout::Variant::None => {
                        with_fields(&p, m.profile_fields(&report.device))
                    }
                    _ => p,
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
    if let Some(e) = failed {
        eprintln!("gpu_measure: the attention kernels failed: {e}");
        std::process::exit(1);
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
