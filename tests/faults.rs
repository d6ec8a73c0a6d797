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

use std::collections::BTreeMap;

use common::{read_all, stats_sans_driver, test_backend, Kind, Snap, TestDriver};
use vmm_arena::driver::fault::FaultKind;
use vmm_arena::driver::CallKind;
use vmm_arena::{Arena, ArenaConfig, Id, Result, Stats, Status, ALL_TAGS, SLEEP_BACKUP};

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

fn status_of(kind: FaultKind) -> Status {
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

struct Row {
    name: &'static str,
    calls: u64,
    by_kind: BTreeMap<CallKind, u64>,
    moves: u64,
    injected: u64,
    /// Injected failures the arena absorbed by design (event polls).
    absorbed: u64,
}

fn run_case(case: &Case) -> Row {
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
