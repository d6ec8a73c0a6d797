//! The workload programs' logic, shortened: `stress` (2 threads, about a second),
//! `multi_tenant` (small synthetic load), `rlhf_cycle` (two small sleep and
//! wake cycles) and `snapshot_svg` on real snapshots.
//! Each program's `main` is a thin call into its library module, so the
//! test runs exactly their code.

use std::path::{Path, PathBuf};

use serde_json::Value;
use vmm_arena::{Arena, ArenaConfig, Backend};
use vmm_sim::snapshot_svg::{self, render, Options};
use vmm_sim::{multi_tenant, rlhf_cycle, stress};

const C: u64 = 2 << 20;

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("vmm-arena-examples-{}-{name}", std::process::id()))
}

/// Every range of the snapshot has at least one `<rect>` of its own.
fn assert_rect_per_range(json: &str, svg: &str) -> usize {
    let ranges = snapshot_svg::parse(json).expect("the snapshot parses").ranges.len();
    assert!(ranges > 0);
    for i in 0..ranges {
        assert!(svg.contains(&format!("data-range=\"{i}\"")), "range {i} has no rect");
    }
    assert!(!svg.contains(&format!("data-range=\"{ranges}\"")));
    ranges
}

/// The ranges of a snapshot tile the reserved range in address order.
fn assert_ranges_tile(json: &str) {
    let doc = snapshot_svg::parse(json).unwrap();
    let base = doc.base.expect("the snapshot gives its base");
    let reserved = doc.stats.reserved_va_bytes;
    assert!(reserved > 0);
    let mut at = base;
    for r in &doc.ranges {
        assert_eq!(r.addr, at, "ranges leave a gap or overlap at {at:#x}");
        at += r.bytes;
    }
    assert_eq!(at, base + reserved);
}

#[test]
fn stress_two_threads_for_a_second() {
    let snap = temp("stress.json");
    let cfg = stress::Config {
        threads: 2,
        seconds: 1.0,
        capacity_bytes: 64 * C,
        max_alloc_bytes: 8 * C,
        snapshot: Some(snap.clone()),
        ..Default::default()
    };
    let r = stress::run(&cfg).unwrap();
    print!("{}", r.table());
    assert_eq!(r.errors, 0, "{:?}", r.error_samples);
    assert!(r.ops > 100, "only {} operations", r.ops);
    for kind in ["alloc", "resize", "free", "verify"] {
        let n = r.ops_by_kind.iter().find(|(k, _)| *k == kind).unwrap().1;
        assert!(n > 0, "no {kind}");
    }
    assert!(r.bytes_verified > 0 && r.pointer_checks > 0);
    assert_eq!(r.driver_creates, r.driver_releases);
    let doc: Value = serde_json::from_str(&r.to_json()).expect("the report is valid JSON");
    assert_eq!(doc["errors"].as_u64(), Some(0));
    assert_eq!(doc["ops"].as_u64(), Some(r.ops));
    assert_eq!(doc["ops_by_kind"]["alloc"].as_u64(), r.ops_by_kind.iter().find(|(k, _)| *k == "alloc").map(|k| k.1));
    assert_eq!(doc["driver_calls"]["create"].as_u64(), Some(r.driver_creates));

    let json = std::fs::read_to_string(&snap).unwrap();
    let _ = std::fs::remove_file(&snap);
    assert_ranges_tile(&json);
    let svg = render(&json, &Options { full: true, ..Default::default() }).unwrap();
    assert_rect_per_range(&json, &svg);
}

fn tiny(rate: f64, prompt: f64, output: f64) -> multi_tenant::Synthetic {
    multi_tenant::Synthetic {
        rate_per_s: rate,
        prompt_median: prompt,
        prompt_sigma: 0.5,
        prompt_max: 4 * prompt as u64,
        output_median: output,
        output_sigma: 0.5,
        output_max: 4 * output as u64,
    }
}

#[test]
fn multi_tenant_small_synthetic() {
    use multi_tenant::{Source, TenantSpec};
    let snap = temp("multi.json");
    let cfg = multi_tenant::Config {
        tenants: vec![
            TenantSpec {
                name: "A".into(),
                kv_bytes_per_token: 64 << 10,
                source: Source::Synthetic(tiny(20.0, 200.0, 10.0)),
            },
            TenantSpec {
                name: "B".into(),
                kv_bytes_per_token: 160 << 10,
                source: Source::Synthetic(tiny(10.0, 300.0, 40.0)),
            },
        ],
        limit: 40,
        shift_s: Some(3.0),
        capacity_bytes: 1 << 30,
        trim_every_s: 1.0,
        trim_keep_bytes: 16 * C,
        phases: 4,
        backend: Backend::HostSparse,
        snapshot: Some(snap.clone()),
        ..Default::default()
    };
    let r = multi_tenant::run(&cfg).unwrap();
    print!("{}", r.table());
    assert_eq!(r.integrity_errors, 0);
    assert_eq!(r.accounting_errors, 0);
    for t in &r.tenants {
        assert_eq!(t.completed + t.skipped_too_large, t.requests, "{}", t.name);
        assert!(t.peak_mapped_bytes > 0);
    }
    // Four phases, the drain and the idle row.
    assert_eq!(r.phases.len(), 6);
    // Load shifts: A is busy in the first phase and idle in the last, B the reverse.
    let (first, last) = (&r.phases[0], &r.phases[3]);
    assert!(first.mean_mapped[0] > 0.0 && first.peak_mapped[1] == 0, "{first:?}");
    assert!(last.peak_mapped[0] == 0 && last.mean_mapped[1] > 0.0, "{last:?}");
    // Idle after trim(0): nothing held, while static partitions hold every peak.
    assert_eq!(r.idle_held_after_trim, 0);
    assert_eq!(r.static_bytes, r.tenants.iter().map(|t| t.peak_mapped_bytes).sum::<u64>());
    assert!(r.static_bytes > 0);
    assert_eq!(r.driver_creates, r.driver_releases);
    let doc: Value = serde_json::from_str(&r.to_json()).expect("the report is valid JSON");
    assert_eq!(doc["tenants"].as_array().map(|a| a.len()), Some(2));
    assert_eq!(doc["integrity_errors"].as_u64(), Some(0));
    assert_eq!(doc["tenants"][1]["peak_mapped_bytes"].as_u64(), Some(r.tenants[1].peak_mapped_bytes));
    assert_eq!(doc["static_partitions"]["total_bytes"].as_u64(), Some(r.static_bytes));
    assert_eq!(doc["phases"].as_array().map(|a| a.len()), Some(6));
    assert_eq!(doc["workload"]["example"], "multi_tenant");

    let json = std::fs::read_to_string(&snap).unwrap();
    let _ = std::fs::remove_file(&snap);
    assert_ranges_tile(&json);
    let svg = render(&json, &Options::default()).unwrap();
    assert_rect_per_range(&json, &svg);
}

/// Both ways of driving the arena on the same small load: stream mode frees
/// every request on the stream (one event each, recorded inside the step),
/// keeps its prefetch with `maintain` between steps, and never needs a
/// device synchronize or a blocking event wait (the load fits); sync mode
/// records no event and does no driver work between steps (nothing moves,
/// the periodic trim is off).
#[test]
fn multi_tenant_stream_and_sync_modes() {
    use multi_tenant::{Mode, Source, TenantSpec};
    let cfg = |mode| multi_tenant::Config {
        tenants: vec![
            TenantSpec {
                name: "A".into(),
                kv_bytes_per_token: 64 << 10,
                source: Source::Synthetic(tiny(20.0, 200.0, 10.0)),
            },
            TenantSpec {
                name: "B".into(),
                kv_bytes_per_token: 160 << 10,
                source: Source::Synthetic(tiny(10.0, 300.0, 40.0)),
            },
        ],
        limit: 30,
        shift_s: Some(1.0),
        capacity_bytes: 1 << 30,
        trim_every_s: 0.0,
        phases: 2,
        backend: Backend::HostSparse,
        mode,
        ..Default::default()
    };
    let stream = multi_tenant::run(&cfg(Mode::Stream)).unwrap();
    let sync = multi_tenant::run(&cfg(Mode::Sync)).unwrap();
    for r in [&stream, &sync] {
        print!("{}", r.table());
        assert_eq!((r.integrity_errors, r.accounting_errors), (0, 0), "{:?}", r.mode);
        assert_eq!(r.tenants.iter().map(|t| t.completed).sum::<u64>(), 60, "{:?}", r.mode);
        assert_eq!(r.tenants.iter().map(|t| t.preemptions).sum::<u64>(), 0, "{:?}: the load fits", r.mode);
    }
    let (c, b) = (&stream.critical_calls, &stream.between_calls);
    assert_eq!(c.event_record, 60, "one event per free on the stream");
    assert_eq!((c.synchronize, c.event_wait_blocked), (0, 0), "{c:?}");
    assert!(b.management() > 0, "maintain works between steps: {b:?}");
    assert_eq!(b.drains(), 0);
    let doc: Value = serde_json::from_str(&stream.to_json()).unwrap();
    assert_eq!(doc["shared"]["mode"], "stream");
    assert_eq!(doc["shared"]["critical_path_calls"]["event_record"].as_u64(), Some(60));
    assert_eq!((sync.critical_calls.event_record, sync.between_calls.management()), (0, 0));
}

#[test]
fn multi_tenant_reads_both_trace_formats() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces");
    let files = ["azure_conv_2023.csv", "mooncake_conversation.jsonl"];
    if !files.iter().all(|f| dir.join(f).exists()) {
        eprintln!("skipped: the shared traces are not in {}", dir.display());
        return;
    }
    for f in files {
        let reqs = multi_tenant::load_trace(&dir.join(f), 50).unwrap();
        assert_eq!(reqs.len(), 50, "{f}");
        assert_eq!(reqs[0].arrive_s, 0.0);
        assert!(reqs.windows(2).all(|w| w[0].arrive_s <= w[1].arrive_s));
        assert!(reqs.iter().all(|r| r.prompt > 0 && r.output > 0));
    }
}

#[test]
fn trace_parsing_accepts_both_formats_inline() {
    let csv = temp("t.csv");
    std::fs::write(&csv, "arrived_at,num_prefill_tokens,num_decode_tokens\n1.5,100,10\n2.0,200,20\n").unwrap();
    let jsonl = temp("t.jsonl");
    std::fs::write(
        &jsonl,
        "{\"timestamp\": 1000, \"input_length\": 300, \"output_length\": 30, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 3500, \"input_length\": 400, \"output_length\": 40}\n",
    )
    .unwrap();
    let a = multi_tenant::load_trace(&csv, 10).unwrap();
    let b = multi_tenant::load_trace(&jsonl, 10).unwrap();
    let _ = (std::fs::remove_file(&csv), std::fs::remove_file(&jsonl));
    assert_eq!(a.len(), 2);
    assert_eq!((a[1].arrive_s, a[1].prompt, a[1].output), (0.5, 200, 20));
    assert_eq!(b.len(), 2);
    assert_eq!((b[1].arrive_s, b[1].prompt, b[1].output), (2.5, 400, 40));
    // A Mooncake line that lacks a field, or is not JSON, is an error naming the line.
    let broken = temp("broken.jsonl");
    for text in ["{\"timestamp\": 1000, \"input_length\": 300}\n", "{\"timestamp\": 1000, \"input_length\": 3\n"] {
        std::fs::write(&broken, format!("{{\"timestamp\": 0, \"input_length\": 1, \"output_length\": 1}}\n{text}"))
            .unwrap();
        let e = multi_tenant::load_trace(&broken, 10).unwrap_err();
        assert!(e.contains("broken.jsonl:2:"), "{e}");
    }
    let _ = std::fs::remove_file(&broken);
    assert_eq!(multi_tenant::parse_bytes("40GiB").unwrap(), 40 << 30);
    assert_eq!(multi_tenant::parse_bytes("128k").unwrap(), 128 << 10);
}

#[test]
fn svg_of_every_kind_of_range() {
    let a = Arena::new(ArenaConfig { capacity_bytes: 64 * C, reserve_bytes: 32 * C, ..Default::default() }).unwrap();
    let (x, _) = a.alloc(3 * C).unwrap();
    let (y, _) = a.alloc_growable(C, 4 * C).unwrap();
    let (z, _) = a.alloc(2 * C).unwrap();
    a.pin(z).unwrap();
    let (_small, _) = a.alloc(1000).unwrap();
    a.write(y, 10, b"yy").unwrap();
    a.free(x).unwrap(); // pooled chunks cached in a free range
    a.resize(y, 4 * C).unwrap();
    a.resize(y, 2 * C).unwrap(); // cached chunks in y's tail
    let (w, _) = a.alloc_growable(C, 2 * C).unwrap();
    a.resize(w, 5 * C).unwrap(); // outgrows its reservation: moves, leaves a retired range
    let (v, _) = a.alloc(2 * C).unwrap();
    a.free(v).unwrap(); // its chunks stay mapped (cached) in a free range
    let (sh, _) = a.alloc_shared(z, C, C, 2 * C).unwrap(); // z's second chunk, mapped again
    let json = a.snapshot_json().unwrap();
    assert_ranges_tile(&json);
    let kinds: Vec<String> = snapshot_svg::parse(&json).unwrap().ranges.into_iter().map(|r| r.kind).collect();
    for k in ["live", "free", "retired", "slab"] {
        assert!(kinds.iter().any(|x| x == k), "no {k} range in {json}");
    }
    let svg = render(&json, &Options { full: true, ..Default::default() }).unwrap();
    let n = assert_rect_per_range(&json, &svg);
    assert_eq!(n, kinds.len());
    for class in ["class=\"live\"", "class=\"mapped\"", "class=\"free\"", "class=\"retired\"", "class=\"slab\""] {
        assert!(svg.contains(class), "no {class}");
    }
    assert!(svg.contains("class=\"pooled\""), "no pooled chunk drawn");
    assert!(
        svg.contains("stroke=\"#a00000\" stroke-width=\"2.5\"><title>live"),
        "the pinned allocation is not outlined"
    );
    assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    // The shared chunk is marked in both holders, and named in the tooltips.
    assert!(svg.matches("class=\"shared\"").count() >= 2, "the shared chunk, drawn in each holder");
    assert!(svg.contains(&format!("shares 2.0 MiB with {:#x}", sh.get())), "z's tooltip names the sharer");

    // Cut short by default: the trailing free range still has its (clipped) rect.
    let short = render(&json, &Options::default()).unwrap();
    assert_rect_per_range(&json, &short);
}

#[test]
fn snapshot_parsing_keeps_u64_exact_and_rejects_garbage() {
    // Addresses near the top of the 64-bit range must not go through f64.
    let top = u64::MAX - 4095;
    let doc = snapshot_svg::parse(&format!(
        r#"{{"base": {top}, "chunk_bytes": 4096, "ranges": [{{"kind": "live", "addr": {top}, "bytes": 4096, "id": 7,
             "pinned": true, "future_field": [1, 2]}}], "stats": {{"moves": 3}}}}"#
    ))
    .unwrap();
    assert_eq!(doc.base, Some(top));
    assert_eq!(doc.ranges[0].addr, top);
    assert!(doc.ranges[0].pinned && !doc.ranges[0].growable);
    assert_eq!((doc.ranges[0].id, doc.ranges[0].mapped_bytes), (7, 0));
    assert_eq!(doc.stats.moves, 3);
    for bad in [
        "",
        "{",
        "[1,]",
        r#"{"chunk_bytes": 1}"#,
        r#"{"ranges": [{"kind": "free", "addr": 0}]}"#,
        r#"{"ranges": [{"kind": "free", "addr": -1, "bytes": 1}]}"#,
        r#"{"ranges": []} x"#,
    ] {
        assert!(snapshot_svg::parse(bad).is_err(), "{bad:?} parsed");
        assert!(render(bad, &Options::default()).is_err(), "{bad:?} rendered");
    }
}

#[test]
fn command_lines_parse_with_their_defaults() {
    use clap::Parser;
    let cli =
        snapshot_svg::Cli::try_parse_from(["snapshot_svg", "in.json", "out.svg", "--rows", "4", "--full"]).unwrap();
    let o = cli.options();
    assert_eq!((o.width, o.rows, o.full), (Options::default().width, 4, true));
    assert_eq!(o.title, "vmm-arena address space: in.json");
    assert!(snapshot_svg::Cli::try_parse_from(["snapshot_svg", "in.json"]).is_err());
    assert!(snapshot_svg::Cli::try_parse_from(["snapshot_svg", "a", "b", "--rows", "x"]).is_err());

    // The command lines' defaults are the library-style `Config` defaults the tests use.
    assert_eq!(stress::Cli::try_parse_from(["stress"]).unwrap().config().unwrap(), stress::Config::default());
    let c = stress::Cli::try_parse_from(["stress", "--backend", "host-sparse", "--no-pins", "--max-alloc", "1.5M"])
        .unwrap()
        .config()
        .unwrap();
    assert_eq!((c.backend, c.pins, c.max_alloc_bytes), (Backend::HostSparse, false, 3 << 19));
    assert!(stress::Cli::try_parse_from(["stress", "--threads", "0"]).is_err());
    assert!(stress::Cli::try_parse_from(["stress", "--max-alloc", "0"]).unwrap().config().is_err());
    assert!(stress::Cli::try_parse_from(["stress", "--backend", "cuda"]).is_err());

    let mt = |args: &[&str]| {
        multi_tenant::Cli::try_parse_from(std::iter::once("multi_tenant").chain(args.iter().copied()))
            .map_err(|e| e.to_string())
            .and_then(|c| c.config())
    };
    assert_eq!(mt(&[]).unwrap(), multi_tenant::Config::default());
    let c = mt(&["--tenants", "3", "--kv-c", "128KiB", "--trace-b", "b.jsonl", "--retain", "1GiB", "--limit", "100"])
        .unwrap();
    assert_eq!(c.tenants.len(), 3);
    assert_eq!(c.tenants[2].name, "C llama3-8b");
    assert_eq!(c.tenants[1].source, multi_tenant::Source::Trace("b.jsonl".into()));
    assert_eq!((c.retain_bytes, c.limit), (1 << 30, 100));
    for bad in [&["--tenants", "4"][..], &["--limit", "0"], &["--step-ms", "0"], &["--kv-a", "lots"]] {
        assert!(mt(bad).is_err(), "{bad:?} accepted");
    }
}

/// Two small cycles of the inference tenant: everything it held goes back
/// at sleep, every weight byte comes back at wake, KV allocations are back
/// at their addresses; the call counts are reported for both models.
#[test]
fn rlhf_cycle_small() {
    use clap::Parser;
    let cfg = rlhf_cycle::Config {
        cycles: 2,
        capacity_bytes: 64 << 20,
        weights_bytes: 20 << 20,
        tensors: 12,
        requests: 8,
        ..rlhf_cycle::Config::quick()
    };
    let r = rlhf_cycle::run(&cfg).unwrap();
    assert_eq!(r.cycles.len(), 2);
    for c in &r.cycles {
        assert!(c.given_back_fraction >= 0.999, "{c:?}");
        assert_eq!(c.weight_bytes_verified, r.weights_bytes);
        assert_eq!((c.backup_bytes, c.restore_bytes), (r.weights_bytes, r.weights_bytes));
        assert!(c.sleep_calls.releases > 0 && c.wake_calls.maps > 0, "{c:?}");
        assert_eq!(c.sleep_calls.copies, 12);
        assert_eq!(c.vllm_wake_calls.creates, 12 + c.kv_allocations_at_sleep);
        assert!(c.trainer_bytes >= (64 << 20) / 2, "the trainer used most of the capacity: {c:?}");
        let ms = r.weights_bytes as f64 / (cfg.bandwidth_gbps * 1e9) * 1e3;
        assert!((c.backup_ms - ms).abs() < 1e-9);
    }
    let cli = rlhf_cycle::Cli::try_parse_from(["rlhf_cycle", "--quick"]).unwrap();
    assert_eq!(cli.config().unwrap(), rlhf_cycle::Config::quick());
    assert!(rlhf_cycle::Cli::try_parse_from(["rlhf_cycle", "--weights", "200M", "--capacity", "256M"])
        .unwrap()
        .config()
        .is_err());
}
