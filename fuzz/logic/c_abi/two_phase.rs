//! The C ABI target's two-phase calls (a child of `c_abi.rs`, which
//! dispatches to them): `vmm_arena_prepare_alloc`, `_prepare_resize` and
//! `_prepare_free` with arbitrary ids, sizes, flags and NULLs, and
//! `vmm_arena_commit` / `vmm_arena_abort` of a pending prepared handle.
//!
//! The guarantee is the invariant: a commit or abort of an operation
//! whose allocation no other call changed since its prepare (the same
//! size, asleep or awake as then, not freed) returns OK, even with a driver failure planned
//! (it makes no call that can fail it); after another call changed it,
//! VMM_ARENA_ERR_STALE, with the arena's snapshot unchanged. Shrinks of
//! allocations of a sharing family may also be STALE (the harness does not
//! know which pages a share covers).

use std::ptr::null_mut;

use super::{ffi, st, strip_driver, Bytes, Harness, ASLEEP, INVALID, OK, OOAS, OOM, STALE, UNKNOWN};

/// A prepared handle not yet committed or aborted.
pub(super) struct Pending {
    pub(super) handle: *mut ffi::vmm_arena_prepared,
    pub(super) id: u64,
    /// The allocation's size when the prepare returned.
    pub(super) size: u64,
    /// The size a commit (Some(to), true) or an abort (Some(to), false)
    /// shrinks it to.
    pub(super) shrinks: Option<(u64, bool)>,
    /// A commit frees it (prepare_free) or an abort does (prepare_alloc).
    pub(super) frees: Option<bool>,
    /// It was asleep when the prepare returned (only a free may be
    /// prepared of a sleeper).
    pub(super) asleep: bool,
}

impl Harness {
    /// One two-phase call, `which` 0..=3: prepare_alloc, prepare_resize,
    /// prepare_free, commit or abort. Returns (status, allowed, whether a
    /// planned driver failure may be the status).
    pub(super) fn two_phase(&mut self, b: &mut Bytes<'_>, which: u8) -> (&'static str, u32, Vec<u32>, bool) {
        let a = self.a;
        let null_out = b.below(16) == 0;
        let mut handle: *mut ffi::vmm_arena_prepared = 0xA5A5 as *mut _;
        let out_handle = if null_out { null_mut() } else { &mut handle as *mut _ };
        match which {
            0 => {
                let size = self.pick_size(b);
                let flags = match b.below(8) {
                    0 => b.u32(),
                    1..=4 => ffi::VMM_ARENA_PREPARE_GROWABLE,
                    _ => 0,
                };
                let max = if flags == ffi::VMM_ARENA_PREPARE_GROWABLE && b.bool() {
                    size.saturating_add(b.below(8 * self.chunk))
                } else {
                    size
                };
                let (mut id, mut p) = (0xA5A5u64, 0xA5A5u64);
                // SAFETY: live handle; out-parameters are ours or NULL.
                let status =
                    st(unsafe { ffi::vmm_arena_prepare_alloc(a, size, max, flags, out_handle, &mut id, &mut p) });
                let bad = null_out || size == 0 || flags & !ffi::VMM_ARENA_PREPARE_GROWABLE != 0;
                let allowed = if bad { vec![INVALID] } else { vec![OK, INVALID, OOM, OOAS] };
                if status == OK {
                    assert_eq!(p % self.chunk, 0, "prepare_alloc: whole chunks");
                    self.new_id("prepare_alloc", id, p, size);
                    self.touch(id, b.u8());
                    self.pending.push(Pending { handle, id, size, shrinks: None, frees: Some(false), asleep: false });
                } else {
                    assert_eq!((id, p), (0xA5A5, 0xA5A5), "prepare_alloc: out-parameters written on failure");
                }
                ("prepare_alloc", status, allowed, true)
            }
            1 => {
                let id = self.pick_id(b);
                let size = self.pick_size(b);
                let before = strip_driver(&self.snapshot());
                let mut p = 0xA5A5u64;
                // SAFETY: live handle; out-parameters are ours or NULL.
                let status = st(unsafe { ffi::vmm_arena_prepare_resize(a, id, size, out_handle, &mut p) });
                let bad_size = size == 0 || size.checked_add(self.chunk - 1).is_none();
                let allowed = match self.live.get(&id) {
                    _ if null_out || bad_size => vec![INVALID],
                    None => vec![UNKNOWN, INVALID],
                    // Beyond its reservation (unknown here) precedes ASLEEP.
                    Some(l) if l.asleep => vec![ASLEEP, INVALID],
                    Some(_) => vec![OK, INVALID, OOM],
                };
                if status == OK {
                    let l = self.live.get_mut(&id).expect("live");
                    assert_eq!(p, l.ptr, "prepare_resize: the address does not change");
                    let old = l.size;
                    if size > old {
                        // Grown now: the new bytes are unknown.
                        l.size = size;
                        l.tag = None;
                        self.pending.push(Pending {
                            handle,
                            id,
                            size,
                            shrinks: Some((old, false)),
                            frees: None,
                            asleep: false,
                        });
                    } else {
                        assert_eq!(strip_driver(&self.snapshot()), before, "a prepared shrink changed the arena");
                        self.pending.push(Pending {
                            handle,
                            id,
                            size: old,
                            shrinks: Some((size, true)),
                            frees: None,
                            asleep: false,
                        });
                    }
                } else {
                    assert_eq!(p, 0xA5A5, "prepare_resize: out-parameter written on failure");
                }
                ("prepare_resize", status, allowed, true)
            }
            2 => {
                let id = self.pick_id(b);
                // SAFETY: live handle; the out-parameter is ours or NULL.
                let status = st(unsafe { ffi::vmm_arena_prepare_free(a, id, out_handle) });
                let allowed = match self.live.get(&id) {
                    _ if null_out => vec![INVALID],
                    None => vec![UNKNOWN, INVALID],
                    Some(_) => vec![OK, INVALID],
                };
                if status == OK {
                    let (size, asleep) = (self.live[&id].size, self.live[&id].asleep);
                    self.pending.push(Pending { handle, id, size, shrinks: None, frees: Some(true), asleep });
                }
                ("prepare_free", status, allowed, false)
            }
            _ => {
                if self.pending.is_empty() {
                    // SAFETY: NULL prepared: refused, nothing consumed.
                    let status = st(unsafe { ffi::vmm_arena_commit(a, null_mut()) });
                    return ("commit of NULL", status, vec![INVALID], false);
                }
                let i = b.below(self.pending.len() as u64) as usize;
                let commit = b.bool();
                let Pending { handle, id, size, shrinks, frees, asleep } = self.pending.remove(i);
                let before = strip_driver(&self.snapshot());
                // SAFETY: live arena; a pending handle of it, given up here.
                let status = st(unsafe {
                    if commit {
                        ffi::vmm_arena_commit(a, handle)
                    } else {
                        ffi::vmm_arena_abort(a, handle)
                    }
                });
                let what = if commit { "commit" } else { "abort" };
                let shrink_to = shrinks.and_then(|(to, on_commit)| (on_commit == commit).then_some(to));
                let allowed = match self.live.get(&id) {
                    None => vec![STALE],
                    Some(l) if l.asleep != asleep || l.size != size => vec![STALE],
                    // A share may cover a page the shrink drops.
                    Some(l)
                        if shrink_to.is_some() && self.live.values().any(|o| o.family == l.family && o.id != id) =>
                    {
                        vec![OK, STALE]
                    }
                    Some(_) => vec![OK],
                };
                if status == OK {
                    if frees == Some(commit) {
                        // The free of an exported allocation that could not
                        // give its chunks back holds them for the next call.
                        self.reap_possible |= self.exported.contains(&id);
                        self.live.remove(&id);
                        self.exported.remove(&id);
                        self.freed.push(id);
                    } else if let Some(to) = shrink_to {
                        let l = self.live.get_mut(&id).expect("live");
                        l.size = to;
                        if let Some(t) = l.tag {
                            // Its first byte stays; the last is another now.
                            self.touch(id, t);
                        }
                    }
                } else if status == STALE {
                    assert_eq!(strip_driver(&self.snapshot()), before, "{what}: a stale settle changed the arena");
                }
                (what, status, allowed, false)
            }
        }
    }
}
