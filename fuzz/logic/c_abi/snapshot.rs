//! Reading the arena's JSON snapshot, as much as the C ABI fuzz target
//! checks: live ranges, slab ranges, the snapshot without driver counters,
//! a number.

use super::*;

/// The snapshot's allocations of whole chunks: id -> (tag, asleep).
/// (Small allocations live in slabs and have no range of their own.)
pub(super) fn live_ranges(json: &str) -> BTreeMap<u64, (u32, bool)> {
    json.split("{\"kind\":\"live\",")
        .skip(1)
        .map(|r| {
            let r = &r[..r.find('}').expect("a range's end")];
            let id = json_u64(r, "id");
            let tag = u32::try_from(json_u64(r, "tag")).expect("a u32 tag");
            let asleep = r.contains("\"asleep\":true");
            assert!(asleep || r.contains("\"asleep\":false"), "no asleep field in {r}");
            (id, (tag, asleep))
        })
        .collect()
}

/// The snapshot's slabs: (addr, bytes, tag, asleep).
pub(super) fn slab_ranges(json: &str) -> Vec<(u64, u64, u32, bool)> {
    json.split("{\"kind\":\"slab\",")
        .skip(1)
        .map(|r| {
            let r = &r[..r.find('}').expect("a range's end")];
            let tag = u32::try_from(json_u64(r, "tag")).expect("a u32 tag");
            (json_u64(r, "addr"), json_u64(r, "bytes"), tag, r.contains("\"asleep\":true"))
        })
        .collect()
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

/// The JSON number after `"key":`.
pub(super) fn json_u64(json: &str, key: &str) -> u64 {
    let pat = format!("\"{key}\":");
    let at = json.find(&pat).unwrap_or_else(|| panic!("no {key} in the snapshot")) + pat.len();
    json[at..].split(|c: char| !c.is_ascii_digit()).next().unwrap().parse().unwrap()
}
