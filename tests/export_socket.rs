//! An export's descriptors over a Unix socket (host backend): a 1 GiB
//! export (512 chunks, more than the 253 descriptors one message carries)
//! crosses in one call each side; the caller's duplicates; every
//! descriptor close-on-exec; a peer that sends something else; and the
//! ordering rule (an export waits for the device first).

use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use vmm_arena::driver::fault::FaultDriver;
use vmm_arena::driver::host::{HostDriver, HostOptions};
use vmm_arena::driver::CallKind;
use vmm_arena::fd_passing::{recv_export, FDS_PER_MESSAGE};
use vmm_arena::{Arena, ArenaConfig, Status};

const C: u64 = 2 << 20;

fn cfg(cap: u64) -> ArenaConfig {
    ArenaConfig { capacity_bytes: cap * C, reserve_bytes: 2 * cap * C, chunk_bytes: C, ..ArenaConfig::default() }
}

/// Sparse chunks: a 1 GiB export commits only the pages the test touches.
fn sparse(exportable: bool) -> Arena {
    let o = HostOptions { sparse: true };
    let d = match exportable {
        true => HostDriver::with_exportable_chunks(o).unwrap(),
        false => HostDriver::with_options(o).unwrap(),
    };
    Arena::with_driver(d, cfg(600)).unwrap()
}

fn socketpair() -> (OwnedFd, OwnedFd) {
    let mut sv = [0i32; 2];
    // SAFETY: `sv` has room for the two descriptors.
    let r = unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0, sv.as_mut_ptr()) };
    assert_eq!(r, 0);
    // SAFETY: fresh descriptors owned here.
    unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) }
}

fn cloexec(fd: i32) -> bool {
    // SAFETY: F_GETFD only reads the descriptor's flags.
    let f = unsafe { libc::fcntl(fd, libc::F_GETFD) };
    f >= 0 && f & libc::FD_CLOEXEC != 0
}

/// Room for 2,000 descriptors (the exporter's chunks, the export's, the
/// receiver's), within the hard limit.
fn raise_fd_limit() {
    let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: `l` is a valid out-parameter.
    assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) }, 0);
    if l.rlim_cur < 2000 {
        l.rlim_cur = l.rlim_max.min(2000);
        // SAFETY: a valid rlimit within the hard limit.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &l) }, 0);
    }
}

#[test]
fn a_one_gib_export_crosses_a_socket_in_one_call() {
    raise_fd_limit();
    let ex = sparse(true);
    let im = sparse(false);
    let (x, _) = ex.alloc(1 << 30).unwrap();
    let chunks = (1u64 << 30) / C;
    assert!(chunks as usize > 2 * FDS_PER_MESSAGE, "more than two messages' worth");
    for i in 0..chunks {
        ex.write(x, i * C + 8, &i.to_le_bytes()).unwrap();
    }
    let export = ex.export(x).unwrap();
    assert!(export.fds().iter().all(|f| cloexec(f.as_raw_fd())), "the export's descriptors are close-on-exec");
    let (a, b) = socketpair();
    // The socket buffer holds three small messages: no second thread needed.
    export.send(a.as_fd()).unwrap();
    let (y, _) = im.import_from_socket(b.as_fd(), false).unwrap();
    assert_eq!(im.query(y).unwrap().size, 1 << 30);
    for i in 0..chunks {
        let mut got = [0u8; 8];
        im.read(y, i * C + 8, &mut got).unwrap();
        assert_eq!(u64::from_le_bytes(got), i, "chunk {i} arrived in its place");
    }
    im.free(y).unwrap();
}

#[test]
fn the_callers_duplicates_are_its_own_and_received_descriptors_are_close_on_exec() {
    let ex = sparse(true);
    let im = sparse(false);
    let (x, _) = ex.alloc(3 * C).unwrap();
    ex.write(x, 0, b"dup").unwrap();
    let export = ex.export(x).unwrap();
    let dups = export.dup_fds().unwrap();
    assert!(dups.iter().all(|f| cloexec(f.as_raw_fd())));
    let theirs: Vec<i32> = export.fds().iter().map(|f| f.as_raw_fd()).collect();
    assert!(dups.iter().all(|d| !theirs.contains(&d.as_raw_fd())), "new numbers");
    drop(dups);
    // The export's own descriptors are intact after the caller closed its copies.
    let (y, _) = im.import_export(&export, true).unwrap();
    let mut got = [0u8; 3];
    im.read(y, 0, &mut got).unwrap();
    assert_eq!(&got, b"dup");
    let (a, b) = socketpair();
    export.send(a.as_fd()).unwrap();
    let (layout, fds) = recv_export(b.as_fd()).unwrap();
    assert_eq!((layout, fds.len()), (export.layout(), 3));
    assert!(fds.iter().all(|f| cloexec(f.as_raw_fd())), "received descriptors are close-on-exec");
}

#[test]
fn a_peer_that_sends_anything_else_is_refused() {
    let im = sparse(false);
    let (a, b) = socketpair();
    // SAFETY: writes 56 bytes from a live buffer.
    let n = unsafe { libc::write(a.as_raw_fd(), [7u8; 56].as_ptr().cast(), 56) };
    assert_eq!(n, 56);
    assert_eq!(im.import_from_socket(b.as_fd(), false).unwrap_err().status(), Status::InvalidArgument);
    drop(a);
    assert_eq!(im.import_from_socket(b.as_fd(), false).unwrap_err().status(), Status::InvalidArgument);
    assert_eq!(im.stats().unwrap().imported_allocations, 0);
}

#[test]
fn an_export_waits_for_the_device_before_handing_out_descriptors() {
    let host = HostDriver::with_exportable_chunks(HostOptions::default()).unwrap();
    let fault = Arc::new(FaultDriver::new(host));
    let ex = Arena::with_driver(fault.clone(), cfg(4)).unwrap();
    let (x, _) = ex.alloc(C).unwrap();
    let syncs = fault.calls(CallKind::Synchronize);
    let share = fault.calls(CallKind::Share);
    let _e = ex.export(x).unwrap();
    assert_eq!(fault.calls(CallKind::Synchronize), syncs + 1, "one synchronize");
    assert_eq!(fault.calls(CallKind::Share), share + 1);
}
