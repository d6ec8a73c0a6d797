//! Lifetimes of what leaves the arena (host backend): DMA-BUFs (through
//! the host driver's stand-in, which binds a DMA-BUF to the physical
//! memory behind the span as `cuMemGetHandleForAddressRange` does), an
//! export beside a sleeping sharer, an import of memory no arena exported,
//! and the importer's own stats.

mod common;

use std::os::fd::{AsFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use common::Snap;
use vmm_arena::driver::fault::{FaultDriver, FaultKind};
use vmm_arena::driver::host::{HostDriver, HostOptions};
use vmm_arena::driver::CallKind;
use vmm_arena::{Arena, ArenaConfig, Error, ExportLayout, Status, EXPORT_FORMAT_VERSION};

const C: u64 = 2 << 20;

fn cfg(cap: u64) -> ArenaConfig {
    ArenaConfig { capacity_bytes: cap * C, reserve_bytes: 4 * cap * C, chunk_bytes: C, ..ArenaConfig::default() }
}

fn standin_arena(cap: u64) -> (Arc<HostDriver>, Arena) {
    let d = Arc::new(HostDriver::new().unwrap().with_dmabuf_standin());
    let a = Arena::with_driver(d.clone(), cfg(cap)).unwrap();
    (d, a)
}

fn exporter(cap: u64) -> (Arc<HostDriver>, Arena) {
    let d = Arc::new(HostDriver::with_exportable_chunks(HostOptions::default()).unwrap());
    let a = Arena::with_driver(d.clone(), cfg(cap)).unwrap();
    (d, a)
}

#[test]
fn a_dmabuf_of_a_freed_allocation_never_reaches_the_next_allocations_bytes() {
    let (d, a) = standin_arena(4);
    let (x, _) = a.alloc(2 * C).unwrap();
    a.write(x, 0, &vec![0xAA; 2 * C as usize]).unwrap();
    let buf = a.dmabuf_fd(x).unwrap();
    a.free(x).unwrap();
    let (y, _) = a.alloc(2 * C).unwrap();
    a.write(y, 0, &vec![0xBB; 2 * C as usize]).unwrap();
    let mut seen = vec![0u8; 2 * C as usize];
    d.standin_dmabuf_read(buf.as_fd(), 0, &mut seen).unwrap();
    assert!(!seen.contains(&0xBB), "the freed allocation's DMA-BUF reads the next allocation's bytes");
    d.standin_dmabuf_write(buf.as_fd(), 0, &vec![0xCC; 2 * C as usize]).unwrap();
    let mut mine = vec![0u8; 2 * C as usize];
    a.read(y, 0, &mut mine).unwrap();
    assert!(mine.iter().all(|&b| b == 0xBB), "a write through the freed allocation's DMA-BUF changed another's bytes");
}

#[test]
fn an_allocation_whose_chunks_a_sleeper_shares_cannot_be_exported() {
    let (_d, a) = exporter(8);
    let (x, _) = a.alloc(2 * C).unwrap();
    let (s, _) = a.alloc_shared(x, 0, C, C).unwrap();
    a.set_tag(s, 7).unwrap();
    a.sleep(7, 0).unwrap();
    let got = a.export(x);
    assert!(matches!(got, Err(Error::InvalidArgument(_))), "export of an allocation a sleeper shares: {got:?}");
    assert_eq!(a.dmabuf(x).unwrap_err().status(), Status::InvalidArgument, "nor a DMA-BUF of it");
    a.wake(7).unwrap();
    a.free(x).unwrap();
    let st = a.stats().unwrap();
    assert_eq!(st.mapped_bytes, C, "the sharer still maps its chunk after the source's free");
}

#[test]
fn import_refuses_a_sealed_memfd_that_no_arena_exported() {
    let (_d, im) = exporter(4);
    // SAFETY: a valid name and constant flags.
    let raw = unsafe { libc::memfd_create(c"caller-memory".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
    assert!(raw >= 0);
    // SAFETY: a fresh descriptor nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: plain calls on the descriptor owned here.
    unsafe {
        assert_eq!(libc::ftruncate(raw, C as libc::off_t), 0);
        assert_eq!(libc::fcntl(raw, libc::F_ADD_SEALS, libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL), 0);
    }
    let layout = ExportLayout {
        version: EXPORT_FORMAT_VERSION,
        chunk_bytes: C,
        chunk_count: 1,
        size: C,
        handle_type: vmm_arena::EXPORT_HANDLE_HOST_MEMFD,
        device: -1,
    };
    let got = im.import(&layout, &[fd.as_fd()], false);
    assert!(matches!(got, Err(Error::InvalidArgument(_))), "a caller's memfd was imported: {got:?}");
    assert_eq!(im.stats().unwrap().imported_allocations, 0);
}

#[test]
fn an_import_and_its_free_count_nowhere_in_the_importers_driver_counts() {
    let (_ed, ex) = exporter(4);
    let (_id, im) = exporter(4);
    let (x, _) = ex.alloc(2 * C).unwrap();
    let export = ex.export(x).unwrap();
    let before = im.stats().unwrap();
    let (y, _) = im.import_export(&export, false).unwrap();
    im.free(y).unwrap();
    let after = im.stats().unwrap();
    assert_eq!(
        (
            after.driver_creates,
            after.driver_releases,
            after.driver_maps,
            after.driver_unmaps,
            after.driver_access_calls
        ),
        (
            before.driver_creates,
            before.driver_releases,
            before.driver_maps,
            before.driver_unmaps,
            before.driver_access_calls
        ),
        "an import counts only in the sharing stats"
    );
    assert!(after.driver_releases <= after.driver_creates);
}

#[test]
fn a_free_while_a_dmabuf_is_open_keeps_the_chunks_until_it_closes() {
    let (d, a) = standin_arena(4);
    let (x, _) = a.alloc(2 * C).unwrap();
    a.write(x, 0, &vec![0xAA; 2 * C as usize]).unwrap();
    let buf = a.dmabuf(x).unwrap();
    assert_eq!(buf.bytes(), 2 * C);
    // SAFETY: F_GETFD only reads the descriptor's flags.
    let flags = unsafe { libc::fcntl(std::os::fd::AsRawFd::as_raw_fd(&buf.fd()), libc::F_GETFD) };
    assert_eq!(flags & libc::FD_CLOEXEC, libc::FD_CLOEXEC, "the DMA-BUF is close-on-exec");
    assert!(a.query(x).unwrap().pinned, "pinned while a DMA-BUF is open");
    a.free(x).unwrap();
    assert_eq!(a.query(x).unwrap_err().status(), Status::UnknownAllocation);
    let st = a.stats().unwrap();
    assert_eq!((st.live_allocations, st.mapped_bytes), (0, 2 * C), "the freed chunks stay while the DMA-BUF is open");
    // The capacity counts them: 3 chunks do not fit in 4 with 2 held.
    assert_eq!(a.alloc(3 * C).unwrap_err().status(), Status::OutOfMemory);
    let (y, _) = a.alloc(2 * C).unwrap();
    a.write(y, 0, &vec![0xBB; 2 * C as usize]).unwrap();
    let mut seen = vec![0u8; 2 * C as usize];
    d.standin_dmabuf_read(buf.fd(), 0, &mut seen).unwrap();
    assert!(seen.iter().all(|&b| b == 0xAA), "the DMA-BUF still reaches the freed allocation's own bytes");
    let snap = Snap::of(&a);
    assert_eq!(snap.ranges.iter().filter(|r| r.kind == common::Kind::Pending).count(), 1, "one held range");
    drop(buf);
    // The next call that runs an operation gives the held chunks back to
    // the driver, not to the pool.
    a.trim(0).unwrap();
    let st = a.stats().unwrap();
    assert_eq!((st.mapped_bytes, st.pooled_bytes), (2 * C, 0));
    assert_eq!(d.live_chunks(), 2, "the held chunks went back to the driver");
    let (z, _) = a.alloc(2 * C).unwrap();
    a.free(z).unwrap();
    a.free(y).unwrap();
}

#[test]
fn an_open_dmabuf_refuses_a_shrink_below_it_and_keeps_the_allocation_awake() {
    let (_d, a) = standin_arena(4);
    let (x, _) = a.alloc_growable(2 * C, 4 * C).unwrap();
    let buf = a.dmabuf(x).unwrap();
    assert_eq!(a.resize(x, C).unwrap_err().status(), Status::InvalidArgument);
    a.resize(x, 3 * C).unwrap();
    a.set_tag(x, 3).unwrap();
    a.sleep(3, 0).unwrap();
    assert!(!a.query(x).unwrap().asleep, "an allocation with a DMA-BUF never sleeps");
    let (small, _) = a.alloc(100).unwrap();
    assert_eq!(a.dmabuf(small).unwrap_err().status(), Status::InvalidArgument);
    drop(buf);
}

#[test]
fn the_host_backend_without_the_stand_in_has_no_dmabuf() {
    let (_d, a) = exporter(4);
    let (x, _) = a.alloc(2 * C).unwrap();
    assert_eq!(a.dmabuf(x).unwrap_err().status(), Status::Unsupported);
    // Nothing changed: it can still shrink and sleep.
    a.resize(x, C).unwrap();
    a.set_tag(x, 1).unwrap();
    a.sleep(1, 0).unwrap();
    assert!(a.query(x).unwrap().asleep);
}

/// Every driver call of `dmabuf` (with a retired range to release first)
/// and of the deferred free after the last close fails in turn.
#[test]
fn every_driver_call_of_a_dmabuf_and_its_deferred_free_fails_cleanly() {
    let build = || {
        let host = Arc::new(HostDriver::new().unwrap().with_dmabuf_standin());
        let fault = Arc::new(FaultDriver::new(host.clone()));
        let a = Arena::with_driver(fault.clone(), cfg(8)).unwrap();
        // x moves on growth, leaving a retired range that maps its chunk.
        let (x, _) = a.alloc(C).unwrap();
        let _blocker = a.alloc(C).unwrap();
        a.resize(x, 2 * C).unwrap();
        assert!(a.stats().unwrap().retired_va_bytes > 0, "a retired range to release");
        (fault, a, x)
    };
    let mut total = 0;
    let (fault, a, x) = build();
    let c0 = fault.total_calls();
    let buf = a.dmabuf(x).unwrap();
    let calls = fault.total_calls() - c0;
    assert!(calls >= 3, "the retired range's synchronize and unmap, and the DMA-BUF: {calls}");
    drop((buf, a));
    for i in 1..=calls {
        for kind in FaultKind::ALL {
            let what = format!("dmabuf: call {i} of {calls} fails with {kind:?}");
            let (fault, a, x) = build();
            let before = (Snap::of(&a).without_driver_counters(), common::stats_sans_driver(a.stats().unwrap()));
            fault.fail_nth(None, i, kind);
            let e = a.dmabuf(x).expect_err(&what);
            assert!(matches!(e.status(), Status::OutOfMemory | Status::Driver), "{what}: {e}");
            let now = (Snap::of(&a).without_driver_counters(), common::stats_sans_driver(a.stats().unwrap()));
            assert_eq!(now, before, "{what}: the arena changed");
            // Not marked: it still shrinks, and a retry works.
            let buf = a.dmabuf(x).unwrap_or_else(|e| panic!("{what}: retry: {e}"));
            drop(buf);
            total += 1;
        }
    }
    // The deferred free: its unmap fails, the chunks stay held, the next
    // call finishes it.
    let (fault, a, x) = build();
    let buf = a.dmabuf(x).unwrap();
    a.free(x).unwrap();
    drop(buf);
    let held = a.stats().unwrap().mapped_bytes;
    fault.fail_nth(Some(CallKind::Unmap), 1, FaultKind::Driver);
    let (y, _) = a.alloc(C).unwrap();
    assert_eq!(a.stats().unwrap().mapped_bytes, held + C, "a failed deferred free keeps the chunks held");
    a.free(y).unwrap();
    let st = a.stats().unwrap();
    assert_eq!((st.exported_allocations, st.driver_releases), (0, 2), "the next call finished it: {st:?}");
    assert!(Snap::of(&a).ranges.iter().all(|r| r.kind != common::Kind::Pending));
    println!("dmabuf fault matrix: {total} injected faults");
}

#[test]
fn a_version_1_layout_record_still_imports() {
    let (_ed, ex) = exporter(4);
    let (_id, im) = exporter(4);
    let (x, _) = ex.alloc(2 * C).unwrap();
    ex.write(x, 0, b"v1").unwrap();
    let export = ex.export(x).unwrap();
    let v1 =
        ExportLayout { version: 1, handle_type: vmm_arena::EXPORT_HANDLE_UNSPECIFIED, device: -1, ..export.layout() };
    let (y, _) = im.import(&v1, &export.borrowed_fds(), false).unwrap();
    let mut got = [0u8; 2];
    im.read(y, 0, &mut got).unwrap();
    assert_eq!(&got, b"v1");
}
