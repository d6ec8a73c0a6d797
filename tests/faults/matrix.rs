//! Running one case of the fault matrix: the twin run that counts the calls, the
//! rebuilt and recorded state, the injected fault, and the checks of the outcome.

use super::*;

/// Everything observable about an arena that a failed call must not change.
struct Recording {
    snap: Snap,
    stats: Stats,
    bytes: BTreeMap<Id, Vec<u8>>,
    live_chunks: usize,
    live_mappings: usize,
    /// Host buffers (backups) lent by the driver and not yet freed.
    live_host_buffers: usize,
    /// The memfd's committed bytes (host only).
    file_bytes: Option<u64>,
}

impl Recording {
    /// Field by field, so that a failure names what changed (and does not
    /// print megabytes of contents).
    fn assert_same(&self, now: &Recording, what: &str) {
        assert_eq!(now.snap, self.snap, "{what}: the ranges or stats changed");
        assert_eq!(now.stats, self.stats, "{what}: the stats changed");
        for (id, want) in &self.bytes {
            assert!(now.bytes.get(id) == Some(want), "{what}: the bytes of {id} changed");
        }
        assert_eq!(now.bytes.len(), self.bytes.len());
        assert_eq!(
            (now.live_chunks, now.live_mappings, now.live_host_buffers, now.file_bytes),
            (self.live_chunks, self.live_mappings, self.live_host_buffers, self.file_bytes),
            "{what}: the driver's chunks, mappings, host buffers or committed memory changed"
        );
    }
}

fn record(a: &Arena, d: &TestDriver, ids: &[Id]) -> Recording {
    Recording {
        snap: Snap::of(a).without_driver_counters(),
        stats: stats_sans_driver(a.stats().unwrap()),
        bytes: ids.iter().map(|&id| (id, read_all(a, id))).collect(),
        live_chunks: d.fault.live_chunks(),
        live_mappings: d.fault.live_mappings(),
        live_host_buffers: d.fault.live_host_buffers(),
        file_bytes: d.host.as_ref().map(|h| h.allocated_file_bytes().unwrap()),
    }
}

/// A fresh arena in the case's starting state, every allocation filled
/// with a pattern of its own.
fn build(case: &Case) -> (TestDriver, Arena, Vec<Id>) {
    let backend = test_backend();
    let (d, c) = (backend.driver(), backend.chunk());
    let cfg = ArenaConfig {
        capacity_bytes: case.cap * c,
        reserve_bytes: case.reserve * c,
        chunk_bytes: c,
        retain_bytes: case.retain,
        ..ArenaConfig::default()
    };
    let a = Arena::with_driver(d.fault.clone(), cfg).unwrap();
    let ids = (case.setup)(&a, c);
    assert_eq!(a.stats().unwrap().live_allocations, ids.len() as u64, "{}: setup lists every allocation", case.name);
    for &id in &ids {
        if !a.query(id).unwrap().asleep {
            common::fill(&a, id, id.get());
        }
    }
    (d, a, ids)
}

/// The invariants that hold after any outcome: nothing leaked, ranges and
/// stats consistent.
fn check_no_leak(what: &str, a: &Arena, d: &TestDriver) {
    let snap = Snap::of(a);
    snap.check_structure(a.va_range());
    let s = a.stats().unwrap();
    let c = a.chunk_bytes();
    assert_eq!(d.fault.live_chunks() as u64, (s.mapped_bytes + s.pooled_bytes) / c, "{what}: leaked or lost chunks");
    assert_eq!(d.fault.live_mappings() as u64, snap.mapped_pages(), "{what}: leaked or lost mappings");
    let backups = snap.live().filter(|r| r.backup_bytes > 0).count();
    assert_eq!(d.fault.live_host_buffers(), backups, "{what}: leaked or lost backup buffers");
    if let Some(host) = &d.host {
        assert_eq!(
            host.allocated_file_bytes().unwrap(),
            s.mapped_bytes + s.pooled_bytes,
            "{what}: memory committed in the memfd vs memory held"
        );
    }
}

/// The arena still works: old data verifies, and a new allocation can be
/// made, written, read and freed.
fn check_keeps_working(what: &str, a: &Arena, d: &TestDriver, bytes: &BTreeMap<Id, Vec<u8>>, live: &[Id]) {
    d.fault.clear();
    // Sleepers with a backup get their bytes back: the recorded ones, or
    // (asleep already when recorded) the pattern their case filled them with.
    let backed_up: Vec<Id> = Snap::of(a)
        .live()
        .filter(|r| r.asleep && r.backup_bytes > 0)
        .map(|r| live.iter().copied().find(|id| id.get() == r.id).expect("a listed allocation"))
        .collect();
    let asleep: Vec<Id> = live.iter().copied().filter(|&id| a.query(id).unwrap().asleep).collect();
    a.wake(ALL_TAGS).unwrap_or_else(|e| panic!("{what}: wake after the fault: {e}"));
    for (&id, want) in bytes.iter().filter(|(id, _)| live.contains(id)) {
        if asleep.contains(&id) && !backed_up.contains(&id) {
            continue; // slept without a backup: contents unspecified
        }
        let got = read_all(a, id);
        let filled;
        let want = if want.is_empty() {
            let mut v = vec![0u8; got.len()];
            for (i, b) in v.iter_mut().enumerate() {
                *b = common::stamp_bytes(id.get(), i as u64 / 8)[i % 8];
            }
            filled = v;
            &filled
        } else {
            want
        };
        let n = want.len().min(got.len());
        assert!(n > 0, "{what}: nothing of {id} to verify");
        assert_eq!(&got[..n], &want[..n], "{what}: bytes of {id} after the fault");
    }
    // Whatever fits: the capacity may be used up by the case.
    let s = a.stats().unwrap();
    let c = a.chunk_bytes();
    let size = if s.mapped_bytes + 2 * c <= s.capacity_bytes { c + 123 } else { 100 };
    if let Ok((id, _)) = a.alloc(size) {
        a.write(id, size - 5, b"alive").unwrap();
        let mut out = [0u8; 5];
        a.read(id, size - 5, &mut out).unwrap();
        assert_eq!(&out, b"alive", "{what}");
        a.free(id).unwrap();
    } else {
        assert_eq!(s.mapped_bytes, s.capacity_bytes, "{what}: a follow-up alloc failed with room left");
    }
    a.release_retired().unwrap();
    a.compact().unwrap();
    check_no_leak(what, a, d);
}

pub(super) fn status_of(kind: FaultKind) -> Status {
    match kind {
        FaultKind::OutOfMemory => Status::OutOfMemory,
        FaultKind::Driver => Status::Driver,
    }
}

/// The live part of a snapshot: allocations and slabs, without pooled chunks.
fn live_part(s: &Snap) -> Vec<(Kind, u64, u64, u64, u64, u64)> {
    s.ranges
        .iter()
        .filter(|r| matches!(r.kind, Kind::Live | Kind::Slab))
        // Ids carry a per-arena tag (bits 32..48); the twin is another arena.
        .map(|r| (r.kind, r.id & !(0xffff << 32), r.addr, r.bytes, r.size, r.used))
        .collect()
}

pub(super) fn run_case(case: &Case) -> Row {
    // The twin: count the calls, and keep its outcome for best-effort cases.
    let (d, a, mut ids) = build(case);
    let (fd, c) = (&d.fault, a.chunk_bytes());
    let before: BTreeMap<CallKind, u64> = CallKind::ALL.iter().map(|&k| (k, fd.calls(k))).collect();
    let total0 = fd.total_calls();
    let moves0 = a.stats().unwrap().moves;
    (case.op)(&a, &mut ids, c).unwrap_or_else(|e| panic!("{}: the operation fails without a fault: {e}", case.name));
    let calls = fd.total_calls() - total0;
    let by_kind: BTreeMap<CallKind, u64> =
        CallKind::ALL.iter().map(|&k| (k, fd.calls(k) - before[&k])).filter(|&(_, n)| n > 0).collect();
    assert!(calls > 0, "{}: the operation makes no driver call; the case tests nothing", case.name);
    let twin = Snap::of(&a);
    let twin_stats = a.stats().unwrap();
    let moves = twin_stats.moves - moves0;
    check_no_leak(case.name, &a, &d);
    if case.expect == Expect::Promise && d.host.is_some() {
        // What the failed calls must not do: the twin's promise makes what
        // its free leaves known idle.
        let (idle0, mapped) = (twin_stats.idle_cached_bytes, a.query(ids[0]).unwrap().mapped_bytes);
        a.free(ids[0]).unwrap();
        let idle = a.stats().unwrap().idle_cached_bytes;
        assert_eq!(idle - idle0, mapped, "{}: the twin's free of its quiesced allocation", case.name);
    }
    drop(a);
    assert_eq!((fd.live_chunks(), fd.live_mappings()), (0, 0), "{}: dropping the arena releases all", case.name);

    let mut injected = 0;
    let mut absorbed_events = 0;
    for i in 1..=calls {
        for kind in FaultKind::ALL {
            let what = format!("{} / call {i} of {calls} fails with {kind:?}", case.name);
            let (d, a, mut ids) = build(case);
            let fd = &d.fault;
            let pre = record(&a, &d, &ids);
            let releases0 = a.stats().unwrap().driver_releases;
            fd.fail_nth(None, i, kind);
            let r = (case.op)(&a, &mut ids, c);
            assert!(!fd.pending(), "{what}: the operation made fewer calls than its twin");
            injected += 1;
            // A failed call the arena absorbs by design (see the module doc):
            // an event's poll or destroy. Only a record can fail the call.
            let absorbed = r.is_ok() && fd.last_injected() == Some(CallKind::Event);
            if absorbed {
                assert!(d.host.is_none(), "{what}: the host has no event to poll or destroy");
                let s = a.stats().unwrap();
                assert_eq!(live_part(&Snap::of(&a)), live_part(&twin), "{what}: the change differs from the twin's");
                assert_eq!(
                    (s.live_allocations, s.live_bytes),
                    (twin_stats.live_allocations, twin_stats.live_bytes),
                    "{what}"
                );
                absorbed_events += 1;
            } else {
                match case.expect {
                    Expect::Sleep if r.is_ok() => {
                        let snap = Snap::of(&a);
                        let s = a.stats().unwrap();
                        assert_eq!(live_part(&snap), live_part(&twin), "{what}: the sleep differs from the twin's");
                        let asleep = |s: &Snap| s.live().filter(|r| r.asleep).map(|r| r.addr).collect::<Vec<_>>();
                        assert_eq!(asleep(&snap), asleep(&twin), "{what}: not the twin's sleepers");
                        assert_eq!(
                            (s.live_allocations, s.live_bytes, s.mapped_bytes, s.asleep_bytes, s.backup_bytes),
                            (
                                twin_stats.live_allocations,
                                twin_stats.live_bytes,
                                twin_stats.mapped_bytes,
                                twin_stats.asleep_bytes,
                                twin_stats.backup_bytes
                            ),
                            "{what}"
                        );
                        assert_eq!(s.release_failures, 1, "{what}: only a release may fail after the unmaps");
                        assert_eq!(s.pooled_bytes, twin_stats.pooled_bytes + c, "{what}: the chunk stays pooled");
                    }
                    Expect::Maintain => {
                        match kind {
                            // The device is out of memory: a target out of reach, no error.
                            FaultKind::OutOfMemory => r.unwrap_or_else(|e| panic!("{what}: {e}")),
                            FaultKind::Driver => {
                                let e = r.expect_err(&what);
                                assert_eq!(e.status(), status_of(kind), "{what}: {e}");
                            }
                        }
                        let snap = Snap::of(&a);
                        let s = a.stats().unwrap();
                        assert_eq!(live_part(&snap), live_part(&pre.snap), "{what}: maintain changed an allocation");
                        assert_eq!(
                            (s.live_allocations, s.live_bytes, s.mapped_bytes),
                            (pre.stats.live_allocations, pre.stats.live_bytes, pre.stats.mapped_bytes),
                            "{what}"
                        );
                        assert_eq!(s.maintain_failures, 1, "{what}: the failure is counted");
                        assert!(s.pooled_bytes >= pre.stats.pooled_bytes, "{what}: nothing pooled was lost");
                        for (&id, want) in &pre.bytes {
                            assert_eq!(&read_all(&a, id), want, "{what}: bytes of {id}");
                        }
                        check_no_leak(&what, &a, &d);
                        d.fault.clear();
                        a.maintain().unwrap_or_else(|e| panic!("{what}: a maintain after the fault: {e}"));
                        let s = a.stats().unwrap();
                        assert_eq!(
                            (s.pooled_bytes, s.prefetched_bytes),
                            (twin_stats.pooled_bytes, twin_stats.prefetched_bytes),
                            "{what}: the second maintain reaches the twin's prefetch"
                        );
                    }
                    Expect::Atomic | Expect::Sleep => {
                        let e = r.expect_err(&what);
                        assert_eq!(e.status(), status_of(kind), "{what}: {e}");
                        let pre_ids: Vec<Id> = pre.bytes.keys().copied().collect();
                        pre.assert_same(&record(&a, &d, &pre_ids), &what);
                    }
                    Expect::BestEffort => {
                        r.unwrap_or_else(|e| panic!("{what}: a give-back failure must not fail the call: {e}"));
                        let snap = Snap::of(&a);
                        let s = a.stats().unwrap();
                        assert_eq!(live_part(&snap), live_part(&twin), "{what}: the change differs from the twin's");
                        assert_eq!(
                            (s.live_allocations, s.live_bytes, s.mapped_bytes),
                            (twin_stats.live_allocations, twin_stats.live_bytes, twin_stats.mapped_bytes),
                            "{what}"
                        );
                        assert_eq!(s.release_failures, 1, "{what}: the failure is counted");
                        assert!(s.pooled_bytes >= twin_stats.pooled_bytes, "{what}");
                    }
                    Expect::Trim => {
                        let e = r.expect_err(&what);
                        assert_eq!(e.status(), status_of(kind), "{what}: {e}");
                        let snap = Snap::of(&a).without_driver_counters();
                        let s = a.stats().unwrap();
                        assert_eq!(live_part(&snap), live_part(&pre.snap), "{what}: trim moved an allocation");
                        assert_eq!(
                            (s.live_allocations, s.live_bytes, s.mapped_bytes),
                            (pre.stats.live_allocations, pre.stats.live_bytes, pre.stats.mapped_bytes),
                            "{what}"
                        );
                        let released = s.driver_releases - releases0;
                        assert_eq!(
                            pre.stats.pooled_bytes - s.pooled_bytes,
                            released * c,
                            "{what}: what was released is gone from the pool, the rest stays pooled"
                        );
                        for (&id, want) in &pre.bytes {
                            assert_eq!(&read_all(&a, id), want, "{what}: bytes of {id}");
                        }
                    }
                    Expect::Promise => {
                        let e = r.expect_err(&what);
                        assert_eq!(e.status(), status_of(kind), "{what}: {e}");
                        let pre_ids: Vec<Id> = pre.bytes.keys().copied().collect();
                        pre.assert_same(&record(&a, &d, &pre_ids), &what);
                        if d.host.is_some() {
                            // No promise was made: its free leaves nothing known idle.
                            let idle0 = a.stats().unwrap().idle_cached_bytes;
                            a.free(ids.remove(0)).unwrap();
                            let idle = a.stats().unwrap().idle_cached_bytes;
                            assert_eq!(idle, idle0, "{what}: the failed call made the promise");
                        }
                    }
                }
            }
            check_no_leak(&what, &a, &d);
            check_keeps_working(&what, &a, &d, &pre.bytes, &ids);
            if case.expect == Expect::Trim {
                a.trim(0).unwrap();
                assert_eq!(a.stats().unwrap().pooled_bytes, 0, "{what}: a second trim finishes the job");
            }
            drop(a);
            assert_eq!(
                (fd.live_chunks(), fd.live_mappings(), fd.live_host_buffers()),
                (0, 0, 0),
                "{what}: dropping the arena releases all"
            );
        }
    }
    Row { name: case.name, calls, by_kind, moves, injected, absorbed: absorbed_events }
}
