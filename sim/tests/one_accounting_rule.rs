//! One accounting rule in every replay (`step_charge.rs`): each rule with a
//! hand-computed expectation, through `multi_model`'s and
//! `idle_footprint`'s engines, and the same calls charged the same in
//! both. The managers here are stand-ins that make fixed driver calls, so
//! the expected charges follow from the profile's prices alone.

use std::collections::HashSet;
use std::sync::Arc;

use vmm_sim::attention::AttnLayout;
use vmm_sim::counted::Calls;
use vmm_sim::idle_footprint::{self, IdleConfig, IdleEngine, IdleRequest};
use vmm_sim::managers::Layout;
use vmm_sim::multi_model::{self, ArenaKv, KvcachedKv, MmConfig, MmRequest, SharedKv, StaticKv};
use vmm_sim::timing::Profile;

/// Calls of an admission: 10 chunks created (1.93 ms at the profiles'
/// prices), with or without a device synchronize.
fn admit_calls(sync: bool) -> Calls {
    Calls { create: 10, create_chunks: 10, synchronize: u64::from(sync), ..Calls::default() }
}

/// Calls of a free: 10 chunks unmapped after a synchronize (as kvcached
/// unmaps under asynchronous scheduling).
fn free_calls() -> Calls {
    Calls { unmap: 1, unmap_chunks: 10, synchronize: 1, ..Calls::default() }
}

/// A manager that makes fixed calls: `admit` for each admission, `free`
/// for each free, nothing for growth; memory never runs out.
struct FixedCalls {
    calls: Calls,
    admit: Calls,
    free: Calls,
    live: HashSet<(usize, usize)>,
}

impl FixedCalls {
    fn new(admit: Calls, free: Calls) -> FixedCalls {
        FixedCalls { calls: Calls::default(), admit, free, live: HashSet::new() }
    }
}

impl SharedKv for FixedCalls {
    fn name(&self) -> &'static str {
        "fixed"
    }
    fn reserve(&mut self, m: usize, rid: usize, _tokens: u64) -> bool {
        if self.live.insert((m, rid)) {
            self.calls = self.calls.plus(&self.admit);
        }
        true
    }
    fn free(&mut self, m: usize, rid: usize) {
        if self.live.remove(&(m, rid)) {
            self.calls = self.calls.plus(&self.free);
        }
    }
    fn held(&self, _m: usize) -> u64 {
        0
    }
    fn path_calls(&self) -> Calls {
        self.calls
    }
}

impl IdleEngine for FixedCalls {
    fn admit(&mut self, id: u64, _q: &IdleRequest) -> Option<u64> {
        self.reserve(0, id as usize, 0);
        Some(0)
    }
    fn decode(&mut self, _id: u64, _tokens: u64) -> bool {
        true
    }
    fn finish(&mut self, id: u64) {
        SharedKv::free(self, 0, id as usize);
    }
    fn held(&self) -> (u64, u64) {
        (0, 0)
    }
    fn trim(&mut self) {}
    fn cached_idle_blocks(&self) -> u64 {
        0
    }
    fn caller_calls(&self) -> Calls {
        self.calls
    }
    fn attn_layout(&self) -> AttnLayout {
        AttnLayout::TokenMajor
    }
}

fn mm_config(max_batch: usize) -> MmConfig {
    MmConfig {
        models: 1,
        kv_bytes_per_token: 128 << 10,
        layers: 32,
        device_bytes: 80 << 30,
        kv_bytes: 6 << 30,
        step_tokens: 8192,
        max_batch,
        requests_per_model: 2,
        rate_scale: 1.0,
        peak: 1.0,
        phase_s: 1.0,
        arena_retain: 0,
        max_context: 8192,
        arena_layout: Layout::TokenMajor,
        sleep_after_s: None,
    }
}

/// Two requests of 32 prompt tokens and 4 output tokens, both there at 0.
fn two_requests() -> Vec<Vec<MmRequest>> {
    vec![vec![MmRequest { arrival: 0.0, prompt: 32, output: 4 }; 2]]
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn between_steps_calls_are_hidden_under_the_step_unless_a_synchronize_is_among_them() {
    let p = Profile::a100();
    let reqs = vec![vec![MmRequest { arrival: 0.0, prompt: 32, output: 1 }]];
    // The admission's step reads 16 GB of weights (8.9 ms on a100): the
    // 1.93 ms of creates hide under it.
    let mut kv = FixedCalls::new(admit_calls(false), Calls::default());
    let r = multi_model::run(&mm_config(1), &reqs, &mut kv, &p);
    assert_eq!(r.driver.charged_s, 0.0);
    assert!(close(r.driver.hidden_s, 10.0 * p.create_s), "{:?}", r.driver);
    // A synchronize among them drains the GPU: none of it is hidden.
    let mut kv = FixedCalls::new(admit_calls(true), Calls::default());
    let r = multi_model::run(&mm_config(1), &reqs, &mut kv, &p);
    assert!(close(r.driver.charged_s, 10.0 * p.create_s + p.synchronize_s), "{:?}", r.driver);
    assert_eq!((r.driver.drained_steps, r.driver.hidden_s), (1, 0.0));
}

#[test]
fn frees_at_completion_are_charged_to_the_models_next_step() {
    let p = Profile::a100();
    // Batch of one: request 0 runs steps 1-4 and is freed after step 4;
    // request 1 is admitted in step 5, which pays the free and its own
    // admission; request 1's free finds the model idle (charged to no step).
    let mut kv = FixedCalls::new(admit_calls(true), free_calls());
    let r = multi_model::run(&mm_config(1), &two_requests(), &mut kv, &p);
    let admit = 10.0 * p.create_s + p.synchronize_s;
    let free = 10.0 * p.unmap_s + p.synchronize_s;
    assert!(close(r.driver.charged_s, 2.0 * admit + free), "{:?}", r.driver);
    assert_eq!(r.driver.drained_steps, 2);
    // Every call is priced on the engine's thread, the idle free included.
    assert!(close(r.driver.caller_thread_s, 2.0 * admit + 2.0 * free), "{:?}", r.driver);
}

#[test]
fn the_same_calls_are_charged_the_same_in_multi_model_and_idle_footprint() {
    let p = Profile::a100();
    let mut mm = FixedCalls::new(admit_calls(true), free_calls());
    let rm = multi_model::run(&mm_config(1), &two_requests(), &mut mm, &p);
    let c = IdleConfig { requests: 2, concurrency: 1, ..IdleConfig::default() };
    let q = IdleRequest { prompt: 32, output: 4, hot: false, hashes: Arc::from(vec![1u64, 2, 3]) };
    let mut idle = FixedCalls::new(admit_calls(true), free_calls());
    let ri = idle_footprint::run(&c, &[q.clone(), q], &mut idle, "fixed", &p).unwrap();
    assert_eq!(rm.driver.calls, ri.driver.calls);
    assert_eq!((rm.driver.steps, rm.driver.drained_steps), (ri.driver.steps, ri.driver.drained_steps));
    assert!(close(rm.driver.charged_s, ri.driver.charged_s), "{:?} vs {:?}", rm.driver, ri.driver);
    assert!(close(rm.driver.caller_thread_s, ri.driver.caller_thread_s));
    let want = 2.0 * (10.0 * p.create_s + p.synchronize_s) + 10.0 * p.unmap_s + p.synchronize_s;
    assert!(close(ri.driver.charged_s, want), "{:?}", ri.driver);
}

#[test]
fn each_row_is_priced_with_its_own_attention_layout() {
    let c = MmConfig { models: 3, kv_bytes: 12 << 30, requests_per_model: 20, max_batch: 16, ..mm_config(16) };
    let reqs: Vec<Vec<MmRequest>> = (0..3)
        .map(|m| (0..20).map(|k| MmRequest { arrival: (k + m) as f64 * 0.01, prompt: 2000, output: 50 }).collect())
        .collect();
    // Paged attention at half speed, token-major at full speed.
    let slow_paged = Profile { attn_eff_decode_paged: 0.5, attn_eff_prefill_paged: 0.5, ..Profile::a100() };
    let makespan = |kv: &mut dyn SharedKv, p: &Profile| {
        let r = multi_model::run(&c, &reqs, kv, p);
        (r.attn_layout, r.makespan_s)
    };
    let base = Profile::a100();
    for (name, paged) in [("static", true), ("kvcached", true), ("arena", false)] {
        let build = || -> Box<dyn SharedKv> {
            match name {
                "static" => Box::new(StaticKv::new(&c)),
                "kvcached" => Box::new(KvcachedKv::new(&c).unwrap()),
                _ => Box::new(ArenaKv::new(&c).unwrap()),
            }
        };
        let (layout, fast) = makespan(build().as_mut(), &base);
        let (_, slow) = makespan(build().as_mut(), &slow_paged);
        assert_eq!(layout, if paged { AttnLayout::Paged } else { AttnLayout::TokenMajor }, "{name}");
        assert_eq!(slow > fast, paged, "{name}: {fast} vs {slow}");
    }
    // The arena row with block-in-chunk is read as paged.
    let bic = MmConfig { arena_layout: Layout::BlockInChunk, ..c.clone() };
    let r = multi_model::run(&bic, &reqs, &mut ArenaKv::new(&bic).unwrap(), &base);
    assert_eq!(r.attn_layout, AttnLayout::Paged);
}

/// A manager that counts its sleeps and makes `sleep_calls` each time.
struct Sleeper {
    inner: FixedCalls,
    slept: Vec<usize>,
    sleep_calls: Calls,
}

impl SharedKv for Sleeper {
    fn name(&self) -> &'static str {
        "sleeper"
    }
    fn reserve(&mut self, m: usize, rid: usize, tokens: u64) -> bool {
        self.inner.reserve(m, rid, tokens)
    }
    fn free(&mut self, m: usize, rid: usize) {
        SharedKv::free(&mut self.inner, m, rid)
    }
    fn held(&self, _m: usize) -> u64 {
        0
    }
    fn path_calls(&self) -> Calls {
        self.inner.calls
    }
    fn sleep(&mut self, m: usize) {
        self.slept.push(m);
        self.inner.calls = self.inner.calls.plus(&self.sleep_calls);
    }
}

#[test]
fn a_model_idle_past_the_threshold_sleeps_once_and_its_sleep_is_charged_to_no_step() {
    let p = Profile::a100();
    // Model 0: requests at 0 and 30 s (idle about 30 s between); model 1:
    // a request every second (never idle 5 s until its last).
    let reqs = vec![
        vec![MmRequest { arrival: 0.0, prompt: 32, output: 2 }, MmRequest { arrival: 30.0, prompt: 32, output: 2 }],
        (0..20).map(|k| MmRequest { arrival: k as f64, prompt: 32, output: 2 }).collect(),
    ];
    let c = MmConfig { models: 2, requests_per_model: 20, sleep_after_s: Some(5.0), ..mm_config(4) };
    let sleep_calls = Calls { unmap: 1, unmap_chunks: 100, synchronize: 1, ..Calls::default() };
    let mut kv = Sleeper { inner: FixedCalls::new(Calls::default(), Calls::default()), slept: Vec::new(), sleep_calls };
    let r = multi_model::run(&c, &reqs, &mut kv, &p);
    // Model 0 sleeps in its 30 s gap; model 1 only after its last request
    // (at 19 s), while model 0's second request runs.
    assert_eq!(kv.slept, vec![0, 1]);
    assert_eq!((r.models[0].sleeps, r.models[1].sleeps), (1, 1));
    // Priced on the sleeping model's thread, charged to no step.
    assert_eq!(r.driver.charged_s, 0.0);
    assert!(close(r.driver.caller_thread_s, 2.0 * (100.0 * p.unmap_s + p.synchronize_s)), "{:?}", r.driver);
    // Off, nothing sleeps.
    let mut kv = Sleeper { inner: FixedCalls::new(Calls::default(), Calls::default()), slept: Vec::new(), sleep_calls };
    multi_model::run(&MmConfig { sleep_after_s: None, ..c }, &reqs, &mut kv, &p);
    assert!(kv.slept.is_empty());
}

#[test]
fn an_arena_model_that_slept_gives_its_pool_back_and_maps_again_on_waking() {
    let p = Profile::a100();
    // 1,000 prompt tokens of 128 KiB: 63 blocks of 16 tokens, 63 chunks.
    let reqs = vec![vec![
        MmRequest { arrival: 0.0, prompt: 1000, output: 1 },
        MmRequest { arrival: 30.0, prompt: 1000, output: 1 },
    ]];
    let c = MmConfig { arena_retain: 1 << 30, ..mm_config(4) };
    let creates = |sleep: Option<f64>| {
        let c = MmConfig { sleep_after_s: sleep, ..c.clone() };
        let mut kv = ArenaKv::new(&c).unwrap();
        let r = multi_model::run(&c, &reqs, &mut kv, &p);
        (r.driver.calls.create_chunks, r.models[0].sleeps)
    };
    let (awake, none) = creates(None);
    let (slept, once) = creates(Some(5.0));
    assert_eq!((none, once), (0, 1));
    // Awake, the second request reuses the first one's pooled chunks; after
    // sleeping it creates its 63 again (and the prefetch target's 4).
    assert_eq!(slept - awake, 63 + 4, "{awake} vs {slept}");
}
