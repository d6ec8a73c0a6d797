//! `kv_serving --layout block-in-chunk`: the arena's KV in chunks that are
//! each one block of a paged kernel's block table. For Llama-3-8B a chunk
//! holds 16 tokens of every layer exactly, so its memory is the token-major
//! layout's; attention reads it at the paged kernel's efficiency, so the
//! token-major penalty does not touch it and the paged overhead does.

use std::process::Command;

/// The JSON report and the stderr of `kv_serving --quick --managers arena`
/// with `extra`.
fn report(tag: &str, extra: &[&str]) -> (serde_json::Value, String) {
    let dir = std::env::temp_dir().join(format!("kv_serving_layout_{}_{tag}", std::process::id()));
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
    (report, String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The arena row of `kv_serving --quick --managers arena` with `extra`.
fn arena_row(tag: &str, extra: &[&str]) -> serde_json::Value {
    let arena = report(tag, extra).0["managers"][0].clone();
    assert_eq!(arena["name"], "arena");
    arena
}

fn efficiency(layout: &str, value: f64) -> String {
    let mut m = serde_json::Map::new();
    for phase in ["decode", "prefill"] {
        m.insert(
            format!("attn_eff_{phase}_{layout}"),
            serde_json::json!({"value": value, "source": "test: an attention penalty"}),
        );
    }
    serde_json::Value::Object(m).to_string()
}

fn f(row: &serde_json::Value, key: &str) -> f64 {
    row[key].as_f64().unwrap_or_else(|| panic!("{key} in {row}"))
}

#[test]
fn block_in_chunk_holds_token_major_memory_and_reads_at_the_paged_efficiency() {
    let token_major = arena_row("tm", &["--layout", "token-major"]);
    let block = arena_row("bic", &["--layout", "block-in-chunk"]);
    // Same chunks for the same tokens.
    assert_eq!(f(&block, "peak_physical_bytes"), f(&token_major, "peak_physical_bytes"));
    assert_eq!(f(&block, "tokens_per_s"), f(&token_major, "tokens_per_s"));

    // A token-major penalty slows the token-major arena, not block-in-chunk.
    let slow_tm = efficiency("token_major", 0.5);
    let tm_pen = arena_row("tm_pen", &["--layout", "token-major", "--profile-json", &slow_tm]);
    let bic_tm_pen = arena_row("bic_tm_pen", &["--layout", "block-in-chunk", "--profile-json", &slow_tm]);
    assert!(f(&tm_pen, "tokens_per_s") < f(&token_major, "tokens_per_s"));
    assert_eq!(f(&bic_tm_pen, "tokens_per_s"), f(&block, "tokens_per_s"));

    // A paged overhead slows block-in-chunk.
    let slow_paged = efficiency("paged", 0.5);
    let bic_paged = arena_row("bic_paged", &["--layout", "block-in-chunk", "--profile-json", &slow_paged]);
    assert!(f(&bic_paged, "tokens_per_s") < f(&block, "tokens_per_s"));
}

#[test]
fn block_in_chunk_refuses_tokens_that_do_not_fill_a_chunk() {
    // 96 KiB tokens: 2 MiB holds 21.3 of them; the padding is not modelled.
    let out = Command::new(env!("CARGO_BIN_EXE_kv_serving"))
        .args(["--quick", "--managers", "arena", "--layout", "block-in-chunk", "--kv-bytes-per-token", "98304"])
        .output()
        .expect("kv_serving runs");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("whole number"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The workload's layout in the JSON report of `kv_serving --quick` with
/// `extra`, and the run's stderr.
fn default_layout(tag: &str, extra: &[&str]) -> (String, String) {
    let (report, stderr) = report(tag, extra);
    (report["workload"]["layout"].as_str().expect("layout").to_string(), stderr)
}

#[test]
fn block_in_chunk_is_the_default_where_a_chunk_holds_whole_tokens() {
    // Llama-3-8B's 128 KiB tokens: 16 in a 2 MiB chunk.
    let (layout, _) = default_layout("default", &[]);
    assert_eq!(layout, "block-in-chunk");
    // 96 KiB tokens do not fill one: token-major, and the run says why.
    let (layout, stderr) = default_layout("default_96k", &["--kv-bytes-per-token", "98304"]);
    assert_eq!(layout, "token-major");
    assert!(stderr.contains("whole number"), "{stderr}");
}
