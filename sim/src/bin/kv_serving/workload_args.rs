//! The options of a benchmark client's workload and of super-pages: a
//! closed-loop client of fixed concurrency, synthetic prompts of fixed
//! lengths with shared system prompts (`vmm_sim::fixed_workload`), and the
//! arena's chunk size.

use clap::Args;
use vmm_sim::fixed_workload::FixedWorkload;
use vmm_sim::replay::Arrivals;
use vmm_sim::trace::Trace;

#[derive(Args, Debug, Clone)]
pub struct WorkloadArgs {
    /// A closed-loop client of N concurrent requests (a benchmark client's
    /// --max-concurrency): a request joins when fewer than N are waiting or
    /// running, that is as soon as one finishes; trace times are ignored.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub closed_loop: Option<u64>,
    /// Synthetic requests of fixed lengths instead of a trace: IN:OUT
    /// tokens each (e.g. 1024:1024), --requests of them (default 5000).
    #[arg(long, value_name = "IN:OUT", value_parser = parse_lengths, conflicts_with = "trace")]
    pub fixed_lengths: Option<(u64, u64)>,
    /// With --fixed-lengths: every prompt opens with one of K shared system
    /// prompts of TOKENS tokens (default 512; a multiple of 512), drawn
    /// uniformly (seeded); the rest of each prompt is its own.
    #[arg(long, value_name = "K[:TOKENS]", value_parser = parse_shared, requires = "fixed_lengths")]
    pub shared_prompts: Option<(u64, u64)>,
    /// The arena's chunk size in MiB: 2 (the default), or a super-page
    /// (4, 8, 16, 20; any multiple of 2). Driver calls stay priced per
    /// 2 MiB they cover (see sim/src/timing.rs).
    #[arg(long, value_name = "MIB", default_value_t = 2, value_parser = parse_chunk_mib)]
    pub chunk_mib: u64,
}

/// Requests a `--fixed-lengths` workload has by default (the anchor's).
pub const DEFAULT_FIXED_REQUESTS: usize = 5000;

fn parse_lengths(s: &str) -> Result<(u64, u64), String> {
    let (a, b) = s.split_once(':').ok_or("expected IN:OUT, e.g. 1024:1024")?;
    let n = |x: &str| x.trim().parse::<u64>().map_err(|_| format!("{x:?} is not a token count"));
    match (n(a)?, n(b)?) {
        (0, _) | (_, 0) => Err("token counts must be positive".into()),
        v => Ok(v),
    }
}

fn parse_shared(s: &str) -> Result<(u64, u64), String> {
    let (k, t) = s.split_once(':').unwrap_or((s, "512"));
    let k = k.trim().parse::<u64>().map_err(|_| format!("{k:?} is not a count"))?;
    let t = t.trim().parse::<u64>().map_err(|_| format!("{t:?} is not a token count"))?;
    if k == 0 {
        return Err("at least one shared system prompt (leave the option out for unique prompts)".into());
    }
    Ok((k, t))
}

fn parse_chunk_mib(s: &str) -> Result<u64, String> {
    let m = s.trim().parse::<u64>().map_err(|_| format!("{s:?} is not a number of MiB"))?;
    if m == 0 || m % 2 != 0 || m > 1024 {
        return Err(format!("a chunk of {m} MiB: give a multiple of 2 MiB (CUDA's granularity) up to 1024"));
    }
    Ok(m)
}

impl WorkloadArgs {
    pub fn chunk_bytes(&self) -> u64 {
        self.chunk_mib << 20
    }

    pub fn arrivals(&self) -> Arrivals {
        match self.closed_loop {
            Some(c) => Arrivals::ClosedLoop { concurrency: c as usize },
            None => Arrivals::Trace,
        }
    }

    /// The fixed-length workload's requests, where one is asked for.
    pub fn fixed_trace(&self, requests: Option<usize>, seed: u64) -> Option<Result<Trace, String>> {
        let (prompt_tokens, output_tokens) = self.fixed_lengths?;
        let (shared_prompts, shared_tokens) = self.shared_prompts.unwrap_or((0, 0));
        let w = FixedWorkload {
            requests: requests.unwrap_or(DEFAULT_FIXED_REQUESTS),
            prompt_tokens,
            output_tokens,
            shared_prompts,
            shared_tokens,
            seed,
        };
        Some(w.trace())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_options_parse_and_refuse_what_they_should() {
        assert_eq!(parse_lengths("1024:1024"), Ok((1024, 1024)));
        assert!(parse_lengths("1024").is_err() && parse_lengths("0:5").is_err());
        assert_eq!(parse_shared("15"), Ok((15, 512)));
        assert_eq!(parse_shared("3:1024"), Ok((3, 1024)));
        assert!(parse_shared("0").is_err());
        assert_eq!(parse_chunk_mib("20"), Ok(20));
        assert!(parse_chunk_mib("3").is_err() && parse_chunk_mib("0").is_err());
    }
}
