//! The arena-against-vLLM verdict as a surface over the constants nobody
//! has measured yet: paged attention's overhead against a dense kernel,
//! the token-major layout's penalty, and whether driver calls cost per
//! 2 MiB chunk or per call. `kv_serving --sweep` replays the grid; this
//! module holds the grid, the break-even rule, and the table and plot.
//!
//! An overhead `x` is an attention efficiency of `1 / (1 + x)`: the
//! attention part of a step takes `1 + x` times as long.

use serde::Serialize;

/// Paged attention's overhead against dense attention.
pub const PAGED_OVERHEADS: [f64; 4] = [0.0, 0.03, 0.10, 0.20];
/// The token-major layout's attention penalty against dense attention.
pub const TOKEN_MAJOR_PENALTIES: [f64; 4] = [0.0, 0.1, 0.3, 0.5];
/// Driver pricings: every call's cost per 2 MiB chunk it covers (the
/// profile as it is), or `cuMemSetAccess`/`cuMemUnmap` per call.
pub const PRICINGS: [&str; 2] = ["per-chunk", "per-call"];

/// A ratio of a grid point (above 1: the arena is better).
type Metric = fn(&Point) -> f64;

/// The two ratios, named.
const METRICS: [(&str, Metric); 2] = [("throughput", Point::throughput_ratio), ("TPOT p99", Point::tpot_ratio)];

/// The efficiency an overhead gives.
pub fn efficiency(overhead: f64) -> f64 {
    1.0 / (1.0 + overhead)
}

/// One grid point's figures.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Point {
    pub pricing: String,
    pub paged_overhead: f64,
    pub token_major_penalty: f64,
    pub arena_tokens_per_s: f64,
    pub vllm_tokens_per_s: f64,
    pub arena_tpot_p99_s: f64,
    pub vllm_tpot_p99_s: f64,
}

impl Point {
    /// arena / vLLM tokens per second (above 1: the arena is faster).
    pub fn throughput_ratio(&self) -> f64 {
        self.arena_tokens_per_s / self.vllm_tokens_per_s
    }

    /// vLLM / arena TPOT p99 (above 1: the arena's tail is shorter).
    pub fn tpot_ratio(&self) -> f64 {
        self.vllm_tpot_p99_s / self.arena_tpot_p99_s
    }
}

/// The smallest `x` at which `ratio` (sampled at increasing `xs`) reaches
/// 1, by linear interpolation between samples: `Some(xs[0])` when it is
/// there already, `None` when no sample reaches it.
pub fn break_even(xs: &[f64], ratios: &[f64]) -> Option<f64> {
    let first = *ratios.first()?;
    if first >= 1.0 {
        return xs.first().copied();
    }
    for i in 1..xs.len().min(ratios.len()) {
        let (r0, r1) = (ratios[i - 1], ratios[i]);
        if r1 >= 1.0 {
            return Some(xs[i - 1] + (1.0 - r0) / (r1 - r0) * (xs[i] - xs[i - 1]));
        }
    }
    None
}

/// The grid's points of one pricing and token-major penalty, in paged
/// overhead order.
fn row<'a>(points: &'a [Point], pricing: &str, tm: f64) -> Vec<&'a Point> {
    let mut v: Vec<&Point> = points.iter().filter(|p| p.pricing == pricing && p.token_major_penalty == tm).collect();
    v.sort_by(|a, b| a.paged_overhead.total_cmp(&b.paged_overhead));
    v
}

/// Break-even paged overheads, by pricing and penalty, for a metric.
pub fn break_evens(points: &[Point], metric: Metric) -> Vec<(String, f64, Option<f64>)> {
    let mut out = Vec::new();
    for pricing in PRICINGS {
        for tm in TOKEN_MAJOR_PENALTIES {
            let r = row(points, pricing, tm);
            if r.is_empty() {
                continue;
            }
            let xs: Vec<f64> = r.iter().map(|p| p.paged_overhead).collect();
            let ys: Vec<f64> = r.iter().map(|p| metric(p)).collect();
            out.push((pricing.to_string(), tm, break_even(&xs, &ys)));
        }
    }
    out
}

fn pct(x: f64) -> String {
    format!("{:.0} %", x * 100.0)
}

/// One sentence per break-even: "the arena matches vLLM's throughput when
/// paged attention is at least x % slower than dense with the token-major
/// penalty at y".
pub fn sentences(points: &[Point]) -> Vec<String> {
    let mut out = Vec::new();
    for (what, f) in METRICS {
        for (pricing, tm, be) in break_evens(points, f) {
            let max = PAGED_OVERHEADS[PAGED_OVERHEADS.len() - 1];
            out.push(match be {
                Some(x) if x <= 0.0 => format!(
                    "Driver calls priced {pricing}, token-major penalty {}: the arena matches or beats vLLM's {what} even with paged attention as fast as dense.",
                    pct(tm)
                ),
                Some(x) => format!(
                    "Driver calls priced {pricing}, token-major penalty {}: the arena matches vLLM's {what} when paged attention is at least {:.1} % slower than dense.",
                    pct(tm),
                    x * 100.0
                ),
                None => format!(
                    "Driver calls priced {pricing}, token-major penalty {}: the arena does not match vLLM's {what} at any paged-attention overhead up to {}.",
                    pct(tm),
                    pct(max)
                ),
            });
        }
    }
    out
}

/// The surface as markdown tables: one per pricing, penalty by row,
/// paged overhead by column, "throughput ratio / TPOT p99 ratio" per cell.
pub fn markdown(points: &[Point]) -> String {
    let mut s = String::new();
    for pricing in PRICINGS {
        if !points.iter().any(|p| p.pricing == pricing) {
            continue;
        }
        s.push_str(&format!(
            "\nDriver calls priced {pricing}. Cells: arena/vLLM tokens_per_s, vLLM/arena tpot_p99_s (above 1: the arena is better).\n\n"
        ));
        s.push_str("| token-major penalty \\ paged overhead |");
        for po in PAGED_OVERHEADS {
            s.push_str(&format!(" {} |", pct(po)));
        }
        s.push_str(" break-even (tokens/s) | break-even (TPOT p99) |\n|---|");
        s.push_str(&"---:|".repeat(PAGED_OVERHEADS.len() + 2));
        s.push('\n');
        for tm in TOKEN_MAJOR_PENALTIES {
            let r = row(points, pricing, tm);
            if r.is_empty() {
                continue;
            }
            s.push_str(&format!("| {} |", pct(tm)));
            for p in &r {
                s.push_str(&format!(" {:.3} / {:.3} |", p.throughput_ratio(), p.tpot_ratio()));
            }
            let xs: Vec<f64> = r.iter().map(|p| p.paged_overhead).collect();
            for (_, f) in METRICS {
                let ys: Vec<f64> = r.iter().map(|p| f(p)).collect();
                s.push_str(&match break_even(&xs, &ys) {
                    Some(x) => format!(" {:.1} % |", x * 100.0),
                    None => format!(" > {} |", pct(*xs.last().unwrap_or(&0.0))),
                });
            }
            s.push('\n');
        }
    }
    s
}

/// The surface as an SVG: for each pricing, a heat map of each ratio
/// (green: the arena better, red: vLLM better) over paged overhead (x) and
/// token-major penalty (y), with the break-even line (ratio 1).
pub fn svg(points: &[Point], title: &str) -> String {
    const CELL: f64 = 70.0;
    const PAD: f64 = 110.0;
    let panel_w = CELL * PAGED_OVERHEADS.len() as f64 + PAD;
    let panel_h = CELL * TOKEN_MAJOR_PENALTIES.len() as f64 + PAD;
    let metrics: [(&str, Metric); 2] =
        [("arena/vLLM tokens_per_s", Point::throughput_ratio), ("vLLM/arena tpot_p99_s", Point::tpot_ratio)];
    let (w, h) = (panel_w * 2.0 + 20.0, panel_h * PRICINGS.len() as f64 + 50.0);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w:.0}\" height=\"{h:.0}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"10\" y=\"20\" font-size=\"14\">{}</text>\n",
        escape(title)
    );
    for (pi, pricing) in PRICINGS.iter().enumerate() {
        for (mi, (label, f)) in metrics.iter().enumerate() {
            let ox = 10.0 + mi as f64 * (panel_w + 10.0) + 80.0;
            let oy = 40.0 + pi as f64 * panel_h + 30.0;
            s.push_str(&format!(
                "<text x=\"{:.0}\" y=\"{:.0}\">{label}, driver {pricing}</text>\n",
                ox - 70.0,
                oy - 10.0
            ));
            let mut line: Vec<(f64, f64)> = Vec::new();
            for (yi, tm) in TOKEN_MAJOR_PENALTIES.iter().enumerate() {
                let r = row(points, pricing, *tm);
                let y = oy + yi as f64 * CELL;
                s.push_str(&format!(
                    "<text x=\"{:.0}\" y=\"{:.0}\" text-anchor=\"end\">tm {}</text>\n",
                    ox - 5.0,
                    y + CELL / 2.0 + 4.0,
                    pct(*tm)
                ));
                for (xi, p) in r.iter().enumerate() {
                    let v = f(p);
                    let x = ox + xi as f64 * CELL;
                    s.push_str(&format!(
                        "<rect x=\"{x:.0}\" y=\"{y:.0}\" width=\"{CELL:.0}\" height=\"{CELL:.0}\" fill=\"{}\" stroke=\"white\"/>\n\
                         <text x=\"{:.0}\" y=\"{:.0}\" text-anchor=\"middle\">{v:.3}</text>\n",
                        color(v),
                        x + CELL / 2.0,
                        y + CELL / 2.0 + 4.0
                    ));
                }
                let xs: Vec<f64> = r.iter().map(|p| p.paged_overhead).collect();
                let ys: Vec<f64> = r.iter().map(|p| f(p)).collect();
                if let Some(be) = break_even(&xs, &ys) {
                    line.push((ox + CELL / 2.0 + grid_pos(be) * CELL, y + CELL / 2.0));
                }
            }
            for (xi, po) in PAGED_OVERHEADS.iter().enumerate() {
                s.push_str(&format!(
                    "<text x=\"{:.0}\" y=\"{:.0}\" text-anchor=\"middle\">paged {}</text>\n",
                    ox + xi as f64 * CELL + CELL / 2.0,
                    oy + TOKEN_MAJOR_PENALTIES.len() as f64 * CELL + 14.0,
                    pct(*po)
                ));
            }
            if line.len() >= 2 {
                let pts: Vec<String> = line.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
                s.push_str(&format!(
                    "<polyline points=\"{}\" fill=\"none\" stroke=\"black\" stroke-width=\"2\" stroke-dasharray=\"5,3\"/>\n",
                    pts.join(" ")
                ));
            } else if let Some((x, y)) = line.first() {
                s.push_str(&format!("<circle cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"4\" fill=\"black\"/>\n"));
            }
        }
    }
    s.push_str(&format!(
        "<text x=\"10\" y=\"{:.0}\">dashed: break-even (ratio 1), interpolated between grid columns; green: the arena better, red: vLLM better</text>\n</svg>\n",
        h - 8.0
    ));
    s
}

/// Where overhead `x` falls on the grid's columns (0 = first column's
/// centre), linear between columns.
fn grid_pos(x: f64) -> f64 {
    for i in 1..PAGED_OVERHEADS.len() {
        let (a, b) = (PAGED_OVERHEADS[i - 1], PAGED_OVERHEADS[i]);
        if x <= b {
            return (i - 1) as f64 + (x - a).max(0.0) / (b - a);
        }
    }
    (PAGED_OVERHEADS.len() - 1) as f64
}

fn color(v: f64) -> String {
    let d = ((v - 1.0).abs() * 10.0).min(1.0);
    let fade = (255.0 - 150.0 * d) as u8;
    if v >= 1.0 {
        format!("rgb({fade},230,{fade})")
    } else {
        format!("rgb(240,{fade},{fade})")
    }
}

fn escape(t: &str) -> String {
    t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pt(pricing: &str, po: f64, tm: f64, arena: f64, vllm: f64) -> Point {
        Point {
            pricing: pricing.into(),
            paged_overhead: po,
            token_major_penalty: tm,
            arena_tokens_per_s: arena,
            vllm_tokens_per_s: vllm,
            arena_tpot_p99_s: 0.1,
            vllm_tpot_p99_s: 0.1 * arena / vllm,
        }
    }

    #[test]
    fn break_even_interpolates_between_samples() {
        // 0.95 at 3 %, 1.05 at 10 %: half way, 6.5 %.
        let be = break_even(&[0.0, 0.03, 0.10, 0.20], &[0.9, 0.95, 1.05, 1.2]).unwrap();
        assert!((be - 0.065).abs() < 1e-12, "{be}");
        assert_eq!(break_even(&[0.0, 0.1], &[1.0, 1.1]), Some(0.0));
        assert_eq!(break_even(&[0.0, 0.1], &[0.8, 0.9]), None);
        assert_eq!(break_even(&[], &[]), None);
    }

    #[test]
    fn sentences_and_tables_state_each_break_even() {
        let mut points = Vec::new();
        for (i, po) in PAGED_OVERHEADS.iter().enumerate() {
            // vLLM slows with its overhead; the arena sits at 100.
            points.push(pt("per-chunk", *po, 0.0, 100.0, [104.0, 102.0, 98.0, 95.0][i]));
        }
        let s = sentences(&points);
        // vLLM 102 → 98 between 3 % and 10 %: ratio 100/102 = 0.98039 →
        // 100/98 = 1.02041, crossing 1 at 0.01961 / 0.04002 = 0.490 of the
        // way: 3 % + 0.490 x 7 % = 6.43 %.
        assert!(s[0].contains("at least 6.4 % slower"), "{s:?}");
        let md = markdown(&points);
        assert!(md.contains("| 0 % | 0.962 / 0.962 |"), "{md}");
        assert!(md.contains(" 6.4 % |"), "{md}");
        let svg = svg(&points, "t");
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert!(svg.contains("<circle"), "one row: the break-even is a point");
    }
}
