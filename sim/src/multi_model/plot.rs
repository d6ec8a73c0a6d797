//! The memory-over-time plot of a multi-model run: one panel per manager,
//! one line per model (bytes it holds), as a self-contained SVG.

use super::MmReport;

const COLORS: [&str; 6] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"];

/// The SVG of `runs` (same models, same traffic), titled `title`.
pub fn svg(runs: &[MmReport], title: &str) -> String {
    let (w, ph, left, top) = (900.0, 220.0, 70.0, 40.0);
    let tmax = runs.iter().map(|r| r.makespan_s).fold(1e-9, f64::max);
    let gib = (1u64 << 30) as f64;
    let ymax = runs
        .iter()
        .flat_map(|r| r.timeline.iter().flat_map(|(_, v)| v.iter().copied()))
        .fold(1.0, |a: f64, b| a.max(b as f64 / gib))
        .ceil();
    let height = top + runs.len() as f64 * (ph + 40.0) + 20.0;
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{height}\" font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n<text x=\"{left}\" y=\"22\" font-size=\"15\">{title}</text>\n"
    );
    let pw = w - left - 20.0;
    for (i, r) in runs.iter().enumerate() {
        let y0 = top + i as f64 * (ph + 40.0) + 10.0;
        s += &format!(
            "<text x=\"{left}\" y=\"{}\" font-weight=\"bold\">{}</text>\n<rect x=\"{left}\" y=\"{y0}\" width=\"{pw}\" height=\"{ph}\" fill=\"none\" stroke=\"#888\"/>\n",
            y0 - 4.0,
            r.manager
        );
        for k in 0..=4 {
            let v = ymax * k as f64 / 4.0;
            let y = y0 + ph - ph * k as f64 / 4.0;
            s += &format!("<text x=\"{}\" y=\"{y}\" text-anchor=\"end\">{v:.0} GiB</text>\n", left - 6.0);
        }
        for k in 0..=5 {
            let x = left + pw * k as f64 / 5.0;
            s += &format!(
                "<text x=\"{x}\" y=\"{}\" text-anchor=\"middle\">{:.0} s</text>\n",
                y0 + ph + 14.0,
                tmax * k as f64 / 5.0
            );
        }
        let n = r.timeline.first().map_or(0, |(_, v)| v.len());
        for m in 0..n {
            let pts: Vec<String> = r
                .timeline
                .iter()
                .map(|(t, v)| format!("{:.1},{:.1}", left + pw * t / tmax, y0 + ph - ph * (v[m] as f64 / gib) / ymax))
                .collect();
            s += &format!(
                "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.2\" points=\"{}\"/>\n",
                COLORS[m % COLORS.len()],
                pts.join(" ")
            );
            s += &format!(
                "<text x=\"{}\" y=\"{}\" fill=\"{}\">model {m}</text>\n",
                left + pw - 60.0,
                y0 + 14.0 + 14.0 * m as f64,
                COLORS[m % COLORS.len()]
            );
        }
    }
    s + "</svg>\n"
}
