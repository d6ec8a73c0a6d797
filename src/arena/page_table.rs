//! The page table: which chunk is mapped at each page of the reservation.
//!
//! Plans run on a copy of the books (`State::clone`), so the table must be
//! cheap to copy even for a reservation of millions of pages (8 TiB of
//! 2 MiB chunks is 4 Mi pages: 64 MiB as one flat vector, copied by every
//! planned resize that has to look elsewhere). It is held in segments of
//! [`SEGMENT`] pages behind reference counts: a copy shares every segment,
//! and a write copies only the segment it lands in, once. Segments nothing
//! was ever mapped in share one empty segment, so a large reservation costs
//! a pointer per segment until it is used.

use std::ops::{Index, IndexMut};
use std::sync::Arc;

use crate::driver::ChunkHandle;

/// Pages per segment: 64 KiB of entries, one per 8 GiB of 2 MiB chunks.
pub(crate) const SEGMENT: usize = 4096;

/// On the heap, always: a segment is 64 KiB, more than some threads' stacks
/// (loom's coroutines overflowed on an array built in place).
type Segment = Vec<Option<ChunkHandle>>;

#[derive(Clone, Debug)]
pub(crate) struct PageTable {
    segments: Vec<Arc<Segment>>,
    pages: usize,
    /// The segment every untouched one shares (skipped by `mapped`).
    empty: Arc<Segment>,
}

impl PageTable {
    /// A table of `pages` unmapped pages, or `None` when even the segment
    /// pointers cannot be allocated.
    pub fn new(pages: usize) -> Option<PageTable> {
        let n = pages.div_ceil(SEGMENT);
        let empty: Arc<Segment> = Arc::new(vec![None; SEGMENT]);
        let mut segments = Vec::new();
        segments.try_reserve_exact(n).ok()?;
        segments.resize(n, empty.clone());
        // The last segment holds only the pages past the others: a small
        // arena's table is one short segment, as cheap to copy on write as
        // the flat table was (a full one would be 64 KiB a plan).
        let rest = pages % SEGMENT;
        if rest != 0 {
            segments[n - 1] = Arc::new(vec![None; rest]);
        }
        Some(PageTable { segments, pages, empty })
    }

    /// Every mapped page and its chunk, in page order; segments never
    /// written are skipped without a look.
    pub fn mapped(&self) -> impl Iterator<Item = (u64, ChunkHandle)> + '_ {
        self.segments
            .iter()
            .enumerate()
            .filter(|(_, s)| !Arc::ptr_eq(s, &self.empty))
            .flat_map(|(i, s)| s.iter().enumerate().filter_map(move |(j, h)| h.map(|h| ((i * SEGMENT + j) as u64, h))))
    }
}

impl Index<usize> for PageTable {
    type Output = Option<ChunkHandle>;

    fn index(&self, p: usize) -> &Option<ChunkHandle> {
        assert!(p < self.pages, "page {p} out of the table's {}", self.pages);
        &self.segments[p / SEGMENT][p % SEGMENT]
    }
}

impl IndexMut<usize> for PageTable {
    /// Copies the page's segment first if a copy of the table shares it.
    fn index_mut(&mut self, p: usize) -> &mut Option<ChunkHandle> {
        assert!(p < self.pages, "page {p} out of the table's {}", self.pages);
        &mut Arc::make_mut(&mut self.segments[p / SEGMENT])[p % SEGMENT]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_shares_segments_until_written_and_writes_stay_apart() {
        let mut a = PageTable::new(3 * SEGMENT + 5).unwrap();
        a[7] = Some(ChunkHandle(70));
        a[3 * SEGMENT + 4] = Some(ChunkHandle(99));
        let mut b = a.clone();
        assert!(Arc::ptr_eq(&a.segments[0], &b.segments[0]), "a copy shares");
        b[7] = None;
        b[SEGMENT] = Some(ChunkHandle(1));
        assert!(!Arc::ptr_eq(&a.segments[0], &b.segments[0]), "a write copies its segment");
        assert!(Arc::ptr_eq(&a.segments[3], &b.segments[3]), "others stay shared");
        assert_eq!((a[7], b[7]), (Some(ChunkHandle(70)), None));
        assert_eq!((a[SEGMENT], b[SEGMENT]), (None, Some(ChunkHandle(1))));
        assert_eq!(b[3 * SEGMENT + 4], Some(ChunkHandle(99)));
        let listed: Vec<(u64, ChunkHandle)> = b.mapped().collect();
        assert_eq!(
            listed,
            vec![(SEGMENT as u64, ChunkHandle(1)), ((3 * SEGMENT + 4) as u64, ChunkHandle(99))],
            "mapped pages in order"
        );
    }

    #[test]
    #[should_panic(expected = "out of the table")]
    fn a_page_past_the_end_panics_like_a_vector() {
        let t = PageTable::new(10).unwrap();
        let _ = t[10];
    }
}
