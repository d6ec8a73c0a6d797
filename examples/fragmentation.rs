//! The textbook fragmentation failure, side by side.
//!
//! Fills a device with interleaved allocations of mixed sizes (3–6 MiB),
//! frees every other one, then asks for one allocation larger than any hole
//! but well below the free total. PyTorch's caching allocator cannot serve
//! it (its holes sit inside 20 MiB segments that still hold live blocks, so
//! even releasing its cache does not help); vmm-arena serves it — from any
//! free chunks, and, when its virtual range is no larger than the device,
//! by moving allocations through remapping (no byte copied).
//!
//! ```sh
//! cargo run --release --example fragmentation [-- --capacity 256MiB --request 32MiB --json out.json]
//! ```
//!
//! Exits non-zero if vmm-arena (with moves) fails the request or any
//! allocator loses a byte.

#[path = "common/mod.rs"]
mod common;

use common::scenario;
use common::util::{fmt_bytes, json_f64, json_str, parse_size};

fn main() {
    let mut capacity = 256u64 << 20;
    let mut request = 32u64 << 20;
    let mut json: Option<String> = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |name: &str| args.next().unwrap_or_else(|| die(&format!("{name} needs a value")));
        match a.as_str() {
            "--capacity" => capacity = parse_size(&val("--capacity")).unwrap_or_else(|e| die(&e)),
            "--request" => request = parse_size(&val("--request")).unwrap_or_else(|e| die(&e)),
            "--json" => json = Some(val("--json")),
            "-h" | "--help" => {
                println!("usage: fragmentation [--capacity SIZE] [--request SIZE] [--json PATH]");
                return;
            }
            other => die(&format!("unknown option {other:?} (try --help)")),
        }
    }
    let outcomes = scenario::run_all(capacity, request);
    println!(
        "Fragmentation: {} device, allocations of 3-6 MiB until full, every other one freed, then one of {}\n",
        fmt_bytes(capacity),
        fmt_bytes(request)
    );
    println!(
        "{:<32} {:>6} {:>6} {:>12} {:>14} {:>7} {:>10}  detail",
        "allocator", "allocs", "freed", "free total", "largest hole", "moves", "outcome"
    );
    for o in &outcomes {
        println!(
            "{:<32} {:>6} {:>6} {:>12} {:>14} {:>7} {:>10}  {}",
            o.name,
            o.allocations,
            o.freed,
            fmt_bytes(o.free_total),
            fmt_bytes(o.largest_hole),
            o.moves,
            if o.succeeded { "OK" } else { "FAILED" },
            o.detail
        );
    }
    let integrity: u64 = outcomes.iter().map(|o| o.integrity_errors).sum();
    println!("\nintegrity errors (tags of surviving allocations): {integrity}");
    if let Some(path) = json {
        let items: Vec<String> = outcomes
            .iter()
            .map(|o| {
                format!(
                    "{{\"name\": {}, \"allocations\": {}, \"freed\": {}, \"free_total_bytes\": {}, \
                     \"largest_hole_bytes\": {}, \"request_bytes\": {}, \"succeeded\": {}, \"moves\": {}, \
                     \"integrity_errors\": {}, \"detail\": {}, \"free_over_request\": {}}}",
                    json_str(&o.name),
                    o.allocations,
                    o.freed,
                    o.free_total,
                    o.largest_hole,
                    o.request,
                    o.succeeded,
                    o.moves,
                    o.integrity_errors,
                    json_str(&o.detail),
                    json_f64(o.free_total as f64 / o.request as f64)
                )
            })
            .collect();
        let doc = format!("{{\"capacity_bytes\": {capacity}, \"outcomes\": [\n  {}\n]}}\n", items.join(",\n  "));
        std::fs::write(&path, doc).unwrap_or_else(|e| die(&format!("cannot write {path}: {e}")));
    }
    let arena_failed = outcomes.iter().any(|o| o.name.starts_with("arena (") && !o.succeeded)
        || outcomes.iter().any(|o| o.name == "arena" && !o.succeeded);
    if arena_failed || integrity > 0 {
        eprintln!("FAILED: vmm-arena could not serve the request, or bytes were lost");
        std::process::exit(1);
    }
}

fn die(msg: &str) -> ! {
    eprintln!("fragmentation: {msg}");
    std::process::exit(2);
}
