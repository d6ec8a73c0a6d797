//! The C ABI with arbitrary ids, sizes, flags, NULLs, struct sizes and
//! injected driver failures: see fuzz/logic/c_abi.rs.
#![no_main]

use vmm_arena_ffi as ffi;

#[path = "../logic/c_abi.rs"]
mod c_abi;

libfuzzer_sys::fuzz_target!(|data: &[u8]| c_abi::run_fuzzing(data));
