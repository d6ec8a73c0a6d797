//! Short runs of the multi-model replay and of the idle-footprint workload:
//! every request served under every manager, the invariants of each
//! manager's memory (figures are measured by the programs, not here).

use vmm_sim::idle_footprint::{self, ArenaEngine, IdleConfig, KvcachedEngine};
use vmm_sim::managers::kvcached::KVCACHED_PAGE_BYTES;
use vmm_sim::managers::Layout;
use vmm_sim::multi_model::{self, ArenaKv, KvcachedKv, MmConfig, SharedKv, StaticKv};
use vmm_sim::timing::Profile;
use vmm_sim::trace;

fn mm_config() -> MmConfig {
    MmConfig {
        models: 3,
        kv_bytes_per_token: 128 << 10,
        layers: 32,
        device_bytes: 80 << 30,
        kv_bytes: 6 << 30,
        step_tokens: 8192,
        max_batch: 64,
        requests_per_model: 60,
        rate_scale: 0.5,
        peak: 10.0,
        phase_s: 5.0,
        arena_retain: 256 << 20,
        max_context: 8192,
        arena_layout: Layout::TokenMajor,
        sleep_after_s: None,
    }
}

#[test]
fn every_manager_serves_every_request_of_every_model() {
    let c = mm_config();
    let tr = trace::synthetic(c.models * c.requests_per_model, 3);
    let reqs = multi_model::model_requests(&c, &tr.requests);
    assert!(reqs.iter().all(|r| r.len() == c.requests_per_model));
    let profile = Profile::named("a100").unwrap();
    let mut managers: Vec<Box<dyn SharedKv>> = vec![
        Box::new(StaticKv::new(&c)),
        Box::new(KvcachedKv::new(&c).unwrap()),
        Box::new(ArenaKv::new(&c).unwrap()),
        Box::new(ArenaKv::new_shared(&c).unwrap()),
    ];
    for kv in managers.iter_mut() {
        let r = multi_model::run(&c, &reqs, kv.as_mut(), &profile);
        for m in &r.models {
            assert_eq!(m.requests, c.requests_per_model);
            assert_eq!(m.served, m.requests, "{}: model {}", r.manager, m.model);
            assert!(m.ttft_p99_s >= m.ttft_mean_s * 0.999 && m.ttft_mean_s > 0.0, "{}: {m:?}", r.manager);
            assert!(m.tokens_per_s > 0.0);
            // No model holds more than the KV memory there is.
            assert!(m.peak_held_bytes <= c.kv_bytes, "{}: model {} held {}", r.manager, m.model, m.peak_held_bytes);
        }
        // Held memory at every sample fits the device, all models together.
        for (t, held) in &r.timeline {
            assert!(held.iter().sum::<u64>() <= c.kv_bytes, "{} at {t}: {held:?}", r.manager);
        }
        // Idle at the end: kvcached keeps at most its reserve, the arena its
        // watermark (a shared arena's pool is no model's: they hold nothing).
        for m in 0..c.models {
            let held = kv.held(m);
            match r.manager.as_str() {
                "static" => assert_eq!(held, c.kv_bytes / 3 / (2 << 20) * (2 << 20)),
                "kvcached" => assert!(held <= 11 * KVCACHED_PAGE_BYTES * 2 * c.layers, "{held}"),
                "arena-shared" => assert_eq!(held, 0),
                _ => assert!(held <= c.arena_retain, "{held}"),
            }
        }
    }
}

#[test]
fn idle_footprint_hits_agree_and_each_engine_holds_at_least_its_floor() {
    let c = IdleConfig {
        requests: 300,
        concurrency: 24,
        max_cached_tokens: 2000,
        num_blocks: 4000,
        ..IdleConfig::default()
    };
    let reqs = idle_footprint::build_requests(&c);
    let mut k = KvcachedEngine::new(&c).unwrap();
    let rk = idle_footprint::run(&c, &reqs, &mut k, "kvcached", &Profile::h200()).unwrap();
    let mut a = ArenaEngine::new(&c).unwrap();
    let ra = idle_footprint::run(&c, &reqs, &mut a, "arena", &Profile::h200()).unwrap();
    assert!(rk.hit_tokens > 0);
    assert_eq!(rk.prompt_tokens, ra.prompt_tokens);
    // Both keep the cap's blocks once idle.
    assert_eq!(rk.idle_cached_blocks, c.max_cached_blocks());
    assert_eq!(ra.idle_cached_blocks, c.max_cached_blocks());
    let raw = c.max_cached_blocks() * c.block_bytes();
    let bundle = KVCACHED_PAGE_BYTES * 2 * c.layers;
    let per_page = KVCACHED_PAGE_BYTES / c.block_buffer_bytes();
    // kvcached: at least the cap in whole pages, plus the null block's page.
    assert!(rk.idle_used_bytes >= c.max_cached_blocks().div_ceil(per_page) * bundle);
    assert_eq!(rk.idle_used_bytes % bundle, 0);
    // The arena: the raw bytes, rounded up to a chunk per request at most.
    assert!(ra.idle_used_bytes >= raw);
    assert!(ra.idle_used_bytes < raw + c.max_cached_blocks() * (2 << 20));
    assert_eq!(ra.idle_after_trim_bytes, ra.idle_used_bytes);
    // The arena grows its growable allocations in place: no implicit move.
    assert_eq!(a.arena.stats().unwrap().moves, 0);
    // Both engines' driver time is priced: every call on the engine's
    // thread at least once, kvcached's pre-allocation thread beside it.
    for r in [&rk, &ra] {
        assert!(r.driver.caller_thread_s > 0.0 && r.driver.serial_s >= r.driver.caller_thread_s, "{r:?}");
        assert!(r.driver.charged_s <= r.driver.caller_thread_s + 1e-12, "{r:?}");
    }
    assert!(rk.driver.serial_s > rk.driver.caller_thread_s, "kvcached's thread maps off the engine's");
    assert!(rk.idle_after_trim_bytes <= rk.idle_held_bytes);
}
