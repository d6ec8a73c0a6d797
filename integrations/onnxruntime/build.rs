//! Compiles the C++ half of the allocator (the exception that reports a
//! refused allocation) and links libvmm_arena.so, the repository's C ABI
//! library, from VMM_ARENA_LIB_DIR (default: the repository's
//! target/release, built by `cargo build --release -p vmm-arena-ffi`).

use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=src/throw.cpp");
    println!("cargo:rerun-if-env-changed=VMM_ARENA_LIB_DIR");
    cc::Build::new().cpp(true).file("src/throw.cpp").flag_if_supported("-std=c++17").compile("vmm_ort_throw");

    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let lib_dir = match std::env::var_os("VMM_ARENA_LIB_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => manifest.join("../../target/release"),
    };
    let lib = lib_dir.join("libvmm_arena.so");
    if !lib.exists() {
        panic!(
            "{} is missing: build it first with `cargo build --release -p vmm-arena-ffi` \
             at the repository root (or set VMM_ARENA_LIB_DIR)",
            lib.display()
        );
    }
    let lib_dir = lib_dir.canonicalize().expect("library folder exists");
    println!("cargo:rerun-if-changed={}", lib.display());
    println!("cargo:rustc-link-search=native={}", lib_dir.display());
    println!("cargo:rustc-link-lib=dylib=vmm_arena");
    // The test and bench executables find the library where it was built.
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
}
