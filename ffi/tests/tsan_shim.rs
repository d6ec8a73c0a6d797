//! The TSan build of the C/C++ thread tests (scripts/tsan.sh) links
//! `tests/tsan/serialize_calls.c`, which runs each library call under one
//! pthread mutex so that TSan sees the ordering the arena's own lock gives.
//! A function it does not wrap still runs under the library's lock only,
//! invisible to TSan: the shim fell behind the header once (sleep, wake,
//! set_tag, alloc_shared and export/import had no wrapper), and nothing
//! noticed. Every function the header exports must have a wrapper, and
//! every wrapper must name one. (Signatures need no check here: the shim
//! includes the header, so a wrapper that disagrees does not compile.)

mod common;

use common::{ffi_dir, parse_header, Decl};
use std::collections::BTreeSet;

/// The functions `include/vmm_arena.h` declares.
fn exported() -> BTreeSet<String> {
    let src = std::fs::read_to_string(ffi_dir().join("include/vmm_arena.h")).unwrap();
    parse_header(&src)
        .into_iter()
        .filter(|(_, item)| matches!(item.decl, Decl::Function(..)))
        .map(|(name, _)| name)
        .collect()
}

/// The functions the shim wraps: the name in each `WRAP(ret, name, ...)`
/// and `WRAP_VOID(name, ...)` line (a plain line reader: each use of the
/// macros starts a line, and a return type holds no comma).
fn wrapped(shim: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for line in shim.lines().map(str::trim_start) {
        let name = if let Some(args) = line.strip_prefix("WRAP(") {
            args.split(',').nth(1)
        } else if let Some(args) = line.strip_prefix("WRAP_VOID(") {
            args.split(',').next()
        } else {
            None
        };
        if let Some(name) = name {
            names.insert(name.trim().to_string());
        }
    }
    names
}

#[test]
fn the_tsan_shim_wraps_every_exported_function() {
    let shim = std::fs::read_to_string(ffi_dir().join("tests/tsan/serialize_calls.c")).unwrap();
    let (exported, wrapped) = (exported(), wrapped(&shim));
    // The readers must have understood both files, or this proves nothing.
    for name in ["vmm_arena_create", "vmm_arena_destroy", "vmm_arena_status_name"] {
        assert!(exported.contains(name), "the header reader found {exported:?}");
        assert!(wrapped.contains(name), "the shim reader found {wrapped:?}");
    }
    let unwrapped: Vec<_> = exported.difference(&wrapped).collect();
    assert!(
        unwrapped.is_empty(),
        "tests/tsan/serialize_calls.c does not wrap {unwrapped:?}: add a WRAP/WRAP_VOID line for each"
    );
    let unknown: Vec<_> = wrapped.difference(&exported).collect();
    assert!(
        unknown.is_empty(),
        "tests/tsan/serialize_calls.c wraps {unknown:?}, which include/vmm_arena.h does not export"
    );
}
