//! The decoder model file, made by model/make_decoder.py with the `onnx`
//! package (seeded random weights), and deterministic inputs for it.

use std::path::PathBuf;
use std::process::Command;
use std::sync::Mutex;

/// The decoder's sizes (see model/make_decoder.py).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelSpec {
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    pub ffn: usize,
}

impl Default for ModelSpec {
    fn default() -> Self {
        ModelSpec { layers: 2, d_model: 512, heads: 8, ffn: 2048 }
    }
}

static MAKING: Mutex<()> = Mutex::new(());

/// The model's path, written first if missing, under VMM_ORT_MODEL_DIR
/// (default: this crate's target/model). The Python (`crate::python`)
/// needs numpy and onnx.
pub fn ensure(spec: ModelSpec) -> Result<PathBuf, String> {
    let dir = std::env::var_os("VMM_ORT_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/model"));
    let name = format!("decoder-l{}-d{}-h{}-f{}.onnx", spec.layers, spec.d_model, spec.heads, spec.ffn);
    let path = dir.join(name);
    let _making = MAKING.lock().unwrap_or_else(|p| p.into_inner());
    if path.exists() {
        return Ok(path);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("model/make_decoder.py");
    let partial = path.with_extension(format!("onnx.{}.tmp", std::process::id()));
    let python = crate::python();
    let out = Command::new(&python)
        .arg(&script)
        .arg(&partial)
        .args(["--layers", &spec.layers.to_string()])
        .args(["--d-model", &spec.d_model.to_string()])
        .args(["--heads", &spec.heads.to_string()])
        .args(["--ffn", &spec.ffn.to_string()])
        .output()
        .map_err(|e| format!("running {python}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{python} {} failed (needs numpy and onnx): {}",
            script.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    // Renamed into place whole, so that another process never reads half a file.
    std::fs::rename(&partial, &path).map_err(|e| format!("renaming to {}: {e}", path.display()))?;
    Ok(path)
}

/// A deterministic input [1, seq, d_model] with values in [-1, 1).
pub fn input(seq: usize, d_model: usize, seed: u64) -> Vec<f32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (seq as u64) ^ 0xD1B5_4A32_D192_ED03;
    (0..seq * d_model)
        .map(|_| {
            // xorshift64*
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            let bits = state.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 40; // 24 bits
            bits as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}
