//! Builds the C and C++ test programs of `tests/c` and `tests/cpp` with the
//! system's compilers under AddressSanitizer and UndefinedBehaviorSanitizer,
//! links them to this crate's `libvmm_arena`, runs them, and requires them
//! to pass.
//!
//! Needs only `cc`/`c++` (or `$CC`/`$CXX`) with the sanitizer runtimes, as
//! gcc ships them on Debian (libasan, libubsan). `VMM_ARENA_FFI_NO_SANITIZE=1`
//! builds without sanitizers, for a compiler that lacks them.
//!
//! Cargo does not build a cdylib/staticlib-only library for integration
//! tests, so the first test to need it runs `cargo build -p vmm-arena-ffi
//! --lib` into this test binary's own target directory and profile (found
//! from the binary's path, so any `--target-dir` or `--release` works).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use common::{contract_header, ffi_dir, parse_header, Decl};

struct Toolchain {
    /// `target/<profile>`, holding libvmm_arena.{so,a}.
    lib_dir: PathBuf,
    /// Where programs are built.
    work: PathBuf,
    cc: String,
    cxx: String,
    sanitize: bool,
}

fn toolchain() -> &'static Toolchain {
    static T: OnceLock<Toolchain> = OnceLock::new();
    T.get_or_init(|| {
        let lib_dir = build_library();
        let work = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("vmm-arena-ffi-programs");
        std::fs::create_dir_all(&work).unwrap();
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        let sanitize = std::env::var_os("VMM_ARENA_FFI_NO_SANITIZE").is_none();
        if sanitize {
            // Fail early and clearly when the sanitizer runtimes are missing.
            let probe = work.join("probe.c");
            std::fs::write(&probe, "int main(void) { return 0; }\n").unwrap();
            let out = Command::new(&cc)
                .args(["-fsanitize=address,undefined", "-o"])
                .arg(work.join("probe"))
                .arg(&probe)
                .output()
                .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}`: {e}"));
            assert!(
                out.status.success(),
                "`{cc} -fsanitize=address,undefined` cannot link (are libasan and libubsan installed? \
                 VMM_ARENA_FFI_NO_SANITIZE=1 skips the sanitizers):\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
        } else {
            eprintln!("warning: VMM_ARENA_FFI_NO_SANITIZE is set: programs are built without sanitizers");
        }
        Toolchain { lib_dir, work, cc, cxx, sanitize }
    })
}

/// Builds libvmm_arena for this test binary's target directory and profile.
fn build_library() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    // <target>/<profile>/deps/<test binary>
    let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>").to_path_buf();
    let target_dir = profile_dir.parent().expect("target/").to_path_buf();
    let profile = profile_dir.file_name().unwrap().to_str().unwrap().to_string();
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "-p", "vmm-arena-ffi", "--lib", "--target-dir"]).arg(&target_dir).current_dir(ffi_dir());
    match profile.as_str() {
        "debug" => {}
        "release" => {
            cmd.arg("--release");
        }
        other => {
            cmd.args(["--profile", other]);
        }
    }
    let out = cmd.output().expect("run cargo");
    assert!(out.status.success(), "building libvmm_arena failed:\n{}", String::from_utf8_lossy(&out.stderr));
    for lib in ["libvmm_arena.so", "libvmm_arena.a"] {
        assert!(profile_dir.join(lib).is_file(), "{} was not built", profile_dir.join(lib).display());
    }
    profile_dir
}

#[derive(Clone, Copy, PartialEq)]
enum Lang {
    C,
    Cxx,
}

#[derive(Clone, Copy, PartialEq)]
enum Link {
    Shared,
    Static,
    /// Compile only (`-c`).
    None,
}

/// test_api's translation units: its `main` and the tests, by area.
fn test_api_sources() -> Vec<PathBuf> {
    ["test_api.c", "api_create.c", "api_moves.c", "api_sleep_share.c", "api_stats.c", "api_stream.c"]
        .iter()
        .map(|f| source(&format!("c/{f}")))
        .collect()
}

/// Compiles `sources` into `name` with `include` first on the include path.
fn compile(name: &str, lang: Lang, sources: &[PathBuf], include: &Path, link: Link) -> PathBuf {
    compile_with(name, lang, sources, include, link, &[])
}

/// `compile`, with `extra` arguments for the compiler after the sources.
fn compile_with(name: &str, lang: Lang, sources: &[PathBuf], include: &Path, link: Link, extra: &[String]) -> PathBuf {
    let t = toolchain();
    let out = t.work.join(name);
    let mut cmd = Command::new(if lang == Lang::C { &t.cc } else { &t.cxx });
    cmd.arg(if lang == Lang::C { "-std=c11" } else { "-std=c++17" });
    cmd.args(["-Wall", "-Wextra", "-Werror", "-g", "-O1", "-pthread"]);
    if lang == Lang::C {
        cmd.arg("-Wstrict-prototypes");
    }
    if t.sanitize {
        cmd.args(["-fsanitize=address,undefined", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"]);
    }
    cmd.arg("-I").arg(include);
    cmd.arg("-I").arg(ffi_dir().join("tests/c"));
    if link == Link::None {
        cmd.arg("-c");
    }
    cmd.arg("-o").arg(&out).args(sources);
    match link {
        Link::Shared => {
            cmd.arg("-L").arg(&t.lib_dir).arg("-lvmm_arena");
            cmd.arg(format!("-Wl,-rpath,{}", t.lib_dir.display()));
        }
        Link::Static => {
            cmd.arg(t.lib_dir.join("libvmm_arena.a")).args(["-ldl", "-lm", "-lrt"]);
        }
        Link::None => {}
    }
    cmd.args(extra);
    let res = cmd.output().expect("run the compiler");
    assert!(
        res.status.success(),
        "compiling {name} failed: {cmd:?}\n{}{}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
    out
}

/// Runs a program; returns its stdout. Fails the test on a non-zero exit,
/// a sanitizer report, or after two minutes.
fn run(program: &Path) -> String {
    run_with_env(program, &[])
}

/// `run`, with `env` added to the program's environment (an
/// `ASAN_OPTIONS` there is appended to the default one).
fn run_with_env(program: &Path, env: &[(&str, String)]) -> String {
    let mut asan = "detect_leaks=1:abort_on_error=0:strict_string_checks=1:detect_stack_use_after_return=1".to_string();
    for (_, v) in env.iter().filter(|(k, _)| *k == "ASAN_OPTIONS") {
        asan = format!("{asan}:{v}");
    }
    let mut child = Command::new(program)
        .envs(env.iter().filter(|(k, _)| *k != "ASAN_OPTIONS").map(|(k, v)| (*k, v.as_str())))
        .env("ASAN_OPTIONS", asan)
        .env("UBSAN_OPTIONS", "print_stacktrace=1:halt_on_error=1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", program.display()));
    let (mut so, mut se) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let out_t = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut so, &mut s).ok();
        s
    });
    let err_t = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut se, &mut s).ok();
        s
    });
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let (stdout, stderr) = (out_t.join().unwrap(), err_t.join().unwrap());
    let name = program.display();
    match status {
        None => panic!("{name} timed out\nstdout:\n{stdout}\nstderr:\n{stderr}"),
        Some(s) if !s.success() => panic!("{name} failed ({s})\nstdout:\n{stdout}\nstderr:\n{stderr}"),
        Some(_) => {}
    }
    assert!(
        !stderr.contains("Sanitizer") && !stderr.contains("runtime error"),
        "{name} passed with a sanitizer report:\n{stderr}"
    );
    print!("{stdout}");
    stdout
}

fn our_include() -> PathBuf {
    ffi_dir().join("include")
}

fn source(rel: &str) -> PathBuf {
    ffi_dir().join("tests").join(rel)
}

/// Runs `program` and requires its last line to report passing checks.
fn run_and_expect_pass(program: &Path) {
    let out = run(program);
    let last = out.lines().last().unwrap_or("");
    assert!(last.contains("passed") && last.contains(" 0 failed"), "unexpected ending: {last:?}");
}

#[test]
fn c_api_test_shared_library() {
    let exe = compile("test_api", Lang::C, &test_api_sources(), &our_include(), Link::Shared);
    run_and_expect_pass(&exe);
}

#[test]
fn c_api_test_static_library() {
    let exe = compile("test_api_static", Lang::C, &test_api_sources(), &our_include(), Link::Static);
    run_and_expect_pass(&exe);
}

#[test]
fn c_threads_test() {
    let exe = compile("test_threads", Lang::C, &[source("c/test_threads.c")], &our_include(), Link::Shared);
    run_and_expect_pass(&exe);
}

/// The C ABI on the CUDA backend, bytes checked through the driver's
/// copies (skipped without a usable driver, unless VMM_ARENA_REQUIRE_GPU=1;
/// CI runs it against cuda-standin).
#[test]
fn c_cuda_backend_test() {
    let exe = compile("test_cuda_backend", Lang::C, &[source("c/test_cuda_backend.c")], &our_include(), Link::Shared);
    run_and_expect_pass(&exe);
}

/// A failed resize_many changes no byte (see the program's header).
#[test]
fn c_failed_batch_keeps_every_byte() {
    let exe = compile("test_batch_bytes", Lang::C, &[source("c/test_batch_bytes.c")], &our_include(), Link::Shared);
    run_and_expect_pass(&exe);
}

/// The C ABI fault matrix (see the program's header): prints its size.
#[test]
fn c_fault_matrix() {
    let exe = compile("test_faults", Lang::C, &[source("c/test_faults.c")], &our_include(), Link::Shared);
    let out = run(&exe);
    let last = out.lines().last().unwrap_or("");
    assert!(last.contains("passed") && last.contains(" 0 failed"), "unexpected ending: {last:?}");
    assert!(out.contains("C ABI fault matrix size:"), "{out}");
}

/// Device groups from C: calls, arguments, the group fault matrix, threads.
#[test]
fn c_group_test() {
    let exe = compile("test_group", Lang::C, &[source("c/test_group.c")], &our_include(), Link::Shared);
    let out = run(&exe);
    let last = out.lines().last().unwrap_or("");
    assert!(last.contains("passed") && last.contains(" 0 failed"), "unexpected ending: {last:?}");
    assert!(out.contains("C ABI group fault matrix size:"), "{out}");
}

/// Export and import from C: one process, refusals, the fault matrix, and
/// two processes (fork, SCM_RIGHTS).
#[test]
fn c_export_test() {
    let exe = compile("test_export", Lang::C, &[source("c/test_export.c")], &our_include(), Link::Shared);
    let out = run(&exe);
    let last = out.lines().last().unwrap_or("");
    assert!(last.contains("passed") && last.contains(" 0 failed"), "unexpected ending: {last:?}");
    assert!(out.contains("C ABI export/import fault matrix size:"), "{out}");
}

/// Tensor-parallel groups from C: member arenas, per-member configs, the
/// group undo, and forked ranks voting on two-phase operations.
#[test]
fn c_group_tp_test() {
    let exe = compile("test_group_tp", Lang::C, &[source("c/test_group_tp.c")], &our_include(), Link::Shared);
    let out = run(&exe);
    let last = out.lines().last().unwrap_or("");
    assert!(last.contains("passed") && last.contains(" 0 failed"), "unexpected ending: {last:?}");
    assert!(out.contains("forked ranks:"), "{out}");
}

/// Lifetimes of what leaves an arena from C: DMA-BUF handles (the host
/// stand-in) and their fault matrix, caller-owned descriptors, the layout
/// record's minimum-size semantics, an export sent to a forked child.
#[test]
fn c_export_lifetime_test() {
    let exe =
        compile("test_export_lifetime", Lang::C, &[source("c/test_export_lifetime.c")], &our_include(), Link::Shared);
    let out = run(&exe);
    let last = out.lines().last().unwrap_or("");
    assert!(last.contains("passed") && last.contains(" 0 failed"), "unexpected ending: {last:?}");
    assert!(out.contains("C ABI DMA-BUF fault matrix size:"), "{out}");
}

/// The block-in-chunk KV layout: layouts, token offsets, block tables
/// across growth and a move (`test_layout.c`).
#[test]
fn kv_layout_from_c() {
    let exe = compile("test_layout", Lang::C, &[source("c/test_layout.c")], &our_include(), Link::Shared);
    run_and_expect_pass(&exe);
}

/// Tags at allocation time, small allocations included (`test_tags.c`).
#[test]
fn tags_from_c() {
    let exe = compile("test_tags", Lang::C, &[source("c/test_tags.c")], &our_include(), Link::Shared);
    run_and_expect_pass(&exe);
}

/// The same through the C++ wrapper (`test_tags.cpp`).
#[test]
fn tags_from_cpp() {
    let exe = compile("test_tags_cpp", Lang::Cxx, &[source("cpp/test_tags.cpp")], &our_include(), Link::Shared);
    run_and_expect_pass(&exe);
}

/// Allocations ordered on a stream from C: bytes, reuse of memory freed or
/// shrunk on the same stream, refusals, and the fault matrix.
#[test]
fn c_stream_test() {
    let exe = compile("test_stream", Lang::C, &[source("c/test_stream.c")], &our_include(), Link::Shared);
    let out = run(&exe);
    let last = out.lines().last().unwrap_or("");
    assert!(last.contains("passed") && last.contains(" 0 failed"), "unexpected ending: {last:?}");
    assert!(out.contains("C ABI stream-ordered allocation fault matrix size:"), "{out}");
}

#[test]
fn torch_entry_points_on_the_host_backend() {
    let exe = compile("test_torch", Lang::C, &[source("c/test_torch.c")], &our_include(), Link::Shared);
    run_and_expect_pass(&exe);
}

/// LD_PRELOAD mode: libvmm_arena_preload.so (built by build.rs next to
/// libvmm_arena.so) catches a program's raw cudaMalloc/cudaFree, routes them
/// to the hooks' arenas, and passes foreign frees to the real runtime (here
/// libfake_cudart.so, a stand-in the program links).
#[test]
fn preload_library_routes_raw_cuda_allocations_to_the_arenas() {
    let t = toolchain();
    let preload = t.lib_dir.join("libvmm_arena_preload.so");
    assert!(preload.is_file(), "{} was not built", preload.display());
    let fake = t.work.join("libfake_cudart.so");
    let out = Command::new(&t.cc)
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-g", "-fPIC", "-shared", "-o"])
        .arg(&fake)
        .arg(source("c/fake_cudart.c"))
        .output()
        .expect("run the C compiler");
    assert!(out.status.success(), "compiling fake_cudart.c failed:\n{}", String::from_utf8_lossy(&out.stderr));
    let extra = [
        format!("-L{}", t.work.display()),
        "-lfake_cudart".to_string(),
        format!("-Wl,-rpath,{}", t.work.display()),
        "-ldl".to_string(),
    ];
    let exe =
        compile_with("test_preload", Lang::C, &[source("c/test_preload.c")], &our_include(), Link::Shared, &extra);
    // Outside a tag to the real runtime (the default), then to the arena too.
    for route_all in ["0", "1"] {
        let env = [
            ("LD_PRELOAD", preload.display().to_string()),
            ("VMM_ARENA_CONF", "backend:host,capacity:64MiB,chunk:2MiB".to_string()),
            ("VMM_ARENA_PRELOAD_ALL", route_all.to_string()),
            // The preloaded library comes before the sanitizer runtime; it
            // allocates nothing, so ASan's interceptors still see every allocation.
            ("ASAN_OPTIONS", "verify_asan_link_order=0".to_string()),
        ];
        let out = run_with_env(&exe, &env);
        let last = out.lines().last().unwrap_or("");
        assert!(last.contains("passed") && last.contains(" 0 failed"), "VMM_ARENA_PRELOAD_ALL={route_all}: {last:?}");
    }
}

/// The throwing PyTorch hook (a C++ shim in the shared library).
#[test]
fn torch_malloc_or_throw_throws_bad_alloc() {
    let exe =
        compile("test_torch_throw", Lang::Cxx, &[source("cpp/test_torch_throw.cpp")], &our_include(), Link::Shared);
    run_and_expect_pass(&exe);
}

#[test]
fn cpp_wrapper_test() {
    let exe = compile("test_wrapper", Lang::Cxx, &[source("cpp/test_wrapper.cpp")], &our_include(), Link::Shared);
    run_and_expect_pass(&exe);
}

/// The wrapper's RAII owners of exports and DMA-BUFs.
#[test]
fn cpp_export_wrapper_test() {
    let exe = compile(
        "test_export_wrapper",
        Lang::Cxx,
        &[source("cpp/test_export_wrapper.cpp")],
        &our_include(),
        Link::Shared,
    );
    run_and_expect_pass(&exe);
}

/// The wrapper's stream-ordered allocations.
#[test]
fn cpp_wrapper_stream_test() {
    let exe = compile(
        "test_wrapper_stream",
        Lang::Cxx,
        &[source("cpp/test_wrapper_stream.cpp")],
        &our_include(),
        Link::Shared,
    );
    run_and_expect_pass(&exe);
}

#[test]
fn headers_compile_as_c_and_cpp_with_warnings_as_errors() {
    // Each header alone in a translation unit, in both languages.
    let t = toolchain();
    for (lang, ext) in [(Lang::C, "c"), (Lang::Cxx, "cpp")] {
        for header in ["vmm_arena.h", "vmm_arena.hpp", "vmm_arena_handles.hpp"] {
            if lang == Lang::C && header.ends_with(".hpp") {
                continue;
            }
            let src = t.work.join(format!("only_{}.{ext}", header.replace('.', "_")));
            std::fs::write(&src, format!("#include \"{header}\"\nint vmm_arena_header_only_tu;\n")).unwrap();
            compile(&format!("only_{}_{ext}.o", header.replace('.', "_")), lang, &[src], &our_include(), Link::None);
        }
    }
}

/// The contract's own programs: written only from the contract header,
/// compiled against it and against ours, linked to libvmm_arena, run.
#[test]
fn programs_written_from_the_contract_run_against_the_library() {
    let Some(contract) = contract_header() else { return };
    let contract_dir = contract.parent().unwrap().to_path_buf();
    for (tag, include) in [("contract", contract_dir), ("generated", our_include())] {
        let exe = compile(&format!("contract_c_{tag}"), Lang::C, &test_api_sources(), &include, Link::Shared);
        run_and_expect_pass(&exe);
        let exe = compile(
            &format!("contract_cpp_{tag}"),
            Lang::Cxx,
            &[source("cpp/contract_program.cpp")],
            &include,
            Link::Shared,
        );
        run_and_expect_pass(&exe);
    }
}

/// Struct layouts, enum values and macro values are the same whichever
/// header a program is compiled with: a program generated from the
/// contract's declarations prints them all, built once with each header.
#[test]
fn layouts_and_values_match_the_contract() {
    let Some(contract) = contract_header() else { return };
    let items = parse_header(&std::fs::read_to_string(&contract).unwrap());
    let mut body = String::new();
    for (name, item) in &items {
        match &item.decl {
            Decl::Struct(fields) => {
                body += &format!(
                    "  printf(\"sizeof %s %zu align %zu\\n\", \"{name}\", sizeof({name}), _Alignof({name}));\n"
                );
                for (_, field) in fields {
                    body += &format!(
                        "  printf(\"{name}.{field} %zu %zu\\n\", offsetof({name}, {field}), sizeof((({name} *)0)->{field}));\n"
                    );
                }
            }
            Decl::Enum(vars) => {
                body += &format!("  printf(\"sizeof %s %zu\\n\", \"{name}\", sizeof({name}));\n");
                for (v, _) in vars {
                    body += &format!("  printf(\"{v} %lld\\n\", (long long){v});\n");
                }
            }
            Decl::Define(_) if name != "VMM_ARENA_H" => {
                body += &format!("  printf(\"{name} %llu %zu\\n\", (unsigned long long)({name}), sizeof({name}));\n");
            }
            Decl::Typedef(_) => {
                body += &format!("  printf(\"sizeof %s %zu\\n\", \"{name}\", sizeof({name}));\n");
            }
            _ => {}
        }
    }
    let t = toolchain();
    let src = t.work.join("layout.c");
    std::fs::write(
        &src,
        format!("#include <stddef.h>\n#include <stdio.h>\n#include \"vmm_arena.h\"\nint main(void) {{\n{body}  return 0;\n}}\n"),
    )
    .unwrap();
    let mut outputs = BTreeMap::new();
    for (tag, include) in [("contract", contract.parent().unwrap().to_path_buf()), ("generated", our_include())] {
        let exe = compile(&format!("layout_{tag}"), Lang::C, std::slice::from_ref(&src), &include, Link::Shared);
        outputs.insert(tag, run(&exe));
    }
    assert!(outputs["contract"].lines().count() > 40, "{}", outputs["contract"]);
    assert_eq!(outputs["contract"], outputs["generated"]);
}

/// In C++, redeclaring an `extern "C"` function with other parameter or
/// return types is an error, and a typedef may only be repeated with the
/// same type: a translation unit that includes our header and then repeats
/// every function and typedef of the contract, verbatim, compiles only if
/// they are declared identically. Enumerators keep their type and value.
#[test]
fn contract_declarations_repeat_cleanly_after_our_header_in_cpp() {
    let Some(contract) = contract_header() else { return };
    let items = parse_header(&std::fs::read_to_string(&contract).unwrap());
    let mut decls = String::new();
    let mut asserts = String::new();
    for (name, item) in &items {
        match &item.decl {
            Decl::Function(..) | Decl::Typedef(_) | Decl::Opaque => decls += &format!("{}\n", item.text),
            Decl::Enum(vars) => {
                for (v, value) in vars {
                    asserts += &format!("static_assert({v} == {value}, \"{v}\");\n");
                    asserts += &format!("static_assert(std::is_same<decltype({v}), {name}>::value, \"{v}\");\n");
                }
            }
            Decl::Define(value) if name != "VMM_ARENA_H" => {
                asserts += &format!("static_assert({name} == ({value}), \"{name}\");\n");
                asserts +=
                    &format!("static_assert(std::is_same<decltype({name}), decltype({value})>::value, \"{name}\");\n");
            }
            _ => {}
        }
    }
    let t = toolchain();
    let src = t.work.join("redeclare.cpp");
    std::fs::write(
        &src,
        format!("#include <type_traits>\n#include \"vmm_arena.h\"\nextern \"C\" {{\n{decls}}}\n{asserts}int vmm_arena_redeclare_tu;\n"),
    )
    .unwrap();
    compile("redeclare.o", Lang::Cxx, &[src], &our_include(), Link::None);
}

/// The CMake example's program, built here directly (the CMake build
/// itself runs in `ffi/examples/run-cmake-example.sh`).
#[test]
fn kv_cache_example_runs() {
    let exe = compile(
        "kv_cache",
        Lang::Cxx,
        &[ffi_dir().join("examples/kv_cache_cpp/main.cpp")],
        &our_include(),
        Link::Shared,
    );
    let out = run(&exe);
    assert!(out.contains("kv_cache: OK"), "{out}");
}
