//! Driver calls per decode step: how many `map`, `unmap`, `create`,
//! `release` and `set_access` calls each step made (its critical path and
//! its between-steps work together, as [`crate::step_charge`] charges
//! them), and their distribution over the steps of a run.
//!
//! A *decode step* is a step that produced at least one output token. The
//! replay keeps two distributions: over every decode step, and over the
//! *warm* ones (steps whose instantaneous peak of live KV did not exceed an
//! earlier step's, `replay.rs`): the steady state, where the memory a step
//! needs has been needed before and a manager that keeps memory has no
//! reason to call the driver.
//!
//! Counts are kept as histograms (count of calls -> steps), so a run of
//! any length costs a few map entries per kind, and every quantile is
//! exact (nearest rank, as the replay's other quantiles).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::counted::Calls;

/// One kind's calls per step over a run's steps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct CallDistribution {
    pub median: u64,
    pub p90: u64,
    pub p99: u64,
    pub max: u64,
    pub mean: f64,
    /// Steps with no call of the kind, over all steps counted (1 when
    /// there were no steps).
    pub zero_fraction: f64,
}

/// Calls per step by kind, over the steps a [`StepCallCounter`] counted.
/// `total` is the sum of the five kinds in each step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StepCallSummary {
    pub steps: u64,
    pub map: CallDistribution,
    pub unmap: CallDistribution,
    pub create: CallDistribution,
    pub release: CallDistribution,
    pub set_access: CallDistribution,
    pub total: CallDistribution,
}

/// The kinds counted, in [`StepCallSummary`]'s field order (`total` last).
pub const KINDS: [&str; 6] = ["map", "unmap", "create", "release", "set_access", "total"];

impl StepCallSummary {
    /// The distributions in [`KINDS`] order.
    pub fn by_kind(&self) -> [&CallDistribution; 6] {
        [&self.map, &self.unmap, &self.create, &self.release, &self.set_access, &self.total]
    }
}

/// Counts steps' calls into one histogram per kind.
#[derive(Clone, Debug, Default)]
pub struct StepCallCounter {
    steps: u64,
    /// Per kind ([`KINDS`] order): calls in a step -> steps with that many.
    histograms: [BTreeMap<u64, u64>; 6],
}

fn per_kind(c: &Calls) -> [u64; 6] {
    let k = [c.map, c.unmap, c.create, c.release, c.set_access];
    [k[0], k[1], k[2], k[3], k[4], k.iter().sum()]
}

/// The value at nearest rank `round((n - 1) q)` of a histogram of `n`
/// samples (0 when empty).
fn quantile(h: &BTreeMap<u64, u64>, n: u64, q: f64) -> u64 {
    if n == 0 {
        return 0;
    }
    let rank = ((n - 1) as f64 * q).round() as u64;
    let mut seen = 0;
    for (&value, &count) in h {
        seen += count;
        if seen > rank {
            return value;
        }
    }
    h.keys().next_back().copied().unwrap_or(0)
}

fn distribution(h: &BTreeMap<u64, u64>, n: u64) -> CallDistribution {
    let sum: u64 = h.iter().map(|(v, c)| v * c).sum();
    CallDistribution {
        median: quantile(h, n, 0.5),
        p90: quantile(h, n, 0.9),
        p99: quantile(h, n, 0.99),
        max: h.keys().next_back().copied().unwrap_or(0),
        mean: if n == 0 { 0.0 } else { sum as f64 / n as f64 },
        zero_fraction: if n == 0 { 1.0 } else { h.get(&0).copied().unwrap_or(0) as f64 / n as f64 },
    }
}

impl StepCallCounter {
    /// Counts one step that made `calls`.
    pub fn add(&mut self, calls: &Calls) {
        self.steps += 1;
        for (h, v) in self.histograms.iter_mut().zip(per_kind(calls)) {
            *h.entry(v).or_insert(0) += 1;
        }
    }

    pub fn summary(&self) -> StepCallSummary {
        let d: Vec<CallDistribution> = self.histograms.iter().map(|h| distribution(h, self.steps)).collect();
        StepCallSummary {
            steps: self.steps,
            map: d[0],
            unmap: d[1],
            create: d[2],
            release: d[3],
            set_access: d[4],
            total: d[5],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_exact_over_the_steps() {
        // 100 steps: 80 without a call, 15 with 2 maps, 4 with 10, one
        // with 500 (and 500 set_access).
        let mut c = StepCallCounter::default();
        for _ in 0..80 {
            c.add(&Calls::default());
        }
        for _ in 0..15 {
            c.add(&Calls { map: 2, ..Calls::default() });
        }
        for _ in 0..4 {
            c.add(&Calls { map: 10, ..Calls::default() });
        }
        c.add(&Calls { map: 500, set_access: 500, ..Calls::default() });
        let s = c.summary();
        assert_eq!(s.steps, 100);
        // Ranks round(99 q): 50 -> 0, 89 -> 2, 98 -> 10; max 500.
        assert_eq!((s.map.median, s.map.p90, s.map.p99, s.map.max), (0, 2, 10, 500));
        assert!((s.map.zero_fraction - 0.8).abs() < 1e-12);
        assert!((s.map.mean - (30.0 + 40.0 + 500.0) / 100.0).abs() < 1e-12);
        assert_eq!((s.set_access.p99, s.set_access.max), (0, 500));
        assert!((s.set_access.zero_fraction - 0.99).abs() < 1e-12);
        assert_eq!(s.total.max, 1000);
        assert_eq!((s.unmap.max, s.unmap.zero_fraction), (0, 1.0));
    }

    #[test]
    fn no_steps_give_zeros() {
        let s = StepCallCounter::default().summary();
        assert_eq!(s.steps, 0);
        assert_eq!(s.total, CallDistribution { zero_fraction: 1.0, ..CallDistribution::default() });
    }
}
