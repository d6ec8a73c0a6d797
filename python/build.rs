//! Compiles `src/torch_throw.cpp`, the C++ throw behind the PyTorch
//! allocation hook that the extension module exports, and links the
//! LD_PRELOAD library (`../ffi/src/preload_shim.c`) as
//! `$OUT_DIR/libvmm_arena_preload.so`, which the extension embeds and
//! `vmm_arena.torch.preload_library()` writes out.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/torch_throw.cpp");
    println!("cargo:rerun-if-changed=../ffi/src/preload_shim.c");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .flag("-fPIC")
        .file("src/torch_throw.cpp")
        .compile("vmm_arena_torch_throw");

    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let lib = out_dir.join("libvmm_arena_preload.so");
    let mut cmd = cc::Build::new().get_compiler().to_command();
    cmd.args(["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-pthread"])
        .arg("-Wl,-soname,libvmm_arena_preload.so")
        .arg("-o")
        .arg(&lib)
        .arg("../ffi/src/preload_shim.c")
        .arg("-ldl");
    let status = cmd.status().expect("run the C compiler for preload_shim.c");
    assert!(status.success(), "compiling ../ffi/src/preload_shim.c failed: {cmd:?}");
}
