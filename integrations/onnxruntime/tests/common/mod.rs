//! What the integration tests share: ONNX Runtime, the model files, and
//! the lock that runs one test of a binary at a time (ONNX Runtime's
//! environment is one per process, and it holds one registered allocator
//! per device).

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use vmm_arena_onnxruntime::model::{self, ModelSpec};
use vmm_arena_onnxruntime::{ArenaAllocator, ArenaStats, Ort};

static SERIAL: Mutex<()> = Mutex::new(());

/// Holds the process's ONNX Runtime environment for one test.
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub fn ort() -> &'static Ort {
    match Ort::global() {
        Ok(ort) => ort,
        Err(error) => panic!("loading ONNX Runtime (set VMM_ARENA_PYTHON to a python with onnxruntime): {error}"),
    }
}

pub fn model_file(spec: ModelSpec) -> PathBuf {
    model::ensure(spec).unwrap_or_else(|error| panic!("making the model {spec:?}: {error}"))
}

/// The index of the first element whose bits differ, or None when the
/// slices are bit-identical (lengths included).
pub fn first_difference(a: &[f32], b: &[f32]) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()));
    }
    a.iter().zip(b).position(|(x, y)| x.to_bits() != y.to_bits())
}

pub fn arena_stats(allocator: &ArenaAllocator) -> ArenaStats {
    allocator.arena_stats().unwrap_or_else(|error| panic!("vmm_arena_stats_get: {error}"))
}

/// A value of ONNX Runtime's GetStats key-value pairs, as a number.
pub fn stat(pairs: &[(String, String)], key: &str) -> i64 {
    let value = pairs
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v)
        .unwrap_or_else(|| panic!("no {key} in allocator stats {pairs:?}"));
    value.parse().unwrap_or_else(|_| panic!("{key}={value} is not a number"))
}

pub const MIB: u64 = 1 << 20;
