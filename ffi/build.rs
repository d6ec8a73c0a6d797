//! Gives the shared library a stable SONAME on Linux, so programs linked
//! against it record `libvmm_arena.so` (found through their RPATH or the
//! loader's path) rather than the path it was linked from.
//!
//! Also compiles `src/torch_shim.cpp`, the PyTorch allocation hook that
//! throws, and links it into the shared library only: PyTorch loads a `.so`,
//! and the static library so keeps its C users free of a C++ runtime.
//!
//! And builds `src/preload_shim.c` as `libvmm_arena_preload.so` (the
//! LD_PRELOAD library for raw `cudaMalloc`/`cudaFree`), copied next to
//! `libvmm_arena.so` in `target/<profile>/`.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/torch_shim.cpp");
    println!("cargo:rerun-if-changed=src/preload_shim.c");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        return;
    }
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libvmm_arena.so");

    let objects = cc::Build::new()
        .cpp(true)
        .std("c++17")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .flag("-fPIC")
        .cpp_link_stdlib(None) // linked below, for the cdylib only
        .file("src/torch_shim.cpp")
        .compile_intermediates();
    for obj in &objects {
        println!("cargo:rustc-cdylib-link-arg={}", obj.display());
    }
    // No Rust code refers to the hook: --undefined keeps it from
    // --gc-sections, and a second version script exports it (rustc's own
    // exports only the Rust symbols).
    const HOOK: &str = "vmm_arena_torch_malloc_or_throw";
    let script = std::path::Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("torch_shim.ver");
    std::fs::write(&script, format!("{{ global: {HOOK}; }};\n")).expect("write the version script");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--undefined={HOOK}");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={}", script.display());
    println!("cargo:rustc-cdylib-link-arg=-lstdc++");
    build_preload_library();
}

/// Links `src/preload_shim.c` into `$OUT_DIR/libvmm_arena_preload.so` and
/// copies it to `target/<profile>/` (three levels above `OUT_DIR`:
/// `<profile>/build/<package>-<hash>/out`), where libvmm_arena.so lands.
fn build_preload_library() {
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let lib = out_dir.join("libvmm_arena_preload.so");
    let compiler = cc::Build::new().get_compiler();
    let mut cmd = compiler.to_command();
    cmd.args(["-std=c11", "-O2", "-g", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared", "-pthread"])
        .arg("-Wl,-soname,libvmm_arena_preload.so")
        .arg("-o")
        .arg(&lib)
        .arg("src/preload_shim.c")
        .arg("-ldl");
    let status = cmd.status().expect("run the C compiler for src/preload_shim.c");
    assert!(status.success(), "compiling src/preload_shim.c failed: {cmd:?}");
    if let Some(profile_dir) = out_dir.ancestors().nth(3) {
        std::fs::copy(&lib, profile_dir.join("libvmm_arena_preload.so")).expect("copy libvmm_arena_preload.so");
    }
}
