//! An inference tenant that sleeps while a trainer uses the memory, then
//! wakes at the same addresses (issue 14: sleep and wake).
//!
//! ```text
//! rlhf_cycle [--quick] [--cycles N] [--capacity BYTES] [--weights BYTES] [--tensors N]
//!            [--requests N] [--trainer-fraction F] [--bandwidth-gbps G] [--seed N] [--json PATH]
//! ```
//!
//! One arena on the host backend. The tenant holds weights (tag 1, many
//! tensors, each filled with a pattern of its own) and KV caches (tag 2,
//! growable allocations, one per request). Each cycle:
//! 1. serve: requests arrive, their KV grows token block by token block,
//!    some finish and free it; some are still in flight at the end;
//! 2. sleep tag 2 without backup (KV is discarded), then tag 1 with backup;
//! 3. the trainer allocates most of the capacity through the same arena,
//!    touches it, and frees it;
//! 4. wake everything; verify every weight byte (read through the arena)
//!    and that every KV allocation is readable again at its old address
//!    (its contents are unspecified);
//! 5. serve again (the in-flight requests keep growing).
//!
//! Per cycle it prints the memory given back (the fraction of what the
//! tenant held that the arena gave back to the driver; goal ≥ 99.9 %), the
//! backup and restore bytes with their time at an assumed host-copy
//! bandwidth (default 25 GB/s: PCIe Gen5 x16, effective; an assumption, not
//! a measurement: the host backend's copies are memcpy), the driver calls
//! sleep and wake made, and the same counts for a model of vLLM's sleep
//! level 1, which keeps one `cuMemCreate` per tensor: for the same tensors
//! it would make, per tensor, an unmap and a release at sleep and a create,
//! a map and an access call at wake (plus one copy each way per weight
//! tensor, as here).

use std::path::PathBuf;
use std::time::Instant;

use clap::Parser;
use serde::Serialize;
use vmm_arena::{Arena, ArenaConfig, Backend, Id, Stats, ALL_TAGS, SLEEP_BACKUP};

const MIB: u64 = 1 << 20;
const WEIGHTS: u32 = 1;
const KV: u32 = 2;

/// Everything a run needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub cycles: u32,
    pub capacity_bytes: u64,
    pub weights_bytes: u64,
    pub tensors: u32,
    pub requests: u32,
    /// Fraction of the capacity the trainer takes while the tenant sleeps.
    pub trainer_fraction: f64,
    /// Assumed host-copy bandwidth for the backup and restore times.
    pub bandwidth_gbps: f64,
    pub seed: u64,
}

impl Config {
    pub fn quick() -> Config {
        Config {
            cycles: 3,
            capacity_bytes: 256 * MIB,
            weights_bytes: 96 * MIB,
            tensors: 48,
            requests: 24,
            trainer_fraction: 0.9,
            bandwidth_gbps: 25.0,
            seed: 1,
        }
    }
}

impl Default for Config {
    fn default() -> Config {
        Config {
            cycles: 5,
            capacity_bytes: 2048 * MIB,
            weights_bytes: 768 * MIB,
            tensors: 291,
            requests: 64,
            ..Config::quick()
        }
    }
}

/// Driver calls of one sleep or wake.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Calls {
    pub creates: u64,
    pub releases: u64,
    pub maps: u64,
    pub unmaps: u64,
    pub access: u64,
    pub syncs: u64,
    /// Host copies (one per backed-up allocation).
    pub copies: u64,
}

impl Calls {
    fn between(a: &Stats, b: &Stats, copies: u64) -> Calls {
        Calls {
            creates: b.driver_creates - a.driver_creates,
            releases: b.driver_releases - a.driver_releases,
            maps: b.driver_maps - a.driver_maps,
            unmaps: b.driver_unmaps - a.driver_unmaps,
            access: b.driver_access_calls - a.driver_access_calls,
            syncs: b.driver_syncs - a.driver_syncs,
            copies,
        }
    }

    pub fn vmm(&self) -> u64 {
        self.creates + self.releases + self.maps + self.unmaps + self.access + self.syncs
    }
}

/// One cycle's figures.
#[derive(Clone, Debug, Serialize)]
pub struct Cycle {
    pub tenant_held_bytes: u64,
    pub given_back_bytes: u64,
    pub given_back_fraction: f64,
    pub kv_allocations_at_sleep: u64,
    pub backup_bytes: u64,
    pub restore_bytes: u64,
    /// At the assumed bandwidth.
    pub backup_ms: f64,
    pub restore_ms: f64,
    /// Measured on this host (memcpy and system calls).
    pub sleep_wall_ms: f64,
    pub wake_wall_ms: f64,
    pub trainer_bytes: u64,
    pub sleep_calls: Calls,
    pub wake_calls: Calls,
    pub vllm_sleep_calls: Calls,
    pub vllm_wake_calls: Calls,
    pub weight_bytes_verified: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub capacity_bytes: u64,
    pub chunk_bytes: u64,
    pub weight_tensors: u32,
    pub weights_bytes: u64,
    pub bandwidth_gbps: f64,
    pub cycles: Vec<Cycle>,
}

/// xorshift64*: a reproducible stream without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// The bytes of weight tensor `t`: a pattern of its own.
fn weight_bytes(t: usize, len: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(len as usize);
    let mut x = (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    while (v.len() as u64) < len {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len as usize);
    v
}

struct Request {
    id: Id,
    ptr: u64,
    size: u64,
    left: u32,
}

/// Serves a round: new requests arrive (a KV allocation each), every live
/// one grows by a block, finished ones free their KV. A request that finds
/// no memory is preempted (its KV freed), as a serving engine would.
fn serve(arena: &Arena, rng: &mut Rng, live: &mut Vec<Request>, arrivals: u32, block: u64) -> Result<(), String> {
    const MAX_BLOCKS: u64 = 8;
    let err = |what: &str, e: vmm_arena::Error| format!("serve: {what}: {e}");
    let oom = |e: &vmm_arena::Error| e.status() == vmm_arena::Status::OutOfMemory;
    for _ in 0..arrivals {
        let size = block * (1 + rng.below(3));
        let (id, ptr) = match arena.alloc_growable(size, MAX_BLOCKS * block) {
            Ok(x) => x,
            Err(e) if oom(&e) => continue,
            Err(e) => return Err(err("alloc KV", e)),
        };
        arena.set_tag(id, KV).map_err(|e| err("tag KV", e))?;
        live.push(Request { id, ptr, size, left: 2 + rng.below(6) as u32 });
    }
    for r in live.iter_mut() {
        let size = (r.size + block).min(MAX_BLOCKS * block);
        match arena.resize(r.id, size) {
            Ok(ptr) => (r.ptr, r.size) = (ptr, size),
            Err(e) if oom(&e) => r.left = 1, // preempted: freed below
            Err(e) => return Err(err("grow KV", e)),
        }
        arena.write(r.id, r.size - 8, &r.size.to_le_bytes()).map_err(|e| err("write KV", e))?;
        r.left = r.left.saturating_sub(1);
    }
    for r in live.iter().filter(|r| r.left == 0) {
        arena.free(r.id).map_err(|e| err("free KV", e))?;
    }
    live.retain(|r| r.left > 0);
    Ok(())
}

pub fn run(cfg: &Config) -> Result<Report, String> {
    let arena = Arena::new(ArenaConfig {
        backend: Backend::Host,
        capacity_bytes: cfg.capacity_bytes,
        reserve_bytes: cfg.capacity_bytes * 4,
        ..Default::default()
    })
    .map_err(|e| format!("cannot create the arena: {e}"))?;
    let c = arena.chunk_bytes();
    let mut rng = Rng(cfg.seed.max(1));
    // Weight tensors: sizes around the mean, each more than half a chunk
    // (the measured figures keep this shape; small ones would sleep with
    // their tag too, in slabs of that tag).
    let mean = (cfg.weights_bytes / cfg.tensors.max(1) as u64).max(c);
    let mut weights: Vec<(Id, u64, u64)> = Vec::new();
    for t in 0..cfg.tensors as usize {
        let size = (mean / 2 + rng.below(mean)).max(c / 2 + 1);
        let (id, ptr) = arena.alloc(size).map_err(|e| format!("weight tensor {t}: {e}"))?;
        arena.set_tag(id, WEIGHTS).map_err(|e| e.to_string())?;
        arena.write(id, 0, &weight_bytes(t, size)).map_err(|e| e.to_string())?;
        weights.push((id, ptr, size));
    }
    let weights_bytes: u64 = weights.iter().map(|w| w.2).sum();
    let block = c; // a KV block of one chunk: growth maps a chunk at a time
    let mut live: Vec<Request> = Vec::new();
    let rounds = 6;
    let mut cycles = Vec::new();
    let bw = cfg.bandwidth_gbps * 1e9;
    for cycle in 0..cfg.cycles {
        for _ in 0..rounds {
            serve(&arena, &mut rng, &mut live, cfg.requests.div_ceil(rounds), block)?;
        }
        // Sleep: KV discarded, weights backed up.
        let before = arena.stats().map_err(|e| e.to_string())?;
        let held = before.mapped_bytes + before.pooled_bytes;
        let t0 = Instant::now();
        arena.sleep(KV, 0).map_err(|e| format!("sleep KV: {e}"))?;
        arena.sleep(WEIGHTS, SLEEP_BACKUP).map_err(|e| format!("sleep weights: {e}"))?;
        let sleep_wall = t0.elapsed();
        let asleep = arena.stats().map_err(|e| e.to_string())?;
        let given_back = held - (asleep.mapped_bytes + asleep.pooled_bytes);
        let sleep_calls = Calls::between(&before, &asleep, weights.len() as u64);
        if asleep.backup_bytes != weights_bytes {
            return Err(format!("cycle {cycle}: backup of {} bytes, weights are {weights_bytes}", asleep.backup_bytes));
        }
        // The trainer: most of the capacity, through the same arena.
        let want = (cfg.capacity_bytes as f64 * cfg.trainer_fraction) as u64;
        let mut trainer = Vec::new();
        let mut got = 0;
        while got + 8 * c <= want {
            let size = c * (1 + rng.below(8));
            let (id, _) = arena.alloc(size).map_err(|e| format!("trainer alloc: {e}"))?;
            arena.write(id, size - 1, &[1]).map_err(|e| e.to_string())?;
            trainer.push(id);
            got += size;
        }
        for id in trainer {
            arena.free(id).map_err(|e| format!("trainer free: {e}"))?;
        }
        // Wake: every pointer the tenant kept is valid again.
        let pre_wake = arena.stats().map_err(|e| e.to_string())?;
        let t1 = Instant::now();
        arena.wake(ALL_TAGS).map_err(|e| format!("wake: {e}"))?;
        let wake_wall = t1.elapsed();
        let awake = arena.stats().map_err(|e| e.to_string())?;
        let wake_calls = Calls::between(&pre_wake, &awake, weights.len() as u64);
        let mut verified = 0;
        for (t, &(id, ptr, size)) in weights.iter().enumerate() {
            let info = arena.query(id).map_err(|e| e.to_string())?;
            if info.ptr != ptr || info.asleep {
                return Err(format!("cycle {cycle}: weight tensor {t} moved or still asleep"));
            }
            let mut buf = vec![0u8; size as usize];
            arena.read(id, 0, &mut buf).map_err(|e| e.to_string())?;
            if buf != weight_bytes(t, size) {
                return Err(format!("cycle {cycle}: weight tensor {t} lost its bytes"));
            }
            verified += size;
        }
        for r in &live {
            let info = arena.query(r.id).map_err(|e| e.to_string())?;
            let mut b = [0u8; 8];
            if info.ptr != r.ptr || info.asleep || arena.read(r.id, r.size - 8, &mut b).is_err() {
                return Err(format!("cycle {cycle}: a KV allocation is not back at its address"));
            }
        }
        // vLLM's sleep level 1: one cuMemCreate per tensor, the same tensors.
        let tensors = (weights.len() + live.len()) as u64;
        let w = weights.len() as u64;
        let vllm_sleep = Calls { unmaps: tensors, releases: tensors, syncs: 1, copies: w, ..Calls::default() };
        let vllm_wake = Calls { creates: tensors, maps: tensors, access: tensors, copies: w, ..Calls::default() };
        cycles.push(Cycle {
            tenant_held_bytes: held,
            given_back_bytes: given_back,
            given_back_fraction: given_back as f64 / held.max(1) as f64,
            kv_allocations_at_sleep: live.len() as u64,
            backup_bytes: asleep.backup_bytes,
            restore_bytes: asleep.backup_bytes,
            backup_ms: asleep.backup_bytes as f64 / bw * 1e3,
            restore_ms: asleep.backup_bytes as f64 / bw * 1e3,
            sleep_wall_ms: sleep_wall.as_secs_f64() * 1e3,
            wake_wall_ms: wake_wall.as_secs_f64() * 1e3,
            trainer_bytes: got,
            sleep_calls,
            wake_calls,
            vllm_sleep_calls: vllm_sleep,
            vllm_wake_calls: vllm_wake,
            weight_bytes_verified: verified,
        });
        // Serve again: the in-flight requests keep growing.
        serve(&arena, &mut rng, &mut live, 1, block)?;
    }
    Ok(Report {
        capacity_bytes: cfg.capacity_bytes,
        chunk_bytes: c,
        weight_tensors: cfg.tensors,
        weights_bytes,
        bandwidth_gbps: cfg.bandwidth_gbps,
        cycles,
    })
}

/// Bytes: `256MiB`, `1.5G`, `512k`, plain numbers.
fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|ch: char| ch.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.trim().parse().map_err(|_| format!("not a size: {s}"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kb" | "kib" => 1024.0,
        "m" | "mb" | "mib" => 1024.0 * 1024.0,
        "g" | "gb" | "gib" => 1024.0 * 1024.0 * 1024.0,
        u => return Err(format!("unknown unit {u} in {s}")),
    };
    Ok((n * mult) as u64)
}

/// The command line.
#[derive(Parser, Debug)]
#[command(name = "rlhf_cycle", about = "An inference tenant sleeps while a trainer uses the memory")]
pub struct Cli {
    /// A short run (under 20 s): 256 MiB, 96 MiB of weights in 48 tensors, 3 cycles.
    #[arg(long)]
    pub quick: bool,
    #[arg(long, value_name = "N")]
    pub cycles: Option<u32>,
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub capacity: Option<u64>,
    #[arg(long, value_name = "BYTES", value_parser = parse_bytes)]
    pub weights: Option<u64>,
    /// Weight tensors.
    #[arg(long, value_name = "N")]
    pub tensors: Option<u32>,
    /// Requests per cycle.
    #[arg(long, value_name = "N")]
    pub requests: Option<u32>,
    #[arg(long, value_name = "F")]
    pub trainer_fraction: Option<f64>,
    /// Assumed host-copy bandwidth (GB/s) for the backup and restore times.
    #[arg(long, value_name = "G")]
    pub bandwidth_gbps: Option<f64>,
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// Write the report as JSON here.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
}

impl Cli {
    pub fn config(&self) -> Result<Config, String> {
        let base = if self.quick { Config::quick() } else { Config::default() };
        let cfg = Config {
            cycles: self.cycles.unwrap_or(base.cycles),
            capacity_bytes: self.capacity.unwrap_or(base.capacity_bytes),
            weights_bytes: self.weights.unwrap_or(base.weights_bytes),
            tensors: self.tensors.unwrap_or(base.tensors),
            requests: self.requests.unwrap_or(base.requests),
            trainer_fraction: self.trainer_fraction.unwrap_or(base.trainer_fraction),
            bandwidth_gbps: self.bandwidth_gbps.unwrap_or(base.bandwidth_gbps),
            seed: self.seed.unwrap_or(base.seed),
        };
        if cfg.tensors == 0 || cfg.cycles == 0 {
            return Err("--tensors and --cycles must be at least 1".into());
        }
        if !(cfg.trainer_fraction > 0.0 && cfg.trainer_fraction <= 1.0) || cfg.bandwidth_gbps <= 0.0 {
            return Err("--trainer-fraction must be in (0, 1] and --bandwidth-gbps positive".into());
        }
        if cfg.weights_bytes * 2 > cfg.capacity_bytes {
            return Err("--weights must be at most half the capacity (the KV caches need room)".into());
        }
        Ok(cfg)
    }
}

fn print(r: &Report) {
    println!(
        "rlhf_cycle: {} MiB arena, {} weight tensors ({} MiB, tag 1, backed up), KV caches (tag 2, discarded); \
         copy times assume {} GB/s host<->device (PCIe Gen5 x16, effective: an assumption)",
        r.capacity_bytes / MIB,
        r.weight_tensors,
        r.weights_bytes / MIB,
        r.bandwidth_gbps
    );
    for (i, c) in r.cycles.iter().enumerate() {
        println!(
            "cycle {i}: gave back {:.3} % of {} MiB held ({} KV allocations in flight); trainer used {} MiB; \
             backup {} MiB ({:.1} ms), restore {} MiB ({:.1} ms); measured sleep {:.1} ms, wake {:.1} ms",
            c.given_back_fraction * 100.0,
            c.tenant_held_bytes / MIB,
            c.kv_allocations_at_sleep,
            c.trainer_bytes / MIB,
            c.backup_bytes / MIB,
            c.backup_ms,
            c.restore_bytes / MIB,
            c.restore_ms,
            c.sleep_wall_ms,
            c.wake_wall_ms
        );
        println!(
            "  driver calls: arena sleep {} + {} copies, wake {} + {} copies | vLLM level 1 model: sleep {} + {} copies, wake {} + {} copies",
            c.sleep_calls.vmm(),
            c.sleep_calls.copies,
            c.wake_calls.vmm(),
            c.wake_calls.copies,
            c.vllm_sleep_calls.vmm(),
            c.vllm_sleep_calls.copies,
            c.vllm_wake_calls.vmm(),
            c.vllm_wake_calls.copies
        );
        println!("  arena sleep {:?}\n  arena wake  {:?}", c.sleep_calls, c.wake_calls);
    }
}

/// The `rlhf_cycle` program (`src/bin/rlhf_cycle.rs`).
pub fn main() {
    let cli = Cli::parse();
    let cfg = match cli.config() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("rlhf_cycle: {e}");
            std::process::exit(2);
        }
    };
    let report = match run(&cfg) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("rlhf_cycle: {e}");
            std::process::exit(1);
        }
    };
    print(&report);
    if let Some(path) = &cli.json {
        let text = serde_json::to_string_pretty(&report).expect("the report serializes");
        if let Err(e) = std::fs::write(path, text) {
            eprintln!("rlhf_cycle: cannot write {}: {e}", path.display());
            std::process::exit(1);
        }
    }
    let worst = report.cycles.iter().map(|c| c.given_back_fraction).fold(1.0, f64::min);
    if worst < 0.999 {
        eprintln!("rlhf_cycle: gave back only {:.3} % in some cycle (goal: 99.9 %)", worst * 100.0);
        std::process::exit(1);
    }
}
