"""`pip install ./python` is the whole install: in a fresh process, from
a directory outside the source tree, with no VMM_ARENA_* variable set,
vmm_arena.torch finds its allocator hooks in the installed extension (no
second build, no VMM_ARENA_LIBRARY), picks a backend by itself (the host
one, and says so, where CUDA cannot start), and pauses and resumes a
region; the README's Python example runs as written."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"

TORCH_HOOKS = r"""
import ctypes, warnings
import vmm_arena, vmm_arena.torch as vt

assert vt.library_path() == vmm_arena._vmm_arena.__file__
lib = vt._load()
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    with vt.region("weights", enable_cpu_backup=True):
        p = lib.vmm_arena_torch_malloc(4 << 20, 0, None)
assert p, lib.vmm_arena_torch_last_error()
name, why = vt.backend(0)
if name == "host":
    assert why, "the host backend was chosen by itself: the reason is given"
    said = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert any("host memory" in m for m in said), said
    ctypes.memset(p, 7, 4 << 20)
    vt.pause()
    assert vt.stats(0).mapped_bytes == 0, vt.stats(0)
    vt.resume()
    assert ctypes.string_at(p, 4 << 20) == b"\x07" * (4 << 20), "the backup came back"
lib.vmm_arena_torch_free(p, 0, 0, None)
print("backend", name)
"""


def run_clean(code, tmp_path):
    """Runs `code` in a new interpreter, in `tmp_path`, with no VMM_ARENA_*
    variable and no PYTHONPATH: only the installed package is importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMM_ARENA") and k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


def test_the_torch_hooks_work_with_nothing_else_installed_or_set(tmp_path):
    out = run_clean(TORCH_HOOKS, tmp_path)
    assert out.startswith("backend "), out


def test_the_readmes_python_example_runs_as_written(tmp_path):
    if not README.is_file():
        pytest.skip("README.md is not beside the tests (an installed copy of them)")
    text = README.read_text()
    section = text[text.index("### From Python"):]
    example = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert "vmm_arena" in example
    out = run_clean(example, tmp_path)
    assert int(out.split()[-1]) > 0, out  # it prints the mapped bytes
