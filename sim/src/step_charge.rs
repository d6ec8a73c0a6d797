//! One accounting rule for every replay: how a step's driver calls are
//! charged to its time. `kv_serving` (`replay.rs`), `multi_model` and
//! `idle_footprint` all hand their calls to [`charge_step`], so a rule
//! cannot be applied in one program and missed in another.
//!
//! A step's calls are split by where the engine makes them ([`StepCalls`]):
//!
//! - **critical**: on the engine thread while it prepares the step, before
//!   the GPU can start it (admission, growth and frees the step waits for);
//!   all of their time is charged, and a drain among them (a device
//!   synchronize, a wait on an event not yet complete) costs the step the
//!   overlap of its CPU work with the GPU;
//! - **between**: on the engine thread while the GPU computes the step
//!   (asynchronous scheduling: the next step's memory; a finished step's
//!   frees; prefetch); hidden up to the step's GPU time, the excess charged;
//!   a drain among them makes the CPU wait for the GPU, and none of them is
//!   hidden then.
//!
//! The rule itself is [`Profile::step`] (`timing.rs`); this module is the
//! one way into it. Calls made by other threads (kvcached's
//! pre-allocation thread) are charged to no step: [`DriverTally`] prices
//! them serially beside the engine thread's.

use crate::attention::AttnLayout;
use crate::counted::Calls;
use crate::managers::Layout;
use crate::timing::{Profile, StepTime, StepWork};

/// The KV layout attention kernels see under manager `name`, in every
/// replay: vLLM's block pool is paged, and so is kvcached's (it keeps
/// vLLM's blocks; `static` in `multi_model` is vLLM's pool; `arena-paged`
/// reads its chunks through a block table); every other
/// manager lays a request's KV out as `layout` says (block-in-chunk is
/// read by the paged kernel: a chunk is one block of its block table).
pub fn attn_layout(name: &str, layout: Layout) -> AttnLayout {
    match (name, layout) {
        ("vllm-paged" | "arena-paged" | "static" | "kvcached", _) => AttnLayout::Paged,
        (_, Layout::TokenMajor) => AttnLayout::TokenMajor,
        (_, Layout::PerLayer) => AttnLayout::PerLayer,
        (_, Layout::BlockInChunk) => AttnLayout::Paged,
    }
}

/// A step's driver calls, by where the engine made them (see the module
/// documentation).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StepCalls {
    pub critical: Calls,
    pub between: Calls,
}

impl StepCalls {
    /// Sets `w`'s allocator fields from the calls, priced by `prof`.
    pub fn price_into(&self, prof: &Profile, w: &mut StepWork) {
        w.alloc_critical_s = prof.driver_s(&self.critical);
        w.critical_syncs = self.critical.synchronize;
        w.critical_blocking_waits = self.critical.event_wait_blocked;
        w.alloc_between_s = prof.driver_s(&self.between);
        w.between_drains = self.between.drains();
    }
}

/// Driver time over a run.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct DriverTally {
    /// Charged to steps (critical, plus between-steps time not hidden).
    pub charged_s: f64,
    /// Between-steps time the GPU hid.
    pub hidden_s: f64,
    /// Every call made on the engine thread, priced one after another.
    pub caller_thread_s: f64,
    /// Every call, the other threads' included, priced one after another.
    pub serial_s: f64,
    /// Steps charged, and those with a drain (critical or between).
    pub steps: u64,
    pub drained_steps: u64,
    pub synchronizes: u64,
    /// Every call made, all threads.
    pub calls: Calls,
}

impl DriverTally {
    /// Calls made off the engine thread (charged to no step).
    pub fn add_background(&mut self, prof: &Profile, c: &Calls) {
        self.serial_s += prof.serial_driver_s(c);
        self.synchronizes += c.synchronize;
        self.calls = self.calls.plus(c);
    }

    /// Calls made on the engine thread: priced there and in the serial sum.
    fn add_engine(&mut self, prof: &Profile, c: &Calls) {
        self.caller_thread_s += prof.serial_driver_s(c);
        self.add_background(prof, c);
    }
}

/// Charges one step: `work`'s allocator fields are set from `calls`, its
/// time is [`Profile::step`]'s, and the tally takes both.
pub fn charge_step(prof: &Profile, work: &mut StepWork, calls: &StepCalls, tally: &mut DriverTally) -> StepTime {
    calls.price_into(prof, work);
    let t = prof.step(work);
    let all = calls.critical.plus(&calls.between);
    tally.charged_s += t.alloc_charged_s;
    tally.hidden_s += t.alloc_hidden_s;
    tally.add_engine(prof, &all);
    tally.steps += 1;
    tally.drained_steps += u64::from(all.drains() > 0);
    t
}

/// An engine with asynchronous scheduling (`multi_model`'s and
/// `idle_footprint`'s engines): step k+1 is scheduled while step k
/// computes, and step k's outputs (its finished requests' frees) are
/// processed while step k+1 computes. So a step's between-steps work is
/// its schedule's calls plus what the engine did after its previous step
/// (frees at completion, between-steps hooks), hidden up to the step's GPU
/// time unless a drain is among them. What an engine does before it goes
/// idle delays no step: priced, charged to none ([`AsyncEngine::went_idle`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct AsyncEngine {
    after_last_step: Calls,
}

impl AsyncEngine {
    /// Calls made after the step just charged (frees of its finished
    /// requests, between-steps hooks): the next step's between work.
    pub fn after_step(&mut self, c: &Calls) {
        self.after_last_step = self.after_last_step.plus(c);
    }

    /// The calls made since the last step was charged: with a schedule's,
    /// the between-steps work of the next step [`AsyncEngine::charge`]s.
    pub fn pending(&self) -> Calls {
        self.after_last_step
    }

    /// Charges a step whose schedule made `schedule`.
    pub fn charge(
        &mut self,
        prof: &Profile,
        work: &mut StepWork,
        schedule: &Calls,
        tally: &mut DriverTally,
    ) -> StepTime {
        let between = std::mem::take(&mut self.after_last_step).plus(schedule);
        charge_step(prof, work, &StepCalls { critical: Calls::default(), between }, tally)
    }

    /// The engine has nothing to run: what it did after its last step
    /// waited for nothing; priced on its thread, charged to no step.
    pub fn went_idle(&mut self, prof: &Profile, tally: &mut DriverTally) {
        let c = std::mem::take(&mut self.after_last_step);
        tally.add_engine(prof, &c);
    }
}

/// The calls a source made since the last mark (a source's counters only
/// grow).
#[derive(Clone, Copy, Debug, Default)]
pub struct CallMeter {
    mark: Calls,
}

impl CallMeter {
    pub fn new(now: Calls) -> CallMeter {
        CallMeter { mark: now }
    }

    /// The calls since the last mark; marks `now`.
    pub fn take(&mut self, now: Calls) -> Calls {
        let d = now.since(&self.mark);
        self.mark = now;
        d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prof() -> Profile {
        Profile::h200()
    }

    #[test]
    fn between_steps_calls_hide_under_the_gpu_unless_a_drain_is_among_them() {
        let p = prof();
        let mut w = StepWork::default();
        w.add_decode(1000, 1000 * (128 << 10));
        let gpu = p.gpu_s(&w);
        // 100 creates: 19.3 ms, more than the step's GPU time.
        let creates = Calls { create: 100, create_chunks: 100, ..Calls::default() };
        assert!(100.0 * p.create_s > gpu);
        let mut tally = DriverTally::default();
        let t = charge_step(&p, &mut w.clone(), &StepCalls { between: creates, ..Default::default() }, &mut tally);
        assert!((t.alloc_charged_s - (100.0 * p.create_s - gpu)).abs() < 1e-12, "{t:?}");
        let drained = Calls { synchronize: 1, ..creates };
        let t = charge_step(&p, &mut w.clone(), &StepCalls { between: drained, ..Default::default() }, &mut tally);
        assert!((t.alloc_charged_s - (100.0 * p.create_s + p.synchronize_s)).abs() < 1e-12, "{t:?}");
        assert_eq!((tally.steps, tally.drained_steps, tally.synchronizes), (2, 1, 1));
        let serial = 200.0 * p.create_s + p.synchronize_s;
        assert!((tally.serial_s - serial).abs() < 1e-12 && tally.caller_thread_s == tally.serial_s);
        // Background calls: serial time, no step's.
        tally.add_background(&p, &Calls { map: 1, map_chunks: 4, ..Calls::default() });
        assert!((tally.serial_s - serial - 4.0 * p.map_s).abs() < 1e-12);
        assert!((tally.caller_thread_s - serial).abs() < 1e-12);
    }

    #[test]
    fn a_synchronize_on_the_critical_path_adds_the_cpu_step_to_the_gpu() {
        let p = prof();
        let mut w = StepWork::default();
        w.add_decode(10, 10 * (128 << 10));
        let gpu = p.gpu_s(&w);
        let sync = Calls { synchronize: 1, ..Calls::default() };
        let t =
            charge_step(&p, &mut w, &StepCalls { critical: sync, ..Default::default() }, &mut DriverTally::default());
        assert!((t.total_s - (gpu + p.cpu_step_s + p.synchronize_s)).abs() < 1e-12, "{t:?}");
    }

    #[test]
    fn the_meter_gives_the_calls_since_its_mark() {
        let mut m = CallMeter::new(Calls { map: 3, ..Calls::default() });
        assert_eq!(m.take(Calls { map: 5, ..Calls::default() }).map, 2);
        assert_eq!(m.take(Calls { map: 5, ..Calls::default() }).map, 0);
    }
}
