//! What attention costs in the step-time model: the model's attention
//! shape, the FLOPs of causal prefill (also a suffix over a cached prefix)
//! and of decode, and the KV layouts whose addressing changes how fast an
//! attention kernel reads the KV.
//!
//! FLOPs per (query token, key token) pair per layer: `QKᵀ` is
//! `2 × head_dim` per query head, `P·V` the same again, so
//! `4 × heads × head_dim` (grouped-query attention shares K/V heads but
//! not this work; the softmax is left out, it is O(1) per pair against
//! O(head_dim)). A prompt position `p` (0-based) attends causally to
//! `p + 1` keys; a decoding token at context `L` attends to `L` keys.

use serde::{Deserialize, Serialize};

/// The attention shape of a decoder model.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct AttentionShape {
    pub layers: u32,
    /// Query heads.
    pub heads: u32,
    /// Key/value heads (grouped-query attention: fewer than `heads`).
    pub kv_heads: u32,
    pub head_dim: u32,
}

impl AttentionShape {
    /// Llama-3-8B: 32 layers, 32 query heads, 8 KV heads, head dim 128
    /// (`config.json` of meta-llama/Meta-Llama-3-8B: num_hidden_layers 32,
    /// num_attention_heads 32, num_key_value_heads 8, hidden_size 4096).
    pub const LLAMA3_8B: AttentionShape = AttentionShape { layers: 32, heads: 32, kv_heads: 8, head_dim: 128 };

    /// FLOPs of one (query, key) pair over all layers.
    pub fn flops_per_pair(&self) -> f64 {
        4.0 * self.layers as f64 * self.heads as f64 * self.head_dim as f64
    }

    /// KV bytes of one token over all layers at `bytes_per_value` (K and V).
    pub fn kv_bytes_per_token(&self, bytes_per_value: u64) -> u64 {
        2 * self.layers as u64 * self.kv_heads as u64 * self.head_dim as u64 * bytes_per_value
    }
}

/// Causal (query, key) pairs when prompt positions `start..end` are
/// computed over a cached prefix of `start` tokens: position `p` attends
/// to `p + 1` keys, so `Σ_{p=start}^{end-1} (p + 1)`.
pub fn causal_pairs(start: u64, end: u64) -> u64 {
    if end <= start {
        return 0;
    }
    let tri = |n: u64| n * (n + 1) / 2;
    tri(end) - tri(start)
}

/// How a manager lays a request's KV out, as an attention kernel sees it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttnLayout {
    /// Each request's KV in one allocation, token after token, every layer
    /// of a token together (the arena rows, and the contiguous managers):
    /// one layer's K/V of consecutive tokens are a token's KV apart, so a
    /// 2 MiB page holds few tokens of any one layer.
    #[default]
    TokenMajor,
    /// One allocation per layer and per K/V (vAttention's layout): one
    /// layer's tokens are contiguous.
    PerLayer,
    /// vLLM's block pool: per layer, 16-token blocks through a block table.
    Paged,
}

impl AttnLayout {
    pub fn name(self) -> &'static str {
        match self {
            AttnLayout::TokenMajor => "token-major",
            AttnLayout::PerLayer => "per-layer",
            AttnLayout::Paged => "paged",
        }
    }
}

/// Wall time of work that costs `serial_s` on one thread when `threads`
/// threads issue it at once, by Amdahl's law with `parallel_fraction` of
/// it able to overlap: `serial × ((1 − f) + f / threads)`.
pub fn concurrent_s(serial_s: f64, threads: u32, parallel_fraction: f64) -> f64 {
    let n = threads.max(1) as f64;
    serial_s * ((1.0 - parallel_fraction) + parallel_fraction / n)
}

/// The parallel fraction for which `threads` threads are `speedup` times
/// faster than one (the inverse of [`concurrent_s`]).
pub fn parallel_fraction(speedup: f64, threads: u32) -> f64 {
    let n = threads as f64;
    (1.0 - 1.0 / speedup) / (1.0 - 1.0 / n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn causal_pairs_by_hand() {
        // Three prompt tokens: 1 + 2 + 3 keys.
        assert_eq!(causal_pairs(0, 3), 6);
        // The last two over a one-token cached prefix: 2 + 3.
        assert_eq!(causal_pairs(1, 3), 5);
        assert_eq!(causal_pairs(3, 3), 0);
        assert_eq!(causal_pairs(4, 3), 0);
        // A chunked prompt adds up to the whole.
        assert_eq!(causal_pairs(0, 100) + causal_pairs(100, 250), causal_pairs(0, 250));
    }

    #[test]
    fn llama3_8b_by_hand() {
        let m = AttentionShape::LLAMA3_8B;
        // 4 × 32 layers × 32 heads × 128 = 524,288 FLOPs a pair.
        assert_eq!(m.flops_per_pair(), 524_288.0);
        // 2 × 32 × 8 × 128 × 2 bytes = 128 KiB a token (the preset's figure).
        assert_eq!(m.kv_bytes_per_token(2), 128 << 10);
    }

    #[test]
    fn contention_reproduces_the_fitted_speedup() {
        let f = parallel_fraction(1.94, 4);
        assert!((f - 0.6460).abs() < 1e-3, "{f}");
        // 4 threads: 1/1.94 of the serial time; 1 thread: all of it.
        assert!((concurrent_s(1.0, 4, f) - 1.0 / 1.94).abs() < 1e-12);
        assert_eq!(concurrent_s(2.0, 1, f), 2.0);
        assert_eq!(concurrent_s(2.0, 0, f), 2.0);
    }
}
