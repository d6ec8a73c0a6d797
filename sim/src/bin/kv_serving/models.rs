//! The model presets kv_serving knows: KV bytes per token, layers,
//! context, parameters and attention shape, each from its model card.

pub struct Model {
    pub name: &'static str,
    pub kv_bytes_per_token: u64,
    pub layers: u32,
    pub context: u64,
    /// Parameters, for the step-time model's FLOPs and weight bytes.
    pub params: f64,
    /// Query heads, KV heads, head dimension (attention FLOPs).
    pub heads: u32,
    pub kv_heads: u32,
    pub head_dim: u32,
    /// Where the shape comes from.
    pub source: &'static str,
}

// KV bytes per token = 2 (K, V) x layers x KV heads x head dim x 2 bytes.
pub const MODELS: [Model; 3] = [
    Model {
        name: "llama2-7b",
        kv_bytes_per_token: 512 << 10,
        layers: 32,
        context: 4096,
        params: 6.7e9,
        heads: 32,
        kv_heads: 32,
        head_dim: 128,
        source: "meta-llama/Llama-2-7b-hf config.json: 32 layers, 32 heads, 32 KV heads, hidden 4096, context 4096",
    },
    Model {
        name: "llama3-8b",
        kv_bytes_per_token: 128 << 10,
        layers: 32,
        context: 131072,
        params: 8.0e9,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        source:
            "meta-llama/Meta-Llama-3.1-8B config.json: 32 layers, 32 heads, 8 KV heads, hidden 4096, context 131072",
    },
    Model {
        name: "llama3-70b",
        kv_bytes_per_token: 320 << 10,
        layers: 80,
        context: 131072,
        params: 70.6e9,
        heads: 64,
        kv_heads: 8,
        head_dim: 128,
        source:
            "meta-llama/Meta-Llama-3.1-70B config.json: 80 layers, 64 heads, 8 KV heads, hidden 8192, context 131072",
    },
];
