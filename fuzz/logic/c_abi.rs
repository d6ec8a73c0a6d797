//! Fuzz target logic: the C ABI with arbitrary ids, sizes, flags, NULLs,
//! misaligned pointers, struct sizes and injected driver failures.
//!
//! The input bytes decode into an arena configuration (any `struct_size`,
//! backend, flag bits, chunk size, capacity, reserve, retain; a NULL or
//! misaligned config; a plain arena or one over the fault injector) and a
//! sequence of calls of every exported function, each argument drawn from
//! valid values and from bad ones (ids never issued, freed, 0, of another
//! tag; sizes 0, huge, overflowing; NULL or misaligned out-parameters;
//! `stats->struct_size` of any value; snapshot buffers too small or NULL;
//! move callbacks that call back into the arena or try to destroy it;
//! driver failures planned on any call kind).
//!
//! Checked after every call:
//! - the status is one the call may return for those arguments (never
//!   `VMM_ARENA_ERR_INTERNAL`: nothing panicked), and `vmm_arena_last_error`
//!   is a valid string;
//! - out-parameters are written only on success; a caller's struct is never
//!   written when its `struct_size` is wrong, nor past it (the buffers are
//!   exactly as large as the caller says: AddressSanitizer, on by default
//!   in cargo-fuzz, sees any overrun);
//! - every live allocation is where the model (fed by the move callback)
//!   says, as large, and its bytes (written through its pointer) survive
//!   resizes, moves, and a sleep with a backup and the wake after it (at
//!   the same address); stats agree with the model; the snapshot's tags and
//!   sleepers agree with it too (sleep selects the awake allocations of
//!   whole chunks with the tag; resize and pin of a sleeper are ASLEEP);
//!   `vmm_arena_alloc_shared` returns what its argument rules and their
//!   precedence say (allocations that may share chunks form a family: a
//!   write through one forgets what the model knew of the others' bytes;
//!   the core's model checks shared bytes); `vmm_arena_resize_on_stream`
//!   has resize's model (on the host backend, which has no asynchronous
//!   streams, it is resize), and the snapshot's `stream_shrinks` stays 0;
//!   `vmm_arena_quiesce_on_stream` of a live id is OK (ASLEEP for a
//!   sleeper), of any other UNKNOWN_ALLOCATION, and changes nothing the
//!   model sees (the promise only makes what the allocation gives up later
//!   idle at once); the snapshot's `quiesces` stays 0 (no event on the host);
//!   `vmm_arena_unquiesce` of a live id (a sleeper too) is OK, of any other
//!   UNKNOWN_ALLOCATION, and changes nothing the model sees;
//! - the snapshot the check reads (in one call, with room to spare) is
//!   NUL-terminated UTF-8 and nothing after the NUL is written;
//! - a call whose injected failure fired returns it and leaves the stats and
//!   the snapshot as they were (but `trim`, documented to keep what it
//!   released);
//! - at the end, freeing everything, releasing retired ranges and trimming
//!   to 0 leaves the driver with no chunk and no mapping.
//!
//! Included with `#[path]` by the cargo-fuzz target `fuzz/fuzz_targets/c_abi.rs`
//! and by the ffi crate's unit tests (which replay `fuzz/corpus/c_abi` on
//! stable Rust); both name the C ABI crate `ffi` in the including module.

use std::alloc::{alloc, dealloc, Layout};
use std::collections::BTreeMap;
use std::ffi::{c_char, c_void, CStr};
use std::ptr::{null, null_mut};

use super::ffi;
use ffi::{vmm_arena, vmm_arena_compact_report, vmm_arena_config, vmm_arena_stats, vmm_arena_status};

#[path = "bytes.rs"]
mod bytes;
use bytes::Bytes;
#[path = "c_abi/batch.rs"]
mod batch;
#[path = "c_abi/call.rs"]
mod call;
#[path = "c_abi/dmabuf.rs"]
mod dmabuf;
#[path = "c_abi/snapshot.rs"]
mod snapshot;
#[path = "c_abi/two_phase.rs"]
mod two_phase;
use snapshot::{json_u64, live_ranges, ranges, stats_u64, strip_driver};

// The handle is opaque to C callers: a pointer to it is FFI-safe in practice.
#[allow(improper_ctypes)]
extern "C" {
    // The library's testing hooks (ffi/src/testing.rs): exported, but not
    // part of its Rust paths.
    fn vmm_arena_testing_create_faulty(config: *const vmm_arena_config, out: *mut *mut vmm_arena) -> vmm_arena_status;
    fn vmm_arena_testing_fail_nth(arena: *mut vmm_arena, call_kind: u32, n: u64, fault: u32) -> vmm_arena_status;
    fn vmm_arena_testing_driver_objects(arena: *mut vmm_arena, chunks: *mut u64, maps: *mut u64) -> vmm_arena_status;
    fn vmm_arena_testing_driver_calls(arena: *mut vmm_arena, calls: *mut u64, injected: *mut u64) -> vmm_arena_status;
    fn vmm_arena_testing_panic(arena: *mut vmm_arena) -> vmm_arena_status;
}

const OK: u32 = 0;
const INVALID: u32 = 1;
const OOM: u32 = 2;
const OOAS: u32 = 3;
const UNKNOWN: u32 = 4;
const PINNED: u32 = 5;
const UNSUPPORTED: u32 = 6;
const DRIVER: u32 = 7;
const INTERNAL: u32 = 8;
const ASLEEP: u32 = 9;
const STALE: u32 = 10;

/// Calls per input at most.
pub const MAX_CALLS: usize = 128;
/// Capacities stay small: every chunk of the host backend is committed
/// memory, and a fresh arena's pages fault in (zeroed) as they are touched.
const MAX_CAPACITY: u64 = 16 << 20;
/// Page tables stay small (one entry per chunk of the reservation, built
/// and zeroed for every input, and walked by every snapshot).
const MAX_PAGES: u64 = 1 << 12;

/// A heap buffer of exactly `len` bytes (AddressSanitizer sees any access
/// past it), 8-aligned, filled with 0xEE.
struct Buf {
    ptr: *mut u8,
    layout: Layout,
}

impl Buf {
    fn new(len: usize) -> Buf {
        let layout = Layout::from_size_align(len.max(1), 8).expect("layout");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc(layout) };
        assert!(!ptr.is_null(), "allocation of {len} bytes failed");
        // SAFETY: `ptr` is a fresh allocation of `layout.size()` bytes.
        unsafe { ptr.write_bytes(0xEE, layout.size()) };
        Buf { ptr, layout }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` holds `layout.size()` initialized bytes owned by `self`.
        unsafe { std::slice::from_raw_parts(self.ptr, self.layout.size()) }
    }
}

impl Drop for Buf {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr, self.layout) }
    }
}

/// Whether `b` holds only 0xEE, the fill of a fresh buffer (compared a KiB
/// at a time: a byte loop here is instrumented code, slow under the fuzzer).
fn untouched(b: &[u8]) -> bool {
    const FILL: [u8; 1024] = [0xEE; 1024];
    b.chunks(FILL.len()).all(|c| c == &FILL[..c.len()])
}

fn st(s: vmm_arena_status) -> u32 {
    s as u32
}

fn last_error() -> String {
    let p = ffi::vmm_arena_last_error();
    assert!(!p.is_null(), "vmm_arena_last_error returned NULL");
    // SAFETY: never NULL, NUL-terminated and valid until the next call on this thread.
    unsafe { CStr::from_ptr(p) }.to_str().expect("last error is UTF-8").to_owned()
}

/// The calls an input made (not the checks' own), by the status they
/// returned (for the replay test's report).
pub static STATUSES: [std::sync::atomic::AtomicU64; 11] = [const { std::sync::atomic::AtomicU64::new(0) }; 11];

fn tally(status: u32) {
    if let Some(c) = STATUSES.get(status as usize) {
        c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

fn expect(what: &str, got: u32, allowed: &[u32]) {
    assert!(got != INTERNAL, "{what}: VMM_ARENA_ERR_INTERNAL: {}", last_error());
    assert!(allowed.contains(&got), "{what}: status {got}, expected one of {allowed:?}: {}", last_error());
    if got != OK {
        assert!(!last_error().is_empty(), "{what}: a failure without a last error");
    }
}

/// What the move callback saw during one call.
#[derive(Default)]
struct Recorder {
    arena: *mut vmm_arena,
    moves: Vec<(u64, u64, u64, u64)>,
    /// Call back into the arena from the callback (query and destroy).
    reenter: bool,
    reentry: Vec<u32>,
}

unsafe extern "C" fn on_move(user: *mut c_void, id: u64, old_ptr: u64, new_ptr: u64, size: u64) {
    // SAFETY: `user` is the harness's boxed Recorder, installed with this
    // callback and alive until the arena is destroyed; nothing else refers
    // to it while the arena runs the callback.
    let r = unsafe { &mut *user.cast::<Recorder>() };
    r.moves.push((id, old_ptr, new_ptr, size));
    if r.reenter {
        let mut p = 0u64;
        // SAFETY: the arena is live (it is calling us); the out-parameter is ours.
        r.reentry.push(st(unsafe { ffi::vmm_arena_query(r.arena, id, &mut p, null_mut()) }));
        // Refused from inside the callback: the arena must stay.
        // SAFETY: as above; destroy refuses a call from the arena's own callback.
        unsafe { ffi::vmm_arena_destroy(r.arena) };
        r.reentry.push(if last_error().contains("not destroyed") { INVALID } else { OK });
    }
}

#[derive(Clone, Copy, Debug)]
struct Live {
    id: u64,
    ptr: u64,
    size: u64,
    pinned: bool,
    /// The byte written at offset 0 and at the last offset.
    tag: Option<u8>,
    /// Its sleep tag (vmm_arena_set_tag).
    sleep_tag: u32,
    /// Asleep: unmapped, never touched through its pointer.
    asleep: bool,
    /// Allocations that may share chunks (vmm_arena_alloc_shared) have the
    /// same family; a touch of one forgets the bytes of the others.
    family: u64,
}

struct Harness {
    a: *mut vmm_arena,
    faulty: bool,
    chunk: u64,
    base: u64,
    reserved: u64,
    capacity: u64,
    live: BTreeMap<u64, Live>,
    issued: Vec<u64>,
    freed: Vec<u64>,
    rec: Box<Recorder>,
    /// The recording callback is installed (else moves are seen only by query).
    callback: bool,
    /// A failure is planned and has not fired yet.
    planned: bool,
    /// After a resize: (id, its tag, the address it returned), checked
    /// once the move events are applied.
    resized: Option<(u64, u8, u64)>,
    /// The configuration's retain_bytes, and the highest peak_physical_bytes read.
    retain: u64,
    peak: u64,
    /// Room for the next snapshot: the last one's length and a KiB.
    snapshot_room: std::cell::Cell<usize>,
    /// Prepared two-phase operations not yet committed or aborted.
    pending: Vec<two_phase::Pending>,
    /// Open DMA-BUF handles.
    dmabufs: Vec<dmabuf::OpenDmaBuf>,
    /// Allocations that had a DMA-BUF: exported until freed (never asleep,
    /// never a source of alloc_shared).
    exported: std::collections::BTreeSet<u64>,
    /// The last DMA-BUF of a freed allocation was closed: any later call,
    /// a failed one included, may give its chunks back (so a failed call's
    /// check holds only the live allocations to unchanged).
    reap_possible: bool,
}

fn size_of_stats() -> u32 {
    std::mem::size_of::<vmm_arena_stats>() as u32
}

impl Harness {
    fn stats(&self) -> vmm_arena_stats {
        let buf = Buf::new(std::mem::size_of::<vmm_arena_stats>());
        // SAFETY: the buffer is as large as a vmm_arena_stats and 8-aligned.
        unsafe { buf.ptr.cast::<u32>().write(size_of_stats()) };
        // SAFETY: live handle; the buffer holds struct_size writable bytes.
        expect("stats", st(unsafe { ffi::vmm_arena_stats_get(self.a, buf.ptr.cast()) }), &[OK]);
        // SAFETY: written in full by the successful call.
        unsafe { buf.ptr.cast::<vmm_arena_stats>().read() }
    }

    /// The snapshot's text, in one call where the last length says how
    /// much room it needs (a spare KiB), else in two (the length, then an
    /// exact buffer). Every byte past the NUL must stay as it was.
    fn snapshot(&self) -> String {
        let cap = self.snapshot_room.get();
        // A heap buffer of exactly `cap` bytes (AddressSanitizer sees any
        // write past it), filled with 0xEE.
        let mut buf = vec![0xEEu8; cap];
        buf.shrink_to_fit();
        let mut len = 0usize;
        // SAFETY: live handle; the buffer has `cap` writable bytes.
        let s = unsafe { ffi::vmm_arena_snapshot_json(self.a, buf.as_mut_ptr().cast::<c_char>(), cap, &mut len) };
        expect("snapshot", st(s), &[OK]);
        if len > cap {
            assert!(untouched(&buf), "a snapshot too large for its buffer wrote to it");
            buf = vec![0xEEu8; len];
            buf.shrink_to_fit();
            let mut len2 = 0usize;
            // SAFETY: the buffer has `len` writable bytes.
            let s = unsafe { ffi::vmm_arena_snapshot_json(self.a, buf.as_mut_ptr().cast::<c_char>(), len, &mut len2) };
            expect("snapshot", st(s), &[OK]);
            assert_eq!(len2, len);
        }
        self.snapshot_room.set(len + 1024);
        assert_eq!(buf[len - 1], 0, "the snapshot is NUL-terminated");
        assert!(untouched(&buf[len..]), "the snapshot wrote past its NUL");
        buf.truncate(len - 1);
        String::from_utf8(buf).expect("the snapshot is UTF-8")
    }

    fn calls(&self) -> (u64, u64) {
        let (mut c, mut i) = (0, 0);
        // SAFETY: live handle; out-parameters are ours.
        let s = unsafe { vmm_arena_testing_driver_calls(self.a, &mut c, &mut i) };
        expect("driver calls", st(s), &[OK]);
        (c, i)
    }

    fn driver_objects(&self) -> (u64, u64) {
        let (mut c, mut m) = (0, 0);
        // SAFETY: live handle; out-parameters are ours.
        let s = unsafe { vmm_arena_testing_driver_objects(self.a, &mut c, &mut m) };
        expect("driver objects", st(s), &[OK]);
        (c, m)
    }

    fn pick_id(&self, b: &mut Bytes<'_>) -> u64 {
        let live: Vec<u64> = self.live.keys().copied().collect();
        match b.below(8) {
            0..=3 if !live.is_empty() => live[b.below(live.len() as u64) as usize],
            4 if !self.freed.is_empty() => self.freed[b.below(self.freed.len() as u64) as usize],
            5 => 0,
            6 if !live.is_empty() => live[b.below(live.len() as u64) as usize] ^ (1 << (32 + b.below(32))),
            _ => b.u64(),
        }
    }

    fn pick_size(&self, b: &mut Bytes<'_>) -> u64 {
        let c = self.chunk;
        match b.below(10) {
            0 => 0,
            1 => b.u64(),
            2 => u64::MAX - b.below(2 * c),
            3 | 4 => 1 + b.below(c / 2),
            5 | 6 => 1 + b.below(8 * c),
            7 => 1 + b.below(40 * c),
            _ => c * (1 + b.below(8)),
        }
    }

    /// Checks the model against the arena: addresses (after the moves the
    /// callback reported), sizes, bytes, counts.
    fn check(&mut self, what: &str) {
        if std::env::var_os("VMM_ARENA_FUZZ_DEBUG").is_some() {
            let s = self.stats();
            let chunks = if self.faulty { self.driver_objects().0 as i64 } else { -1 };
            eprintln!(
                "after {what}: mapped {} pooled {} live {} driver chunks {chunks}",
                s.mapped_bytes, s.pooled_bytes, s.live_allocations
            );
        }
        for (id, old, new, _size) in std::mem::take(&mut self.rec.moves) {
            let l = self.live.get_mut(&id).unwrap_or_else(|| panic!("{what}: a move of unknown id {id:#x}"));
            assert_eq!(l.ptr, old, "{what}: move of {id:#x} from an address it was not at");
            assert!(!l.pinned && !l.asleep, "{what}: pinned or sleeping {id:#x} moved");
            l.ptr = new;
        }
        for r in std::mem::take(&mut self.rec.reentry) {
            assert_eq!(r, INVALID, "{what}: a call from inside the move callback was not refused");
        }
        for l in self.live.values_mut() {
            let (mut p, mut n) = (0u64, 0u64);
            // SAFETY: live handle; out-parameters are ours.
            let s = unsafe { ffi::vmm_arena_query(self.a, l.id, &mut p, &mut n) };
            expect("query of a live id", st(s), &[OK]);
            if !self.callback {
                assert!(!(l.pinned || l.asleep) || p == l.ptr, "{what}: pinned or sleeping {:#x} moved", l.id);
                l.ptr = p;
            }
            assert_eq!((p, n), (l.ptr, l.size), "{what}: {:#x} is not where and as large as the model says", l.id);
            assert!(p % 256 == 0 && p >= self.base && p + n <= self.base + self.reserved, "{what}: {p:#x}+{n}");
            if let (Some(t), false) = (l.tag, l.asleep) {
                // SAFETY: a live allocation of the host backend: `size`
                // bytes of process memory mapped readable at `ptr`.
                let (first, last) = unsafe { ((p as *const u8).read(), ((p + n - 1) as *const u8).read()) };
                assert_eq!((first, last), (t, t), "{what}: the bytes of {:#x} changed", l.id);
            }
        }
        let s = self.stats();
        assert_eq!(s.struct_size, size_of_stats());
        assert_eq!(s.live_allocations, self.live.len() as u64, "{what}: live_allocations");
        assert_eq!(s.live_bytes, self.live.values().map(|l| l.size).sum::<u64>(), "{what}: live_bytes");
        assert!(s.mapped_bytes + s.pooled_bytes <= s.capacity_bytes, "{what}: held memory beyond the capacity");
        assert_eq!(s.capacity_bytes, self.capacity);
        assert!(s.peak_physical_bytes >= self.peak, "{what}: peak_physical_bytes went down");
        assert!(s.peak_physical_bytes >= s.mapped_bytes + s.pooled_bytes, "{what}: held memory above the peak");
        self.peak = s.peak_physical_bytes;
        // The driver's chunks against the memory held, from one snapshot
        // (stats and chunks in flight read together). With the background
        // worker on (a config flag), a round may be in flight (its chunks
        // count as pooled before the driver has them) or start at any
        // moment: the comparison is made only when the driver's count is
        // the same just before and just after a snapshot with nothing in
        // flight, which is always so without the worker.
        let chunks_before = self.faulty.then(|| self.driver_objects().0);
        let snap = self.snapshot();
        if let Some(before) = chunks_before {
            let (after, _) = self.driver_objects();
            let [mapped, pooled, failed] = stats_u64(&snap, ["mapped_bytes", "pooled_bytes", "release_failures"]);
            if before == after && json_u64(&snap, "inflight_chunks") == 0 {
                if failed == 0 {
                    assert_eq!(after * self.chunk, mapped + pooled, "{what}: driver chunks vs held memory");
                } else {
                    // A chunk of an exported or DMA-BUF'd allocation whose
                    // release failed is kept apart (never pooled), released
                    // when the arena is dropped: the driver holds it beyond
                    // what the stats count.
                    assert!(after * self.chunk >= mapped + pooled, "{what}: driver chunks below held memory");
                }
            }
        }
        let [release_failures, stream_shrinks, quiesces] =
            stats_u64(&snap, ["release_failures", "stream_shrinks", "quiesces"]);
        if release_failures == 0 {
            // (A give-back that failed keeps its chunks pooled until one succeeds.)
            assert!(s.pooled_bytes <= self.retain, "{what}: pooled_bytes above retain_bytes");
        }
        // The host backend records no event: resize_on_stream is resize,
        // and quiesce_on_stream's promise holds at once.
        assert_eq!(stream_shrinks, 0, "{what}: a stream shrink on the host");
        assert_eq!(quiesces, 0, "{what}: a quiesce event on the host");
        let (ranges, slabs) = ranges(&snap);
        for l in self.live.values() {
            // Small allocations live in slabs, not in ranges of their own,
            // and have their slab's tag and sleep.
            let in_slab =
                || slabs.iter().find(|&&(at, len, ..)| at <= l.ptr && l.ptr < at + len).map(|&(.., t, z)| (t, z));
            let (tag, asleep) = ranges.get(&l.id).copied().or_else(in_slab).expect("a range or a slab");
            assert_eq!((tag, asleep), (l.sleep_tag, l.asleep), "{what}: tag and sleep of {:#x}", l.id);
        }
    }

    /// Writes the tag bytes of a live allocation through its pointer.
    fn touch(&mut self, id: u64, tag: u8) {
        let l = self.live.get_mut(&id).expect("live");
        assert!(!l.asleep, "the harness touches a sleeper");
        // SAFETY: a live allocation of the host backend: `size` bytes of
        // process memory mapped writable at `ptr`, owned by this harness.
        unsafe {
            (l.ptr as *mut u8).write(tag);
            ((l.ptr + l.size - 1) as *mut u8).write(tag);
        }
        l.tag = Some(tag);
        let family = l.family;
        for o in self.live.values_mut().filter(|o| o.family == family && o.id != id) {
            o.tag = None;
        }
    }

    fn new_id(&mut self, what: &str, id: u64, ptr: u64, size: u64) {
        assert!(id != 0 && !self.issued.contains(&id), "{what}: id {id:#x} issued twice");
        self.issued.push(id);
        self.live.insert(id, Live { id, ptr, size, pinned: false, tag: None, sleep_tag: 0, asleep: false, family: id });
    }

    /// vmm_arena_resize, or vmm_arena_resize_on_stream on `stream`: one
    /// model for both, since on the host backend (no asynchronous streams)
    /// the latter resizes exactly as the former. Returns the status and
    /// the statuses allowed.
    fn resize(&mut self, b: &mut Bytes<'_>, stream: Option<u64>) -> (u32, Vec<u32>) {
        let what = if stream.is_some() { "resize_on_stream" } else { "resize" };
        let id = self.pick_id(b);
        let size = self.pick_size(b);
        let bad = b.below(16) == 0;
        let mut p = 0xA5A5u64;
        let out = if bad { null_mut() } else { &mut p as *mut u64 };
        // SAFETY: live handle; the out-parameter is ours or NULL.
        let status = st(unsafe {
            match stream {
                None => ffi::vmm_arena_resize(self.a, id, size, out),
                Some(s) => ffi::vmm_arena_resize_on_stream(self.a, id, size, s, out),
            }
        });
        // The size is checked first: 0, or overflowing when rounded up.
        let bad_size = size == 0 || size.checked_add(self.chunk - 1).is_none();
        let allowed = match (bad, self.live.get(&id)) {
            (true, _) => vec![INVALID],
            (false, None) => vec![UNKNOWN, INVALID],
            (false, Some(_)) if size == 0 => vec![INVALID],
            (false, Some(l)) if l.asleep => vec![if bad_size { INVALID } else { ASLEEP }],
            // An allocation with a DMA-BUF open is pinned by it.
            (false, Some(l)) if l.pinned || self.exported.contains(&id) => vec![OK, INVALID, OOM, OOAS, PINNED],
            (false, Some(_)) => vec![OK, INVALID, OOM, OOAS],
        };
        if status == OK {
            // The address follows from the move events (checked below).
            let l = self.live.get_mut(&id).unwrap();
            l.size = size;
            if let Some(t) = l.tag.take() {
                self.resized = Some((id, t, p));
            }
        } else {
            assert_eq!(p, 0xA5A5, "{what}: out-parameter written on failure");
        }
        (status, allowed)
    }
}

/// A tag for set_tag, sleep and wake: one of a few, every tag, or any.
fn pick_tag(b: &mut Bytes<'_>) -> u32 {
    match b.below(8) {
        0..=4 => b.below(3) as u32,
        5 | 6 => ffi::VMM_ARENA_ALL_TAGS,
        _ => b.u32(),
    }
}

/// A configuration drawn from the input: valid values mostly, any value
/// sometimes, within memory bounds (see MAX_CAPACITY, MAX_PAGES).
fn config(b: &mut Bytes<'_>) -> vmm_arena_config {
    let mut c = vmm_arena_config {
        struct_size: 0,
        backend: 0,
        device: 0,
        flags: 0,
        capacity_bytes: 0,
        reserve_bytes: 0,
        chunk_bytes: 0,
        retain_bytes: 0,
    };
    // SAFETY: a writable config.
    unsafe { ffi::vmm_arena_config_default(&mut c) };
    assert_eq!(c.struct_size as usize, std::mem::size_of::<vmm_arena_config>());
    c.struct_size = match b.below(12) {
        0 => b.u32(),
        1 => c.struct_size.wrapping_add(b.below(9) as u32).wrapping_sub(4),
        _ => c.struct_size,
    };
    c.backend = match b.below(16) {
        0 => 1,
        1 => b.u32(),
        _ => 0,
    };
    c.device = b.below(3) as i32 - 1;
    c.flags = match b.below(8) {
        0 => b.u32(),
        1 | 2 => ffi::VMM_ARENA_FLAG_NO_IMPLICIT_MOVES,
        _ => 0,
    };
    c.chunk_bytes = match b.below(10) {
        0 => 0,
        1 => 4096,
        2 => 4096 * (1 + b.below(64)),
        3 => b.u64(),
        _ => 64 << 10,
    };
    let chunk = if c.chunk_bytes == 0 { 2 << 20 } else { c.chunk_bytes };
    c.capacity_bytes = match b.below(8) {
        0 => b.u64() % (MAX_CAPACITY + 1),
        1 => 1 + b.below(chunk.min(MAX_CAPACITY)),
        _ => chunk.saturating_mul(1 + b.below(32)),
    };
    if c.capacity_bytes == 0 || c.capacity_bytes > MAX_CAPACITY {
        c.capacity_bytes = MAX_CAPACITY / 2;
    }
    c.reserve_bytes = match b.below(8) {
        0..=2 => 0,
        3 => b.u64(),
        4 => 1 + b.below(2 * c.capacity_bytes),
        _ => chunk.saturating_mul(1 + b.below(64)),
    };
    let reserve = if c.reserve_bytes == 0 { c.capacity_bytes.saturating_mul(4) } else { c.reserve_bytes };
    // (A reserve that overflows when rounded up is refused before any page table.)
    if reserve / chunk > MAX_PAGES && reserve <= u64::MAX - chunk {
        c.reserve_bytes = chunk.saturating_mul(MAX_PAGES / 2);
    }
    c.retain_bytes = match b.below(4) {
        0 => 0,
        1 => chunk.saturating_mul(b.below(8)),
        2 => b.u64(),
        _ => u64::MAX,
    };
    c
}

/// Runs one input (the replay test's body): everything, including a caught
/// panic that poisons the arena at the end of some inputs.
#[allow(dead_code)] // the fuzz target uses `run_fuzzing`
pub fn run(data: &[u8]) {
    run_with(data, true)
}

/// Runs one input under libFuzzer (the fuzz target's body), whose panic
/// hook aborts on any panic, even one the library's boundary catches: the
/// poisoning step (`vmm_arena_testing_panic`) is left to the replay.
#[allow(dead_code)] // the replay test uses `run`
pub fn run_fuzzing(data: &[u8]) {
    run_with(data, false)
}

fn run_with(data: &[u8], may_panic: bool) {
    let mut b = Bytes::new(data);
    let cfg = config(&mut b);
    // VMM_ARENA_FUZZ_DEBUG=1: print what the input decodes to (to study a crash).
    let debug = std::env::var_os("VMM_ARENA_FUZZ_DEBUG").is_some();
    if debug {
        eprintln!("{cfg:?}");
    }
    let faulty = b.bool();
    let how = b.below(16);
    let poison_at_end = b.below(8) == 0;
    // The config exactly as large as its struct_size says (at least the
    // u32), or misaligned, or NULL.
    let len = (cfg.struct_size as usize).clamp(4, std::mem::size_of::<vmm_arena_config>());
    let buf = Buf::new(len + 1);
    let p = if how == 1 { buf.ptr.wrapping_add(1) } else { buf.ptr };
    // SAFETY: `p` has `len` writable bytes inside the buffer; the config's
    // fields are plain integers.
    unsafe { std::ptr::copy_nonoverlapping((&cfg as *const vmm_arena_config).cast::<u8>(), p, len) };
    let cfg_ptr: *const vmm_arena_config = if how == 0 { null() } else { p.cast() };
    let null_out = how == 2;
    let mut a: *mut vmm_arena = 0xA5A5 as *mut vmm_arena;
    let out: *mut *mut vmm_arena = if null_out { null_mut() } else { &mut a };
    // SAFETY: the config is NULL, misaligned (refused before any read) or
    // `len` readable bytes, where `len` covers struct_size whenever the
    // library reads past the u32 (struct_size == sizeof); `out` is ours or NULL.
    let status = st(unsafe {
        if faulty {
            vmm_arena_testing_create_faulty(cfg_ptr, out)
        } else {
            ffi::vmm_arena_create(cfg_ptr, out)
        }
    });
    tally(status);
    if status != OK {
        expect("create", status, &[INVALID, OOM, UNSUPPORTED]);
        assert_eq!(a, 0xA5A5 as *mut vmm_arena, "create wrote its out-parameter on failure");
        return;
    }
    assert!(!a.is_null() && !null_out && cfg_ptr == p.cast::<vmm_arena_config>().cast_const());
    if cfg.backend != 0 {
        // A CUDA arena (on a machine with a GPU): not what this target tests.
        assert_eq!(cfg.backend, 1, "an unknown backend was accepted");
        // SAFETY: a live handle, given up here.
        unsafe { ffi::vmm_arena_destroy(a) };
        return;
    }
    let known = ffi::VMM_ARENA_FLAG_NO_IMPLICIT_MOVES
        | ffi::VMM_ARENA_FLAG_BACKGROUND
        | ffi::VMM_ARENA_FLAG_EXPORTABLE
        | ffi::VMM_ARENA_FLAG_DETERMINISTIC_PLACEMENT;
    assert_eq!(cfg.flags & !known, 0, "unknown flag bits accepted");
    let mut h = Harness {
        a,
        faulty,
        chunk: 0,
        base: 0,
        reserved: 0,
        capacity: 0,
        live: BTreeMap::new(),
        issued: Vec::new(),
        freed: Vec::new(),
        rec: Box::new(Recorder { arena: a, ..Recorder::default() }),
        callback: false,
        planned: false,
        resized: None,
        retain: cfg.retain_bytes,
        peak: 0,
        snapshot_room: std::cell::Cell::new(4096),
        pending: Vec::new(),
        dmabufs: Vec::new(),
        exported: Default::default(),
        reap_possible: false,
    };
    if b.below(4) != 0 {
        let user: *mut Recorder = &mut *h.rec;
        // SAFETY: live handle; `on_move` follows the callback rules and the
        // boxed Recorder outlives the arena.
        expect(
            "set_move_callback",
            st(unsafe { ffi::vmm_arena_set_move_callback(a, Some(on_move), user.cast()) }),
            &[OK],
        );
        h.callback = true;
    }
    let snap = h.snapshot();
    h.chunk = json_u64(&snap, "chunk_bytes");
    h.base = json_u64(&snap, "base");
    let s = h.stats();
    (h.reserved, h.capacity) = (s.reserved_va_bytes, s.capacity_bytes);
    assert!(h.capacity <= cfg.capacity_bytes && h.capacity % h.chunk == 0 && h.capacity > 0);
    let mut calls = 0;
    while !b.is_empty() && calls < MAX_CALLS {
        h.step(&mut b);
        calls += 1;
    }
    // Tear down: the arena gives everything back.
    if h.faulty {
        // SAFETY: live handle.
        expect("clear", st(unsafe { vmm_arena_testing_fail_nth(a, 0, 0, 0) }), &[OK]);
    }
    // Open DMA-BUFs are closed first: dropping the arena with one open is
    // the caller's error.
    for d in std::mem::take(&mut h.dmabufs) {
        // SAFETY: a live DMA-BUF handle, given up here.
        unsafe { ffi::vmm_arena_dmabuf_close(d.handle) };
    }
    // Pending prepared handles are consumed (an abort: OK, or STALE when
    // another call changed the allocation since).
    for p in std::mem::take(&mut h.pending) {
        // SAFETY: live arena; a pending handle of it, given up here.
        let s = st(unsafe { ffi::vmm_arena_abort(a, p.handle) });
        expect("abort at the end", s, &[OK, STALE]);
        if s == OK && p.frees == Some(false) {
            h.live.remove(&p.id);
        }
        if s == OK {
            if let Some((to, false)) = p.shrinks {
                h.live.get_mut(&p.id).expect("live").size = to;
            }
        }
    }
    for id in h.live.keys().copied().collect::<Vec<_>>() {
        // SAFETY: live handle.
        expect("free at the end", st(unsafe { ffi::vmm_arena_free(a, id) }), &[OK]);
        h.live.remove(&id);
    }
    // SAFETY: live handle.
    expect("release_retired at the end", st(unsafe { ffi::vmm_arena_release_retired(a) }), &[OK]);
    // SAFETY: live handle.
    expect("trim at the end", st(unsafe { ffi::vmm_arena_trim(a, 0, null_mut()) }), &[OK]);
    h.check("teardown");
    let s = h.stats();
    assert_eq!((s.mapped_bytes, s.pooled_bytes, s.retired_va_bytes), (0, 0, 0));
    assert_eq!(s.free_va_bytes, s.reserved_va_bytes);
    if h.faulty {
        let (chunks, mappings) = h.driver_objects();
        let failed = json_u64(&h.snapshot(), "release_failures");
        // Chunks of exported or DMA-BUF'd allocations whose release failed
        // are released when the arena is dropped, not before.
        assert!(mappings == 0 && chunks <= failed, "the driver still holds {chunks} chunks, {mappings} mappings");
    }
    if poison_at_end && may_panic {
        // A caught panic poisons the arena: every call refuses, destroy still works.
        // SAFETY: live handle.
        assert_eq!(st(unsafe { vmm_arena_testing_panic(a) }), INTERNAL);
        let (mut x, mut y) = (0xA5A5u64, 0xA5A5u64);
        // SAFETY: live (poisoned) handle; out-parameters are ours.
        assert_eq!(st(unsafe { ffi::vmm_arena_alloc(a, 1, &mut x, &mut y) }), INTERNAL);
        assert!(last_error().contains("poisoned") && (x, y) == (0xA5A5, 0xA5A5));
    }
    // SAFETY: live handle, given up here; the Recorder outlives it.
    unsafe { ffi::vmm_arena_destroy(a) };
    drop(h);
}
