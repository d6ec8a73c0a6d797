//! The report: Markdown, its JSON, and the measured prices as a profile.

use std::fmt::Write as _;

use serde::Serialize;
use vmm_sim::timing::{fit_span_cost, DriverPrices, SpanCost};

use crate::measure::{CallRow, MoveRow, PoolRow, SpanRow};
use crate::stats::{size_label, LatencyJson, Stats};
use crate::MIB;

#[derive(Default)]
pub(crate) struct Report {
    pub(crate) device: String,
    pub(crate) driver_version: i32,
    pub(crate) chunk: u64,
    pub(crate) granularity: (u64, u64),
    pub(crate) total: u64,
    pub(crate) quick: bool,
    /// The arena's probe: one `cuMemUnmap` may cover several separate mappings.
    pub(crate) unmap_spans: bool,
    pub(crate) calls: Vec<CallRow>,
    pub(crate) spans: Vec<SpanRow>,
    pub(crate) moves: Vec<MoveRow>,
    pub(crate) pool: Vec<PoolRow>,
    pub(crate) seconds: f64,
}

impl Report {
    pub(crate) fn markdown(&self) -> String {
        let mut m = String::new();
        let _ = writeln!(m, "# CUDA VMM measurements\n");
        let _ = writeln!(
            m,
            "Device: {} (driver {}.{}), total memory {} MiB, granularity minimum {} KiB / \
             recommended {} KiB, chunk {}{}. Run took {:.1} s.\n",
            self.device,
            self.driver_version / 1000,
            (self.driver_version % 1000) / 10,
            self.total / MIB,
            self.granularity.0 / 1024,
            self.granularity.1 / 1024,
            size_label(self.chunk),
            if self.quick { " (quick run)" } else { "" },
            self.seconds
        );
        let _ = writeln!(
            m,
            "Unmap of several separately mapped chunks with one `cuMemUnmap` (the arena's probe): {}.\n",
            if self.unmap_spans {
                "accepted, the arena unmaps a run with one call"
            } else {
                "refused, the arena unmaps one mapping per call (and so do the unmaps measured here)"
            }
        );
        let _ = writeln!(m, "## Driver calls, one chunk each\n");
        let _ = writeln!(m, "| call | n | median µs | p99 µs | mean µs |");
        let _ = writeln!(m, "|---|---:|---:|---:|---:|");
        for r in &self.calls {
            let s = &r.stats;
            let _ = writeln!(
                m,
                "| `{}` | {} | {:.2} | {:.2} | {:.2} |",
                r.call,
                s.ns.len(),
                s.median_us(),
                s.p99_us(),
                s.mean_us()
            );
        }
        let _ = writeln!(m, "\n## cuMemSetAccess and cuMemUnmap over spans of freshly mapped chunks\n");
        let _ = writeln!(m, "| span | n | set_access median µs | p99 µs | per chunk µs | unmap median µs | p99 µs |");
        let _ = writeln!(m, "|---|---:|---:|---:|---:|---:|---:|");
        for r in &self.spans {
            let _ = writeln!(
                m,
                "| {} chunk{} ({}) | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} |",
                r.chunks,
                if r.chunks == 1 { "" } else { "s" },
                size_label(r.chunks * self.chunk),
                r.set_access.ns.len(),
                r.set_access.median_us(),
                r.set_access.p99_us(),
                r.set_access.median_us() / r.chunks as f64,
                r.unmap.median_us(),
                r.unmap.p99_us()
            );
        }
        let _ = writeln!(m, "\n## Move by remap vs copy (cuMemcpyDtoD)\n");
        let _ = writeln!(
            m,
            "Remap = map the chunks at a second range + one `cuMemSetAccess` (the move's \
             critical path). Deferred unmap = `cuMemUnmap` of a span that size (done later, \
             at `release_retired`). Copy = `cuMemcpyDtoD` until complete.\n"
        );
        let _ = writeln!(
            m,
            "| size | n | remap median µs | remap p99 µs | deferred unmap µs | copy median µs | copy GB/s | copy / remap |"
        );
        let _ = writeln!(m, "|---|---:|---:|---:|---:|---:|---:|---:|");
        for r in &self.moves {
            let copy = r.copy.median_us();
            let _ = writeln!(
                m,
                "| {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.0} | {:.2} |",
                size_label(r.bytes),
                r.remap.ns.len(),
                r.remap.median_us(),
                r.remap.p99_us(),
                r.unmap_old.median_us(),
                copy,
                r.bytes as f64 / (copy * 1e3),
                copy / r.remap.median_us()
            );
        }
        let _ = writeln!(m, "\n## Arena alloc/free pairs on the pooled path\n");
        let _ = writeln!(m, "| size | n | pair median µs | p99 µs | driver calls |");
        let _ = writeln!(m, "|---|---:|---:|---:|---:|");
        for r in &self.pool {
            let _ = writeln!(
                m,
                "| {} | {} | {:.3} | {:.3} | {} |",
                size_label(r.bytes),
                r.pair.ns.len(),
                r.pair.median_us(),
                r.pair.p99_us(),
                r.driver_calls
            );
        }
        m
    }

    pub(crate) fn json(&self) -> String {
        let doc = ReportJson {
            status: "ok",
            device: &self.device,
            driver_version: self.driver_version,
            total_memory_bytes: self.total,
            granularity: GranularityJson { minimum: self.granularity.0, recommended: self.granularity.1 },
            chunk_bytes: self.chunk,
            quick: self.quick,
            unmap_spans_mappings: self.unmap_spans,
            seconds: self.seconds,
            calls: self.calls.iter().map(|r| CallJson { call: &r.call, latency: r.stats.json() }).collect(),
            set_access_spans: self
                .spans
                .iter()
                .map(|r| SpanJson {
                    chunks: r.chunks,
                    bytes: r.chunks * self.chunk,
                    set_access: r.set_access.json(),
                    unmap: r.unmap.json(),
                })
                .collect(),
            moves: self
                .moves
                .iter()
                .map(|r| MoveJson {
                    bytes: r.bytes,
                    remap: r.remap.json(),
                    deferred_unmap: r.unmap_old.json(),
                    copy: r.copy.json(),
                    copy_over_remap: r.copy.median_us() / r.remap.median_us(),
                })
                .collect(),
            pooled_alloc_free: self
                .pool
                .iter()
                .map(|r| PoolJson { bytes: r.bytes, alloc_free_pair: r.pair.json(), driver_calls: r.driver_calls })
                .collect(),
        };
        // Pretty: `scripts/gpu-check.sh` greps for `"status": "unsupported"` with its space.
        serde_json::to_string_pretty(&doc).expect("plain data serializes") + "\n"
    }

    /// The measured driver prices as overrides of the replay's profile
    /// (`kv_serving --profile-file`): per call (median) where the arena
    /// calls once a chunk (create, map, release), per range (reserve, an
    /// 8 GiB one), per call (synchronize), and for access and unmap the
    /// two parts fitted over the spans. The replay prices per 2 MiB: a
    /// larger chunk's per-chunk parts are scaled down to 2 MiB.
    pub(crate) fn kv_profile(&self) -> Result<String, String> {
        let median_s = |name: &str| -> Result<f64, String> {
            let r = self.calls.iter().find(|r| r.call == name).ok_or(format!("{name} was not measured"))?;
            let m = r.stats.median_us();
            if m.is_finite() {
                Ok(m * 1e-6)
            } else {
                Err(format!("{name} has no samples"))
            }
        };
        let fit = |what: &str, pick: fn(&SpanRow) -> &Stats| -> Result<SpanCost, String> {
            let pts: Vec<(u64, f64)> = self.spans.iter().map(|r| (r.chunks, pick(r).median_us() * 1e-6)).collect();
            fit_span_cost(&pts).ok_or(format!("{what} over spans: no usable samples"))
        };
        let per_2mib = (2 * MIB) as f64 / self.chunk as f64;
        let access = fit("cuMemSetAccess", |r| &r.set_access)?;
        let unmap = fit("cuMemUnmap", |r| &r.unmap)?;
        let p = DriverPrices {
            name: format!("measured: {} (driver {})", self.device, self.driver_version),
            create_s: median_s("cuMemCreate")? * per_2mib,
            map_s: median_s("cuMemMap")? * per_2mib,
            set_access_s: access.chunk_s * per_2mib,
            set_access_call_s: access.call_s,
            unmap_s: unmap.chunk_s * per_2mib,
            unmap_call_s: unmap.call_s,
            release_s: median_s("cuMemRelease")? * per_2mib,
            reserve_s: median_s("cuMemAddressReserve (8 GiB)")?,
            synchronize_s: median_s("cuCtxSynchronize (idle device)")?,
        };
        Ok(p.json())
    }
}

// The JSON layout of the report (field names are what scripts read).

#[derive(Serialize)]
struct ReportJson<'a> {
    status: &'static str,
    device: &'a str,
    driver_version: i32,
    total_memory_bytes: u64,
    granularity: GranularityJson,
    chunk_bytes: u64,
    quick: bool,
    /// The arena's probe at creation: whether one `cuMemUnmap` may cover
    /// several separately mapped chunks (else the arena unmaps one per call).
    unmap_spans_mappings: bool,
    seconds: f64,
    calls: Vec<CallJson<'a>>,
    set_access_spans: Vec<SpanJson>,
    moves: Vec<MoveJson>,
    pooled_alloc_free: Vec<PoolJson>,
}

#[derive(Serialize)]
struct GranularityJson {
    minimum: u64,
    recommended: u64,
}

#[derive(Serialize)]
struct CallJson<'a> {
    call: &'a str,
    latency: LatencyJson,
}

#[derive(Serialize)]
struct SpanJson {
    chunks: u64,
    bytes: u64,
    set_access: LatencyJson,
    unmap: LatencyJson,
}

#[derive(Serialize)]
struct MoveJson {
    bytes: u64,
    remap: LatencyJson,
    deferred_unmap: LatencyJson,
    copy: LatencyJson,
    copy_over_remap: f64,
}

#[derive(Serialize)]
struct PoolJson {
    bytes: u64,
    alloc_free_pair: LatencyJson,
    driver_calls: u64,
}

#[derive(Serialize)]
pub(crate) struct UnsupportedJson {
    pub(crate) status: &'static str,
    pub(crate) reason: String,
}
