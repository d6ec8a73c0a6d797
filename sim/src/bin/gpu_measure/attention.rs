//! The attention efficiencies of the three KV layouts, measured: the kernels
//! of `sim/gpu/attention.cu` (one implementation, only the addressing
//! differs), loaded from the committed PTX with `cuModuleLoadData`, checked
//! against a CPU reference on small sizes, then timed with events on one
//! layer of Llama-3-8B-shaped attention (32 query heads, 8 KV heads, head dim
//! 128, bf16 K/V), a decode launch and a prefill-shaped one (a chunk of
//! queries at the end of its context, causal).
//!
//! Each layout's efficiency is the per-layer contiguous kernel's time over
//! its own (the same code reading a dense, uniformly strided layout): the
//! replay's `attn_eff_*` constants, with per-layer at 1 by definition.
#![allow(unsafe_code)]

use std::ffi::{c_void, CString};

use cudarc::driver::sys::{self, CUdeviceptr, CUresult};

const PTX: &str = include_str!("../../../gpu/attention.ptx");
const HEADS: i32 = 32;
const KV_HEADS: i32 = 8;
const DIM: usize = 128;
const BLOCK: usize = 16;
/// Layers of the token-major layout: a token's KV of every layer together.
const LAYERS: usize = 32;
const THREADS: u32 = 128;

type Res<T> = Result<T, String>;

fn ck(r: CUresult, what: &str) -> Res<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {r:?}"))
    }
}

/// The kernels' `Kv` argument (`attention.cu`), field for field.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct Kv {
    k: CUdeviceptr,
    v: CUdeviceptr,
    block_table: CUdeviceptr,
    req_base: CUdeviceptr,
    token_stride: i64,
    layer_offset: i64,
    batch_stride: i64,
    max_blocks: i32,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Paged,
    TokenMajor,
    PerLayer,
}

const MODES: [Mode; 3] = [Mode::Paged, Mode::TokenMajor, Mode::PerLayer];

impl Mode {
    fn kernel(self) -> &'static str {
        match self {
            Mode::Paged => "attention_paged",
            Mode::TokenMajor => "attention_token_major",
            Mode::PerLayer => "attention_per_layer",
        }
    }
}

/// Device memory freed on drop.
struct DevBuf(CUdeviceptr);

impl DevBuf {
    fn new(bytes: usize) -> Res<DevBuf> {
        let mut p: CUdeviceptr = 0;
        // SAFETY: an out-pointer to a local; a context is current (`Gpu::new`).
        ck(unsafe { sys::cuMemAlloc_v2(&mut p, bytes.max(1)) }, "cuMemAlloc")?;
        // SAFETY: `p` was just allocated with at least `bytes` bytes.
        ck(unsafe { sys::cuMemsetD8_v2(p, 0, bytes.max(1)) }, "cuMemsetD8")?;
        Ok(DevBuf(p))
    }

    fn from<T: Copy>(v: &[T]) -> Res<DevBuf> {
        let bytes = std::mem::size_of_val(v);
        let b = DevBuf::new(bytes)?;
        // SAFETY: `b` holds `bytes` bytes; the source slice is `bytes` long.
        ck(unsafe { sys::cuMemcpyHtoD_v2(b.0, v.as_ptr() as *const c_void, bytes) }, "cuMemcpyHtoD")?;
        Ok(b)
    }

    fn read_f32(&self, n: usize) -> Res<Vec<f32>> {
        let mut v = vec![0f32; n];
        // SAFETY: the buffer holds at least `n` floats (the caller's sizes);
        // the destination is `n` floats long.
        ck(unsafe { sys::cuMemcpyDtoH_v2(v.as_mut_ptr() as *mut c_void, self.0, n * 4) }, "cuMemcpyDtoH")?;
        Ok(v)
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc and freed once; an error is ignored
        // (Drop never panics).
        let _ = unsafe { sys::cuMemFree_v2(self.0) };
    }
}

/// The device's primary context, retained; released on drop (also while
/// a panic unwinds out of `Gpu::new`).
struct PrimaryCtx(sys::CUdevice);

impl Drop for PrimaryCtx {
    fn drop(&mut self) {
        // SAFETY: retained once in `Gpu::new`, released once here; errors
        // ignored (Drop never panics).
        let _ = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.0) };
    }
}

/// The device's primary context made current, and the module (dropped
/// before the context).
struct Gpu {
    module: sys::CUmodule,
    _ctx: PrimaryCtx,
}

impl Gpu {
    fn new(device: i32) -> Res<Gpu> {
        // SAFETY: only looks for the library (no call into it).
        if !unsafe { sys::is_culib_present() } {
            return Err("libcuda not found".into());
        }
        // SAFETY: plain driver calls with out-pointers to locals; the PTX is
        // a NUL-terminated string that outlives the call.
        unsafe {
            ck(sys::cuInit(0), "cuInit")?;
            let mut dev = 0;
            ck(sys::cuDeviceGet(&mut dev, device), "cuDeviceGet")?;
            let mut ctx = std::ptr::null_mut();
            ck(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
            let guard = PrimaryCtx(dev);
            ck(sys::cuCtxSetCurrent(ctx), "cuCtxSetCurrent")?;
            let image = CString::new(PTX).map_err(|e| e.to_string())?;
            let mut module = std::ptr::null_mut();
            ck(sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void), "cuModuleLoadData")?;
            Ok(Gpu { module, _ctx: guard })
        }
    }

    fn function(&self, name: &str) -> Res<sys::CUfunction> {
        let c = CString::new(name).map_err(|e| e.to_string())?;
        let mut f = std::ptr::null_mut();
        // SAFETY: the module is loaded; the name is NUL-terminated.
        ck(unsafe { sys::cuModuleGetFunction(&mut f, self.module, c.as_ptr()) }, "cuModuleGetFunction")?;
        Ok(f)
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        // SAFETY: loaded once in `new`; errors ignored in Drop.
        let _ = unsafe { sys::cuModuleUnload(self.module) };
    }
}

/// One problem: `batch` requests, a context of `context` tokens each, the
/// last `queries` of them queried (1: decode).
#[derive(Clone, Copy, Debug)]
struct Shape {
    batch: usize,
    context: usize,
    queries: usize,
}

/// A tiny deterministic generator (xorshift) for data and permutations.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn unit(&mut self) -> f32 {
        (self.next() % 2001) as f32 / 1000.0 - 1.0
    }

    fn permutation(&mut self, n: usize) -> Vec<usize> {
        let mut v: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            v.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
        v
    }
}

fn to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

fn from_bf16(x: u16) -> f32 {
    f32::from_bits((x as u32) << 16)
}

/// K/V of every (request, token, KV head) of one layer, as bf16 on the
/// host (`None`: zeros, for timing), laid out in `mode` on the device.
struct Layout {
    kv: Kv,
    _bufs: Vec<DevBuf>,
}

fn build(mode: Mode, s: Shape, data: Option<(&[u16], &[u16])>, rng: &mut Rng) -> Res<Layout> {
    let row = KV_HEADS as usize * DIM; // one token's K (or V) of one layer
    let at = |b: usize, t: usize| (b * s.context + t) * row;
    let mut kv = Kv::default();
    let mut bufs = Vec::new();
    match mode {
        Mode::PerLayer => {
            let n = s.batch * s.context * row;
            let (k, v) = match data {
                Some((k, v)) => (DevBuf::from(k)?, DevBuf::from(v)?),
                None => (DevBuf::new(n * 2)?, DevBuf::new(n * 2)?),
            };
            kv.k = k.0;
            kv.v = v.0;
            kv.batch_stride = (s.context * row) as i64;
            bufs.extend([k, v]);
        }
        Mode::Paged => {
            let per = s.context.div_ceil(BLOCK);
            let blocks = s.batch * per;
            // Blocks handed out in a shuffled order, as a pool does over time.
            let order = rng.permutation(blocks);
            let table: Vec<i32> = order.iter().map(|&x| x as i32).collect();
            let n = blocks * BLOCK * row;
            let (k, v) = match data {
                Some((kd, vd)) => {
                    let (mut kh, mut vh) = (vec![0u16; n], vec![0u16; n]);
                    for b in 0..s.batch {
                        for t in 0..s.context {
                            let dst = (table[b * per + t / BLOCK] as usize * BLOCK + t % BLOCK) * row;
                            kh[dst..dst + row].copy_from_slice(&kd[at(b, t)..at(b, t) + row]);
                            vh[dst..dst + row].copy_from_slice(&vd[at(b, t)..at(b, t) + row]);
                        }
                    }
                    (DevBuf::from(&kh)?, DevBuf::from(&vh)?)
                }
                None => (DevBuf::new(n * 2)?, DevBuf::new(n * 2)?),
            };
            let t = DevBuf::from(&table)?;
            kv.k = k.0;
            kv.v = v.0;
            kv.block_table = t.0;
            kv.max_blocks = per as i32;
            bufs.extend([k, v, t]);
        }
        Mode::TokenMajor => {
            // Each request's allocation holds every layer's K and V of each
            // token; requests sit at shuffled places in one buffer. This is
            // layer 2 of LAYERS.
            let token = LAYERS * 2 * row;
            let region = s.context * token;
            let place = rng.permutation(s.batch);
            let base: Vec<i64> = place.iter().map(|&p| (p * region) as i64).collect();
            let layer_offset = 2 * 2 * row;
            let n = s.batch * region;
            let buf = match data {
                Some((kd, vd)) => {
                    let mut h = vec![0u16; n];
                    for b in 0..s.batch {
                        for t in 0..s.context {
                            let dst = base[b] as usize + t * token + layer_offset;
                            h[dst..dst + row].copy_from_slice(&kd[at(b, t)..at(b, t) + row]);
                            h[dst + row..dst + 2 * row].copy_from_slice(&vd[at(b, t)..at(b, t) + row]);
                        }
                    }
                    DevBuf::from(&h)?
                }
                None => DevBuf::new(n * 2)?,
            };
            let bb = DevBuf::from(&base)?;
            kv.k = buf.0;
            kv.req_base = bb.0;
            kv.token_stride = token as i64;
            kv.layer_offset = layer_offset as i64;
            bufs.extend([buf, bb]);
        }
    }
    Ok(Layout { kv, _bufs: bufs })
}

/// Launches `f` over `s` once.
fn launch(f: sys::CUfunction, q: &DevBuf, out: &DevBuf, kv: &Kv, s: Shape) -> Res<()> {
    let (mut qp, mut op, mut kvv) = (q.0, out.0, *kv);
    let (mut h, mut kvh, mut ctx, mut nq) = (HEADS, KV_HEADS, s.context as i32, s.queries as i32);
    let mut scale = 1.0f32 / (DIM as f32).sqrt();
    let mut params: [*mut c_void; 8] = [
        &mut qp as *mut _ as *mut c_void,
        &mut op as *mut _ as *mut c_void,
        &mut kvv as *mut _ as *mut c_void,
        &mut h as *mut _ as *mut c_void,
        &mut kvh as *mut _ as *mut c_void,
        &mut ctx as *mut _ as *mut c_void,
        &mut nq as *mut _ as *mut c_void,
        &mut scale as *mut _ as *mut c_void,
    ];
    // SAFETY: the parameters match the kernel's signature in type and
    // order and live across the call (the driver copies them at launch);
    // the buffers hold what the shape addresses.
    ck(
        unsafe {
            sys::cuLaunchKernel(
                f,
                s.batch as u32,
                KV_HEADS as u32,
                s.queries as u32,
                THREADS,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        },
        "cuLaunchKernel",
    )
}

/// The CPU reference: softmax(q·K / sqrt(dim)) V per query head, causal.
fn reference(q: &[f32], k: &[u16], v: &[u16], s: Shape) -> Vec<f32> {
    let (h, kvh) = (HEADS as usize, KV_HEADS as usize);
    let group = h / kvh;
    let scale = 1.0 / (DIM as f32).sqrt();
    let mut out = vec![0f32; s.batch * s.queries * h * DIM];
    for b in 0..s.batch {
        for qi in 0..s.queries {
            let keys = s.context - s.queries + qi + 1;
            for hh in 0..h {
                let g = hh / group;
                let qo = ((b * s.queries + qi) * h + hh) * DIM;
                let kv_at = |t: usize| ((b * s.context + t) * kvh + g) * DIM;
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

/// Every layout's kernel against the CPU reference on a small problem.
fn check(gpu: &Gpu, s: Shape) -> Res<f32> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let row = KV_HEADS as usize * DIM;
    let n = s.batch * s.context * row;
    let k: Vec<u16> = (0..n).map(|_| to_bf16(rng.unit())).collect();
    let v: Vec<u16> = (0..n).map(|_| to_bf16(rng.unit())).collect();
    let nq = s.batch * s.queries * HEADS as usize * DIM;
    let q: Vec<f32> = (0..nq).map(|_| rng.unit()).collect();
    let want = reference(&q, &k, &v, s);
    let qd = DevBuf::from(&q)?;
    let mut worst = 0f32;
    for mode in MODES {
        let l = build(mode, s, Some((&k, &v)), &mut rng)?;
        let out = DevBuf::new(nq * 4)?;
        launch(gpu.function(mode.kernel())?, &qd, &out, &l.kv, s)?;
        // SAFETY: a context is current.
        ck(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")?;
        let got = out.read_f32(nq)?;
        let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        if err.is_nan() || err > 2e-3 {
            return Err(format!("{}: output differs from the CPU reference by {err} ({s:?})", mode.kernel()));
        }
        worst = worst.max(err);
    }
    Ok(worst)
}

/// Median seconds of one launch of each layout's kernel over `s`.
fn time(gpu: &Gpu, s: Shape, reps: usize) -> Res<[f64; 3]> {
    let mut rng = Rng(7);
    let nq = s.batch * s.queries * HEADS as usize * DIM;
    let q = DevBuf::new(nq * 4)?;
    let out = DevBuf::new(nq * 4)?;
    let mut res = [0.0; 3];
    for (i, mode) in MODES.iter().enumerate() {
        let l = build(*mode, s, None, &mut rng)?;
        let f = gpu.function(mode.kernel())?;
        let mut ms = Vec::new();
        for r in 0..reps + 2 {
            let (mut a, mut b) = (std::ptr::null_mut(), std::ptr::null_mut());
            // SAFETY: events created, recorded on the default stream around
            // one launch, waited for, read and destroyed here.
            unsafe {
                ck(sys::cuEventCreate(&mut a, 0), "cuEventCreate")?;
                ck(sys::cuEventCreate(&mut b, 0), "cuEventCreate")?;
                ck(sys::cuEventRecord(a, std::ptr::null_mut()), "cuEventRecord")?;
                launch(f, &q, &out, &l.kv, s)?;
                ck(sys::cuEventRecord(b, std::ptr::null_mut()), "cuEventRecord")?;
                ck(sys::cuEventSynchronize(b), "cuEventSynchronize")?;
                let mut t = 0f32;
                ck(sys::cuEventElapsedTime(&mut t, a, b), "cuEventElapsedTime")?;
                let _ = sys::cuEventDestroy_v2(a);
                let _ = sys::cuEventDestroy_v2(b);
                if r >= 2 {
                    ms.push(t as f64);
                }
            }
        }
        ms.sort_by(f64::total_cmp);
        res[i] = ms[ms.len() / 2] * 1e-3;
    }
    Ok(res)
}

/// What the measurement found.
pub struct Measured {
    /// Seconds per launch, paged / token-major / per-layer, decode and prefill.
    pub decode_s: [f64; 3],
    pub prefill_s: [f64; 3],
    pub decode: String,
    pub prefill: String,
    pub max_error: f32,
}

impl Measured {
    /// The `attn_eff_*` profile fields, with their sources.
    pub fn profile_fields(&self, device: &str) -> Vec<(String, serde_json::Value)> {
        let mut v = Vec::new();
        for (phase, t, shape) in [("decode", self.decode_s, &self.decode), ("prefill", self.prefill_s, &self.prefill)] {
            for (i, layout) in ["paged", "token_major", "per_layer"].iter().enumerate() {
                let src = format!(
                    "gpu_measure on {device}: sim/gpu/attention.cu, one layer, 32/8 heads, dim 128, bf16, {shape}; \
                     median launch of the per-layer contiguous kernel ({:.1} us) over this layout's ({:.1} us)",
                    t[2] * 1e6,
                    t[i] * 1e6
                );
                v.push((
                    format!("attn_eff_{phase}_{layout}"),
                    serde_json::json!({"value": t[2] / t[i], "source": src}),
                ));
            }
        }
        v
    }
}

/// Checks the kernels, then times them.
pub fn measure(device: i32, quick: bool) -> Res<Measured> {
    let gpu = Gpu::new(device)?;
    let mut max_error = check(&gpu, Shape { batch: 2, context: 37, queries: 1 })?;
    max_error = max_error.max(check(&gpu, Shape { batch: 2, context: 50, queries: 7 })?);
    let reps = if quick { 3 } else { 20 };
    let decode = if quick {
        Shape { batch: 4, context: 512, queries: 1 }
    } else {
        Shape { batch: 64, context: 4096, queries: 1 }
    };
    let prefill = if quick {
        Shape { batch: 1, context: 512, queries: 64 }
    } else {
        Shape { batch: 2, context: 4096, queries: 512 }
    };
    Ok(Measured {
        decode_s: time(&gpu, decode, reps)?,
        prefill_s: time(&gpu, prefill, reps)?,
        decode: format!("decode batch {} context {}", decode.batch, decode.context),
        prefill: format!(
            "prefill {} queries over context {} x batch {}",
            prefill.queries, prefill.context, prefill.batch
        ),
        max_error,
    })
}
