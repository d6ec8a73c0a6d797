//! What the model knows of every allocation: its size, place, stamps and
//! sleep, and its *model chunks*, whose sharing (reference counts, bytes
//! written through one holder seen through every other) is worked out here.

use vmm_arena::Id;

use super::super::common::Stamps;
use super::Harness;

/// Stamps: (offset, bytes) pairs.
pub(super) type Marks = Vec<(u64, Vec<u8>)>;

/// What a sleeper slept with.
#[derive(Clone, Debug)]
pub(super) struct Slept {
    /// Its stamps when it fell asleep, if it slept with a backup.
    pub(super) backup: Option<Marks>,
    /// Order of falling asleep.
    pub(super) seq: u64,
    /// Per backed page: whether its chunk was shared then (it joined the
    /// chunk's group and shares again on wake).
    pub(super) grouped: Vec<bool>,
}

/// What the model knows about one allocation.
#[derive(Debug)]
pub(super) struct Model {
    pub(super) size: u64,
    pub(super) growable: bool,
    pub(super) pinned: bool,
    /// Packed in a slab (a non-growable allocation of at most half a chunk,
    /// until a resize beyond the small classes promotes it).
    pub(super) small: bool,
    pub(super) ptr: u64,
    /// Bytes reserved for it: its reservation, or its size class if small.
    pub(super) reserved: u64,
    pub(super) stamps: Stamps,
    pub(super) tag: u32,
    /// Asleep (its stamps restored on wake, see `Harness::wake`).
    pub(super) asleep: bool,
    /// Model chunks of its backed pages (empty for a small one).
    pub(super) chunks: Vec<u64>,
    pub(super) slept: Option<Slept>,
    /// Promised no more work (`quiesce_on_stream`) since it last grew or
    /// slept: the harness writes nothing through it.
    pub(super) quiesced: bool,
}

/// The pieces of `marks` inside page `page` (pages of `c` bytes), as
/// (offset in the page, bytes); a mark across a page boundary is split.
pub(super) fn marks_in_page(marks: &[(u64, Vec<u8>)], page: u64, c: u64) -> Vec<(u64, Vec<u8>)> {
    let (lo, hi) = (page * c, (page + 1) * c);
    marks
        .iter()
        .filter_map(|(off, b)| {
            let (s, e) = ((*off).max(lo), (off + b.len() as u64).min(hi));
            (s < e).then(|| (s - lo, b[(s - off) as usize..(e - off) as usize].to_vec()))
        })
        .collect()
}

/// Replaces whatever `marks` said about `off..off + bytes.len()` by `bytes`.
fn overwrite(marks: &mut Vec<(u64, Vec<u8>)>, off: u64, bytes: Vec<u8>) {
    let end = off + bytes.len() as u64;
    marks.retain(|(o, b)| o + b.len() as u64 <= off || *o >= end);
    marks.push((off, bytes));
}

impl Harness {
    pub(super) fn fresh_chunks(&mut self, n: u64) -> Vec<u64> {
        let first = self.next_chunk;
        self.next_chunk += n;
        (first..first + n).collect()
    }

    /// How many of `id`'s backed pages `pages` (indices into its model
    /// chunks) map a chunk no other awake allocation maps.
    pub(super) fn mapped_alone(&self, id: Id, pages: std::ops::Range<usize>) -> u64 {
        let m = &self.live[&id];
        if m.asleep {
            return 0;
        }
        m.chunks[pages].iter().filter(|&&k| self.awake_holders(k).iter().all(|&(o, _)| o == id)).count() as u64
    }

    /// Awake allocations mapping model chunk `k`, with the page where each does.
    pub(super) fn awake_holders(&self, k: u64) -> Vec<(Id, u64)> {
        self.live
            .iter()
            .filter(|(_, m)| !m.asleep)
            .flat_map(|(&id, m)| {
                m.chunks.iter().enumerate().filter(move |&(_, &x)| x == k).map(move |(j, _)| (id, j as u64))
            })
            .collect()
    }

    /// Writes fresh stamps over `from..to` of `id` (replacing what its
    /// stamps said there), and copies them into every other awake holder
    /// of the chunks written.
    pub(super) fn restamp(&mut self, id: Id, from: u64, to: u64) {
        let seed = self.seed();
        let c = self.c;
        let m = self.live.get_mut(&id).unwrap();
        m.stamps.marks.retain(|(o, b)| o + b.len() as u64 <= from || *o >= to);
        let n0 = m.stamps.marks.len();
        m.stamps.seed = seed;
        m.stamps.write(&self.arena, id, from, to);
        let written: Marks = m.stamps.marks[n0..].to_vec();
        let chunks = m.chunks.clone();
        for (i, &k) in chunks.iter().enumerate() {
            let pieces = marks_in_page(&written, i as u64, c);
            if pieces.is_empty() {
                continue;
            }
            for (other, j) in self.awake_holders(k) {
                if other == id {
                    continue;
                }
                let o = self.live.get_mut(&other).unwrap();
                for (off, bytes) in &pieces {
                    let at = j * c + off;
                    if at < o.size {
                        let keep = (o.size - at).min(bytes.len() as u64) as usize;
                        overwrite(&mut o.stamps.marks, at, bytes[..keep].to_vec());
                    }
                }
            }
        }
    }
}
