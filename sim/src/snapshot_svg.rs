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
//!   not their place), pinned allocations outlined in dark red, and the
//!   chunks it shares with other allocations (`Arena::alloc_shared`, the
//!   range's `shared_runs`) cross-hatched in black over the mapped prefix
//!   (class `shared`; the tooltip names the sharers);
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
//! The snapshot is read with `serde_json` into the typed [`Snapshot`]: ranges
//! need `kind`, `addr` and `bytes`; every other field may be missing (zero,
//! false or unknown) and unknown ones are ignored, so snapshots from older or
//! newer versions of the library still draw.

use std::fmt::Write as _;
use std::path::PathBuf;

use clap::Parser;
use serde::Deserialize;

// ---------------------------------------------------------------- snapshot format

/// A snapshot document, as `Arena::snapshot_json` writes it.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Snapshot {
    #[serde(default)]
    pub backend: Option<String>,
    /// Start of the reserved range; absent: the first range's address.
    #[serde(default)]
    pub base: Option<u64>,
    #[serde(default)]
    pub chunk_bytes: u64,
    #[serde(default)]
    pub pooled_unmapped_chunks: u64,
    pub ranges: Vec<Range>,
    #[serde(default)]
    pub stats: SnapshotStats,
}

/// The stats the map shows (the snapshot carries more; they are ignored).
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(default)]
pub struct SnapshotStats {
    pub live_allocations: u64,
    pub live_bytes: u64,
    pub mapped_bytes: u64,
    pub pooled_bytes: u64,
    pub peak_physical_bytes: u64,
    pub capacity_bytes: u64,
    pub reserved_va_bytes: u64,
    pub free_va_bytes: u64,
    pub largest_free_va_bytes: u64,
    pub retired_va_bytes: u64,
    pub moves: u64,
    pub driver_creates: u64,
    pub driver_releases: u64,
    pub driver_maps: u64,
    pub driver_unmaps: u64,
    pub driver_access_calls: u64,
    pub driver_syncs: u64,
    pub cached_mapped_bytes: u64,
    pub bytes_copied: u64,
    pub small_slabs: u64,
    pub shared_bytes: u64,
}

/// Parses a snapshot document.
pub fn parse(json: &str) -> Result<Snapshot, String> {
    serde_json::from_str(json).map_err(|e| format!("not a snapshot: {e}"))
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

/// One range as the snapshot gives it: `kind`, `addr` and `bytes` are
/// required, the rest depends on the kind.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Range {
    pub kind: String,
    pub addr: u64,
    pub bytes: u64,
    #[serde(default)]
    pub id: u64,
    #[serde(default)]
    pub size: u64,
    #[serde(default)]
    pub mapped_bytes: u64,
    #[serde(default)]
    pub pooled_mapped_bytes: u64,
    #[serde(default)]
    pub pinned: bool,
    #[serde(default)]
    pub growable: bool,
    #[serde(default)]
    pub class_bytes: u64,
    #[serde(default)]
    pub objects: u64,
    #[serde(default)]
    pub used: u64,
    #[serde(default)]
    pub retired_bytes: u64,
    /// Live: its pages whose chunks other live allocations map too, as
    /// (offset, bytes) pairs, and those allocations' ids.
    #[serde(default)]
    pub shared_bytes: u64,
    #[serde(default)]
    pub shared_runs: Vec<(u64, u64)>,
    #[serde(default)]
    pub shares_with: Vec<u64>,
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
    let doc = parse(json)?;
    let rs = &doc.ranges;
    let st = &doc.stats;
    let chunk = doc.chunk_bytes.max(1);
    let base = doc.base.or_else(|| rs.first().map(|r| r.addr)).unwrap_or(0);
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
         <pattern id=\"shared\" width=\"5\" height=\"5\" patternUnits=\"userSpaceOnUse\">\
         <path d=\"M0,0 L5,5 M5,0 L0,5\" stroke=\"#000\" stroke-width=\"0.8\"/></pattern>\
         </defs>\n",
    );
    let _ = writeln!(o, "<rect x=\"0\" y=\"0\" width=\"{width:.0}\" height=\"{height:.0}\" fill=\"#ffffff\"/>");
    let backend = doc.backend.as_deref().unwrap_or("?");
    let _ =
        writeln!(o, "<text x=\"{margin}\" y=\"28\" font-size=\"18\" font-weight=\"bold\">{}</text>", esc(&opts.title));
    let _ = writeln!(
        o,
        "<text x=\"{margin}\" y=\"48\" fill=\"#444\">backend {}, base {base:#x}, chunk {}, {} ranges, reserved {}</text>",
        esc(backend),
        human(chunk),
        rs.len(),
        human(st.reserved_va_bytes.max(total_end - base))
    );

    // Legend.
    let legend: [(&str, &str, &str); 8] = [
        ("hsl(210,65%,48%)", "none", "live: mapped (colour by id)"),
        ("hsl(210,65%,86%)", "none", "live: reserved, unmapped"),
        ("url(#pooled)", "none", "pooled chunk, mapped (cached)"),
        ("#f3c15a", "none", "slab of small allocations (fill: objects in use)"),
        ("#ffffff", "#bbb", "free address space"),
        ("url(#retired)", "none", "retired (old range of a move)"),
        ("#ffffff", "#a00000", "pinned (outline)"),
        ("url(#shared)", "none", "chunks shared with other allocations"),
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
            st.live_allocations,
            human(st.live_bytes),
            human(st.mapped_bytes),
            human(st.peak_physical_bytes),
            human(st.capacity_bytes)
        ),
        format!(
            "pooled {} ({} mapped and cached, {} chunks unmapped); small slabs {}, bytes copied {}",
            human(st.pooled_bytes),
            human(st.cached_mapped_bytes),
            doc.pooled_unmapped_chunks,
            st.small_slabs,
            human(st.bytes_copied)
        ),
        format!(
            "free VA {} (largest {}), retired {}; moves {}",
            human(st.free_va_bytes),
            human(st.largest_free_va_bytes),
            human(st.retired_va_bytes),
            st.moves
        ),
        format!(
            "driver calls: create {}, release {}, map {}, unmap {}, set access {}, sync {}",
            st.driver_creates,
            st.driver_releases,
            st.driver_maps,
            st.driver_unmaps,
            st.driver_access_calls,
            st.driver_syncs
        ),
    ];
    for (i, l) in lines.iter().enumerate() {
        let _ = writeln!(o, "<text class=\"stat\" x=\"{margin}\" y=\"{}\">{}</text>", 118.0 + i as f64 * 17.0, esc(l));
    }

    // Physical capacity bar.
    let cap = st.capacity_bytes.max(1);
    let bar_y = 190.0;
    let bar_w = width - 2.0 * margin;
    let parts = [
        (st.mapped_bytes, "hsl(210,65%,48%)", "mapped"),
        (st.cached_mapped_bytes, "url(#pooled)", "pooled, mapped"),
        (doc.pooled_unmapped_chunks * chunk, "#7fd1d1", "pooled, unmapped"),
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
                "live id {:#x} at {:#x}: size {}, reserved {}, mapped {}, pooled in its tail {}{}{}{}",
                r.id,
                r.addr,
                human(r.size),
                human(r.bytes),
                human(r.mapped_bytes),
                human(r.pooled_mapped_bytes),
                if r.pinned { ", pinned" } else { "" },
                if r.growable { ", growable" } else { "" },
                if r.shared_bytes > 0 {
                    let ids: Vec<String> = r.shares_with.iter().map(|id| format!("{id:#x}")).collect();
                    format!(", shares {} with {}", human(r.shared_bytes), ids.join(", "))
                } else {
                    String::new()
                }
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
                for &(off, len) in &r.shared_runs {
                    let (sa, sb) =
                        (a.saturating_add(off).min(m_end), a.saturating_add(off).saturating_add(len).min(m_end));
                    for (x, y, w) in map.pieces(sa, sb) {
                        let _ = writeln!(
                            o,
                            "<rect class=\"shared\" data-range=\"{i}\" x=\"{x:.2}\" y=\"{}\" width=\"{w:.2}\" \
                             height=\"{}\" fill=\"url(#shared)\"><title>{tip}</title></rect>",
                            y + 1.5,
                            h - 3.0
                        );
                    }
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

/// Draws an arena snapshot (`Arena::snapshot_json`) as an SVG map of its address space.
#[derive(Debug, Parser)]
#[command(name = "snapshot_svg")]
pub struct Cli {
    /// The snapshot to draw (JSON).
    #[arg(value_name = "SNAPSHOT.json")]
    pub input: PathBuf,
    /// Where to write the SVG.
    #[arg(value_name = "OUT.svg")]
    pub output: PathBuf,
    /// Width of the picture, in pixels.
    #[arg(long, value_name = "PX", default_value_t = Options::default().width)]
    pub width: u32,
    /// Rows the address space is drawn in.
    #[arg(long, value_name = "N", default_value_t = Options::default().rows)]
    pub rows: u32,
    /// Draw all the trailing free address space instead of cutting it short.
    #[arg(long)]
    pub full: bool,
    /// Title above the map [default: "vmm-arena address space: SNAPSHOT.json"].
    #[arg(long, value_name = "TEXT")]
    pub title: Option<String>,
}

impl Cli {
    pub fn options(&self) -> Options {
        Options {
            width: self.width,
            rows: self.rows,
            full: self.full,
            title: self.title.clone().unwrap_or_else(|| format!("vmm-arena address space: {}", self.input.display())),
        }
    }
}

/// The `snapshot_svg` program (`src/bin/snapshot_svg.rs`).
pub fn main() {
    let cli = Cli::parse();
    let (input, output) = (cli.input.display(), cli.output.display());
    let result = std::fs::read_to_string(&cli.input)
        .map_err(|e| format!("cannot read {input}: {e}"))
        .and_then(|json| render(&json, &cli.options()))
        .and_then(|svg| std::fs::write(&cli.output, svg).map_err(|e| format!("cannot write {output}: {e}")));
    if let Err(e) = result {
        eprintln!("snapshot_svg: {e}");
        std::process::exit(1);
    }
    println!("wrote {output}");
}
