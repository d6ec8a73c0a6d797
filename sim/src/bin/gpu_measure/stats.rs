//! Latency samples and their summary, and the size labels of the tables.

use std::time::Instant;

use serde::Serialize;

use crate::{GIB, MIB};

/// Latency samples in nanoseconds.
#[derive(Clone)]
pub(crate) struct Stats {
    pub(crate) ns: Vec<u64>,
}

impl Stats {
    pub(crate) fn new() -> Stats {
        Stats { ns: Vec::new() }
    }

    pub(crate) fn time<T>(&mut self, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let r = f();
        self.ns.push(t.elapsed().as_nanos() as u64);
        r
    }

    fn sorted(&self) -> Vec<u64> {
        let mut v = self.ns.clone();
        v.sort_unstable();
        v
    }

    /// Nearest-rank percentile, in microseconds.
    fn pct_us(&self, p: f64) -> f64 {
        let v = self.sorted();
        if v.is_empty() {
            return f64::NAN;
        }
        let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
        v[rank.clamp(1, v.len()) - 1] as f64 / 1e3
    }

    pub(crate) fn median_us(&self) -> f64 {
        self.pct_us(50.0)
    }

    pub(crate) fn p99_us(&self) -> f64 {
        self.pct_us(99.0)
    }

    pub(crate) fn mean_us(&self) -> f64 {
        if self.ns.is_empty() {
            return f64::NAN;
        }
        self.ns.iter().sum::<u64>() as f64 / self.ns.len() as f64 / 1e3
    }

    /// The summary written to JSON (no samples: NaN, written as null).
    pub(crate) fn json(&self) -> LatencyJson {
        LatencyJson {
            n: self.ns.len(),
            median_us: self.median_us(),
            p99_us: self.p99_us(),
            mean_us: self.mean_us(),
            min_us: self.pct_us(0.0),
            max_us: self.pct_us(100.0),
        }
    }
}

#[derive(Serialize)]
pub(crate) struct LatencyJson {
    n: usize,
    median_us: f64,
    p99_us: f64,
    mean_us: f64,
    min_us: f64,
    max_us: f64,
}

pub(crate) fn size_label(bytes: u64) -> String {
    if bytes >= GIB && bytes % GIB == 0 {
        format!("{} GiB", bytes / GIB)
    } else {
        format!("{} MiB", bytes / MIB)
    }
}
