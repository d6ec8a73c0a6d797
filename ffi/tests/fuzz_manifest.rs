//! The c_abi fuzz target builds this crate's source a second time, as the
//! rlib `fuzz/ffi-rlib` (nightly only, so no stable build sees it). Every
//! dependency of this crate must be one of that crate's too: `libc`, added
//! here for `vmm_arena_import`, was missing there, and CI's fuzz step could
//! not build (a warning, not a failure, so nothing stopped it).

use std::collections::BTreeSet;

/// The keys of a manifest's `[dependencies]` table (a plain line reader:
/// both manifests write one `name = ...` per line).
fn dependencies(manifest: &str) -> BTreeSet<String> {
    let mut deps = BTreeSet::new();
    let mut inside = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            inside = line == "[dependencies]";
        } else if inside && !line.starts_with('#') {
            if let Some((name, _)) = line.split_once('=') {
                deps.insert(name.trim().to_string());
            }
        }
    }
    deps
}

#[test]
fn the_fuzz_rlib_has_every_dependency_of_the_ffi_crate() {
    let root = env!("CARGO_MANIFEST_DIR");
    let ffi = std::fs::read_to_string(format!("{root}/Cargo.toml")).unwrap();
    let rlib = std::fs::read_to_string(format!("{root}/../fuzz/ffi-rlib/Cargo.toml")).unwrap();
    let (ffi, rlib) = (dependencies(&ffi), dependencies(&rlib));
    assert!(ffi.contains("libc") && ffi.contains("arena"), "the reader found {ffi:?}");
    let missing: Vec<_> = ffi.difference(&rlib).collect();
    assert!(missing.is_empty(), "fuzz/ffi-rlib/Cargo.toml lacks {missing:?} (ffi/Cargo.toml has them)");
}
