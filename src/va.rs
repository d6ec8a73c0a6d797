//! Free ranges of the reserved virtual address space, in chunk-sized pages.
//!
//! Two ordered indexes over the same set — by start (for coalescing and
//! address-ordered walks) and by (length, start) (for best fit) — make every
//! operation O(log n) in the number of free ranges.

use std::collections::{BTreeMap, BTreeSet};

/// A set of disjoint, coalesced page ranges.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct FreeRanges {
    by_start: BTreeMap<u64, u64>,
    by_len: BTreeSet<(u64, u64)>,
    total: u64,
}

impl FreeRanges {
    /// One free range `start..start+len`.
    pub fn with_range(start: u64, len: u64) -> FreeRanges {
        let mut f = FreeRanges::default();
        f.insert(start, len);
        f
    }

    /// Total free pages.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// The longest range's length (0 when empty).
    pub fn largest(&self) -> u64 {
        self.by_len.last().map_or(0, |&(l, _)| l)
    }

    /// Ranges in address order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.by_start.iter().map(|(&s, &l)| (s, l))
    }

    /// Number of ranges.
    pub fn len(&self) -> usize {
        self.by_start.len()
    }

    fn put(&mut self, start: u64, len: u64) {
        self.by_start.insert(start, len);
        self.by_len.insert((len, start));
    }

    fn take(&mut self, start: u64) -> u64 {
        let len = self.by_start.remove(&start).expect("range present");
        self.by_len.remove(&(len, start));
        len
    }

    /// Adds `start..start+len`, which must not overlap a free range, merging
    /// it with its neighbours.
    pub fn insert(&mut self, mut start: u64, mut len: u64) {
        if len == 0 {
            return;
        }
        self.total += len;
        if let Some((&ps, &pl)) = self.by_start.range(..start).next_back() {
            debug_assert!(ps + pl <= start, "overlapping free insert");
            if ps + pl == start {
                self.take(ps);
                start = ps;
                len += pl;
            }
        }
        if let Some(&nl) = self.by_start.get(&(start + len)) {
            self.take(start + len);
            len += nl;
        }
        self.put(start, len);
    }

    /// The free range containing `page`, if any.
    pub fn containing(&self, page: u64) -> Option<(u64, u64)> {
        self.by_start.range(..=page).next_back().filter(|(&s, &l)| page < s + l).map(|(&s, &l)| (s, l))
    }

    /// Whether all of `start..start+len` is free.
    pub fn contains(&self, start: u64, len: u64) -> bool {
        self.containing(start).is_some_and(|(s, l)| start + len <= s + l)
    }

    /// Removes `start..start+len`, which must lie inside one free range.
    pub fn remove(&mut self, start: u64, len: u64) {
        if len == 0 {
            return;
        }
        let (s, l) = self.containing(start).expect("removing a range that is not free");
        assert!(start + len <= s + l, "removing a range that is not wholly free");
        self.take(s);
        self.total -= len;
        if start > s {
            self.put(s, start - s);
        }
        if start + len < s + l {
            self.put(start + len, s + l - (start + len));
        }
    }

    /// Best fit: the start of the shortest range of at least `len` pages
    /// (lowest address among equals).
    pub fn best_fit(&self, len: u64) -> Option<u64> {
        self.by_len.range((len, 0)..).next().map(|&(_, s)| s)
    }

    /// The starts of the ranges of the best-fitting length for `len` pages
    /// (all of that one length, lowest address first), at most `limit`.
    pub fn best_fits(&self, len: u64, limit: usize) -> Vec<u64> {
        let mut it = self.by_len.range((len, 0)..);
        let Some(&(best, first)) = it.next() else {
            return Vec::new();
        };
        std::iter::once(first).chain(it.take_while(|&&(l, _)| l == best).map(|&(_, s)| s)).take(limit).collect()
    }

    /// Best fit among ranges satisfying `ok(start, len)`, looking at no more
    /// than `limit` candidates.
    pub fn best_fit_where(&self, len: u64, limit: usize, mut ok: impl FnMut(u64, u64) -> bool) -> Option<u64> {
        self.by_len.range((len, 0)..).take(limit).find(|&&(l, s)| ok(s, l)).map(|&(_, s)| s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coalesces_and_splits() {
        let mut f = FreeRanges::with_range(0, 100);
        f.remove(10, 10);
        f.remove(50, 5);
        assert_eq!(f.iter().collect::<Vec<_>>(), vec![(0, 10), (20, 30), (55, 45)]);
        assert_eq!((f.total(), f.largest()), (85, 45));
        assert_eq!(f.best_fit(10), Some(0));
        assert_eq!(f.best_fit(11), Some(20));
        assert_eq!(f.best_fit(46), None);
        f.insert(10, 10);
        f.insert(50, 5);
        assert_eq!(f.iter().collect::<Vec<_>>(), vec![(0, 100)]);
        assert!(f.contains(3, 97) && !f.contains(3, 98));
    }

    #[test]
    fn best_fits_lists_ranges_of_the_best_length() {
        let mut f = FreeRanges::with_range(0, 100);
        f.remove(10, 5);
        f.remove(20, 5);
        f.remove(30, 60);
        // Free: 0..10, 15..20, 25..30, 90..100.
        assert_eq!(f.best_fits(4, 8), vec![15, 25]);
        assert_eq!(f.best_fits(6, 8), vec![0, 90]);
        assert_eq!(f.best_fits(6, 1), vec![0]);
        assert!(f.best_fits(11, 8).is_empty());
    }

    #[test]
    fn best_fit_where_filters() {
        let mut f = FreeRanges::with_range(0, 100);
        f.remove(5, 10);
        assert_eq!(f.best_fit_where(3, 8, |s, _| s > 0), Some(15));
    }
}
