//! Group undo against a model (host backend, 64 KiB chunks, groups of 2
//! or 3 members of 16 chunks each, deterministic placement on or off).
//! Random sequences of `alloc`, `alloc_growable`, `resize` (small sizes,
//! whole and odd chunk counts, growth past the small classes) and `free`,
//! where before an operation a random member's n-th driver call may be set
//! to fail (out of memory or a driver error).
//!
//! After a failed operation: the error names the member whose call failed
//! (member 0 for a real shortage) with the fault's status, no undo failed,
//! and every member is as before: the member that failed and those after
//! it exactly (snapshot and stats without driver counters); the members
//! before it, whose change was undone, have the same live allocations
//! (size, mapped bytes), the same live, mapped and live bytes, at most the
//! operation's chunks more pooled, and the same layout (live ranges at
//! their addresses, free ranges once retired ones are released) unless
//! the undone change moved something, which the undo does not restore
//! (`group.rs` says so): the members' layouts differ from then on.
//! Retired ranges an undone change released are released on every member,
//! the failing one and those after it included (which are otherwise
//! exactly as before); the directed test
//! `an_undone_growth_releases_retired_ranges_on_every_member` shows it. A
//! reservation an undone growth extended in place is trimmed back
//! (`an_undone_growth_trims_the_reservation_it_extended`). After
//! a successful operation every member agrees: each allocation's size is
//! the model's on every member, `mapped_bytes` and `live_bytes` are equal,
//! and with deterministic placement each allocation has one offset from
//! its member's base until such a divergence. After every operation, every
//! member's stamps read back and the snapshots pass `check_structure`.
//!
//! The test can fail: with the undo of member 0 skipped in
//! `Group::resize` (`for j in 1..k`), both tests failed; the property test
//! shrank to an allocation of 100 bytes grown to two chunks while member
//! 1's first driver call fails: member 0 kept the grown size. The undo was
//! then restored. `PROPTEST_CASES` sets the number of cases (256 by
//! default).

mod common;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use common::{Kind, Snap, Stamps, HOST_CHUNK as C};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use vmm_arena::driver::fault::{FaultDriver, FaultKind};
use vmm_arena::driver::host::HostDriver;
use vmm_arena::{Arena, ArenaConfig, Group, GroupError, GroupId, Status};

/// Each member's capacity, in chunks.
const CAP: u64 = 16;

#[derive(Clone, Debug)]
enum Act {
    Alloc(u64),
    AllocGrowable(u64, u64),
    Resize(usize, u64),
    Free(usize),
}

/// An operation, and maybe a fault: (member selector, n-th call, kind).
#[derive(Clone, Debug)]
struct Op {
    act: Act,
    fault: Option<(usize, u64, bool)>,
}

/// Small sizes, whole chunks, and odd sizes over one to five chunks.
fn size() -> impl Strategy<Value = u64> {
    prop_oneof![
        prop_oneof![Just(100u64), Just(1000), Just(C / 4), Just(C / 2 + 1)],
        (1..=5u64).prop_map(|n| n * C),
        (1..=5u64, 1..C).prop_map(|(n, r)| (n - 1) * C + r),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let act = prop_oneof![
        3 => size().prop_map(Act::Alloc),
        2 => (size(), 0..=3u64).prop_map(|(s, extra)| Act::AllocGrowable(s, s + extra * C)),
        4 => (any::<usize>(), size()).prop_map(|(k, s)| Act::Resize(k, s)),
        2 => any::<usize>().prop_map(Act::Free),
    ];
    let fault = prop::option::weighted(0.6, (any::<usize>(), 1..=6u64, any::<bool>()));
    (act, fault).prop_map(|(act, fault)| Op { act, fault })
}

static SEEN: Mutex<BTreeMap<&'static str, u64>> = Mutex::new(BTreeMap::new());

fn seen(what: &'static str) {
    *SEEN.lock().unwrap().entry(what).or_default() += 1;
}

fn pages(size: u64) -> u64 {
    size.div_ceil(C)
}

/// A group allocation: its size and each member's stamps.
struct Shard {
    gid: GroupId,
    size: u64,
    stamps: Vec<Stamps>,
}

struct Harness {
    faults: Vec<Arc<FaultDriver<HostDriver>>>,
    group: Group,
    allocs: Vec<Shard>,
    deterministic: bool,
    /// An undone operation moved something on some member: offsets may differ.
    diverged: bool,
    seeds: u64,
}

/// A member's state, for the comparison after a failed operation.
struct Before {
    snap: Snap,
    stats: vmm_arena::Stats,
}

fn status_of(kind: FaultKind) -> Status {
    match kind {
        FaultKind::OutOfMemory => Status::OutOfMemory,
        FaultKind::Driver => Status::Driver,
    }
}

/// The layout without what pooling changes (an undone member keeps the
/// chunks its undone change took, pooled) or what releasing retired ranges
/// (which the arena may do at any call) changes: live ranges, and free
/// ranges once retired ones are released.
type Layout = (Vec<(u64, u64, u64, u64, u64)>, Vec<(u64, u64)>);

fn layout(s: &Snap) -> Layout {
    (s.live().map(|r| (r.addr, r.bytes, r.id, r.size, r.mapped_bytes)).collect(), s.free_after_release())
}

impl Harness {
    fn new(members: usize, deterministic: bool) -> Harness {
        let faults: Vec<_> = (0..members).map(|_| Arc::new(FaultDriver::new(HostDriver::new().unwrap()))).collect();
        let cfg = ArenaConfig {
            capacity_bytes: CAP * C,
            reserve_bytes: 8 * CAP * C,
            chunk_bytes: C,
            deterministic_placement: deterministic,
            ..ArenaConfig::default()
        };
        let arenas = faults.iter().map(|f| Arena::with_driver(f.clone(), cfg).unwrap()).collect();
        let group = Group::from_arenas(arenas).unwrap();
        Harness { faults, group, allocs: Vec::new(), deterministic, diverged: false, seeds: 0 }
    }

    fn used(&self) -> u64 {
        self.allocs.iter().map(|s| pages(s.size)).sum()
    }

    fn apply(&mut self, op: &Op) {
        let what = format!("{op:?}");
        let n = self.group.len();
        let before: Vec<Before> = (0..n)
            .map(|k| {
                let a = self.group.member(k);
                Before { snap: Snap::of(a).without_driver_counters(), stats: a.stats().unwrap() }
            })
            .collect();
        let fault = op.fault.map(|(m, i, oom)| {
            let kind = if oom { FaultKind::OutOfMemory } else { FaultKind::Driver };
            self.faults[m % n].fail_nth(None, i, kind);
            (m % n, kind)
        });
        // Chunks the operation adds on each member, and the bytes to stamp
        // once the fault is cleared (an armed one would fail the writes).
        let mut fresh = None;
        let (result, adds): (Result<(), GroupError>, u64) = match op.act {
            Act::Alloc(size) | Act::AllocGrowable(size, _) => {
                let got = match op.act {
                    Act::Alloc(_) => self.group.alloc(size),
                    _ => self.group.alloc_growable(size, op_max(&op.act)),
                };
                let adds = pages(size);
                (
                    got.map(|(gid, _)| {
                        self.allocs.push(Shard { gid, size, stamps: vec![Stamps::default(); n] });
                        fresh = Some((self.allocs.len() - 1, 0, size));
                    }),
                    adds,
                )
            }
            Act::Resize(sel, size) if !self.allocs.is_empty() => {
                let i = sel % self.allocs.len();
                let old = self.allocs[i].size;
                let adds = pages(size).saturating_sub(pages(old));
                let got = self.group.resize(self.allocs[i].gid, size).map(|_| {
                    self.allocs[i].size = size;
                    for s in &mut self.allocs[i].stamps {
                        s.truncate(size);
                    }
                    if size > old {
                        fresh = Some((i, old, size));
                    }
                });
                (got, adds)
            }
            Act::Free(sel) if !self.allocs.is_empty() => {
                let i = sel % self.allocs.len();
                let got = self.group.free(self.allocs[i].gid);
                if got.is_ok() {
                    self.allocs.remove(i);
                }
                (got, 0)
            }
            _ => (Ok(()), 0),
        };
        let fired = fault.filter(|&(m, _)| !self.faults[m].pending());
        for f in &self.faults {
            f.clear();
        }
        if let Some((i, from, to)) = fresh {
            self.stamp(i, from, to);
        }
        let short = self.used() + adds > CAP;
        let e = match (result, fired) {
            (Ok(()), None) => {
                // After the change: the used count includes it.
                assert!(self.used() <= CAP, "{what}: beyond the capacity");
                return seen("ok");
            }
            (Ok(()), Some((m, _))) => panic!("{what}: member {m}'s call failed, the operation succeeded"),
            (Err(e), fired) => {
                match fired {
                    Some((m, kind)) => {
                        assert_eq!((e.member, e.status()), (Some(m), status_of(kind)), "{what}: {e}");
                        seen(if m > 0 { "undone after a fault" } else { "fault on the first member" });
                    }
                    None => {
                        assert!(short, "{what}: failed without a fault or a shortage: {e}");
                        assert_eq!((e.member, e.status()), (Some(0), Status::OutOfMemory), "{what}: {e}");
                        seen("out of memory");
                    }
                }
                e
            }
        };
        assert!(e.undo_failures.is_empty(), "{what}: {e}");
        let m = e.member.unwrap();
        let retired = |s: &Snap| -> Vec<(u64, u64)> {
            s.ranges.iter().filter(|r| r.kind == Kind::Retired).map(|r| (r.addr, r.bytes)).collect()
        };
        let now: Vec<(Snap, vmm_arena::Stats)> = (0..n)
            .map(|k| {
                let a = self.group.member(k);
                (Snap::of(a).without_driver_counters(), a.stats().unwrap())
            })
            .collect();
        // Retired ranges an undone member released (to make room) are
        // released on every member (`Group`'s undo), the failing one too.
        let released = (0..m).any(|k| retired(&before[k].snap).iter().any(|r| !retired(&now[k].0).contains(r)));
        if released {
            seen("an undone change released retired ranges: released on every member");
        }
        for (k, (b, (snap, s))) in before.iter().zip(&now).enumerate() {
            let w = format!("{what}: member {k} after the failure on member {m}");
            if released {
                let left: Vec<_> = retired(&b.snap).into_iter().filter(|r| retired(snap).contains(r)).collect();
                assert!(left.is_empty(), "{w}: retired ranges not released: {left:?}");
            }
            if k >= m {
                if released {
                    // As before but for the released ranges, now free.
                    assert_eq!(layout(snap), layout(&b.snap), "{w}: layout");
                    let (now, was) = (s, &b.stats);
                    assert_eq!(
                        (now.live_allocations, now.live_bytes, now.mapped_bytes),
                        (was.live_allocations, was.live_bytes, was.mapped_bytes),
                        "{w}: changed"
                    );
                } else {
                    assert_eq!(*snap, b.snap, "{w}: changed");
                }
                continue;
            }
            // Live allocations as before, reservations included (an undone
            // growth's reservation extended in place is trimmed back).
            let live = |s: &Snap| -> BTreeMap<u64, (u64, u64, bool, u64)> {
                s.live().map(|r| (r.id, (r.size, r.mapped_bytes, r.growable, r.bytes))).collect()
            };
            let (ln, lb) = (live(snap), live(&b.snap));
            assert_eq!(ln.keys().collect::<Vec<_>>(), lb.keys().collect::<Vec<_>>(), "{w}: live allocations");
            for (id, &(size, mapped, growable, bytes)) in &ln {
                let was = lb[id];
                assert_eq!((size, mapped, growable, bytes), was, "{w}: allocation {id}");
            }
            if s.moves != b.stats.moves {
                seen("an undone change had moved something");
                self.diverged = true;
            } else {
                assert_eq!(layout(snap), layout(&b.snap), "{w}: layout");
            }
            let (now, was) = (s, &b.stats);
            assert_eq!(
                (now.live_allocations, now.live_bytes, now.mapped_bytes),
                (was.live_allocations, was.live_bytes, was.mapped_bytes),
                "{w}: not undone"
            );
            assert!(
                was.pooled_bytes <= now.pooled_bytes && now.pooled_bytes <= was.pooled_bytes + adds * C,
                "{w}: pooled {} -> {} (the operation adds {adds} chunks)",
                was.pooled_bytes,
                now.pooled_bytes
            );
        }
    }

    /// Writes fresh stamps over `from..to` of allocation `i` on every member.
    fn stamp(&mut self, i: usize, from: u64, to: u64) {
        let ids = self.group.member_ids(self.allocs[i].gid).unwrap();
        for (k, id) in ids.into_iter().enumerate() {
            self.seeds += 1;
            let st = &mut self.allocs[i].stamps[k];
            st.seed = self.seeds;
            st.write(self.group.member(k), id, from, to);
        }
    }

    fn check(&self, what: &str) {
        let n = self.group.len();
        for s in &self.allocs {
            let infos = self.group.query(s.gid).unwrap_or_else(|e| panic!("{what}: {e}"));
            let ids = self.group.member_ids(s.gid).unwrap();
            for k in 0..n {
                let i = &infos[k];
                assert_eq!((i.size, i.mapped_bytes), (s.size, pages(s.size) * C), "{what}: member {k}");
                s.stamps[k].verify(self.group.member(k), ids[k], &format!("{what}: member {k}"));
            }
            if self.deterministic && !self.diverged {
                let offsets: Vec<u64> = (0..n).map(|k| infos[k].ptr - self.group.member(k).va_range().0).collect();
                assert!(offsets.windows(2).all(|w| w[0] == w[1]), "{what}: offsets differ: {offsets:?}");
            }
        }
        let stats = self.group.stats().unwrap();
        let model = (self.allocs.len() as u64, self.allocs.iter().map(|s| s.size).sum(), self.used() * C);
        for (k, s) in stats.iter().enumerate() {
            assert_eq!((s.live_allocations, s.live_bytes, s.mapped_bytes), model, "{what}: member {k} stats");
            let a = self.group.member(k);
            Snap::of(a).check_structure(a.va_range());
        }
    }
}

fn op_max(act: &Act) -> u64 {
    match *act {
        Act::AllocGrowable(_, max) => max,
        _ => 0,
    }
}

fn run(members: usize, deterministic: bool, ops: &[Op]) {
    let mut h = Harness::new(members, deterministic);
    for (i, op) in ops.iter().enumerate() {
        h.apply(op);
        h.check(&format!("op {i} ({op:?})"));
    }
    for s in std::mem::take(&mut h.allocs) {
        h.group.free(s.gid).unwrap();
    }
    for (k, f) in h.faults.iter().enumerate() {
        let s = h.group.member(k).stats().unwrap();
        assert_eq!(f.live_chunks() as u64, (s.mapped_bytes + s.pooled_bytes) / C, "member {k} leaks a chunk");
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn a_failed_group_operation_leaves_every_member_as_it_was(
        members in 2..=3usize,
        deterministic in any::<bool>(),
        ops in prop::collection::vec(op(), 1..40),
    ) {
        run(members, deterministic, &ops);
    }
}

#[test]
fn the_generator_reaches_every_outcome() {
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let strategy = (2..=3usize, any::<bool>(), prop::collection::vec(op(), 30..40));
    for _ in 0..48 {
        let (members, deterministic, ops) = strategy.new_tree(&mut runner).unwrap().current();
        run(members, deterministic, &ops);
    }
    let seen = SEEN.lock().unwrap();
    println!("outcomes: {seen:?}");
    for what in ["ok", "undone after a fault", "fault on the first member", "out of memory"] {
        assert!(seen.contains_key(what), "never reached: {what} (reached: {seen:?})");
    }
}

/// Two members with deterministic placement (member 1 fails on demand).
fn deterministic_pair() -> (Vec<Arc<FaultDriver<HostDriver>>>, Group) {
    let faults: Vec<_> = (0..2).map(|_| Arc::new(FaultDriver::new(HostDriver::new().unwrap()))).collect();
    let cfg = ArenaConfig {
        capacity_bytes: CAP * C,
        reserve_bytes: 8 * CAP * C,
        chunk_bytes: C,
        deterministic_placement: true,
        ..ArenaConfig::default()
    };
    let arenas = faults.iter().map(|f| Arena::with_driver(f.clone(), cfg).unwrap()).collect();
    (faults, Group::from_arenas(arenas).unwrap())
}

/// Each member's offset of `ptrs` from its base.
fn offsets(g: &Group, ptrs: &[u64]) -> Vec<u64> {
    ptrs.iter().enumerate().map(|(k, p)| p - g.member(k).va_range().0).collect()
}

/// An undone growth of a growable allocation past its reservation, which
/// member 0 extended in place, trims the reservation back: both members
/// reserve the same, and the next allocation lands at one offset (before
/// the trim, member 0 kept 3 chunks reserved and the next allocation's
/// offsets were [3C, C]).
#[test]
fn an_undone_growth_trims_the_reservation_it_extended() {
    let (faults, g) = deterministic_pair();
    let (x, _) = g.alloc_growable(C, C).unwrap();
    faults[1].fail_nth(None, 1, FaultKind::OutOfMemory);
    assert_eq!(g.resize(x, 3 * C).unwrap_err().member, Some(1));
    faults[1].clear();
    let reserved: Vec<u64> = g.query(x).unwrap().iter().map(|i| i.reserved_bytes).collect();
    assert_eq!(reserved, vec![C, C]);
    let (_, ptrs) = g.alloc(C).unwrap();
    let next = offsets(&g, &ptrs);
    assert_eq!(next[0], next[1], "{next:?}");
}

/// An undone growth that released retired ranges (to make room) on the
/// member it succeeded on: the undo cannot map them back, so it releases
/// them on every member, and the next group allocation lands at one offset
/// (found by the property test; before, member 0 alone had released them
/// and the next allocation's offsets were [C, 7C]).
#[test]
fn an_undone_growth_releases_retired_ranges_on_every_member() {
    // A growth that releases a retired range (the old place of a moved one).
    let (faults, g) = deterministic_pair();
    let (a, _) = g.alloc(C).unwrap();
    let (b, _) = g.alloc(2 * C).unwrap();
    let (_c, _) = g.alloc(C).unwrap();
    g.resize(b, 3 * C).unwrap(); // moves: pages 1..3 retired
    g.free(a).unwrap();
    let (y, _) = g.alloc(C).unwrap(); // page 0, before the retired ones
    let retired = |g: &Group| -> Vec<u64> { g.stats().unwrap().iter().map(|s| s.retired_va_bytes).collect() };
    assert_eq!(retired(&g), vec![2 * C, 2 * C]);
    faults[1].fail_nth(None, 1, FaultKind::OutOfMemory);
    let e = g.resize(y, 2 * C).unwrap_err();
    faults[1].clear();
    assert_eq!(e.member, Some(1));
    assert!(e.undo_failures.is_empty(), "{e}");
    assert_eq!(retired(&g), vec![0, 0], "released on every member");
    let sizes: Vec<u64> = g.query(y).unwrap().iter().map(|i| i.size).collect();
    assert_eq!(sizes, vec![C, C], "the growth is undone");
    let (_, ptrs) = g.alloc(C).unwrap();
    let next = offsets(&g, &ptrs);
    assert_eq!(next[0], next[1], "{next:?}");
}
