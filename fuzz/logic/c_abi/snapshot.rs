//! Reading the arena's JSON snapshot, as much as the C ABI fuzz target
//! checks: live ranges, slab ranges, the snapshot without driver counters,
//! a number.
//!
//! These run after every call, so they read the text in one pass where
//! they can, splitting it at `{` and `,` (the standard library's memchr)
//! rather than searching it once per key.

use super::*;

/// The snapshot's allocations of whole chunks: id -> (tag, asleep).
/// (Small allocations live in slabs and have no range of their own.)
pub(super) fn live_ranges(json: &str) -> BTreeMap<u64, (u32, bool)> {
    ranges(json).0
}

/// Where the snapshot's stats begin (`"stats":{`): after every range.
fn stats_at(json: &str) -> usize {
    json.rfind("\"stats\":{").expect("the snapshot's stats")
}

/// The `"key":value` members of an object's text without its braces, in
/// order, with the key unquoted. A member whose value is an array yields
/// its first element only (the rest, split at their commas, have no key).
fn members(obj: &str) -> impl Iterator<Item = (&str, &str)> {
    obj.split(',').filter_map(|m| {
        let (k, v) = m.split_once(':')?;
        Some((k.strip_prefix('"')?.strip_suffix('"')?, v))
    })
}

fn number(key: &str, v: &str) -> u64 {
    v.parse().unwrap_or_else(|e| panic!("{key}: {v:?}: {e}"))
}

fn boolean(key: &str, v: &str) -> bool {
    match v {
        "true" => true,
        "false" => false,
        _ => panic!("{key}: {v:?} is not a bool"),
    }
}

/// A slab of the snapshot: (addr, bytes, tag, asleep).
pub(super) type Slab = (u64, u64, u32, bool);

/// The snapshot's allocations of whole chunks (id -> (tag, asleep)) and
/// its slabs ((addr, bytes, tag, asleep)), in one pass over the text: a
/// range is an object without nested objects, so every `{` after the
/// top-level one opens a range until the stats.
pub(super) fn ranges(json: &str) -> (BTreeMap<u64, (u32, bool)>, Vec<Slab>) {
    let (mut live, mut slabs) = (BTreeMap::new(), Vec::new());
    for r in json[..stats_at(json)].split('{').skip(2) {
        let r = &r[..r.find('}').expect("a range's end")];
        let (mut kind, mut id, mut addr, mut bytes, mut tag, mut asleep) = (None, None, None, None, None, None);
        for (k, v) in members(r) {
            match k {
                "kind" => kind = Some(v),
                "id" => id = Some(number(k, v)),
                "addr" => addr = Some(number(k, v)),
                "bytes" => bytes = Some(number(k, v)),
                "tag" => tag = Some(u32::try_from(number(k, v)).expect("a u32 tag")),
                "asleep" => asleep = Some(boolean(k, v)),
                _ => {}
            }
        }
        match kind {
            Some("\"live\"") => {
                live.insert(field(id, "id", r), (field(tag, "tag", r), field(asleep, "asleep", r)));
            }
            Some("\"slab\"") => slabs.push((
                field(addr, "addr", r),
                field(bytes, "bytes", r),
                field(tag, "tag", r),
                field(asleep, "asleep", r),
            )),
            Some(_) => {}
            None => panic!("not a range: {r}"),
        }
    }
    (live, slabs)
}

/// A member a range must have.
fn field<T>(v: Option<T>, key: &str, range: &str) -> T {
    v.unwrap_or_else(|| panic!("no {key} in {range}"))
}

/// The stats' numbers named in `keys`, in that order (each must be there).
pub(super) fn stats_u64<const N: usize>(json: &str, keys: [&str; N]) -> [u64; N] {
    let stats = &json[stats_at(json) + "\"stats\":{".len()..];
    let mut out = [None; N];
    for (k, v) in members(stats.trim_end_matches('}')) {
        if let Some(i) = keys.iter().position(|&want| want == k) {
            out[i] = Some(number(k, v));
        }
    }
    std::array::from_fn(|i| out[i].unwrap_or_else(|| panic!("no {} in the snapshot's stats", keys[i])))
}

/// The snapshot without the driver counters' values (a rolled-back call
/// changes them: its calls and their undoing). They are all stats: the
/// text before the stats is kept as it is.
pub(super) fn strip_driver(json: &str) -> String {
    // The counters of driver calls: driver_*, by thread, and of stream events.
    let counter = |k: &str| {
        k.starts_with("driver_")
            || k.starts_with("caller_")
            || k.starts_with("event_")
            || k == "maintain_driver_calls"
            || k == "stream_frees"
    };
    let at = stats_at(json) + "\"stats\":{".len();
    let mut out = String::with_capacity(json.len());
    out.push_str(&json[..at]);
    for (i, m) in json[at..].split(',').enumerate() {
        if i > 0 {
            out.push(',');
        }
        match m.split_once(':') {
            Some((k, _)) if counter(k.trim_matches('"')) => {
                out.push_str(k);
                out.push(':');
                // The last stat is followed by the closing braces.
                out.extend(m.chars().filter(|&c| c == '}'));
            }
            _ => out.push_str(m),
        }
    }
    out
}

/// The JSON number after the first `"key":`.
pub(super) fn json_u64(json: &str, key: &str) -> u64 {
    // The key's occurrences, until one is quoted and followed by a colon.
    let mut from = 0;
    loop {
        let i = from + json[from..].find(key).unwrap_or_else(|| panic!("no {key} in the snapshot"));
        let end = i + key.len();
        if json[..i].ends_with('"') && json[end..].starts_with("\":") {
            let digits = &json[end + 2..];
            let n = digits.find(|c: char| !c.is_ascii_digit()).unwrap_or(digits.len());
            return number(key, &digits[..n]);
        }
        from = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot's text as the library writes it, cut to a live range, a
    /// slab, a free range and a few stats.
    const SNAP: &str = concat!(
        r#"{"backend":"host","base":4096,"chunk_bytes":65536,"pooled_unmapped_chunks":0,"inflight_chunks":0,"deferred_unmap_pages":0,"ranges":["#,
        r#"{"kind":"live","id":7,"addr":4096,"bytes":131072,"size":131072,"mapped_bytes":131072,"#,
        r#""pooled_mapped_bytes":0,"pinned":false,"growable":false,"tag":2,"asleep":true,"backup_bytes":0,"#,
        r#""shared_bytes":65536,"shared_runs":[[0,65536]],"shares_with":[9,11]},"#,
        r#"{"kind":"slab","addr":135168,"bytes":65536,"class_bytes":1024,"objects":64,"used":1,"retired_bytes":0,"#,
        r#""pending_bytes":0,"pinned":false,"tag":1,"asleep":false,"mapped_bytes":65536,"backup_bytes":0},"#,
        r#"{"kind":"free","addr":200704,"bytes":65536,"pooled_mapped_bytes":0}],"#,
        r#""stats":{"live_allocations":2,"driver_creates":5,"release_failures":3,"stream_frees":4,"quiesces":0,"event_waits":6}}"#
    );

    #[test]
    fn ranges_and_stats_are_read_from_their_members() {
        let (live, slabs) = ranges(SNAP);
        assert_eq!(live.into_iter().collect::<Vec<_>>(), [(7, (2, true))]);
        assert_eq!(slabs, [(135168, 65536, 1, false)]);
        assert_eq!(stats_u64(SNAP, ["quiesces", "release_failures"]), [0, 3]);
        assert_eq!((json_u64(SNAP, "chunk_bytes"), json_u64(SNAP, "bytes")), (65536, 131072));
    }

    #[test]
    fn a_live_range_without_its_asleep_member_is_refused() {
        let cut = SNAP.replacen(r#""asleep":true,"#, "", 1);
        assert!(std::panic::catch_unwind(|| ranges(&cut)).is_err());
    }

    #[test]
    fn strip_driver_blanks_the_counters_only() {
        let s = strip_driver(SNAP);
        let (ranges_part, stats) = s.split_at(stats_at(&s));
        assert_eq!(ranges_part, &SNAP[..stats_at(SNAP)]);
        assert_eq!(
            stats,
            r#""stats":{"live_allocations":2,"driver_creates":,"release_failures":3,"stream_frees":,"quiesces":0,"event_waits":}}"#
        );
    }
}
