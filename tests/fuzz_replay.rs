//! Replays the committed corpus of the `ops` fuzz target (fuzz/corpus/ops)
//! through the target's own logic, on stable Rust: every input the fuzzer
//! kept (and every crash it ever found, once fixed and added) runs in
//! `cargo test`. The logic is fuzz/logic/ops.rs, shared with the target.
//! The C ABI target's corpus is replayed by the ffi crate's unit tests.
//!
//! `VMM_ARENA_FUZZ_INPUT=path` replays one file (e.g. a crash artifact).

#[path = "../fuzz/logic/ops.rs"]
mod ops;

use std::path::{Path, PathBuf};

fn inputs() -> Vec<PathBuf> {
    if let Some(one) = std::env::var_os("VMM_ARENA_FUZZ_INPUT") {
        return vec![one.into()];
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/ops");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    files
}

#[test]
fn ops_corpus_replays_against_the_model() {
    let files = inputs();
    assert!(!files.is_empty(), "the ops corpus is empty");
    let mut ops = 0;
    for f in &files {
        let data = std::fs::read(f).unwrap();
        ops += ops::decode(&data).1.len();
        if let Err(p) = std::panic::catch_unwind(|| ops::run(&data)) {
            eprintln!("corpus input {} fails", f.display());
            std::panic::resume_unwind(p);
        }
    }
    println!("replayed {} inputs, {ops} operations", files.len());
    println!("outcomes: {:?}", ops::OUTCOMES.lock().unwrap());
}
