//! Export and import in one process (host backend): bytes both ways,
//! pinning while an export is open, the exporter freeing first, read-only
//! imports, what is refused, stats; and a fault matrix over export, import
//! and the frees of both, plain and on a stream (every driver call of the
//! operation fails in turn, with each fault kind). The two-process test is `tests/export_two_process.rs`.

mod common;

use std::os::fd::AsFd;
use std::sync::Arc;

use common::{Snap, HOST_CHUNK as C};
use vmm_arena::driver::fault::{FaultDriver, FaultKind};
use vmm_arena::driver::host::{HostDriver, HostOptions};
use vmm_arena::driver::Driver;
use vmm_arena::{Arena, ArenaConfig, ExportLayout, Id, Status, ALL_TAGS, EXPORT_FORMAT_VERSION};

fn cfg(cap: u64) -> ArenaConfig {
    ArenaConfig { capacity_bytes: cap * C, reserve_bytes: 4 * cap * C, chunk_bytes: C, ..ArenaConfig::default() }
}

fn exporter(cap: u64) -> (Arc<HostDriver>, Arena) {
    let d = Arc::new(HostDriver::with_exportable_chunks(HostOptions::default()).unwrap());
    let a = Arena::with_driver(d.clone(), cfg(cap)).unwrap();
    (d, a)
}

fn importer(cap: u64) -> (Arc<HostDriver>, Arena) {
    let d = Arc::new(HostDriver::new().unwrap());
    let a = Arena::with_driver(d.clone(), cfg(cap)).unwrap();
    (d, a)
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 11) as u8).collect()
}

fn read(a: &Arena, id: Id, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    a.read(id, 0, &mut v).unwrap();
    v
}

#[test]
fn bytes_flow_both_ways_and_stats_count_imports_apart() {
    let (_ed, ex) = exporter(8);
    let (_id, im) = importer(8);
    let size = 3 * C - 100;
    let (x, _) = ex.alloc(size).unwrap();
    ex.write(x, 0, &pattern(1, size as usize)).unwrap();
    let export = ex.export(x).unwrap();
    let layout = export.layout();
    assert_eq!(
        layout,
        ExportLayout {
            version: EXPORT_FORMAT_VERSION,
            chunk_bytes: C,
            chunk_count: 3,
            size,
            handle_type: vmm_arena::EXPORT_HANDLE_HOST_MEMFD,
            device: -1
        }
    );
    assert_eq!(export.fds().len(), 3);
    let (y, ptr) = im.import_export(&export, false).unwrap();
    assert_ne!(ptr, 0);
    assert_eq!(read(&im, y, size as usize), pattern(1, size as usize), "the importer sees the exporter's bytes");
    im.write(y, 5, b"from the importer").unwrap();
    let mut got = [0u8; 17];
    ex.read(x, 5, &mut got).unwrap();
    assert_eq!(&got, b"from the importer", "and the exporter sees the importer's");
    let info = im.query(y).unwrap();
    assert_eq!((info.ptr, info.size, info.mapped_bytes, info.pinned), (ptr, size, 3 * C, true));
    let s = im.stats().unwrap();
    assert_eq!((s.imported_allocations, s.imported_bytes), (1, 3 * C));
    assert_eq!((s.live_allocations, s.live_bytes, s.mapped_bytes), (0, 0, 0), "imports count apart");
    assert_eq!(ex.stats().unwrap().exported_allocations, 1);
    // Refused on an import.
    for e in [im.resize(y, C).unwrap_err(), im.set_tag(y, 3).unwrap_err(), im.export(y).unwrap_err()] {
        assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    }
    im.pin(y).unwrap();
    im.unpin(y).unwrap();
    im.free(y).unwrap();
    assert_eq!(im.free(y).unwrap_err().status(), Status::UnknownAllocation);
    assert_eq!(im.stats().unwrap().imported_allocations, 0);
    drop(export);
    ex.free(x).unwrap();
}

#[test]
fn an_exported_allocation_is_pinned_until_every_export_closes() {
    let (_d, ex) = exporter(16);
    let (a, _) = ex.alloc(2 * C).unwrap();
    let (b, _) = ex.alloc(C).unwrap(); // right after a
    ex.pin(b).unwrap(); // so that a cannot grow in place by moving b
    let e1 = ex.export(a).unwrap();
    let e2 = ex.export(a).unwrap();
    assert!(ex.query(a).unwrap().pinned);
    // Growth past the neighbour would have to move it: pinned.
    assert_eq!(ex.resize(a, 4 * C).unwrap_err().status(), Status::Pinned);
    ex.unpin(a).unwrap(); // the caller's wish, applied when the exports close
    assert!(ex.query(a).unwrap().pinned, "exports keep it pinned");
    drop(e1);
    assert!(ex.query(a).unwrap().pinned, "one export is still open");
    drop(e2);
    assert!(!ex.query(a).unwrap().pinned, "the caller's unpin applies once all are closed");
    // A caller's pin survives an export.
    drop(ex.export(b).unwrap());
    assert!(ex.query(b).unwrap().pinned);
    // It may move again, and a shrink below the exported chunks is refused.
    assert_eq!(ex.resize(a, C).unwrap_err().status(), Status::InvalidArgument);
    let before = ex.query(a).unwrap().ptr;
    assert_ne!(ex.resize(a, 5 * C).unwrap(), before, "unpinned again, it moves to grow");
    ex.resize(a, 2 * C).unwrap(); // back to what it exported: fine
                                  // It never sleeps.
    ex.set_tag(a, 9).unwrap();
    ex.sleep(ALL_TAGS, 0).unwrap();
    assert!(!ex.query(a).unwrap().asleep);
    ex.free(a).unwrap();
    ex.free(b).unwrap();
}

#[test]
fn the_exporter_frees_first_and_the_importer_keeps_its_bytes() {
    let (ed, ex) = exporter(4);
    let (id, im) = importer(4);
    let size = 2 * C;
    let (x, _) = ex.alloc(size).unwrap();
    ex.write(x, 0, &pattern(7, size as usize)).unwrap();
    let export = ex.export(x).unwrap();
    let (y, _) = im.import_export(&export, false).unwrap();
    drop(export);
    ex.free(x).unwrap();
    let s = ex.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes, s.exported_allocations), (0, 0, 0), "released, never pooled");
    // The exporter reuses its capacity; none of it is the importer's memory.
    let (z, _) = ex.alloc(4 * C).unwrap();
    ex.write(z, 0, &pattern(9, 4 * C as usize)).unwrap();
    assert_eq!(read(&im, y, size as usize), pattern(7, size as usize), "the importer's bytes stay");
    im.write(y, 0, b"still mine").unwrap();
    assert_eq!(read(&ex, z, 4 * C as usize), pattern(9, 4 * C as usize), "and do not reach the exporter");
    assert_eq!(ed.own_descriptors(), 4, "only z's chunks are held by the exporter");
    assert_eq!(id.own_descriptors(), 2);
    im.free(y).unwrap();
    assert_eq!(id.own_descriptors(), 0, "the importer closed what it kept");
    assert_eq!((id.live_chunks(), id.live_mappings()), (0, 0));
}

#[test]
fn read_only_imports_refuse_writes() {
    let (_ed, ex) = exporter(4);
    let (_id, im) = importer(4);
    let (x, _) = ex.alloc(C).unwrap();
    ex.write(x, 0, b"read me").unwrap();
    let export = ex.export(x).unwrap();
    let (y, _) = im.import_export(&export, true).unwrap();
    assert_eq!(im.import_is_read_only(y).unwrap(), Some(true));
    assert_eq!(&read(&im, y, 7)[..], b"read me");
    assert_eq!(im.write(y, 0, b"no").unwrap_err().status(), Status::Driver);
    im.free(y).unwrap();
}

#[test]
fn bad_layouts_descriptors_and_arenas_are_refused() {
    let (_ed, ex) = exporter(8);
    let (_id, im) = importer(8);
    let (x, _) = ex.alloc(2 * C).unwrap();
    let export = ex.export(x).unwrap();
    let good = export.layout();
    let fds = export.borrowed_fds();
    let bad = [
        ExportLayout { version: 3, ..good },
        ExportLayout { version: 0, ..good },
        ExportLayout { handle_type: vmm_arena::EXPORT_HANDLE_CUDA_POSIX_FD, ..good },
        ExportLayout { chunk_bytes: 2 * C, ..good },
        ExportLayout { chunk_count: 3, ..good },
        ExportLayout { chunk_count: 0, ..good },
        ExportLayout { size: 0, ..good },
        ExportLayout { size: C, ..good }, // fills one chunk, not two
        ExportLayout { size: 2 * C + 1, ..good },
    ];
    for l in bad {
        let e = im.import(&l, &fds, false).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument, "{l:?}: {e}");
    }
    // Descriptors that are not exported chunks: a regular file that is not
    // sealed, a chunk of another size.
    let file = std::fs::File::open(std::env::current_exe().unwrap()).unwrap();
    let e = im.import(&ExportLayout { chunk_count: 1, size: C, ..good }, &[file.as_fd()], false).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    let other = Arc::new(HostDriver::with_exportable_chunks(HostOptions::default()).unwrap());
    let big = Arena::with_driver(other, ArenaConfig { chunk_bytes: 2 * C, ..cfg(8) }).unwrap();
    let (bx, _) = big.alloc(2 * C).unwrap();
    let bexp = big.export(bx).unwrap();
    let wrong_size = ExportLayout { chunk_count: 1, size: C, ..good };
    let e = im.import(&wrong_size, &bexp.borrowed_fds(), false).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    // Nothing was kept by the refusals.
    let s = im.stats().unwrap();
    assert_eq!((s.imported_allocations, s.imported_bytes), (0, 0));
    // What cannot be exported.
    let (small, _) = ex.alloc(100).unwrap();
    assert_eq!(ex.export(small).unwrap_err().status(), Status::InvalidArgument);
    let (plain_d, plain) = importer(4);
    let (p, _) = plain.alloc(C).unwrap();
    assert_eq!(plain.export(p).unwrap_err().status(), Status::Unsupported, "chunks in the shared memfd");
    assert_eq!(plain_d.own_descriptors(), 0);
    assert_eq!(ex.dmabuf_fd(x).unwrap_err().status(), Status::Unsupported, "DMA-BUF is GPU only");
    // Exported chunks are never shared within the arena, and shared ones never exported.
    let e = ex.alloc_shared(x, 0, C, 2 * C).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    let (src, _) = ex.alloc(2 * C).unwrap();
    let (sharer, _) = ex.alloc_shared(src, 0, C, 2 * C).unwrap();
    for id in [src, sharer] {
        let e = ex.export(id).unwrap_err();
        assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    }
}

// ------------------------------------------------------------ fault matrix

/// One shared-memory operation under test, on `arena` (faulty driver)
/// with `peer` (a healthy arena of the other side).
struct Case {
    name: &'static str,
    /// The faulty arena exports (true) or imports (false).
    faulty_exports: bool,
    /// Builds the state; returns the id the op acts on and an export to
    /// keep alive, if any.
    setup: fn(&Arena, &Arena) -> (Id, Option<vmm_arena::Export>),
    op: fn(&Arena, &Arena, Id, &mut Option<vmm_arena::Export>) -> vmm_arena::Result<()>,
    /// The op may succeed after its point of no return (a failed release).
    best_effort_after: Option<u64>,
}

/// Two chunks of `a`'s own, exported.
fn exported_two_chunks(a: &Arena, _: &Arena) -> (Id, Option<vmm_arena::Export>) {
    let (x, _) = a.alloc(2 * C).unwrap();
    (x, Some(a.export(x).unwrap()))
}

/// Two chunks of the peer's, exported and imported into `a`.
fn imported_two_chunks(a: &Arena, peer: &Arena) -> (Id, Option<vmm_arena::Export>) {
    let (x, _) = peer.alloc(2 * C).unwrap();
    let e = peer.export(x).unwrap();
    let (y, _) = a.import_export(&e, false).unwrap();
    (y, Some(e))
}

fn cases() -> Vec<Case> {
    vec![
        Case {
            name: "export (a moved allocation: retired ranges released first)",
            faulty_exports: true,
            setup: |a, _| {
                let (x, _) = a.alloc(C).unwrap();
                let (_y, _) = a.alloc(C).unwrap();
                a.resize(x, 3 * C).unwrap(); // moves: x's old page is retired
                a.write(x, 0, b"exported").unwrap();
                (x, None)
            },
            op: |a, _, x, keep| a.export(x).map(|e| *keep = Some(e)),
            best_effort_after: None,
        },
        Case {
            name: "import",
            faulty_exports: false,
            setup: |_, peer| {
                let (x, _) = peer.alloc(3 * C).unwrap();
                peer.write(x, 0, b"exported").unwrap();
                (x, Some(peer.export(x).unwrap()))
            },
            op: |a, _, _, keep| a.import_export(keep.as_ref().unwrap(), false).map(drop),
            best_effort_after: None,
        },
        Case {
            name: "free of an exported allocation",
            faulty_exports: true,
            setup: exported_two_chunks,
            // sync, unmap; then 2 releases (best effort)
            op: |a, _, x, _| a.free(x),
            best_effort_after: Some(2),
        },
        Case {
            name: "free of an import",
            faulty_exports: false,
            setup: imported_two_chunks,
            // sync, unmap; then 2 releases and the reservation's free (best effort)
            op: |a, _, y, _| a.free(y),
            best_effort_after: Some(2),
        },
        Case {
            name: "free_on_stream of an exported allocation (a free: no event)",
            faulty_exports: true,
            setup: exported_two_chunks,
            op: |a, _, x, _| a.free_on_stream(x, 5),
            best_effort_after: Some(2),
        },
        Case {
            name: "free_on_stream of an import (a free: no event)",
            faulty_exports: false,
            setup: imported_two_chunks,
            op: |a, _, y, _| a.free_on_stream(y, 5),
            best_effort_after: Some(2),
        },
    ]
}

struct Side {
    fault: Arc<FaultDriver<Arc<HostDriver>>>,
    host: Arc<HostDriver>,
    arena: Arena,
}

fn side(exportable: bool, faulty: bool) -> Side {
    let host = Arc::new(match exportable {
        true => HostDriver::with_exportable_chunks(HostOptions::default()).unwrap(),
        false => HostDriver::new().unwrap(),
    });
    let fault = Arc::new(FaultDriver::new(host.clone()));
    let d: Arc<dyn Driver> = if faulty { fault.clone() } else { host.clone() };
    let arena = Arena::with_driver(d, cfg(8)).unwrap();
    Side { fault, host, arena }
}

fn build(case: &Case) -> (Side, Side, Id, Option<vmm_arena::Export>) {
    // Both sides exportable where they export; the faulty one is `a`.
    let a = side(case.faulty_exports, true);
    let peer = side(!case.faulty_exports, false);
    let (id, keep) = (case.setup)(&a.arena, &peer.arena);
    (a, peer, id, keep)
}

/// Chunks the faulty driver holds = the arena's held memory plus imports.
fn check_no_leak(what: &str, s: &Side) {
    let st = s.arena.stats().unwrap();
    let held = (st.mapped_bytes + st.pooled_bytes + st.imported_bytes) / C;
    assert_eq!(s.fault.live_chunks() as u64, held, "{what}: chunks");
    let snap = Snap::of(&s.arena);
    snap.check_structure(s.arena.va_range());
    assert_eq!(s.fault.live_mappings() as u64, snap.mapped_pages() + st.imported_bytes / C, "{what}: mappings");
    assert_eq!(s.host.own_descriptors() as u64, s.host.live_chunks() as u64, "{what}: descriptors");
}

#[test]
fn every_driver_call_of_export_and_import_fails_cleanly() {
    let mut total = 0;
    for case in cases() {
        let (a, peer, id, mut keep) = build(&case);
        let calls0 = a.fault.total_calls();
        (case.op)(&a.arena, &peer.arena, id, &mut keep).unwrap_or_else(|e| panic!("{}: {e}", case.name));
        let calls = a.fault.total_calls() - calls0;
        assert!(calls > 0, "{}", case.name);
        check_no_leak(case.name, &a);
        drop((keep, a, peer));
        for i in 1..=calls {
            for kind in FaultKind::ALL {
                let what = format!("{} / call {i} of {calls} fails with {kind:?}", case.name);
                let (a, peer, id, mut keep) = build(&case);
                let before =
                    (Snap::of(&a.arena).without_driver_counters(), common::stats_sans_driver(a.arena.stats().unwrap()));
                let chunks0 = a.fault.live_chunks();
                a.fault.fail_nth(None, i, kind);
                let r = (case.op)(&a.arena, &peer.arena, id, &mut keep);
                assert!(!a.fault.pending(), "{what}: fewer calls than the twin");
                match case.best_effort_after {
                    Some(n) if i > n => {
                        r.unwrap_or_else(|e| panic!("{what}: a failed release must not fail the free: {e}"));
                        assert_eq!(a.arena.stats().unwrap().release_failures, 1, "{what}");
                        assert_eq!(a.arena.query(id).unwrap_err().status(), Status::UnknownAllocation, "{what}");
                    }
                    _ => {
                        let e = r.expect_err(&what);
                        let want = match kind {
                            FaultKind::OutOfMemory => Status::OutOfMemory,
                            FaultKind::Driver => Status::Driver,
                        };
                        assert_eq!(e.status(), want, "{what}: {e}");
                        let now = (
                            Snap::of(&a.arena).without_driver_counters(),
                            common::stats_sans_driver(a.arena.stats().unwrap()),
                        );
                        assert_eq!(now.0, before.0, "{what}: the arena changed");
                        assert_eq!(now.1, before.1, "{what}: the stats changed");
                        assert_eq!(a.fault.live_chunks(), chunks0, "{what}: driver chunks");
                        // It still works: the op now succeeds.
                        (case.op)(&a.arena, &peer.arena, id, &mut keep)
                            .unwrap_or_else(|e| panic!("{what}: retry: {e}"));
                    }
                }
                if !case.faulty_exports && case.best_effort_after.is_none() {
                    // A failed import kept no descriptor beyond the retry's.
                    assert_eq!(a.host.own_descriptors(), 3, "{what}");
                }
                if case.best_effort_after.is_none() || i <= case.best_effort_after.unwrap() {
                    check_no_leak(&what, &a);
                }
                total += 1;
                let fault = a.fault.clone();
                drop((keep, a, peer));
                assert_eq!((fault.live_chunks(), fault.live_mappings()), (0, 0), "{what}: the drop releases all");
            }
        }
    }
    println!("export/import fault matrix: {total} injected faults");
}
