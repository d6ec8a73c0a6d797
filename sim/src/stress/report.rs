//! The report as a table and as JSON.

use super::*;

impl Report {
    /// The printed summary.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "stress: {} threads, {:.1} s: {} operations, {:.0} ops/s, errors {}",
            self.threads,
            self.seconds,
            self.ops,
            self.ops_per_second(),
            self.errors
        );
        let _ = writeln!(o, "{:<16} {:>12} {:>12}", "operation", "count", "per second");
        for (k, n) in &self.ops_by_kind {
            let _ = writeln!(o, "{k:<16} {n:>12} {:>12.0}", *n as f64 / self.seconds.max(1e-9));
        }
        let _ = writeln!(
            o,
            "refused (allowed): out of memory {}, out of address space {}, pinned {}",
            self.refused_out_of_memory, self.refused_out_of_address_space, self.refused_pinned
        );
        let _ = writeln!(
            o,
            "moves {} (compaction moved {}; {} compactions left a smaller largest hole), move events {}, \
             pointer checks {} ({} raced with a move, skipped)",
            self.moves,
            self.compact_moved_allocations,
            self.compact_shrank_largest_hole,
            self.move_events,
            self.pointer_checks,
            self.pointer_checks_raced
        );
        let _ = writeln!(
            o,
            "bytes written {:.1} MiB, verified {:.1} MiB; trimmed {:.1} MiB; peak physical {:.1} MiB",
            self.bytes_written as f64 / MIB as f64,
            self.bytes_verified as f64 / MIB as f64,
            self.trimmed_bytes as f64 / MIB as f64,
            self.peak_physical_bytes as f64 / MIB as f64
        );
        let _ = writeln!(
            o,
            "driver: creates {} releases {} maps {} unmaps {} syncs {}; live at the end {}",
            self.driver_creates,
            self.driver_releases,
            self.driver_maps,
            self.driver_unmaps,
            self.driver_syncs,
            self.live_at_end
        );
        for m in &self.error_samples {
            let _ = writeln!(o, "ERROR: {m}");
        }
        let _ = writeln!(o, "errors: {}", self.errors);
        o
    }

    /// The figures as a JSON document.
    pub fn to_json(&self) -> String {
        let doc = ReportJson {
            example: "stress",
            threads: self.threads,
            seconds: self.seconds,
            ops: self.ops,
            ops_per_second: self.ops_per_second(),
            ops_by_kind: InOrder(&self.ops_by_kind),
            refused_out_of_memory: self.refused_out_of_memory,
            refused_out_of_address_space: self.refused_out_of_address_space,
            refused_pinned: self.refused_pinned,
            bytes_written: self.bytes_written,
            bytes_verified: self.bytes_verified,
            pointer_checks: self.pointer_checks,
            pointer_checks_raced: self.pointer_checks_raced,
            move_events: self.move_events,
            moves: self.moves,
            compact_moved_allocations: self.compact_moved_allocations,
            compact_shrank_largest_hole: self.compact_shrank_largest_hole,
            trimmed_bytes: self.trimmed_bytes,
            peak_physical_bytes: self.peak_physical_bytes,
            driver_calls: DriverCalls {
                create: self.driver_creates,
                release: self.driver_releases,
                map: self.driver_maps,
                unmap: self.driver_unmaps,
                sync: self.driver_syncs,
            },
            live_at_end: self.live_at_end,
            errors: self.errors,
            error_samples: &self.error_samples,
        };
        serde_json::to_string_pretty(&doc).expect("plain data serializes") + "\n"
    }
}

/// The JSON layout of a [`Report`] (field names are what scripts read).
#[derive(Serialize)]
struct ReportJson<'a> {
    example: &'static str,
    threads: usize,
    seconds: f64,
    ops: u64,
    ops_per_second: f64,
    ops_by_kind: InOrder<'a>,
    refused_out_of_memory: u64,
    refused_out_of_address_space: u64,
    refused_pinned: u64,
    bytes_written: u64,
    bytes_verified: u64,
    pointer_checks: u64,
    pointer_checks_raced: u64,
    move_events: u64,
    moves: u64,
    compact_moved_allocations: u64,
    compact_shrank_largest_hole: u64,
    trimmed_bytes: u64,
    peak_physical_bytes: u64,
    driver_calls: DriverCalls,
    live_at_end: u64,
    errors: u64,
    error_samples: &'a [String],
}

#[derive(Serialize)]
struct DriverCalls {
    create: u64,
    release: u64,
    map: u64,
    unmap: u64,
    sync: u64,
}

/// Pairs as a JSON object in their own order (the report's operation order),
/// which a map type would sort.
struct InOrder<'a>(&'a [(&'static str, u64)]);

impl Serialize for InOrder<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}
