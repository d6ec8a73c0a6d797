//! Request traces: the two formats of `../shared/traces/` and a built-in,
//! seeded synthetic trace drawn from the published Azure conversation
//! statistics.
//!
//! - Azure CSV (Splitwise / Vidur processing): a header naming
//!   `arrived_at` (seconds), `num_prefill_tokens`, `num_decode_tokens`;
//! - Mooncake JSONL: one object per line with `timestamp` (milliseconds),
//!   `input_length`, `output_length` (other fields ignored).
//!
//! The format is chosen by the file's extension (`.csv`, `.jsonl`/`.json`),
//! else by its first non-blank character (`{` means JSONL).

use std::path::Path;

use super::util::Rng;

/// Tokens named by one prompt hash of a Mooncake trace.
pub const HASH_BLOCK_TOKENS: u64 = 512;

/// One request: arrival time and token counts.
#[derive(Clone, Debug, PartialEq)]
pub struct Request {
    pub arrival_s: f64,
    pub prompt: u64,
    /// Tokens to generate (at least 1).
    pub output: u64,
    /// Mooncake `hash_ids`: block `i` names prompt tokens `512 i ..
    /// 512 (i + 1)` and, being chained on its predecessors, the whole
    /// prefix up to them. Empty where the trace has none (Azure).
    pub hash_ids: std::sync::Arc<[u64]>,
}

impl Request {
    /// Prompt blocks of [`HASH_BLOCK_TOKENS`] that are full and named.
    pub fn full_hash_blocks(&self) -> u64 {
        (self.prompt / HASH_BLOCK_TOKENS).min(self.hash_ids.len() as u64)
    }
}

/// A named, arrival-ordered list of requests.
#[derive(Clone, Debug)]
pub struct Trace {
    pub name: String,
    pub requests: Vec<Request>,
}

impl Trace {
    pub fn duration_s(&self) -> f64 {
        match (self.requests.first(), self.requests.last()) {
            (Some(a), Some(b)) => b.arrival_s - a.arrival_s,
            _ => 0.0,
        }
    }

    /// (mean, median, p99) of prompt and output lengths.
    pub fn stats(&self) -> ((f64, u64, u64), (f64, u64, u64)) {
        fn s(mut v: Vec<u64>) -> (f64, u64, u64) {
            if v.is_empty() {
                return (0.0, 0, 0);
            }
            v.sort_unstable();
            let mean = v.iter().sum::<u64>() as f64 / v.len() as f64;
            let q = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
            (mean, q(0.5), q(0.99))
        }
        (s(self.requests.iter().map(|r| r.prompt).collect()), s(self.requests.iter().map(|r| r.output).collect()))
    }
}

/// Loads a trace file, keeping the first `limit` requests (by arrival).
pub fn load(path: &Path, limit: Option<usize>) -> Result<Trace, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("").to_ascii_lowercase();
    let jsonl = match ext.as_str() {
        "csv" => false,
        "jsonl" | "json" | "ndjson" => true,
        _ => text.trim_start().starts_with('{'),
    };
    let mut requests = if jsonl { parse_jsonl(&text, limit)? } else { parse_csv(&text, limit)? };
    requests.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
    if let Some(n) = limit {
        requests.truncate(n);
    }
    if requests.is_empty() {
        return Err(format!("{}: no requests", path.display()));
    }
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| path.display().to_string());
    Ok(Trace { name, requests })
}

/// Parses the Azure CSV format (header required).
pub fn parse_csv(text: &str, limit: Option<usize>) -> Result<Vec<Request>, String> {
    let mut lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
    let (_, header) = lines.next().ok_or("empty CSV")?;
    let cols: Vec<&str> = header.split(',').map(|c| c.trim()).collect();
    let col = |name: &str| {
        cols.iter().position(|c| *c == name).ok_or_else(|| format!("CSV header lacks {name:?} (found {header:?})"))
    };
    let (ca, cp, cd) = (col("arrived_at")?, col("num_prefill_tokens")?, col("num_decode_tokens")?);
    let mut out = Vec::new();
    for (i, line) in lines {
        if limit.is_some_and(|n| out.len() >= n) {
            break;
        }
        let f: Vec<&str> = line.split(',').map(|c| c.trim()).collect();
        let get = |c: usize| f.get(c).copied().ok_or_else(|| format!("line {}: too few columns", i + 1));
        let num = |c: usize| -> Result<f64, String> {
            get(c)?.parse::<f64>().map_err(|_| format!("line {}: bad number {:?}", i + 1, f[c]))
        };
        out.push(request(num(ca)?, num(cp)?, num(cd)?).map_err(|e| format!("line {}: {e}", i + 1))?);
    }
    Ok(out)
}

/// Parses the Mooncake JSONL format.
pub fn parse_jsonl(text: &str, limit: Option<usize>) -> Result<Vec<Request>, String> {
    #[derive(serde::Deserialize)]
    struct Line {
        timestamp: f64,
        input_length: f64,
        output_length: f64,
        #[serde(default)]
        hash_ids: Vec<u64>,
    }
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        if limit.is_some_and(|n| out.len() >= n) {
            break;
        }
        let l: Line = serde_json::from_str(line).map_err(|e| format!("line {}: {e}", i + 1))?;
        let mut r = request(l.timestamp / 1000.0, l.input_length, l.output_length)
            .map_err(|e| format!("line {}: {e}", i + 1))?;
        r.hash_ids = l.hash_ids.into();
        out.push(r);
    }
    Ok(out)
}

fn request(arrival_s: f64, prompt: f64, output: f64) -> Result<Request, String> {
    if !(arrival_s.is_finite() && prompt >= 0.0 && output >= 0.0) {
        return Err("negative or invalid value".into());
    }
    Ok(Request {
        arrival_s,
        prompt: (prompt as u64).max(1),
        output: (output as u64).max(1),
        hash_ids: Vec::new().into(),
    })
}

/// Inverse CDF through (quantile, value) points, linear in between.
fn quantile(points: &[(f64, f64)], u: f64) -> f64 {
    for w in points.windows(2) {
        let ((p0, v0), (p1, v1)) = (w[0], w[1]);
        if u <= p1 {
            return v0 + (v1 - v0) * (u - p0) / (p1 - p0);
        }
    }
    points.last().map_or(0.0, |p| p.1)
}

/// Quantile points of the synthetic prompt length. Median and p99 are the
/// published Azure conversation figures (1020, 4142); the 90th percentile
/// (1808) and the ends (20, 8192) are chosen so the mean is 1155.
pub const PROMPT_QUANTILES: [(f64, f64); 5] =
    [(0.0, 20.0), (0.5, 1020.0), (0.9, 1808.0), (0.99, 4142.0), (1.0, 8192.0)];
/// Output length: median 129 and p99 601 published; p90 476 and the ends
/// (1, 1200) give the mean 211.
pub const OUTPUT_QUANTILES: [(f64, f64); 5] = [(0.0, 1.0), (0.5, 129.0), (0.9, 476.0), (0.99, 601.0), (1.0, 1200.0)];
/// Requests per second of the Azure conversation trace.
pub const SYNTHETIC_RATE: f64 = 5.5;

/// A synthetic Azure-conversation-like trace of `n` requests: Poisson
/// arrivals at 5.5 requests/s, prompt and output lengths drawn from the
/// quantile curves above. The same seed gives the same trace everywhere.
pub fn synthetic(n: usize, seed: u64) -> Trace {
    let mut rng = Rng::new(seed);
    let mut t = 0.0;
    let mut requests = Vec::with_capacity(n);
    for _ in 0..n {
        let prompt = quantile(&PROMPT_QUANTILES, rng.f64()).round().max(1.0) as u64;
        let output = quantile(&OUTPUT_QUANTILES, rng.f64()).round().max(1.0) as u64;
        requests.push(Request { arrival_s: t, prompt, output, hash_ids: Vec::new().into() });
        t += -(1.0 - rng.f64()).ln() / SYNTHETIC_RATE;
    }
    Trace { name: format!("synthetic-azure-conv(seed={seed},n={n})"), requests }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_formats() {
        let csv = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,374,44\n4.3,396,109\n";
        let r = parse_csv(csv, None).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!((r[1].prompt, r[1].output), (396, 109));
        let jl = "{\"timestamp\": 1500, \"input_length\": 6758, \"output_length\": 500, \"hash_ids\": [0, 1]}\n";
        let r = parse_jsonl(jl, None).unwrap();
        assert_eq!((r[0].arrival_s, r[0].prompt, r[0].output), (1.5, 6758, 500));
        assert_eq!(&r[0].hash_ids[..], &[0, 1]);
        assert_eq!(r[0].full_hash_blocks(), 2);
    }

    #[test]
    fn synthetic_matches_the_published_statistics() {
        let t = synthetic(20_000, 7);
        let ((pm, pmed, pp99), (om, omed, op99)) = t.stats();
        assert!((pm - 1155.0).abs() < 40.0 && (pmed as f64 - 1020.0).abs() < 40.0, "{pm} {pmed}");
        assert!((pp99 as f64 - 4142.0).abs() < 300.0, "{pp99}");
        assert!((om - 211.0).abs() < 10.0 && (omed as f64 - 129.0).abs() < 10.0, "{om} {omed}");
        assert!((op99 as f64 - 601.0).abs() < 60.0, "{op99}");
        let rate = t.requests.len() as f64 / t.duration_s();
        assert!((rate - 5.5).abs() < 0.3, "{rate}");
    }
}
