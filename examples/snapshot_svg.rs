//! Turns an arena snapshot (`Arena::snapshot_json`) into an SVG map of its
//! address space, for people who would rather look than read.
//!
//! ```text
//! snapshot_svg SNAPSHOT.json OUT.svg [--width PX] [--rows N] [--full] [--title TEXT]
//! ```
//!
//! The map draws the reserved virtual range left to right, top to bottom, in
//! `--rows` rows (linear in bytes). Each range of the snapshot is one or more
//! `<rect>`s carrying `data-range="INDEX"` and its kind as the class:
//! - `live`: an allocation, coloured by its id; the mapped prefix solid, the
//!   reserved but unmapped tail pale, pooled chunks cached inside that tail
//!   hatched (drawn after the mapped prefix: the snapshot gives their number,
//!   not their place), pinned allocations outlined in dark red;
//! - `slab`: a chunk of small allocations, filled to the share of its objects in use;
//! - `free`: unreserved address space, with its cached pooled chunks hatched
//!   (again drawn at its start);
//! - `retired`: old ranges of moved allocations, still mapped until `release_retired`.
//!
//! Above the map: a legend, the key stats, and a bar of the physical
//! capacity (mapped, pooled mapped, pooled unmapped, unused). Hovering a
//! range shows its details (`<title>`). By default the free address space
//! after the last used range is cut short (`--full` draws all of it).
//!
//! The JSON parser is a minimal one written here: the project takes no
//! dependency for this.

use std::fmt::Write as _;

// ---------------------------------------------------------------- JSON

/// A parsed JSON value (numbers kept as text, so u64 addresses stay exact).
#[derive(Clone, Debug, PartialEq)]
pub enum Json {
    Null,
    Bool(bool),
    Num(String),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

impl Json {
    /// Parses a whole document.
    pub fn parse(text: &str) -> Result<Json, String> {
        let mut p = Parser { s: text.as_bytes(), i: 0 };
        let v = p.value(0)?;
        p.ws();
        if p.i != p.s.len() {
            return Err(format!("trailing characters at byte {}", p.i));
        }
        Ok(v)
    }

    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Json::Obj(kv) => kv.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Json::Num(n) => {
                n.parse::<u64>().ok().or_else(|| n.parse::<f64>().ok().filter(|f| *f >= 0.0).map(|f| f as u64))
            }
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Json::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Json::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub fn as_arr(&self) -> Option<&[Json]> {
        match self {
            Json::Arr(a) => Some(a),
            _ => None,
        }
    }

    fn u(&self, key: &str) -> u64 {
        self.get(key).and_then(Json::as_u64).unwrap_or(0)
    }
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && matches!(self.s[self.i], b' ' | b'\t' | b'\n' | b'\r') {
            self.i += 1;
        }
    }

    fn err<T>(&self, what: &str) -> Result<T, String> {
        Err(format!("JSON: {what} at byte {}", self.i))
    }

    fn lit(&mut self, word: &str, v: Json) -> Result<Json, String> {
        if self.s[self.i..].starts_with(word.as_bytes()) {
            self.i += word.len();
            Ok(v)
        } else {
            self.err("unexpected word")
        }
    }

    fn value(&mut self, depth: usize) -> Result<Json, String> {
        if depth > 64 {
            return self.err("nesting too deep");
        }
        self.ws();
        match self.s.get(self.i) {
            None => self.err("unexpected end"),
            Some(b'{') => {
                self.i += 1;
                let mut kv = Vec::new();
                self.ws();
                if self.s.get(self.i) == Some(&b'}') {
                    self.i += 1;
                    return Ok(Json::Obj(kv));
                }
                loop {
                    self.ws();
                    let k = self.string()?;
                    self.ws();
                    if self.s.get(self.i) != Some(&b':') {
                        return self.err("expected ':'");
                    }
                    self.i += 1;
                    let v = self.value(depth + 1)?;
                    kv.push((k, v));
                    self.ws();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b'}') => {
                            self.i += 1;
                            return Ok(Json::Obj(kv));
                        }
                        _ => return self.err("expected ',' or '}'"),
                    }
                }
            }
            Some(b'[') => {
                self.i += 1;
                let mut a = Vec::new();
                self.ws();
                if self.s.get(self.i) == Some(&b']') {
                    self.i += 1;
                    return Ok(Json::Arr(a));
                }
                loop {
                    a.push(self.value(depth + 1)?);
                    self.ws();
                    match self.s.get(self.i) {
                        Some(b',') => self.i += 1,
                        Some(b']') => {
                            self.i += 1;
                            return Ok(Json::Arr(a));
                        }
                        _ => return self.err("expected ',' or ']'"),
                    }
                }
            }
            Some(b'"') => Ok(Json::Str(self.string()?)),
            Some(b't') => self.lit("true", Json::Bool(true)),
            Some(b'f') => self.lit("false", Json::Bool(false)),
            Some(b'n') => self.lit("null", Json::Null),
            Some(c) if *c == b'-' || c.is_ascii_digit() => {
                let start = self.i;
                while self.i < self.s.len() && matches!(self.s[self.i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                {
                    self.i += 1;
                }
                let t = std::str::from_utf8(&self.s[start..self.i]).map_err(|e| e.to_string())?;
                if t.parse::<f64>().is_err() {
                    return self.err("bad number");
                }
                Ok(Json::Num(t.to_string()))
            }
            Some(_) => self.err("unexpected character"),
        }
    }

    fn string(&mut self) -> Result<String, String> {
        if self.s.get(self.i) != Some(&b'"') {
            return self.err("expected a string");
        }
        self.i += 1;
        let mut out = Vec::new();
        loop {
            match self.s.get(self.i) {
                None => return self.err("unterminated string"),
                Some(b'"') => {
                    self.i += 1;
                    return String::from_utf8(out).map_err(|e| e.to_string());
                }
                Some(b'\\') => {
                    let c = *self.s.get(self.i + 1).ok_or("JSON: unterminated escape")?;
                    self.i += 2;
                    let ch = match c {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'n' => '\n',
                        b'r' => '\r',
                        b't' => '\t',
                        b'u' => {
                            let hex = self.s.get(self.i..self.i + 4).ok_or("JSON: short \\u escape")?;
                            let code = u32::from_str_radix(std::str::from_utf8(hex).map_err(|e| e.to_string())?, 16)
                                .map_err(|e| e.to_string())?;
                            self.i += 4;
                            char::from_u32(code).unwrap_or('\u{fffd}')
                        }
                        _ => return self.err("bad escape"),
                    };
                    let mut b = [0u8; 4];
                    out.extend_from_slice(ch.encode_utf8(&mut b).as_bytes());
                }
                Some(&c) => {
                    out.push(c);
                    self.i += 1;
                }
            }
        }
    }
}

// ---------------------------------------------------------------- rendering

/// How to draw.
#[derive(Clone, Debug, PartialEq)]
pub struct Options {
    pub width: u32,
    pub rows: u32,
    /// Draw all the trailing free address space instead of cutting it short.
    pub full: bool,
    pub title: String,
}

impl Default for Options {
    fn default() -> Self {
        Options { width: 1200, rows: 16, full: false, title: "vmm-arena address space".into() }
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

/// `1.5 GiB`, `64.0 MiB`, `4 KiB`, `12 B`.
pub fn human(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u < U.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", U[u])
    }
}

fn hue_of(id: u64) -> u64 {
    let mut z = id.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z ^= z >> 29;
    z.wrapping_mul(0xbf58_476d_1ce4_e5b9) >> 40
}

/// One range as the snapshot gives it.
#[derive(Clone, Debug, PartialEq)]
pub struct Range {
    pub kind: String,
    pub addr: u64,
    pub bytes: u64,
    pub id: u64,
    pub size: u64,
    pub mapped_bytes: u64,
    pub pooled_mapped_bytes: u64,
    pub pinned: bool,
    pub growable: bool,
    pub class_bytes: u64,
    pub objects: u64,
    pub used: u64,
    pub retired_bytes: u64,
}

/// Reads the ranges of a parsed snapshot.
pub fn ranges(doc: &Json) -> Result<Vec<Range>, String> {
    let arr = doc.get("ranges").and_then(Json::as_arr).ok_or("the snapshot has no \"ranges\" array")?;
    arr.iter()
        .enumerate()
        .map(|(i, r)| {
            let kind = r.get("kind").and_then(Json::as_str).ok_or(format!("range {i} has no kind"))?;
            let addr = r.get("addr").and_then(Json::as_u64).ok_or(format!("range {i} has no addr"))?;
            let bytes = r.get("bytes").and_then(Json::as_u64).ok_or(format!("range {i} has no bytes"))?;
            Ok(Range {
                kind: kind.to_string(),
                addr,
                bytes,
                id: r.u("id"),
                size: r.u("size"),
                mapped_bytes: r.u("mapped_bytes"),
                pooled_mapped_bytes: r.u("pooled_mapped_bytes"),
                pinned: r.get("pinned").and_then(Json::as_bool).unwrap_or(false),
                growable: r.get("growable").and_then(Json::as_bool).unwrap_or(false),
                class_bytes: r.u("class_bytes"),
                objects: r.u("objects"),
                used: r.u("used"),
                retired_bytes: r.u("retired_bytes"),
            })
        })
        .collect()
}

struct Map {
    x0: f64,
    y0: f64,
    w: f64,
    row_h: f64,
    row_gap: f64,
    base: u64,
    per_row: u64,
    rows: u64,
}

impl Map {
    /// The pieces (x, y, width) of `[a, b)`, one per row it touches.
    fn pieces(&self, a: u64, b: u64) -> Vec<(f64, f64, f64)> {
        let end = self.base + self.per_row * self.rows;
        let (a, b) = (a.max(self.base), b.min(end));
        let mut out = Vec::new();
        if a >= b {
            return out;
        }
        let first = (a - self.base) / self.per_row;
        let last = (b - 1 - self.base) / self.per_row;
        for r in first..=last {
            let rs = self.base + r * self.per_row;
            let (pa, pb) = (a.max(rs), b.min(rs + self.per_row));
            let x = self.x0 + (pa - rs) as f64 / self.per_row as f64 * self.w;
            let wd = ((pb - pa) as f64 / self.per_row as f64 * self.w).max(0.6);
            out.push((x, self.y0 + r as f64 * (self.row_h + self.row_gap), wd));
        }
        out
    }
}

/// Renders a snapshot document as SVG.
pub fn render(json: &str, opts: &Options) -> Result<String, String> {
    let doc = Json::parse(json)?;
    let rs = ranges(&doc)?;
    let stats = doc.get("stats").cloned().unwrap_or(Json::Obj(Vec::new()));
    let st = |k: &str| stats.u(k);
    let chunk = doc.u("chunk_bytes").max(1);
    let base = doc.get("base").and_then(Json::as_u64).or_else(|| rs.first().map(|r| r.addr)).unwrap_or(0);
    let total_end = rs.iter().map(|r| r.addr + r.bytes).max().unwrap_or(base + chunk);
    let used_end = rs.iter().filter(|r| r.kind != "free").map(|r| r.addr + r.bytes).max().unwrap_or(base);
    let view_end = if opts.full || used_end <= base {
        total_end
    } else {
        let span = used_end - base;
        (used_end + (span / 16).max(chunk)).min(total_end)
    };
    let width = opts.width.max(400) as f64;
    let rows = opts.rows.clamp(1, 256) as u64;
    let per_row = (view_end - base).div_ceil(rows).div_ceil(chunk).max(1) * chunk;
    let rows = (view_end - base).div_ceil(per_row).max(1);
    let margin = 20.0;
    let header_h = 250.0;
    let map =
        Map { x0: margin, y0: header_h, w: width - 2.0 * margin, row_h: 26.0, row_gap: 10.0, base, per_row, rows };
    let height = header_h + rows as f64 * (map.row_h + map.row_gap) + 40.0;

    let mut o = String::new();
    let _ = writeln!(
        o,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width:.0}\" height=\"{height:.0}\" \
         viewBox=\"0 0 {width:.0} {height:.0}\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">"
    );
    o.push_str(
        "<defs>\
         <pattern id=\"pooled\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" patternTransform=\"rotate(45)\">\
         <rect width=\"6\" height=\"6\" fill=\"#b9ecec\"/><rect width=\"3\" height=\"6\" fill=\"#22a3a3\"/></pattern>\
         <pattern id=\"retired\" width=\"6\" height=\"6\" patternUnits=\"userSpaceOnUse\" patternTransform=\"rotate(-45)\">\
         <rect width=\"6\" height=\"6\" fill=\"#e0e0e0\"/><rect width=\"2\" height=\"6\" fill=\"#777\"/></pattern>\
         </defs>\n",
    );
    let _ = writeln!(o, "<rect x=\"0\" y=\"0\" width=\"{width:.0}\" height=\"{height:.0}\" fill=\"#ffffff\"/>");
    let backend = doc.get("backend").and_then(Json::as_str).unwrap_or("?");
    let _ =
        writeln!(o, "<text x=\"{margin}\" y=\"28\" font-size=\"18\" font-weight=\"bold\">{}</text>", esc(&opts.title));
    let _ = writeln!(
        o,
        "<text x=\"{margin}\" y=\"48\" fill=\"#444\">backend {}, base {base:#x}, chunk {}, {} ranges, reserved {}</text>",
        esc(backend),
        human(chunk),
        rs.len(),
        human(st("reserved_va_bytes").max(total_end - base))
    );

    // Legend.
    let legend: [(&str, &str, &str); 7] = [
        ("hsl(210,65%,48%)", "none", "live: mapped (colour by id)"),
        ("hsl(210,65%,86%)", "none", "live: reserved, unmapped"),
        ("url(#pooled)", "none", "pooled chunk, mapped (cached)"),
        ("#f3c15a", "none", "slab of small allocations (fill: objects in use)"),
        ("#ffffff", "#bbb", "free address space"),
        ("url(#retired)", "none", "retired (old range of a move)"),
        ("#ffffff", "#a00000", "pinned (outline)"),
    ];
    for (i, (fill, stroke, label)) in legend.iter().enumerate() {
        let (col, row) = (i % 4, i / 4);
        let x = margin + col as f64 * 290.0;
        let y = 62.0 + row as f64 * 20.0;
        let sw = if *stroke == "#a00000" { 2.5 } else { 1.0 };
        let _ = writeln!(
            o,
            "<rect class=\"legend\" x=\"{x}\" y=\"{y}\" width=\"22\" height=\"13\" fill=\"{fill}\" stroke=\"{stroke}\" \
             stroke-width=\"{sw}\"/><text x=\"{}\" y=\"{}\">{}</text>",
            x + 28.0,
            y + 11.0,
            esc(label)
        );
    }

    // Key stats.
    let lines = [
        format!(
            "live {} allocations, {} asked, {} mapped; peak physical {} of capacity {}",
            st("live_allocations"),
            human(st("live_bytes")),
            human(st("mapped_bytes")),
            human(st("peak_physical_bytes")),
            human(st("capacity_bytes"))
        ),
        format!(
            "pooled {} ({} mapped and cached, {} chunks unmapped); small slabs {}, bytes copied {}",
            human(st("pooled_bytes")),
            human(st("cached_mapped_bytes")),
            doc.u("pooled_unmapped_chunks"),
            st("small_slabs"),
            human(st("bytes_copied"))
        ),
        format!(
            "free VA {} (largest {}), retired {}; moves {}",
            human(st("free_va_bytes")),
            human(st("largest_free_va_bytes")),
            human(st("retired_va_bytes")),
            st("moves")
        ),
        format!(
            "driver calls: create {}, release {}, map {}, unmap {}, set access {}, sync {}",
            st("driver_creates"),
            st("driver_releases"),
            st("driver_maps"),
            st("driver_unmaps"),
            st("driver_access_calls"),
            st("driver_syncs")
        ),
    ];
    for (i, l) in lines.iter().enumerate() {
        let _ = writeln!(o, "<text class=\"stat\" x=\"{margin}\" y=\"{}\">{}</text>", 118.0 + i as f64 * 17.0, esc(l));
    }

    // Physical capacity bar.
    let cap = st("capacity_bytes").max(1);
    let bar_y = 190.0;
    let bar_w = width - 2.0 * margin;
    let parts = [
        (st("mapped_bytes"), "hsl(210,65%,48%)", "mapped"),
        (st("cached_mapped_bytes"), "url(#pooled)", "pooled, mapped"),
        (doc.u("pooled_unmapped_chunks") * chunk, "#7fd1d1", "pooled, unmapped"),
    ];
    let _ =
        writeln!(o, "<text x=\"{margin}\" y=\"{}\" fill=\"#444\">physical capacity {}</text>", bar_y - 5.0, human(cap));
    let mut x = margin;
    for (b, fill, label) in parts {
        let w = b as f64 / cap as f64 * bar_w;
        if w > 0.0 {
            let _ = writeln!(
                o,
                "<rect class=\"physical\" x=\"{x:.2}\" y=\"{bar_y}\" width=\"{w:.2}\" height=\"16\" fill=\"{fill}\">\
                 <title>{label}: {}</title></rect>",
                human(b)
            );
        }
        x += w;
    }
    let _ = writeln!(
        o,
        "<rect x=\"{margin}\" y=\"{bar_y}\" width=\"{bar_w:.2}\" height=\"16\" fill=\"none\" stroke=\"#888\"/>"
    );
    let _ = writeln!(
        o,
        "<text x=\"{margin}\" y=\"{}\" fill=\"#444\">address space: {} per row{}</text>",
        header_h - 18.0,
        human(per_row),
        if view_end < total_end {
            format!(
                "; free address space after {:#x} ({}) not drawn (--full draws it)",
                view_end,
                human(total_end - view_end)
            )
        } else {
            String::new()
        }
    );

    // Row backgrounds and offsets.
    for r in 0..rows {
        let y = map.y0 + r as f64 * (map.row_h + map.row_gap);
        let _ = writeln!(
            o,
            "<text x=\"{}\" y=\"{}\" font-size=\"9\" fill=\"#888\">+{}</text>",
            margin,
            y - 1.5,
            human(r * per_row)
        );
    }

    // Ranges.
    let h = map.row_h;
    for (i, r) in rs.iter().enumerate() {
        let (a, b) = (r.addr, r.addr + r.bytes);
        let tip = match r.kind.as_str() {
            "live" => format!(
                "live id {:#x} at {:#x}: size {}, reserved {}, mapped {}, pooled in its tail {}{}{}",
                r.id,
                r.addr,
                human(r.size),
                human(r.bytes),
                human(r.mapped_bytes),
                human(r.pooled_mapped_bytes),
                if r.pinned { ", pinned" } else { "" },
                if r.growable { ", growable" } else { "" }
            ),
            "slab" => format!(
                "slab at {:#x}: class {}, {} of {} objects in use{}{}",
                r.addr,
                human(r.class_bytes),
                r.used,
                r.objects,
                if r.retired_bytes > 0 { format!(", retired {}", human(r.retired_bytes)) } else { String::new() },
                if r.pinned { ", pinned" } else { "" }
            ),
            "free" => {
                format!("free at {:#x}: {}, pooled mapped {}", r.addr, human(r.bytes), human(r.pooled_mapped_bytes))
            }
            k => format!("{k} at {:#x}: {}", r.addr, human(r.bytes)),
        };
        let tip = esc(&tip);
        let kind = esc(&r.kind);
        match r.kind.as_str() {
            "live" => {
                let hue = hue_of(r.id) % 360;
                let (stroke, sw) = if r.pinned { ("#a00000", 2.5) } else { ("#ffffff", 0.5) };
                for (x, y, w) in map.pieces(a, b) {
                    let _ = writeln!(
                        o,
                        "<rect class=\"live\" data-range=\"{i}\" x=\"{x:.2}\" y=\"{y}\" width=\"{w:.2}\" height=\"{h}\" \
                         fill=\"hsl({hue},65%,86%)\" stroke=\"{stroke}\" stroke-width=\"{sw}\"><title>{tip}</title></rect>"
                    );
                }
                let m_end = a + r.mapped_bytes.min(r.bytes);
                for (x, y, w) in map.pieces(a, m_end) {
                    let _ = writeln!(
                        o,
                        "<rect class=\"mapped\" data-range=\"{i}\" x=\"{x:.2}\" y=\"{}\" width=\"{w:.2}\" height=\"{}\" \
                         fill=\"hsl({hue},65%,48%)\"><title>{tip}</title></rect>",
                        y + 1.5,
                        h - 3.0
                    );
                }
                let p_end = (m_end + r.pooled_mapped_bytes).min(b);
                for (x, y, w) in map.pieces(m_end, p_end) {
                    let _ = writeln!(
                        o,
                        "<rect class=\"pooled\" data-range=\"{i}\" x=\"{x:.2}\" y=\"{}\" width=\"{w:.2}\" height=\"{}\" \
                         fill=\"url(#pooled)\"><title>{tip}</title></rect>",
                        y + 1.5,
                        h - 3.0
                    );
                }
                if let Some(&(x, y, w)) = map.pieces(a, b).first() {
                    if w > 46.0 {
                        let _ = writeln!(
                            o,
                            "<text x=\"{:.2}\" y=\"{}\" font-size=\"10\" fill=\"#fff\" pointer-events=\"none\">{}{}</text>",
                            x + 3.0,
                            y + h / 2.0 + 4.0,
                            r.id & 0xffff_ffff,
                            if r.pinned { " pin" } else { "" }
                        );
                    }
                }
            }
            "slab" => {
                let (stroke, sw) = if r.pinned { ("#a00000", 2.5) } else { ("#ffffff", 0.5) };
                for (x, y, w) in map.pieces(a, b) {
                    let _ = writeln!(
                        o,
                        "<rect class=\"slab\" data-range=\"{i}\" x=\"{x:.2}\" y=\"{y}\" width=\"{w:.2}\" height=\"{h}\" \
                         fill=\"#fbe3ae\" stroke=\"{stroke}\" stroke-width=\"{sw}\"><title>{tip}</title></rect>"
                    );
                    let frac = if r.objects > 0 { r.used as f64 / r.objects as f64 } else { 0.0 };
                    let fh = (h - 3.0) * frac.clamp(0.0, 1.0);
                    let _ = writeln!(
                        o,
                        "<rect class=\"slab-used\" data-range=\"{i}\" x=\"{x:.2}\" y=\"{:.2}\" width=\"{w:.2}\" \
                         height=\"{fh:.2}\" fill=\"#e8a317\"><title>{tip}</title></rect>",
                        y + 1.5 + (h - 3.0 - fh)
                    );
                }
            }
            "free" => {
                for (x, y, w) in map.pieces(a, b) {
                    let _ = writeln!(
                        o,
                        "<rect class=\"free\" data-range=\"{i}\" x=\"{x:.2}\" y=\"{y}\" width=\"{w:.2}\" height=\"{h}\" \
                         fill=\"#ffffff\" stroke=\"#bbb\" stroke-width=\"0.5\"><title>{tip}</title></rect>"
                    );
                }
                for (x, y, w) in map.pieces(a, (a + r.pooled_mapped_bytes).min(b)) {
                    let _ = writeln!(
                        o,
                        "<rect class=\"pooled\" data-range=\"{i}\" x=\"{x:.2}\" y=\"{}\" width=\"{w:.2}\" height=\"{}\" \
                         fill=\"url(#pooled)\"><title>{tip}</title></rect>",
                        y + 1.5,
                        h - 3.0
                    );
                }
            }
            "retired" => {
                for (x, y, w) in map.pieces(a, b) {
                    let _ = writeln!(
                        o,
                        "<rect class=\"retired\" data-range=\"{i}\" x=\"{x:.2}\" y=\"{y}\" width=\"{w:.2}\" height=\"{h}\" \
                         fill=\"url(#retired)\" stroke=\"#555\" stroke-width=\"0.5\"><title>{tip}</title></rect>"
                    );
                }
            }
            _ => {
                for (x, y, w) in map.pieces(a, b) {
                    let _ = writeln!(
                        o,
                        "<rect class=\"{kind}\" data-range=\"{i}\" x=\"{x:.2}\" y=\"{y}\" width=\"{w:.2}\" height=\"{h}\" \
                         fill=\"#cccccc\"><title>{tip}</title></rect>"
                    );
                }
            }
        }
        // A range entirely in the part not drawn still gets its (zero-width) rect, at the last row's end.
        if a >= view_end {
            let y = map.y0 + (rows - 1) as f64 * (map.row_h + map.row_gap);
            let _ = writeln!(
                o,
                "<rect class=\"{kind}\" data-range=\"{i}\" x=\"{:.2}\" y=\"{y}\" width=\"0\" height=\"{h}\"><title>{tip}</title></rect>",
                map.x0 + map.w
            );
        }
    }
    o.push_str("</svg>\n");
    Ok(o)
}

fn parse_args(mut it: impl Iterator<Item = String>) -> Result<(String, String, Options), String> {
    let mut opts = Options::default();
    let mut files = Vec::new();
    let mut title = None;
    while let Some(a) = it.next() {
        let mut val = || it.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "--width" => opts.width = val()?.parse().map_err(|_| "bad --width".to_string())?,
            "--rows" => opts.rows = val()?.parse().map_err(|_| "bad --rows".to_string())?,
            "--full" => opts.full = true,
            "--title" => title = Some(val()?),
            "-h" | "--help" => return Err(String::new()),
            s if s.starts_with("--") => return Err(format!("unknown argument {s:?}")),
            _ => files.push(a),
        }
    }
    let [input, output]: [String; 2] = files.try_into().map_err(|_| "give SNAPSHOT.json and OUT.svg".to_string())?;
    opts.title = title.unwrap_or_else(|| format!("vmm-arena address space: {input}"));
    Ok((input, output, opts))
}

#[allow(dead_code)]
fn main() {
    let usage = "usage: snapshot_svg SNAPSHOT.json OUT.svg [--width PX] [--rows N] [--full] [--title TEXT]";
    let (input, output, opts) = match parse_args(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) if e.is_empty() => {
            println!("{usage}");
            return;
        }
        Err(e) => {
            eprintln!("{e}\n{usage}");
            std::process::exit(2);
        }
    };
    let result = std::fs::read_to_string(&input)
        .map_err(|e| format!("cannot read {input}: {e}"))
        .and_then(|json| render(&json, &opts))
        .and_then(|svg| std::fs::write(&output, svg).map_err(|e| format!("cannot write {output}: {e}")));
    if let Err(e) = result {
        eprintln!("snapshot_svg: {e}");
        std::process::exit(1);
    }
    println!("wrote {output}");
}
