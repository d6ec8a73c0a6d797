//! The host side of the attention measurement that needs no GPU: where each
//! KV addressing puts a token's K and V (`HostLayout`, the kernel's `Kv`
//! argument and the buffers behind it), the CPU reference attention, the
//! split count, the PTX ISA a driver accepts, and the rule that marks a
//! timing invalid. Each mirrors `sim/gpu/attention.cu` and is unit-tested
//! here, so that what the GPU run relies on is checked on every machine.

/// Query heads, KV heads and head dim of one Llama-3-8B layer.
pub const HEADS: usize = 32;
pub const KV_HEADS: usize = 8;
pub const DIM: usize = 128;
/// Query heads per KV head (the kernel's `GROUP`).
pub const GROUP: usize = HEADS / KV_HEADS;
/// Keys per tile (the kernel's `TILE`): a block holds a multiple of it.
pub const TILE: usize = 16;
/// vLLM's block: 16 tokens.
pub const PAGED_BLOCK: usize = 16;
/// Layers of the model, for the layouts that hold every layer's KV together.
pub const LAYERS: usize = 32;
/// The layer the kernels read in those layouts.
pub const LAYER: usize = 2;
/// The arena's chunk, in bf16 elements (2 MiB).
pub const CHUNK_ELEMS: usize = (2 << 20) / 2;
/// One token's K (or V) of one layer, in elements.
pub const ROW: usize = KV_HEADS * DIM;

/// The kernel's `Kv` argument (`attention.cu`), field for field; pointers
/// are device addresses (0 on the host).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Kv {
    pub k: u64,
    pub v: u64,
    pub block_table: u64,
    pub req_base: u64,
    pub block_stride: i64,
    pub token_stride: i64,
    pub layer_offset: i64,
    pub v_offset: i64,
    pub batch_stride: i64,
    pub block_tokens: i32,
    pub max_blocks: i32,
}

/// The five addressings (the kernels of `attention.cu`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Dense,
    Paged,
    BlockInChunk,
    TokenMajor,
    PerLayer,
}

pub const MODES: [Mode; 5] = [Mode::Dense, Mode::Paged, Mode::BlockInChunk, Mode::TokenMajor, Mode::PerLayer];

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Dense => "dense",
            Mode::Paged => "paged",
            Mode::BlockInChunk => "block_in_chunk",
            Mode::TokenMajor => "token_major",
            Mode::PerLayer => "per_layer",
        }
    }
}

/// A deliberately wrong or slow kernel in place of `paged`, to show that the
/// measurement's checks reject it (`gpu_measure --kernel-variant`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Variant {
    /// The kernels as measured.
    None,
    /// `paged` reads the block table and scalar values for every key.
    Slow,
    /// `paged` leaves out each query's last key.
    Broken,
}

/// The kernel's name for `mode` under `variant`.
pub fn kernel_name(mode: Mode, variant: Variant) -> &'static str {
    match (mode, variant) {
        (Mode::Paged, Variant::Slow) => "attention_paged_slow",
        (Mode::Paged, Variant::Broken) => "attention_paged_broken",
        (Mode::Dense, _) => "attention_dense",
        (Mode::Paged, _) => "attention_paged",
        (Mode::BlockInChunk, _) => "attention_block_in_chunk",
        (Mode::TokenMajor, _) => "attention_token_major",
        (Mode::PerLayer, _) => "attention_per_layer",
    }
}

/// `batch` requests, a context of `context` tokens each, the last `queries`
/// of them queried (1: decode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shape {
    pub batch: usize,
    pub context: usize,
    pub queries: usize,
}

/// A tiny deterministic generator (xorshift) for data and permutations.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    pub fn unit(&mut self) -> f32 {
        (self.next() % 2001) as f32 / 1000.0 - 1.0
    }

    pub fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            v.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
        v
    }
}

pub fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

pub fn from_bf16(x: u16) -> f32 {
    f32::from_bits((x as u32) << 16)
}

/// One layout on the host: the `Kv` strides, the block table or request
/// bases, and (with data) the K and V buffers as the device will hold them.
/// `k_len`/`v_len` are the buffers' sizes in elements (`v_len` 0: V lives in
/// the K buffer).
pub struct HostLayout {
    pub kv: Kv,
    pub table: Vec<i32>,
    pub base: Vec<i64>,
    pub k_len: usize,
    pub v_len: usize,
    pub k: Vec<u16>,
    pub v: Vec<u16>,
}

/// Tokens of every layer that one chunk holds in the block-in-chunk layout.
pub fn block_in_chunk_tokens() -> usize {
    CHUNK_ELEMS / (LAYERS * 2 * ROW)
}

/// Lays out the dense `[batch][context][ROW]` K/V (`data`, or zeros to be
/// made on the device when `None`) in `mode`.
pub fn host_layout(mode: Mode, s: Shape, data: Option<(&[u16], &[u16])>, rng: &mut Rng) -> HostLayout {
    let at = |b: usize, t: usize| (b * s.context + t) * ROW;
    let mut kv = Kv { token_stride: ROW as i64, ..Kv::default() };
    let (mut table, mut base) = (Vec::new(), Vec::new());
    // Where token (b, t)'s K and V go, in element offsets of the K and V
    // buffers; filled per mode below and used to place `data`.
    let place: Box<dyn Fn(usize, usize) -> (usize, usize)>;
    let (k_len, v_len);
    match mode {
        Mode::Dense => {
            kv.batch_stride = (s.context * ROW) as i64;
            k_len = s.batch * s.context * ROW;
            v_len = k_len;
            place = Box::new(move |b, t| (at(b, t), at(b, t)));
        }
        Mode::Paged | Mode::BlockInChunk => {
            let bt = if mode == Mode::Paged { PAGED_BLOCK } else { block_in_chunk_tokens() };
            assert!(bt > 0 && bt % TILE == 0, "a block holds a whole number of tiles");
            let per = s.context.div_ceil(bt);
            // Blocks handed out in a shuffled order, as a pool does over time.
            table = rng.permutation(s.batch * per).into_iter().map(|x| x as i32).collect();
            kv.block_tokens = bt as i32;
            kv.max_blocks = per as i32;
            let t2 = table.clone();
            let blk = move |b: usize, t: usize| t2[b * per + t / bt] as usize;
            if mode == Mode::Paged {
                kv.block_stride = (bt * ROW) as i64;
                k_len = s.batch * per * bt * ROW;
                v_len = k_len;
                place = Box::new(move |b, t| {
                    let o = (blk(b, t) * bt + t % bt) * ROW;
                    (o, o)
                });
            } else {
                // A chunk: [layer][K|V][token][ROW]; this is layer LAYER.
                kv.block_stride = CHUNK_ELEMS as i64;
                kv.layer_offset = (LAYER * 2 * bt * ROW) as i64;
                kv.v_offset = (bt * ROW) as i64;
                k_len = s.batch * per * CHUNK_ELEMS;
                v_len = 0;
                let (lo, vo) = (kv.layer_offset as usize, kv.v_offset as usize);
                place = Box::new(move |b, t| {
                    let o = blk(b, t) * CHUNK_ELEMS + lo + (t % bt) * ROW;
                    (o, o + vo)
                });
            }
        }
        Mode::TokenMajor => {
            let token = LAYERS * 2 * ROW;
            let region = s.context * token;
            base = rng.permutation(s.batch).into_iter().map(|p| (p * region) as i64).collect();
            kv.token_stride = token as i64;
            kv.layer_offset = (LAYER * 2 * ROW) as i64;
            kv.v_offset = ROW as i64;
            k_len = s.batch * region;
            v_len = 0;
            let (b2, lo) = (base.clone(), kv.layer_offset as usize);
            place = Box::new(move |b, t| {
                let o = b2[b] as usize + lo + t * token;
                (o, o + ROW)
            });
        }
        Mode::PerLayer => {
            // Each request's K (and V) of this layer in an allocation of its
            // own, rounded to chunks, at shuffled places.
            let region = (s.context * ROW).div_ceil(CHUNK_ELEMS) * CHUNK_ELEMS;
            base = rng.permutation(s.batch).into_iter().map(|p| (p * region) as i64).collect();
            k_len = s.batch * region;
            v_len = k_len;
            let b2 = base.clone();
            place = Box::new(move |b, t| {
                let o = b2[b] as usize + t * ROW;
                (o, o)
            });
        }
    }
    let (mut k, mut v) = (Vec::new(), Vec::new());
    if let Some((kd, vd)) = data {
        k = vec![0u16; k_len];
        v = vec![0u16; v_len];
        for b in 0..s.batch {
            for t in 0..s.context {
                let (ko, vo) = place(b, t);
                k[ko..ko + ROW].copy_from_slice(&kd[at(b, t)..at(b, t) + ROW]);
                let vbuf = if v_len == 0 { &mut k } else { &mut v };
                vbuf[vo..vo + ROW].copy_from_slice(&vd[at(b, t)..at(b, t) + ROW]);
            }
        }
    }
    HostLayout { kv, table, base, k_len, v_len, k, v }
}

/// The kernel's `tile_base` for token `t` (its tile's base plus `t`'s place
/// in the tile), in elements of the K and V buffers: the address rule the
/// CUDA code follows, mirrored so the host layouts can be checked against it.
#[cfg(test)]
pub fn token_offsets(mode: Mode, l: &HostLayout, b: usize, t: usize) -> (usize, usize) {
    let kv = &l.kv;
    let t0 = t - t % TILE;
    let (ko, vo) = match mode {
        Mode::Dense => {
            let o = b as i64 * kv.batch_stride + t0 as i64 * kv.token_stride;
            (o, o)
        }
        Mode::Paged | Mode::BlockInChunk => {
            let bt = kv.block_tokens as usize;
            let block = l.table[b * kv.max_blocks as usize + t0 / bt] as i64;
            let off = block * kv.block_stride + (t0 % bt) as i64 * kv.token_stride;
            if mode == Mode::BlockInChunk {
                (off + kv.layer_offset, off + kv.layer_offset + kv.v_offset)
            } else {
                (off, off)
            }
        }
        Mode::TokenMajor => {
            let o = l.base[b] + kv.layer_offset + t0 as i64 * kv.token_stride;
            (o, o + kv.v_offset)
        }
        Mode::PerLayer => {
            let o = l.base[b] + t0 as i64 * kv.token_stride;
            (o, o)
        }
    };
    let inside = (t % TILE) as i64 * kv.token_stride;
    ((ko + inside) as usize, (vo + inside) as usize)
}

/// The CPU reference: softmax(q·K / sqrt(dim)) V per query head, causal,
/// over the dense `[batch][context][ROW]` K/V; q and the result are
/// `[batch][queries][HEADS][DIM]`.
pub fn reference(q: &[f32], k: &[u16], v: &[u16], s: Shape) -> Vec<f32> {
    let scale = 1.0 / (DIM as f32).sqrt();
    let mut out = vec![0f32; s.batch * s.queries * HEADS * DIM];
    for b in 0..s.batch {
        for qi in 0..s.queries {
            let keys = s.context - s.queries + qi + 1;
            for hh in 0..HEADS {
                let g = hh / GROUP;
                let qo = ((b * s.queries + qi) * HEADS + hh) * DIM;
                let kv_at = |t: usize| ((b * s.context + t) * KV_HEADS + g) * DIM;
                let scores: Vec<f32> =
                    (0..keys).map(|t| (0..DIM).map(|d| q[qo + d] * scale * from_bf16(k[kv_at(t) + d])).sum()).collect();
                let m = scores.iter().cloned().fold(f32::MIN, f32::max);
                let e: Vec<f32> = scores.iter().map(|x| (x - m).exp()).collect();
                let z: f32 = e.iter().sum();
                for d in 0..DIM {
                    out[qo + d] = (0..keys).map(|t| e[t] * from_bf16(v[kv_at(t) + d])).sum::<f32>() / z;
                }
            }
        }
    }
    out
}

/// The largest absolute difference between a kernel's output and the
/// reference, or why the output is rejected (NaN, or beyond `tolerance`).
pub fn verify(got: &[f32], want: &[f32], tolerance: f32) -> Result<f32, String> {
    if got.len() != want.len() {
        return Err(format!("{} outputs, {} expected", got.len(), want.len()));
    }
    let mut worst = 0f32;
    for (a, b) in got.iter().zip(want) {
        let d = (a - b).abs();
        if d.is_nan() {
            return Err("an output is NaN".into());
        }
        worst = worst.max(d);
    }
    if worst > tolerance {
        return Err(format!("output differs from the CPU reference by {worst:.2e} (tolerance {tolerance:.0e})"));
    }
    Ok(worst)
}

/// Splits of the keys across CTAs: enough CTAs for two waves of the
/// device's multiprocessors, while every warp of a CTA keeps at least one
/// 16-key tile per split.
pub fn splits(s: Shape, sms: usize, warps: usize) -> usize {
    let ctas = (s.batch * KV_HEADS * s.queries).max(1);
    let tiles = s.context.div_ceil(TILE);
    let want = (2 * sms).div_ceil(ctas);
    want.clamp(1, (tiles / warps).max(1))
}

/// The newest PTX ISA a driver of `version` (cuDriverGetVersion: 1000 *
/// major + 10 * minor) accepts, as (major, minor); None before CUDA 11.8,
/// the first with sm_90. From the PTX ISA's release notes: 7.8 came with
/// CUDA 11.8, 8.0 to 8.5 with 12.0 to 12.5 (12.6 kept 8.5), 8.7 with 12.8,
/// 8.8 with 12.9, 9.0 with 13.0.
pub fn max_ptx_isa(version: i32) -> Option<(u32, u32)> {
    let (major, minor) = (version / 1000, (version % 1000) / 10);
    Some(match (major, minor) {
        (13.., _) => (9, 0),
        (12, m @ 0..=5) => (8, m as u32),
        (12, 6) => (8, 5),
        (12, 7) => (8, 6),
        (12, 8) => (8, 7),
        (12, _) => (8, 8),
        (11, 8..) => (7, 8),
        _ => return None,
    })
}

/// The PTX's `.version` as (major, minor).
pub fn ptx_isa(ptx: &str) -> Option<(u32, u32)> {
    let line = ptx.lines().find(|l| l.trim_start().starts_with(".version"))?;
    let (a, b) = line.split_whitespace().nth(1)?.split_once('.')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// The PTX with its `.version` line set to `isa`. The kernels use nothing
/// newer than PTX 7.8 offers for sm_90, so an older ISA number is a faithful
/// declaration of the same code.
pub fn with_ptx_isa(ptx: &str, isa: (u32, u32)) -> String {
    let mut out = String::with_capacity(ptx.len());
    let mut done = false;
    for line in ptx.split_inclusive('\n') {
        if !done && line.trim_start().starts_with(".version") {
            out.push_str(&format!(".version {}.{}\n", isa.0, isa.1));
            done = true;
        } else {
            out.push_str(line);
        }
    }
    out
}

/// The ISAs to try loading, newest first: the PTX's own if the driver
/// takes it, else the driver's newest, then 8.0 and 7.8 (for a driver that
/// refuses what its version suggests).
pub fn ptx_isa_candidates(ptx: (u32, u32), driver: Option<(u32, u32)>) -> Vec<(u32, u32)> {
    let first = match driver {
        Some(d) if d < ptx => d,
        _ => ptx,
    };
    let mut v = vec![first];
    for fallback in [(8, 0), (7, 8)] {
        if fallback < first {
            v.push(fallback);
        }
    }
    v
}

/// Whether a layout's timing is valid: its achieved bandwidth is at least
/// `min_fraction` of the plain device copy's measured in the same run.
pub fn bandwidth_valid(kernel_bytes_per_s: f64, copy_bytes_per_s: f64, min_fraction: f64) -> bool {
    copy_bytes_per_s > 0.0 && kernel_bytes_per_s / copy_bytes_per_s >= min_fraction
}

/// Nearest-rank percentile of `v` (sorted here), for `p` in 0..=100.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    if s.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(s: Shape, rng: &mut Rng) -> (Vec<u16>, Vec<u16>) {
        let n = s.batch * s.context * ROW;
        ((0..n).map(|_| to_bf16(rng.unit())).collect(), (0..n).map(|_| to_bf16(rng.unit())).collect())
    }

    #[test]
    fn every_layout_puts_each_token_where_the_kernel_reads_it() {
        let s = Shape { batch: 3, context: 53, queries: 1 };
        let mut rng = Rng(11);
        let (k, v) = data(s, &mut rng);
        for mode in MODES {
            let l = host_layout(mode, s, Some((&k, &v)), &mut rng);
            assert_eq!(l.k.len(), l.k_len);
            let vbuf = if l.v_len == 0 { &l.k } else { &l.v };
            for b in 0..s.batch {
                for t in 0..s.context {
                    let (ko, vo) = token_offsets(mode, &l, b, t);
                    let at = (b * s.context + t) * ROW;
                    assert_eq!(&l.k[ko..ko + ROW], &k[at..at + ROW], "{mode:?} K of ({b}, {t})");
                    assert_eq!(&vbuf[vo..vo + ROW], &v[at..at + ROW], "{mode:?} V of ({b}, {t})");
                }
            }
        }
    }

    #[test]
    fn the_layouts_that_should_scatter_do() {
        // A layout that put every request in order would measure dense
        // addressing under another name.
        let s = Shape { batch: 8, context: 64, queries: 1 };
        for mode in [Mode::Paged, Mode::BlockInChunk, Mode::TokenMajor, Mode::PerLayer] {
            let l = host_layout(mode, s, None, &mut Rng(5));
            let firsts: Vec<usize> = (0..s.batch).map(|b| token_offsets(mode, &l, b, 0).0).collect();
            assert!(firsts.windows(2).any(|w| w[1] < w[0]), "{mode:?} keeps requests in order");
        }
    }

    #[test]
    fn a_chunk_holds_sixteen_tokens_of_every_layer_with_nothing_left() {
        assert_eq!(block_in_chunk_tokens(), 16);
        assert_eq!(block_in_chunk_tokens() * LAYERS * 2 * ROW, CHUNK_ELEMS);
    }

    #[test]
    fn the_reference_is_the_value_when_one_key_is_visible() {
        // One key: softmax is 1, the output is that key's V.
        let s = Shape { batch: 1, context: 1, queries: 1 };
        let mut rng = Rng(3);
        let (k, v) = data(s, &mut rng);
        let q: Vec<f32> = (0..HEADS * DIM).map(|_| rng.unit()).collect();
        let out = reference(&q, &k, &v, s);
        for h in 0..HEADS {
            for d in 0..DIM {
                assert_eq!(out[h * DIM + d], from_bf16(v[(h / GROUP) * DIM + d]));
            }
        }
    }

    #[test]
    fn verification_rejects_a_kernel_that_leaves_out_the_last_key() {
        // What `attention_paged_broken` computes, on the CPU: the reference
        // over one key fewer. The check must refuse it.
        let s = Shape { batch: 2, context: 37, queries: 1 };
        let mut rng = Rng(9);
        let (k, v) = data(s, &mut rng);
        let q: Vec<f32> = (0..s.batch * HEADS * DIM).map(|_| rng.unit()).collect();
        let want = reference(&q, &k, &v, s);
        let short = Shape { context: s.context - 1, ..s };
        let trim = |x: &[u16]| -> Vec<u16> {
            (0..s.batch).flat_map(|b| x[b * s.context * ROW..(b * s.context + short.context) * ROW].to_vec()).collect()
        };
        let broken = reference(&q, &trim(&k), &trim(&v), short);
        assert!(verify(&broken, &want, 2e-3).is_err());
        assert!(verify(&want, &want, 2e-3).is_ok());
        let mut nan = want.clone();
        nan[5] = f32::NAN;
        assert!(verify(&nan, &want, 2e-3).is_err());
    }

    #[test]
    fn splits_fill_two_waves_and_keep_every_warp_busy() {
        // 32 requests x 8 KV heads = 256 CTAs: two waves of 132 SMs (264) need 2 splits.
        assert_eq!(splits(Shape { batch: 32, context: 4096, queries: 1 }, 132, 4), 2);
        assert_eq!(splits(Shape { batch: 64, context: 4096, queries: 1 }, 132, 4), 1);
        // One request: 8 CTAs, 33 splits wanted; 4096 keys allow 64.
        assert_eq!(splits(Shape { batch: 1, context: 4096, queries: 1 }, 132, 4), 33);
        // A short context caps it: 64 keys are 4 tiles, one per warp.
        assert_eq!(splits(Shape { batch: 1, context: 64, queries: 1 }, 132, 4), 1);
    }

    #[test]
    fn ptx_isa_follows_the_driver() {
        assert_eq!(max_ptx_isa(12090), Some((8, 8)));
        assert_eq!(max_ptx_isa(12040), Some((8, 4)));
        assert_eq!(max_ptx_isa(12060), Some((8, 5)));
        assert_eq!(max_ptx_isa(11080), Some((7, 8)));
        assert_eq!(max_ptx_isa(11070), None);
        assert_eq!(max_ptx_isa(13000), Some((9, 0)));
        let ptx = "//\n.version 8.8\n.target sm_90\n.address_size 64\n";
        assert_eq!(ptx_isa(ptx), Some((8, 8)));
        let older = with_ptx_isa(ptx, (8, 4));
        assert_eq!(ptx_isa(&older), Some((8, 4)));
        assert_eq!(older.replace(".version 8.4", ".version 8.8"), ptx);
        assert_eq!(ptx_isa_candidates((8, 8), Some((8, 4))), vec![(8, 4), (8, 0), (7, 8)]);
        assert_eq!(ptx_isa_candidates((8, 8), Some((9, 0))), vec![(8, 8), (8, 0), (7, 8)]);
        assert_eq!(ptx_isa_candidates((8, 8), None), vec![(8, 8), (8, 0), (7, 8)]);
    }

    #[test]
    fn the_committed_ptx_targets_sm_90_and_names_every_kernel() {
        let ptx = include_str!("../../../gpu/attention.ptx");
        assert!(ptx.contains(".target sm_90"));
        assert!(ptx_isa(ptx).is_some());
        for mode in MODES {
            for variant in [Variant::None, Variant::Slow, Variant::Broken] {
                let name = kernel_name(mode, variant);
                assert!(ptx.contains(&format!(".entry {name}(")), "{name} missing from the PTX");
            }
        }
        assert!(ptx.contains(".entry attention_reduce("));
    }

    #[test]
    fn the_bandwidth_rule_marks_a_slow_kernel_invalid() {
        let copy = 4.0e12;
        assert!(bandwidth_valid(3.0e12, copy, 0.6));
        assert!(!bandwidth_valid(1.0e12, copy, 0.6));
        assert!(!bandwidth_valid(3.0e12, 0.0, 0.6));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50.0), 2.0);
    }
}
