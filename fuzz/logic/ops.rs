//! Fuzz target logic: operation sequences against the model.
//!
//! The input bytes decode (see [`decode`]) into an arena configuration and
//! a sequence of every public operation, some of them with a driver failure
//! injected (the `n`th driver call of the operation fails with out of memory
//! or a driver error). The arena runs on the in-memory `MockDriver` under a
//! `FaultDriver`, and after every operation the model shared with the
//! core's property test (`tests/common/harness/`, whose `mod.rs` lists its
//! checks) judges it. At the end everything is freed and trimmed: the driver holds
//! nothing.
//!
//! This file is the body of the cargo-fuzz target `fuzz/fuzz_targets/ops.rs`
//! and of the stable replay test `tests/fuzz_replay.rs` (both include it
//! with `#[path]`), so the committed corpus runs in `cargo test`.
//!
//! The input format: the selector byte of an operation picks it modulo the
//! number of operations, except the values 0xF8..=0xFF, which select
//! `alloc_shared`, 0xF0..=0xF7, which select `resize_on_stream`,
//! 0xE8..=0xEB, which select `quiesce_on_stream`, 0xEC..=0xEF, which
//! select `unquiesce`, 0xE4..=0xE7, which select `resize_many` (of 1 to 4
//! allocations: the low bits), and 0xE0..=0xE3, which select `maintain`
//! with prefetch targets (see `harness/maintain.rs`: the stats are read
//! inside its driver calls) (each added later: inputs made before decode
//! as they did, but where such a byte selects an operation).
//!
//! An input whose first byte is [`DMABUF_INPUT`] runs the DMA-BUF model
//! instead (`tests/common/dmabuf_harness.rs`, shared with
//! `tests/dmabuf_model.rs`): on the host backend's DMA-BUF stand-in under
//! the fault injector, DMA-BUF handles opened, written through and closed
//! among allocations, frees, resizes, prepared resizes and frees, sleeps,
//! wakes, compactions, trims and releases of retired memory, any of them
//! with an injected driver failure ([`decode_dmabuf`]). Miri skips those
//! inputs (the host backend's memfd and mmap calls are foreign to it).

use std::collections::BTreeMap;
use std::sync::Mutex;

use vmm_arena::driver::fault::FaultKind;

#[path = "bytes.rs"]
mod bytes;
#[path = "../../tests/common/mod.rs"]
mod common;
#[path = "../../tests/common/dmabuf_harness.rs"]
mod dmabuf_harness;
#[path = "../../tests/common/harness/mod.rs"]
mod harness;

use bytes::Bytes;
use dmabuf_harness::{DmaHarness, DmaOp};
use harness::{Backend, Harness};
pub use harness::{Config, Op};

const C: u64 = 64 << 10;
/// The largest small allocation with 64 KiB chunks (half a chunk).
const SMALL_MAX: u64 = C / 2;
/// Operations per input at most (longer inputs are cut).
pub const MAX_OPS: usize = 96;

/// Outcome counters, for the replay test's report of what the corpus reaches.
#[allow(dead_code)] // read by the replay test, not by the fuzz target
pub static OUTCOMES: &Mutex<BTreeMap<&'static str, u64>> = &harness::OUTCOMES;

/// A size of 1..=`max_pages` chunks, not chunk-aligned in general.
fn size(b: &mut Bytes<'_>, max_pages: u64) -> u64 {
    let p = 1 + b.below(max_pages);
    let tail = if b.below(4) == 0 { C } else { 1 + b.below(C) };
    (p - 1) * C + tail
}

fn op(b: &mut Bytes<'_>, faults: bool) -> Op {
    // `below(45)` and `below(41)` read one byte, modulo: the same byte read
    // here, with 0xF8..=0xFF taken for alloc_shared, 0xF0..=0xF7 for
    // resize_on_stream, 0xE8..=0xEB for quiesce_on_stream, 0xEC..=0xEF
    // for unquiesce, 0xE4..=0xE7 for resize_many, 0xE0..=0xE3 for
    // maintain and 0xDC..=0xDF for two-phase operations.
    let sel = b.u8();
    if sel >= 0xF8 {
        let (src, first, pages, extra) = (b.u16() as usize, b.below(8), b.below(8), b.below(7));
        return Op::AllocShared { src, first, pages, extra };
    }
    if sel >= 0xF0 {
        // The low bits: the stream.
        let i = b.u16() as usize;
        let s = if b.below(4) == 0 { 1 + b.below(SMALL_MAX) } else { size(b, 16) };
        return Op::ResizeOnStream(i, s, (sel & 7) as u64);
    }
    if sel >= 0xEC {
        return Op::Unquiesce(b.u16() as usize);
    }
    if sel >= 0xE8 {
        // The low bits: the stream.
        return Op::Quiesce(b.u16() as usize, (sel & 3) as u64);
    }
    if sel >= 0xE4 {
        // The low bits: how many requests, less one.
        let picks = (0..=(sel & 3))
            .map(|_| {
                let i = b.u16() as usize;
                let s = if b.below(3) == 0 { 1 + b.below(SMALL_MAX) } else { size(b, 16) };
                (i, s)
            })
            .collect();
        return Op::ResizeMany(picks);
    }
    if sel >= 0xDC {
        // The low bits: which two-phase call.
        return match sel & 3 {
            0 => {
                let s = size(b, 6);
                let growable = b.bool();
                let max = if growable || b.below(8) == 0 { s + b.below(7) * C } else { s };
                Op::PrepareAlloc(s, max, growable)
            }
            1 => Op::PrepareResize(b.u16() as usize, size(b, 12)),
            2 => Op::PrepareFree(b.u16() as usize),
            _ => Op::Settle(b.u16() as usize, b.bool()),
        };
    }
    if sel >= 0xE0 {
        // The low bits: the map-ahead target; then the precreate target.
        return Op::Maintain { precreate: b.below(4), ahead: (sel & 3) as u64 };
    }
    match sel as u64 % if faults { 45 } else { 41 } {
        0..=5 => Op::Alloc(size(b, 8)),
        6..=9 => Op::Alloc(1 + b.below(SMALL_MAX)),
        10 => Op::Alloc(size(b, 40)),
        11..=14 => {
            let s = size(b, 6);
            Op::AllocGrowable(s, s + b.below(13) * C)
        }
        15..=19 => Op::Free(b.u16() as usize),
        20..=25 => Op::Resize(b.u16() as usize, size(b, 16)),
        26..=28 => Op::Resize(b.u16() as usize, 1 + b.below(SMALL_MAX)),
        29 => Op::Resize(b.u16() as usize, size(b, 40)),
        30 => Op::Pin(b.u16() as usize),
        31 => Op::Unpin(b.u16() as usize),
        32 => Op::Compact,
        33 => Op::ReleaseRetired,
        34 => Op::Trim(b.below(8)),
        35 => match b.below(3) {
            0 => Op::BadId(b.u64()),
            _ => Op::Write(b.u16() as usize),
        },
        36 | 37 => Op::SetTag(b.u16() as usize, b.below(3) as u32),
        38 => Op::Sleep(b.below(4) as u32, b.bool()),
        39 | 40 => Op::Wake(b.below(4) as u32),
        _ => {
            let n = 1 + b.below(12);
            let kind = FaultKind::ALL[b.below(2) as usize];
            Op::Faulty(n, kind, Box::new(op(b, false)))
        }
    }
}

/// Decodes an input: a configuration, then operations until the bytes run out.
pub fn decode(data: &[u8]) -> (Config, Vec<Op>) {
    let mut b = Bytes::new(data);
    let cap = 4 + b.below(45);
    let lo = (cap * 3 / 4).max(1);
    let reserve = if b.below(4) == 0 { cap * 2 } else { lo + b.below(cap * 2 - lo + 1) };
    let retain = [None, Some(0), Some(1), Some(4)][b.below(4) as usize];
    let nim = b.below(5) == 0;
    let cfg = Config { cap_pages: cap, reserve_pages: reserve, retain_pages: retain, no_implicit_moves: nim };
    let mut ops = Vec::new();
    while !b.is_empty() && ops.len() < MAX_OPS {
        ops.push(op(&mut b, true));
    }
    (cfg, ops)
}

/// The first byte of an input for the DMA-BUF model.
pub const DMABUF_INPUT: u8 = 0xDB;

fn dma_op(b: &mut Bytes<'_>, faults: bool) -> DmaOp {
    const DC: u64 = dmabuf_harness::C;
    let pages = |b: &mut Bytes<'_>| (1 + b.below(6)) * DC;
    match b.u8() % if faults { 22 } else { 20 } {
        0..=2 => DmaOp::Alloc((1 + b.below(4)) * DC),
        3 => DmaOp::AllocSmall(1 + b.below(DC / 2 - 1)),
        4 | 5 => {
            let p = 1 + b.below(3);
            DmaOp::AllocGrowable(p * DC, (p + b.below(5)) * DC)
        }
        6 | 7 => DmaOp::Free(b.u16() as usize),
        8 | 9 => DmaOp::Resize(b.u16() as usize, pages(b)),
        10 | 11 => DmaOp::Open(b.u16() as usize),
        12 => DmaOp::Close(b.u16() as usize),
        13 => DmaOp::WriteThrough(b.u16() as usize, b.u8()),
        14 => DmaOp::Stamp(b.u16() as usize, b.u8()),
        15 => DmaOp::Sleep(b.bool()),
        16 => DmaOp::Wake,
        17 => [DmaOp::Compact, DmaOp::Trim, DmaOp::ReleaseRetired][b.below(3) as usize].clone(),
        18 => DmaOp::PrepareResize(b.u16() as usize, pages(b), b.bool()),
        19 => DmaOp::PrepareFree(b.u16() as usize, b.bool()),
        _ => {
            let n = 1 + b.below(8);
            let kind = FaultKind::ALL[b.below(2) as usize];
            DmaOp::Faulty(n, kind, Box::new(dma_op(b, false)))
        }
    }
}

/// Decodes a DMA-BUF input (after its first byte): the arena's capacity,
/// reservation and watermark in chunks, then operations until the bytes
/// run out.
pub fn decode_dmabuf(data: &[u8]) -> ((u64, u64, u64), Vec<DmaOp>) {
    let mut b = Bytes::new(data);
    let cap = 6 + b.below(27);
    let reserve = cap + b.below(2 * cap);
    let retain = b.below(6);
    let mut ops = Vec::new();
    while !b.is_empty() && ops.len() < MAX_OPS {
        ops.push(dma_op(&mut b, true));
    }
    ((cap, reserve, retain), ops)
}

/// Runs one input: the fuzz target's whole body.
#[allow(dead_code)] // the replay test uses `run_limited`
pub fn run(data: &[u8]) {
    run_limited(data, MAX_OPS)
}

/// Runs the first `max_ops` operations of an input (Miri, ~1000 times
/// slower than native, replays the corpus this way).
pub fn run_limited(data: &[u8], max_ops: usize) {
    if let Some((&DMABUF_INPUT, rest)) = data.split_first() {
        if !cfg!(miri) {
            run_dmabuf(rest, max_ops);
        }
        return;
    }
    let (cfg, mut ops) = decode(data);
    ops.truncate(max_ops);
    // VMM_ARENA_FUZZ_DEBUG=1: print what the input decodes to (to study a crash).
    let debug = std::env::var_os("VMM_ARENA_FUZZ_DEBUG").is_some();
    if debug {
        eprintln!("{cfg:?}");
    }
    let mut h = Harness::new(Backend::Mock, C, cfg, None);
    for op in &ops {
        if debug {
            eprintln!("{op:?}");
        }
        h.apply(op);
    }
    h.teardown();
}

/// Runs a DMA-BUF input (see the module docs).
fn run_dmabuf(data: &[u8], max_ops: usize) {
    let ((cap, reserve, retain), mut ops) = decode_dmabuf(data);
    ops.truncate(max_ops);
    let debug = std::env::var_os("VMM_ARENA_FUZZ_DEBUG").is_some();
    if debug {
        eprintln!("DMA-BUF model: capacity {cap}, reserve {reserve}, retain {retain} chunks");
    }
    let mut h = DmaHarness::new(cap, reserve, retain);
    for op in &ops {
        if debug {
            eprintln!("{op:?}");
        }
        h.apply(op);
    }
    let mut outcomes = OUTCOMES.lock().unwrap_or_else(|p| p.into_inner());
    for (what, n) in &h.reached {
        *outcomes.entry(what).or_default() += n;
    }
    drop(outcomes);
    h.teardown();
}
