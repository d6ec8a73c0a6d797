//! The JSON snapshot of an arena: every range in address order and the stats.
//!
//! `inflight_chunks`: chunks the prefetcher is creating or mapping outside
//! the lock at this moment (held, counted in `pooled_bytes`).
//! `deferred_unmap_pages`: old addresses of chunks taken by same-stream
//! reuse, still mapped until the event of the old owner's queued work
//! completes (each maps a chunk that another page backs too, so it adds a
//! driver mapping but no bytes to `mapped_bytes` or `pooled_bytes`).
//! Slabs of small allocations appear as `"kind":"slab"` ranges, the
//! reservations of allocations freed on a stream whose event has not
//! completed as `"kind":"pending"` (with the `mapped_bytes` they hold). A live
//! range carries its `tag`, whether it is `asleep` (it maps nothing then:
//! `mapped_bytes` 0) and the `backup_bytes` it holds while asleep, and
//! the chunks it shares with other allocations (`Arena::alloc_shared`):
//! `shared_bytes` (its backing bytes that another live allocation maps
//! too), `shared_runs` (`[offset, bytes]` pairs of those pages, in
//! address order) and `shares_with` (the ids of those allocations).
//! Written by hand (the library has no serialization dependency); the format
//! is documented in DESIGN.md and read by the `snapshot_svg` example.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write;

use crate::arena::state::{Owner, Segment, State};
use crate::arena::Stats;

/// Renders the snapshot.
pub(crate) fn to_json(st: &State, stats: &Stats, backend: &str) -> String {
    let c = st.chunk;
    // Room for the stats (about 1.2 KiB) and every range (a live one of
    // about 300 bytes), so that the text is built without reallocating.
    let mut s = String::with_capacity(2048 + (2 * st.by_start.len() + 1) * 320);
    let _ = write!(
        s,
        "{{\"backend\":\"{backend}\",\"base\":{},\"chunk_bytes\":{c},\"pooled_unmapped_chunks\":{},\"inflight_chunks\":{},\"deferred_unmap_pages\":{},\"ranges\":[",
        st.base,
        st.pool.len(),
        st.inflight_pages,
        st.reuse.deferred.len()
    );
    let cached_in = |from: u64, to: u64| st.cached.range(from..to).count() as u64 * c;
    // Which live allocations map each shared chunk (few: built only when
    // something is shared).
    let mut holders: BTreeMap<crate::driver::ChunkHandle, Vec<u32>> = BTreeMap::new();
    if !st.shared.is_empty() {
        for &slot in st.by_start.values() {
            let a = st.alloc(slot);
            for p in a.start..a.start + a.backed {
                if let Some(h) = st.mapped[p as usize].filter(|h| st.shared.contains_key(h)) {
                    holders.entry(h).or_default().push(slot);
                }
            }
        }
    }
    for (i, (start, len, kind)) in st.segments().into_iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        let addr = st.addr(start);
        let bytes = len * c;
        // Every range opens with its kind, address and size.
        let open = |s: &mut String, kind: &str| {
            s.push_str("{\"kind\":\"");
            s.push_str(kind);
            s.push('"');
            num(s, "addr", addr);
            num(s, "bytes", bytes);
        };
        match kind {
            Segment::Free => {
                open(&mut s, "free");
                num(&mut s, "pooled_mapped_bytes", cached_in(start, start + len));
                s.push('}');
            }
            Segment::Retired => {
                open(&mut s, "retired");
                s.push('}');
            }
            Segment::Alloc(slot) => {
                let a = st.alloc(slot);
                if matches!(a.owner, Owner::Pending | Owner::DmaBuf) {
                    // Freed on a stream (its memory waits for the event), or
                    // while a DMA-BUF of it is open (it waits for the close).
                    let waits_for = if a.owner == Owner::DmaBuf { "dmabuf" } else { "event" };
                    s.push_str("{\"kind\":\"pending\",\"waits_for\":\"");
                    s.push_str(waits_for);
                    s.push('"');
                    num(&mut s, "addr", addr);
                    num(&mut s, "bytes", bytes);
                    num(&mut s, "mapped_bytes", a.backed * c);
                    num(&mut s, "pooled_mapped_bytes", cached_in(start + a.backed, start + len));
                    s.push('}');
                    continue;
                }
                let backup_bytes = a.sleep.as_ref().and_then(|z| z.backup.as_ref()).map_or(0, |b| b.len() as u64);
                if let Owner::Slab(slab) = a.owner {
                    let sl = st.small.slab(slab);
                    let live = sl.members.iter().filter(|m| m.is_some()).count() as u32;
                    let class = st.small.classes.size(sl.class);
                    // `used`: live objects; `retired_bytes`: old places of
                    // copy-resized objects, held until retired memory is
                    // released; `pending_bytes`: objects freed on a stream
                    // whose event has not completed.
                    open(&mut s, "slab");
                    num(&mut s, "class_bytes", class);
                    num(&mut s, "objects", sl.members.len() as u64);
                    num(&mut s, "used", live as u64);
                    num(&mut s, "retired_bytes", sl.retired as u64 * class);
                    num(&mut s, "pending_bytes", (sl.used - live - sl.retired) as u64 * class);
                    flag(&mut s, "pinned", a.pinned);
                    num(&mut s, "tag", sl.tag as u64);
                    flag(&mut s, "asleep", a.sleep.is_some());
                    num(&mut s, "mapped_bytes", a.backed * c);
                    num(&mut s, "backup_bytes", backup_bytes);
                    s.push('}');
                    continue;
                }
                let mut runs: Vec<(u64, u64)> = Vec::new();
                let mut with = BTreeSet::new();
                for p in start..start + a.backed {
                    let Some(others) = st.mapped[p as usize].and_then(|h| holders.get(&h)) else { continue };
                    with.extend(others.iter().filter(|&&o| o != slot).map(|&o| st.user_id(o).get()));
                    match runs.last_mut() {
                        Some((off, len)) if *off + *len == (p - start) * c => *len += c,
                        _ => runs.push(((p - start) * c, c)),
                    }
                }
                s.push_str("{\"kind\":\"live\"");
                num(&mut s, "id", st.user_id(slot).get());
                num(&mut s, "addr", addr);
                num(&mut s, "bytes", bytes);
                num(&mut s, "size", a.size);
                num(&mut s, "mapped_bytes", a.backed * c);
                num(&mut s, "pooled_mapped_bytes", cached_in(start + a.backed, start + len));
                flag(&mut s, "pinned", a.pinned);
                flag(&mut s, "growable", a.growable);
                num(&mut s, "tag", a.tag as u64);
                flag(&mut s, "asleep", a.sleep.is_some());
                num(&mut s, "backup_bytes", backup_bytes);
                num(&mut s, "shared_bytes", runs.iter().map(|r| r.1).sum());
                s.push_str(",\"shared_runs\":[");
                for (i, (o, l)) in runs.iter().enumerate() {
                    s.push_str(if i > 0 { ",[" } else { "[" });
                    push_u64(&mut s, *o);
                    s.push(',');
                    push_u64(&mut s, *l);
                    s.push(']');
                }
                s.push_str("],\"shares_with\":[");
                for (i, id) in with.iter().enumerate() {
                    if i > 0 {
                        s.push(',');
                    }
                    push_u64(&mut s, *id);
                }
                s.push_str("]}");
            }
        }
    }
    s.push_str("],\"stats\":{");
    let fields: [(&str, u64); 40] = [
        ("live_allocations", stats.live_allocations),
        ("live_bytes", stats.live_bytes),
        ("mapped_bytes", stats.mapped_bytes),
        ("pooled_bytes", stats.pooled_bytes),
        ("peak_physical_bytes", stats.peak_physical_bytes),
        ("capacity_bytes", stats.capacity_bytes),
        ("reserved_va_bytes", stats.reserved_va_bytes),
        ("free_va_bytes", stats.free_va_bytes),
        ("largest_free_va_bytes", stats.largest_free_va_bytes),
        ("retired_va_bytes", stats.retired_va_bytes),
        ("moves", stats.moves),
        ("driver_creates", stats.driver_creates),
        ("driver_releases", stats.driver_releases),
        ("driver_maps", stats.driver_maps),
        ("driver_unmaps", stats.driver_unmaps),
        ("driver_access_calls", stats.driver_access_calls),
        ("driver_syncs", stats.driver_syncs),
        ("chunk_bytes", stats.chunk_bytes),
        ("cached_mapped_bytes", stats.cached_mapped_bytes),
        ("release_failures", stats.release_failures),
        ("reserve_fallbacks", stats.reserve_fallbacks),
        ("bytes_copied", stats.bytes_copied),
        ("small_slabs", stats.small_slabs),
        ("asleep_bytes", stats.asleep_bytes),
        ("backup_bytes", stats.backup_bytes),
        ("caller_driver_calls", stats.caller_driver_calls),
        ("caller_creates", stats.caller_creates),
        ("caller_syncs", stats.caller_syncs),
        ("maintain_driver_calls", stats.maintain_driver_calls),
        ("stream_frees", stats.stream_frees),
        ("stream_shrinks", stats.stream_shrinks),
        ("quiesces", stats.quiesces),
        ("idle_cached_bytes", stats.idle_cached_bytes),
        ("unmapped_pooled_bytes", stats.unmapped_pooled_bytes),
        ("event_polls", stats.event_polls),
        ("event_waits", stats.event_waits),
        ("pending_free_bytes", stats.pending_free_bytes),
        ("prefetched_bytes", stats.prefetched_bytes),
        ("maintain_failures", stats.maintain_failures),
        ("shared_bytes", stats.shared_bytes),
    ];
    for (i, (k, v)) in fields.iter().enumerate() {
        if i > 0 {
            s.push(',');
        }
        s.push('"');
        s.push_str(k);
        s.push_str("\":");
        push_u64(&mut s, *v);
    }
    s.push_str("}}");
    s
}

/// Appends `,"key":v`.
fn num(s: &mut String, key: &str, v: u64) {
    s.push_str(",\"");
    s.push_str(key);
    s.push_str("\":");
    push_u64(s, v);
}

/// Appends `,"key":true` or `false`.
fn flag(s: &mut String, key: &str, v: bool) {
    s.push_str(",\"");
    s.push_str(key);
    s.push_str(if v { "\":true" } else { "\":false" });
}

/// Appends `v` in decimal (without `fmt`'s machinery: a snapshot holds
/// dozens of numbers, and tests read one after every operation).
fn push_u64(s: &mut String, mut v: u64) {
    let mut digits = [0u8; 20];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (v % 10) as u8;
        v /= 10;
        if v == 0 {
            break;
        }
    }
    s.push_str(std::str::from_utf8(&digits[at..]).expect("ASCII digits"));
}

#[cfg(test)]
mod tests {
    #[test]
    fn push_u64_writes_decimal() {
        for v in [0, 7, 10, 99, 100, 4096, 1 << 40, u64::MAX - 1, u64::MAX] {
            let mut s = String::from("x");
            super::push_u64(&mut s, v);
            assert_eq!(s, format!("x{v}"));
        }
    }
}
