//! Staged admissions (the `arena-staged` row, an experiment; sim/DESIGN.md,
//! "Staged admissions"): an admission's mapping spread over the steps
//! before it, within what each step's GPU time hides, with idle chunks
//! only. Whole prompts only: under chunked prefill each chunk is grown
//! between steps anyway (`prepare_growth`).

use super::*;

/// An admission whose allocation is being mapped over several steps: it
/// holds its hit and part of its chunks, and is handed out by `admit` once
/// its whole size is mapped.
pub(super) struct Staged {
    pub(super) seq: usize,
    pub(super) tokens: u64,
    pub(super) id: Id,
    pub(super) size: u64,
    /// Bytes mapped so far.
    pub(super) backed: u64,
    pub(super) hit: u64,
    /// Bytes its hit added to the running requests' sharing.
    pub(super) shared_bytes: u64,
}

/// Counts of staged admissions, for the report.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct StageStats {
    /// Admissions begun over several steps, and the steps they waited.
    pub(super) begun: u64,
    pub(super) waits: u64,
    /// Given up: their request was no longer the front, or a running
    /// request's growth needed their memory.
    pub(super) given_up: u64,
    /// Finished on the critical path (nothing ran to hide under).
    pub(super) finished_critical: u64,
    /// Steps whose staging stopped for want of chunks that another address
    /// can take without a synchronize (it evicted ahead instead).
    pub(super) short_of_idle: u64,
}

/// Of a step's GPU time, the share staged admissions may fill with driver
/// work (the rest is left to `maintain` and `release_retired`).
const STAGE_SHARE: f64 = 0.8;

/// Steps admission waits for a staged admission before finishing its
/// mapping on the critical path. Waiting holds up the whole queue: with
/// no bound, the Mooncake replay at 32 GiB fell to 0.43x vLLM's tokens/s
/// (515,451 steps instead of 43,225); one step measured best (see
/// BENCHMARKS.md).
pub(super) const MAX_STAGE_WAIT: u64 = 1;

/// Chunks mapped per slice of a staged admission's growth: the budget is
/// checked after each slice, so a step overshoots it by at most one.
const STAGE_SLICE_CHUNKS: u64 = 16;

impl ArenaMgr {
    /// Whether admissions are mapped over several steps (`Stream` mode,
    /// preparation and staging on, one allocation per request, whole
    /// prompts: under chunked prefill each chunk is grown between steps
    /// anyway, and a staging keyed by a chunk's token count would restart
    /// whenever the step's plan changes).
    pub(super) fn staging(&self) -> bool {
        self.mode == ArenaMode::Stream && self.prepare && self.stage && self.shape.n_allocs() == 1 && !self.chunked
    }

    /// Chunks another address can take now without a device synchronize
    /// or an event wait: unmapped pooled chunks, cached chunks known idle,
    /// and free capacity (new chunks) where no cached chunk needs a
    /// synchronize (the arena takes those before creating).
    pub(super) fn idle_bytes(&self) -> u64 {
        let Ok(s) = self.arena.stats() else { return 0 };
        let room = s.capacity_bytes.saturating_sub(s.mapped_bytes + s.pooled_bytes);
        let room = if s.cached_mapped_bytes == s.idle_cached_bytes { room } else { 0 };
        s.unmapped_pooled_bytes + s.idle_cached_bytes + room
    }

    /// Begins a staged admission of `size` bytes, mapping at most `now`
    /// bytes past its hit: the allocation and its prefix hit.
    pub(super) fn stage_begin(&mut self, size: u64, now: u64, q: &Request) -> Result<(Id, u64), Fail> {
        let max = size.max(self.bytes_for(self.shape.max_context));
        match self.prefix.as_mut() {
            Some(p) => p.begin(&self.arena, size, max, q, self.discard, now).map_err(|e| self.fail(e, size)),
            None => {
                let first = size.min(now.max(self.chunk));
                self.arena.alloc_growable(first, max).map(|(id, _)| (id, 0)).map_err(|e| self.fail(e, size))
            }
        }
    }

    /// Grows the staged allocation to `new_size` bytes.
    pub(super) fn stage_grow(&mut self, new_size: u64) -> Result<(), Fail> {
        let s = self.staged.as_ref().expect("a staged admission");
        let (id, backed) = (s.id, s.backed);
        let done = match self.prefix.as_mut() {
            Some(p) => p.grow(&self.arena, id, backed, new_size, self.discard),
            None => self.arena.resize(id, new_size).map(|_| ()),
        };
        done.map_err(|e| self.fail(e, new_size - backed))?;
        self.staged.as_mut().expect("staged").backed = new_size;
        Ok(())
    }

    /// The staged admission is fully mapped and admitted: it runs.
    pub(super) fn stage_finish(&mut self, q: &Request) -> (usize, Result<u64, Fail>, u64) {
        let s = self.staged.take().expect("a staged admission");
        let mut uncached = None;
        if let Some(p) = self.prefix.as_mut() {
            p.finish(&self.arena, s.id, q, s.tokens);
            uncached = uncached_after(q, s.tokens);
        }
        *slot_vec(&mut self.seqs, s.seq) = Some(ArenaSeq { ids: vec![s.id], cap: s.size / self.shape.bpt(), uncached });
        (s.seq, Ok(s.hit), s.shared_bytes)
    }

    /// Gives the staged admission up (never run by the GPU): its hit goes
    /// back to the cache's queue, its allocation is freed; `now` when its
    /// memory is needed at once (a plain free), else on the stream.
    pub(super) fn stage_give_up(&mut self, now: bool) {
        let Some(s) = self.staged.take() else { return };
        self.stage_stats.given_up += 1;
        match self.prefix.as_mut() {
            Some(p) => p.give_up(&self.arena, s.id, now),
            None => {
                let _ = if now { self.arena.free(s.id) } else { self.free_one(s.id) };
            }
        }
    }

    /// Stops a staging step for want of idle chunks: evicts what the
    /// admission still needs now (and the running requests' growth
    /// reserve), so that those chunks are idle next step.
    pub(super) fn stage_short(&mut self, bytes: u64) {
        self.stage_stats.short_of_idle += 1;
        let reserve = self.growth_reserve();
        if let Some(p) = self.prefix.as_mut() {
            p.evict_ahead(&self.arena, bytes + reserve, self.discard);
        }
    }

    /// Idle chunks staging leaves to the running requests' growth: a
    /// request crosses into a new chunk every 16 tokens at 128 KiB a token,
    /// so about an eighth of the batch in a step, with some slack. Without
    /// it, staging would take every idle chunk and growth would synchronize
    /// to steal one.
    pub(super) fn growth_reserve(&self) -> u64 {
        let running = self.seqs.iter().filter(|s| s.is_some()).count() as u64;
        (running.div_ceil(8) + 4) * self.chunk
    }

    /// `prepare_admissions` with staging: the front's admissions, in order,
    /// each mapped only with chunks another address can take without a
    /// synchronize or an event wait, and only while the driver time spent
    /// stays within [`STAGE_SHARE`] of the step's GPU time. One that is not
    /// fully mapped stays staged (its chunks kept) and goes on in the next
    /// step; admission waits for it (`admission_ready`).
    pub(super) fn prepare_staged(&mut self, front: &[(usize, u64, &Request)], budget: &StepBudget<'_>) {
        let start = self.dev.calls();
        let limit = STAGE_SHARE * budget.gpu_s;
        let spent = |m: &ArenaMgr| budget.profile.driver_s(&m.dev.calls().since(&start));
        for &(seq, tokens, q) in front {
            if self.staged.as_ref().is_some_and(|s| (s.seq, s.tokens) != (seq, tokens)) {
                self.stage_give_up(false);
            }
            let size = self.bytes_for(tokens);
            if self.staged.is_none() {
                if spent(self) >= limit {
                    return;
                }
                let hit = self.prefix.as_ref().map_or(0, |p| p.hit_bytes(q));
                let idle = self.idle_bytes().saturating_sub(self.growth_reserve());
                if idle < self.chunk && hit == 0 {
                    self.stage_short(size);
                    return;
                }
                // With no idle chunk, only the hit is mapped now (it needs
                // no new chunk), which keeps it from eviction.
                let now = idle.min(STAGE_SLICE_CHUNKS * self.chunk) / self.chunk * self.chunk;
                let shared_before = self.shared_live_bytes_all();
                match self.stage_begin(size, now, q) {
                    Ok((id, hit)) => {
                        let backed = self.arena.query(id).map_or(0, |i| i.mapped_bytes).min(size);
                        let shared_bytes = self.shared_live_bytes_all().saturating_sub(shared_before);
                        self.staged = Some(Staged { seq, tokens, id, size, backed, hit, shared_bytes });
                        self.stage_stats.begun += 1;
                    }
                    Err(f) => {
                        self.prepared.push(Prepared { seq, tokens, outcome: Err(f), shared_bytes: 0 });
                        return;
                    }
                }
            }
            loop {
                let s = self.staged.as_ref().expect("staged above");
                if s.backed >= s.size {
                    let (seq, outcome, shared_bytes) = self.stage_finish(q);
                    self.prepared.push(Prepared { seq, tokens, outcome, shared_bytes });
                    break;
                }
                let left = s.size - s.backed;
                if spent(self) >= limit {
                    self.stage_stats.waits += 1;
                    return;
                }
                let idle = self.idle_bytes().saturating_sub(self.growth_reserve());
                if idle < self.chunk {
                    self.stage_stats.waits += 1;
                    self.stage_short(left);
                    return;
                }
                let more = idle.min(STAGE_SLICE_CHUNKS * self.chunk).min(left) / self.chunk * self.chunk;
                let next = self.staged.as_ref().expect("staged").backed + more.max(self.chunk).min(left);
                if let Err(f) = self.stage_grow(next) {
                    self.stage_give_up(false);
                    self.prepared.push(Prepared { seq, tokens, outcome: Err(f), shared_bytes: 0 });
                    return;
                }
            }
        }
    }
}
