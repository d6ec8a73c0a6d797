//! Export and import beside the driver work off the critical path (host
//! backend):
//!
//! - `free_on_stream` of an exported allocation releases its chunks (never
//!   pooled, never pending), and of an import unmaps and closes it; both
//!   after a device synchronize, which orders them after the stream's work,
//!   and without an event (a driver whose streams record events, wrapped
//!   around the exportable host driver, shows that a plain allocation's
//!   stream free does record one);
//! - prefetch: precreated chunks of an exportable arena are exportable
//!   (adopted by an allocation, exported, imported, bytes intact); the
//!   map-ahead window of an exported growable allocation holds pool chunks,
//!   which stay pooled when it is freed while its exported chunks are
//!   released; `maintain` leaves an import's reservation alone;
//! - `resize_many` refuses an import and an exported allocation's shrink
//!   below its exported chunks (all or nothing: the other requests are
//!   untouched), and never moves an exported allocation.

mod common;

use std::collections::BTreeMap;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex};

use common::{Snap, HOST_CHUNK as C};
use vmm_arena::driver::fault::FaultDriver;
use vmm_arena::driver::host::{HostDriver, HostOptions};
use vmm_arena::driver::{ChunkHandle, Driver, Granularity};
use vmm_arena::{Arena, ArenaConfig, Error, Id, Result, Status};

fn cfg(cap: u64) -> ArenaConfig {
    ArenaConfig { capacity_bytes: cap * C, reserve_bytes: 4 * cap * C, chunk_bytes: C, ..ArenaConfig::default() }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(29) ^ seed).collect()
}

fn read(a: &Arena, id: Id, len: usize) -> Vec<u8> {
    let mut v = vec![0; len];
    a.read(id, 0, &mut v).unwrap();
    v
}

fn check(a: &Arena) {
    Snap::of(a).check_structure(a.va_range());
}

/// A host driver (exportable or not) with streams: `record_event` gives an
/// event that completes only at a synchronize or a wait, and a log of the
/// calls that order a free (event records, synchronizes, unmaps).
struct Streamed {
    inner: HostDriver,
    /// Event id -> completed.
    events: Mutex<BTreeMap<u64, bool>>,
    next_event: Mutex<u64>,
    log: Mutex<Vec<&'static str>>,
}

impl Streamed {
    fn new(exportable: bool) -> Arc<Streamed> {
        let inner = match exportable {
            true => HostDriver::with_exportable_chunks(HostOptions::default()),
            false => HostDriver::with_options(HostOptions::default()),
        };
        Arc::new(Streamed {
            inner: inner.unwrap(),
            events: Mutex::default(),
            next_event: Mutex::new(1),
            log: Mutex::default(),
        })
    }
    fn note(&self, what: &'static str) {
        self.log.lock().unwrap().push(what);
    }
    fn take_log(&self) -> Vec<&'static str> {
        std::mem::take(&mut *self.log.lock().unwrap())
    }
}

impl Driver for Streamed {
    fn name(&self) -> &'static str {
        "host with streams"
    }
    fn granularity(&self) -> Result<Granularity> {
        self.inner.granularity()
    }
    fn total_memory(&self) -> Result<u64> {
        self.inner.total_memory()
    }
    fn reserve(&self, size: u64, align: u64) -> Result<u64> {
        self.inner.reserve(size, align)
    }
    fn free_reservation(&self, base: u64, size: u64) -> Result<()> {
        self.inner.free_reservation(base, size)
    }
    fn create(&self, size: u64) -> Result<ChunkHandle> {
        self.inner.create(size)
    }
    fn release(&self, chunk: ChunkHandle) -> Result<()> {
        self.inner.release(chunk)
    }
    fn map(&self, addr: u64, size: u64, chunk: ChunkHandle, offset: u64) -> Result<()> {
        self.inner.map(addr, size, chunk, offset)
    }
    fn set_access(&self, addr: u64, size: u64) -> Result<()> {
        self.inner.set_access(addr, size)
    }
    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        self.note("unmap");
        self.inner.unmap(addr, size)
    }
    fn synchronize(&self) -> Result<()> {
        self.note("sync");
        // The device is idle afterwards: every stream's work has completed.
        self.events.lock().unwrap().values_mut().for_each(|done| *done = true);
        self.inner.synchronize()
    }
    fn read(&self, addr: u64, dst: &mut [u8]) -> Result<()> {
        self.inner.read(addr, dst)
    }
    fn write(&self, addr: u64, src: &[u8]) -> Result<()> {
        self.inner.write(addr, src)
    }
    fn copy(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        self.inner.copy(dst, src, len)
    }
    fn record_event(&self, _stream: u64) -> Result<Option<u64>> {
        self.note("record");
        let mut n = self.next_event.lock().unwrap();
        let e = *n;
        *n += 1;
        self.events.lock().unwrap().insert(e, false);
        Ok(Some(e))
    }
    fn event_complete(&self, event: u64) -> Result<bool> {
        self.events.lock().unwrap().get(&event).copied().ok_or_else(|| Error::InvalidArgument("unknown event".into()))
    }
    fn wait_event(&self, event: u64) -> Result<()> {
        match self.events.lock().unwrap().get_mut(&event) {
            Some(done) => {
                *done = true;
                Ok(())
            }
            None => Err(Error::InvalidArgument("unknown event".into())),
        }
    }
    fn destroy_event(&self, event: u64) -> Result<()> {
        self.events
            .lock()
            .unwrap()
            .remove(&event)
            .map(drop)
            .ok_or_else(|| Error::InvalidArgument("unknown event".into()))
    }
    fn export_chunk(&self, chunk: ChunkHandle) -> Result<OwnedFd> {
        self.inner.export_chunk(chunk)
    }
    fn import_chunk(&self, fd: BorrowedFd<'_>, size: u64, read_only: bool) -> Result<ChunkHandle> {
        self.inner.import_chunk(fd, size, read_only)
    }
}

#[test]
fn a_plain_stream_free_stays_pending_until_its_event() {
    // The wrapper's events work: the contrast to the two tests below.
    let d = Streamed::new(true);
    let a = Arena::with_driver(d.clone(), cfg(8)).unwrap();
    let (x, _) = a.alloc(2 * C).unwrap();
    d.take_log();
    a.free_on_stream(x, 7).unwrap();
    assert_eq!(d.take_log(), ["record"]);
    let s = a.stats().unwrap();
    assert_eq!((s.stream_frees, s.pending_free_bytes, s.pooled_bytes), (1, 2 * C, 2 * C));
    check(&a);
}

#[test]
fn an_exported_allocation_freed_on_a_stream_releases_its_chunks_after_a_synchronize() {
    let d = Streamed::new(true);
    let ex = Arena::with_driver(d.clone(), cfg(8)).unwrap();
    let im = Arena::with_driver(Streamed::new(false), cfg(8)).unwrap();
    let size = 2 * C;
    let (x, _) = ex.alloc(size).unwrap();
    ex.write(x, 0, &pattern(3, size as usize)).unwrap();
    let export = ex.export(x).unwrap();
    let (y, _) = im.import_export(&export, false).unwrap();
    let before = ex.stats().unwrap();
    d.take_log();
    // The export is still open: the exporter may free first.
    ex.free_on_stream(x, 7).unwrap();
    let log = d.take_log();
    assert!(!log.contains(&"record"), "no event: the free is done at once ({log:?})");
    let first_unmap = log.iter().position(|&c| c == "unmap").expect("its backing is unmapped");
    assert!(log[..first_unmap].contains(&"sync"), "a synchronize orders the unmap after the stream ({log:?})");
    assert!(matches!(ex.query(x), Err(Error::UnknownAllocation(_))));
    let s = ex.stats().unwrap();
    assert_eq!((s.stream_frees, s.pending_free_bytes), (0, 0), "nothing pending");
    assert_eq!(s.pooled_bytes, before.pooled_bytes, "its chunks never went to the pool");
    assert_eq!(s.driver_releases, before.driver_releases + 2, "both chunks released");
    assert_eq!(s.exported_allocations, 0);
    assert_eq!(read(&im, y, size as usize), pattern(3, size as usize), "the importer's mapping stays valid");
    // A new allocation makes new chunks: nothing of x's is reused.
    let (z, _) = ex.alloc(size).unwrap();
    assert_eq!(ex.stats().unwrap().driver_creates, s.driver_creates + 2);
    ex.write(z, 0, &pattern(9, size as usize)).unwrap();
    assert_eq!(read(&im, y, size as usize), pattern(3, size as usize), "z's bytes are not the import's");
    check(&ex);
    drop(export);
    im.free(y).unwrap();
}

#[test]
fn an_import_freed_on_a_stream_is_unmapped_and_closed_after_a_synchronize() {
    let ex = Arena::with_driver(Streamed::new(true), cfg(8)).unwrap();
    let d = Streamed::new(false);
    let im = Arena::with_driver(d.clone(), cfg(8)).unwrap();
    let (x, _) = ex.alloc(3 * C).unwrap();
    ex.write(x, 0, &pattern(5, 3 * C as usize)).unwrap();
    let export = ex.export(x).unwrap();
    let (y, _) = im.import_export(&export, true).unwrap();
    assert_eq!(im.stats().unwrap().imported_allocations, 1);
    d.take_log();
    im.free_on_stream(y, 3).unwrap();
    let log = d.take_log();
    assert!(!log.contains(&"record"), "no event ({log:?})");
    let first_unmap = log.iter().position(|&c| c == "unmap").expect("the import is unmapped");
    assert!(log[..first_unmap].contains(&"sync"), "after a synchronize ({log:?})");
    let s = im.stats().unwrap();
    assert_eq!((s.imported_allocations, s.imported_bytes, s.pending_free_bytes, s.stream_frees), (0, 0, 0, 0));
    assert_eq!(im.free_on_stream(y, 3).unwrap_err().status(), Status::UnknownAllocation);
    assert_eq!(read(&ex, x, 3 * C as usize), pattern(5, 3 * C as usize), "the exporter's bytes are its own");
    check(&im);
    drop(export);
    ex.free(x).unwrap();
}

#[test]
fn precreated_chunks_of_an_exportable_arena_are_exportable() {
    let d = Arc::new(FaultDriver::new(HostDriver::with_exportable_chunks(HostOptions::default()).unwrap()));
    let ex = Arena::with_driver(d.clone(), cfg(8)).unwrap();
    let im = Arena::with_driver(Arc::new(HostDriver::new().unwrap()), cfg(8)).unwrap();
    ex.set_prefetch(2 * C, 0).unwrap();
    ex.maintain().unwrap();
    assert_eq!(ex.stats().unwrap().prefetched_bytes, 2 * C);
    let before = ex.stats().unwrap();
    let (x, _) = ex.alloc(2 * C).unwrap();
    assert_eq!(ex.stats().unwrap().caller_creates, before.caller_creates, "x adopted the precreated chunks");
    ex.write(x, 0, &pattern(7, 2 * C as usize)).unwrap();
    let export = ex.export(x).unwrap();
    assert_eq!(export.fds().len(), 2);
    let (y, _) = im.import_export(&export, false).unwrap();
    assert_eq!(read(&im, y, 2 * C as usize), pattern(7, 2 * C as usize));
    drop(export);
    im.free(y).unwrap();
    ex.free(x).unwrap();
    check(&ex);
    drop(ex);
    assert_eq!((d.live_chunks(), d.live_mappings()), (0, 0));
}

#[test]
fn an_exported_growable_allocations_map_ahead_chunks_stay_pooled_at_its_free() {
    let d = Arc::new(FaultDriver::new(HostDriver::with_exportable_chunks(HostOptions::default()).unwrap()));
    let ex = Arena::with_driver(d.clone(), cfg(16)).unwrap();
    let im = Arena::with_driver(Arc::new(HostDriver::new().unwrap()), cfg(16)).unwrap();
    let (g, g_ptr) = ex.alloc_growable(C, 8 * C).unwrap();
    ex.write(g, 0, &pattern(1, C as usize)).unwrap();
    let export = ex.export(g).unwrap();
    let (y, _) = im.import_export(&export, false).unwrap();
    ex.set_prefetch(0, 2 * C).unwrap();
    ex.maintain().unwrap();
    let s = ex.stats().unwrap();
    assert_eq!((s.prefetched_bytes, s.pooled_bytes, s.mapped_bytes), (2 * C, 2 * C, C), "two chunks mapped ahead");
    // Growth into the window: no driver call on the caller's thread, no move.
    let before = ex.stats().unwrap();
    assert_eq!(ex.resize(g, 3 * C).unwrap(), g_ptr);
    assert_eq!(ex.stats().unwrap().caller_driver_calls, before.caller_driver_calls);
    // The exported chunk cannot go; above it, shrinking is fine.
    assert_eq!(ex.resize(g, C - 1).unwrap(), g_ptr);
    assert_eq!(ex.resize(g, C).unwrap(), g_ptr);
    ex.maintain().unwrap();
    assert_eq!(ex.stats().unwrap().prefetched_bytes, 2 * C);
    let (live, pooled) = (d.live_chunks(), ex.stats().unwrap().pooled_bytes);
    ex.free(g).unwrap();
    // The one backing chunk (exported) is released; the window's stay pooled.
    assert_eq!(d.live_chunks(), live - 1);
    assert_eq!(ex.stats().unwrap().pooled_bytes, pooled);
    assert_eq!(read(&im, y, C as usize), pattern(1, C as usize), "the import still maps the exported chunk");
    check(&ex);
    drop(export);
    im.free(y).unwrap();
    drop(ex);
    assert_eq!((d.live_chunks(), d.live_mappings()), (0, 0));
}

#[test]
fn maintain_leaves_an_imports_reservation_alone() {
    let ex = Arena::with_driver(Arc::new(HostDriver::with_exportable_chunks(HostOptions::default()).unwrap()), cfg(8))
        .unwrap();
    let d = Arc::new(FaultDriver::new(HostDriver::new().unwrap()));
    let im = Arena::with_driver(d.clone(), cfg(8)).unwrap();
    let (x, _) = ex.alloc(2 * C).unwrap();
    ex.write(x, 0, &pattern(2, 2 * C as usize)).unwrap();
    let export = ex.export(x).unwrap();
    let (y, y_ptr) = im.import_export(&export, false).unwrap();
    let (g, _) = im.alloc_growable(C, 4 * C).unwrap();
    im.set_prefetch(3 * C, 2 * C).unwrap();
    im.maintain().unwrap();
    let s = im.stats().unwrap();
    // Three precreated, plus two mapped ahead of g; the capacity counts none
    // of the import's chunks.
    assert_eq!(s.prefetched_bytes, 5 * C);
    assert_eq!((s.imported_allocations, s.imported_bytes), (1, 2 * C));
    let info = im.query(y).unwrap();
    assert_eq!((info.ptr, info.mapped_bytes), (y_ptr, 2 * C));
    assert_eq!(read(&im, y, 2 * C as usize), pattern(2, 2 * C as usize));
    im.free(g).unwrap();
    im.free(y).unwrap();
    check(&im);
    drop(export);
    drop(im);
    assert_eq!((d.live_chunks(), d.live_mappings()), (0, 0));
}

#[test]
fn resize_many_keeps_the_export_rules_all_or_nothing() {
    let ex = Arena::with_driver(Arc::new(HostDriver::with_exportable_chunks(HostOptions::default()).unwrap()), cfg(16))
        .unwrap();
    let im = Arena::with_driver(Arc::new(HostDriver::new().unwrap()), cfg(16)).unwrap();
    let (x, x_ptr) = ex.alloc(3 * C).unwrap();
    let (n, _) = ex.alloc(C).unwrap(); // x's neighbour
    let (o, _) = ex.alloc(2 * C).unwrap();
    ex.write(x, 0, &pattern(4, 3 * C as usize)).unwrap();
    let export = ex.export(x).unwrap();
    let (y, _) = im.import_export(&export, false).unwrap();
    let before = Snap::of(&ex);

    // A shrink below the exported chunks: refused, the other request undone.
    let e = ex.resize_many(&[(o, 4 * C), (x, 2 * C)]).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    assert_eq!(Snap::of(&ex), before, "nothing changed");
    assert_eq!(ex.query(o).unwrap().size, 2 * C);

    // An import in a batch of the importer's.
    let (z, _) = im.alloc(C).unwrap();
    let e = im.resize_many(&[(z, 2 * C), (y, 2 * C)]).unwrap_err();
    assert_eq!(e.status(), Status::InvalidArgument, "{e}");
    assert_eq!(im.query(z).unwrap().size, C);

    // Growth of the exported (pinned) allocation past its reservation, with
    // a neighbour in the way: it grows in place or is refused, never moves.
    match ex.resize_many(&[(x, 5 * C), (o, C)]) {
        Ok(ptrs) => assert_eq!(ptrs[0], x_ptr, "an exported allocation never moves"),
        Err(e) => {
            assert_eq!(e.status(), Status::Pinned, "{e}");
            assert_eq!(Snap::of(&ex), before);
        }
    }
    assert_eq!(ex.query(x).unwrap().ptr, x_ptr);
    assert_eq!(read(&im, y, 3 * C as usize), pattern(4, 3 * C as usize), "the import maps x's chunks still");
    // Growing and shrinking above the exported chunks is fine.
    let ptrs = ex.resize_many(&[(x, 3 * C), (o, 2 * C)]).unwrap();
    assert_eq!(ptrs[0], x_ptr);
    check(&ex);
    drop(export);
    im.free(y).unwrap();
    for id in [x, n, o] {
        ex.free(id).unwrap();
    }
}
