//! Reading the arena's JSON snapshot, as much as the C ABI fuzz target
//! checks: live ranges, slab ranges, the snapshot without driver counters,
//! a number.

use super::*;

/// The snapshot's allocations of whole chunks: id -> (tag, asleep).
/// (Small allocations live in slabs and have no range of their own.)
pub(super) fn live_ranges(json: &str) -> BTreeMap<u64, (u32, bool)> {
    ranges(json).0
}

/// The snapshot's allocations of whole chunks (id -> (tag, asleep)) and
/// its slabs ((addr, bytes, tag, asleep)), in one pass over the text: a
/// range is an object without nested objects, so every `{` after the
/// top-level one opens a range until the stats.
pub(super) fn ranges(json: &str) -> (BTreeMap<u64, (u32, bool)>, Vec<(u64, u64, u32, bool)>) {
    let end = json.rfind(",\"stats\":{").expect("the snapshot's stats");
    let (mut live, mut slabs) = (BTreeMap::new(), Vec::new());
    for r in json[..end].split('{').skip(2) {
        let r = &r[..r.find('}').expect("a range's end")];
        let tag = || u32::try_from(json_u64(r, "tag")).expect("a u32 tag");
        if r.starts_with("\"kind\":\"live\",") {
            let asleep = r.contains("\"asleep\":true");
            assert!(asleep || r.contains("\"asleep\":false"), "no asleep field in {r}");
            live.insert(json_u64(r, "id"), (tag(), asleep));
        } else if r.starts_with("\"kind\":\"slab\",") {
            slabs.push((json_u64(r, "addr"), json_u64(r, "bytes"), tag(), r.contains("\"asleep\":true")));
        } else {
            assert!(r.starts_with("\"kind\":\""), "not a range: {r}");
        }
    }
    (live, slabs)
}

/// The stats' part of a snapshot (what [`json_u64`] of a stat should search).
pub(super) fn stats_part(json: &str) -> &str {
    &json[json.rfind("\"stats\":{").expect("the snapshot's stats")..]
}

/// The snapshot without the driver counters' values (a rolled-back call
/// changes them: its calls and their undoing).
pub(super) fn strip_driver(json: &str) -> String {
    // The counters of driver calls: driver_*, by thread, and of stream events.
    const COUNTERS: [&str; 5] = ["\"driver_", "\"caller_", "\"maintain_driver_calls\"", "\"stream_frees\"", "\"event_"];
    let mut out = String::with_capacity(json.len());
    let mut rest = json;
    while let Some(i) = COUNTERS.iter().filter_map(|k| rest.find(k)).min() {
        let colon = i + rest[i..].find(':').expect("a key's colon");
        out.push_str(&rest[..=colon]);
        rest = rest[colon + 1..].trim_start_matches(|c: char| c.is_ascii_digit());
    }
    out.push_str(rest);
    out
}

/// The JSON number after the first `"key":`.
pub(super) fn json_u64(json: &str, key: &str) -> u64 {
    // The key's occurrences, until one is quoted and followed by a colon
    // (no pattern string built: this runs several times after every call).
    let mut from = 0;
    loop {
        let i = from + json[from..].find(key).unwrap_or_else(|| panic!("no {key} in the snapshot"));
        let end = i + key.len();
        if json[..i].ends_with('"') && json[end..].starts_with("\":") {
            let digits = &json[end + 2..];
            let n = digits.find(|c: char| !c.is_ascii_digit()).unwrap_or(digits.len());
            return digits[..n].parse().unwrap_or_else(|e| panic!("{key}: {e}"));
        }
        from = end;
    }
}
