//! Compiles `src/torch_throw.cpp`, the C++ throw behind the PyTorch
//! allocation hook that the extension module exports.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/torch_throw.cpp");
    cc::Build::new()
        .cpp(true)
        .std("c++17")
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true)
        .flag("-fPIC")
        .file("src/torch_throw.cpp")
        .compile("vmm_arena_torch_throw");
}
