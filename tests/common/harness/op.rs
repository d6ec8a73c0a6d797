//! What the includers draw (proptest) or decode (fuzz bytes): the arena's
//! configuration and the operations the harness applies.

use vmm_arena::driver::fault::FaultKind;
use vmm_arena::ALL_TAGS;

#[derive(Clone, Debug)]
pub struct Config {
    pub cap_pages: u64,
    pub reserve_pages: u64,
    pub retain_pages: Option<u64>,
    pub no_implicit_moves: bool,
}

#[derive(Clone, Debug)]
pub enum Op {
    Alloc(u64),
    /// An allocation made with a tag (`alloc_tagged`); a small one goes
    /// into a slab of that tag.
    AllocTagged(u64, u32),
    AllocGrowable(u64, u64),
    /// A share of the `src`th live allocation: from its whole page
    /// `first`, `pages` pages, reserving `extra` pages more (each taken
    /// modulo what the source allows; a source without a whole chunk is
    /// refused).
    AllocShared {
        src: usize,
        first: u64,
        pages: u64,
        extra: u64,
    },
    Free(usize),
    Resize(usize, u64),
    /// `resize_on_stream` on the stream given: the model is `Resize`'s.
    /// Neither the host nor the mock (without streams) records an event,
    /// so `stream_shrinks` stays 0 there; on a GPU it counts the shrinks
    /// that drop whole chunks.
    ResizeOnStream(usize, u64, u64),
    /// `quiesce_on_stream` of the `n`th live allocation on the stream given.
    Quiesce(usize, u64),
    /// `unquiesce` of the `n`th live allocation (no driver call).
    Unquiesce(usize),
    Pin(usize),
    Unpin(usize),
    Compact,
    ReleaseRetired,
    Trim(u64),
    Write(usize),
    /// A stale or made-up id must be refused.
    BadId(u64),
    /// Tags 0..=2 (a small allocation refuses any).
    SetTag(usize, u32),
    /// A tag (3: `ALL_TAGS`), with or without a backup.
    Sleep(u32, bool),
    Wake(u32),
    /// `resize_many` of the `n`th live allocations to the sizes given (a
    /// repeated pick is dropped): all or nothing, every byte included.
    ResizeMany(Vec<(usize, u64)>),
    /// `maintain` with the prefetch targets given (in chunks; set back to
    /// none after it), the stats read inside its driver calls as another
    /// thread would read them while it runs (see `harness/maintain.rs`).
    Maintain {
        precreate: u64,
        ahead: u64,
    },
    /// `prepare_alloc(size, max, growable)`: whole chunks, moving nothing.
    PrepareAlloc(u64, u64, bool),
    /// `prepare_resize` of the `n`th live allocation.
    PrepareResize(usize, u64),
    /// `prepare_free` of the `n`th live allocation.
    PrepareFree(usize),
    /// `commit` (true) or `abort` of the `n`th pending prepared operation.
    Settle(usize, bool),
    /// The `n`th driver call of the operation fails with the fault.
    Faulty(u64, FaultKind, Box<Op>),
}

/// The model's tags: 0..=2, and 3 for `ALL_TAGS`.
pub fn tag_arg(t: u32) -> u32 {
    if t == 3 {
        ALL_TAGS
    } else {
        t
    }
}
