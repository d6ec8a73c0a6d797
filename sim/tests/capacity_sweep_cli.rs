//! `kv_serving --capacity-sweep` on a tiny sweep: every manager at every
//! capacity, each point's figures in the JSON, and the sums over the range
//! equal to the points' figures added up.

use std::process::Command;

#[test]
fn a_tiny_capacity_sweep_reports_every_point_and_the_sums() {
    let dir = std::env::temp_dir().join(format!("kv_serving_capacity_sweep_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("sweep.json");
    let out = Command::new(env!("CARGO_BIN_EXE_kv_serving"))
        .args(["--requests", "80", "--managers", "arena,vllm-paged", "--capacity", "64GiB"])
        .args(["--capacity-sweep", "256MiB:512MiB:256MiB", "--jobs", "2", "--json"])
        .arg(&json)
        .output()
        .expect("kv_serving runs");
    assert!(out.status.success(), "kv_serving failed: {}", String::from_utf8_lossy(&out.stderr));
    let doc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(doc["workload"]["capacities_bytes"], serde_json::json!([256u64 << 20, 512u64 << 20]));
    let points = doc["capacity_sweep"]["points"].as_array().unwrap();
    assert_eq!(points.len(), 2);
    let mut preemptions = [0u64; 2];
    for p in points {
        let managers = p["managers"].as_array().unwrap();
        let names: Vec<&str> = managers.iter().map(|m| m["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["arena", "vllm-paged"]);
        for (i, m) in managers.iter().enumerate() {
            let done = m["completed_requests"].as_u64().unwrap() + m["rejected_requests"].as_u64().unwrap();
            assert_eq!(done, 80, "{} at {}", m["name"], p["capacity_bytes"]);
            assert_eq!(m["integrity_errors"], 0);
            preemptions[i] += m["preemptions"].as_u64().unwrap();
            assert!(m["decode_step_calls"]["steps"].as_u64().unwrap() > 0);
        }
        // vLLM's pool is mapped when it is built: no call in any step.
        assert_eq!(managers[1]["decode_step_calls"]["total"]["max"], 0);
    }
    // At 256 MiB (2,048 tokens of 128 KiB) 80 requests of the synthetic
    // trace cannot all run at once: the small capacity preempts.
    assert!(preemptions.iter().sum::<u64>() > 0, "no pressure at 256 MiB");
    let summed = doc["capacity_sweep"]["summed"].as_array().unwrap();
    for (i, t) in summed.iter().enumerate() {
        assert_eq!(t["capacities"], 2);
        assert_eq!(t["preemptions"].as_u64().unwrap(), preemptions[i]);
    }
}
