//! Property test: DMA-BUF handles (on the host backend's stand-in) opened
//! and closed among random allocs, frees, resizes, sleeps and wakes,
//! compactions, trims and releases of retired memory, against a simple
//! model of what each open DMA-BUF must reach:
//! - while its allocation lives, a DMA-BUF reads exactly the allocation's
//!   bytes (it reaches the same chunks, which never move, sleep or shrink
//!   below it while it is open), and a write through it is seen through
//!   the allocation;
//! - once its allocation is freed, it keeps reading the bytes it had at the
//!   free, whatever the next allocations write (its chunks are never
//!   pooled or reused), and a write through it changes no live allocation;
//! - every allocation's own bytes (stamped through the arena) survive every
//!   operation;
//! - when every DMA-BUF is closed and everything freed and trimmed, the
//!   driver holds no chunk and no mapping.
//!
//! Each operation also runs the debug build's audit of who holds each chunk
//! (`arena/holds.rs`).

use std::sync::Arc;

use proptest::prelude::*;
use vmm_arena::driver::host::HostDriver;
use vmm_arena::{Arena, ArenaConfig, DmaBuf, Id, SLEEP_BACKUP};

const C: u64 = 64 << 10;

#[derive(Clone, Debug)]
enum Op {
    Alloc(u64),
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
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (1..=4u64).prop_map(|p| Op::Alloc(p * C)),
        2 => (1..=3u64, 0..=4u64).prop_map(|(p, e)| Op::AllocGrowable(p * C, (p + e) * C)),
        3 => any::<usize>().prop_map(Op::Free),
        3 => (any::<usize>(), 1..=6u64).prop_map(|(i, p)| Op::Resize(i, p * C)),
        3 => any::<usize>().prop_map(Op::Open),
        2 => any::<usize>().prop_map(Op::Close),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(i, s)| Op::WriteThrough(i, s)),
        2 => (any::<usize>(), any::<u8>()).prop_map(|(i, s)| Op::Stamp(i, s)),
        1 => any::<bool>().prop_map(Op::Sleep),
        1 => Just(Op::Wake),
        1 => Just(Op::Compact),
        1 => Just(Op::Trim),
        1 => Just(Op::ReleaseRetired),
    ]
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

struct Model {
    d: Arc<HostDriver>,
    a: Arena,
    /// Live allocations and their bytes (what the arena must read).
    live: Vec<(Id, Vec<u8>)>,
    open: Vec<Open>,
    asleep: bool,
}

fn fill(seed: u8, len: u64) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i * 7 % 253) as u8)).collect()
}

impl Model {
    fn nth(&self, i: usize) -> Option<usize> {
        (!self.live.is_empty()).then(|| i % self.live.len())
    }

    fn dma_read(&self, o: &Open) -> Vec<u8> {
        let mut got = vec![0u8; o.buf.bytes() as usize];
        self.d.standin_dmabuf_read(o.buf.fd(), 0, &mut got).unwrap();
        got
    }

    fn apply(&mut self, op: &Op) {
        let a = &self.a;
        match *op {
            Op::Alloc(size) | Op::AllocGrowable(size, _) => {
                let r = match *op {
                    Op::AllocGrowable(s, m) => a.alloc_growable(s, m),
                    _ => a.alloc(size),
                };
                if let Ok((id, _)) = r {
                    let bytes = fill(self.live.len() as u8 ^ 0x5A, size);
                    a.write(id, 0, &bytes).unwrap();
                    self.live.push((id, bytes));
                }
            }
            Op::Free(i) => {
                let Some(k) = self.nth(i) else { return };
                let (id, bytes) = self.live.remove(k);
                for o in self.open.iter_mut().filter(|o| o.id == Some(id)) {
                    // It keeps what the allocation held (its first `size`
                    // bytes as the model knows them; past them, what the
                    // DMA-BUF reads now).
                    let mut now = vec![0u8; o.buf.bytes() as usize];
                    self.d.standin_dmabuf_read(o.buf.fd(), 0, &mut now).unwrap();
                    let n = bytes.len().min(now.len());
                    assert_eq!(&now[..n], &bytes[..n], "a DMA-BUF did not read its allocation's bytes before the free");
                    o.frozen = now;
                    o.id = None;
                }
                a.free(id).unwrap();
            }
            Op::Resize(i, size) => {
                let Some(k) = self.nth(i) else { return };
                let id = self.live[k].0;
                if a.resize(id, size).is_ok() {
                    let bytes = &mut self.live[k].1;
                    let old = bytes.len();
                    bytes.truncate(size as usize);
                    if size as usize > old {
                        let more = fill(old as u8, size - old as u64);
                        a.write(id, old as u64, &more).unwrap();
                        bytes.extend(more);
                    }
                }
            }
            Op::Open(i) => {
                let Some(k) = self.nth(i) else { return };
                let id = self.live[k].0;
                let was_asleep = a.query(id).unwrap().asleep;
                if let Ok(buf) = a.dmabuf(id) {
                    assert!(!was_asleep, "a DMA-BUF of a sleeping allocation");
                    self.open.push(Open { buf, id: Some(id), origin: id, frozen: Vec::new() });
                }
            }
            Op::Close(j) => {
                if !self.open.is_empty() {
                    let n = self.open.len();
                    drop(self.open.remove(j % n));
                }
            }
            Op::WriteThrough(j, seed) => {
                if self.open.is_empty() {
                    return;
                }
                let n = self.open.len();
                let o = &self.open[j % n];
                let (id, origin) = (o.id, o.origin);
                let bytes = fill(seed, o.buf.bytes());
                self.d.standin_dmabuf_write(o.buf.fd(), 0, &bytes).unwrap();
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
            Op::Stamp(i, seed) => {
                let Some(k) = self.nth(i) else { return };
                let (id, bytes) = &mut self.live[k];
                if a.query(*id).unwrap().asleep {
                    return;
                }
                *bytes = fill(seed, bytes.len() as u64);
                a.write(*id, 0, bytes).unwrap();
            }
            Op::Sleep(backup) => {
                if !self.asleep && a.sleep(1, if backup { SLEEP_BACKUP } else { 0 }).is_ok() {
                    self.asleep = true;
                    if !backup {
                        // Contents of the sleepers are lost; those with a
                        // DMA-BUF (exported) stayed awake.
                        for (id, bytes) in self.live.iter_mut() {
                            if a.query(*id).unwrap().asleep {
                                bytes.clear();
                            }
                        }
                    }
                }
            }
            Op::Wake => {
                if self.asleep && a.wake(1).is_ok() {
                    self.asleep = false;
                    for (id, bytes) in self.live.iter_mut() {
                        if bytes.is_empty() {
                            // Lost in a sleep without backup: stamp again.
                            let size = a.query(*id).unwrap().size;
                            *bytes = fill(0x33, size);
                            a.write(*id, 0, bytes).unwrap();
                        }
                    }
                }
            }
            Op::Compact => drop(a.compact()),
            Op::Trim => drop(a.trim(0)),
            Op::ReleaseRetired => drop(a.release_retired()),
        }
        self.check(op);
    }

    fn check(&self, op: &Op) {
        for (id, bytes) in &self.live {
            let info = self.a.query(*id).unwrap();
            if info.asleep || bytes.is_empty() {
                continue;
            }
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
}

fn run(ops: Vec<Op>) {
    let d = Arc::new(HostDriver::new().unwrap().with_dmabuf_standin());
    let cfg = ArenaConfig {
        capacity_bytes: 24 * C,
        reserve_bytes: 40 * C,
        chunk_bytes: C,
        retain_bytes: 4 * C,
        ..ArenaConfig::default()
    };
    let a = Arena::with_driver(d.clone(), cfg).unwrap();
    let mut m = Model { d: d.clone(), a, live: Vec::new(), open: Vec::new(), asleep: false };
    // Every allocation sleeps and wakes with tag 1.
    for op in &ops {
        m.apply(op);
        for (id, _) in &m.live {
            let _ = m.a.set_tag(*id, 1);
        }
    }
    m.open.clear();
    // (A sleeper's free drops it, backup included.)
    for (id, _) in std::mem::take(&mut m.live) {
        m.a.free(id).unwrap();
    }
    m.a.release_retired().unwrap();
    m.a.trim(0).unwrap();
    let s = m.a.stats().unwrap();
    assert_eq!((s.mapped_bytes, s.pooled_bytes), (0, 0), "held after every DMA-BUF closed and everything freed");
    drop(m);
    assert_eq!(d.live_chunks(), 0, "the driver still holds chunks");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn dmabufs_reach_their_allocations_bytes_and_nothing_else(ops in prop::collection::vec(op(), 1..60)) {
        run(ops);
    }
}
