//! What a device group's undo needs beyond a resize back (`group.rs`): a
//! reservation that a growth extended in place, trimmed back, and the
//! retired ranges each member holds, so that when an undone change had
//! released them on one member they can be released on every member: the
//! members' free ranges stay alike and deterministic placement keeps every
//! member's offsets equal.

use crate::error::Result;
use crate::id::Id;

use super::{Arena, Touch};

impl Arena {
    /// Trims `id`'s reservation back to `reserved_bytes` (rounded up to
    /// whole chunks) where a growth extended it in place: the pages beyond
    /// become free again, and the chunks cached there stay cached (a free
    /// page may hold a cached chunk). No driver call. Nothing changes if
    /// the reservation is not larger, if backed pages reach past
    /// `reserved_bytes`, or if the allocation sleeps.
    pub(crate) fn trim_reservation(&self, id: Id, reserved_bytes: u64) -> Result<()> {
        self.run(Touch::Nothing, |inner, _, _| {
            let st = &mut inner.st;
            let slot = st.lookup(id)?;
            let keep = reserved_bytes.div_ceil(st.chunk);
            let a = st.alloc(slot);
            if a.reserved <= keep || a.backed > keep || a.sleep.is_some() {
                return Ok(());
            }
            let (from, extra) = (a.start + keep, a.reserved - keep);
            st.alloc_mut(slot).reserved = keep;
            st.free.insert(from, extra);
            Ok(())
        })
    }

    /// The retired ranges, as (first page, pages) from the arena's base,
    /// in address order.
    pub(crate) fn retired_ranges(&self) -> Result<Vec<(u64, u64)>> {
        self.run(Touch::Nothing, |inner, _, _| Ok(inner.st.retired.iter().map(|(&s, &l)| (s, l)).collect()))
    }
}
