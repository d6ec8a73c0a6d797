//! The report as a table and as JSON.

use super::*;

fn gib(b: f64) -> f64 {
    b / GIB as f64
}

/// `1.5 GiB`, `32 MiB`, `2 MiB`.
fn human(b: u64) -> String {
    if b >= GIB {
        format!("{:.1} GiB", gib(b as f64))
    } else if b >= 1 << 20 {
        format!("{:.0} MiB", b as f64 / (1 << 20) as f64)
    } else {
        format!("{:.0} KiB", b as f64 / KIB as f64)
    }
}

impl Report {
    /// The printed table.
    pub fn table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "multi_tenant: {} tenants share one arena ({}; capacity {}, chunk {}, retain {}; {})",
            self.tenants.len(),
            self.backend,
            human(self.capacity_bytes),
            human(self.chunk_bytes),
            if self.retain_bytes == u64::MAX { "all".into() } else { human(self.retain_bytes) },
            if self.trim_every_s > 0.0 {
                format!("the engine calls trim({}) every {} s", human(self.trim_keep_bytes), self.trim_every_s)
            } else {
                "no periodic trim".into()
            }
        );
        for t in &self.tenants {
            let _ = writeln!(
                o,
                "  {}: {} KiB/token, {} requests from {:.0} s ({})",
                t.name,
                t.kv_bytes_per_token / KIB,
                t.requests,
                t.start_s,
                t.source
            );
        }
        let _ = writeln!(o);
        let _ = write!(o, "{:<6} {:>15}", "phase", "window s");
        for t in &self.tenants {
            let n: String = t.name.chars().take(19).collect();
            let _ = write!(o, " {n:>19}");
        }
        let _ = writeln!(o, " {:>12} {:>15} {:>8} {:>8}", "pooled peak", "held mean/peak", "creates", "releases");
        let _ = write!(o, "{:<6} {:>15}", "", "");
        for _ in &self.tenants {
            let _ = write!(o, " {:>19}", "GiB mean/peak");
        }
        let _ = writeln!(o, " {:>12} {:>15} {:>8} {:>8}", "GiB", "GiB", "", "");
        for p in &self.phases {
            let window =
                if p.name == "idle" { "after trim(0)".to_string() } else { format!("{:.0}-{:.0}", p.from_s, p.to_s) };
            let _ = write!(o, "{:<6} {:>15}", p.name, window);
            for k in 0..self.tenants.len() {
                let cell = format!("{:.2} / {:.2}", gib(p.mean_mapped[k]), gib(p.peak_mapped[k] as f64));
                let _ = write!(o, " {cell:>19}");
            }
            let held = format!("{:.2} / {:.2}", gib(p.mean_held), gib(p.peak_held as f64));
            let _ = writeln!(o, " {:>12.2} {held:>15} {:>8} {:>8}", gib(p.peak_pooled as f64), p.creates, p.releases);
        }
        let _ = writeln!(o);
        let _ = writeln!(o, "{:<34} {:>14} {:>26}", "", "shared arena", "static partitions (peaks)");
        // Each row: the shared arena's figure beside the static partitions' total.
        let mut against_static = |label: &str, shared_bytes: f64| {
            let _ = writeln!(
                o,
                "{:<34} {:>10.2} GiB {:>22.2} GiB",
                label,
                gib(shared_bytes),
                gib(self.static_bytes as f64)
            );
        };
        against_static("peak physical", self.shared_peak_bytes as f64);
        against_static("time-weighted mean held", self.shared_mean_held);
        against_static("idle footprint before trim", self.idle_held_before_trim as f64);
        against_static("idle footprint after trim(0)", self.idle_held_after_trim as f64);
        if self.static_bytes > self.capacity_bytes {
            let _ = writeln!(
                o,
                "(static partitions would need {:.2} GiB, more than the {:.2} GiB capacity: sized to fit it, \
                 some tenant's peak would queue or fail)",
                gib(self.static_bytes as f64),
                gib(self.capacity_bytes as f64)
            );
        }
        let _ = writeln!(o);
        let _ = writeln!(
            o,
            "{:<14} {:>9} {:>9} {:>8} {:>11} {:>12} {:>13} {:>10}",
            "tenant", "requests", "completed", "skipped", "preemptions", "peak GiB", "mean queue s", "integrity"
        );
        for t in &self.tenants {
            let n: String = t.name.chars().take(14).collect();
            let _ = writeln!(
                o,
                "{n:<14} {:>9} {:>9} {:>8} {:>11} {:>12.2} {:>13.2} {:>10}",
                t.requests,
                t.completed,
                t.skipped_too_large,
                t.preemptions,
                gib(t.peak_mapped_bytes as f64),
                t.mean_queue_s,
                t.integrity_errors
            );
        }
        let (c, b) = (&self.critical_calls, &self.between_calls);
        let _ = writeln!(
            o,
            "\n{} mode: inside steps (critical path) creates {} ({} in warm steps), maps {}, access calls {}, \
             unmaps {}, synchronizes {}, blocking event waits {}, events recorded {}; between steps creates {}, \
             maps {}, access calls {}, unmaps {}, synchronizes {}, blocking event waits {}",
            match self.mode {
                Mode::Stream => "stream",
                Mode::Sync => "sync",
            },
            c.create,
            self.critical_creates_warm,
            c.map,
            c.set_access,
            c.unmap,
            c.synchronize,
            c.event_wait_blocked,
            c.event_record,
            b.create,
            b.map,
            b.set_access,
            b.unmap,
            b.synchronize,
            b.event_wait_blocked
        );
        let _ = writeln!(
            o,
            "{} steps ({:.0} s simulated) in {:.1} s; moves {}; driver creates {} releases {} maps {} unmaps {}; \
             accounting errors {}; integrity errors {}",
            self.steps,
            self.sim_seconds,
            self.wall_seconds,
            self.moves,
            self.driver_creates,
            self.driver_releases,
            self.driver_maps,
            self.driver_unmaps,
            self.accounting_errors,
            self.integrity_errors
        );
        o
    }

    /// The figures as a JSON document.
    pub fn to_json(&self) -> String {
        let doc = ReportJson {
            workload: WorkloadJson {
                example: "multi_tenant",
                backend: &self.backend,
                capacity_bytes: self.capacity_bytes,
                chunk_bytes: self.chunk_bytes,
                // u64::MAX means "keep everything": null, not a number no reader expects.
                retain_bytes: Some(self.retain_bytes).filter(|&b| b != u64::MAX),
                trim_every_seconds: self.trim_every_s,
                trim_keep_bytes: self.trim_keep_bytes,
                steps: self.steps,
                sim_seconds: self.sim_seconds,
            },
            tenants: self
                .tenants
                .iter()
                .map(|t| TenantJson {
                    name: &t.name,
                    source: &t.source,
                    kv_bytes_per_token: t.kv_bytes_per_token,
                    start_s: t.start_s,
                    requests: t.requests,
                    completed_requests: t.completed,
                    skipped_too_large: t.skipped_too_large,
                    preemptions: t.preemptions,
                    tokens_written: t.tokens_written,
                    peak_mapped_bytes: t.peak_mapped_bytes,
                    mean_mapped_bytes: t.mean_mapped_bytes,
                    mean_queue_seconds: t.mean_queue_s,
                    max_queue_seconds: t.max_queue_s,
                    integrity_errors: t.integrity_errors,
                })
                .collect(),
            phases: self
                .phases
                .iter()
                .map(|p| PhaseJson {
                    name: &p.name,
                    from_s: p.from_s,
                    to_s: p.to_s,
                    steps: p.steps,
                    mean_mapped_bytes: &p.mean_mapped,
                    peak_mapped_bytes: &p.peak_mapped,
                    mean_running: &p.mean_running,
                    peak_pooled_bytes: p.peak_pooled,
                    mean_held_bytes: p.mean_held,
                    peak_held_bytes: p.peak_held,
                    driver_creates: p.creates,
                    driver_releases: p.releases,
                })
                .collect(),
            shared: SharedJson {
                peak_physical_bytes: self.shared_peak_bytes,
                mean_held_bytes: self.shared_mean_held,
                idle_held_before_trim_bytes: self.idle_held_before_trim,
                idle_held_after_trim_bytes: self.idle_held_after_trim,
                trimmed_bytes: self.trimmed_bytes,
                moves: self.moves,
                driver_calls: DriverCallsJson {
                    create: self.driver_creates,
                    release: self.driver_releases,
                    map: self.driver_maps,
                    unmap: self.driver_unmaps,
                    set_access: self.driver_access_calls,
                },
                periodic_trims: self.periodic_trims,
                periodic_trimmed_bytes: self.periodic_trimmed_bytes,
                mode: self.mode,
                critical_path_calls: self.critical_calls,
                between_steps_calls: self.between_calls,
                critical_path_creates_warm: self.critical_creates_warm,
            },
            static_partitions: StaticJson {
                total_bytes: self.static_bytes,
                per_tenant_bytes: self.tenants.iter().map(|t| t.peak_mapped_bytes).collect(),
            },
            accounting_errors: self.accounting_errors,
            integrity_errors: self.integrity_errors,
            wall_seconds: self.wall_seconds,
        };
        serde_json::to_string_pretty(&doc).expect("plain data serializes") + "\n"
    }
}

// The JSON layout of a `Report` (field names are what scripts read; floats
// that are not finite become null).

#[derive(Serialize)]
struct ReportJson<'a> {
    workload: WorkloadJson<'a>,
    tenants: Vec<TenantJson<'a>>,
    phases: Vec<PhaseJson<'a>>,
    shared: SharedJson,
    static_partitions: StaticJson,
    accounting_errors: u64,
    integrity_errors: u64,
    wall_seconds: f64,
}

#[derive(Serialize)]
struct WorkloadJson<'a> {
    example: &'static str,
    backend: &'a str,
    capacity_bytes: u64,
    chunk_bytes: u64,
    retain_bytes: Option<u64>,
    trim_every_seconds: f64,
    trim_keep_bytes: u64,
    steps: u64,
    sim_seconds: f64,
}

#[derive(Serialize)]
struct TenantJson<'a> {
    name: &'a str,
    source: &'a str,
    kv_bytes_per_token: u64,
    start_s: f64,
    requests: u64,
    completed_requests: u64,
    skipped_too_large: u64,
    preemptions: u64,
    tokens_written: u64,
    peak_mapped_bytes: u64,
    mean_mapped_bytes: f64,
    mean_queue_seconds: f64,
    max_queue_seconds: f64,
    integrity_errors: u64,
}

#[derive(Serialize)]
struct PhaseJson<'a> {
    name: &'a str,
    from_s: f64,
    to_s: f64,
    steps: u64,
    mean_mapped_bytes: &'a [f64],
    peak_mapped_bytes: &'a [u64],
    mean_running: &'a [f64],
    peak_pooled_bytes: u64,
    mean_held_bytes: f64,
    peak_held_bytes: u64,
    driver_creates: u64,
    driver_releases: u64,
}

#[derive(Serialize)]
struct SharedJson {
    peak_physical_bytes: u64,
    mean_held_bytes: f64,
    idle_held_before_trim_bytes: u64,
    idle_held_after_trim_bytes: u64,
    trimmed_bytes: u64,
    moves: u64,
    driver_calls: DriverCallsJson,
    periodic_trims: u64,
    periodic_trimmed_bytes: u64,
    mode: Mode,
    critical_path_calls: Calls,
    between_steps_calls: Calls,
    critical_path_creates_warm: u64,
}

#[derive(Serialize)]
struct DriverCallsJson {
    create: u64,
    release: u64,
    map: u64,
    unmap: u64,
    set_access: u64,
}

#[derive(Serialize)]
struct StaticJson {
    total_bytes: u64,
    per_tenant_bytes: Vec<u64>,
}
