//! Where the `arena` rows' driver calls come from: the chunks mapped,
//! unmapped and created, and the access calls made, by the engine's
//! action that made them (admission, prepared admission, growth, growth
//! made between steps, free, the between-steps upkeep). Reported in the
//! JSON as `arena_calls_by_phase`, to tell which action an adoption path
//! must serve.

use super::*;
use crate::counted::Calls;

/// An engine action of the arena rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phase {
    /// Admission on the critical path.
    Admit,
    /// Admission prepared between steps (`prepare_admissions`).
    PreparedAdmit,
    /// Growth on the critical path (`grow`, `grow_batch`).
    Grow,
    /// Growth made between steps (`prepare_growth`, `prepare_decode_growth`).
    PreparedGrow,
    /// A request's end or preemption (`free`).
    Free,
    /// `release_retired` and `maintain` between steps.
    Upkeep,
}

const PHASES: [(Phase, &str); 6] = [
    (Phase::Admit, "admit"),
    (Phase::PreparedAdmit, "prepared_admit"),
    (Phase::Grow, "grow"),
    (Phase::PreparedGrow, "prepared_grow"),
    (Phase::Free, "free"),
    (Phase::Upkeep, "upkeep"),
];

/// The calls of each [`Phase`], summed over a run.
#[derive(Clone, Debug, Default)]
pub(super) struct PhaseCalls {
    totals: [Calls; 6],
}

impl PhaseCalls {
    /// Adds the calls made since `before` to `phase`.
    pub(super) fn add(&mut self, phase: Phase, before: &Calls, now: &Calls) {
        let i = PHASES.iter().position(|&(p, _)| p == phase).unwrap_or(0);
        self.totals[i] = self.totals[i].plus(&now.since(before));
    }

    /// The tally as a JSON object: per phase, the chunks mapped, unmapped
    /// and created, and the access calls and synchronizes made.
    pub(super) fn json(&self) -> String {
        let fields: Vec<String> = PHASES
            .iter()
            .zip(&self.totals)
            .map(|(&(_, name), c)| {
                format!(
                    "\"{name}\": {{\"map_chunks\": {}, \"unmap_chunks\": {}, \"unmap_calls\": {}, \"create_chunks\": {}, \"access_calls\": {}, \"syncs\": {}}}",
                    c.map_chunks, c.unmap_chunks, c.unmap, c.create_chunks, c.set_access, c.synchronize
                )
            })
            .collect();
        format!("{{{}}}", fields.join(", "))
    }
}

impl ArenaMgr {
    /// Runs `f`, counting its driver calls to `phase`.
    pub(super) fn in_phase<T>(&mut self, phase: Phase, f: impl FnOnce(&mut ArenaMgr) -> T) -> T {
        let before = self.dev.calls();
        let out = f(self);
        let now = self.dev.calls();
        self.phase_calls.add(phase, &before, &now);
        out
    }
}
