//! `scripts/gpu-check.sh run` on this machine, without a GPU and without a
//! build: a device session gets one try of a few minutes and at
//! most eight files back, so the script must write its four result files
//! whatever happens, and must never stop at the first crash.
//!
//! The tests take well under a second plus the two seconds of the capped
//! hang; nothing here needs a GPU or cargo.

#![cfg(target_os = "linux")]

use std::collections::BTreeSet;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const RESULT_FILES: [&str; 4] = ["driver_latency.md", "gpu-check-logs.tar.gz", "pytorch_comparison.md", "summary.txt"];

fn repo() -> &'static Path {
    // This test lives in the simulator crate (the script builds its
    // gpu_measure); the script is at the workspace root.
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// False (with a message) where this binary runs away from its build tree:
/// gpu-check.sh carries every test binary to the GPU machine, and there the
/// script under test is not at the build tree's path. Wherever the build
/// tree is, the script must be too.
fn build_tree_here(test: &str) -> bool {
    if repo().join("Cargo.toml").is_file() {
        assert!(repo().join("scripts/gpu-check.sh").is_file(), "scripts/gpu-check.sh is missing");
        return true;
    }
    eprintln!("{test}: skipped: the build tree {} is not on this machine", repo().display());
    false
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("vmm-arena-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `bash SCRIPT run OUT` in `cwd` with no GPU and a clean environment
/// for the variables the script reads.
fn run(script: &Path, out: &Path, cwd: &Path, max_step_s: Option<u32>) -> Output {
    let mut cmd = Command::new("bash");
    cmd.arg(script).arg("run").arg(out).current_dir(cwd);
    cmd.env("VMM_ARENA_GPU_CHECK_NO_GPU", "1");
    for var in ["OUT", "VMM_ARENA_REQUIRE_GPU", "GPU_CHECK_MAX_STEP_S", "VMM_ARENA_FUZZ_INPUT"] {
        cmd.env_remove(var);
    }
    if let Some(s) = max_step_s {
        cmd.env("GPU_CHECK_MAX_STEP_S", s.to_string());
    }
    cmd.output().expect("bash runs")
}

fn files_in(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect()
}

fn summary(out: &Path) -> String {
    std::fs::read_to_string(out.join("summary.txt")).expect("summary.txt is written")
}

/// The status line of one step in summary.txt.
fn status<'a>(summary: &'a str, step: &str) -> &'a str {
    let prefix = format!("{step}:");
    summary
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no status line for {step} in:\n{summary}"))
}

fn tar_listing(out: &Path) -> String {
    let o = Command::new("tar").arg("tzf").arg(out.join("gpu-check-logs.tar.gz")).output().expect("tar runs");
    assert!(o.status.success(), "the log tarball is readable: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout).unwrap()
}

#[test]
#[cfg_attr(miri, ignore)] // runs processes
fn run_without_a_gpu_writes_the_four_files_and_says_no_gpu() {
    if !build_tree_here("run_without_a_gpu_writes_the_four_files_and_says_no_gpu") {
        return;
    }
    let tmp = TempDir::new("gpu-check-nogpu");
    let out = tmp.0.join("out");
    let o = run(&repo().join("scripts/gpu-check.sh"), &out, repo(), None);
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "exit {:?}; stderr:\n{stderr}", o.status.code());

    let expected: BTreeSet<String> = RESULT_FILES.iter().map(|s| s.to_string()).collect();
    assert_eq!(files_in(&out), expected, "exactly the four result files");

    let s = summary(&out);
    assert!(s.lines().next().unwrap().contains("no GPU"), "first line says no GPU:\n{s}");
    for step in ["cuda_backend", "gpu_measure", "pytorch"] {
        assert!(status(&s, step).contains("SKIPPED no GPU"), "{step}:\n{s}");
    }
    // scripts/ has no bin/: the test steps say so instead of failing.
    assert!(status(&s, "fuzz_replay").contains("SKIPPED not built"), "{s}");
    assert!(s.lines().count() <= 40, "one screen:\n{s}");
    for md in ["driver_latency.md", "pytorch_comparison.md"] {
        let text = std::fs::read_to_string(out.join(md)).unwrap();
        assert!(text.contains("no GPU"), "{md} says no GPU ran:\n{text}");
    }
    let listing = tar_listing(&out);
    assert!(listing.contains("status.txt") && listing.contains("summary.txt"), "{listing}");
}

fn write_exe(path: &Path, body: &str) {
    std::fs::write(path, body).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A bundle whose test binaries crash, hang, print no summary, cannot start
/// or pass: every one gets its own status line, and the steps after them
/// still run and the files are still written.
#[test]
#[cfg_attr(miri, ignore)] // runs processes
fn a_crash_a_hang_or_a_missing_summary_never_stops_the_run() {
    if !build_tree_here("a_crash_a_hang_or_a_missing_summary_never_stops_the_run") {
        return;
    }
    let tmp = TempDir::new("gpu-check-crash");
    let bundle = tmp.0.join("bundle");
    let bin = bundle.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::create_dir_all(bundle.join("fuzz/corpus/ops")).unwrap();
    std::fs::copy(repo().join("scripts/gpu-check.sh"), bundle.join("gpu-check.sh")).unwrap();
    write_exe(&bin.join("test-a_crash"), "#!/bin/sh\nulimit -c 0\necho running\nkill -SEGV $$\n");
    write_exe(&bin.join("test-b_hang"), "#!/bin/sh\nexec sleep 60\n");
    write_exe(&bin.join("test-c_quiet"), "#!/bin/sh\necho no summary here\nexit 3\n");
    write_exe(&bin.join("test-d_nostart"), "#!/nonexistent/interpreter\n");
    write_exe(&bin.join("test-e_good"), "#!/bin/sh\necho 'test result: ok. 7 passed; 0 failed; 0 ignored'\n");
    // Passes only when run where fuzz/corpus/ops is (the bundle's copy: the
    // working directory below has none).
    write_exe(
        &bin.join("test-fuzz_replay"),
        "#!/bin/sh\n[ -d fuzz/corpus/ops ] || { echo \"no corpus in $PWD\"; exit 1; }\n\
         echo 'test result: ok. 1 passed; 0 failed; 0 ignored'\n",
    );
    let elsewhere = tmp.0.join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();
    let out = tmp.0.join("out");

    let o = run(&bundle.join("gpu-check.sh"), &out, &elsewhere, Some(2));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "failures make exit 1; stderr:\n{stderr}");

    let s = summary(&out);
    assert!(status(&s, "a_crash").contains("FAILED rc=139") && status(&s, "a_crash").contains("signal 11"), "{s}");
    assert!(status(&s, "b_hang").contains("TIMEOUT"), "{s}");
    assert!(status(&s, "c_quiet").contains("FAILED rc=3") && status(&s, "c_quiet").contains("no test summary"), "{s}");
    assert!(status(&s, "d_nostart").contains("FAILED rc=12"), "{s}"); // 126 or 127
    assert!(status(&s, "e_good").contains("ok") && status(&s, "e_good").contains("7 passed"), "{s}");
    assert!(status(&s, "fuzz_replay").contains("ok"), "found the bundle's corpus:\n{s}");
    // The steps after the failures still reported.
    assert!(status(&s, "gpu_measure").contains("SKIPPED no GPU"), "{s}");
    assert!(status(&s, "pytorch").contains("SKIPPED no GPU"), "{s}");
    assert!(s.contains("4 step(s) FAILED or TIMEOUT"), "{s}");

    let expected: BTreeSet<String> = RESULT_FILES.iter().map(|s| s.to_string()).collect();
    assert_eq!(files_in(&out), expected);
    let listing = tar_listing(&out);
    for log in ["test-a_crash.log", "test-b_hang.log", "test-c_quiet.log", "test-e_good.log"] {
        assert!(listing.contains(log), "{log} in the tarball:\n{listing}");
    }
}

/// The GPU path's plumbing, with stand-ins: an `nvidia-smi` that names a
/// GPU, a `gpu_measure` and a `torch_check.py` that write their tables, and
/// an importable (empty) `torch`. The tables must reach the two Markdown
/// files, the CUDA tests must run with VMM_ARENA_REQUIRE_GPU=1, and the
/// PyTorch children must get 60 s each.
#[test]
#[cfg_attr(miri, ignore)] // runs processes
fn with_a_gpu_the_measurements_reach_the_markdown_tables() {
    if !build_tree_here("with_a_gpu_the_measurements_reach_the_markdown_tables") {
        return;
    }
    let tmp = TempDir::new("gpu-check-fakegpu");
    let bundle = tmp.0.join("bundle");
    let (bin, lib, fake) = (bundle.join("bin"), bundle.join("lib"), tmp.0.join("fake"));
    for d in [&bin, &lib, &fake.join("torch")] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::copy(repo().join("scripts/gpu-check.sh"), bundle.join("gpu-check.sh")).unwrap();
    std::fs::write(lib.join("libvmm_arena.so"), "").unwrap();
    std::fs::write(fake.join("torch/__init__.py"), "").unwrap();
    write_exe(&fake.join("nvidia-smi"), "#!/bin/sh\necho 'Fake H200, 999.99, 143771 MiB'\n");
    write_exe(
        &bin.join("test-cuda_backend"),
        "#!/bin/sh\n[ \"$VMM_ARENA_REQUIRE_GPU\" = 1 ] || exit 9\n\
         echo 'test result: ok. 12 passed; 0 failed; 0 ignored'\n",
    );
    write_exe(
        &bin.join("gpu_measure"),
        "#!/bin/sh\n\
         case \"$*\" in *'--kernel-variant broken'*) echo 'FAILED: attention_paged_broken (x): differs'; exit 1;; esac\n\
         case \"$*\" in *'--kernel-variant slow'*) echo '| paged | attention_paged_slow | 1 | 900.0 | 1-2 | 300 | 9 % | 0.100 | INVALID |'; exit 0;; esac\n\
         [ \"$1\" = --out ] || exit 9\n\
         printf '# CUDA VMM measurements\\n\\n| call | median |\\n|---|---|\\n| `cuMemCreate` | 12.5 |\\n' >\"$2/gpu-measure.md\"\n\
         echo '{\"status\": \"ok\"}' >\"$2/gpu-measure.json\"\n\
         echo '{\"name\": \"measured\", \"set_access_call_s\": 2e-05}' >\"$2/kv-profile.json\"\n",
    );
    std::fs::write(
        bundle.join("torch_check.py"),
        "import sys\nargs = sys.argv[1:]\nassert args[args.index('--timeout') + 1] == '60', args\n\
         out = args[args.index('--out') + 1]\n\
         open(out + '/torch-check.md', 'w').write('| allocator | peak |\\n|---|---|\\n| vmm-arena | 42 |\\n')\n",
    )
    .unwrap();
    let out = tmp.0.join("out");

    let path = format!("{}:{}", fake.display(), std::env::var("PATH").unwrap_or_default());
    let mut cmd = Command::new("bash");
    cmd.arg(bundle.join("gpu-check.sh")).arg("run").arg(&out).current_dir(&tmp.0);
    cmd.env("PATH", path).env("PYTHONPATH", &fake);
    for var in ["OUT", "VMM_ARENA_REQUIRE_GPU", "GPU_CHECK_MAX_STEP_S", "VMM_ARENA_GPU_CHECK_NO_GPU"] {
        cmd.env_remove(var);
    }
    let o = cmd.output().expect("bash runs");
    let stderr = String::from_utf8_lossy(&o.stderr);
    let s = summary(&out);
    assert!(o.status.success(), "exit {:?}; stderr:\n{stderr}\nsummary:\n{s}", o.status.code());

    assert!(s.lines().next().unwrap().contains("GPU: Fake H200"), "{s}");
    assert!(status(&s, "cuda_backend").contains("ok") && status(&s, "cuda_backend").contains("12 passed"), "{s}");
    assert!(status(&s, "gpu_measure").contains("ok"), "{s}");
    // The attention checks ran the deliberately broken and slow kernels and
    // saw them rejected.
    assert!(status(&s, "attention_broken_rejected").contains("ok"), "{s}");
    assert!(status(&s, "attention_slow_rejected").contains("ok"), "{s}");
    assert!(status(&s, "pytorch").contains("ok"), "{s}");
    let latency = std::fs::read_to_string(out.join("driver_latency.md")).unwrap();
    assert!(latency.contains("| `cuMemCreate` | 12.5 |"), "{latency}");
    let torch = std::fs::read_to_string(out.join("pytorch_comparison.md")).unwrap();
    assert!(torch.contains("| vmm-arena | 42 |"), "{torch}");
    // The four files, and the measured profile beside them.
    let mut expected: BTreeSet<String> = RESULT_FILES.iter().map(|s| s.to_string()).collect();
    expected.insert("kv-profile.json".into());
    assert_eq!(files_in(&out), expected);
    let profile = std::fs::read_to_string(out.join("kv-profile.json")).unwrap();
    assert!(profile.contains("set_access_call_s"), "{profile}");
    assert!(s.contains("kv-profile.json"), "the summary names it:\n{s}");
    assert!(tar_listing(&out).contains("gpu-measure.json"));
}
