//! Allocation ids: a slot index and a generation, never reused.

use std::num::NonZeroU64;

/// Names one allocation for the arena's lifetime.
///
/// The low 32 bits are the slot index plus one (so an id is never 0), the
/// high 32 bits the slot's generation (31 bits; the top bit tags the ids of
/// small, slab-packed allocations, which have their own slots), bumped each time the slot is freed: a
/// stale id names a generation that no longer lives and is rejected. A slot
/// whose generation would wrap is retired, so an id is never issued twice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Id(NonZeroU64);

impl Id {
    pub(crate) fn compose(slot: u32, generation: u32) -> Id {
        let raw = ((generation as u64) << 32) | (slot as u64 + 1);
        Id(NonZeroU64::new(raw).expect("low half is at least 1"))
    }

    /// A small allocation's id: the top bit tags it, the generation keeps 31 bits.
    pub(crate) fn compose_small(slot: u32, generation: u32) -> Id {
        debug_assert!(generation < 1 << 31);
        Id::compose(slot, generation | 1 << 31)
    }

    /// Whether this id names a small (slab-packed) allocation.
    pub(crate) fn is_small(self) -> bool {
        self.0.get() >> 63 == 1
    }

    /// Slot and generation; for a small id the generation without its tag.
    pub(crate) fn parts(self) -> (u32, u32) {
        let raw = self.0.get();
        (((raw & 0xffff_ffff) as u32).wrapping_sub(1), ((raw >> 32) as u32) & (u32::MAX >> 1))
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
        let id = Id::compose(7, 3);
        assert_eq!(id.parts(), (7, 3));
        assert!(!id.is_small());
        let small = Id::compose_small(7, 3);
        assert!(small.is_small() && small != id);
        assert_eq!(small.parts(), (7, 3));
        assert_eq!(Id::from_raw(id.get()), Some(id));
        assert_eq!(Id::from_raw(0), None);
        // A made-up id whose low half is 0 decodes to a slot that cannot exist.
        assert_eq!(Id::from_raw(1 << 32).unwrap().parts().0, u32::MAX);
    }
}
