//! The fault matrix: every driver call of every public operation fails in
//! turn, with each kind of failure, and the arena must come out of it as the
//! contract says.
//!
//! The matrix is generated from [`cases`], a table of operations, each with
//! the arena state it starts from. For each case:
//! 1. a twin arena is set up and the operation run once without faults, to
//!    count the driver calls it makes (`FaultDriver::total_calls`);
//! 2. for every call `i` in `1..=calls` and every [`FaultKind`], the same
//!    state is rebuilt, recorded (snapshot without the driver counters,
//!    stats without them, every allocation's bytes, the driver's live chunks
//!    and mappings, the memfd's committed bytes), the `i`th call is made to
//!    fail, and the operation run;
//! 3. the outcome is checked against the case's [`Expect`]:
//!    - `Atomic`: the operation returns the fault's status (`OutOfMemory` or
//!      `Driver`) and the arena equals the recording exactly;
//!    - `BestEffort` (free and shrink, which only give memory back after
//!      their own change is done; see `enforce_watermark`): the operation
//!      succeeds, its change is made as in the twin, the memory it could not
//!      give back stays pooled and `release_failures` counts the failure;
//!    - `Trim`: as [`Arena::trim`] documents, chunks released before the
//!      failure stay released (and counted), the rest stay pooled, the error
//!      is returned;
//!    - `Sleep` ([`Arena::sleep`]): a failure up to its unmaps is `Atomic`
//!      (nothing has slept); a failed release, after them, keeps that chunk
//!      pooled, counts in `release_failures`, and the sleep succeeds as in
//!      the twin;
//!    - `Maintain` ([`Arena::maintain`], every call the prefetcher makes:
//!      creates, maps, access calls): a driver error is returned (a driver
//!      out of memory ends the call with success: the target is out of
//!      reach, which the contract says is no error), what earlier
//!      rounds did stays (pooled), no allocation changed, the failure counts
//!      in `maintain_failures`, and a second maintain completes the work;
//!    - `Promise` ([`Arena::quiesce_on_stream`]): `Atomic`, and no promise
//!      made: freeing the allocation leaves nothing known idle (host), where
//!      the twin's free leaves its pages known idle;
//!
//!    except that a failed event poll, or a failed destroy of a completed
//!    event, which the arena absorbs by design (the poll reads as not
//!    complete yet; the destroy leaks one event), lets the operation
//!    succeed with the twin's change to the allocations: only a GPU has
//!    events to poll (the host records none), so on the host the matrix
//!    never takes that exit;
//!
//!    and in every case: no chunk, mapping or host buffer leaked (the
//!    driver's live chunks equal the arena's held memory, its live mappings
//!    the arena's mapped pages, its live host buffers the sleepers' backups;
//!    a sleep's backup buffers, `Driver::alloc_host`, are among the calls
//!    that fail), and the arena keeps working (data still verifies, a
//!    follow-up wake of everything, alloc, write, read and free succeed).
//!
//! A case's setup may leave allocations asleep (for `wake`): it fills each
//! with `fill(id.get())` and sleeps it with a backup, and the check after
//! the fault wakes it and verifies that pattern.
//!
//! The test prints the matrix: per case, the calls by kind and the faults
//! injected, and the total.
//!
//! Backend: the host (64 KiB chunks), or device 0 with 2 MiB chunks when
//! `VMM_ARENA_TEST_BACKEND=cuda` (see `common::test_backend`); sizes are in
//! chunks, so the cases are the same. Bytes are compared through
//! `Arena::read`, which on CUDA is `cuMemcpy`. Only the memfd's committed
//! bytes are a host-only check.

mod common;
#[path = "faults/matrix.rs"]
mod matrix;

use std::collections::BTreeMap;

use common::{read_all, stats_sans_driver, test_backend, Kind, Snap, TestDriver};
use vmm_arena::driver::fault::FaultKind;
use vmm_arena::driver::CallKind;
use vmm_arena::{Arena, ArenaConfig, Id, Result, Stats, Status, ALL_TAGS, SLEEP_BACKUP};

use matrix::{run_case, status_of};

/// What a failed driver call must leave behind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// Error, and the arena exactly as before.
    Atomic,
    /// Success; memory not given back stays pooled.
    BestEffort,
    /// Error; what was released stays released, the rest pooled.
    Trim,
    /// `Atomic`, but a failed release (after the point of no return)
    /// succeeds, keeps the chunk pooled and counts the failure.
    Sleep,
    /// [`Arena::maintain`]: error; the rounds committed before the failure
    /// stay (chunks created or mapped ahead, all pooled), no allocation
    /// changed, nothing lost, the failure counted in `maintain_failures`;
    /// a maintain without faults then reaches the twin's prefetch.
    Maintain,
    /// [`Arena::quiesce_on_stream`] of `ids[0]`: `Atomic`, and the failed
    /// call made no promise: on the host (where a promise holds at once)
    /// freeing the allocation then leaves none of its pages known idle,
    /// where the twin's free leaves them all.
    Promise,
}

struct Case {
    name: &'static str,
    cap: u64,
    reserve: u64,
    retain: u64,
    /// Builds the starting state from chunks of the given size; returns
    /// the live allocations (all of them).
    setup: fn(&Arena, u64) -> Vec<Id>,
    /// The operation under test; may use and change the ids (it removes the
    /// ones it frees). Gets the chunk size too.
    op: fn(&Arena, &mut Vec<Id>, u64) -> Result<()>,
    expect: Expect,
}

fn alloc(a: &Arena, size: u64) -> Id {
    a.alloc(size).unwrap().0
}

/// Quiesces `id` and polls until no event is pending (on a GPU, where the
/// promise's event is recorded: the device is idle, so it completes at
/// once; on the host nothing is recorded): the case then starts from a
/// promise known kept, whatever the timing.
fn quiesce_kept(a: &Arena, id: Id) {
    a.quiesce_on_stream(id, 0).unwrap();
    for _ in 0..100_000 {
        let polls = a.stats().unwrap().event_polls;
        a.maintain().unwrap();
        if a.stats().unwrap().event_polls == polls {
            return; // nothing pending was polled
        }
    }
    panic!("the promise's event never completed");
}

fn cases() -> Vec<Case> {
    const KEEP: u64 = u64::MAX;
    vec![
        Case {
            name: "maintain: precreate chunks",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                a.set_prefetch(3 * c, 0).unwrap();
                vec![alloc(a, 2 * c)]
            },
            op: |a, _, _| a.maintain(),
            expect: Expect::Maintain,
        },
        Case {
            name: "maintain: map ahead of two growable allocations",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let g = a.alloc_growable(c, 4 * c).unwrap().0;
                let h = a.alloc_growable(c, 3 * c).unwrap().0;
                a.set_prefetch(0, 2 * c).unwrap();
                vec![g, h]
            },
            // Per allocation: two creates, then both chunks mapped in one
            // round with one access call.
            op: |a, _, _| a.maintain(),
            expect: Expect::Maintain,
        },
        Case {
            name: "maintain: map ahead, precreate from idle cached chunks",
            cap: 12,
            reserve: 24,
            retain: KEEP,
            setup: |a, c| {
                let h = a.alloc_growable(c, 4 * c).unwrap().0;
                let g = a.alloc_growable(c, 4 * c).unwrap().0;
                a.set_prefetch(0, 2 * c).unwrap();
                a.maintain().unwrap();
                // h's window stays mapped at free pages: idle cached chunks.
                a.free(h).unwrap();
                // Too big for h's hole: placed after g, its window empty.
                let k = a.alloc_growable(c, 6 * c).unwrap().0;
                a.set_prefetch(2 * c, 2 * c).unwrap();
                vec![g, k]
            },
            // k's window: an idle chunk unmapped (no synchronize), mapped
            // with a new one, one access call; the pool: creates.
            op: |a, _, _| a.maintain(),
            expect: Expect::Maintain,
        },
        Case {
            name: "maintain: admission windows from the pool and idle cached chunks",
            cap: 12,
            reserve: 48,
            retain: KEEP,
            setup: |a, c| {
                let g = a.alloc_growable(c, 4 * c).unwrap().0;
                let x = alloc(a, 2 * c);
                a.free(x).unwrap();
                a.set_prefetch(5 * c, 0).unwrap();
                a.set_admission_prefetch(8 * c, 3 * c, 2).unwrap();
                vec![g]
            },
            // Two windows of three, the first at x's place (its two cached
            // chunks count): creates for the precreate target, pooled chunks
            // mapped into the windows.
            op: |a, _, _| a.maintain(),
            expect: Expect::Maintain,
        },
        Case {
            name: "resize_many: three growths in place, planned together",
            cap: 12,
            reserve: 24,
            retain: KEEP,
            setup: |a, c| {
                let v: Vec<Id> = (0..3).map(|_| a.alloc_growable(c, 4 * c).unwrap().0).collect();
                let x = alloc(a, c);
                a.free(x).unwrap(); // one cached chunk elsewhere to steal
                v
            },
            op: |a, ids, c| a.resize_many(&[(ids[0], 3 * c), (ids[1], 2 * c), (ids[2], 4 * c)]).map(drop),
            expect: Expect::Atomic,
        },
        Case {
            name: "resize_many: a shrink, a growth and a move",
            cap: 12,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let g = a.alloc_growable(c, 2 * c).unwrap().0;
                let b = alloc(a, 3 * c); // g cannot grow past 2 chunks in place
                let h = a.alloc_growable(c, 3 * c).unwrap().0;
                vec![g, b, h]
            },
            op: |a, ids, c| a.resize_many(&[(ids[0], 4 * c), (ids[1], c), (ids[2], 3 * c)]).map(drop),
            expect: Expect::Atomic,
        },
        Case {
            name: "alloc that must create",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| vec![alloc(a, 2 * c)],
            op: |a, ids, c| a.alloc(3 * c).map(|(id, _)| ids.push(id)),
            expect: Expect::Atomic,
        },
        Case {
            name: "alloc that steals a cached chunk",
            cap: 3,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let (x, y, z) = (alloc(a, c), alloc(a, c), alloc(a, c));
                a.free(x).unwrap(); // page 0 cached, a hole of one page
                a.free(z).unwrap(); // page 2 cached at the start of the big free range
                vec![y]
            },
            // Lands at page 2 (adopting its chunk); page 3 gets page 0's
            // chunk: an unmap there, since the capacity allows no create.
            op: |a, ids, c| a.alloc(2 * c).map(|(id, _)| ids.push(id)),
            expect: Expect::Atomic,
        },
        Case {
            name: "alloc that must compact",
            cap: 8,
            reserve: 8,
            retain: KEEP,
            setup: |a, c| {
                let v: Vec<Id> = (0..7).map(|_| alloc(a, c)).collect();
                for &i in &[0, 2, 4] {
                    a.free(v[i]).unwrap();
                }
                vec![v[1], v[3], v[5], v[6]] // holes of one page at 0, 2, 4 and 7
            },
            op: |a, ids, c| a.alloc(4 * c).map(|(id, _)| ids.push(id)),
            expect: Expect::Atomic,
        },
        Case {
            name: "alloc that reclaims a slab of retired small objects",
            cap: 4,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let x = alloc(a, 100);
                a.resize(x, c / 4).unwrap(); // slab 1 now holds only x's retired old place
                vec![x, alloc(a, c)]
            },
            // Two chunks: a new one and slab 1's, unmapped from where it was.
            op: |a, ids, c| a.alloc(2 * c).map(|(id, _)| ids.push(id)),
            expect: Expect::Atomic,
        },
        Case {
            name: "alloc_growable",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| vec![alloc(a, c)],
            op: |a, ids, c| a.alloc_growable(2 * c, 6 * c).map(|(id, _)| ids.push(id)),
            expect: Expect::Atomic,
        },
        Case {
            name: "alloc_growable that must compact",
            cap: 8,
            reserve: 8,
            retain: KEEP,
            setup: |a, c| {
                let v: Vec<Id> = (0..6).map(|_| alloc(a, c)).collect();
                a.free(v[1]).unwrap();
                a.free(v[3]).unwrap();
                vec![v[0], v[2], v[4], v[5]]
            },
            op: |a, ids, c| a.alloc_growable(c, 3 * c).map(|(id, _)| ids.push(id)),
            expect: Expect::Atomic,
        },
        Case {
            name: "alloc small (new slab)",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| vec![alloc(a, 2 * c)],
            op: |a, ids, _| a.alloc(1000).map(|(id, _)| ids.push(id)),
            expect: Expect::Atomic,
        },
        Case {
            name: "free (retain 0: gives the chunks back)",
            cap: 8,
            reserve: 16,
            retain: 0,
            setup: |a, c| vec![alloc(a, 2 * c), alloc(a, c)],
            op: |a, ids, _| a.free(ids.remove(0)),
            expect: Expect::BestEffort,
        },
        Case {
            name: "free small emptying its slab (retain 0)",
            cap: 8,
            reserve: 16,
            retain: 0,
            setup: |a, c| vec![alloc(a, 3000), alloc(a, c)],
            op: |a, ids, _| a.free(ids.remove(0)),
            expect: Expect::BestEffort,
        },
        Case {
            name: "resize grow in place",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| vec![a.alloc_growable(c, 6 * c).unwrap().0, alloc(a, c)],
            op: |a, ids, c| a.resize(ids[0], 4 * c).map(drop),
            expect: Expect::Atomic,
        },
        Case {
            name: "resize grow that reclaims a slab of retired small objects",
            cap: 3,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let x = alloc(a, 100);
                a.resize(x, c / 4).unwrap(); // slab 1 now holds only x's retired old place
                vec![x, a.alloc_growable(c / 2 + 1, 2 * c).unwrap().0]
            },
            op: |a, ids, c| a.resize(ids[1], c + 1).map(drop),
            expect: Expect::Atomic,
        },
        Case {
            name: "resize grow beyond the reservation (move)",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| vec![a.alloc_growable(c, 2 * c).unwrap().0, alloc(a, c)],
            op: |a, ids, c| a.resize(ids[0], 3 * c).map(drop),
            expect: Expect::Atomic,
        },
        Case {
            name: "resize that needs compaction",
            cap: 8,
            reserve: 8,
            retain: KEEP,
            setup: |a, c| {
                let x = alloc(a, 2 * c); // [0, 2)
                let g = a.alloc_growable(c, c).unwrap().0; // [2, 3)
                let b = alloc(a, c); // [3, 4)
                let y = alloc(a, 2 * c); // [4, 6)
                let d = alloc(a, c); // [6, 7)
                a.free(x).unwrap();
                a.free(y).unwrap();
                vec![g, b, d] // free: [0, 2), [4, 6), [7, 8)
            },
            op: |a, ids, c| a.resize(ids[0], 3 * c).map(drop),
            expect: Expect::Atomic,
        },
        Case {
            name: "shrink (retain 0: gives the tail back)",
            cap: 8,
            reserve: 16,
            retain: 0,
            setup: |a, c| vec![alloc(a, 4 * c), alloc(a, c)],
            op: |a, ids, c| a.resize(ids[0], c).map(drop),
            expect: Expect::BestEffort,
        },
        Case {
            name: "resize small beyond its class (copy)",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| vec![alloc(a, 1000), alloc(a, c)],
            op: |a, ids, _| a.resize(ids[0], 20_000).map(drop),
            expect: Expect::Atomic,
        },
        Case {
            name: "resize small beyond the small classes (copy to chunks)",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| vec![alloc(a, 1000), alloc(a, c)],
            op: |a, ids, c| a.resize(ids[0], 3 * c).map(drop),
            expect: Expect::Atomic,
        },
        Case {
            name: "compact",
            cap: 8,
            reserve: 8,
            retain: KEEP,
            setup: |a, c| {
                let v: Vec<Id> = [2 * c, c, c, 2 * c, 700].iter().map(|&s| alloc(a, s)).collect();
                a.free(v[0]).unwrap();
                a.free(v[2]).unwrap();
                vec![v[1], v[3], v[4]]
            },
            op: |a, _, _| a.compact().map(drop),
            expect: Expect::Atomic,
        },
        Case {
            name: "release_retired",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let g = a.alloc_growable(c, c).unwrap().0;
                let b = alloc(a, c);
                a.resize(g, 2 * c).unwrap(); // moves: page 0 retired
                let h = a.alloc_growable(2 * c, 2 * c).unwrap().0;
                let d = alloc(a, c);
                a.resize(h, 3 * c).unwrap(); // moves too: a second retired range
                assert_eq!(a.stats().unwrap().retired_va_bytes, 3 * c);
                vec![g, b, h, d]
            },
            op: |a, _, _| a.release_retired(),
            expect: Expect::Atomic,
        },
        Case {
            name: "trim (pooled chunks, mapped and unmapped)",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let v: Vec<Id> = [2 * c, c, 2 * c, c, c].iter().map(|&s| alloc(a, s)).collect();
                a.free(v[0]).unwrap(); // pages 0, 1 cached
                a.compact().unwrap(); // v[1] lands on page 0: its cached chunk is evicted to the pool
                a.free(v[3]).unwrap();
                let s = Snap::of(a);
                assert!(s.pooled_unmapped_chunks > 0 && s.stats["cached_mapped_bytes"] > 0, "{s:?}");
                vec![v[1], v[2], v[4]]
            },
            op: |a, _, _| a.trim(0).map(drop),
            expect: Expect::Trim,
        },
        Case {
            name: "trim of chunks still mapped at a retired range",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let g = a.alloc_growable(c, c).unwrap().0;
                let b = alloc(a, c);
                a.resize(g, 2 * c).unwrap(); // moves: page 0 retired, mapping g's first chunk
                a.free(g).unwrap();
                vec![b]
            },
            op: |a, _, _| a.trim(0).map(drop),
            expect: Expect::Trim,
        },
        Case {
            name: "sleep a tag with backup (a retired range, a cached chunk)",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let g = a.alloc_growable(c, c).unwrap().0;
                let b = alloc(a, c);
                a.resize(g, 2 * c).unwrap(); // moves: page 0 retired, mapping g's first chunk
                let w = alloc(a, 2 * c);
                let t = alloc(a, c);
                a.free(t).unwrap(); // one cached chunk
                a.set_tag(g, 1).unwrap();
                a.set_tag(w, 1).unwrap();
                vec![g, b, w]
            },
            op: |a, _, _| a.sleep(1, SLEEP_BACKUP),
            expect: Expect::Sleep,
        },
        Case {
            name: "sleep everything without backup (a small allocation stays)",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let v: Vec<Id> = [2 * c, c, c].iter().map(|&s| alloc(a, s)).collect();
                a.free(v[1]).unwrap();
                vec![v[0], v[2], alloc(a, 700)]
            },
            op: |a, _, _| a.sleep(ALL_TAGS, 0),
            expect: Expect::Sleep,
        },
        Case {
            name: "wake a tag (stolen and new chunks, backups)",
            cap: 6,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let x = alloc(a, 2 * c + 5);
                let y = a.alloc_growable(c, 3 * c).unwrap().0;
                let k = alloc(a, c);
                for id in [x, y] {
                    common::fill(a, id, id.get());
                    a.set_tag(id, 3).unwrap();
                }
                a.sleep(3, SLEEP_BACKUP).unwrap();
                // The trainer's leftovers: two cached chunks at free pages.
                let t = alloc(a, 2 * c);
                a.free(t).unwrap();
                vec![x, y, k]
            },
            // Four chunks: two stolen from the cache (an unmap), two new.
            op: |a, _, _| a.wake(3),
            expect: Expect::Atomic,
        },
        Case {
            name: "alloc_shared (evicts a cached chunk where it lands)",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let src = alloc(a, 2 * c);
                let x = alloc(a, c);
                a.free(x).unwrap(); // page 2 cached, where the share lands
                vec![src]
            },
            op: |a, ids, c| a.alloc_shared(ids[0], 0, 2 * c, 3 * c).map(|(id, _)| ids.push(id)),
            expect: Expect::Atomic,
        },
        Case {
            name: "alloc_shared that must compact",
            cap: 8,
            reserve: 8,
            retain: KEEP,
            setup: |a, c| {
                let v: Vec<Id> = (0..6).map(|_| alloc(a, c)).collect();
                for &i in &[0, 2, 4] {
                    a.free(v[i]).unwrap();
                }
                vec![v[1], v[3], v[5]] // holes of one page at 0, 2, 4, and two at 6
            },
            op: |a, ids, c| a.alloc_shared(ids[1], 0, c, 3 * c).map(|(id, _)| ids.push(id)),
            expect: Expect::Atomic,
        },
        Case {
            name: "shrink of a growable sharer (unmaps its shared pages)",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let src = alloc(a, 3 * c);
                let (sh, _) = a.alloc_shared(src, 0, 3 * c, 4 * c).unwrap();
                vec![src, sh]
            },
            op: |a, ids, c| a.resize(ids[1], c).map(|_| ()),
            expect: Expect::Atomic,
        },
        Case {
            // Its calls: the event record, then the unmap of the shared pages.
            name: "resize_on_stream: shrink of a growable sharer (unmaps its shared pages)",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let src = alloc(a, 3 * c);
                let (sh, _) = a.alloc_shared(src, 0, 3 * c, 4 * c).unwrap();
                vec![src, sh]
            },
            // Stream 0: a CUstream on a GPU too.
            op: |a, ids, c| a.resize_on_stream(ids[1], c, 0).map(|_| ()),
            expect: Expect::Atomic,
        },
        Case {
            name: "free of a chunk's last holder (retain 0: its retired aliases and the chunk go)",
            cap: 8,
            reserve: 16,
            retain: 0,
            setup: |a, c| {
                let src = alloc(a, 3 * c);
                let (sh, _) = a.alloc_shared(src, c, 2 * c, 2 * c).unwrap();
                a.free(src).unwrap(); // its shared pages are retired, still mapping the chunks
                vec![sh]
            },
            op: |a, ids, _| a.free(ids.remove(0)),
            expect: Expect::BestEffort,
        },
        Case {
            name: "sleep of a sharer (the chunk an awake allocation maps stays)",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let src = alloc(a, 2 * c);
                let (sh, _) = a.alloc_shared(src, 0, c, 2 * c).unwrap();
                a.resize(sh, 2 * c).unwrap(); // a page of its own
                a.set_tag(sh, 1).unwrap();
                vec![src, sh]
            },
            op: |a, _, _| a.sleep(1, SLEEP_BACKUP),
            expect: Expect::Sleep,
        },
        Case {
            // Its call: the event record (on a GPU, then its poll).
            name: "quiesce_on_stream (records the promise's event)",
            cap: 8,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| vec![alloc(a, 2 * c), alloc(a, c), alloc(a, 700)],
            op: |a, ids, _| a.quiesce_on_stream(ids[0], 0),
            expect: Expect::Promise,
        },
        Case {
            name: "free_on_stream of a quiesced allocation (retain 0: no event, no synchronize)",
            cap: 8,
            reserve: 16,
            retain: 0,
            setup: |a, c| {
                let x = alloc(a, 2 * c);
                quiesce_kept(a, x);
                vec![x, alloc(a, c)]
            },
            // Freed at once; its chunks, known idle, go back.
            op: |a, ids, _| a.free_on_stream(ids.remove(0), 0),
            expect: Expect::BestEffort,
        },
        Case {
            name: "resize_on_stream: shrink of a quiesced allocation (retain 0: no event, no synchronize)",
            cap: 8,
            reserve: 16,
            retain: 0,
            setup: |a, c| {
                let x = alloc(a, 4 * c);
                quiesce_kept(a, x);
                vec![x, alloc(a, c)]
            },
            // The promise covers the tail: no event; known idle, it goes back.
            op: |a, ids, c| a.resize_on_stream(ids[0], c, 0).map(drop),
            expect: Expect::BestEffort,
        },
        Case {
            name: "compact of a quiesced allocation (its old range unmapped, no synchronize)",
            cap: 8,
            reserve: 8,
            retain: KEEP,
            setup: |a, c| {
                let hole = alloc(a, 2 * c); // [0, 2)
                let x = alloc(a, 2 * c); // [2, 4)
                a.free(hole).unwrap();
                a.trim(0).unwrap(); // nothing cached where x goes
                quiesce_kept(a, x);
                vec![x]
            },
            op: |a, _, _| a.compact().map(drop),
            expect: Expect::Atomic,
        },
        Case {
            name: "alloc that steals a quiesced allocation's cached chunks (no synchronize)",
            cap: 5,
            reserve: 16,
            retain: KEEP,
            setup: |a, c| {
                let x = alloc(a, 2 * c); // [0, 2)
                quiesce_kept(a, x);
                let y = alloc(a, 2 * c); // [2, 4)
                a.free(x).unwrap(); // two cached chunks, known idle once the promise is
                vec![y]
            },
            // Three pages at [4, 7): the two cached chunks and a new one.
            op: |a, ids, c| a.alloc(3 * c).map(|(id, _)| ids.push(id)),
            expect: Expect::Atomic,
        },
    ]
}

struct Row {
    name: &'static str,
    calls: u64,
    by_kind: BTreeMap<CallKind, u64>,
    moves: u64,
    injected: u64,
    /// Injected failures the arena absorbed by design (event polls).
    absorbed: u64,
}

#[test]
fn every_driver_call_of_every_operation_fails_cleanly() {
    let rows: Vec<Row> = cases().iter().map(run_case).collect();
    let total: u64 = rows.iter().map(|r| r.injected).sum();
    println!("fault matrix ({} operations x their driver calls x {} fault kinds):", rows.len(), FaultKind::ALL.len());
    for r in &rows {
        println!(
            "  {:<58} {:>2} moves {:>3} calls {:?} -> {:>3} faults{}",
            r.name,
            r.moves,
            r.calls,
            r.by_kind,
            r.injected,
            if r.absorbed > 0 { format!(" ({} absorbed: event polls)", r.absorbed) } else { String::new() }
        );
        // What a kept promise saves (host, where it holds at once): the
        // pages it gives up are known idle, unmapped without a synchronize.
        if r.name.contains("no synchronize") && test_backend() == common::TestBackend::Host {
            assert!(!r.by_kind.contains_key(&CallKind::Synchronize), "{}: {:?}", r.name, r.by_kind);
        }
    }
    println!("fault matrix size: {total} injected faults");
    assert_eq!(total, rows.iter().map(|r| r.calls * 2).sum::<u64>());
}

/// Creation: a refused reservation is retried smaller (down to the
/// capacity) and reported; a failure of every size is an error, not a panic.
#[test]
fn a_refused_reservation_falls_back_to_a_smaller_one() {
    let backend = test_backend();
    let c = backend.chunk();
    let d = backend.driver();
    d.fault.fail_nth(Some(CallKind::Reserve), 1, FaultKind::OutOfMemory);
    let cfg = ArenaConfig { capacity_bytes: 4 * c, reserve_bytes: 16 * c, chunk_bytes: c, ..ArenaConfig::default() };
    let a = Arena::with_driver(d.fault.clone(), cfg).unwrap();
    let s = a.stats().unwrap();
    assert_eq!((s.reserve_fallbacks, s.reserved_va_bytes), (1, 8 * c));
    let (id, _) = a.alloc(4 * c).unwrap();
    a.free(id).unwrap();
    drop(a);
    for kind in FaultKind::ALL {
        let d = backend.driver();
        let cfg = ArenaConfig { capacity_bytes: 4 * c, reserve_bytes: 4 * c, chunk_bytes: c, ..ArenaConfig::default() };
        d.fault.fail_nth(Some(CallKind::Reserve), 1, kind);
        let e = Arena::with_driver(d.fault.clone(), cfg).unwrap_err();
        assert_eq!(e.status(), status_of(kind), "{e}");
        assert_eq!((d.fault.live_chunks(), d.fault.live_mappings()), (0, 0));
    }
}
