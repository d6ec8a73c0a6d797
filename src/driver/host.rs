//! The Linux host backend: a faithful model of CUDA VMM on process memory.
//!
//! - the virtual range is an `mmap(PROT_NONE, MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE)`;
//! - physical memory is one memfd for the whole arena, chunks at offsets in it
//!   (one file descriptor however many chunks);
//! - `create` commits the chunk's pages with `fallocate`, so exhaustion is an
//!   out-of-memory error now rather than a SIGBUS at first touch (sparse mode
//!   skips this for simulations that touch little of what they allocate);
//! - `map` is `mmap(MAP_FIXED|MAP_SHARED)` of the memfd range with no access,
//!   `set_access` is `mprotect(READ|WRITE)`;
//! - `unmap` maps `PROT_NONE` anonymous memory back over the span, so the
//!   reservation never has a hole another `mmap` could land in;
//! - `release` punches the chunk's hole (`fallocate(PUNCH_HOLE)`), giving the
//!   pages back to the kernel, once the chunk's last mapping is gone.
//!
//! **Exportable chunks** ([`HostDriver::with_exportable_chunks`]): passing
//! the arena's one memfd to another process would hand over every chunk.
//! So an exportable chunk gets a memfd of its own, sealed against growing
//! and shrinking (`F_SEAL_GROW | F_SEAL_SHRINK | F_SEAL_SEAL`: an importer
//! can neither truncate it under the exporter, which would be a SIGBUS, nor
//! change the seals). [`Driver::export_chunk`] hands out a duplicate of that
//! descriptor; [`Driver::import_chunk`] takes one (checked: a sealed regular
//! file of the chunk's size) and keeps a duplicate. Releasing such a chunk
//! closes the driver's descriptor instead of punching a hole: the kernel
//! frees the memory once no descriptor or mapping in any process holds it,
//! as the CUDA driver frees a chunk exported to another process only when
//! that process has released its handle too.
//!
//! An importer recognises an exported chunk by its memfd's name
//! (`vmm-arena-chunk`, read from `/proc/self/fd`) and its seals, so a
//! memfd a caller made is refused. This tells a mistake from a chunk; it
//! is no defence against a caller who forges both (that caller only maps
//! memory it already had).
//!
//! **DMA-BUF stand-in** ([`HostDriver::with_dmabuf_standin`]): the host has
//! no DMA-BUF, so [`Driver::dmabuf_fd`] is `Unsupported` by default. With
//! the stand-in on, it returns a descriptor (an empty memfd) bound to the
//! physical memory behind the span *at the time of the call*, as
//! `cuMemGetHandleForAddressRange` binds the pages and not the addresses;
//! [`HostDriver::standin_dmabuf_read`] and
//! [`HostDriver::standin_dmabuf_write`] reach that memory the way a
//! network card registered with the DMA-BUF would. It exists to test the
//! arena's bookkeeping of DMA-BUF lifetimes on machines without a GPU.
//!
//! Every call is first checked against the CUDA rules checker (`rules.rs`),
//! so an arena bug that a GPU driver would reject fails here too instead of
//! silently working.
#![allow(unsafe_code)]

use super::{ChunkHandle, Driver, Granularity};
use crate::error::{Error, Result};

/// Options of the host backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostOptions {
    /// Skip committing chunk memory at create time. Pages are then allocated
    /// on first touch, and running out of memory is a SIGBUS at that touch:
    /// only for simulations that write a small fraction of what they allocate.
    pub sparse: bool,
}

#[cfg(target_os = "linux")]
pub use linux::HostDriver;

#[cfg(not(target_os = "linux"))]
pub use other::HostDriver;

#[cfg(not(target_os = "linux"))]
mod other {
    use super::*;

    /// The host backend is Linux-only; elsewhere construction reports it.
    #[derive(Debug)]
    pub struct HostDriver(());

    impl HostDriver {
        /// Always `Error::Unsupported` off Linux.
        pub fn new() -> Result<HostDriver> {
            Err(Error::Unsupported("the host backend needs Linux (memfd, MAP_FIXED)".into()))
        }
        /// Always `Error::Unsupported` off Linux.
        pub fn with_options(_: HostOptions) -> Result<HostDriver> {
            Self::new()
        }
    }

    impl Driver for HostDriver {
        fn name(&self) -> &'static str {
            "host"
        }
        fn granularity(&self) -> Result<Granularity> {
            unreachable!("cannot be constructed")
        }
        fn total_memory(&self) -> Result<u64> {
            unreachable!()
        }
        fn reserve(&self, _: u64, _: u64) -> Result<u64> {
            unreachable!()
        }
        fn free_reservation(&self, _: u64, _: u64) -> Result<()> {
            unreachable!()
        }
        fn create(&self, _: u64) -> Result<ChunkHandle> {
            unreachable!()
        }
        fn release(&self, _: ChunkHandle) -> Result<()> {
            unreachable!()
        }
        fn map(&self, _: u64, _: u64, _: ChunkHandle, _: u64) -> Result<()> {
            unreachable!()
        }
        fn set_access(&self, _: u64, _: u64) -> Result<()> {
            unreachable!()
        }
        fn unmap(&self, _: u64, _: u64) -> Result<()> {
            unreachable!()
        }
        fn synchronize(&self) -> Result<()> {
            unreachable!()
        }
        fn read(&self, _: u64, _: &mut [u8]) -> Result<()> {
            unreachable!()
        }
        fn write(&self, _: u64, _: &[u8]) -> Result<()> {
            unreachable!()
        }
        fn copy(&self, _: u64, _: u64, _: u64) -> Result<()> {
            unreachable!()
        }
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use std::collections::{BTreeMap, HashMap};
    use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

    use super::*;
    use crate::driver::rules::Rules;
    use crate::sync::{Mutex, MutexGuard};

    /// Linux host driver (see the module documentation).
    #[derive(Debug)]
    pub struct HostDriver {
        memfd: OwnedFd,
        page: u64,
        options: HostOptions,
        /// Every created chunk gets a sealed memfd of its own (see the module docs).
        exportable: bool,
        /// `dmabuf_fd` answers with the stand-in (see the module docs).
        dmabuf_standin: bool,
        inner: Mutex<HostState>,
    }

    /// A chunk with a memfd of its own: exportable, or imported.
    #[derive(Debug)]
    struct OwnChunk {
        fd: OwnedFd,
        /// Imported from elsewhere (not counted in `allocated_file_bytes`).
        imported: bool,
    }

    #[derive(Debug)]
    struct HostState {
        rules: Rules,
        /// Offsets in the memfd of live chunks.
        offsets: HashMap<ChunkHandle, (u64, u64)>,
        /// Holes punched by released chunks, by size, for reuse.
        free_offsets: BTreeMap<u64, Vec<u64>>,
        /// Chunks with a memfd of their own, until their memory is gone
        /// from this driver (released and unmapped).
        own: HashMap<ChunkHandle, OwnChunk>,
        file_len: u64,
        next_handle: u64,
        /// Stand-in DMA-BUFs by their memfd's inode: the memory each reaches.
        dmabufs: HashMap<u64, Vec<StandinPiece>>,
    }

    /// A span of physical memory a stand-in DMA-BUF reaches: `len` bytes
    /// at `offset` of a chunk's own memfd (a duplicate, which keeps that
    /// memory alive as a DMA-BUF does), or of the arena's memfd (`None`:
    /// bound to the offset, whatever chunk later lives there).
    #[derive(Debug)]
    struct StandinPiece {
        own: Option<OwnedFd>,
        offset: u64,
        len: u64,
    }

    /// How `/proc/self/fd` shows an exported chunk's memfd (`create_own`).
    const CHUNK_LINK: &str = "/memfd:vmm-arena-chunk ";

    fn errno() -> i32 {
        std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
    }

    fn errno_name(code: i32) -> String {
        match code {
            libc::ENOMEM => "ENOMEM".into(),
            libc::ENOSPC => "ENOSPC".into(),
            libc::EFBIG => "EFBIG".into(),
            libc::EINVAL => "EINVAL".into(),
            libc::EFAULT => "EFAULT".into(),
            libc::EPERM => "EPERM".into(),
            libc::EACCES => "EACCES".into(),
            libc::EBADF => "EBADF".into(),
            libc::ENOSYS => "ENOSYS".into(),
            libc::EOPNOTSUPP => "EOPNOTSUPP".into(),
            libc::EMFILE => "EMFILE".into(),
            other => format!("errno {other}"),
        }
    }

    /// Wraps a failed system call into the crate's error, once.
    fn os_error(call: &'static str, code: i32) -> Error {
        let message = std::io::Error::from_raw_os_error(code).to_string();
        // The memfd's backing store refusing pages (no memory, no space, a
        // file-size limit) is the host's way of saying out of memory.
        if code == libc::ENOMEM || code == libc::ENOSPC || code == libc::EFBIG {
            return Error::OutOfMemory(format!("{call}: {message}"));
        }
        Error::Driver { call, code: code as i64, name: errno_name(code), message }
    }

    fn mmap(addr: u64, size: u64, prot: i32, flags: i32, fd: i32, offset: u64) -> Result<u64> {
        // SAFETY: callers pass either a null hint (a fresh mapping the kernel
        // places) or, with MAP_FIXED, a span that `Rules` has verified lies
        // inside one of this driver's own reservations, so no memory owned by
        // anyone else is replaced.
        let p = unsafe { libc::mmap(addr as *mut libc::c_void, size as usize, prot, flags, fd, offset as libc::off_t) };
        if p == libc::MAP_FAILED {
            return Err(os_error("mmap", errno()));
        }
        Ok(p as u64)
    }

    fn munmap(addr: u64, size: u64) -> Result<()> {
        // SAFETY: only called on spans of this driver's own reservations,
        // which no Rust reference points into once the arena has freed them.
        if unsafe { libc::munmap(addr as *mut libc::c_void, size as usize) } != 0 {
            return Err(os_error("munmap", errno()));
        }
        Ok(())
    }

    fn fallocate(fd: i32, mode: i32, offset: u64, len: u64) -> Result<()> {
        // SAFETY: plain system call on a descriptor this driver owns.
        if unsafe { libc::fallocate(fd, mode, offset as libc::off_t, len as libc::off_t) } != 0 {
            return Err(os_error("fallocate", errno()));
        }
        Ok(())
    }

    fn fstat(fd: i32) -> Result<libc::stat> {
        // SAFETY: `st` is a plain-old-data out-parameter for fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a descriptor number and a valid pointer to `st`; fstat
        // only reads the descriptor table (a closed number is EBADF).
        if unsafe { libc::fstat(fd, &mut st) } != 0 {
            return Err(os_error("fstat", errno()));
        }
        Ok(st)
    }

    fn ftruncate(fd: i32, len: u64) -> Result<()> {
        // SAFETY: plain system call on a descriptor this driver owns.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            return Err(os_error("ftruncate", errno()));
        }
        Ok(())
    }

    fn page_size() -> u64 {
        // SAFETY: sysconf has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 {
            p as u64
        } else {
            4096
        }
    }

    impl HostDriver {
        /// A host driver that commits chunk memory at create time.
        pub fn new() -> Result<HostDriver> {
            Self::with_options(HostOptions::default())
        }

        /// A host driver whose chunks are exportable: each gets a sealed
        /// memfd of its own (see the module docs), one descriptor per chunk.
        pub fn with_exportable_chunks(options: HostOptions) -> Result<HostDriver> {
            let mut d = Self::with_options(options)?;
            d.exportable = true;
            Ok(d)
        }

        /// A host driver with explicit options.
        pub fn with_options(options: HostOptions) -> Result<HostDriver> {
            let name = c"vmm-arena";
            // SAFETY: `name` is a valid NUL-terminated string; flags are constants.
            let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
            if fd < 0 {
                let code = errno();
                return Err(Error::Unsupported(format!(
                    "memfd_create failed: {}",
                    std::io::Error::from_raw_os_error(code)
                )));
            }
            // SAFETY: `fd` is a fresh descriptor that nothing else owns.
            let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
            let page = page_size();
            Ok(HostDriver {
                memfd,
                page,
                options,
                exportable: false,
                dmabuf_standin: false,
                inner: Mutex::new(HostState {
                    rules: Rules::new(page),
                    offsets: HashMap::new(),
                    free_offsets: BTreeMap::new(),
                    own: HashMap::new(),
                    file_len: 0,
                    next_handle: 1,
                    dmabufs: HashMap::new(),
                }),
            })
        }

        /// This driver with the DMA-BUF stand-in on (see the module docs).
        pub fn with_dmabuf_standin(mut self) -> HostDriver {
            self.dmabuf_standin = true;
            self
        }

        /// Reads `dst.len()` bytes at `offset` of the memory a stand-in
        /// DMA-BUF reaches, as a device registered with it would.
        pub fn standin_dmabuf_read(&self, fd: BorrowedFd<'_>, offset: u64, dst: &mut [u8]) -> Result<()> {
            self.standin_io(fd, offset, dst.len() as u64, |file, at, done, n| {
                // SAFETY: `dst[done..done + n]` is in bounds (`standin_io`
                // splits `dst.len()` bytes), pread writes at most n bytes.
                unsafe { libc::pread(file, dst[done..].as_mut_ptr().cast(), n, at as libc::off_t) }
            })
        }

        /// Writes `src` at `offset` of the memory a stand-in DMA-BUF reaches.
        pub fn standin_dmabuf_write(&self, fd: BorrowedFd<'_>, offset: u64, src: &[u8]) -> Result<()> {
            self.standin_io(fd, offset, src.len() as u64, |file, at, done, n| {
                // SAFETY: `src[done..done + n]` is in bounds, pwrite reads n bytes.
                unsafe { libc::pwrite(file, src[done..].as_ptr().cast(), n, at as libc::off_t) }
            })
        }

        /// Splits `offset..offset + len` of a stand-in DMA-BUF over its
        /// pieces and runs `io(file, file_offset, done, n)` on each.
        fn standin_io(
            &self,
            fd: BorrowedFd<'_>,
            offset: u64,
            len: u64,
            mut io: impl FnMut(i32, u64, usize, usize) -> isize,
        ) -> Result<()> {
            let s = self.state()?;
            let ino = fstat(fd.as_raw_fd())?.st_ino;
            let pieces = s.dmabufs.get(&ino).ok_or_else(|| Error::invalid("not a stand-in DMA-BUF of this driver"))?;
            let total: u64 = pieces.iter().map(|p| p.len).sum();
            if offset.checked_add(len).map_or(true, |end| end > total) {
                return Err(Error::invalid(format!("{offset}+{len} is past the DMA-BUF's {total} bytes")));
            }
            let (mut skip, mut done) = (offset, 0u64);
            for p in pieces {
                if done == len {
                    break;
                }
                if skip >= p.len {
                    skip -= p.len;
                    continue;
                }
                let n = (p.len - skip).min(len - done);
                let (file, base) = match &p.own {
                    Some(f) => (f.as_raw_fd(), 0),
                    None => (self.memfd.as_raw_fd(), 0),
                };
                let got = io(file, base + p.offset + skip, done as usize, n as usize);
                if got != n as isize {
                    return Err(os_error("pread/pwrite", errno()));
                }
                done += n;
                skip = 0;
            }
            Ok(())
        }

        fn state(&self) -> Result<MutexGuard<'_, HostState>> {
            self.inner.lock().map_err(|_| Error::Internal("host driver lock poisoned".into()))
        }

        /// Bytes of the memfd that hold memory (committed or touched), and
        /// of the chunks with a memfd of their own that this driver created
        /// and still holds (imported chunks are not counted).
        pub fn allocated_file_bytes(&self) -> Result<u64> {
            let mut total = fstat(self.memfd.as_raw_fd())?.st_blocks as u64 * 512;
            for c in self.state()?.own.values().filter(|c| !c.imported) {
                total += fstat(c.fd.as_raw_fd())?.st_blocks as u64 * 512;
            }
            Ok(total)
        }

        /// Chunks holding a descriptor of their own (exportable or imported).
        pub fn own_descriptors(&self) -> usize {
            self.state().map(|s| s.own.len()).unwrap_or(0)
        }

        /// Creates one exportable chunk: a sealed memfd of its own.
        fn create_own(&self, size: u64) -> Result<OwnedFd> {
            // The name `import_chunk` recognises (`CHUNK_LINK`).
            let name = c"vmm-arena-chunk";
            // SAFETY: `name` is a valid NUL-terminated string; flags are constants.
            let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING) };
            if raw < 0 {
                return Err(os_error("memfd_create", errno()));
            }
            // SAFETY: `raw` is a fresh descriptor that nothing else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            ftruncate(fd.as_raw_fd(), size)?;
            if !self.options.sparse {
                fallocate(fd.as_raw_fd(), 0, 0, size)?;
            }
            let seals = libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
            // SAFETY: plain fcntl on a descriptor owned here.
            if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
                return Err(os_error("fcntl(F_ADD_SEALS)", errno()));
            }
            Ok(fd)
        }

        /// Chunks created and not yet released.
        pub fn live_chunks(&self) -> usize {
            self.state().map(|s| s.rules.live_chunks()).unwrap_or(0)
        }

        /// Mappings currently in place.
        pub fn live_mappings(&self) -> usize {
            self.state().map(|s| s.rules.live_mappings()).unwrap_or(0)
        }

        /// Chunks released while still mapped somewhere (their memory
        /// lives until the last unmap).
        pub fn released_but_mapped(&self) -> usize {
            self.state().map(|s| s.rules.released_but_mapped()).unwrap_or(0)
        }

        fn punch(&self, s: &mut HostState, handle: ChunkHandle) {
            // A chunk with its own memfd: closing this driver's descriptor
            // drops its reference; the memory goes once no process holds it.
            if s.own.remove(&handle).is_some() {
                return;
            }
            if let Some((off, size)) = s.offsets.remove(&handle) {
                // Best effort: a failed punch leaves the pages allocated but
                // the offset is still reused, so nothing accumulates.
                let _ = fallocate(
                    self.memfd.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    off,
                    size,
                );
                s.free_offsets.entry(size).or_default().push(off);
            }
        }
    }

    impl Driver for HostDriver {
        fn name(&self) -> &'static str {
            "host"
        }

        fn granularity(&self) -> Result<Granularity> {
            Ok(Granularity { minimum: self.page, recommended: 2 << 20 })
        }

        fn total_memory(&self) -> Result<u64> {
            // SAFETY: sysconf has no preconditions.
            let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
            if pages <= 0 {
                return Err(os_error("sysconf", errno()));
            }
            Ok(pages as u64 * self.page)
        }

        fn reserve(&self, size: u64, align: u64) -> Result<u64> {
            // The CUDA rule (0 or a power of two) first, so that a caller
            // passing e.g. a 6 MiB chunk as the alignment fails here, not
            // only on a GPU.
            self.state()?.rules.check_reserve(size, align)?;
            let align = align.max(self.page);
            if size == 0 || size % self.page != 0 || align % self.page != 0 {
                return Err(os_error("mmap", libc::EINVAL));
            }
            let total = size.checked_add(align).ok_or_else(|| os_error("mmap", libc::ENOMEM))?;
            let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
            // The arguments are valid (checked above): EINVAL here means the
            // length is more than the address space can hold (Valgrind says
            // so where the kernel says ENOMEM), which is out of memory.
            let raw = mmap(0, total, libc::PROT_NONE, flags, -1, 0).map_err(|e| match e {
                Error::Driver { code, .. } if code == libc::EINVAL as i64 => {
                    Error::OutOfMemory(format!("mmap: no address range of {total} bytes"))
                }
                e => e,
            })?;
            let base = raw.div_ceil(align) * align;
            // Trim the alignment slack on both sides; failures here only leak
            // inaccessible address space, never memory.
            if base > raw {
                let _ = munmap(raw, base - raw);
            }
            let tail = raw + total - (base + size);
            if tail > 0 {
                let _ = munmap(base + size, tail);
            }
            self.state()?.rules.add_reservation(base, size);
            Ok(base)
        }

        fn free_reservation(&self, base: u64, size: u64) -> Result<()> {
            let mut s = self.state()?;
            s.rules.check_free_reservation(base, size)?;
            munmap(base, size)?;
            s.rules.remove_reservation(base);
            Ok(())
        }

        fn create(&self, size: u64) -> Result<ChunkHandle> {
            let mut s = self.state()?;
            s.rules.check_create(size)?;
            if self.exportable {
                let fd = self.create_own(size)?;
                let h = ChunkHandle(s.next_handle);
                s.next_handle += 1;
                s.own.insert(h, OwnChunk { fd, imported: false });
                s.rules.add_chunk(h, size);
                return Ok(h);
            }
            let fd = self.memfd.as_raw_fd();
            let reused = s.free_offsets.get_mut(&size).and_then(|v| v.pop());
            let (off, grew) = match reused {
                Some(off) => (off, false),
                None => (s.file_len, true),
            };
            let restore = |s: &mut HostState| match grew {
                true => {}
                false => s.free_offsets.entry(size).or_default().push(off),
            };
            if grew {
                if let Err(e) = ftruncate(fd, off + size) {
                    restore(&mut s);
                    return Err(e);
                }
            }
            if !self.options.sparse {
                if let Err(e) = fallocate(fd, 0, off, size) {
                    // Give back whatever part was committed before the failure.
                    let _ = fallocate(fd, libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE, off, size);
                    if grew {
                        let _ = ftruncate(fd, s.file_len);
                    }
                    restore(&mut s);
                    return Err(e);
                }
            }
            if grew {
                s.file_len = off + size;
            }
            let h = ChunkHandle(s.next_handle);
            s.next_handle += 1;
            s.offsets.insert(h, (off, size));
            s.rules.add_chunk(h, size);
            Ok(h)
        }

        fn release(&self, chunk: ChunkHandle) -> Result<()> {
            let mut s = self.state()?;
            if s.rules.release(chunk)? {
                self.punch(&mut s, chunk);
            }
            Ok(())
        }

        fn map(&self, addr: u64, size: u64, chunk: ChunkHandle, offset: u64) -> Result<()> {
            let mut s = self.state()?;
            s.rules.check_map(addr, size, chunk, offset)?;
            let (fd, file_off) = match s.own.get(&chunk) {
                Some(c) => (c.fd.as_raw_fd(), offset),
                None => (self.memfd.as_raw_fd(), s.offsets[&chunk].0 + offset),
            };
            let flags = libc::MAP_SHARED | libc::MAP_FIXED;
            mmap(addr, size, libc::PROT_NONE, flags, fd, file_off)?;
            s.rules.add_mapping(addr, size, chunk, offset);
            Ok(())
        }

        fn set_access(&self, addr: u64, size: u64) -> Result<()> {
            let mut s = self.state()?;
            s.rules.check_set_access(addr, size)?;
            let prot = match s.rules.maps_read_only(addr, size) {
                true => libc::PROT_READ,
                false => libc::PROT_READ | libc::PROT_WRITE,
            };
            // SAFETY: `Rules` verified the span is wholly mapped by this driver.
            if unsafe { libc::mprotect(addr as *mut libc::c_void, size as usize, prot) } != 0 {
                return Err(os_error("mprotect", errno()));
            }
            s.rules.set_access(addr, size);
            Ok(())
        }

        fn unmap(&self, addr: u64, size: u64) -> Result<()> {
            let mut s = self.state()?;
            s.rules.check_unmap(addr, size)?;
            let flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED;
            mmap(addr, size, libc::PROT_NONE, flags, -1, 0)?;
            for (h, _) in s.rules.unmap(addr, size).freed_chunks {
                self.punch(&mut s, h);
            }
            Ok(())
        }

        fn synchronize(&self) -> Result<()> {
            Ok(())
        }

        fn read(&self, addr: u64, dst: &mut [u8]) -> Result<()> {
            let s = self.state()?;
            s.rules.resolve("read", addr, dst.len() as u64)?;
            // SAFETY: `resolve` proved the whole span is mapped with read
            // access, and the state lock keeps it mapped during the copy.
            unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, dst.as_mut_ptr(), dst.len()) };
            Ok(())
        }

        fn write(&self, addr: u64, src: &[u8]) -> Result<()> {
            let s = self.state()?;
            let pieces = s.rules.resolve("write", addr, src.len() as u64)?;
            s.rules.check_writable("write", &pieces)?;
            // SAFETY: as in `read`: mapped, writable, and kept so by the lock.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), addr as *mut u8, src.len()) };
            Ok(())
        }

        fn copy(&self, dst: u64, src: u64, len: u64) -> Result<()> {
            let s = self.state()?;
            s.rules.resolve("copy", src, len)?;
            let pieces = s.rules.resolve("copy", dst, len)?;
            s.rules.check_writable("copy", &pieces)?;
            // SAFETY: both spans are mapped and accessible (checked above) and
            // stay so under the lock; `copy` handles overlap safely.
            unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
            Ok(())
        }

        fn export_chunk(&self, chunk: ChunkHandle) -> Result<OwnedFd> {
            let s = self.state()?;
            if s.rules.chunk_size(chunk).is_none() {
                return Err(Error::invalid(format!("export: chunk {chunk:?} is not live")));
            }
            match s.own.get(&chunk) {
                Some(c) => c.fd.try_clone().map_err(|e| os_error("fcntl(F_DUPFD_CLOEXEC)", e.raw_os_error().unwrap_or(0))),
                None => Err(Error::Unsupported(
                    "this chunk lives in the arena's shared memfd and cannot be exported alone: create the arena with exportable chunks".into(),
                )),
            }
        }

        fn import_chunk(&self, fd: BorrowedFd<'_>, size: u64, read_only: bool) -> Result<ChunkHandle> {
            let mut s = self.state()?;
            s.rules.check_create(size)?;
            let raw = fd.as_raw_fd();
            let st = fstat(raw).map_err(|e| match e {
                Error::Driver { code, .. } if code == libc::EBADF as i64 => {
                    Error::invalid(format!("import: descriptor {raw} is not open"))
                }
                e => e,
            })?;
            if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_size as u64 != size {
                return Err(Error::invalid(format!(
                    "import: descriptor {raw} is not an exported chunk of {size} bytes (a file of {} bytes)",
                    st.st_size
                )));
            }
            // SAFETY: plain fcntl on a descriptor the caller lends us.
            let seals = unsafe { libc::fcntl(raw, libc::F_GET_SEALS) };
            let wanted = libc::F_SEAL_GROW | libc::F_SEAL_SHRINK;
            if seals < 0 || seals & wanted != wanted {
                return Err(Error::invalid(format!(
                    "import: descriptor {raw} is not sealed against resizing (not an exported chunk)"
                )));
            }
            // A sealed memfd of the right size that no arena made is not a
            // chunk: refused by its name (the header promises INVALID_ARGUMENT).
            match std::fs::read_link(format!("/proc/self/fd/{raw}")) {
                Ok(target) if target.to_string_lossy().starts_with(CHUNK_LINK) => {}
                Ok(target) => {
                    return Err(Error::invalid(format!(
                        "import: descriptor {raw} is {} , not an exported chunk",
                        target.display()
                    )))
                }
                Err(e) => return Err(os_error("readlink(/proc/self/fd)", e.raw_os_error().unwrap_or(0))),
            }
            let fd = fd
                .try_clone_to_owned()
                .map_err(|e| os_error("fcntl(F_DUPFD_CLOEXEC)", e.raw_os_error().unwrap_or(0)))?;
            let h = ChunkHandle(s.next_handle);
            s.next_handle += 1;
            s.own.insert(h, OwnChunk { fd, imported: true });
            if read_only {
                s.rules.add_read_only_chunk(h, size);
            } else {
                s.rules.add_chunk(h, size);
            }
            Ok(h)
        }

        fn dmabuf_fd(&self, addr: u64, size: u64) -> Result<OwnedFd> {
            if !self.dmabuf_standin {
                return Err(Error::Unsupported("the host backend has no DMA-BUF handles (GPU only)".into()));
            }
            let mut s = self.state()?;
            let mut pieces = Vec::new();
            for (chunk, offset, len) in s.rules.resolve("dmabuf_fd", addr, size)? {
                pieces.push(match s.own.get(&chunk) {
                    Some(c) => StandinPiece {
                        own: Some(
                            c.fd.try_clone()
                                .map_err(|e| os_error("fcntl(F_DUPFD_CLOEXEC)", e.raw_os_error().unwrap_or(0)))?,
                        ),
                        offset,
                        len,
                    },
                    None => StandinPiece { own: None, offset: s.offsets[&chunk].0 + offset, len },
                });
            }
            let name = c"vmm-arena-dmabuf-standin";
            // SAFETY: `name` is a valid NUL-terminated string; flags are constants.
            let raw = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
            if raw < 0 {
                return Err(os_error("memfd_create", errno()));
            }
            // SAFETY: `raw` is a fresh descriptor that nothing else owns.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            let ino = fstat(fd.as_raw_fd())?.st_ino;
            s.dmabufs.insert(ino, pieces);
            Ok(fd)
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        const C: u64 = 2 << 20;

        #[test]
        #[cfg_attr(miri, ignore)] // system calls
        fn same_chunk_at_two_addresses_and_release_gives_memory_back() {
            let d = HostDriver::new().unwrap();
            let base = d.reserve(8 * C, C).unwrap();
            assert_eq!(base % C, 0);
            let c = d.create(C).unwrap();
            assert!(d.allocated_file_bytes().unwrap() >= C, "create commits");
            d.map(base, C, c, 0).unwrap();
            d.map(base + 3 * C, C, c, 0).unwrap();
            d.set_access(base, C).unwrap();
            d.set_access(base + 3 * C, C).unwrap();
            d.write(base + 4096, b"moved by remapping").unwrap();
            let mut out = [0u8; 18];
            d.read(base + 3 * C + 4096, &mut out).unwrap();
            assert_eq!(&out, b"moved by remapping");
            assert!(d.read(base + C, &mut out).is_err(), "unmapped hole is refused, not a segfault");
            assert!(d.unmap(base, C / 2).is_err(), "partial unmap refused");
            d.unmap(base, C).unwrap();
            d.release(c).unwrap();
            assert!(d.allocated_file_bytes().unwrap() >= C, "still mapped once");
            d.unmap(base + 3 * C, C).unwrap();
            assert_eq!(d.allocated_file_bytes().unwrap(), 0, "hole punched");
            assert!(d.release(c).is_err(), "double release refused");
            assert_eq!((d.live_chunks(), d.live_mappings()), (0, 0));
            d.free_reservation(base, 8 * C).unwrap();
        }

        #[test]
        #[cfg_attr(miri, ignore)] // system calls
        fn sparse_mode_does_not_commit_and_offsets_are_reused() {
            let d = HostDriver::with_options(HostOptions { sparse: true }).unwrap();
            let a = d.create(C).unwrap();
            assert_eq!(d.allocated_file_bytes().unwrap(), 0);
            d.release(a).unwrap();
            let _b = d.create(C).unwrap();
            assert_eq!(d.state().unwrap().file_len, C, "offset reused");
        }
    }
}
