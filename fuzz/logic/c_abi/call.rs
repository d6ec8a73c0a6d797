//! One call of the C ABI fuzz target: a byte of the input picks the
//! function, the next ones its arguments (sometimes invalid), and the
//! outcome is checked against the harness's books.

use super::*;

impl Harness {
    /// One call; returns false when the input asked to stop.
    pub(super) fn step(&mut self, b: &mut Bytes<'_>) {
        let a = self.a;
        let fault_ok: &[u32] = &[OOM, DRIVER];
        let before = if self.planned { Some((self.stats(), strip_driver(&self.snapshot()))) } else { None };
        let injected0 = if self.faulty { self.calls().1 } else { 0 };
        let null_sometimes = |b: &mut Bytes<'_>| b.below(16) == 0;
        // One byte picks the call: modulo 29, but 0xF8..=0xFF pick
        // alloc_shared, 0xF0..=0xF7 resize_on_stream, 0xEE..=0xEF unquiesce
        // and 0xE8..=0xED quiesce_on_stream (added later: older inputs
        // decode as they did, except where such a byte picks a call).
        // Likewise 0xE4..=0xE7 resize_many (of 1 to 4: the low bits) and
        // 0xE0..=0xE3 maintain, 0xDC..=0xDF the two-phase calls and
        // 0xD8..=0xDB DMA-BUF open and close.
        let sel = b.u8();
        let kind = match sel {
            0xF8.. => 29,
            0xF0.. => 30,
            0xEE.. => 32,
            0xE8.. => 31,
            0xE4.. => 33,
            0xE0.. => 34,
            0xDC.. => 35,
            0xD8.. => 36,
            _ => sel as u64 % 29,
        };
        let mut trim = false;
        // maintain is best effort: a failure keeps the rounds completed
        // before it (the header), so only live allocations must be as before.
        let mut maintain = false;
        // A commit or abort of an unchanged allocation must return OK even
        // when a planned failure fired in it (the two-phase guarantee).
        let mut settle_guarantee = false;
        let what: &str;
        let status: u32;
        let mut allowed: Vec<u32>;
        match kind {
            0..=4 => {
                // One in five with a tag (vmm_arena_alloc_tagged).
                let tag = (kind == 4).then(|| pick_tag(b));
                what = if tag.is_some() { "alloc_tagged" } else { "alloc" };
                let size = self.pick_size(b);
                let (mut id, mut p) = (0xA5A5u64, 0xA5A5u64);
                let (oid, optr) = (null_sometimes(b), null_sometimes(b));
                let (out_id, out_ptr) =
                    (if oid { null_mut() } else { &mut id }, if optr { null_mut() } else { &mut p });
                // SAFETY: live handle; out-parameters are ours or NULL.
                status = st(unsafe {
                    match tag {
                        Some(t) => ffi::vmm_arena_alloc_tagged(a, size, t, out_id, out_ptr),
                        None => ffi::vmm_arena_alloc(a, size, out_id, out_ptr),
                    }
                });
                allowed = if oid || optr || size == 0 { vec![INVALID] } else { vec![OK, INVALID, OOM, OOAS] };
                if status == OK {
                    self.new_id(what, id, p, size);
                    self.live.get_mut(&id).unwrap().sleep_tag = tag.unwrap_or(0);
                    self.touch(id, b.u8());
                } else {
                    assert_eq!((id, p), (0xA5A5, 0xA5A5), "{what}: out-parameters written on failure");
                }
            }
            5 | 6 => {
                what = "alloc_growable";
                let size = self.pick_size(b);
                let max = if b.bool() { size.saturating_add(b.below(16 * self.chunk)) } else { self.pick_size(b) };
                let (mut id, mut p) = (0xA5A5u64, 0xA5A5u64);
                let bad = null_sometimes(b);
                // SAFETY: live handle; out-parameters are ours or NULL.
                status = st(unsafe {
                    ffi::vmm_arena_alloc_growable(a, size, max, &mut id, if bad { null_mut() } else { &mut p })
                });
                allowed = if bad || size == 0 || max < size { vec![INVALID] } else { vec![OK, INVALID, OOM, OOAS] };
                if status == OK {
                    self.new_id(what, id, p, size);
                    self.touch(id, b.u8());
                } else {
                    assert_eq!((id, p), (0xA5A5, 0xA5A5), "{what}: out-parameters written on failure");
                }
            }
            7 | 8 => {
                what = "free";
                let id = self.pick_id(b);
                // SAFETY: live handle.
                status = st(unsafe { ffi::vmm_arena_free(a, id) });
                allowed = if self.live.contains_key(&id) { vec![OK] } else { vec![UNKNOWN] };
                if status == OK {
                    self.live.remove(&id);
                    self.exported.remove(&id);
                    self.freed.push(id);
                }
            }
            9..=11 => {
                what = "resize";
                (status, allowed) = self.resize(b, None);
            }
            30 => {
                what = "resize_on_stream";
                let stream = match b.below(4) {
                    0 => 0,
                    1 => 1 + b.below(8),
                    _ => b.u64(),
                };
                (status, allowed) = self.resize(b, Some(stream));
            }
            31 => {
                what = "quiesce_on_stream";
                let id = self.pick_id(b);
                let stream = match b.below(4) {
                    0 => 0,
                    1 => 1 + b.below(8),
                    _ => b.u64(),
                };
                // SAFETY: live handle; the host driver takes any stream.
                status = st(unsafe { ffi::vmm_arena_quiesce_on_stream(a, id, stream) });
                // A promise of no more work: nothing the model knows changes
                // (the allocation stays usable; only what it gives up later
                // becomes idle at once, and growth or sleep ends it).
                allowed = match self.live.get(&id) {
                    None => vec![UNKNOWN],
                    Some(l) if l.asleep => vec![ASLEEP],
                    Some(_) => vec![OK],
                };
            }
            32 => {
                what = "unquiesce";
                let id = self.pick_id(b);
                // SAFETY: live handle.
                status = st(unsafe { ffi::vmm_arena_unquiesce(a, id) });
                // Ends a promise, or changes nothing: no driver call, and
                // nothing the model knows changes (a sleeper too).
                allowed = match self.live.get(&id) {
                    None => vec![UNKNOWN],
                    Some(_) => vec![OK],
                };
            }
            12 => {
                what = "query";
                let id = self.pick_id(b);
                let (mut p, mut n) = (0xA5A5u64, 0xA5A5u64);
                let (np, nn) = (b.bool(), b.bool());
                // SAFETY: live handle; out-parameters are ours or NULL.
                status = st(unsafe {
                    ffi::vmm_arena_query(
                        a,
                        id,
                        if np { null_mut() } else { &mut p },
                        if nn { null_mut() } else { &mut n },
                    )
                });
                allowed = if self.live.contains_key(&id) { vec![OK] } else { vec![UNKNOWN] };
                if status == OK {
                    let l = self.live[&id];
                    assert_eq!((p, n), (if np { 0xA5A5 } else { l.ptr }, if nn { 0xA5A5 } else { l.size }));
                }
            }
            13 | 14 => {
                let pin = kind == 13;
                what = if pin { "pin" } else { "unpin" };
                let id = self.pick_id(b);
                // SAFETY: live handle.
                status = st(unsafe {
                    if pin {
                        ffi::vmm_arena_pin(a, id)
                    } else {
                        ffi::vmm_arena_unpin(a, id)
                    }
                });
                allowed = match self.live.get(&id) {
                    None => vec![UNKNOWN],
                    Some(l) if pin && l.asleep => vec![ASLEEP],
                    Some(_) => vec![OK],
                };
                if status == OK {
                    self.live.get_mut(&id).unwrap().pinned = pin;
                }
            }
            15 => {
                what = "compact";
                let mut r = vmm_arena_compact_report::default();
                let null = b.bool();
                // SAFETY: live handle; the report is ours or NULL.
                status = st(unsafe { ffi::vmm_arena_compact(a, if null { null_mut() } else { &mut r }) });
                allowed = vec![OK];
                if status == OK && !null {
                    assert!(r.largest_free_va_after >= r.largest_free_va_before, "{what}: {r:?}");
                }
            }
            16 => {
                what = "release_retired";
                // SAFETY: live handle.
                status = st(unsafe { ffi::vmm_arena_release_retired(a) });
                allowed = vec![OK];
            }
            17 => {
                what = "trim";
                trim = true;
                let keep = match b.below(3) {
                    0 => 0,
                    1 => self.chunk * b.below(8),
                    _ => b.u64(),
                };
                let mut released = 0xA5A5u64;
                let null = b.bool();
                // SAFETY: live handle; the out-parameter is ours or NULL.
                status = st(unsafe { ffi::vmm_arena_trim(a, keep, if null { null_mut() } else { &mut released }) });
                allowed = vec![OK];
                if status == OK && !null {
                    assert_eq!(released % self.chunk, 0, "{what}: released {released}");
                    // What pooled_bytes counts, slabs of retired objects included.
                    let s = self.stats();
                    assert!(s.pooled_bytes <= keep, "{what}: more than keep_bytes stays pooled");
                } else if status != OK {
                    assert_eq!(released, 0xA5A5, "{what}: out-parameter written on failure");
                }
            }
            18 => {
                what = "stats_get with any struct_size";
                let real = size_of_stats();
                let size = match b.below(4) {
                    0 => real,
                    1 => real.wrapping_add(b.below(17) as u32).wrapping_sub(8),
                    2 => b.below(256) as u32,
                    _ => b.u32(),
                };
                let how = b.below(8);
                // The caller's struct is as large as its struct_size says
                // (at least the u32 itself, at most 256 bytes).
                let len = (size as usize).clamp(4, 256);
                let buf = Buf::new(len + 1);
                let p = if how == 0 { buf.ptr.wrapping_add(1) } else { buf.ptr };
                // SAFETY: `p` has at least 4 writable bytes inside the buffer.
                unsafe { p.cast::<u32>().write_unaligned(size) };
                let arg = if how == 1 { null_mut() } else { p.cast::<vmm_arena_stats>() };
                // SAFETY: live handle; `arg` is NULL, misaligned (refused
                // before any read), or a buffer of `len` >= struct_size bytes
                // (capped at 256, but the library reads only the u32 of a
                // wrong struct_size).
                status = st(unsafe { ffi::vmm_arena_stats_get(a, arg) });
                allowed = if how <= 1 || size != real { vec![INVALID] } else { vec![OK] };
                let after = &buf.bytes()[if how == 0 { 1 } else { 0 }..];
                if status != OK {
                    assert!(after[4..len].iter().all(|&x| x == 0xEE), "{what}: a refused struct was written");
                }
            }
            19 => {
                what = "snapshot_json with any buffer";
                let mut need = 0usize;
                // SAFETY: live handle; asks only the length.
                expect(what, st(unsafe { ffi::vmm_arena_snapshot_json(a, null_mut(), 0, &mut need) }), &[OK]);
                let cap = match b.below(6) {
                    0 => 0,
                    1 => need - 1,
                    2 => need,
                    3 => need + 1 + b.below(64) as usize,
                    _ => b.below(4096) as usize,
                };
                let (null_buf, null_len) = (b.below(4) == 0, b.below(8) == 0);
                let buf = Buf::new(cap);
                let mut len = 0xA5A5usize;
                // SAFETY: live handle; the buffer has `cap` writable bytes (or is NULL).
                status = st(unsafe {
                    ffi::vmm_arena_snapshot_json(
                        a,
                        if null_buf { null_mut() } else { buf.ptr.cast() },
                        cap,
                        if null_len { null_mut() } else { &mut len },
                    )
                });
                allowed = if null_len || (null_buf && cap >= need) { vec![INVALID] } else { vec![OK] };
                if status == OK {
                    assert_eq!(len, need);
                    if cap >= need {
                        assert_eq!(buf.bytes()[need - 1], 0);
                        assert!(buf.bytes()[need..cap].iter().all(|&x| x == 0xEE), "{what}: wrote past the JSON");
                    }
                }
                if status != OK || cap < need {
                    assert!(buf.bytes()[..cap].iter().all(|&x| x == 0xEE), "{what}: wrote a buffer it refused");
                }
            }
            20 => {
                what = "set_move_callback";
                let mode = b.below(3);
                self.rec.reenter = mode == 2;
                let user: *mut Recorder = &mut *self.rec;
                let f: ffi::vmm_arena_move_fn = if mode == 0 { None } else { Some(on_move) };
                // SAFETY: live handle; `on_move` follows the callback rules
                // and `user` (the boxed Recorder) outlives the arena.
                status = st(unsafe { ffi::vmm_arena_set_move_callback(a, f, user.cast()) });
                allowed = vec![OK];
                self.callback = mode != 0;
            }
            21 => {
                what = "testing_fail_nth";
                let call_kind = if b.below(8) == 0 { b.u32() } else { b.below(12) as u32 };
                let n = b.below(10);
                let fault = if b.below(8) == 0 { b.u32() } else { b.below(2) as u32 };
                // SAFETY: live handle.
                status = st(unsafe { vmm_arena_testing_fail_nth(a, call_kind, n, fault) });
                allowed = if !self.faulty || call_kind > 11 || fault > 1 { vec![INVALID] } else { vec![OK] };
                if status == OK {
                    self.planned = n > 0;
                }
            }
            22 => {
                what = "write and check bytes";
                status = OK;
                allowed = vec![OK];
                if !self.live.is_empty() {
                    let id = *self.live.keys().nth(b.below(self.live.len() as u64) as usize).unwrap();
                    let t = b.u8();
                    if !self.live[&id].asleep {
                        self.touch(id, t);
                    }
                }
            }
            23 => {
                what = "functions without an arena";
                let (mut x, mut y) = (0u64, 0u64);
                let mut len = 0usize;
                // SAFETY: NULL handles are allowed and refused; out-parameters are ours.
                let all = unsafe {
                    [
                        st(ffi::vmm_arena_alloc(null_mut(), 1, &mut x, &mut y)),
                        st(ffi::vmm_arena_free(null_mut(), b.u64())),
                        st(ffi::vmm_arena_query(null_mut(), b.u64(), &mut x, null_mut())),
                        st(ffi::vmm_arena_compact(null_mut(), null_mut())),
                        st(ffi::vmm_arena_trim(null_mut(), 0, null_mut())),
                        st(ffi::vmm_arena_snapshot_json(null_mut(), null_mut(), 0, &mut len)),
                        st(ffi::vmm_arena_set_tag(null_mut(), b.u64(), b.u32())),
                        st(ffi::vmm_arena_sleep(null_mut(), b.u32(), b.u32())),
                        st(ffi::vmm_arena_wake(null_mut(), b.u32())),
                        st(ffi::vmm_arena_alloc_shared(null_mut(), b.u64(), 0, 1, 1, &mut x, &mut y)),
                        st(ffi::vmm_arena_resize_on_stream(null_mut(), 1, 1, 0, &mut x)),
                        st(ffi::vmm_arena_quiesce_on_stream(null_mut(), 1, 0)),
                        st(ffi::vmm_arena_unquiesce(null_mut(), 1)),
                        st(vmm_arena_testing_driver_calls(null_mut(), &mut x, &mut y)),
                    ]
                };
                for s in all {
                    tally(s);
                    expect(what, s, &[INVALID]);
                }
                // SAFETY: NULL is ignored.
                unsafe { ffi::vmm_arena_config_default(null_mut()) };
                // SAFETY: NULL is a no-op.
                unsafe { ffi::vmm_arena_destroy(null_mut()) };
                let name = ffi::vmm_arena_status_name(b.u32());
                // SAFETY: status names are static NUL-terminated strings.
                assert!(!unsafe { CStr::from_ptr(name) }.to_bytes().is_empty());
                assert_eq!(ffi::vmm_arena_abi_version(), ffi::VMM_ARENA_ABI_VERSION);
                status = OK;
                allowed = vec![OK];
            }
            24 => {
                what = "set_tag";
                let id = self.pick_id(b);
                let tag = pick_tag(b);
                // Every allocation takes a tag. One of whole chunks (a range
                // of its own) keeps its place; a small one moves by copy
                // into a slab of the new tag, which a pinned or sleeping
                // one refuses and which needs a slab's room.
                let chunked = live_ranges(&self.snapshot()).contains_key(&id);
                // SAFETY: live handle.
                status = st(unsafe { ffi::vmm_arena_set_tag(a, id, tag) });
                allowed = match (self.live.get(&id), chunked) {
                    (None, _) => vec![UNKNOWN],
                    (Some(_), true) => vec![OK],
                    (Some(l), false) if l.sleep_tag == tag => vec![OK],
                    (Some(l), false) if l.pinned => vec![PINNED],
                    (Some(l), false) if l.asleep => vec![ASLEEP],
                    (Some(_), false) => vec![OK, OOM, OOAS],
                };
                if status == OK {
                    self.live.get_mut(&id).unwrap().sleep_tag = tag;
                }
            }
            25 => {
                what = "sleep";
                let tag = pick_tag(b);
                let flags = match b.below(4) {
                    0 => 0,
                    1 => ffi::VMM_ARENA_SLEEP_BACKUP,
                    2 => 1 << b.below(32),
                    _ => b.u32(),
                };
                // SAFETY: live handle.
                status = st(unsafe { ffi::vmm_arena_sleep(a, tag, flags) });
                allowed = if flags & !ffi::VMM_ARENA_SLEEP_BACKUP != 0 { vec![INVALID] } else { vec![OK] };
                if status == OK {
                    let backup = flags & ffi::VMM_ARENA_SLEEP_BACKUP != 0;
                    let exported = &self.exported;
                    for l in self.live.values_mut().filter(|l| !exported.contains(&l.id)) {
                        // Small allocations sleep with their slab (one tag's).
                        if tag == ffi::VMM_ARENA_ALL_TAGS
                            || l.sleep_tag == tag
                            || l.sleep_tag == ffi::VMM_ARENA_ALL_TAGS
                        {
                            if !l.asleep && !backup {
                                l.tag = None; // contents lost
                            }
                            l.asleep = true;
                        }
                    }
                    let s = self.stats();
                    // A release the driver refused (an injected failure) keeps one chunk.
                    let kept = if self.faulty && self.calls().1 > injected0 { self.chunk } else { 0 };
                    assert!(s.pooled_bytes <= kept, "{what}: {} bytes still pooled", s.pooled_bytes);
                    assert_eq!(s.retired_va_bytes, 0, "{what}: retired ranges left");
                }
            }
            26 => {
                what = "wake";
                let tag = pick_tag(b);
                // SAFETY: live handle.
                status = st(unsafe { ffi::vmm_arena_wake(a, tag) });
                let selected = |l: &Live| {
                    l.asleep
                        && (tag == ffi::VMM_ARENA_ALL_TAGS
                            || l.sleep_tag == tag
                            || l.sleep_tag == ffi::VMM_ARENA_ALL_TAGS)
                };
                // Nothing to wake cannot run out of memory.
                allowed = if self.live.values().any(selected) { vec![OK, OOM] } else { vec![OK] };
                if status == OK {
                    for l in self.live.values_mut().filter(|l| selected(l)) {
                        l.asleep = false;
                    }
                }
            }
            29 => {
                what = "alloc_shared";
                let src = self.pick_id(b);
                let c = self.chunk;
                let pick = |b: &mut Bytes<'_>| match b.below(6) {
                    0 => 0,
                    1 => b.u64(),
                    2 => 1 + b.below(2 * c),
                    _ => c * b.below(6),
                };
                let (off, bytes) = (pick(b), pick(b));
                let max = match b.below(3) {
                    0 => bytes.saturating_add(c * b.below(8)),
                    1 => bytes,
                    _ => pick(b),
                };
                let (mut id, mut p) = (0xA5A5u64, 0xA5A5u64);
                let (oid, optr) = (null_sometimes(b), null_sometimes(b));
                // SAFETY: live handle; out-parameters are ours or NULL.
                status = st(unsafe {
                    ffi::vmm_arena_alloc_shared(
                        a,
                        src,
                        off,
                        bytes,
                        max,
                        if oid { null_mut() } else { &mut id },
                        if optr { null_mut() } else { &mut p },
                    )
                });
                // A max_size that overflows when rounded up to the chunk is
                // an invalid argument too, which precedes an unknown source.
                // Rounded up as the library rounds every size: `max + c - 1`
                // must fit (with a chunk size that is no power of two, the
                // next multiple of it may fit where that sum does not).
                let overflows = max.checked_add(c - 1).is_none();
                let bad_args = oid || optr || bytes == 0 || bytes % c != 0 || off % c != 0 || max < bytes || overflows;
                // Only allocations of whole chunks (ranges of their own) can be shared.
                let chunked = live_ranges(&self.snapshot()).contains_key(&src);
                allowed = match self.live.get(&src) {
                    _ if bad_args => vec![INVALID],
                    None => vec![UNKNOWN],
                    Some(l) if !chunked || off.checked_add(bytes).map_or(true, |e| e > l.size) => vec![INVALID],
                    Some(_) if self.exported.contains(&src) => vec![INVALID],
                    Some(l) if l.asleep => vec![ASLEEP],
                    Some(_) => vec![OK, OOAS],
                };
                if status == OK {
                    assert_eq!(p % c, 0, "{what}: a share is chunk-aligned");
                    let family = self.live[&src].family;
                    self.new_id(what, id, p, bytes);
                    self.live.get_mut(&id).unwrap().family = family;
                    // The source's bytes at that offset are unknown here: a
                    // touch of the share gives it its own, and forgets the
                    // source's.
                    self.touch(id, b.u8());
                } else {
                    assert_eq!((id, p), (0xA5A5, 0xA5A5), "{what}: out-parameters written on failure");
                }
            }
            33 => {
                what = "resize_many";
                (status, allowed) = self.resize_many(b, 1 + (sel & 3) as usize);
            }
            35 => {
                let may_fault;
                (what, status, allowed, may_fault) = self.two_phase(b, sel & 3);
                // A commit or abort makes no driver call that can fail it.
                settle_guarantee = !may_fault;
            }
            36 => {
                (what, status, allowed) = self.dmabuf(b, sel & 3);
            }
            34 => {
                what = "maintain";
                maintain = true;
                (status, allowed) = self.maintain(b);
            }
            _ => {
                what = "testing hooks with NULL out-parameters";
                let mut x = 0u64;
                let (nc, nm) = (b.bool(), b.bool());
                let px: *mut u64 = &mut x;
                // SAFETY: live handle; out-parameters are ours or NULL.
                status = st(unsafe {
                    vmm_arena_testing_driver_objects(
                        a,
                        if nc { null_mut() } else { px },
                        if nm { null_mut() } else { px },
                    )
                });
                allowed = if nc || nm || !self.faulty { vec![INVALID] } else { vec![OK] };
            }
        }
        // A planned failure that fired during this call may be its status.
        let fired = self.faulty && self.calls().1 > injected0;
        if fired {
            self.planned = false;
            if !settle_guarantee {
                allowed.extend_from_slice(fault_ok);
            }
            if status != OK {
                if let Some((stats, snap)) = &before {
                    let now = self.stats();
                    if trim {
                        assert_eq!(
                            (now.live_allocations, now.mapped_bytes),
                            (stats.live_allocations, stats.mapped_bytes)
                        );
                    } else if maintain || self.reap_possible {
                        assert_eq!(
                            (now.live_allocations, now.live_bytes),
                            (stats.live_allocations, stats.live_bytes),
                            "{what}: a failed call changed the live allocations"
                        );
                    } else {
                        let fields = |s: &vmm_arena_stats| {
                            [s.live_allocations, s.live_bytes, s.mapped_bytes, s.pooled_bytes, s.peak_physical_bytes]
                                .into_iter()
                                .chain([s.free_va_bytes, s.largest_free_va_bytes, s.retired_va_bytes, s.moves])
                                .collect::<Vec<_>>()
                        };
                        assert_eq!(fields(&now), fields(stats), "{what}: a failed call changed the stats");
                        assert_eq!(&strip_driver(&self.snapshot()), snap, "{what}: a failed call changed the arena");
                    }
                }
            }
        }
        tally(status);
        if std::env::var_os("VMM_ARENA_FUZZ_DEBUG").is_some() {
            eprintln!("{what}: status {status} (injected failure fired: {fired})");
        }
        expect(what, status, &allowed);
        self.check(what);
        if let Some((id, t, p)) = self.resized.take() {
            assert_eq!(self.live[&id].ptr, p, "{what}: the returned address is not where the moves lead");
            // SAFETY: live allocation of the host backend, at least 1 byte at `p`.
            let first = unsafe { (p as *const u8).read() };
            assert_eq!(first, t, "{what}: the first byte did not survive the resize");
            self.touch(id, t);
        }
    }
}
