//! Tensor-parallel ranks as separate processes (forked), the shape of
//! vLLM and SGLang (one process per GPU): every rank applies the same
//! operations to its own arena, two-phase operations vote through pipes
//! (standing in for the engine's collective: all prepared, or abort), and
//! one rank's injected failure aborts the operation on every rank.
//! Checked: after every step, every rank has the same allocations at the
//! same offsets from its base — placement is a pure function of the
//! operations and the config (`deterministic_placement`).
//!
//! Compaction across ranks follows the documented rule (DESIGN.md,
//! "Export, import and device groups"): `compact` runs on every rank; a
//! rank whose compaction failed is exactly as it was, and compacts again
//! (its plan depends on the books alone, which are the other ranks'), so
//! the ranks agree again before the next operation.
//!
//! One test in this binary, so that when it forks no other test thread
//! can hold a lock a child needs.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vmm_arena::driver::fault::{FaultDriver, FaultKind};
use vmm_arena::driver::host::HostDriver;
use vmm_arena::{Arena, ArenaConfig, Id, Status};

const C: u64 = 2 << 20;
const RANKS: usize = 3;
const SLOTS: usize = 12;

/// One step of the script every rank runs.
#[derive(Clone, Copy, Debug)]
enum Step {
    Alloc {
        slot: usize,
        bytes: u64,
    },
    Free {
        slot: usize,
    },
    Resize {
        slot: usize,
        bytes: u64,
    },
    /// Two-phase: prepare everywhere, vote, commit or abort. `fail_on`:
    /// this rank's next driver call fails (an out-of-memory device); a
    /// prepare that needs no driver call (it adopts pooled chunks) succeeds.
    Prepared {
        slot: usize,
        what: TwoPhase,
        fail_on: Option<usize>,
    },
    /// `compact` on every rank; on `fail_on`, its first driver call fails,
    /// and that rank compacts again.
    Compact {
        fail_on: Option<usize>,
    },
}

#[derive(Clone, Copy, Debug)]
enum TwoPhase {
    Alloc { bytes: u64, max: u64 },
    Resize { bytes: u64 },
    Free,
}

fn script() -> Vec<Step> {
    use Step::*;
    let mut s = vec![
        Alloc { slot: 0, bytes: 3 * C },
        Alloc { slot: 1, bytes: C },
        Prepared { slot: 2, what: TwoPhase::Alloc { bytes: 2 * C, max: 8 * C }, fail_on: None },
        Free { slot: 1 },
        Resize { slot: 0, bytes: 5 * C }, // moves: a retired range
        Prepared { slot: 3, what: TwoPhase::Alloc { bytes: C, max: C }, fail_on: None },
        Prepared { slot: 4, what: TwoPhase::Alloc { bytes: 4 * C, max: 4 * C }, fail_on: Some(1) },
        Prepared { slot: 2, what: TwoPhase::Resize { bytes: 6 * C }, fail_on: Some(2) },
        Prepared { slot: 5, what: TwoPhase::Alloc { bytes: 4 * C, max: 6 * C }, fail_on: None },
        Prepared { slot: 2, what: TwoPhase::Resize { bytes: 6 * C }, fail_on: None },
        Prepared { slot: 3, what: TwoPhase::Free, fail_on: None },
        Prepared { slot: 5, what: TwoPhase::Resize { bytes: C }, fail_on: None },
        Prepared { slot: 6, what: TwoPhase::Alloc { bytes: 100 << 10, max: 100 << 10 }, fail_on: Some(0) },
        Prepared { slot: 6, what: TwoPhase::Alloc { bytes: 100 << 10, max: 100 << 10 }, fail_on: None },
    ];
    // A deterministic pseudo-random tail of plain operations (moves,
    // compaction and small allocations included).
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..120 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let slot = 7 + (x % 5) as usize;
        let bytes = [100 << 10, C, 2 * C + 1, 3 * C, 5 * C][(x >> 8) as usize % 5];
        s.push(match (x >> 16) % 3 {
            0 => Alloc { slot, bytes },
            1 => Free { slot },
            _ => Resize { slot, bytes },
        });
        if (x >> 24) % 9 == 0 {
            s.push(Compact { fail_on: Some((x >> 32) as usize % RANKS) });
        }
    }
    s.push(Compact { fail_on: None });
    s
}

/// One rank: runs the script, votes through `up`, reads the decision
/// from `down`, and after each step writes every slot's offset from the
/// base (u64::MAX for none) to `up`.
fn rank(me: usize, up: &OwnedFd, down: &OwnedFd) {
    let fault = Arc::new(FaultDriver::new(HostDriver::new().unwrap()));
    let cfg = ArenaConfig {
        capacity_bytes: 48 * C,
        reserve_bytes: 64 * C,
        chunk_bytes: C,
        deterministic_placement: true,
        ..ArenaConfig::default()
    };
    let a = Arena::with_driver(fault.clone(), cfg).unwrap();
    let base = a.va_range().0;
    let mut ids: [Option<Id>; SLOTS] = [None; SLOTS];
    for step in script() {
        match step {
            Step::Alloc { slot, bytes } if ids[slot].is_none() => {
                ids[slot] = a.alloc(bytes).ok().map(|(id, _)| id);
            }
            Step::Free { slot } => {
                if let Some(id) = ids[slot].take() {
                    a.free(id).unwrap();
                }
            }
            Step::Resize { slot, bytes } => {
                if let Some(id) = ids[slot] {
                    // Refused the same way on every rank, or done on every rank.
                    let _ = a.resize(id, bytes);
                }
            }
            Step::Prepared { slot, what, fail_on } => {
                if fail_on == Some(me) {
                    fault.fail_nth(None, 1, FaultKind::OutOfMemory);
                }
                let prepared = match what {
                    TwoPhase::Alloc { bytes, max } => a.prepare_alloc(bytes, max, max > bytes).map(|(p, _)| p),
                    TwoPhase::Resize { bytes } => a.prepare_resize(ids[slot].unwrap(), bytes).map(|(p, _)| p),
                    TwoPhase::Free => a.prepare_free(ids[slot].unwrap()),
                };
                fault.clear();
                if let Err(e) = &prepared {
                    assert_eq!(fail_on, Some(me), "rank {me}: an unplanned failure: {e}");
                    assert_eq!(e.status(), Status::OutOfMemory);
                }
                write_all(up, &[prepared.is_ok() as u8]);
                let mut decision = [0u8];
                read_exact(down, &mut decision);
                if let Ok(p) = prepared {
                    let id = p.id();
                    if decision[0] == 1 {
                        a.commit(p).unwrap();
                        match what {
                            TwoPhase::Alloc { .. } => ids[slot] = Some(id),
                            TwoPhase::Free => ids[slot] = None,
                            TwoPhase::Resize { .. } => {}
                        }
                    } else {
                        a.abort(p).unwrap();
                    }
                }
            }
            Step::Compact { fail_on } => {
                if fail_on == Some(me) {
                    fault.fail_nth(None, 1, FaultKind::Driver);
                }
                let first = a.compact();
                let fired = !fault.pending();
                fault.clear();
                if let Err(e) = &first {
                    assert!(fail_on == Some(me) && fired, "rank {me}: an unplanned compaction failure: {e}");
                    // The rule: this rank is as it was; the same books plan
                    // the same moves again.
                    a.compact().unwrap();
                }
                write_all(up, &[first.is_err() as u8]);
            }
            Step::Alloc { .. } => {}
        }
        let mut offsets = [u64::MAX; SLOTS];
        for (i, id) in ids.iter().enumerate() {
            if let Some(id) = id {
                let q = a.query(*id).unwrap();
                offsets[i] = q.ptr - base;
                assert!(q.size > 0);
            }
        }
        let bytes: Vec<u8> = offsets.iter().flat_map(|o| o.to_le_bytes()).collect();
        write_all(up, &bytes);
    }
}

fn pipe() -> (OwnedFd, OwnedFd) {
    let mut p = [0i32; 2];
    // SAFETY: `p` has room for the two descriptors.
    assert_eq!(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: fresh descriptors owned here.
    unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) }
}

fn write_all(fd: &OwnedFd, mut b: &[u8]) {
    while !b.is_empty() {
        // SAFETY: writes from a live buffer.
        let n = unsafe { libc::write(fd.as_raw_fd(), b.as_ptr().cast(), b.len()) };
        assert!(n > 0, "write: {}", std::io::Error::last_os_error());
        b = &b[n as usize..];
    }
}

fn read_exact(fd: &OwnedFd, b: &mut [u8]) {
    let mut got = 0;
    while got < b.len() {
        // SAFETY: reads into the rest of a live buffer.
        let n = unsafe { libc::read(fd.as_raw_fd(), b[got..].as_mut_ptr().cast(), b.len() - got) };
        assert!(n > 0, "read: a rank died ({})", std::io::Error::last_os_error());
        got += n as usize;
    }
}

#[test]
fn forked_ranks_agree_on_every_offset_and_abort_together() {
    let mut ups = Vec::new();
    let mut downs = Vec::new();
    let mut pids = Vec::new();
    for me in 0..RANKS {
        let (up_r, up_w) = pipe();
        let (down_r, down_w) = pipe();
        // SAFETY: fork in a test binary that runs only this test (see the
        // module docs); the child runs `rank` and leaves with `_exit`.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            drop((up_r, down_w));
            let ok = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rank(me, &up_w, &down_r))).is_ok();
            // SAFETY: ends the child without running the harness's exit path.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        drop((up_w, down_r));
        ups.push(up_r);
        downs.push(down_w);
        pids.push(pid);
    }
    let steps = script();
    let (mut aborted, mut committed) = (0, 0);
    let mut compactions_failed = 0u32;
    for (n, step) in steps.iter().enumerate() {
        if let Step::Prepared { fail_on, .. } = step {
            // The collective: every rank's vote, then one decision for all.
            let mut all = true;
            for (r, up) in ups.iter().enumerate() {
                let mut v = [0u8];
                read_exact(up, &mut v);
                assert!(v[0] == 1 || *fail_on == Some(r), "step {n}: rank {r} voted no unasked");
                all &= v[0] == 1;
            }
            for d in &downs {
                write_all(d, &[all as u8]);
            }
            if all {
                committed += 1;
            } else {
                aborted += 1;
            }
        }
        if let Step::Compact { .. } = step {
            for up in &ups {
                let mut failed = [0u8];
                read_exact(up, &mut failed);
                compactions_failed += failed[0] as u32;
            }
        }
        let mut views = Vec::new();
        for up in &ups {
            let mut b = vec![0u8; 8 * SLOTS];
            read_exact(up, &mut b);
            views.push(b);
        }
        for r in 1..RANKS {
            assert_eq!(views[r], views[0], "step {n} ({step:?}): rank {r} differs from rank 0");
        }
    }
    assert!(aborted >= 2 && committed >= 6, "committed {committed}, aborted {aborted}");
    assert!(compactions_failed >= 1, "no rank's compaction failed: the rule was not exercised");
    println!("compactions that failed on one rank and were retried there: {compactions_failed}");
    println!("two-phase steps: {committed} committed, {aborted} aborted");
    let deadline = Instant::now() + Duration::from_secs(20);
    for pid in pids {
        let mut status = 0;
        loop {
            // SAFETY: waits for our own child without blocking.
            let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
            if r == pid {
                break;
            }
            assert!(Instant::now() < deadline, "rank {pid} did not exit");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "a rank failed ({status:#x})");
    }
}
