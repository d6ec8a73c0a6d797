//! Pressure over a range of capacities (`kv_serving --capacity-sweep`):
//! the same workload replayed at each capacity of a range, and each
//! manager's figures summed over the range. A count as chaotic as
//! preemptions (two schedules part at the first one and never meet again)
//! is judged over the range, not at one capacity.

use serde::Serialize;

use crate::replay::RunResult;
use crate::util::parse_size;

/// The most capacities one sweep replays.
pub const MAX_POINTS: usize = 64;

/// The capacities of `FROM:TO:STEP` (sizes with suffixes, e.g.
/// `2.5GiB:4GiB:0.25GiB`): FROM, FROM + STEP, ... up to TO included.
pub fn parse_range(s: &str) -> Result<Vec<u64>, String> {
    let parts: Vec<&str> = s.split(':').collect();
    let [from, to, step] = parts[..] else {
        return Err(format!("capacity range {s:?}: expected FROM:TO:STEP, e.g. 2.5GiB:4GiB:0.25GiB"));
    };
    let (from, to, step) = (parse_size(from)?, parse_size(to)?, parse_size(step)?);
    if from == 0 || step == 0 || to < from {
        return Err(format!("capacity range {s:?}: needs 0 < FROM <= TO and STEP > 0"));
    }
    let n = (to - from) / step + 1;
    if n > MAX_POINTS as u64 {
        return Err(format!("capacity range {s:?}: {n} capacities, more than {MAX_POINTS}"));
    }
    Ok((0..n).map(|i| from + i * step).collect())
}

/// One manager's figures summed over the capacities of a sweep.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ManagerTotals {
    pub manager: String,
    pub capacities: u64,
    pub preemptions: u64,
    pub fragmentation_failures: u64,
    pub bytes_copied: u64,
    pub rejected_requests: u64,
    pub completed_requests: u64,
    pub integrity_errors: u64,
    /// Tokens per simulated second, summed over the capacities (divide by
    /// `capacities` for the mean).
    pub tokens_per_s_sum: f64,
    /// Capacities at which this manager preempted more than vllm-paged
    /// (when vllm-paged ran).
    pub capacities_preempting_more_than_vllm: u64,
}

/// Each manager's totals over `points` (a capacity and its replays), in
/// the order the managers first appear.
pub fn totals(points: &[(u64, Vec<RunResult>)]) -> Vec<ManagerTotals> {
    let mut out: Vec<ManagerTotals> = Vec::new();
    for (_, results) in points {
        let vllm = results.iter().find(|r| r.name == "vllm-paged").map(|v| v.preemptions);
        for r in results {
            let i = match out.iter().position(|t| t.manager == r.name) {
                Some(i) => i,
                None => {
                    out.push(ManagerTotals { manager: r.name.clone(), ..ManagerTotals::default() });
                    out.len() - 1
                }
            };
            let t = &mut out[i];
            t.capacities += 1;
            t.preemptions += r.preemptions;
            t.fragmentation_failures += r.fragmentation_failures;
            t.bytes_copied += r.bytes_copied;
            t.rejected_requests += r.rejected_requests;
            t.completed_requests += r.completed_requests;
            t.integrity_errors += r.integrity_errors;
            t.tokens_per_s_sum += r.tokens_per_s;
            t.capacities_preempting_more_than_vllm += u64::from(vllm.is_some_and(|v| r.preemptions > v));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_range_includes_both_ends() {
        let g = 1u64 << 30;
        let c = parse_range("2.5GiB:4GiB:0.25GiB").unwrap();
        assert_eq!(c.len(), 7);
        assert_eq!((c[0], c[6]), (5 * g / 2, 4 * g));
        assert_eq!(parse_range("1GiB:1GiB:1MiB").unwrap(), vec![g]);
        // TO not on the grid: the last point below it.
        assert_eq!(parse_range("1GiB:2.9GiB:1GiB").unwrap(), vec![g, 2 * g]);
    }

    #[test]
    fn a_bad_range_is_refused() {
        for bad in ["1GiB:2GiB", "2GiB:1GiB:1MiB", "1GiB:2GiB:0", "0:1GiB:1MiB", "1GiB:100GiB:1MiB", "a:b:c"] {
            assert!(parse_range(bad).is_err(), "{bad}");
        }
    }

    fn run(name: &str, preemptions: u64, tokens_per_s: f64, copied: u64) -> RunResult {
        RunResult { name: name.into(), preemptions, tokens_per_s, bytes_copied: copied, ..RunResult::default() }
    }

    #[test]
    fn totals_sum_each_manager_over_the_capacities() {
        let points = vec![
            (1, vec![run("arena", 5, 100.0, 0), run("vllm-paged", 4, 110.0, 0)]),
            (2, vec![run("arena", 1, 200.0, 7), run("vllm-paged", 3, 190.0, 0)]),
        ];
        let t = totals(&points);
        assert_eq!(t.len(), 2);
        assert_eq!((t[0].manager.as_str(), t[0].capacities, t[0].preemptions), ("arena", 2, 6));
        assert_eq!((t[0].bytes_copied, t[0].capacities_preempting_more_than_vllm), (7, 1));
        assert!((t[0].tokens_per_s_sum - 300.0).abs() < 1e-9);
        assert_eq!(
            (t[1].manager.as_str(), t[1].preemptions, t[1].capacities_preempting_more_than_vllm),
            ("vllm-paged", 7, 0)
        );
    }
}
