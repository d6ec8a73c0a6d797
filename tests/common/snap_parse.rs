//! The arena's JSON snapshot read straight into a [`Snap`], in one pass.
//!
//! The model check and the `ops` fuzz target read a snapshot after every
//! operation. Building a generic [`super::Json`] tree first (a map of
//! string keys per range, then a lookup per field) was most of the check's
//! cost, and under libFuzzer every string comparison of those lookups also
//! goes through its `memcmp` hook. This reader keeps the same strictness:
//! the text must be one JSON value and nothing after it, a key appears once
//! in an object, every field a range's kind has must be there with the
//! right type, and an unknown range kind is refused. Keys it does not know
//! are skipped (checked to be well-formed JSON), as the tree reader ignored
//! them.

use super::{stat_name, Kind, Range, Snap, StatMap};

struct Lexer<'a> {
    text: &'a str,
    b: &'a [u8],
    at: usize,
}

impl<'a> Lexer<'a> {
    fn ws(&mut self) {
        while self.at < self.b.len() && self.b[self.at].is_ascii_whitespace() {
            self.at += 1;
        }
    }

    fn peek(&mut self) -> u8 {
        self.ws();
        *self.b.get(self.at).unwrap_or_else(|| panic!("snapshot ends early at byte {}", self.at))
    }

    fn expect(&mut self, c: u8) {
        assert_eq!(self.peek(), c, "expected {:?} at byte {}", c as char, self.at);
        self.at += 1;
    }

    /// A string without escapes (the snapshot's keys, kinds and backend names).
    fn string(&mut self) -> &'a str {
        self.expect(b'"');
        let start = self.at;
        // `str::find` (the standard library's memchr, not a byte loop of
        // this crate's: under the fuzzer, every iteration of that is counted).
        let len = self.text[start..].find('"').expect("an unterminated string");
        self.at += len + 1;
        // Both ends are at ASCII quotes, so at character boundaries.
        let s = &self.text[start..start + len];
        assert!(!s.contains('\\'), "an escape in a snapshot string at byte {start}");
        s
    }

    fn number(&mut self) -> u64 {
        self.ws();
        let start = self.at;
        let mut v: u64 = 0;
        while self.at < self.b.len() && self.b[self.at].is_ascii_digit() {
            let d = (self.b[self.at] - b'0') as u64;
            v = v.checked_mul(10).and_then(|v| v.checked_add(d)).expect("number fits u64");
            self.at += 1;
        }
        assert!(self.at > start, "expected a number at byte {start}");
        v
    }

    fn boolean(&mut self) -> bool {
        self.ws();
        if self.b[self.at..].starts_with(b"true") {
            self.at += 4;
            true
        } else if self.b[self.at..].starts_with(b"false") {
            self.at += 5;
            false
        } else {
            panic!("expected a bool at byte {}", self.at)
        }
    }

    /// Calls `item` for each element of an array.
    fn array(&mut self, mut item: impl FnMut(&mut Self)) {
        self.expect(b'[');
        if self.peek() == b']' {
            self.at += 1;
            return;
        }
        loop {
            item(self);
            match self.peek() {
                b',' => self.at += 1,
                b']' => {
                    self.at += 1;
                    return;
                }
                c => panic!("unexpected {:?} in an array at byte {}", c as char, self.at),
            }
        }
    }

    /// Calls `field` with each key of an object, the lexer before its value
    /// (the caller refuses a key it has seen: [`set`]).
    fn object(&mut self, mut field: impl FnMut(&mut Self, &'a str)) {
        self.expect(b'{');
        if self.peek() == b'}' {
            self.at += 1;
            return;
        }
        loop {
            let k = self.string();
            self.expect(b':');
            field(self, k);
            match self.peek() {
                b',' => self.at += 1,
                b'}' => {
                    self.at += 1;
                    return;
                }
                c => panic!("unexpected {:?} in an object at byte {}", c as char, self.at),
            }
        }
    }

    fn numbers(&mut self) -> Vec<u64> {
        let mut v = Vec::new();
        self.array(|l| v.push(l.number()));
        v
    }

    /// Any value, read and dropped (a key this reader does not know).
    fn skip(&mut self) {
        match self.peek() {
            b'{' => self.object(|l, _| l.skip()),
            b'[' => self.array(|l| l.skip()),
            b'"' => {
                self.string();
            }
            b't' | b'f' => {
                self.boolean();
            }
            b'n' if self.b[self.at..].starts_with(b"null") => self.at += 4,
            _ => {
                self.number();
            }
        }
    }
}

/// Fills a field once: a key seen twice in an object is refused.
fn set<T>(slot: &mut Option<T>, v: T, key: &str) {
    assert!(slot.replace(v).is_none(), "duplicate key {key}");
}

/// The fields of one range as read, before its kind says which must be there.
#[derive(Default)]
struct Fields<'a> {
    kind: Option<&'a str>,
    nums: [Option<u64>; NUMS.len()],
    pinned: Option<bool>,
    growable: Option<bool>,
    asleep: Option<bool>,
    shared_runs: Option<Vec<(u64, u64)>>,
    shares_with: Option<Vec<u64>>,
}

const NUMS: [&str; 14] = [
    "addr",
    "bytes",
    "id",
    "size",
    "mapped_bytes",
    "pooled_mapped_bytes",
    "class_bytes",
    "objects",
    "used",
    "retired_bytes",
    "pending_bytes",
    "tag",
    "backup_bytes",
    "shared_bytes",
];

/// The index of a numeric field in [`NUMS`] (a `match`: a few comparisons
/// of keys of the same length, not a scan of all of them).
fn num_index(k: &str) -> Option<usize> {
    Some(match k {
        "addr" => 0,
        "bytes" => 1,
        "id" => 2,
        "size" => 3,
        "mapped_bytes" => 4,
        "pooled_mapped_bytes" => 5,
        "class_bytes" => 6,
        "objects" => 7,
        "used" => 8,
        "retired_bytes" => 9,
        "pending_bytes" => 10,
        "tag" => 11,
        "backup_bytes" => 12,
        "shared_bytes" => 13,
        _ => return None,
    })
}

impl Fields<'_> {
    /// A numeric field that the kind has (`has`), else 0.
    fn num(&self, i: usize, has: bool) -> u64 {
        if !has {
            return 0;
        }
        self.nums[i].unwrap_or_else(|| panic!("field {}: missing from a {:?} range", NUMS[i], self.kind))
    }

    fn flag(&self, v: Option<bool>, key: &str, has: bool) -> bool {
        has && v.unwrap_or_else(|| panic!("field {key}: missing from a {:?} range", self.kind))
    }
}

fn range<'a>(l: &mut Lexer<'a>) -> Range {
    let mut f = Fields::default();
    l.object(|l, k| match k {
        "kind" => set(&mut f.kind, l.string(), k),
        "pinned" => set(&mut f.pinned, l.boolean(), k),
        "growable" => set(&mut f.growable, l.boolean(), k),
        "asleep" => set(&mut f.asleep, l.boolean(), k),
        "shared_runs" => {
            let mut runs = Vec::new();
            l.array(|l| match l.numbers()[..] {
                [a, b] => runs.push((a, b)),
                ref other => panic!("expected a pair, got {other:?}"),
            });
            set(&mut f.shared_runs, runs, k);
        }
        "shares_with" => set(&mut f.shares_with, l.numbers(), k),
        _ => match num_index(k) {
            Some(i) => set(&mut f.nums[i], l.number(), k),
            None => l.skip(),
        },
    });
    let kind = match f.kind.expect("field kind: missing") {
        "live" => Kind::Live,
        "slab" => Kind::Slab,
        "free" => Kind::Free,
        "retired" => Kind::Retired,
        "pending" => Kind::Pending,
        k => panic!("unknown range kind {k}"),
    };
    let (live, slab, pending) = (kind == Kind::Live, kind == Kind::Slab, kind == Kind::Pending);
    Range {
        kind,
        addr: f.num(0, true),
        bytes: f.num(1, true),
        id: f.num(2, live),
        size: f.num(3, live),
        mapped_bytes: f.num(4, live || pending || slab),
        pooled_mapped_bytes: f.num(5, live || pending || kind == Kind::Free),
        pinned: f.flag(f.pinned, "pinned", live || slab),
        growable: f.flag(f.growable, "growable", live),
        class_bytes: f.num(6, slab),
        objects: f.num(7, slab),
        used: f.num(8, slab),
        retired_bytes: f.num(9, slab),
        pending_bytes: f.num(10, slab),
        tag: f.num(11, live || slab),
        asleep: f.flag(f.asleep, "asleep", live || slab),
        backup_bytes: f.num(12, live || slab),
        shared_bytes: f.num(13, live),
        shared_runs: if live { f.shared_runs.take().expect("field shared_runs: missing") } else { Vec::new() },
        shares_with: if live { f.shares_with.take().expect("field shares_with: missing") } else { Vec::new() },
    }
}

/// Reads a snapshot's text (see the module doc).
pub fn parse(text: &str) -> Snap {
    let mut l = Lexer { text, b: text.as_bytes(), at: 0 };
    let (mut base, mut chunk, mut pooled, mut inflight, mut deferred) = (None, None, None, None, None);
    let mut ranges = None;
    let mut stats = None;
    l.object(|l, k| match k {
        "base" => set(&mut base, l.number(), k),
        "chunk_bytes" => set(&mut chunk, l.number(), k),
        "pooled_unmapped_chunks" => set(&mut pooled, l.number(), k),
        "inflight_chunks" => set(&mut inflight, l.number(), k),
        "deferred_unmap_pages" => set(&mut deferred, l.number(), k),
        "ranges" => {
            let mut rs = Vec::new();
            l.array(|l| rs.push(range(l)));
            set(&mut ranges, rs, k);
        }
        "stats" => {
            let mut st = StatMap::with_capacity_and_hasher(64, Default::default());
            l.object(|l, k| {
                let name = stat_name(k, st.len());
                assert!(st.insert(name, l.number()).is_none(), "duplicate key {k}");
            });
            set(&mut stats, st, k);
        }
        _ => l.skip(),
    });
    l.ws();
    assert_eq!(l.at, l.b.len(), "trailing text after the JSON value");
    Snap {
        base: base.expect("field base: missing"),
        chunk: chunk.expect("field chunk_bytes: missing"),
        pooled_unmapped_chunks: pooled.expect("field pooled_unmapped_chunks: missing"),
        inflight_chunks: inflight.expect("field inflight_chunks: missing"),
        deferred_unmap_pages: deferred.expect("field deferred_unmap_pages: missing"),
        ranges: ranges.expect("no ranges"),
        stats: stats.expect("no stats"),
    }
}
