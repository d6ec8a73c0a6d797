//! Export and import across two processes on the host backend: the parent
//! exports an allocation and sends its descriptors over a Unix socket
//! (`SCM_RIGHTS`) with the layout record; a forked child imports them into
//! its own arena. Bytes are checked both ways; then the exporter frees
//! first, and the importer's bytes must stay valid until it frees.
//!
//! Bounded: every socket read has a 10 s timeout, the child is waited for
//! at most 20 s and killed (and reaped) past that. This binary holds only
//! this test, so when it forks no other test thread can hold a lock the
//! child needs.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use vmm_arena::driver::host::{HostDriver, HostOptions};
use vmm_arena::{Arena, ArenaConfig, ExportLayout};

const C: u64 = 64 << 10;
const SIZE: u64 = 3 * C - 1000;

fn cfg() -> ArenaConfig {
    ArenaConfig { capacity_bytes: 8 * C, reserve_bytes: 32 * C, chunk_bytes: C, ..ArenaConfig::default() }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(13) ^ seed ^ (i >> 9) as u8).collect()
}

fn layout_bytes(l: &ExportLayout) -> [u8; 32] {
    let mut b = [0u8; 32];
    b[0..4].copy_from_slice(&l.version.to_le_bytes());
    b[8..16].copy_from_slice(&l.chunk_bytes.to_le_bytes());
    b[16..24].copy_from_slice(&l.chunk_count.to_le_bytes());
    b[24..32].copy_from_slice(&l.size.to_le_bytes());
    b
}

fn layout_from(b: &[u8]) -> ExportLayout {
    let u = |r: std::ops::Range<usize>| u64::from_le_bytes(b[r].try_into().unwrap());
    ExportLayout {
        version: u32::from_le_bytes(b[0..4].try_into().unwrap()),
        chunk_bytes: u(8..16),
        chunk_count: u(16..24),
        size: u(24..32),
        handle_type: vmm_arena::EXPORT_HANDLE_HOST_MEMFD,
        device: -1,
    }
}

const MAX_FDS: usize = 16;

/// Sends `data` and, in the same message, `fds` (SCM_RIGHTS).
fn send(sock: BorrowedFd<'_>, data: &[u8], fds: &[RawFd]) {
    assert!(fds.len() <= MAX_FDS);
    // SAFETY: the message header points at `data` and at a control buffer
    // sized by CMSG_SPACE for `fds.len()` descriptors, both alive for the
    // call; the CMSG_* macros compute positions inside that buffer.
    unsafe {
        let mut iov = libc::iovec { iov_base: data.as_ptr() as *mut libc::c_void, iov_len: data.len() };
        let space = libc::CMSG_SPACE(std::mem::size_of_val(fds) as u32) as usize;
        let mut control = vec![0u8; space.max(1)];
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !fds.is_empty() {
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = space as _;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of_val(fds) as u32) as _;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(cmsg).cast::<RawFd>(), fds.len());
        }
        let n = libc::sendmsg(sock.as_raw_fd(), &msg, 0);
        assert_eq!(n, data.len() as isize, "sendmsg: {}", std::io::Error::last_os_error());
    }
}

/// Receives one message: its bytes and the descriptors it carried (owned).
/// Fails on the socket's receive timeout.
fn recv(sock: BorrowedFd<'_>, len: usize) -> (Vec<u8>, Vec<OwnedFd>) {
    let mut data = vec![0u8; len];
    let mut fds = Vec::new();
    // SAFETY: as in `send`; the kernel writes at most `iov_len` bytes and
    // `msg_controllen` control bytes, and every descriptor it installed
    // (MSG_CMSG_CLOEXEC) is taken into an `OwnedFd` exactly once.
    unsafe {
        let mut iov = libc::iovec { iov_base: data.as_mut_ptr().cast(), iov_len: len };
        let space = libc::CMSG_SPACE((MAX_FDS * std::mem::size_of::<RawFd>()) as u32) as usize;
        let mut control = vec![0u8; space];
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        let n = libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
        assert!(n >= 0, "recvmsg: {}", std::io::Error::last_os_error());
        data.truncate(n as usize);
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let bytes = (*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let p = libc::CMSG_DATA(cmsg).cast::<RawFd>();
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(p.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    (data, fds)
}

fn socketpair() -> (OwnedFd, OwnedFd) {
    let mut sv = [0 as RawFd; 2];
    // SAFETY: `sv` receives two fresh descriptors, each owned once below;
    // the timeout is a plain struct passed by pointer with its size.
    unsafe {
        assert_eq!(libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, sv.as_mut_ptr()), 0);
        for fd in sv {
            let tv = libc::timeval { tv_sec: 10, tv_usec: 0 };
            let size = std::mem::size_of::<libc::timeval>() as libc::socklen_t;
            let ok =
                libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVTIMEO, (&tv as *const libc::timeval).cast(), size);
            assert_eq!(ok, 0);
        }
        (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1]))
    }
}

/// The importer, in the child: everything it checks panics on failure,
/// which the caller turns into a non-zero exit status.
fn child(sock: BorrowedFd<'_>) {
    let arena = Arena::new(cfg()).expect("child arena");
    let (msg, fds) = recv(sock, 32);
    let layout = layout_from(&msg);
    assert_eq!((layout.chunk_count, layout.size, fds.len()), (3, SIZE, 3));
    let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
    let (id, _) = arena.import(&layout, &borrowed, false).expect("import");
    drop(fds); // the arena keeps its own duplicates
    let mut got = vec![0u8; SIZE as usize];
    arena.read(id, 0, &mut got).unwrap();
    assert!(got == pattern(1, SIZE as usize), "the child sees the parent's bytes");
    let tail = pattern(2, C as usize);
    arena.write(id, 2 * C - 500, &tail[..500]).unwrap();
    send(sock, b"wrote", &[]);
    // The parent frees its allocation, then says so.
    let (msg, _) = recv(sock, 16);
    assert_eq!(&msg, b"freed");
    arena.read(id, 0, &mut got).unwrap();
    let mut want = pattern(1, SIZE as usize);
    want[(2 * C - 500) as usize..(2 * C) as usize].copy_from_slice(&tail[..500]);
    assert!(got == want, "the bytes outlive the exporter's free");
    arena.write(id, 0, b"still writable").unwrap();
    let s = arena.stats().unwrap();
    assert_eq!((s.imported_allocations, s.imported_bytes), (1, 3 * C));
    arena.free(id).unwrap();
    send(sock, b"done", &[]);
}

#[test]
fn two_processes_share_an_allocation_and_the_exporter_frees_first() {
    let (parent_sock, child_sock) = socketpair();
    // SAFETY: fork in a test binary that runs only this test: the other
    // thread (the harness's main thread) is blocked waiting for it and holds
    // no lock the child could need. The child only runs `child` and exits
    // with `_exit`, never returning into the harness.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork: {}", std::io::Error::last_os_error());
    if pid == 0 {
        drop(parent_sock);
        let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| child(child_sock.as_fd()))).is_ok();
        // SAFETY: ends the child without running the harness's exit path.
        unsafe { libc::_exit(if ok { 0 } else { 1 }) };
    }
    drop(child_sock);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let driver = HostDriver::with_exportable_chunks(HostOptions::default()).unwrap();
        let arena = Arena::with_driver(driver, cfg()).unwrap();
        let (id, _) = arena.alloc(SIZE).unwrap();
        arena.write(id, 0, &pattern(1, SIZE as usize)).unwrap();
        let export = arena.export(id).unwrap();
        let raw: Vec<RawFd> = export.fds().iter().map(|f| f.as_raw_fd()).collect();
        send(parent_sock.as_fd(), &layout_bytes(&export.layout()), &raw);
        drop(export); // the child holds its own descriptors now
        let (msg, _) = recv(parent_sock.as_fd(), 16);
        assert_eq!(&msg, b"wrote");
        let mut got = vec![0u8; 500];
        arena.read(id, 2 * C - 500, &mut got).unwrap();
        assert!(got == pattern(2, C as usize)[..500], "the parent sees the child's bytes");
        assert!(!arena.query(id).unwrap().pinned, "the export is closed");
        arena.free(id).unwrap();
        let s = arena.stats().unwrap();
        assert_eq!((s.mapped_bytes, s.pooled_bytes), (0, 0), "the exporter released its chunks");
        send(parent_sock.as_fd(), b"freed", &[]);
        let (msg, _) = recv(parent_sock.as_fd(), 16);
        assert_eq!(&msg, b"done");
    }));
    // Reap the child within 20 s, killing it past that.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut status = 0;
    let reaped = loop {
        // SAFETY: waits for our own child only; `status` is a valid out-pointer.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r == pid {
            break true;
        }
        if Instant::now() > deadline {
            // SAFETY: our own child; then reaped blocking (it is being killed).
            unsafe {
                libc::kill(pid, libc::SIGKILL);
                libc::waitpid(pid, &mut status, 0);
            }
            break false;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    if let Err(p) = result {
        std::panic::resume_unwind(p);
    }
    assert!(reaped, "the child did not finish within 20 s");
    assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child failed (status {status:#x})");
}
