//! Request streams: seeded synthetic load and the trace files (Azure CSV, Mooncake JSONL).

use super::*;

pub(super) fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn unit(x: &mut u64) -> f64 {
    ((splitmix(x) >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

fn normal(x: &mut u64) -> f64 {
    let (u, v) = (unit(x), unit(x));
    (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
}

/// Seeded synthetic requests.
pub fn synthetic(s: &Synthetic, n: usize, seed: u64) -> Vec<Request> {
    let mut x = seed;
    let mut t = 0.0;
    (0..n)
        .map(|_| {
            let r = Request {
                arrive_s: t,
                prompt: ((s.prompt_median * (s.prompt_sigma * normal(&mut x)).exp()).round() as u64)
                    .clamp(1, s.prompt_max),
                output: ((s.output_median * (s.output_sigma * normal(&mut x)).exp()).round() as u64)
                    .clamp(1, s.output_max),
            };
            t += -unit(&mut x).ln() / s.rate_per_s;
            r
        })
        .collect()
}

/// The fields of a Mooncake JSONL line that the replay uses (others, such as
/// `hash_ids`, are skipped).
#[derive(Deserialize)]
struct MooncakeLine {
    /// Milliseconds.
    timestamp: f64,
    input_length: f64,
    output_length: f64,
}

/// Reads the first `limit` requests of an Azure CSV or Mooncake JSONL trace,
/// arrivals relative to the first one.
pub fn load_trace(path: &Path, limit: usize) -> Result<Vec<Request>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if out.len() >= limit {
            break;
        }
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let bad = || format!("{}:{}: cannot parse {line:?}", path.display(), n + 1);
        let r = if line.starts_with('{') {
            let m: MooncakeLine = serde_json::from_str(line).map_err(|e| format!("{} ({e})", bad()))?;
            Request { arrive_s: m.timestamp / 1000.0, prompt: m.input_length as u64, output: m.output_length as u64 }
        } else {
            let f: Vec<&str> = line.split(',').map(str::trim).collect();
            if f.len() < 3 || f[0].parse::<f64>().is_err() {
                if n == 0 {
                    continue; // header
                }
                return Err(bad());
            }
            Request {
                arrive_s: f[0].parse().map_err(|_| bad())?,
                prompt: f[1].parse::<f64>().map_err(|_| bad())? as u64,
                output: f[2].parse::<f64>().map_err(|_| bad())? as u64,
            }
        };
        out.push(Request { prompt: r.prompt.max(1), output: r.output.max(1), ..r });
    }
    if out.is_empty() {
        return Err(format!("{}: no requests", path.display()));
    }
    let t0 = out.iter().map(|r| r.arrive_s).fold(f64::INFINITY, f64::min);
    for r in &mut out {
        r.arrive_s -= t0;
    }
    out.sort_by(|a, b| a.arrive_s.total_cmp(&b.arrive_s));
    Ok(out)
}
