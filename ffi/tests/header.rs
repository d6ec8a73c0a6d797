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
    // 23 from the contracts, 3 from the open work's stream-ordered frees and
    // prefetch, and the project's own: resize_many, resize_on_stream,
    // quiesce_on_stream, unquiesce, 13 of the device groups, 12 of export,
    // import and DMA-BUFs, 5 of two-phase operations, 2 of tagged allocation, 2 stream-ordered
    // allocations, 1 of admission map-ahead, 3 of the KV layout, 2 of the
    // backup cache, 1 reading a sleeper's backup, 1 giving the virtual
    // range (a block table's base).
    assert_eq!(functions, 23 + 3 + 4 + 13 + 12 + 5 + 2 + 2 + 1 + 3 + 2 + 1 + 1, "{items:#?}");
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
            // The status enum grows with the contract's additions (checked
            // against the next contract below): the contract's members first.
            Some(got) if matches!((&got.decl, &want.decl), (Decl::Enum(g), Decl::Enum(w)) if g.starts_with(w)) => {}
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

/// The integer value of a `#define`'s text (`0xFFFFFFFFu`, `4294967295u`, `1u`).
fn define_value(text: &str) -> Option<u64> {
    let t = text.trim().trim_end_matches(['u', 'U', 'l', 'L']);
    match t.strip_prefix("0x").or_else(|| t.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => t.parse().ok(),
    }
}

/// Names the project header declares that neither contract header has yet
/// (issue 11's resize_many; issue 15: device groups, export and import;
/// resize_on_stream, quiesce_on_stream and unquiesce, the C faces of
/// `Arena::resize_on_stream`, `Arena::quiesce_on_stream` and
/// `Arena::unquiesce`; alloc_on_stream and alloc_growable_on_stream, the C
/// faces of same-stream reuse), each documented in the header itself. Every
/// other addition must come from `vmm_arena_next.h`; a name added by
/// mistake fails `additions_match_the_next_contract`.
const PROJECT_ONLY: &[&str] = &[
    "vmm_arena_resize_many",
    "vmm_arena_resize_on_stream",
    "vmm_arena_quiesce_on_stream",
    "vmm_arena_unquiesce",
    "VMM_ARENA_GROUP_PEER_ACCESS",
    "vmm_arena_group",
    "vmm_arena_group_id",
    "vmm_arena_group_create",
    "vmm_arena_group_destroy",
    "vmm_arena_group_last_member",
    "vmm_arena_group_member_count",
    "vmm_arena_group_alloc",
    "vmm_arena_group_alloc_growable",
    "vmm_arena_group_resize",
    "vmm_arena_group_free",
    "vmm_arena_group_query",
    "vmm_arena_group_stats_get",
    "vmm_arena_group_snapshot_json",
    "VMM_ARENA_FLAG_EXPORTABLE",
    "VMM_ARENA_EXPORT_FORMAT_VERSION",
    "VMM_ARENA_IMPORT_READ_ONLY",
    "vmm_arena_export_layout",
    "vmm_arena_export",
    "vmm_arena_export_open",
    "vmm_arena_export_layout_get",
    "vmm_arena_export_fds",
    "vmm_arena_export_close",
    "vmm_arena_import",
    "vmm_arena_export_dmabuf",
    "vmm_arena_sharing_stats",
    // Export descriptors, the layout record's version 2, DMA-BUF handles.
    "VMM_ARENA_EXPORT_HANDLE_UNSPECIFIED",
    "VMM_ARENA_EXPORT_HANDLE_HOST_MEMFD",
    "VMM_ARENA_EXPORT_HANDLE_CUDA_POSIX_FD",
    "VMM_ARENA_EXPORT_LAYOUT_MIN_SIZE",
    "VMM_ARENA_FDS_PER_MESSAGE",
    "vmm_arena_export_send",
    "vmm_arena_import_recv",
    "vmm_arena_dmabuf",
    "vmm_arena_dmabuf_open",
    "vmm_arena_dmabuf_fd",
    "vmm_arena_dmabuf_close",
    // Tensor-parallel groups: members from C, per-member configs, ranks
    // in separate processes (deterministic placement, two-phase operations).
    "vmm_arena_group_create_with_configs",
    "vmm_arena_group_member",
    "VMM_ARENA_FLAG_DETERMINISTIC_PLACEMENT",
    "VMM_ARENA_PREPARE_GROWABLE",
    "vmm_arena_prepared",
    "vmm_arena_prepare_alloc",
    "vmm_arena_prepare_resize",
    "vmm_arena_prepare_free",
    "vmm_arena_commit",
    "vmm_arena_abort",
    // Tags at allocation time.
    "vmm_arena_alloc_tagged",
    "vmm_arena_alloc_growable_tagged",
    // Allocations ordered on a stream.
    "vmm_arena_alloc_on_stream",
    "vmm_arena_alloc_growable_on_stream",
    // Admission map-ahead.
    "vmm_arena_set_admission_prefetch",
    // The block-in-chunk KV layout.
    "vmm_arena_kv_geometry",
    "vmm_arena_kv_layout",
    "vmm_arena_kv_layout_get",
    "vmm_arena_kv_token_offset",
    "vmm_arena_block_table",
    "vmm_arena_va_range",
    // Sleep backups kept across cycles.
    "vmm_arena_set_backup_cache",
    "vmm_arena_release_backup_cache",
    // A sleeper's backup, read without waking it.
    "vmm_arena_read_backup",
];

/// What the header adds from the contract of the open work
/// (`vmm_arena_next.h`: sleep and wake, alloc_shared, stream-ordered
/// frees and prefetch so far) is declared as it says: its functions
/// identically, its macros with the same value and type (unsigned), and
/// each new status member with the value its comment gives.
/// The project's own additions ([`PROJECT_ONLY`]) are all there, and are
/// the only names in neither contract.
#[test]
fn additions_match_the_next_contract() {
    let Some(contract_path) = contract_header() else { return };
    let next_path = contract_path.with_file_name("vmm_arena_next.h");
    let Ok(next_text) = std::fs::read_to_string(&next_path) else {
        eprintln!("SKIPPED: {} is missing", next_path.display());
        return;
    };
    let next = parse_header(&next_text);
    let contract = parse_header(&std::fs::read_to_string(&contract_path).unwrap());
    let ours = parse_header(&std::fs::read_to_string(ffi_dir().join("include/vmm_arena.h")).unwrap());
    let added: Vec<&String> = ours.keys().filter(|k| !contract.contains_key(*k)).collect();
    assert!(!added.is_empty(), "nothing added, nothing to check");
    for name in [
        "vmm_arena_set_tag",
        "vmm_arena_sleep",
        "vmm_arena_wake",
        "VMM_ARENA_ALL_TAGS",
        "VMM_ARENA_SLEEP_BACKUP",
        "vmm_arena_alloc_shared",
        "vmm_arena_free_on_stream",
        "vmm_arena_set_prefetch",
        "vmm_arena_maintain",
        "VMM_ARENA_FLAG_BACKGROUND",
        "vmm_arena_resize_many",
    ] {
        assert!(added.contains(&&name.to_string()), "{name} is not declared");
    }
    for name in PROJECT_ONLY {
        assert!(added.contains(&&name.to_string()), "{name} is not declared");
        assert!(!next.contains_key(*name), "{name} is in vmm_arena_next.h now: check it there instead");
    }
    for name in added.into_iter().filter(|n| !PROJECT_ONLY.contains(&n.as_str())) {
        let want = next.get(name).unwrap_or_else(|| panic!("{name} is in neither contract header"));
        match (&ours[name].decl, &want.decl) {
            (Decl::Define(g), Decl::Define(w)) => {
                assert_eq!(define_value(g), define_value(w), "{name}: {g} vs {w}");
                assert!(g.ends_with('u') && w.ends_with('u'), "{name}: both unsigned: {g} vs {w}");
            }
            (g, w) => assert_eq!(g, w, "{name}"),
        }
    }
    let Decl::Enum(ours_status) = &ours["vmm_arena_status"].decl else { panic!("vmm_arena_status is an enum") };
    let Decl::Enum(contract_status) = &contract["vmm_arena_status"].decl else { panic!("an enum") };
    for (member, value) in &ours_status[contract_status.len()..] {
        if PROJECT_ONLY_STATUSES.contains(&(member.as_str(), *value)) {
            assert!(!next_text.contains(member.as_str()), "{member} is in vmm_arena_next.h now: check it there");
            continue;
        }
        assert!(
            next_text.contains(&format!("{member} = {value}")),
            "{member} = {value} is not a status of {}",
            next_path.display()
        );
    }
    assert!(ours_status.iter().any(|(m, v)| m == "VMM_ARENA_ERR_ASLEEP" && *v == 9));
    for (member, value) in PROJECT_ONLY_STATUSES {
        assert!(ours_status.iter().any(|(m, v)| m == member && v == value), "{member} = {value} is not declared");
    }
}

/// Statuses of this project's own additions (two-phase operations), in
/// neither contract header.
const PROJECT_ONLY_STATUSES: &[(&str, i64)] = &[("VMM_ARENA_ERR_STALE", 10)];
