//! The `kv_serving` binary's command line as a user gives it: each manager
//! runs in a worker process, and every profile override reaches the worker.

use std::process::Command;

/// Runs `kv_serving --quick --managers arena` with `extra` arguments and
/// returns the arena's critical-path and between-steps driver seconds.
fn arena_alloc_seconds(extra: &[&str]) -> (f64, f64) {
    let dir = std::env::temp_dir().join(format!("kv_serving_cli_{}_{}", std::process::id(), extra.len()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("report.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kv_serving"))
        .args(["--quick", "--managers", "arena", "--json"])
        .arg(&json)
        .args(extra)
        .output()
        .expect("kv_serving runs");
    assert!(out.status.success(), "kv_serving failed: {}", String::from_utf8_lossy(&out.stderr));
    let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    let arena = &report["managers"][0];
    assert_eq!(arena["name"], "arena");
    (arena["critical_path_alloc_s"].as_f64().unwrap(), arena["overlapped_alloc_s"].as_f64().unwrap())
}

#[test]
fn profile_json_reaches_the_worker_processes() {
    // Every driver price zero: the arena's driver time is zero, where the
    // default profile charges it (each manager runs in its own process,
    // which must get the override too).
    let free: serde_json::Map<String, serde_json::Value> = [
        "create_s",
        "map_s",
        "release_s",
        "reserve_s",
        "set_access_s",
        "unmap_s",
        "synchronize_s",
        "event_destroy_s",
        "event_query_s",
        "event_record_s",
    ]
    .into_iter()
    .map(|k| (k.to_string(), serde_json::json!({"value": 0.0, "source": "test: every driver call free"})))
    .collect();
    let free = serde_json::Value::Object(free).to_string();
    let (crit, hidden) = arena_alloc_seconds(&[]);
    assert!(crit + hidden > 0.0, "the default profile charges the arena's driver calls");
    let (crit, hidden) = arena_alloc_seconds(&["--profile-json", &free]);
    assert_eq!((crit, hidden), (0.0, 0.0), "--profile-json was not applied in the worker");
}
