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
        if let Some(moves) = evacuate(st, &segs, c.start, c.start + n, &immovable) {
            return Some(WindowPlan { window: (c.start, c.start + n), moves, moved_pages: c.moved_pages });
        }
    }
    None
}

/// Plans moving every allocation in pages `w0..w1` to free space outside
/// them, so that the range becomes free (once the moves' old ranges are
/// released). `None` if a retired range or an immovable allocation lies
/// there, or if the occupants do not fit elsewhere.
pub(crate) fn plan_evacuation(
    st: &State,
    w0: u64,
    w1: u64,
    immovable: impl Fn(u32) -> bool,
) -> Option<Vec<(u32, u64)>> {
    evacuate(st, &st.segments(), w0, w1, &immovable)
}

fn evacuate(
    st: &State,
    segs: &[(u64, u64, Segment)],
    w0: u64,
    w1: u64,
    immovable: &impl Fn(u32) -> bool,
) -> Option<Vec<(u32, u64)>> {
    let mut outside: FreeRanges = st.free.clone();
    let first = segs.partition_point(|&(s, l, _)| s + l <= w0);
    let mut occupants = Vec::new();
    for &(s, l, kind) in segs[first..].iter().take_while(|&&(s, _, _)| s < w1) {
        match kind {
            Segment::Free => {
                let (a, b) = (s.max(w0), (s + l).min(w1));
                outside.remove(a, b - a);
            }
            Segment::Alloc(slot) if !immovable(slot) => occupants.push((l, slot)),
            Segment::Alloc(_) | Segment::Retired => return None,
        }
    }
    occupants.sort_by(|a, b| b.cmp(a));
    pack(&outside, &occupants)
}

/// Occupants at most for which packing falls back to an exact search when
/// best fit fails (bin packing is NP-hard; with few items it is cheap).
const EXACT_MAX_OCCUPANTS: usize = 8;
/// Search steps at most of the exact packing.
const EXACT_BUDGET: u32 = 100_000;

/// Places `occupants` (reserved pages, slot; largest first) into the free
/// ranges `outside`: best fit, largest first; if that fails and there are
/// few occupants, an exact search. Returns (slot, destination page).
fn pack(outside: &FreeRanges, occupants: &[(u64, u32)]) -> Option<Vec<(u32, u64)>> {
    let mut left = outside.clone();
    let mut moves = Vec::with_capacity(occupants.len());
    let best_fit = occupants.iter().all(|&(len, slot)| match left.best_fit(len) {
        Some(t) => {
            left.remove(t, len);
            moves.push((slot, t));
            true
        }
        None => false,
    });
    if best_fit {
        return Some(moves);
    }
    if occupants.len() > EXACT_MAX_OCCUPANTS {
        return None;
    }
    let smallest = occupants.iter().map(|&(l, _)| l).min().unwrap_or(0);
    let bins: Vec<(u64, u64)> = outside.iter().filter(|&(_, l)| l >= smallest).collect();
    let mut fill = vec![0u64; bins.len()];
    let mut choice = vec![0usize; occupants.len()];
    let mut budget = EXACT_BUDGET;
    if !place(0, occupants, &bins, &mut fill, &mut choice, &mut budget) {
        return None;
    }
    let mut next = bins.iter().map(|&(s, _)| s).collect::<Vec<_>>();
    let moves = occupants
        .iter()
        .zip(&choice)
        .map(|(&(len, slot), &b)| {
            next[b] += len;
            (slot, next[b] - len)
        })
        .collect();
    Some(moves)
}

/// Depth-first search for bins (free ranges) that hold occupants `i..`.
/// Bins of equal remaining room are interchangeable: only one is tried.
fn place(
    i: usize,
    occupants: &[(u64, u32)],
    bins: &[(u64, u64)],
    fill: &mut [u64],
    choice: &mut [usize],
    budget: &mut u32,
) -> bool {
    let Some(&(len, _)) = occupants.get(i) else { return true };
    if *budget == 0 {
        return false;
    }
    *budget -= 1;
    let mut tried: Vec<u64> = Vec::new();
    for b in 0..bins.len() {
        let room = bins[b].1 - fill[b];
        if room < len || tried.contains(&room) {
            continue;
        }
        tried.push(room);
        fill[b] += len;
        choice[i] = b;
        if place(i + 1, occupants, bins, fill, choice, budget) {
            return true;
        }
        fill[b] -= len;
    }
    false
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::arena::state::{Alloc, Owner};

    /// What occupies a run of pages in a test layout.
    #[derive(Clone, Copy, Debug)]
    enum Piece {
        Free(u64),
        /// (reserved pages, backed pages, pinned)
        Alloc(u64, u64, bool),
        Retired(u64),
    }

    /// A state of `pieces` laid out from page 0; returns it and the slot of
    /// each allocation, in order.
    fn layout(pieces: &[Piece]) -> (State, Vec<u32>) {
        let pages = pieces
            .iter()
            .map(|p| match *p {
                Piece::Free(l) | Piece::Retired(l) | Piece::Alloc(l, _, _) => l,
            })
            .sum();
        let mut st = State::new(1 << 16, 0x10_0000, pages, pages, u64::MAX, false).unwrap();
        let mut slots = Vec::new();
        let mut at = 0;
        for p in pieces {
            match *p {
                Piece::Free(l) => at += l,
                Piece::Retired(l) => {
                    st.free.remove(at, l);
                    st.retired.insert(at, l);
                    st.retired_pages += l;
                    at += l;
                }
                Piece::Alloc(reserved, backed, pinned) => {
                    let a = Alloc {
                        start: at,
                        reserved,
                        backed,
                        size: backed * st.chunk,
                        growable: reserved > backed,
                        pinned,
                        owner: Owner::User,
                        tag: 0,
                        sleep: None,
                        quiet: Default::default(),
                    };
                    slots.push(st.insert_alloc(a));
                    at += reserved;
                }
            }
        }
        (st, slots)
    }

    fn pinned(st: &State) -> impl Fn(u32) -> bool + '_ {
        |slot| st.alloc(slot).pinned
    }

    /// Checks that a plan is executable: its window holds no immovable
    /// allocation and no retired range, it moves exactly the allocations
    /// the window intersects, to free, disjoint places outside the window.
    fn assert_valid(st: &State, n: u64, plan: &WindowPlan, immovable: impl Fn(u32) -> bool) {
        let (w0, w1) = plan.window;
        assert_eq!(w1 - w0, n);
        assert!(w1 <= st.pages);
        assert!(st.retired.iter().all(|(&s, &l)| s + l <= w0 || s >= w1), "window over a retired range");
        let mut inside: Vec<u32> = st
            .by_start
            .iter()
            .filter(|(&s, &slot)| s < w1 && s + st.alloc(slot).reserved > w0)
            .map(|(_, &x)| x)
            .collect();
        let mut moved: Vec<u32> = plan.moves.iter().map(|&(slot, _)| slot).collect();
        inside.sort_unstable();
        moved.sort_unstable();
        assert_eq!(inside, moved, "the plan must move exactly the window's occupants");
        assert!(inside.iter().all(|&s| !immovable(s)), "an immovable allocation in the window");
        let mut taken = FreeRanges::default();
        for &(slot, dest) in &plan.moves {
            let len = st.alloc(slot).reserved;
            assert!(st.free.contains(dest, len), "destination not free");
            assert!(dest + len <= w0 || dest >= w1, "destination inside the window");
            assert!(taken.iter().all(|(s, l)| dest + len <= s || dest >= s + l), "destinations overlap");
            taken.insert(dest, len);
        }
        assert_eq!(plan.moved_pages, inside.iter().map(|&s| st.alloc(s).backed).sum::<u64>());
    }

    #[test]
    fn picks_the_cheapest_window() {
        use Piece::*;
        // [A:4][free 2][B:1][free 2][C:2][free 1][D:4]: a window of 4 pages
        // holding only B (1 page) is the cheapest; one holding C costs 2.
        let (st, s) = layout(&[
            Alloc(4, 4, false),
            Free(2),
            Alloc(1, 1, false),
            Free(2),
            Alloc(2, 2, false),
            Free(1),
            Alloc(4, 4, false),
        ]);
        let plan = plan_window(&st, 4, pinned(&st)).expect("a window exists");
        assert_valid(&st, 4, &plan, pinned(&st));
        assert_eq!(plan.moved_pages, 1);
        assert_eq!(plan.moves.len(), 1);
        assert_eq!(plan.moves[0].0, s[1], "B moves");
        // A free window costs nothing.
        let (st, _) = layout(&[Alloc(2, 2, false), Free(4), Alloc(2, 2, false)]);
        let plan = plan_window(&st, 4, pinned(&st)).unwrap();
        assert_eq!((plan.window, plan.moved_pages, plan.moves.len()), ((2, 6), 0, 0));
    }

    #[test]
    fn counts_backed_pages_not_reservations() {
        use Piece::*;
        // B reserves 3 pages but backs 1; C reserves and backs 2. The window
        // over B moves fewer bytes, though it holds the larger reservation.
        let (st, s) = layout(&[Free(4), Alloc(3, 1, false), Free(1), Alloc(2, 2, false), Free(4)]);
        let plan = plan_window(&st, 6, pinned(&st)).unwrap();
        assert_valid(&st, 6, &plan, pinned(&st));
        assert_eq!((plan.moved_pages, plan.moves[0].0), (1, s[0]), "B (1 backed page) is cheaper to move than C");
        assert!(plan_window(&st, 14, pinned(&st)).is_none(), "the whole range has nowhere to put its occupants");
    }

    #[test]
    fn respects_pinned_and_immovable_allocations() {
        use Piece::*;
        let pieces =
            [Alloc(4, 4, false), Free(2), Alloc(1, 1, true), Free(2), Alloc(2, 2, false), Free(1), Alloc(4, 4, false)];
        let (st, s) = layout(&pieces);
        let plan = plan_window(&st, 4, pinned(&st)).expect("a window avoiding the pinned B");
        assert_valid(&st, 4, &plan, pinned(&st));
        let b = st.alloc(s[1]).start;
        assert!(plan.window.1 <= b || plan.window.0 > b, "window {:?} over the pinned B at {b}", plan.window);
        assert_eq!((plan.moved_pages, plan.moves[0].0), (2, s[2]), "C moves instead");
        // The same with B unpinned but immovable for the caller (it is the one being resized).
        let mut unpinned = pieces;
        unpinned[2] = Alloc(1, 1, false);
        let (st, s) = layout(&unpinned);
        let b_slot = s[1];
        let plan = plan_window(&st, 4, |slot| slot == b_slot).unwrap();
        assert_valid(&st, 4, &plan, |slot| slot == b_slot);
        assert!(plan.moves.iter().all(|&(slot, _)| slot != b_slot));
    }

    #[test]
    fn returns_none_when_nothing_fits() {
        use Piece::*;
        // Every window of 4 pages holds 3 pages of allocation, and at most
        // 1 page is free outside it.
        let (st, _) = layout(&[Alloc(3, 3, false), Free(1), Alloc(3, 3, false), Free(1)]);
        assert!(plan_window(&st, 4, pinned(&st)).is_none());
        assert!(plan_window(&st, 0, pinned(&st)).is_none());
        assert!(plan_window(&st, 9, pinned(&st)).is_none(), "larger than the range");
        // Pinned allocations in every window.
        let (st, _) = layout(&[Free(2), Alloc(1, 1, true), Free(2), Alloc(1, 1, true), Free(2)]);
        assert!(plan_window(&st, 3, pinned(&st)).is_none());
        assert!(plan_window(&st, 2, pinned(&st)).is_some(), "a free window of 2 exists");
        // Retired ranges are never in a window (they are released first).
        let (st, _) = layout(&[Free(2), Retired(1), Free(2)]);
        assert!(plan_window(&st, 3, pinned(&st)).is_none());
    }

    fn piece() -> impl Strategy<Value = Piece> {
        prop_oneof![
            4 => (1..=3u64).prop_map(Piece::Free),
            5 => (1..=4u64, 1..=4u64, prop::bool::weighted(0.2))
                .prop_map(|(r, b, p)| Piece::Alloc(r, b.min(r), p)),
            1 => (1..=2u64).prop_map(Piece::Retired),
        ]
    }

    proptest! {
        /// Against brute force: whenever some window satisfies the sufficient
        /// condition of the module doc (no immovable occupant, no retired
        /// range, and the occupants' reservations fit together into the
        /// largest free range outside it), the planner finds a plan, no
        /// costlier than that window; and every plan it returns is valid.
        #[test]
        fn agrees_with_brute_force(pieces in prop::collection::vec(piece(), 1..14), n in 1..12u64) {
            let (st, _) = layout(&pieces);
            let plan = plan_window(&st, n, pinned(&st));
            if let Some(p) = &plan {
                assert_valid(&st, n, p, pinned(&st));
            }
            let free: Vec<(u64, u64)> = st.free.iter().collect();
            for w0 in 0..=st.pages.saturating_sub(n) {
                let w1 = w0 + n;
                if n > st.pages || st.retired.iter().any(|(&s, &l)| s < w1 && s + l > w0) {
                    continue;
                }
                let inside: Vec<&Alloc> = st.by_start.iter()
                    .map(|(_, &slot)| st.alloc(slot))
                    .filter(|a| a.start < w1 && a.start + a.reserved > w0)
                    .collect();
                if inside.iter().any(|a| a.pinned) {
                    continue;
                }
                let need: u64 = inside.iter().map(|a| a.reserved).sum();
                let largest_outside = free.iter()
                    .flat_map(|&(s, l)| [(s, (s + l).min(w0)), (s.max(w1), s + l)])
                    .map(|(a, b)| b.saturating_sub(a))
                    .max()
                    .unwrap_or(0);
                if need <= largest_outside {
                    let cost: u64 = inside.iter().map(|a| a.backed).sum();
                    let p = plan.as_ref().unwrap_or_else(|| panic!("window {w0}..{w1} qualifies but no plan: {pieces:?}"));
                    prop_assert!(p.moved_pages <= cost, "plan {p:?} costlier than window {w0}..{w1} ({cost})");
                }
            }
        }
    }
}
