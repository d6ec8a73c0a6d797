//! The attention efficiencies of the KV layouts, measured with a kernel that
//! stands for the real decode kernels: `sim/gpu/attention.cu` (split-KV,
//! 16-byte loads, the block table read once a tile; one implementation, only
//! the addressing differs), loaded from the committed PTX, checked against a
//! CPU reference, then timed on one layer of Llama-3-8B-shaped decode
//! attention (32 query heads, 8 KV heads, head dim 128, bf16 K/V).
//!
//! The rules that keep the figures honest:
//! - every kernel is verified before it is timed; a kernel that fails to
//!   load or verify is an error ([`AttnError::Failed`]), and no `attn_eff_*`
//!   is written;
//! - each layout's achieved bandwidth is compared with a plain device copy
//!   measured in the same run; below `min_fraction` of it the layout's result
//!   is marked invalid and its efficiency is not written;
//! - the clocks are warmed until a batch of launches times within 2 % of the
//!   one before, then the layouts are timed interleaved (one launch of each
//!   in turn, the order rotated every round), median and spread reported.
//!
//! Efficiency = the dense kernel's median time over the layout's. Only the
//! decode launch is measured: it is memory-bound, so the copy comparison
//! judges it; a prefill kernel is compute-bound and this one does not tile
//! queries as FlashAttention's prefill does, so the profile keeps its
//! assumed prefill efficiencies.
#![allow(unsafe_code)]

use std::ffi::{c_void, CString};

use cudarc::driver::sys::{self, CUdeviceptr, CUresult};

use crate::attention_layout::{
    bandwidth_valid, host_layout, kernel_name, max_ptx_isa, percentile, ptx_isa, ptx_isa_candidates, reference, splits,
    to_bf16, verify, with_ptx_isa, Kv, Mode, Rng, Shape, Variant, DIM, HEADS, KV_HEADS, MODES, ROW,
};

const PTX: &str = include_str!("../../../gpu/attention.ptx");
const WARPS: usize = 4;
const THREADS: u32 = (WARPS * 32) as u32;
const TOLERANCE: f32 = 2e-3;

/// Why the kernels were not measured.
pub enum AttnError {
    /// This driver cannot load modules at all (the libcuda stand-in answers
    /// NOT_SUPPORTED): nothing to measure here.
    NoModules(String),
    /// A kernel failed to load, launch or verify on a real driver.
    Failed(String),
}

type Res<T> = Result<T, AttnError>;

fn ck(r: CUresult, what: &str) -> Res<()> {
    if r == CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(AttnError::Failed(format!("{what}: {r:?}")))
    }
}

/// Device memory freed on drop.
struct DevBuf(CUdeviceptr);

impl DevBuf {
    fn new(bytes: usize) -> Res<DevBuf> {
        let mut p: CUdeviceptr = 0;
        // SAFETY: an out-pointer to a local; a context is current (`Gpu::new`).
        ck(unsafe { sys::cuMemAlloc_v2(&mut p, bytes.max(1)) }, "cuMemAlloc")?;
        let b = DevBuf(p);
        // SAFETY: `p` was just allocated with at least `bytes` bytes.
        ck(unsafe { sys::cuMemsetD8_v2(p, 0, bytes.max(1)) }, "cuMemsetD8")?;
        Ok(b)
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

/// The device's primary context, retained; released on drop.
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
    sms: usize,
    /// The PTX ISA the module was loaded with.
    isa: (u32, u32),
    _ctx: PrimaryCtx,
}

impl Gpu {
    fn new(device: i32) -> Res<Gpu> {
        // SAFETY: only looks for the library (no call into it).
        if !unsafe { sys::is_culib_present() } {
            return Err(AttnError::NoModules("libcuda not found".into()));
        }
        // SAFETY: plain driver calls with out-pointers to locals.
        let (dev, ctx, driver, sms) = unsafe {
            ck(sys::cuInit(0), "cuInit")?;
            let mut dev = 0;
            ck(sys::cuDeviceGet(&mut dev, device), "cuDeviceGet")?;
            let mut ctx = std::ptr::null_mut();
            ck(sys::cuDevicePrimaryCtxRetain(&mut ctx, dev), "cuDevicePrimaryCtxRetain")?;
            let mut driver = 0;
            ck(sys::cuDriverGetVersion(&mut driver), "cuDriverGetVersion")?;
            let mut sms = 0;
            let attr = sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT;
            ck(sys::cuDeviceGetAttribute(&mut sms, attr, dev), "cuDeviceGetAttribute")?;
            (dev, ctx, driver, sms)
        };
        let guard = PrimaryCtx(dev);
        // SAFETY: the context was retained above.
        ck(unsafe { sys::cuCtxSetCurrent(ctx) }, "cuCtxSetCurrent")?;
        let own = ptx_isa(PTX).ok_or_else(|| AttnError::Failed("the committed PTX has no .version".into()))?;
        let mut last = String::new();
        for isa in ptx_isa_candidates(own, max_ptx_isa(driver)) {
            let image = CString::new(with_ptx_isa(PTX, isa)).map_err(|e| AttnError::Failed(e.to_string()))?;
            let mut module = std::ptr::null_mut();
            // SAFETY: the image is a NUL-terminated PTX string that outlives the call.
            let r = unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void) };
            match r {
                CUresult::CUDA_SUCCESS => return Ok(Gpu { module, sms: sms.max(1) as usize, isa, _ctx: guard }),
                CUresult::CUDA_ERROR_NOT_SUPPORTED => {
                    return Err(AttnError::NoModules(format!("cuModuleLoadData: {r:?} (driver {driver})")))
                }
                // An older ISA number may still be accepted.
                CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION | CUresult::CUDA_ERROR_INVALID_PTX => {
                    last = format!("cuModuleLoadData with PTX ISA {}.{}: {r:?}", isa.0, isa.1)
                }
                _ => return Err(AttnError::Failed(format!("cuModuleLoadData: {r:?} (driver {driver})"))),
            }
        }
        Err(AttnError::Failed(format!("no PTX ISA this driver ({driver}) accepts: {last}")))
    }

    fn function(&self, name: &str) -> Res<sys::CUfunction> {
        let c = CString::new(name).map_err(|e| AttnError::Failed(e.to_string()))?;
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

/// A layout on the device, with its split-KV scratch and output.
struct Device {
    kv: Kv,
    splits: usize,
    part_ml: DevBuf,
    part_acc: DevBuf,
    out: DevBuf,
    _bufs: Vec<DevBuf>,
}

fn upload(gpu: &Gpu, mode: Mode, s: Shape, data: Option<(&[u16], &[u16])>, rng: &mut Rng) -> Res<Device> {
    let l = host_layout(mode, s, data, rng);
    let mut kv = l.kv;
    let mut bufs = Vec::new();
    let k = if data.is_some() { DevBuf::from(&l.k)? } else { DevBuf::new(l.k_len * 2)? };
    kv.k = k.0;
    bufs.push(k);
    if l.v_len > 0 {
        let v = if data.is_some() { DevBuf::from(&l.v)? } else { DevBuf::new(l.v_len * 2)? };
        kv.v = v.0;
        bufs.push(v);
    }
    if !l.table.is_empty() {
        let t = DevBuf::from(&l.table)?;
        kv.block_table = t.0;
        bufs.push(t);
    }
    if !l.base.is_empty() {
        let b = DevBuf::from(&l.base)?;
        kv.req_base = b.0;
        bufs.push(b);
    }
    let splits = splits(s, gpu.sms, WARPS);
    let rows = s.batch * s.queries * HEADS;
    Ok(Device {
        kv,
        splits,
        part_ml: DevBuf::new(rows * splits * 2 * 4)?,
        part_acc: DevBuf::new(rows * splits * DIM * 4)?,
        out: DevBuf::new(rows * DIM * 4)?,
        _bufs: bufs,
    })
}

/// One attention: the split kernel, then the merge of the splits.
fn launch(f: sys::CUfunction, reduce: sys::CUfunction, q: &DevBuf, d: &Device, s: Shape) -> Res<()> {
    let (mut qp, mut ml, mut acc, mut kvv) = (q.0, d.part_ml.0, d.part_acc.0, d.kv);
    let (mut kvh, mut ctx, mut nq, mut sp) = (KV_HEADS as i32, s.context as i32, s.queries as i32, d.splits as i32);
    let mut scale = 1.0f32 / (DIM as f32).sqrt();
    let mut params: [*mut c_void; 9] = [
        &mut qp as *mut _ as *mut c_void,
        &mut ml as *mut _ as *mut c_void,
        &mut acc as *mut _ as *mut c_void,
        &mut kvv as *mut _ as *mut c_void,
        &mut kvh as *mut _ as *mut c_void,
        &mut ctx as *mut _ as *mut c_void,
        &mut nq as *mut _ as *mut c_void,
        &mut sp as *mut _ as *mut c_void,
        &mut scale as *mut _ as *mut c_void,
    ];
    let grid_z = (s.queries * d.splits) as u32;
    // SAFETY: the parameters match the kernel's signature in type and order
    // and live across the call (the driver copies them at launch); the
    // buffers hold what the shape and the split count address.
    ck(
        unsafe {
            sys::cuLaunchKernel(
                f,
                s.batch as u32,
                KV_HEADS as u32,
                grid_z,
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
    )?;
    let (mut ml, mut acc, mut out) = (d.part_ml.0, d.part_acc.0, d.out.0);
    let mut rparams: [*mut c_void; 4] = [
        &mut ml as *mut _ as *mut c_void,
        &mut acc as *mut _ as *mut c_void,
        &mut out as *mut _ as *mut c_void,
        &mut sp as *mut _ as *mut c_void,
    ];
    let rows = (s.batch * s.queries * HEADS) as u32;
    // SAFETY: as above, for `attention_reduce(part_ml, part_acc, out, splits)`.
    ck(
        unsafe {
            sys::cuLaunchKernel(
                reduce,
                rows,
                1,
                1,
                DIM as u32,
                1,
                1,
                0,
                std::ptr::null_mut(),
                rparams.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        },
        "cuLaunchKernel (reduce)",
    )
}

/// Seconds that `work` takes on the default stream, timed with events.
fn timed(work: impl FnOnce() -> Res<()>) -> Res<f64> {
    let (mut a, mut b) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: events created, recorded on the default stream around the
    // work, waited for, read and destroyed here.
    unsafe {
        ck(sys::cuEventCreate(&mut a, 0), "cuEventCreate")?;
        ck(sys::cuEventCreate(&mut b, 0), "cuEventCreate")?;
        let r = (|| {
            ck(sys::cuEventRecord(a, std::ptr::null_mut()), "cuEventRecord")?;
            work()?;
            ck(sys::cuEventRecord(b, std::ptr::null_mut()), "cuEventRecord")?;
            ck(sys::cuEventSynchronize(b), "cuEventSynchronize")?;
            let mut ms = 0f32;
            ck(sys::cuEventElapsedTime(&mut ms, a, b), "cuEventElapsedTime")?;
            Ok(ms as f64 * 1e-3)
        })();
        let _ = sys::cuEventDestroy_v2(a);
        let _ = sys::cuEventDestroy_v2(b);
        r
    }
}

/// Every layout's kernel against the CPU reference on a small problem;
/// the largest difference.
fn check(gpu: &Gpu, s: Shape, variant: Variant) -> Res<f32> {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let n = s.batch * s.context * ROW;
    let k: Vec<u16> = (0..n).map(|_| to_bf16(rng.unit())).collect();
    let v: Vec<u16> = (0..n).map(|_| to_bf16(rng.unit())).collect();
    let nq = s.batch * s.queries * HEADS * DIM;
    let q: Vec<f32> = (0..nq).map(|_| rng.unit()).collect();
    let want = reference(&q, &k, &v, s);
    let qd = DevBuf::from(&q)?;
    let reduce = gpu.function("attention_reduce")?;
    let mut worst = 0f32;
    for mode in MODES {
        let name = kernel_name(mode, variant);
        let d = upload(gpu, mode, s, Some((&k, &v)), &mut rng)?;
        launch(gpu.function(name)?, reduce, &qd, &d, s)?;
        // SAFETY: a context is current.
        ck(unsafe { sys::cuCtxSynchronize() }, "cuCtxSynchronize")?;
        let got = d.out.read_f32(nq)?;
        worst =
            worst.max(verify(&got, &want, TOLERANCE).map_err(|e| AttnError::Failed(format!("{name} ({s:?}): {e}")))?);
    }
    Ok(worst)
}

/// Bytes per second of a plain device-to-device copy of `bytes` (read plus
/// write), the median of `reps`.
fn copy_bandwidth(bytes: usize, reps: usize) -> Res<f64> {
    let (src, dst) = (DevBuf::new(bytes)?, DevBuf::new(bytes)?);
    let mut t = Vec::new();
    for r in 0..reps + 2 {
        // SAFETY: both buffers hold `bytes` bytes.
        let s = timed(|| ck(unsafe { sys::cuMemcpyDtoD_v2(dst.0, src.0, bytes) }, "cuMemcpyDtoD"))?;
        if r >= 2 {
            t.push(s);
        }
    }
    Ok(2.0 * bytes as f64 / percentile(&t, 50.0))
}

/// One layout's decode timing.
pub struct Timing {
    pub mode: Mode,
    pub kernel: &'static str,
    pub splits: usize,
    pub median_s: f64,
    pub p10_s: f64,
    pub p90_s: f64,
    /// K/V bytes read per second at the median.
    pub bandwidth: f64,
    pub valid: bool,
}

/// What the measurement found.
pub struct Measured {
    pub shape: Shape,
    pub timings: Vec<Timing>,
    pub copy_bandwidth: f64,
    pub min_fraction: f64,
    pub max_error: f32,
    pub rounds: usize,
    pub warmup_batches: usize,
    pub ptx_isa: (u32, u32),
}

impl Measured {
    fn timing(&self, mode: Mode) -> &Timing {
        self.timings.iter().find(|t| t.mode == mode).expect("every mode is timed")
    }

    /// The decode `attn_eff_*` profile fields, with their sources: only for
    /// layouts whose timing is valid, and none if the dense reference is not.
    pub fn profile_fields(&self, device: &str) -> Vec<(String, serde_json::Value)> {
        let dense = self.timing(Mode::Dense);
        if !dense.valid {
            return Vec::new();
        }
        let mut v = Vec::new();
        for mode in [Mode::Paged, Mode::TokenMajor, Mode::PerLayer] {
            let t = self.timing(mode);
            if !t.valid {
                continue;
            }
            let src = format!(
                "gpu_measure on {device}: sim/gpu/attention.cu split-KV decode, one layer, 32/8 heads, dim 128, bf16, \
                 batch {} context {}; median of {} interleaved launches of the dense kernel ({:.1} us) over this \
                 layout's ({:.1} us, {:.0} GB/s, {:.0} % of a device copy's {:.0} GB/s)",
                self.shape.batch,
                self.shape.context,
                self.rounds,
                dense.median_s * 1e6,
                t.median_s * 1e6,
                t.bandwidth / 1e9,
                100.0 * t.bandwidth / self.copy_bandwidth,
                self.copy_bandwidth / 1e9
            );
            v.push((
                format!("attn_eff_decode_{}", mode.name()),
                serde_json::json!({"value": dense.median_s / t.median_s, "source": src}),
            ));
        }
        v
    }

    /// The Markdown table of the measurement.
    pub fn markdown(&self) -> String {
        let mut md = format!(
            "Decode, batch {} context {}, PTX ISA {}.{}; outputs match the CPU reference (largest difference \
             {:.1e}). Device copy: {:.0} GB/s; a layout below {:.0} % of it is marked invalid. Warm-up: {} batches; \
             {} interleaved rounds.\n\n\
             | layout | kernel | splits | median us | p10-p90 us | GB/s | of copy | vs dense | valid |\n\
             |---|---|---:|---:|---:|---:|---:|---:|---|\n",
            self.shape.batch,
            self.shape.context,
            self.ptx_isa.0,
            self.ptx_isa.1,
            self.max_error,
            self.copy_bandwidth / 1e9,
            100.0 * self.min_fraction,
            self.warmup_batches,
            self.rounds
        );
        let dense = self.timing(Mode::Dense).median_s;
        for t in &self.timings {
            md.push_str(&format!(
                "| {} | {} | {} | {:.1} | {:.1}-{:.1} | {:.0} | {:.0} % | {:.3} | {} |\n",
                t.mode.name(),
                t.kernel,
                t.splits,
                t.median_s * 1e6,
                t.p10_s * 1e6,
                t.p90_s * 1e6,
                t.bandwidth / 1e9,
                100.0 * t.bandwidth / self.copy_bandwidth,
                dense / t.median_s,
                if t.valid { "yes" } else { "INVALID" }
            ));
        }
        md
    }
}

/// Checks the kernels, then times them. `variant` swaps in a deliberately
/// slow or broken `paged` kernel (to show the checks reject it).
pub fn measure(device: i32, quick: bool, variant: Variant, min_fraction: f64) -> Result<Measured, AttnError> {
    let gpu = Gpu::new(device)?;
    let mut max_error = check(&gpu, Shape { batch: 2, context: 37, queries: 1 }, variant)?;
    max_error = max_error.max(check(&gpu, Shape { batch: 3, context: 300, queries: 1 }, variant)?);
    max_error = max_error.max(check(&gpu, Shape { batch: 1, context: 1000, queries: 1 }, variant)?);
    let (shape, rounds, copy_bytes) = if quick {
        (Shape { batch: 8, context: 1024, queries: 1 }, 5, 64 << 20)
    } else {
        // 512 MiB of K/V per layer: ten times the H200's L2.
        (Shape { batch: 32, context: 4096, queries: 1 }, 30, 1 << 30)
    };
    let copy = copy_bandwidth(copy_bytes, if quick { 3 } else { 10 })?;
    let reduce = gpu.function("attention_reduce")?;
    let q = DevBuf::new(shape.batch * HEADS * DIM * 4)?;
    let mut rng = Rng(7);
    let mut layouts = Vec::new();
    for mode in MODES {
        let f = gpu.function(kernel_name(mode, variant))?;
        layouts.push((mode, f, upload(&gpu, mode, shape, None, &mut rng)?));
    }
    // Warm the clocks on the dense kernel: batches of 10 launches until one
    // times within 2 % of the one before (at least 3, at most 100).
    let (_, dense_f, dense) = &layouts[0];
    let mut prev = f64::INFINITY;
    let mut warmup_batches = 0;
    for i in 0..100 {
        let t = timed(|| (0..10).try_for_each(|_| launch(*dense_f, reduce, &q, dense, shape)))?;
        warmup_batches = i + 1;
        if i >= 2 && (t - prev).abs() <= 0.02 * prev {
            break;
        }
        prev = t;
    }
    let mut samples = vec![Vec::new(); layouts.len()];
    for r in 0..rounds {
        for j in 0..layouts.len() {
            let i = (r + j) % layouts.len();
            let (_, f, d) = &layouts[i];
            samples[i].push(timed(|| launch(*f, reduce, &q, d, shape))?);
        }
    }
    let kv_bytes = (shape.batch * shape.context * 2 * ROW * 2) as f64;
    let timings = layouts
        .iter()
        .zip(&samples)
        .map(|((mode, _, d), s)| {
            let median_s = percentile(s, 50.0);
            let bandwidth = kv_bytes / median_s;
            Timing {
                mode: *mode,
                kernel: kernel_name(*mode, variant),
                splits: d.splits,
                median_s,
                p10_s: percentile(s, 10.0),
                p90_s: percentile(s, 90.0),
                bandwidth,
                valid: bandwidth_valid(bandwidth, copy, min_fraction),
            }
        })
        .collect();
    Ok(Measured {
        shape,
        timings,
        copy_bandwidth: copy,
        min_fraction,
        max_error,
        rounds,
        warmup_batches,
        ptx_isa: gpu.isa,
    })
}
