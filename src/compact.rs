//! Targeted compaction: which allocations to move to make room for a request.
//!
//! To free `n` contiguous pages, look for the window of `n` pages whose
//! evacuation moves the fewest mapped bytes, contains no pinned (or
//! otherwise immovable) allocation, and whose occupants all fit — best fit,
//! largest first — into free space outside the window.
//!
//! Candidate windows start or end at a segment boundary (a boundary between
//! free ranges, allocations and retired ranges). Any other window can slide,
//! without crossing a boundary, to one of these without gaining an occupant
//! and without shrinking the largest free piece outside it, so nothing is
//! missed. With `s` segments there are at most `4s` candidates; each costs
//! O(occupants) to score, and the cheapest ones are simulated (O(s log s)
//! each) until one fits. Compaction only runs when no free range fits, so
//! this never touches the allocation fast path.

use crate::arena::state::{Segment, State};
use crate::va::FreeRanges;

/// How many scored windows are simulated at most before giving up.
const MAX_SIMULATED: usize = 512;

/// A chosen window and where each of its occupants goes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct WindowPlan {
    pub window: (u64, u64),
    /// (slot, destination start page), largest reservation first.
    pub moves: Vec<(u32, u64)>,
    pub moved_pages: u64,
}

/// Plans the evacuation of a window of `n` pages. `immovable(slot)` marks
/// allocations that must stay (pinned, or the one being resized).
pub(crate) fn plan_window(st: &State, n: u64, immovable: impl Fn(u32) -> bool) -> Option<WindowPlan> {
    if n == 0 || n > st.pages {
        return None;
    }
    let segs = st.segments();
    let mut starts: Vec<u64> = Vec::with_capacity(segs.len() * 4);
    for &(s, l, _) in &segs {
        for b in [s, s + l] {
            if b + n <= st.pages {
                starts.push(b);
            }
            if b >= n {
                starts.push(b - n);
            }
        }
    }
    starts.sort_unstable();
    starts.dedup();

    struct Scored {
        start: u64,
        moved_pages: u64,
    }
    let mut scored = Vec::new();
    'window: for &w0 in &starts {
        let w1 = w0 + n;
        let first = segs.partition_point(|&(s, l, _)| s + l <= w0);
        let (mut moved, mut reserved, mut free_inside) = (0u64, 0u64, 0u64);
        for &(s, l, kind) in segs[first..].iter().take_while(|&&(s, _, _)| s < w1) {
            match kind {
                Segment::Free => free_inside += s.max(w0).abs_diff((s + l).min(w1)),
                Segment::Retired => continue 'window,
                Segment::Alloc(slot) => {
                    if immovable(slot) {
                        continue 'window;
                    }
                    moved += st.alloc(slot).backed;
                    reserved += l;
                }
            }
        }
        if st.free.total() - free_inside >= reserved {
            scored.push(Scored { start: w0, moved_pages: moved });
        }
    }
    scored.sort_by_key(|c| (c.moved_pages, c.start));

    for c in scored.iter().take(MAX_SIMULATED) {
        let (w0, w1) = (c.start, c.start + n);
        let mut outside: FreeRanges = st.free.clone();
        let first = segs.partition_point(|&(s, l, _)| s + l <= w0);
        let mut occupants = Vec::new();
        for &(s, l, kind) in segs[first..].iter().take_while(|&&(s, _, _)| s < w1) {
            match kind {
                Segment::Free => {
                    let (a, b) = (s.max(w0), (s + l).min(w1));
                    outside.remove(a, b - a);
                }
                Segment::Alloc(slot) => occupants.push((l, slot)),
                Segment::Retired => unreachable!("filtered above"),
            }
        }
        occupants.sort_by(|a, b| b.cmp(a));
        let mut moves = Vec::with_capacity(occupants.len());
        let placed = occupants.iter().all(|&(len, slot)| match outside.best_fit(len) {
            Some(t) => {
                outside.remove(t, len);
                moves.push((slot, t));
                true
            }
            None => false,
        });
        if placed {
            return Some(WindowPlan { window: (w0, w1), moves, moved_pages: c.moved_pages });
        }
    }
    None
}
