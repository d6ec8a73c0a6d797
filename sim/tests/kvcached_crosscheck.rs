//! The kvcached model against kvcached's own Python code: the trace in
//! `data/kvcached_crosscheck.json` was run through kvcached's
//! `KVCacheManager` and vLLM `ElasticBlockPool` (unmodified, on a CPU, the
//! C++ extension and torch mocked: `sim/crosscheck/kvcached_crosscheck.py`
//! says how and what), which recorded every operation's outcome and the
//! pages in use and reserved after each step. The model must give the same.

use std::sync::Arc;

use serde_json::Value;
use vmm_sim::managers::kvcached::{BlockManager, SharedHbm};
use vmm_sim::managers::kvcached_pool::{ElasticBlockPool, KvcachedPool};

#[test]
fn the_model_holds_the_pages_kvcached_holds_after_every_step() {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/kvcached_crosscheck.json"))
        .expect("the cross-check trace");
    let d: Value = serde_json::from_str(&text).expect("JSON");
    let g = &d["geometry"];
    let n = |v: &Value| v.as_u64().expect("a number");
    let block_bytes = n(&g["block_tokens"]) * n(&g["cell_bytes"]);
    let num_blocks = n(&g["num_blocks"]);
    let mgr = BlockManager::new(num_blocks, block_bytes, n(&g["layers"]), SharedHbm::unlimited()).expect("manager");
    let cap = g["max_cached_blocks"].as_i64().expect("cap");
    let mut p = KvcachedPool::new(ElasticBlockPool::new(mgr, num_blocks, true, cap));
    let steps = d["steps"].as_array().expect("steps");
    assert!(steps.len() > 100, "a trace of some length");
    let mut hits = 0;
    for (i, s) in steps.iter().enumerate() {
        for (op, want) in s["ops"].as_array().unwrap().iter().zip(s["results"].as_array().unwrap()) {
            let op = op.as_array().unwrap();
            let id = n(&op[1]);
            match op[0].as_str().unwrap() {
                "admit" => {
                    let hashes: Arc<[u64]> = op[3].as_array().unwrap().iter().map(n).collect();
                    let got = p.admit(id, hashes, n(&op[2]));
                    assert_eq!(got, want.as_u64(), "step {i}: admit {id}");
                    hits += u64::from(got.unwrap_or(0) > 0);
                }
                "decode" => assert_eq!(Some(p.decode(id, n(&op[2]))), want.as_bool(), "step {i}: decode {id}"),
                _ => p.finish(id),
            }
        }
        let pa = &p.pool.mgr.page_allocator;
        assert_eq!(pa.num_inuse_pages(), n(&s["inuse_pages"]), "step {i}: pages in use");
        assert_eq!(pa.num_reserved_pages(), n(&s["reserved_pages"]), "step {i}: reserved pages");
        assert_eq!(p.pool.num_evictable(), n(&s["evictable_blocks"]), "step {i}: evictable blocks");
    }
    assert!(hits > 0, "the trace exercises prefix hits");
    p.pool.mgr.trim();
    assert_eq!(p.pool.mgr.page_allocator.num_inuse_pages(), n(&d["after_trim"]["inuse_pages"]));
    assert_eq!(p.pool.mgr.page_allocator.num_reserved_pages(), n(&d["after_trim"]["reserved_pages"]));
}
