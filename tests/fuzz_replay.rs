//! Replays the committed corpus of the `ops` fuzz target (fuzz/corpus/ops)
//! through the target's own logic, on stable Rust: every input the fuzzer
//! kept (and every crash it ever found, once fixed and added) runs in
//! `cargo test`. The logic is fuzz/logic/ops.rs, shared with the target.
//! The C ABI target's corpus is replayed by the ffi crate's unit tests.
//!
//! `VMM_ARENA_FUZZ_INPUT=path` replays one file (e.g. a crash artifact) or
//! every file of a directory (e.g. the scratch corpus of scripts/fuzz.sh,
//! target/fuzz-corpus/ops) instead.

#[path = "../fuzz/logic/ops.rs"]
mod ops;

use std::path::{Path, PathBuf};

fn inputs() -> Vec<PathBuf> {
    let dir = match std::env::var_os("VMM_ARENA_FUZZ_INPUT").map(PathBuf::from) {
        Some(one) if one.is_file() => return vec![one],
        Some(dir) => dir,
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/ops"),
    };
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    // VMM_ARENA_FUZZ_MAX_INPUTS=n: n inputs spread over the sorted list (Miri).
    let n = std::env::var("VMM_ARENA_FUZZ_MAX_INPUTS").ok().and_then(|v| v.parse().ok()).unwrap_or(usize::MAX);
    if files.len() > n {
        files = (0..n).map(|i| files[i * files.len() / n].clone()).collect();
    }
    files
}

#[test]
fn ops_corpus_replays_against_the_model() {
    let files = inputs();
    assert!(!files.is_empty(), "the ops corpus is empty");
    // VMM_ARENA_FUZZ_MAX_OPS=n: only the first n operations of each input
    // (scripts/miri.sh, where an operation and its checks take seconds).
    let max_ops = std::env::var("VMM_ARENA_FUZZ_MAX_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(ops::MAX_OPS);
    let mut ops = 0;
    for f in &files {
        let data = std::fs::read(f).unwrap();
        ops += ops::decode(&data).1.len().min(max_ops);
        if let Err(p) = std::panic::catch_unwind(|| ops::run_limited(&data, max_ops)) {
            eprintln!("corpus input {} fails", f.display());
            std::panic::resume_unwind(p);
        }
    }
    println!("replayed {} inputs, {ops} operations", files.len());
    println!("outcomes: {:?}", ops::OUTCOMES.lock().unwrap());
}
