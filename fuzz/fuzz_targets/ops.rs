//! Operation sequences against a model, on the in-memory driver with
//! injected driver failures: see fuzz/logic/ops.rs.
#![no_main]

#[path = "../logic/ops.rs"]
mod ops;

libfuzzer_sys::fuzz_target!(|data: &[u8]| ops::run(data));
