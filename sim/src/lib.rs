//! The KV-serving simulator over vmm-arena: LLM serving traffic replayed
//! through vmm-arena and through models of the allocators engines use
//! today, every step's time charged by a GPU step-time model. The programs
//! are in `src/bin/` (`kv_serving`, the main job, runs with
//! `cargo run --release -p vmm-sim`).
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
//! - [`trace`]: trace files and the synthetic trace; [`fixed_workload`]:
//!   fixed-length prompts with shared system prompts (a closed-loop
//!   benchmark client's workload);
//! - [`replay`]: the continuous-batching scheduler;
//! - [`timing`]: the step-time model (GPU profiles, driver costs; the
//!   `h100` profile in [`profile_h100`]), and
//!   [`step_charge`], the one way every replay charges a step's driver
//!   calls to its time;
//! - [`tp`]: tensor-parallel managers (`kv_serving --tp N`);
//! - [`scenario`]: the textbook fragmentation failure;
//! - [`util`]: sizes and a seeded RNG; [`cli_args`]: what the
//!   `multi_tenant` and `stress` command lines share.
//!
//! The other workloads, each the library half of a program in `src/bin/`:
//! [`multi_tenant`] (several models' KV caches in one arena),
//! [`multi_model`] (several models on one GPU, timed: static partitions,
//! kvcached, the arena), [`idle_footprint`] (what an idle instance holds
//! under prefix caching, kvcached beside the arena),
//! [`rlhf_cycle`] (sleep and wake between training and generation),
//! [`stress`] (threads racing every operation), and [`snapshot_svg`]
//! (an arena snapshot drawn as SVG).

pub mod arena_prefix_cache;
pub mod attention;
pub mod caching;
pub mod capacity_sweep;
pub mod cli_args;
pub mod counted;
pub mod fixed_workload;
pub mod idle_footprint;
pub mod managers;
pub mod multi_model;
pub mod multi_tenant;
pub mod prefix_cache;
pub mod prepared;
pub mod profile_h100;
pub mod replay;
pub mod rlhf_cycle;
pub mod scenario;
pub mod snapshot_svg;
pub mod step_calls;
pub mod step_charge;
pub mod stress;
pub mod sweep;
pub mod timing;
pub mod tp;
pub mod trace;
pub mod util;
