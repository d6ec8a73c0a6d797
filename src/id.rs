//! Allocation ids: never reused, and checked against the arena that made them.

use std::num::NonZeroU64;

/// Generations have this many bits; a slot whose generation would pass
/// [`MAX_GENERATION`] is retired for good, so an id is never issued twice.
pub(crate) const GENERATION_BITS: u32 = 15;
pub(crate) const MAX_GENERATION: u32 = (1 << GENERATION_BITS) - 1;

/// Names one allocation for the arena's lifetime.
///
/// Layout, from the top bit down:
/// - 1 bit: set for small (slab-packed) allocations, which have slots of their own;
/// - 15 bits: the slot's generation, bumped each time the slot is freed, so
///   a stale id names a generation that no longer lives;
/// - 16 bits: a tag of the arena that issued the id, so an id of another
///   arena is rejected (unless the two tags collide: 1 in 65,536);
/// - 32 bits: the slot index plus one, so an id is never 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Id(NonZeroU64);

/// The parts of an id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IdParts {
    pub small: bool,
    pub generation: u32,
    pub tag: u16,
    pub slot: u32,
}

impl Id {
    pub(crate) fn compose(p: IdParts) -> Id {
        debug_assert!(p.generation <= MAX_GENERATION);
        let raw = ((p.small as u64) << 63)
            | ((p.generation as u64 & MAX_GENERATION as u64) << 48)
            | ((p.tag as u64) << 32)
            | (p.slot as u64 + 1);
        Id(NonZeroU64::new(raw).expect("low half is at least 1"))
    }

    /// The parts; a made-up id whose low half is 0 decodes to slot `u32::MAX`,
    /// which never exists.
    pub(crate) fn parts(self) -> IdParts {
        let raw = self.0.get();
        IdParts {
            small: raw >> 63 == 1,
            generation: ((raw >> 48) as u32) & MAX_GENERATION,
            tag: (raw >> 32) as u16,
            slot: (raw as u32).wrapping_sub(1),
        }
    }

    /// Whether this id names a small (slab-packed) allocation.
    pub(crate) fn is_small(self) -> bool {
        self.parts().small
    }

    /// The raw value (as the C ABI's `vmm_arena_id`).
    pub fn get(self) -> u64 {
        self.0.get()
    }

    /// An id from a raw value; `None` for 0, which is never issued. Any other
    /// value is accepted here and checked by the arena that receives it.
    pub fn from_raw(raw: u64) -> Option<Id> {
        NonZeroU64::new(raw).map(Id)
    }
}

impl std::fmt::Display for Id {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:#x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        let p = IdParts { small: false, generation: 3, tag: 0xbeef, slot: 7 };
        let id = Id::compose(p);
        assert_eq!(id.parts(), p);
        assert!(!id.is_small());
        let small = Id::compose(IdParts { small: true, ..p });
        assert!(small.is_small() && small != id);
        assert_eq!(Id::from_raw(id.get()), Some(id));
        assert_eq!(Id::from_raw(0), None);
        assert_eq!(Id::from_raw(1 << 40).unwrap().parts().slot, u32::MAX);
        let max = IdParts { small: true, generation: MAX_GENERATION, tag: u16::MAX, slot: u32::MAX - 1 };
        assert_eq!(Id::compose(max).parts(), max);
    }
}
