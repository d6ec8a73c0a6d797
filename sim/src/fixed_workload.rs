//! Synthetic requests of fixed input and output lengths, each prompt
//! optionally opening with one of a given number of shared system prompts:
//! the workload of a throughput benchmark client (`trtllm-bench`,
//! `vllm bench serve --dataset-name random`), replayed with a closed-loop
//! client of fixed concurrency (`replay::Arrivals::ClosedLoop`).
//!
//! Prompt contents are named by hash ids of [`HASH_BLOCK_TOKENS`] tokens,
//! as in a Mooncake trace, so that prefix caching (vLLM's and the arena's)
//! finds exactly what is shared:
//!
//! - the shared system prompt `k` (drawn uniformly per request, seeded)
//!   is its first `shared_tokens / 512` blocks, with ids of prompt `k`
//!   alone: every request opening with it names the same chain;
//! - every other full block of a prompt has an id of its request alone
//!   (unique prompts: all of them), so no cache finds it in another.
//!
//! Ids of shared blocks are below [`UNIQUE_ID_BASE`], those of unique
//! blocks at or above it.

use super::trace::{Request, Trace, HASH_BLOCK_TOKENS};
use super::util::Rng;

/// The first id of a request's own blocks.
pub const UNIQUE_ID_BASE: u64 = 1 << 40;

/// What the generator draws.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FixedWorkload {
    pub requests: usize,
    /// Tokens of every prompt (system prompt included) and of every output.
    pub prompt_tokens: u64,
    pub output_tokens: u64,
    /// Shared system prompts (0: every prompt unique), and the tokens of
    /// each (a multiple of 512, less than `prompt_tokens`).
    pub shared_prompts: u64,
    pub shared_tokens: u64,
    pub seed: u64,
}

impl FixedWorkload {
    /// The requests, all arriving at time 0 (a closed loop sends them).
    pub fn trace(&self) -> Result<Trace, String> {
        if self.requests == 0 || self.prompt_tokens == 0 || self.output_tokens == 0 {
            return Err("fixed lengths: requests, prompt and output tokens must be positive".into());
        }
        if self.shared_prompts > 0 {
            if self.shared_tokens == 0 || self.shared_tokens % HASH_BLOCK_TOKENS != 0 {
                return Err(format!(
                    "shared system prompts of {} tokens: the replay names prompt contents by blocks of {HASH_BLOCK_TOKENS} tokens; give a positive multiple",
                    self.shared_tokens
                ));
            }
            if self.shared_tokens >= self.prompt_tokens {
                return Err(format!(
                    "a shared system prompt of {} tokens leaves nothing of its own in a prompt of {}",
                    self.shared_tokens, self.prompt_tokens
                ));
            }
        }
        let blocks = self.prompt_tokens / HASH_BLOCK_TOKENS;
        let shared_blocks = if self.shared_prompts > 0 { self.shared_tokens / HASH_BLOCK_TOKENS } else { 0 };
        let mut rng = Rng::new(self.seed);
        let mut requests = Vec::with_capacity(self.requests);
        for i in 0..self.requests as u64 {
            let mut ids = Vec::with_capacity(blocks as usize);
            if shared_blocks > 0 {
                let k = rng.next_u64() % self.shared_prompts;
                ids.extend((0..shared_blocks).map(|b| k * shared_blocks + b));
            }
            ids.extend((shared_blocks..blocks).map(|b| UNIQUE_ID_BASE + i * blocks + b));
            requests.push(Request {
                arrival_s: 0.0,
                prompt: self.prompt_tokens,
                output: self.output_tokens,
                hash_ids: ids.into(),
            });
        }
        let prompts = match self.shared_prompts {
            0 => "unique prompts".to_string(),
            k => format!("{k} shared system prompts of {} tokens", self.shared_tokens),
        };
        Ok(Trace {
            name: format!(
                "fixed {}/{} tokens, {prompts} (seed={}, n={})",
                self.prompt_tokens, self.output_tokens, self.seed, self.requests
            ),
            requests,
        })
    }
}
