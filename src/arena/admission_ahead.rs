//! Admission map-ahead: chunks kept mapped where the next new allocations
//! will be placed, so that an admission maps nothing on the caller's
//! critical path (`Arena::set_admission_prefetch`).
//!
//! A new allocation of whole chunks reserving `R` pages is placed by best
//! fit: among the free ranges of the best length for `R` (at most 16 looked
//! at), the one whose first pages hold the most cached chunks, lowest
//! address on ties, or a longer range where it would adopt more
//! (`alloc::best_fit_adopting`); a cached chunk there is
//! adopted with no driver call. So the place is known before the
//! allocation is asked for, and `maintain` can map chunks there while the
//! device computes: [`windows`] predicts the next `count` places exactly as
//! placement will choose them (each one taken out of a copy of the free
//! ranges before the next is chosen), and the first `ready` pages of each
//! are the *admission windows*. A window filled this way has the most cached
//! chunks a candidate can have, so placement chooses it (or another
//! candidate with as many, which saves as much).
//!
//! What fills a window, cheapest first and none growing the footprint: the
//! unmapped pool, then known-idle cached chunks that no window (of growth or
//! of admission) holds. Window chunks count toward the `precreate` target
//! (`Arena::set_prefetch`): they are the precreated chunks, mapped where
//! they will be used, so creating ahead is bounded by that target as
//! before, and admission map-ahead changes where created chunks wait, not
//! how many are held. Like every prefetched chunk they are cached and idle:
//! the first taken by any plan under pressure and the first given back, so
//! they never cause an out-of-memory. Plans take other idle chunks before
//! window chunks ([`State::admit_windows`] keeps the last prediction for
//! that).
//!
//! An allocation that does not come (the caller's prediction of its size
//! was wrong, or another allocation took the place) costs nothing but the
//! between-steps driver calls: the chunks stay cached where they are.

use std::ops::Range;

use super::alloc::best_fit_adopting;
use super::state::State;

/// The admission map-ahead target, in pages (see
/// `Arena::set_admission_prefetch`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct AdmitAhead {
    /// The reservation, in pages, of the allocations to come.
    pub reserve: u64,
    /// Pages kept mapped at the start of each place.
    pub ready: u64,
    /// How many allocations to come.
    pub count: u32,
}

impl AdmitAhead {
    pub fn is_off(&self) -> bool {
        self.count == 0 || self.ready == 0 || self.reserve == 0
    }
}

/// The admission windows now: the first `ready` pages of the places the
/// next `count` allocations reserving `reserve` pages will get, in the
/// order they will be taken. Empty when the target is off or nothing fits.
pub(super) fn windows(st: &State) -> Vec<Range<u64>> {
    let a = st.admit_ahead;
    if a.is_off() || a.reserve > st.pages {
        return Vec::new();
    }
    let ready = a.ready.min(a.reserve);
    let mut out = Vec::with_capacity(a.count as usize);
    if a.count == 1 {
        // The common case: no copy of the free ranges.
        if let Some(t) = best_fit_adopting(st, &st.free, a.reserve, ready) {
            out.push(t..t + ready);
        }
        return out;
    }
    let mut free = st.free.clone();
    for _ in 0..a.count {
        let Some(t) = best_fit_adopting(st, &free, a.reserve, ready) else { break };
        out.push(t..t + ready);
        free.remove(t, a.reserve);
    }
    out
}

/// Whether page `p` lies in one of `windows`.
pub(super) fn in_windows(windows: &[Range<u64>], p: u64) -> bool {
    windows.iter().any(|w| w.contains(&p))
}

/// The first window's pages that hold no chunk yet and are not set aside
/// (a page mapped to another page's chunk, an old address of same-stream
/// reuse, is left alone: the allocation's plan unmaps it).
pub(super) fn first_missing(st: &State, windows: &[Range<u64>]) -> Option<Vec<u64>> {
    windows.iter().find_map(|w| {
        let missing: Vec<u64> =
            w.clone().filter(|&p| st.mapped[p as usize].is_none() && !st.set_aside.contains(&p)).collect();
        (!missing.is_empty()).then_some(missing)
    })
}

/// Cached pages inside the windows that are still free (prefetched chunks
/// waiting there). The windows may be a stale prediction: pages an
/// allocation has taken since are its own (backing it, or mapped ahead of
/// it) and are not counted here.
pub(super) fn cached_in(st: &State, windows: &[Range<u64>]) -> u64 {
    windows.iter().flat_map(|w| st.cached.range(w.clone())).filter(|&&p| st.free.containing(p).is_some()).count() as u64
}
