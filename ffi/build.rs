//! Gives the shared library a stable SONAME on Linux, so programs linked
//! against it record `libvmm_arena.so` (found through their RPATH or the
//! loader's path) rather than the path it was linked from.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var("CARGO_CFG_TARGET_OS").as_deref() == Ok("linux") {
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libvmm_arena.so");
    }
}
