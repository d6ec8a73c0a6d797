//! The CUDA device's setup: a CUDA-backend arena registered for ONNX
//! Runtime's "Cuda" device and a session with the CUDA execution provider.
//! Where there is no CUDA driver or no CUDA build of ONNX Runtime (the
//! onnxruntime wheel is CPU-only), each step fails with a clear error and
//! nothing crashes; with both (onnxruntime-gpu on a GPU machine), the
//! decoder runs on the arena's device memory.

mod common;

use common::{first_difference, model_file, ort, serial};
use vmm_arena_onnxruntime::model::{self, ModelSpec};
use vmm_arena_onnxruntime::{ArenaAllocator, ArenaConfig, ArenaDevice, Session, SessionConfig, SetupError};

#[test]
fn cuda_arena_and_provider_are_set_up_or_refused_with_an_error() {
    let _serial = serial();
    let ort = ort();
    let spec = ModelSpec::default();
    let path = model_file(spec);
    let providers = ort.available_providers().expect("GetAvailableProviders");
    assert!(providers.iter().any(|p| p == "CPUExecutionProvider"), "{providers:?}");
    let has_cuda_provider = providers.iter().any(|p| p == "CUDAExecutionProvider");
    println!("ONNX Runtime {} providers: {providers:?}", ort.version());

    let config = ArenaConfig { device: ArenaDevice::Cuda(0), ..ArenaConfig::default() };
    let allocator = match ArenaAllocator::new(ort, config) {
        Ok(allocator) => allocator,
        Err(SetupError::Arena(error)) => {
            // No driver or no device here: the arena says so, and a session
            // asking for CUDA is refused by ONNX Runtime (CPU-only build)
            // or by the missing driver, with an error either way.
            assert_eq!(error.name, "VMM_ARENA_ERR_UNSUPPORTED", "{error}");
            println!("no CUDA arena here: {error}");
            let asked = SessionConfig { cuda_device: Some(0), ..SessionConfig::default() };
            match Session::new(ort, &path, asked) {
                Ok(_) => assert!(has_cuda_provider, "a CUDA session without the CUDA provider"),
                Err(error) => println!("no CUDA session here: {error}"),
            }
            return;
        }
        Err(error) => panic!("CUDA arena allocator: {error}"),
    };
    // A CUDA driver and device: register for the "Cuda" device.
    let registration = allocator.register().expect("RegisterAllocator for Cuda");
    if !has_cuda_provider {
        println!("a CUDA arena, but this ONNX Runtime has no CUDA provider (install onnxruntime-gpu)");
        return;
    }
    let on_arena = SessionConfig { cuda_device: Some(0), allocator: Some(&registration), ..SessionConfig::default() };
    let on_default = SessionConfig { cuda_device: Some(0), ..SessionConfig::default() };
    let arena_session = Session::new(ort, &path, on_arena).expect("CUDA session on the arena");
    let default_session = Session::new(ort, &path, on_default).expect("CUDA session on ONNX Runtime's allocator");
    for seq in [1usize, 7, 64, 512, 3] {
        let x = model::input(seq, spec.d_model, seq as u64);
        let before = allocator.counters();
        let a = arena_session.run(&x, seq, spec.d_model).expect("run on the arena");
        let b = default_session.run(&x, seq, spec.d_model).expect("run on the default allocator");
        let after = allocator.counters();
        assert!(after.allocs > before.allocs, "seq {seq}: no device tensor came from the arena");
        assert_eq!(after.live_blocks, before.live_blocks, "seq {seq}: {after:?}");
        // Same kernels on the same device; a difference is reported with
        // its size rather than hidden.
        if let Some(i) = first_difference(&a, &b) {
            let worst = a.iter().zip(&b).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
            assert!(worst <= 1e-4, "seq {seq}: element {i} differs, largest difference {worst}");
            println!("seq {seq}: not bit-identical, largest difference {worst}");
        }
    }
    drop(arena_session);
    let end = allocator.counters();
    assert_eq!((end.live_blocks, end.unknown_frees, end.arena_free_errors), (0, 0, 0), "{end:?}");
    allocator.trim().expect("trim");
    let stats = allocator.arena_stats().expect("stats");
    assert_eq!((stats.mapped_bytes, stats.pooled_bytes), (0, 0), "{stats:?}");
}
