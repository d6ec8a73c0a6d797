//! An in-memory backend: chunks are byte vectors, addresses are numbers.
//!
//! It enforces the same rules as the host backend (`driver/rules.rs`) but
//! makes no system call, so the whole policy runs under Miri and loom, and
//! large-scale bookkeeping benches do not need real memory. Chunk memory is
//! allocated lazily, a 4 KiB page at its first write, so a million untouched
//! chunks cost nothing and a chunk written in a few places costs a few pages.
//!
//! Streams: by default the mock, like the host, has none (`record_event`
//! returns `None`: freed memory is reusable at once). [`MockDriver::with_streams`]
//! gives it events that complete only when a test says so
//! ([`MockDriver::complete_event`], [`MockDriver::complete_all_events`]) or
//! when the arena waits for one (`wait_event`, which models the device
//! finishing that stream's work), so tests can check the ordering rules of
//! stream-ordered frees.
//!
//! Queued work: [`MockDriver::enqueue_write`] queues a device write on a
//! stream, behind the events recorded there before it. It runs when the
//! device gets past it (an event recorded after it completes, or
//! [`MockDriver::complete_stream`]), through the mappings in place *then*,
//! as a kernel writes through virtual addresses when it runs. A queued
//! write that finds its address unmapped is a device fault, counted in
//! [`MockDriver::faults`]; one that lands in memory a later owner uses
//! shows as that owner's bytes changing. Tests use it to check that reused
//! memory is never written by its old owner's queued work.

use std::collections::HashMap;

use super::rules::Rules;
use super::{ChunkHandle, Driver, Granularity};
use crate::error::{Error, Result};
use crate::sync::Mutex;

/// In-memory driver.
#[derive(Debug)]
pub struct MockDriver {
    granularity: u64,
    total: u64,
    inner: Mutex<MockState>,
}

#[derive(Debug, Default)]
struct MockState {
    rules: Rules,
    next_va: u64,
    next_handle: u64,
    /// Chunk contents, created on first write; absent means all zeroes.
    data: HashMap<ChunkHandle, ChunkData>,
    /// Whether `record_event` makes events (see [`MockDriver::with_streams`]).
    streams: bool,
    next_event: u64,
    /// Live events: id -> (stream, completed).
    events: std::collections::BTreeMap<u64, (u64, bool)>,
    events_waited: u64,
    /// Work queued per stream, in stream order (see the module doc).
    queues: HashMap<u64, std::collections::VecDeque<Work>>,
    /// Queued writes that found their address unmapped when they ran.
    faults: Vec<String>,
}

/// Bytes of a page of chunk contents, allocated at its first write.
const DATA_PAGE: usize = 4096;

/// One chunk's contents: pages allocated at their first write; a page
/// never written reads as zeroes.
#[derive(Debug)]
struct ChunkData {
    size: usize,
    pages: Vec<Option<Box<[u8]>>>,
}

impl ChunkData {
    fn new(size: usize) -> ChunkData {
        ChunkData { size, pages: (0..size.div_ceil(DATA_PAGE)).map(|_| None).collect() }
    }

    /// The pieces of `off..off + len` in each page: (page, offset in it, bytes).
    fn pieces(off: usize, len: usize) -> impl Iterator<Item = (usize, usize, usize)> {
        let mut at = off;
        let end = off + len;
        std::iter::from_fn(move || {
            (at < end).then(|| {
                let (page, in_page) = (at / DATA_PAGE, at % DATA_PAGE);
                let n = (DATA_PAGE - in_page).min(end - at);
                at += n;
                (page, in_page, n)
            })
        })
    }

    fn read(&self, off: usize, dst: &mut [u8]) {
        let mut at = 0;
        for (page, in_page, n) in Self::pieces(off, dst.len()) {
            match &self.pages[page] {
                Some(p) => dst[at..at + n].copy_from_slice(&p[in_page..in_page + n]),
                None => dst[at..at + n].fill(0),
            }
            at += n;
        }
    }

    fn write(&mut self, off: usize, src: &[u8]) {
        let mut at = 0;
        for (page, in_page, n) in Self::pieces(off, src.len()) {
            let len = DATA_PAGE.min(self.size - page * DATA_PAGE);
            let p = self.pages[page].get_or_insert_with(|| vec![0; len].into_boxed_slice());
            p[in_page..in_page + n].copy_from_slice(&src[at..at + n]);
            at += n;
        }
    }
}

/// One item of a stream's queue.
#[derive(Debug)]
enum Work {
    Write { addr: u64, bytes: Vec<u8> },
    Event(u64),
}

impl MockDriver {
    /// A mock device with the given granularity and total memory.
    pub fn new(granularity: u64, total_memory: u64) -> MockDriver {
        MockDriver {
            granularity,
            total: total_memory,
            inner: Mutex::new(MockState {
                rules: Rules::new(granularity),
                next_va: 0x1000_0000_0000,
                next_handle: 1,
                data: HashMap::new(),
                streams: false,
                next_event: 1,
                events: Default::default(),
                events_waited: 0,
                queues: HashMap::new(),
                faults: Vec::new(),
            }),
        }
    }

    /// A mock device whose streams are asynchronous: every recorded event
    /// stays incomplete until [`MockDriver::complete_event`] (or
    /// `wait_event`) completes it.
    pub fn with_streams(granularity: u64, total_memory: u64) -> MockDriver {
        let d = MockDriver::new(granularity, total_memory);
        if let Ok(mut s) = d.state() {
            s.streams = true;
        }
        d
    }

    /// The same mock, refusing an unmap that spans several separate
    /// mappings (the strict reading of `cuMemUnmap`; a real driver may
    /// read it so).
    pub fn with_strict_unmap(self) -> MockDriver {
        if let Ok(mut s) = self.state() {
            s.rules.set_strict_unmap();
        }
        self
    }

    /// Completes one recorded event (the device got past it); false if it
    /// is unknown (never recorded, or destroyed).
    pub fn complete_event(&self, event: u64) -> bool {
        match self.state() {
            Ok(mut s) => match s.events.get_mut(&event) {
                Some(e) => {
                    e.1 = true;
                    let stream = e.0;
                    s.run_queue(stream, Some(event));
                    true
                }
                None => false,
            },
            Err(_) => false,
        }
    }

    /// Queues a device write of `bytes` at `addr` on `stream` (see the
    /// module doc); without streams it runs at once.
    pub fn enqueue_write(&self, stream: u64, addr: u64, bytes: &[u8]) -> Result<()> {
        let mut s = self.state()?;
        if !s.streams {
            return s.write_now(addr, bytes);
        }
        s.queues.entry(stream).or_default().push_back(Work::Write { addr, bytes: bytes.to_vec() });
        Ok(())
    }

    /// Queued writes that found their address unmapped when they ran.
    pub fn faults(&self) -> Vec<String> {
        self.state().map(|s| s.faults.clone()).unwrap_or_default()
    }

    /// Completes every event recorded on `stream` so far.
    pub fn complete_stream(&self, stream: u64) {
        if let Ok(mut s) = self.state() {
            for e in s.events.values_mut().filter(|e| e.0 == stream) {
                e.1 = true;
            }
            s.run_queue(stream, None);
        }
    }

    /// Completes every recorded event.
    pub fn complete_all_events(&self) {
        if let Ok(mut s) = self.state() {
            for e in s.events.values_mut() {
                e.1 = true;
            }
            let streams: Vec<u64> = s.queues.keys().copied().collect();
            for stream in streams {
                s.run_queue(stream, None);
            }
        }
    }

    /// Live (recorded, not destroyed) events, oldest first, with whether
    /// each has completed.
    pub fn events(&self) -> Vec<(u64, bool)> {
        self.state().map(|s| s.events.iter().map(|(&id, &(_, done))| (id, done)).collect()).unwrap_or_default()
    }

    /// How many times `wait_event` was called.
    pub fn events_waited(&self) -> u64 {
        self.state().map(|s| s.events_waited).unwrap_or(0)
    }

    fn state(&self) -> Result<crate::sync::MutexGuard<'_, MockState>> {
        self.inner.lock().map_err(|_| Error::Internal("mock driver lock poisoned".into()))
    }

    /// Chunks created and not yet released.
    pub fn live_chunks(&self) -> usize {
        self.state().map(|s| s.rules.live_chunks()).unwrap_or(0)
    }

    /// Reservations not yet freed.
    pub fn live_reservations(&self) -> usize {
        self.state().map(|s| s.rules.live_reservations()).unwrap_or(0)
    }

    /// Mappings currently in place.
    pub fn live_mappings(&self) -> usize {
        self.state().map(|s| s.rules.live_mappings()).unwrap_or(0)
    }

    /// Chunks released while still mapped somewhere (their memory lives
    /// until the last unmap).
    pub fn released_but_mapped(&self) -> usize {
        self.state().map(|s| s.rules.released_but_mapped()).unwrap_or(0)
    }
}

impl MockState {
    /// Runs `stream`'s queued work up to `until` (that event included), or
    /// all of it.
    fn run_queue(&mut self, stream: u64, until: Option<u64>) {
        let Some(mut q) = self.queues.remove(&stream) else { return };
        while let Some(w) = q.pop_front() {
            match w {
                Work::Write { addr, bytes } => {
                    if let Err(e) = self.write_now(addr, &bytes) {
                        self.faults.push(format!("stream {stream}: queued write at {addr:#x}: {e}"));
                    }
                }
                Work::Event(e) if Some(e) == until => break,
                Work::Event(_) => {}
            }
        }
        if !q.is_empty() {
            self.queues.insert(stream, q);
        }
    }

    fn write_now(&mut self, addr: u64, src: &[u8]) -> Result<()> {
        let pieces = self.rules.resolve("write", addr, src.len() as u64)?;
        let mut at = 0usize;
        for (h, off, len) in pieces {
            let len = len as usize;
            let size = self.rules.chunk_size(h).unwrap_or(0) as usize;
            let d = self.data.entry(h).or_insert_with(|| ChunkData::new(size));
            d.write(off as usize, &src[at..at + len]);
            at += len;
        }
        Ok(())
    }
}

impl Driver for MockDriver {
    fn name(&self) -> &'static str {
        "mock"
    }

    fn granularity(&self) -> Result<Granularity> {
        Ok(Granularity { minimum: self.granularity, recommended: self.granularity })
    }

    fn total_memory(&self) -> Result<u64> {
        Ok(self.total)
    }

    fn reserve(&self, size: u64, align: u64) -> Result<u64> {
        let mut s = self.state()?;
        s.rules.check_reserve(size, align)?;
        let align = align.max(self.granularity);
        let base = s.next_va.div_ceil(align) * align;
        let end = base.checked_add(size).ok_or_else(|| Error::OutOfMemory("mock VA exhausted".into()))?;
        // Leave a guard gap between reservations, as a real address space would.
        s.next_va = end + self.granularity;
        s.rules.add_reservation(base, size);
        Ok(base)
    }

    fn free_reservation(&self, base: u64, size: u64) -> Result<()> {
        let mut s = self.state()?;
        s.rules.check_free_reservation(base, size)?;
        s.rules.remove_reservation(base);
        Ok(())
    }

    fn create(&self, size: u64) -> Result<ChunkHandle> {
        let mut s = self.state()?;
        s.rules.check_create(size)?;
        let h = ChunkHandle(s.next_handle);
        s.next_handle += 1;
        s.rules.add_chunk(h, size);
        Ok(h)
    }

    fn release(&self, chunk: ChunkHandle) -> Result<()> {
        let mut s = self.state()?;
        if s.rules.release(chunk)? {
            s.data.remove(&chunk);
        }
        Ok(())
    }

    fn map(&self, addr: u64, size: u64, chunk: ChunkHandle, offset: u64) -> Result<()> {
        let mut s = self.state()?;
        s.rules.check_map(addr, size, chunk, offset)?;
        s.rules.add_mapping(addr, size, chunk, offset);
        Ok(())
    }

    fn set_access(&self, addr: u64, size: u64) -> Result<()> {
        let mut s = self.state()?;
        s.rules.check_set_access(addr, size)?;
        s.rules.set_access(addr, size);
        Ok(())
    }

    fn unmap(&self, addr: u64, size: u64) -> Result<()> {
        let mut s = self.state()?;
        s.rules.check_unmap(addr, size)?;
        for (h, _) in s.rules.unmap(addr, size).freed_chunks {
            s.data.remove(&h);
        }
        Ok(())
    }

    fn synchronize(&self) -> Result<()> {
        // The device drains: every queued write runs (events stay as the
        // test set them, so that tests of event order keep control).
        let mut s = self.state()?;
        let streams: Vec<u64> = s.queues.keys().copied().collect();
        for stream in streams {
            s.run_queue(stream, None);
        }
        Ok(())
    }

    fn read(&self, addr: u64, dst: &mut [u8]) -> Result<()> {
        let s = self.state()?;
        let mut at = 0usize;
        for (h, off, len) in s.rules.resolve("read", addr, dst.len() as u64)? {
            let len = len as usize;
            match s.data.get(&h) {
                Some(d) => d.read(off as usize, &mut dst[at..at + len]),
                None => dst[at..at + len].fill(0),
            }
            at += len;
        }
        Ok(())
    }

    fn write(&self, addr: u64, src: &[u8]) -> Result<()> {
        self.state()?.write_now(addr, src)
    }

    fn copy(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        let mut buf = vec![0u8; len as usize];
        self.read(src, &mut buf)?;
        self.write(dst, &buf)
    }

    fn record_event(&self, stream: u64) -> Result<Option<u64>> {
        let mut s = self.state()?;
        if !s.streams {
            return Ok(None);
        }
        let id = s.next_event;
        s.next_event += 1;
        s.events.insert(id, (stream, false));
        s.queues.entry(stream).or_default().push_back(Work::Event(id));
        Ok(Some(id))
    }

    fn event_complete(&self, event: u64) -> Result<bool> {
        let s = self.state()?;
        match s.events.get(&event) {
            Some(&(_, done)) => Ok(done),
            None if !s.streams => Ok(true),
            None => Err(Error::invalid(format!("event {event} is unknown or destroyed"))),
        }
    }

    fn wait_event(&self, event: u64) -> Result<()> {
        let mut s = self.state()?;
        s.events_waited += 1;
        let streams = s.streams;
        match s.events.get_mut(&event) {
            Some(e) => {
                e.1 = true;
                let stream = e.0;
                s.run_queue(stream, Some(event));
                Ok(())
            }
            None if !streams => Ok(()),
            None => Err(Error::invalid(format!("event {event} is unknown or destroyed"))),
        }
    }

    fn destroy_event(&self, event: u64) -> Result<()> {
        let mut s = self.state()?;
        match s.events.remove(&event) {
            Some(_) => Ok(()),
            None if !s.streams => Ok(()),
            None => Err(Error::invalid(format!("event {event} is unknown or destroyed"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_chunk_at_two_addresses_shows_same_bytes() {
        let d = MockDriver::new(4096, 1 << 30);
        let base = d.reserve(8 * 4096, 4096).unwrap();
        let c = d.create(2 * 4096).unwrap();
        d.map(base, 2 * 4096, c, 0).unwrap();
        d.map(base + 4 * 4096, 2 * 4096, c, 0).unwrap();
        d.set_access(base, 2 * 4096).unwrap();
        d.set_access(base + 4 * 4096, 2 * 4096).unwrap();
        d.write(base + 100, b"hello").unwrap();
        let mut out = [0u8; 5];
        d.read(base + 4 * 4096 + 100, &mut out).unwrap();
        assert_eq!(&out, b"hello");
        d.release(c).unwrap();
        d.read(base + 100, &mut out).unwrap();
        assert_eq!(&out, b"hello", "released while mapped: memory lives");
        d.unmap(base, 2 * 4096).unwrap();
        d.unmap(base + 4 * 4096, 2 * 4096).unwrap();
        assert_eq!((d.live_chunks(), d.live_mappings()), (0, 0));
        d.free_reservation(base, 8 * 4096).unwrap();
    }

    #[test]
    fn chunk_data_crosses_pages_and_reads_zeroes_where_unwritten() {
        // A size that is not a whole number of pages: the last page is short.
        let size = 3 * DATA_PAGE + 100;
        let mut c = ChunkData::new(size);
        let src: Vec<u8> = (0..2 * DATA_PAGE + 7).map(|i| (i % 251 + 1) as u8).collect();
        c.write(DATA_PAGE - 3, &src);
        c.write(size - 5, b"tail!");
        assert!(c.pages[0].is_some() && c.pages[3].as_ref().unwrap().len() == 100);
        let mut all = vec![0xAA; size];
        c.read(0, &mut all);
        let mut want = vec![0u8; size];
        want[DATA_PAGE - 3..DATA_PAGE - 3 + src.len()].copy_from_slice(&src);
        want[size - 5..].copy_from_slice(b"tail!");
        assert_eq!(all, want);
        let fresh = ChunkData::new(size);
        let mut out = [0xAAu8; 9];
        fresh.read(DATA_PAGE - 4, &mut out);
        assert_eq!(out, [0; 9], "an unwritten page reads as zeroes");
    }
}
