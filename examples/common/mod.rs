//! Workload code shared by the examples (`kv_serving`, `fragmentation`) and
//! by `tests/workloads.rs`, included with `#[path]`.
//!
//! - [`counted`]: the driver wrapper that counts every manager's calls and
//!   models the device's capacity;
//! - [`caching`]: a model of PyTorch's CUDA caching allocator (native and
//!   expandable segments);
//! - [`managers`]: KV-cache managers (vmm-arena and the baselines);
//! - [`prefix_cache`]: the arena manager's prefix cache (hash chains, LRU
//!   eviction, entries sharing chunks), and [`arena_prefix_cache`], those
//!   books driven on an arena;
//! - [`prepared`]: admissions prepared between steps (the arena manager's
//!   asynchronous scheduling);
//! - [`trace`]: trace files and the synthetic trace;
//! - [`replay`]: the continuous-batching scheduler;
//! - [`timing`]: the step-time model (GPU profiles, driver costs);
//! - [`tp`]: tensor-parallel managers (`kv_serving --tp N`);
//! - [`scenario`]: the textbook fragmentation failure;
//! - [`util`]: sizes and a seeded RNG.
#![allow(dead_code)]

pub mod arena_prefix_cache;
pub mod caching;
pub mod counted;
pub mod managers;
pub mod prefix_cache;
pub mod prepared;
pub mod replay;
pub mod scenario;
pub mod timing;
pub mod tp;
pub mod trace;
pub mod util;
