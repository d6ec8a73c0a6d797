//! The tests' one-pass snapshot reader (`tests/common/snap_parse.rs`, which
//! the model check and the `ops` fuzz target use after every operation)
//! reads what the generic JSON reader reads, field by field, on snapshots
//! with every kind of range, and refuses what the generic reader refused.

mod common;

use std::sync::Arc;

use common::{Json, Kind, Snap};
use vmm_arena::driver::mock::MockDriver;
use vmm_arena::{Arena, ArenaConfig, SLEEP_BACKUP};

const C: u64 = 64 << 10;

/// A snapshot holding live (awake, asleep, shared, growable, pinned), slab,
/// free and retired ranges.
fn busy_snapshot() -> String {
    let cfg = ArenaConfig { capacity_bytes: 32 * C, reserve_bytes: 64 * C, chunk_bytes: C, ..ArenaConfig::default() };
    let a = Arena::with_driver(Arc::new(MockDriver::new(4096, 1 << 40)), cfg).unwrap();
    let (x, _) = a.alloc(3 * C).unwrap();
    let (_small, _) = a.alloc(1000).unwrap();
    let (g, _) = a.alloc_growable(C + 5, 6 * C).unwrap();
    let (_alias, _) = a.alloc_shared(x, C, 2 * C, 2 * C).unwrap();
    let (s, _) = a.alloc(2 * C).unwrap();
    a.set_tag(s, 2).unwrap();
    a.sleep(2, SLEEP_BACKUP).unwrap();
    a.pin(g).unwrap();
    let (y, _) = a.alloc(4 * C).unwrap();
    let (z, _) = a.alloc(C).unwrap();
    let (_w, _) = a.alloc(C).unwrap(); // right after z: z cannot grow in place
    a.free(y).unwrap();
    a.resize(z, 9 * C).unwrap(); // moves by remapping: its old range is retired
    a.snapshot_json().unwrap()
}

fn num(j: &Json, k: &str) -> u64 {
    j.get(k).map_or(0, |_| j.u64(k))
}

fn flag(j: &Json, k: &str) -> bool {
    j.get(k).is_some_and(|_| j.bool(k))
}

#[test]
fn one_pass_reader_agrees_with_the_json_tree() {
    let text = busy_snapshot();
    let snap = Snap::parse(&text);
    let tree = Json::parse(&text);
    assert_eq!(snap.base, tree.u64("base"));
    assert_eq!(snap.chunk, tree.u64("chunk_bytes"));
    assert_eq!(snap.pooled_unmapped_chunks, tree.u64("pooled_unmapped_chunks"));
    assert_eq!(snap.inflight_chunks, tree.u64("inflight_chunks"));
    assert_eq!(snap.deferred_unmap_pages, tree.u64("deferred_unmap_pages"));
    let Some(Json::Arr(rs)) = tree.get("ranges") else { panic!("no ranges") };
    assert_eq!(snap.ranges.len(), rs.len());
    let mut kinds = Vec::new();
    for (r, j) in snap.ranges.iter().zip(rs) {
        kinds.push(r.kind);
        let fields = [
            (r.addr, "addr"),
            (r.bytes, "bytes"),
            (r.id, "id"),
            (r.size, "size"),
            (r.mapped_bytes, "mapped_bytes"),
            (r.pooled_mapped_bytes, "pooled_mapped_bytes"),
            (r.class_bytes, "class_bytes"),
            (r.objects, "objects"),
            (r.used, "used"),
            (r.retired_bytes, "retired_bytes"),
            (r.pending_bytes, "pending_bytes"),
            (r.tag, "tag"),
            (r.backup_bytes, "backup_bytes"),
            (r.shared_bytes, "shared_bytes"),
        ];
        for (v, k) in fields {
            assert_eq!(v, num(j, k), "{k} of {r:?}");
        }
        assert_eq!((r.pinned, r.growable, r.asleep), (flag(j, "pinned"), flag(j, "growable"), flag(j, "asleep")));
        let list = |k: &str| match j.get(k) {
            Some(Json::Arr(v)) => v.clone(),
            _ => Vec::new(),
        };
        let runs: Vec<Json> = r.shared_runs.iter().map(|&(o, l)| Json::Arr(vec![Json::Num(o), Json::Num(l)])).collect();
        assert_eq!(runs, list("shared_runs"));
        assert_eq!(r.shares_with.iter().map(|&n| Json::Num(n)).collect::<Vec<_>>(), list("shares_with"));
    }
    for k in [Kind::Live, Kind::Slab, Kind::Free, Kind::Retired] {
        assert!(kinds.contains(&k), "the snapshot has a {k:?} range: {kinds:?}");
    }
    assert!(snap.ranges.iter().any(|r| r.asleep) && snap.ranges.iter().any(|r| r.shared_bytes > 0));
    let Some(Json::Obj(st)) = tree.get("stats") else { panic!("no stats") };
    assert_eq!(snap.stats.len(), st.len());
    for (k, v) in st {
        assert_eq!(Json::Num(snap.stats[k.as_str()]), *v, "stat {k}");
    }
    snap.check_structure((snap.base, 64 * C));
}

fn refused(text: &str) -> bool {
    std::panic::catch_unwind(|| Snap::parse(text)).is_err()
}

#[test]
fn one_pass_reader_refuses_malformed_snapshots() {
    let text = busy_snapshot();
    assert!(!refused(&text));
    assert!(refused(&format!("{text} x")), "trailing text");
    assert!(refused(&text.replacen("\"addr\":", "\"addr\":1,\"addr\":", 1)), "a duplicate key");
    assert!(refused(&text.replacen("\"growable\":", "\"growable_\":", 1)), "a live range without growable");
    assert!(refused(&text.replacen("\"kind\":\"free\"", "\"kind\":\"freed\"", 1)), "an unknown kind");
    assert!(refused(&text.replacen("\"stats\":", "\"statz\":", 1)), "no stats");
    assert!(refused(&text.replacen("\"size\":", "\"size\":true,\"x\":", 1)), "a bool for a number");
    assert!(refused(&text[..text.len() - 1]), "cut short");
    // A key the reader does not know is read and skipped, as before.
    assert!(!refused(&text.replacen("\"ranges\":", "\"extra\":{\"a\":[1,true,null,\"s\"]},\"ranges\":", 1)));
}
