//! The committed header `include/vmm_arena.h` is exactly what cbindgen
//! generates from the code, and it declares every name of the contract
//! header identically.
//!
//! To regenerate it: `VMM_ARENA_BLESS=1 cargo test -p vmm-arena-ffi --test header`.

mod common;

use common::{contract_header, ffi_dir, parse_header, Decl};

fn generate() -> String {
    let dir = ffi_dir();
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml parses");
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen generates the header");
    let mut out = Vec::new();
    bindings.write(&mut out);
    String::from_utf8(out).expect("the header is UTF-8")
}

#[test]
fn committed_header_is_fresh() {
    let path = ffi_dir().join("include/vmm_arena.h");
    let fresh = generate();
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed == fresh {
        return;
    }
    if std::env::var_os("VMM_ARENA_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("write the header");
        eprintln!("rewrote {}", path.display());
        return;
    }
    let first = committed.lines().zip(fresh.lines()).position(|(a, b)| a != b);
    panic!(
        "{} is stale (first difference at line {}): regenerate it with \
         `VMM_ARENA_BLESS=1 cargo test -p vmm-arena-ffi --test header` and commit it",
        path.display(),
        first.map_or(committed.lines().count().min(fresh.lines().count()), |l| l) + 1
    );
}

#[test]
fn generated_header_parses_to_the_whole_api() {
    let src = std::fs::read_to_string(ffi_dir().join("include/vmm_arena.h")).unwrap();
    let items = parse_header(&src);
    let functions = items.values().filter(|i| matches!(i.decl, Decl::Function(..))).count();
    assert_eq!(functions, 19, "{items:#?}");
    // The testing hooks are not part of the header.
    assert!(items.keys().all(|k| !k.contains("testing")), "{:?}", items.keys());
    match &items["vmm_arena_stats"].decl {
        Decl::Struct(fields) => assert_eq!(fields.len(), 18),
        other => panic!("{other:?}"),
    }
}

#[test]
fn generated_header_declares_the_contract_identically() {
    let Some(contract_path) = contract_header() else { return };
    let contract = parse_header(&std::fs::read_to_string(&contract_path).unwrap());
    let ours = parse_header(&std::fs::read_to_string(ffi_dir().join("include/vmm_arena.h")).unwrap());

    // The parser must have understood the contract, or this test proves nothing.
    let count = |f: fn(&Decl) -> bool| contract.values().filter(|i| f(&i.decl)).count();
    assert!(count(|d| matches!(d, Decl::Function(..))) >= 19, "{contract:#?}");
    assert!(count(|d| matches!(d, Decl::Struct(..))) >= 3, "{contract:#?}");
    assert!(count(|d| matches!(d, Decl::Enum(..))) >= 2, "{contract:#?}");
    assert!(count(|d| matches!(d, Decl::Define(..))) >= 2, "{contract:#?}");

    let mut problems = Vec::new();
    for (name, want) in &contract {
        if name == "VMM_ARENA_H" {
            continue; // the include guard, which has no value anyway
        }
        match ours.get(name) {
            None => problems.push(format!("missing: {name}\n  contract: {}", want.text)),
            Some(got) if got.decl != want.decl => {
                problems.push(format!("differs: {name}\n  contract:  {:?}\n  generated: {:?}", want.decl, got.decl))
            }
            Some(_) => {}
        }
    }
    assert!(
        problems.is_empty(),
        "the generated header does not match {}:\n{}",
        contract_path.display(),
        problems.join("\n")
    );
}
