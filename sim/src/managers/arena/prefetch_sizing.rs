//! How far ahead the `arena` rows ask the arena to work (`Stream` mode):
//! the chunks created ahead, sized to the recent growth of backed memory,
//! and the admission map-ahead windows, sized to recent admissions. Both
//! are set between steps, before `maintain`.

use super::*;

/// Recent admissions: what the next step's admissions will likely need
/// mapped where they will be placed.
#[derive(Clone, Debug, Default)]
pub(super) struct AdmissionRate {
    /// Bytes of each of the last [`ADMISSIONS_KEPT`] allocations admitted.
    pub(super) recent: std::collections::VecDeque<u64>,
    /// Allocations admitted since the last look.
    pub(super) this_step: u64,
    /// Exponentially weighted mean of allocations admitted per step.
    pub(super) per_step: f64,
    /// The target set last: (ready bytes, windows).
    pub(super) target: (u64, u32),
}

/// Admissions the window size is taken from.
const ADMISSIONS_KEPT: usize = 64;

/// Windows kept at most (a step admits a few requests at a time).
const MAX_WINDOWS: u32 = 4;

impl AdmissionRate {
    pub(super) fn record(&mut self, bytes: u64) {
        if self.recent.len() == ADMISSIONS_KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(bytes);
        self.this_step += 1;
    }
}

/// The recent growth of the memory backing allocations, per step: the
/// chunks an engine must have created before the next step's admissions
/// and growth can map them without a create on the critical path.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct GrowthRate {
    /// Backed bytes at the last look.
    pub(super) last: u64,
    /// Exponentially weighted mean of the per-step increase (decreases
    /// count as none: freed memory is pooled, and serves growth at once).
    pub(super) mean: f64,
    /// The precreate target set last.
    pub(super) target: u64,
}

impl ArenaMgr {
    /// Sizes the chunks created ahead to the need: at least the asked-for
    /// target, and as much as backed memory grew per step lately (the
    /// weighted mean of the increases, half each step), so that a step's
    /// admissions and growth find created chunks while live KV climbs,
    /// and nothing more is held once it stops climbing (then freed
    /// memory serves them). The pool gives way to allocations before any
    /// request is refused (it is the first source of every plan), so it
    /// never causes a preemption; beyond the asked-for target it is bounded
    /// by 1/64 of the backed memory (the footprint) and by the room left
    /// beside what is backed.
    pub(super) fn size_precreate(&mut self) {
        let (base, map_ahead) = self.base_prefetch;
        if base == 0 && map_ahead == 0 {
            return; // prefetch off
        }
        let Ok(s) = self.arena.stats() else { return };
        let rise = s.mapped_bytes.saturating_sub(self.growth.last) as f64;
        self.growth.last = s.mapped_bytes;
        self.growth.mean = 0.5 * self.growth.mean + 0.5 * rise;
        let room = s.capacity_bytes.saturating_sub(s.mapped_bytes + s.pending_free_bytes);
        // The footprint bound: what is created beyond the asked-for target
        // stays within 1/64 of the backed memory (1.6 %).
        let bound = base + s.mapped_bytes / 64;
        let want = ((self.growth.mean as u64).min(bound)).div_ceil(self.chunk) * self.chunk;
        let target = want.max(base).min(room.max(base));
        if target != self.growth.target {
            self.growth.target = target;
            if let Err(e) = self.arena.set_prefetch(target, map_ahead) {
                self.maintain_errors += 1;
                self.last_maintain_error = Some(e.to_string());
            }
        }
    }

    /// Sizes the admission map-ahead windows (`Arena::set_admission_prefetch`)
    /// to recent admissions: as many windows as allocations admitted per
    /// step lately (the weighted mean, rounded up, 1 to [`MAX_WINDOWS`]),
    /// each as large as the 90th percentile of the last
    /// [`ADMISSIONS_KEPT`] admitted allocations, at the places allocations
    /// reserving a full context will be given; none while requests wait. An admission on a decode
    /// step (a request that arrived during the step before, when the
    /// waiting queue was empty and nothing could be prepared) then adopts
    /// chunks `maintain` mapped while the GPU computed. Window chunks are
    /// the precreated ones and spare idle ones, so the footprint is what
    /// [`ArenaMgr::size_precreate`] makes it.
    pub(super) fn size_admission_windows(&mut self) {
        let r = &mut self.admissions;
        r.per_step = 0.5 * r.per_step + 0.5 * r.this_step as f64;
        r.this_step = 0;
        if r.recent.is_empty() || self.base_prefetch == (0, 0) {
            return;
        }
        // While requests wait, the next admissions are theirs: prepared
        // between steps (`prepare_admissions`), or blocked until memory is
        // freed; windows would only move chunks for nothing.
        let (ready, windows) = if self.waiting > 0 {
            (0, 0)
        } else {
            let mut sizes: Vec<u64> = r.recent.iter().copied().collect();
            sizes.sort_unstable();
            (sizes[sizes.len() * 9 / 10], (r.per_step.ceil() as u32).clamp(1, MAX_WINDOWS))
        };
        if (ready, windows) == r.target {
            return;
        }
        r.target = (ready, windows);
        let reserve = self.bytes_for(self.shape.max_context);
        if let Err(e) = self.arena.set_admission_prefetch(reserve, ready, windows) {
            self.maintain_errors += 1;
            self.last_maintain_error = Some(e.to_string());
        }
    }
}
