//! Replays the committed corpus of the `ops` fuzz target (fuzz/corpus/ops)
//! through the target's own logic, on stable Rust: every input the fuzzer
//! kept (and every crash it ever found, once fixed and added) runs in
//! `cargo test`. The logic is fuzz/logic/ops.rs, shared with the target.
//! The C ABI target's corpus is replayed by the ffi crate's unit tests.
//!
//! `VMM_ARENA_FUZZ_INPUT=path` replays one file (e.g. a crash artifact) or
//! every file of a directory (e.g. the scratch corpus of scripts/fuzz.sh,
//! target/fuzz-corpus/ops) instead.
//!
//! The test binary may run on another machine than the one that built it
//! (scripts/gpu-check.sh carries it to a GPU machine, with a copy of the
//! repository at another path). There the build tree's `CARGO_MANIFEST_DIR`
//! does not exist, so the corpus is looked up as `fuzz/corpus/ops` under the
//! current directory, and the test says it skipped when that is missing too.

#[path = "../fuzz/logic/ops.rs"]
mod ops;

use std::path::{Path, PathBuf};

const CORPUS: &str = "fuzz/corpus/ops";

/// The corpus directory (or single input) to replay, or why there is none.
fn source() -> Result<PathBuf, String> {
    if let Some(given) = std::env::var_os("VMM_ARENA_FUZZ_INPUT") {
        // Asked for explicitly: a missing path is an error, found below.
        return Ok(PathBuf::from(given));
    }
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    if manifest.join("Cargo.toml").is_file() {
        // The build tree is here (every `cargo test`): its corpus must be
        // too, so a deleted or moved corpus fails instead of skipping.
        return Ok(manifest.join(CORPUS));
    }
    let here = Path::new(CORPUS);
    if here.is_dir() {
        return Ok(here.to_path_buf());
    }
    let cwd = std::env::current_dir().map_or_else(|e| format!("? ({e})"), |d| d.display().to_string());
    Err(format!(
        "neither the build tree {} nor {cwd} has {CORPUS}; run from a copy of the repository root \
         or set VMM_ARENA_FUZZ_INPUT",
        manifest.display()
    ))
}

fn inputs(dir: PathBuf) -> Vec<PathBuf> {
    if dir.is_file() {
        return vec![dir];
    }
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
    let dir = match source() {
        Ok(dir) => dir,
        Err(why) => {
            eprintln!("ops_corpus_replays_against_the_model: skipped: {why}");
            return;
        }
    };
    println!("corpus: {}", dir.display());
    let files = inputs(dir);
    assert!(!files.is_empty(), "the ops corpus is empty");
    // VMM_ARENA_FUZZ_MAX_OPS=n: only the first n operations of each input
    // (scripts/miri.sh, where an operation and its checks take seconds).
    let max_ops = std::env::var("VMM_ARENA_FUZZ_MAX_OPS").ok().and_then(|v| v.parse().ok()).unwrap_or(ops::MAX_OPS);
    let mut ops = 0;
    let mut sharing = 0;
    let mut on_stream = 0;
    let mut quiescing = 0;
    for f in &files {
        let data = std::fs::read(f).unwrap();
        let decoded = ops::decode(&data).1;
        ops += decoded.len().min(max_ops);
        let shares = |op: &ops::Op| match op {
            ops::Op::AllocShared { .. } => true,
            ops::Op::Faulty(_, _, inner) => matches!(**inner, ops::Op::AllocShared { .. }),
            _ => false,
        };
        sharing += usize::from(decoded.iter().take(max_ops).any(shares));
        let resizes_on_stream = |op: &ops::Op| match op {
            ops::Op::ResizeOnStream(..) => true,
            ops::Op::Faulty(_, _, inner) => matches!(**inner, ops::Op::ResizeOnStream(..)),
            _ => false,
        };
        on_stream += usize::from(decoded.iter().take(max_ops).any(resizes_on_stream));
        let quiesces = |op: &ops::Op| match op {
            ops::Op::Quiesce(..) | ops::Op::Unquiesce(_) => true,
            ops::Op::Faulty(_, _, inner) => matches!(**inner, ops::Op::Quiesce(..) | ops::Op::Unquiesce(_)),
            _ => false,
        };
        quiescing += usize::from(decoded.iter().take(max_ops).any(quiesces));
        if let Err(p) = std::panic::catch_unwind(|| ops::run_limited(&data, max_ops)) {
            eprintln!("corpus input {} fails", f.display());
            std::panic::resume_unwind(p);
        }
    }
    println!(
        "replayed {} inputs, {ops} operations; {sharing} inputs call alloc_shared, {on_stream} resize_on_stream, \
         {quiescing} quiesce_on_stream or unquiesce",
        files.len()
    );
    println!("outcomes: {:?}", ops::OUTCOMES.lock().unwrap());
}
