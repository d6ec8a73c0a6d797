//! The model of open DMA-BUF handles that the property test
//! (`tests/dmabuf_model.rs`) and the `ops` fuzz target (its DMA-BUF inputs,
//! `fuzz/logic/ops.rs`) share. The arena runs on the host backend's
//! DMA-BUF stand-in (`HostDriver::with_dmabuf_standin`: a descriptor that
//! reaches the chunks behind the range, as `cuMemGetHandleForAddressRange`'s
//! does) under a `FaultDriver`, so any operation may be given an injected
//! driver failure.
//!
//! What each open DMA-BUF must reach, checked after every operation:
//! - while its allocation lives, exactly the allocation's bytes (it reaches
//!   the same chunks, which never move, sleep or shrink below it while it is
//!   open), and a write through it is seen through the allocation; the
//!   allocation is pinned and awake;
//! - once its allocation is freed (plainly or by a committed `prepare_free`),
//!   the bytes it had at the free, whatever later allocations write (its
//!   chunks are never pooled or reused), and a write through it changes no
//!   live allocation;
//! - every live allocation's own bytes survive every operation;
//! - two-phase operations: after a successful prepare and no other call,
//!   commit and abort succeed whatever driver call fails; a prepared shrink
//!   below a DMA-BUF's chunks is refused at the prepare, not at the commit;
//! - an operation whose injected failure fired returns that failure and
//!   leaves the arena exactly as it was (its snapshot, driver counters
//!   aside), unless chunks of a freed allocation may be held for a later
//!   call (its last DMA-BUF closed, or a committed free of an allocation
//!   that had one could not give them back at once): the first call after
//!   that gives them back, also one that then fails;
//! - when every DMA-BUF is closed and everything freed and trimmed, the
//!   arena and the driver hold no chunk and no mapping.
//!
//! Each operation also runs the debug build's audit of who holds each chunk
//! (`arena/holds.rs`).

#![allow(dead_code)] // each includer uses what it needs

use std::sync::Arc;

use super::common::{Range, Snap};
use vmm_arena::driver::fault::{FaultDriver, FaultKind};
use vmm_arena::driver::host::HostDriver;
use vmm_arena::driver::Driver;
use vmm_arena::{Arena, ArenaConfig, DmaBuf, Id, Status, SLEEP_BACKUP};

/// The chunk size.
pub const C: u64 = 64 << 10;

#[derive(Clone, Debug)]
pub enum DmaOp {
    /// Whole chunks.
    Alloc(u64),
    /// A small allocation (a slab's: no DMA-BUF of it).
    AllocSmall(u64),
    AllocGrowable(u64, u64),
    Free(usize),
    Resize(usize, u64),
    Open(usize),
    Close(usize),
    WriteThrough(usize, u8),
    Stamp(usize, u8),
    Sleep(bool),
    Wake,
    Compact,
    Trim,
    ReleaseRetired,
    /// `prepare_resize` of the `n`th allocation to the size, then `commit`
    /// (true) or `abort` at once.
    PrepareResize(usize, u64, bool),
    /// `prepare_free` of the `n`th allocation, then `commit` or `abort`.
    PrepareFree(usize, bool),
    /// The `n`th driver call of the operation fails with the fault.
    Faulty(u64, FaultKind, Box<DmaOp>),
}

struct Open {
    buf: DmaBuf,
    /// The allocation it was made of, while it lives.
    id: Option<Id>,
    /// The allocation it was made of (DMA-BUFs of one reach the same chunks).
    origin: Id,
    /// What it must read once its allocation is freed.
    frozen: Vec<u8>,
}

pub struct DmaHarness {
    host: Arc<HostDriver>,
    fd: Arc<FaultDriver<Arc<dyn Driver>>>,
    a: Arena,
    /// Live allocations and their bytes (what the arena must read; empty
    /// after a sleep without a backup until stamped again).
    live: Vec<(Id, Vec<u8>)>,
    open: Vec<Open>,
    asleep: bool,
    /// Chunks of a freed allocation may be held for a later call to give
    /// back (its last DMA-BUF closed, or a committed free of an allocation
    /// that had one could not give them back at once; see the module
    /// docs), until a call that reaps them succeeds with no injected
    /// failure.
    maybe_held: bool,
    /// Allocations that had a DMA-BUF (exported until freed).
    had_dmabuf: std::collections::HashSet<Id>,
    /// The injected failure planned for the current operation.
    fault: Option<(u64, FaultKind)>,
    /// A planned failure the operation's first call did not reach: a
    /// two-phase operation arms it again for its commit or abort.
    unfired: Option<(u64, FaultKind)>,
    /// Outcome counters: what a run reached.
    pub reached: std::collections::BTreeMap<&'static str, u64>,
}

fn fill(seed: u8, len: u64) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i * 7 % 253) as u8)).collect()
}

fn status_of(kind: FaultKind) -> Status {
    match kind {
        FaultKind::OutOfMemory => Status::OutOfMemory,
        FaultKind::Driver => Status::Driver,
    }
}

impl DmaHarness {
    /// An arena of `cap` chunks over `reserve` chunks of address space,
    /// keeping up to `retain` chunks pooled.
    pub fn new(cap: u64, reserve: u64, retain: u64) -> DmaHarness {
        let host = Arc::new(HostDriver::new().expect("host driver").with_dmabuf_standin());
        let inner: Arc<dyn Driver> = host.clone();
        let fd = Arc::new(FaultDriver::new(inner));
        let cfg = ArenaConfig {
            capacity_bytes: cap * C,
            reserve_bytes: reserve * C,
            chunk_bytes: C,
            retain_bytes: retain * C,
            ..ArenaConfig::default()
        };
        let a = Arena::with_driver(fd.clone(), cfg).expect("arena");
        DmaHarness {
            host,
            fd,
            a,
            live: Vec::new(),
            open: Vec::new(),
            asleep: false,
            maybe_held: false,
            had_dmabuf: Default::default(),
            fault: None,
            unfired: None,
            reached: Default::default(),
        }
    }

    fn count(&mut self, what: &'static str) {
        *self.reached.entry(what).or_default() += 1;
    }

    fn nth(&self, i: usize) -> Option<usize> {
        (!self.live.is_empty()).then(|| i % self.live.len())
    }

    fn dma_read(&self, o: &Open) -> Vec<u8> {
        let mut got = vec![0u8; o.buf.bytes() as usize];
        self.host.standin_dmabuf_read(o.buf.fd(), 0, &mut got).expect("stand-in read");
        got
    }

    /// Runs the operation's one arena call with the planned failure, if
    /// any, and judges a failure that fired. `None`: the call failed with
    /// the injected failure and left the arena as it was.
    fn call<T>(&mut self, what: &str, f: impl FnOnce(&Arena) -> vmm_arena::Result<T>) -> Option<vmm_arena::Result<T>> {
        let reap_possible = self.maybe_held;
        // Calls that give held chunks back first (documented: alloc, free,
        // resize, trim...), which succeed on the host without a failure.
        let reaps = matches!(what, "alloc" | "alloc_growable" | "free" | "resize" | "trim");
        let Some((n, kind)) = self.fault.take() else {
            let r = f(&self.a);
            if reaps && r.is_ok() {
                self.maybe_held = false;
            }
            return Some(r);
        };
        let pre = Snap::of(&self.a).without_driver_counters();
        let failures0 = self.a.stats().unwrap().release_failures;
        self.fd.fail_nth(None, n, kind);
        let r = f(&self.a);
        let fired = !self.fd.pending();
        self.fd.clear();
        if !fired {
            self.unfired = Some((n, kind));
            self.count("fault planned beyond the operation's calls");
            if reaps && r.is_ok() {
                self.maybe_held = false;
            }
            return Some(r);
        }
        match r {
            Ok(v) => {
                // Only a give-back may fail without failing the call: a
                // pool's (counted) or a held DMA-BUF free's (retried).
                let failures = self.a.stats().unwrap().release_failures;
                assert!(
                    failures > failures0 || reap_possible,
                    "{what}: an injected failure fired, the call succeeded and nothing counts it"
                );
                self.count("fault absorbed by a give-back");
                Some(Ok(v))
            }
            Err(e) => {
                assert_eq!(e.status(), status_of(kind), "{what}: the call fails with the injected failure: {e}");
                if reap_possible {
                    self.count("fault fired after a reap was due");
                } else if what == "trim" {
                    // Documented: what it released stays released (retired
                    // small objects of a slab given back included); no
                    // allocation changes.
                    let now = Snap::of(&self.a).without_driver_counters();
                    let live =
                        |s: &Snap| s.live().map(|r| Range { pooled_mapped_bytes: 0, ..r.clone() }).collect::<Vec<_>>();
                    assert_eq!(live(&now), live(&pre), "trim: a failed trim changed an allocation");
                    assert!(now.stats["pooled_bytes"] <= pre.stats["pooled_bytes"], "trim: a failed trim pooled more");
                    self.count("trim failed by a fault");
                } else {
                    let now = Snap::of(&self.a).without_driver_counters();
                    assert_eq!(now, pre, "{what}: a failed call changed the arena");
                    self.count("operation rolled back after a fault");
                }
                None
            }
        }
    }

    pub fn apply(&mut self, op: &DmaOp) {
        match op {
            DmaOp::Faulty(n, kind, inner) => {
                self.fault = Some((*n, *kind));
                self.apply(inner);
                self.fault = None;
                self.unfired = None;
                return;
            }
            &DmaOp::Alloc(size) => self.alloc(size, None),
            &DmaOp::AllocSmall(size) => self.alloc(size, None),
            &DmaOp::AllocGrowable(size, max) => self.alloc(size, Some(max)),
            &DmaOp::Free(i) => {
                let Some(k) = self.nth(i) else { return };
                let id = self.live[k].0;
                if let Some(r) = self.call("free", |a| a.free(id)) {
                    r.unwrap_or_else(|e| panic!("free of live {id}: {e}"));
                    self.freed(k);
                }
            }
            &DmaOp::Resize(i, size) => {
                let Some(k) = self.nth(i) else { return };
                let id = self.live[k].0;
                if let Some(Ok(_)) = self.call("resize", |a| a.resize(id, size)) {
                    self.resized(k, size);
                }
            }
            &DmaOp::PrepareResize(i, size, commit) => {
                let Some(k) = self.nth(i) else { return };
                let id = self.live[k].0;
                let Some(Ok((p, _))) = self.call("prepare_resize", |a| a.prepare_resize(id, size)) else { return };
                // Nothing else ran on it: commit and abort cannot fail, for
                // memory or a driver call (the fault may still be armed).
                self.settle(p, commit);
                if commit {
                    self.resized(k, size);
                }
                self.count(if commit { "prepared resize committed" } else { "prepared resize aborted" });
            }
            &DmaOp::PrepareFree(i, commit) => {
                let Some(k) = self.nth(i) else { return };
                let id = self.live[k].0;
                let Some(Ok(p)) = self.call("prepare_free", |a| a.prepare_free(id)) else { return };
                self.settle(p, commit);
                if commit {
                    // Its chunks may be held for a later call to give back.
                    self.maybe_held |= self.had_dmabuf.contains(&id);
                    self.freed(k);
                }
                self.count(if commit { "prepared free committed" } else { "prepared free aborted" });
            }
            &DmaOp::Open(i) => {
                let Some(k) = self.nth(i) else { return };
                let id = self.live[k].0;
                let info = self.a.query(id).unwrap();
                let Some(r) = self.call("dmabuf", |a| a.dmabuf(id)) else { return };
                match r {
                    Ok(buf) => {
                        assert!(!info.asleep, "a DMA-BUF of a sleeping allocation");
                        assert_eq!(buf.bytes(), info.size.div_ceil(C) * C, "a DMA-BUF spans the backed chunks");
                        self.open.push(Open { buf, id: Some(id), origin: id, frozen: Vec::new() });
                        self.had_dmabuf.insert(id);
                        self.count("dmabuf opened");
                    }
                    Err(e) => {
                        // Small allocations' ids have the top bit set.
                        let small = id.get() >> 63 == 1;
                        assert!(info.asleep || small, "a DMA-BUF of an awake allocation of whole chunks refused: {e}");
                        self.count("dmabuf refused");
                    }
                }
            }
            &DmaOp::Close(j) => {
                if self.open.is_empty() {
                    return;
                }
                let n = self.open.len();
                let o = self.open.remove(j % n);
                let last_of_freed = o.id.is_none() && !self.open.iter().any(|x| x.origin == o.origin);
                drop(o);
                if last_of_freed {
                    self.maybe_held = true;
                    self.count("last dmabuf of a freed allocation closed");
                }
            }
            &DmaOp::WriteThrough(j, seed) => {
                if self.open.is_empty() {
                    return;
                }
                let n = self.open.len();
                let o = &self.open[j % n];
                let (id, origin) = (o.id, o.origin);
                let bytes = fill(seed, o.buf.bytes());
                self.host.standin_dmabuf_write(o.buf.fd(), 0, &bytes).unwrap();
                match id {
                    Some(id) => {
                        let m = &mut self.live.iter_mut().find(|(x, _)| *x == id).expect("live").1;
                        let k = m.len().min(bytes.len());
                        m[..k].copy_from_slice(&bytes[..k]);
                    }
                    // Every DMA-BUF of the freed allocation sees the write.
                    None => {
                        for other in self.open.iter_mut().filter(|x| x.origin == origin) {
                            let k = other.frozen.len().min(bytes.len());
                            other.frozen[..k].copy_from_slice(&bytes[..k]);
                        }
                    }
                }
            }
            &DmaOp::Stamp(i, seed) => {
                let Some(k) = self.nth(i) else { return };
                let (id, bytes) = &mut self.live[k];
                if self.a.query(*id).unwrap().asleep {
                    return;
                }
                *bytes = fill(seed, bytes.len() as u64);
                self.a.write(*id, 0, bytes).unwrap();
            }
            &DmaOp::Sleep(backup) => {
                if self.asleep {
                    return;
                }
                let flags = if backup { SLEEP_BACKUP } else { 0 };
                if let Some(r) = self.call("sleep", |a| a.sleep(1, flags)) {
                    r.unwrap_or_else(|e| panic!("sleep: {e}"));
                    self.asleep = true;
                    if !backup {
                        // Contents of the sleepers are lost; those with a
                        // DMA-BUF (exported) stayed awake.
                        for (id, bytes) in self.live.iter_mut() {
                            if self.a.query(*id).unwrap().asleep {
                                bytes.clear();
                            }
                        }
                    }
                }
            }
            DmaOp::Wake => {
                if !self.asleep {
                    return;
                }
                if let Some(r) = self.call("wake", |a| a.wake(1)) {
                    // Allocations made while others slept may hold the
                    // capacity the sleepers need.
                    if let Err(e) = r {
                        assert_eq!(e.status(), Status::OutOfMemory, "wake: {e}");
                        self.count("wake refused for memory");
                        return self.check(op);
                    }
                    self.asleep = false;
                    for (id, bytes) in self.live.iter_mut() {
                        if bytes.is_empty() {
                            // Lost in a sleep without backup: stamp again.
                            let size = self.a.query(*id).unwrap().size;
                            *bytes = fill(0x33, size);
                            self.a.write(*id, 0, bytes).unwrap();
                        }
                    }
                }
            }
            DmaOp::Compact => drop(self.call("compact", |a| a.compact())),
            DmaOp::Trim => drop(self.call("trim", |a| a.trim(0))),
            DmaOp::ReleaseRetired => drop(self.call("release_retired", |a| a.release_retired())),
        }
        // Every allocation sleeps and wakes with tag 1.
        for (id, _) in &self.live {
            let _ = self.a.set_tag(*id, 1);
        }
        self.check(op);
    }

    fn alloc(&mut self, size: u64, max: Option<u64>) {
        let r = match max {
            Some(m) => self.call("alloc_growable", |a| a.alloc_growable(size, m)),
            None => self.call("alloc", |a| a.alloc(size)),
        };
        if let Some(Ok((id, _))) = r {
            let bytes = fill(self.live.len() as u8 ^ 0x5A, size);
            self.a.write(id, 0, &bytes).unwrap();
            self.live.push((id, bytes));
        }
    }

    /// Commit or abort of a prepared operation nothing else touched.
    fn settle(&mut self, p: vmm_arena::Prepared, commit: bool) {
        // The failure planned for the operation stays armed through it.
        if let Some((n, kind)) = self.unfired.take() {
            self.fd.fail_nth(None, n, kind);
        }
        let r = if commit { self.a.commit(p) } else { self.a.abort(p) };
        self.fd.clear();
        r.unwrap_or_else(|e| {
            panic!("{} of an untouched prepared operation failed: {e}", ["abort", "commit"][commit as usize])
        });
    }

    /// The model of a successful free of the `k`th live allocation.
    fn freed(&mut self, k: usize) {
        let (id, bytes) = self.live.remove(k);
        for o in self.open.iter_mut().filter(|o| o.id == Some(id)) {
            // It keeps what the allocation held (its first `size` bytes as
            // the model knows them; past them, what the DMA-BUF reads now).
            let mut now = vec![0u8; o.buf.bytes() as usize];
            self.host.standin_dmabuf_read(o.buf.fd(), 0, &mut now).unwrap();
            let n = bytes.len().min(now.len());
            assert_eq!(&now[..n], &bytes[..n], "a DMA-BUF did not read its allocation's bytes at the free");
            o.frozen = now;
            o.id = None;
        }
    }

    /// The model of a successful resize of the `k`th live allocation.
    fn resized(&mut self, k: usize, size: u64) {
        let id = self.live[k].0;
        let bytes = &mut self.live[k].1;
        if bytes.is_empty() {
            return; // asleep without a backup: stamped again on wake
        }
        let old = bytes.len();
        bytes.truncate(size as usize);
        if size as usize > old {
            let more = fill(old as u8, size - old as u64);
            self.a.write(id, old as u64, &more).unwrap();
            bytes.extend(more);
        }
    }

    fn check(&self, op: &DmaOp) {
        for (id, bytes) in &self.live {
            let info = self.a.query(*id).unwrap();
            if info.asleep || bytes.is_empty() {
                continue;
            }
            assert_eq!(info.size as usize, bytes.len(), "after {op:?}: the size of {id}");
            let mut got = vec![0u8; bytes.len()];
            self.a.read(*id, 0, &mut got).unwrap();
            assert!(got == *bytes, "after {op:?}: the bytes of {id} changed");
        }
        for o in &self.open {
            let now = self.dma_read(o);
            match o.id {
                Some(id) => {
                    let info = self.a.query(id).unwrap();
                    assert!(!info.asleep, "after {op:?}: an allocation with an open DMA-BUF is asleep");
                    assert!(info.pinned, "after {op:?}: an allocation with an open DMA-BUF is not pinned");
                    let m = &self.live.iter().find(|(x, _)| *x == id).expect("live").1;
                    let n = m.len().min(now.len());
                    assert!(now[..n] == m[..n], "after {op:?}: a DMA-BUF does not read its allocation's bytes");
                }
                None => assert!(now == o.frozen, "after {op:?}: a freed allocation's DMA-BUF reads other bytes"),
            }
        }
    }

    /// Closes every DMA-BUF, frees everything, releases and trims: the arena
    /// and the driver hold nothing.
    pub fn teardown(mut self) {
        self.open.clear();
        // (A sleeper's free drops it, backup included.)
        for (id, _) in std::mem::take(&mut self.live) {
            self.a.free(id).unwrap();
        }
        self.a.release_retired().unwrap();
        self.a.trim(0).unwrap();
        let s = self.a.stats().unwrap();
        assert_eq!((s.mapped_bytes, s.pooled_bytes), (0, 0), "held after every DMA-BUF closed and everything freed");
        assert_eq!((self.fd.live_chunks(), self.fd.live_mappings()), (0, 0), "teardown leaves nothing on the driver");
        let host = self.host.clone();
        drop(self);
        assert_eq!(host.live_chunks(), 0, "the driver still holds chunks");
    }
}
