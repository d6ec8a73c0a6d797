//! Export to a child process: the parent exports an allocation (one file
//! descriptor per chunk and a layout record), a child process imports the
//! descriptors into its own arena, and both see the same bytes.
//!
//! `cargo run --example export_child` runs on the host backend (each chunk
//! a sealed memfd). On CUDA the descriptors are POSIX file-descriptor
//! handles of the chunks (`exportable: true` needs a device that supports
//! them). Real programs send the descriptors over a Unix socket
//! (`SCM_RIGHTS`, see `tests/export_two_process.rs`); here the child
//! inherits them and gets their numbers on its command line.

use std::os::fd::{AsRawFd, BorrowedFd};
use std::process::Command;

use vmm_arena::{Arena, ArenaConfig, Backend, Error, ExportLayout, EXPORT_FORMAT_VERSION};

const MIB: u64 = 1 << 20;
const SIZE: u64 = 5 * MIB;

fn arena() -> Result<Arena, Error> {
    Arena::new(ArenaConfig { backend: Backend::Host, capacity_bytes: 64 * MIB, exportable: true, ..Default::default() })
}

fn main() -> Result<(), Error> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("child") {
        return child(&args[2..]);
    }

    let arena = arena()?;
    let (id, _) = arena.alloc(SIZE)?;
    arena.write(id, 0, b"written by the parent")?;
    // Pinned while `export` lives: the allocation cannot move or sleep.
    let export = arena.export(id)?;
    let layout = export.layout();
    println!("exported {} bytes as {} chunk descriptors", layout.size, layout.chunk_count);

    let mut cmd = Command::new(std::env::current_exe().expect("own executable"));
    cmd.arg("child").arg(layout.chunk_bytes.to_string()).arg(layout.size.to_string());
    cmd.arg(layout.handle_type.to_string()).arg(layout.device.to_string());
    for fd in export.fds() {
        // SAFETY: F_GETFD/F_SETFD change only this descriptor's
        // close-on-exec flag; the descriptor is open (owned by `export`).
        unsafe {
            let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFD);
            libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, flags & !libc::FD_CLOEXEC);
        }
        cmd.arg(fd.as_raw_fd().to_string());
    }
    let status = cmd.status().expect("the child starts");
    assert!(status.success(), "the child failed: {status}");

    // The child wrote into the same chunks.
    let mut got = [0u8; 21];
    arena.read(id, 3 * MIB, &mut got)?;
    println!("parent reads at 3 MiB: {:?}", String::from_utf8_lossy(&got));
    assert_eq!(&got, b"written by the child.");

    // Closing the export unpins; freeing releases the chunks (the child's
    // mapping, had it still one, would keep the memory alive).
    drop(export);
    arena.free(id)?;
    Ok(())
}

/// The child: imports the inherited descriptors and checks the bytes.
fn child(args: &[String]) -> Result<(), Error> {
    let num = |s: &String| s.parse::<u64>().expect("a number");
    let fds: Vec<i32> = args[4..].iter().map(|s| s.parse().expect("a descriptor")).collect();
    let layout = ExportLayout {
        version: EXPORT_FORMAT_VERSION,
        chunk_bytes: num(&args[0]),
        chunk_count: fds.len() as u64,
        size: num(&args[1]),
        handle_type: args[2].parse().expect("a handle type"),
        device: args[3].parse().expect("a device ordinal"),
    };
    // SAFETY: the parent passed these descriptors open, and this process
    // keeps them open for the import (which keeps duplicates of its own).
    let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|&fd| unsafe { BorrowedFd::borrow_raw(fd) }).collect();

    let arena = arena()?;
    let (id, ptr) = arena.import(&layout, &borrowed, false)?;
    let mut got = [0u8; 21];
    arena.read(id, 0, &mut got)?;
    println!("child imported at {ptr:#x}, reads: {:?}", String::from_utf8_lossy(&got));
    assert_eq!(&got, b"written by the parent");
    arena.write(id, 3 * MIB, b"written by the child.")?;
    arena.free(id)?;
    Ok(())
}
