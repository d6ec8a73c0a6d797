//! Sending an export's descriptors to another process over a Unix socket
//! (`SCM_RIGHTS`), in batches, with its layout, so that an export of any
//! size crosses in one call on each side.
//!
//! Limits: the kernel takes at most 253 descriptors in one message
//! (`SCM_MAX_FD`), so an export of more chunks goes as several messages
//! ([`FDS_PER_MESSAGE`] each); one descriptor per chunk means a 1 GiB
//! allocation of 2 MiB chunks is 512 descriptors, which the receiver holds
//! at once: its `RLIMIT_NOFILE` soft limit (often 1,024) must leave room
//! (raise it with `setrlimit` up to the hard limit). A receiver out of
//! descriptors gets `OutOfMemory` and keeps none. Received descriptors are
//! close-on-exec (`MSG_CMSG_CLOEXEC`).
//!
//! The socket may be `SOCK_STREAM` or `SOCK_SEQPACKET`, blocking; a
//! timeout (`SO_RCVTIMEO`/`SO_SNDTIMEO`) ends a call with a driver-kind
//! error naming `EAGAIN`. Each message carries a 56-byte header (a magic
//! number, the layout, the batch's first chunk), so a peer that sends
//! anything else is refused with `InvalidArgument`.
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use crate::arena::ExportLayout;
use crate::error::{Error, Result};

/// Descriptors per message (the kernel's `SCM_MAX_FD`).
pub const FDS_PER_MESSAGE: usize = 253;

const MAGIC: u64 = u64::from_le_bytes(*b"VMMAEXP1");
const HEADER: usize = 56;

fn os_error(call: &'static str) -> Error {
    let e = std::io::Error::last_os_error();
    let code = e.raw_os_error().unwrap_or(0);
    if code == libc::EMFILE || code == libc::ENFILE || code == libc::ENOMEM {
        return Error::OutOfMemory(format!("{call}: {e}"));
    }
    Error::Driver { call, code: code as i64, name: format!("errno {code}"), message: e.to_string() }
}

fn header(layout: &ExportLayout, first: u64) -> [u8; HEADER] {
    let kind = layout.handle_type as u64 | (layout.device as u32 as u64) << 32;
    let words = [MAGIC, layout.version as u64, layout.chunk_bytes, layout.chunk_count, layout.size, first, kind];
    let mut h = [0u8; HEADER];
    for (i, w) in words.iter().enumerate() {
        h[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
    }
    h
}

fn parse(h: &[u8; HEADER]) -> Result<(ExportLayout, u64)> {
    let w = |i: usize| u64::from_le_bytes(h[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    if w(0) != MAGIC {
        return Err(Error::invalid("the peer did not send an export (bad magic number)"));
    }
    let version = u32::try_from(w(1)).map_err(|_| Error::invalid("export layout version out of range"))?;
    let (handle_type, device) = (w(6) as u32, (w(6) >> 32) as u32 as i32);
    Ok((ExportLayout { version, chunk_bytes: w(2), chunk_count: w(3), size: w(4), handle_type, device }, w(5)))
}

/// Space for a control message of `n` descriptors, aligned for `cmsghdr`.
fn cmsg_space(n: usize) -> Vec<u64> {
    // SAFETY: CMSG_SPACE is arithmetic on its argument.
    let bytes = unsafe { libc::CMSG_SPACE((n * std::mem::size_of::<i32>()) as u32) } as usize;
    vec![0u64; bytes.div_ceil(8)]
}

/// Sends `layout` and `fds` (one per chunk, in order) over `sock`, in
/// messages of at most [`FDS_PER_MESSAGE`] descriptors. The descriptors
/// stay the caller's (the receiver gets its own). `InvalidArgument` when
/// the count is not the layout's.
pub fn send_export(sock: BorrowedFd<'_>, layout: &ExportLayout, fds: &[BorrowedFd<'_>]) -> Result<()> {
    if fds.is_empty() || fds.len() as u64 != layout.chunk_count {
        return Err(Error::invalid(format!(
            "send_export: {} descriptors for a layout of {} chunks",
            fds.len(),
            layout.chunk_count
        )));
    }
    for (b, batch) in fds.chunks(FDS_PER_MESSAGE).enumerate() {
        let h = header(layout, (b * FDS_PER_MESSAGE) as u64);
        let mut control = cmsg_space(batch.len());
        let mut iov = libc::iovec { iov_base: h.as_ptr() as *mut libc::c_void, iov_len: HEADER };
        // SAFETY: msghdr is plain data; zeroed is a valid empty value.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = control.len() * 8;
        // SAFETY: `msg` points at `control`, which has CMSG_SPACE(batch)
        // bytes, so the first header and its data fit.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN((batch.len() * std::mem::size_of::<i32>()) as u32) as _;
            let data = libc::CMSG_DATA(c).cast::<i32>();
            for (i, fd) in batch.iter().enumerate() {
                data.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
        loop {
            // SAFETY: `msg` and everything it points to live across the call.
            let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) };
            if n == HEADER as isize {
                break;
            }
            if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            if n >= 0 {
                return Err(Error::invalid(format!("send_export: the socket took {n} of {HEADER} header bytes")));
            }
            return Err(os_error("sendmsg"));
        }
    }
    Ok(())
}

/// Receives what [`send_export`] sent: the layout and the descriptors (one
/// per chunk, in order, close-on-exec, owned by the caller). The layout is
/// not checked against an arena here ([`crate::Arena::import`] does). On
/// error every descriptor received so far is closed.
pub fn recv_export(sock: BorrowedFd<'_>) -> Result<(ExportLayout, Vec<OwnedFd>)> {
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut layout: Option<ExportLayout> = None;
    loop {
        let mut h = [0u8; HEADER];
        let got = recv_batch(sock, &mut h, &mut fds)?;
        let (l, first) = parse(&h)?;
        match layout {
            None => {
                if l.chunk_count == 0 || l.chunk_count > (1 << 24) {
                    return Err(Error::invalid(format!("recv_export: a layout of {} chunks", l.chunk_count)));
                }
                layout = Some(l);
            }
            Some(prev) if prev != l => return Err(Error::invalid("recv_export: the layout changed between messages")),
            Some(_) => {}
        }
        if first != (fds.len() - got) as u64 {
            return Err(Error::invalid("recv_export: a batch out of order"));
        }
        let l = layout.expect("set above");
        if fds.len() as u64 > l.chunk_count {
            return Err(Error::invalid("recv_export: more descriptors than the layout's chunks"));
        }
        if fds.len() as u64 == l.chunk_count {
            return Ok((l, fds));
        }
        if got == 0 {
            return Err(Error::invalid("recv_export: a message without descriptors"));
        }
    }
}

/// Receives one message: its header into `h` (all of it, reading on if
/// the stream splits it) and its descriptors onto `fds`; returns how many.
fn recv_batch(sock: BorrowedFd<'_>, h: &mut [u8; HEADER], fds: &mut Vec<OwnedFd>) -> Result<usize> {
    let mut control = cmsg_space(FDS_PER_MESSAGE);
    let mut iov = libc::iovec { iov_base: h.as_mut_ptr().cast(), iov_len: HEADER };
    // SAFETY: msghdr is plain data; zeroed is a valid empty value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len() * 8;
    let n = loop {
        // SAFETY: `msg` points at `h` and `control`, both live and sized as declared.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        break n;
    };
    if n < 0 {
        return Err(os_error("recvmsg"));
    }
    // Take ownership of whatever arrived before judging the message, so
    // that an error closes them.
    let mut got = 0;
    // SAFETY: the kernel filled `control` up to msg_controllen; CMSG_*
    // walk only within it, and SCM_RIGHTS data are descriptors now ours.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let len = (*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize;
                let data = libc::CMSG_DATA(c).cast::<i32>();
                for i in 0..len / std::mem::size_of::<i32>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                    got += 1;
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        return Err(Error::OutOfMemory(
            "recv_export: descriptors were dropped (RLIMIT_NOFILE reached?); raise the soft limit".into(),
        ));
    }
    if n == 0 {
        return Err(Error::invalid("recv_export: the peer closed the socket"));
    }
    // A record-keeping socket (SOCK_SEQPACKET) delivers one message whole:
    // longer than the header (the kernel cut it) or shorter is not what
    // `send_export` sent. A stream may split the header; read on below.
    if msg.msg_flags & libc::MSG_TRUNC != 0 {
        return Err(Error::invalid(format!("recv_export: a message longer than the {HEADER}-byte header")));
    }
    if (n as usize) < HEADER && keeps_records(sock) {
        return Err(Error::invalid(format!("recv_export: a message of {n} bytes, not the {HEADER}-byte header")));
    }
    let mut have = n as usize;
    while have < HEADER {
        // SAFETY: reads into the rest of `h`, in bounds.
        let m = unsafe { libc::recv(sock.as_raw_fd(), h[have..].as_mut_ptr().cast(), HEADER - have, 0) };
        if m < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        if m <= 0 {
            return Err(if m == 0 {
                Error::invalid("recv_export: the peer closed the socket")
            } else {
                os_error("recv")
            });
        }
        have += m as usize;
    }
    Ok(got)
}

/// Whether `sock` keeps message boundaries (SOCK_SEQPACKET or SOCK_DGRAM).
fn keeps_records(sock: BorrowedFd<'_>) -> bool {
    let mut ty: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `ty` and `len` are live, writable and sized as passed.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_TYPE,
            (&mut ty as *mut libc::c_int).cast(),
            &mut len,
        )
    };
    r == 0 && (ty == libc::SOCK_SEQPACKET || ty == libc::SOCK_DGRAM)
}
