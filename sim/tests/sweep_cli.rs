//! `kv_serving --sweep` on a tiny workload: the arena row is `arena`, or
//! `arena-paged` when `--managers` names it (and not `arena`); with
//! arena-paged every grid point's arena run is an arena-paged replay, and
//! since its blocks are read by the paged kernel, the paged overhead slows
//! both rows alike.

use std::process::Command;

#[test]
fn a_sweep_of_arena_paged_replays_that_row_at_every_paged_overhead() {
    let dir = std::env::temp_dir().join(format!("kv_serving_sweep_{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_kv_serving"))
        .args(["--requests", "40", "--managers", "arena-paged", "--capacity", "1GiB", "--jobs", "2", "--sweep"])
        .arg(&dir)
        .output()
        .expect("kv_serving runs");
    assert!(out.status.success(), "kv_serving failed: {}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("sweep.json")).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(doc["title"].as_str().unwrap().starts_with("arena-paged, "), "{}", doc["title"]);
    let runs = doc["runs"].as_array().unwrap();
    let names: Vec<&str> = runs.iter().map(|r| r["manager"].as_str().unwrap()).collect();
    // Two pricings x four paged overheads of arena-paged, then vLLM at each
    // overhead (its steps make no driver call, so one pricing).
    assert_eq!(names.iter().filter(|n| **n == "arena-paged").count(), 8, "{names:?}");
    assert_eq!(names.iter().filter(|n| **n == "vllm-paged").count(), 4, "{names:?}");
    for r in runs {
        assert_eq!(r["integrity_errors"], 0);
    }
    // Slower attention lengthens both rows' steps: each row's tokens/s
    // falls along the overhead axis.
    let points = doc["points"].as_array().unwrap();
    let per_chunk: Vec<&serde_json::Value> = points
        .iter()
        .filter(|p| p["pricing"] == "per-chunk" && p["token_major_penalty"].as_f64() == Some(0.0))
        .collect();
    assert_eq!(per_chunk.len(), 4);
    for w in per_chunk.windows(2) {
        for k in ["arena_tokens_per_s", "vllm_tokens_per_s"] {
            assert!(w[1][k].as_f64().unwrap() < w[0][k].as_f64().unwrap(), "{k}: {} then {}", w[0], w[1]);
        }
    }
}
