"""vmm_arena.torch_memory_saver and vmm_arena.vllm against the peers'
documented behaviours (docs/python-drop-ins.md numbers them: TMS-n, VLLM-n),
on the host backend through the hooks PyTorch would call. The ones that need
a GPU (real tensors, MemPools, CUDA graphs) are listed there as GPU-only."""
import ctypes
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import vmm_arena as va
import vmm_arena.torch as vt
from vmm_arena.torch_memory_saver import TorchMemorySaver, configure_subprocess, memory_saver, torch_memory_saver
from vmm_arena.vllm import CuMemAllocator

from conftest import CONF, MiB, fill, holds, mapped

tms = torch_memory_saver


# torch_memory_saver


def test_tms1_region_memory_is_released_by_pause_and_mapped_back_by_resume_at_its_address(hooks):
    with tms.region():
        p = hooks.malloc(4 * MiB)
    tms.pause()
    assert mapped() == 0
    tms.resume()
    assert mapped() == 4 * MiB and [a for a, _, _ in vt.allocations()] == [p]
    fill(p, 1)


def test_tms2_memory_outside_a_region_is_never_paused(hooks):
    normal = hooks.malloc(4 * MiB)
    fill(normal, 5)
    with tms.region():
        hooks.malloc(4 * MiB)
    tms.pause()
    assert mapped() == 4 * MiB and holds(normal, 5)


def test_tms3_tags_pause_and_resume_selectively_in_any_order(hooks):
    with tms.region(tag="type1"):
        hooks.malloc(4 * MiB)
    with tms.region(tag="type2"):
        hooks.malloc(2 * MiB)
    tms.pause("type1")
    assert mapped() == 2 * MiB
    tms.pause("type2")
    assert mapped() == 0
    tms.resume("type2")
    assert mapped() == 2 * MiB
    tms.resume("type1")
    assert mapped() == 6 * MiB
    tms.pause("type1")
    tms.resume("type1")
    assert mapped() == 6 * MiB


def test_tms4_content_is_kept_only_with_enable_cpu_backup(hooks):
    with tms.region(tag="demo", enable_cpu_backup=True):
        kept = hooks.malloc(4 * MiB)
    with tms.region(tag="other"):
        hooks.malloc(4 * MiB)
    fill(kept, 42)
    tms.pause()
    assert va.Stats is type(vt.stats()) and vt.stats().backup_bytes == 4 * MiB
    tms.resume()
    assert holds(kept, 42)


def test_tms5_pause_and_resume_with_no_tag_cover_every_tag(hooks):
    for tag in ("a", "b", 7):
        with tms.region(tag=tag):
            hooks.malloc(2 * MiB)
    tms.pause(None)
    assert mapped() == 0
    tms.resume(None)
    assert mapped() == 6 * MiB


def test_tms6_disable_inside_a_region_allocates_untracked_memory(hooks):
    with tms.region(tag="kv"):
        with tms.disable():
            untracked = hooks.malloc(4 * MiB)
    fill(untracked, 3)
    tms.pause()
    assert mapped() == 4 * MiB and holds(untracked, 3)


def test_tms7_keep_resident_protects_an_allocation_and_refuses_a_paused_one(hooks):
    with tms.region(tag="mixed", enable_cpu_backup=True):
        resident = hooks.malloc(4 * MiB)
        ordinary = hooks.malloc(4 * MiB)
    assert vt.keep_resident(resident + 4096, device=0) == 4 * MiB
    fill(resident, 17)
    fill(ordinary, 29)
    for tag in ("mixed", None, "mixed"):
        tms.pause(tag)
        assert holds(resident, 17) and mapped() == 4 * MiB
        tms.resume(tag)
        assert holds(ordinary, 29)
    tms.pause("mixed")
    with pytest.raises(va.Asleep):
        vt.keep_resident(ordinary, device=0)


def test_kept_backups_are_reused_by_the_next_pause_and_freed_on_request(hooks):
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = hooks.malloc(4 * MiB)
    fill(w, 41)
    assert vt.keep_backups(True) == 0
    for _ in range(3):
        tms.pause("weights")
        assert mapped() == 0
        tms.resume("weights")
        assert holds(w, 41)
        # The spent backup is kept for the next pause.
        assert vt.stats().backup_bytes == 0
    assert vt.keep_backups(False) == 4 * MiB
    tms.pause("weights")
    tms.resume("weights")
    assert holds(w, 41) and vt.keep_backups(False) == 0


def test_tms8_every_affected_device_is_paused(hooks):
    with tms.region():
        hooks.malloc(2 * MiB, device=0)
        hooks.malloc(2 * MiB, device=1)
    tms.pause()
    assert mapped(0) == mapped(1) == 0
    tms.resume()
    assert mapped(0) == mapped(1) == 2 * MiB


def test_tms9_the_object_its_aliases_and_properties():
    assert memory_saver is torch_memory_saver and isinstance(TorchMemorySaver(), TorchMemorySaver)
    assert tms.enabled is True
    tms.hook_mode = "torch"
    assert tms.hook_mode == "torch"
    with pytest.raises(ValueError):
        tms.hook_mode = "ld_preload"
    # This process was not started under the preload library (TMS-10 runs
    # a child that is): said so, and the mode stays.
    assert not vt.preloaded()
    with pytest.raises(RuntimeError, match="configure_subprocess"):
        tms.hook_mode = "preload"
    assert tms.hook_mode == "torch"


# A child started inside configure_subprocess(): its raw cudaMalloc/cudaFree
# (as NCCL or an extension would call them) are the arena's, with the
# region's tag; pause/resume cover them; memory outside a region is kept.
PRELOADED_CHILD = r"""
import ctypes
import vmm_arena.torch as vt
from vmm_arena.torch_memory_saver import torch_memory_saver as tms

tms.hook_mode = "preload"
assert tms.hook_mode == "preload" and vt.preloaded()
rt = ctypes.CDLL(None)  # the symbols any library in the process resolves
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
rt.cudaFree.argtypes = [ctypes.c_void_p]
MiB = 1 << 20


def malloc(n):
    p = ctypes.c_void_p()
    assert rt.cudaMalloc(ctypes.byref(p), n) == 0
    return p.value


# Outside a region: the CUDA runtime's memory where one is loaded (as in
# torch_memory_saver); none is loaded yet here, so the arena's (tag 0).
outside = malloc(2 * MiB)
with tms.region("kv"):
    kv = malloc(4 * MiB)
with tms.region("weights", enable_cpu_backup=True):
    w = malloc(4 * MiB)
for p, byte in ((outside, 1), (kv, 2), (w, 3)):
    ctypes.memset(p, byte, MiB)
tags = {p: t for p, _, t in vt.allocations()}
assert tags == {outside: 0, kv: vt.tag_of("kv"), w: vt.tag_of("weights", True)}, tags
full = vt.stats().mapped_bytes
tms.pause("kv")
assert vt.stats().mapped_bytes == full - 4 * MiB
tms.pause()
assert vt.stats().mapped_bytes == full - 8 * MiB
assert ctypes.string_at(outside, MiB) == bytes([1]) * MiB
tms.resume()
assert vt.stats().mapped_bytes == full
assert ctypes.string_at(w, MiB) == bytes([3]) * MiB
for p in (outside, kv, w):
    assert rt.cudaFree(p) == 0
assert vt.allocations() == [] and vt.stats().bad_frees == 0
print("preloaded child passed")
"""


def test_tms10_preload_mode_catches_a_child_processs_raw_cuda_allocations(hooks, tmp_path):
    before = {k: os.environ.get(k) for k in ("LD_PRELOAD", "VMM_ARENA_PRELOAD_HOOKS", "VMM_ARENA_CONF")}
    with configure_subprocess():
        env = dict(os.environ)
    assert {k: os.environ.get(k) for k in before} == before, "configure_subprocess() left the environment changed"
    library = vt.preload_library()
    assert os.path.isfile(library) and env["LD_PRELOAD"].split()[0] == library
    assert env["VMM_ARENA_PRELOAD_HOOKS"] == vt.library_path()
    assert env["VMM_ARENA_CONF"] == CONF  # what configure() set (the hooks fixture)
    child = subprocess.run([sys.executable, "-c", PRELOADED_CHILD], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert "preloaded child passed" in child.stdout
    # A program that never loads CUDA (or Python) runs unchanged under it.
    assert subprocess.run(["/bin/sh", "-c", "exit 7"], env=env, timeout=60).returncode == 7


def test_tms11_memory_margin_bytes_refuses_an_allocation_that_would_leave_less_free(hooks):
    assert tms.memory_margin_bytes == 0
    tms.memory_margin_bytes = 60 * MiB  # of the 64 MiB arena
    try:
        assert tms.memory_margin_bytes == 60 * MiB
        with tms.region():
            kept = hooks.malloc(4 * MiB)  # leaves 60 MiB: allowed
            assert hooks.vmm_arena_torch_malloc(2 * MiB, 0, None) is None  # would leave 58
        assert b"memory_margin_bytes" in hooks.vmm_arena_torch_last_error()
        assert vt.stats().live_allocations == 1 and mapped() == 4 * MiB
        # Freed memory counts as free again.
        hooks.free_(kept)
        assert hooks.malloc(4 * MiB)
        tms.memory_margin_bytes = 0
        assert hooks.malloc(2 * MiB)
    finally:
        tms.memory_margin_bytes = 0
    with pytest.raises(TypeError):
        tms.memory_margin_bytes = 1.5
    with pytest.raises(ValueError):
        tms.memory_margin_bytes = -1


class _PausedTensor:
    """What get_cpu_backup reads of a CUDA tensor (its address, dtype,
    shape), over memory the hooks handed out: real CUDA tensors need a GPU."""

    def __init__(self, ptr, dtype, shape):
        import torch

        self.ptr, self.dtype, self.shape = ptr, dtype, torch.Size(shape)
        self.device = torch.device("cuda", 0)

    def numel(self):
        return self.shape.numel()

    def element_size(self):
        import torch

        return torch.empty(0, dtype=self.dtype).element_size()

    def is_contiguous(self):
        return True

    def data_ptr(self):
        return self.ptr


def test_tms12_get_cpu_backup_copies_a_paused_tensors_backup(hooks):
    torch = pytest.importorskip("torch")
    with tms.region("weights", enable_cpu_backup=True):
        w = hooks.malloc(4 * MiB)
    with tms.region("kv"):
        kv = hooks.malloc(1 * MiB)
    values = torch.arange(1024, dtype=torch.float32)
    ctypes.memmove(w + 4096, values.numpy().tobytes(), 4096)
    x = _PausedTensor(w + 4096, torch.float32, (32, 32))
    assert tms.get_cpu_backup(x) is None, "not paused: no backup"
    tms.pause()
    backup = tms.get_cpu_backup(x)
    assert backup.device.type == "cpu" and backup.dtype == torch.float32 and backup.shape == (32, 32)
    assert torch.equal(backup.flatten(), values)
    assert vt.stats().mapped_bytes == 0, "reading the backup does not resume it"
    assert tms.get_cpu_backup(_PausedTensor(kv, torch.float32, (16,))) is None, "paused without a backup"
    assert vt.cpu_backup(0x1000, 16) is None, "not the arena's memory"
    with pytest.raises(ValueError):
        vt.cpu_backup(w + 4 * MiB - 8, 16)  # runs past the allocation's end
    tms.resume()


def test_allocation_read_backup_reads_a_sleeping_allocation():
    with va.Arena(backend="host", capacity_bytes=8 * MiB, chunk_bytes=64 << 10) as arena:
        a = arena.alloc(100_000, tag=3)
        a.write(bytes(range(256)) * 10)
        with pytest.raises(va.InvalidArgument):
            a.read_backup()
        arena.sleep(3, backup=True)
        assert a.read_backup(256, 10) == bytes(range(10))
        assert a.read_backup()[:2560] == bytes(range(256)) * 10
        arena.wake(3)


# A child with a CUDA runtime loaded (the C tests' stand-in, as PyTorch would
# load the real one): raw allocations outside a region are the runtime's, as
# in torch_memory_saver's preload mode; inside one, the arena's.
ROUTING_CHILD = r"""
import ctypes, sys
import vmm_arena.torch as vt
from vmm_arena.torch_memory_saver import torch_memory_saver as tms

runtime = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
tms.hook_mode = "preload"
rt = ctypes.CDLL(None)
rt.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
rt.cudaFree.argtypes = [ctypes.c_void_p]


def malloc(n):
    p = ctypes.c_void_p()
    assert rt.cudaMalloc(ctypes.byref(p), n) == 0
    return p.value


outside = malloc(1 << 20)
assert runtime.fake_cudart_mallocs() == 1 and vt.allocations() == []
with tms.region("kv"):
    inside = malloc(1 << 20)
assert runtime.fake_cudart_mallocs() == 1
assert [(p, t) for p, _, t in vt.allocations()] == [(inside, vt.tag_of("kv"))]
assert rt.cudaFree(inside) == 0 and rt.cudaFree(outside) == 0
assert runtime.fake_cudart_frees() == 1 and vt.allocations() == []
print("routing child passed")
"""


def test_tms10_preload_mode_leaves_allocations_outside_regions_to_the_cuda_runtime(hooks, tmp_path):
    source = Path(__file__).resolve().parents[2] / "ffi" / "tests" / "c" / "fake_cudart.c"
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None or not source.is_file():
        pytest.skip("needs a C compiler and the repository's ffi/tests/c/fake_cudart.c")
    runtime = tmp_path / "libfake_cudart.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(runtime), str(source)], check=True, timeout=120)
    with configure_subprocess():
        env = dict(os.environ)
    child = subprocess.run([sys.executable, "-c", ROUTING_CHILD, str(runtime)], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr
    assert "routing child passed" in child.stdout


# vLLM's CuMemAllocator


def test_vllm1_get_instance_is_a_singleton():
    assert CuMemAllocator.get_instance() is CuMemAllocator.get_instance()
    assert CuMemAllocator.default_tag == "default"


def test_vllm2_only_memory_in_the_pool_sleeps(hooks):
    a = CuMemAllocator.get_instance()
    outside = hooks.malloc(4 * MiB)
    fill(outside, 11)
    with a.use_memory_pool(tag="weights"):
        hooks.malloc(4 * MiB)
    a.sleep()
    assert mapped() == 4 * MiB and holds(outside, 11)
    a.wake_up()


def test_vllm3_sleep_offloads_the_tags_named_and_discards_the_rest(hooks):
    a = CuMemAllocator.get_instance()
    with a.use_memory_pool(tag="weights"):
        w = hooks.malloc(4 * MiB)
    with a.use_memory_pool(tag="kv_cache"):
        hooks.malloc(4 * MiB)
    fill(w, 21)
    a.sleep(offload_tags=("weights",))
    s = vt.stats()
    assert s.mapped_bytes == 0 and s.backup_bytes == 4 * MiB, "kv_cache discarded, not copied"
    a.wake_up()
    assert mapped() == 8 * MiB and holds(w, 21)


def test_vllm4_sleep_defaults_to_offloading_the_default_tag_and_takes_a_str(hooks):
    a = CuMemAllocator.get_instance()
    with a.use_memory_pool():
        d = hooks.malloc(2 * MiB)
    with a.use_memory_pool(tag="kv_cache"):
        k = hooks.malloc(2 * MiB)
    fill(d, 1)
    fill(k, 2)
    a.sleep()
    assert vt.stats().backup_bytes == 2 * MiB
    a.wake_up()
    assert holds(d, 1)
    fill(k, 2)  # discarded by that sleep
    a.sleep(offload_tags="kv_cache")
    assert vt.stats().backup_bytes == 2 * MiB
    a.wake_up()
    assert holds(k, 2)


def test_vllm5_a_level_2_sleep_discards_everything_even_after_an_offloading_sleep(hooks):
    a = CuMemAllocator.get_instance()
    with a.use_memory_pool(tag="weights"):
        hooks.malloc(4 * MiB)
    a.sleep(offload_tags=("weights",))
    a.wake_up()
    a.sleep(offload_tags=())
    s = vt.stats()
    assert s.mapped_bytes == 0 and s.backup_bytes == 0
    a.wake_up()


def test_vllm6_wake_up_maps_back_only_the_tags_named(hooks):
    a = CuMemAllocator.get_instance()
    with a.use_memory_pool(tag="weights"):
        w = hooks.malloc(4 * MiB)
    with a.use_memory_pool(tag="kv_cache"):
        hooks.malloc(2 * MiB)
    fill(w, 8)
    a.sleep(offload_tags=("weights",))
    a.wake_up(tags=["weights"])
    assert mapped() == 4 * MiB and holds(w, 8)
    a.wake_up(tags=["kv_cache"])
    assert mapped() == 6 * MiB


def test_vllm7_get_current_usage_counts_the_pools_live_bytes_asleep_or_awake(hooks):
    a = CuMemAllocator.get_instance()
    hooks.malloc(4 * MiB)  # outside the pool: not counted
    with a.use_memory_pool(tag="weights"):
        w = hooks.malloc(4 * MiB)
        hooks.malloc(1000)
    assert a.get_current_usage() == 4 * MiB + 1000
    a.sleep()
    assert a.get_current_usage() == 4 * MiB + 1000
    a.wake_up()
    hooks.free_(w)
    assert a.get_current_usage() == 1000


def test_vllm8_sleep_and_wake_cover_every_device(hooks):
    a = CuMemAllocator.get_instance()
    with a.use_memory_pool():
        hooks.malloc(2 * MiB, device=0)
        hooks.malloc(2 * MiB, device=1)
    a.sleep()
    assert mapped(0) == mapped(1) == 0
    a.wake_up()
    assert mapped(0) == mapped(1) == 2 * MiB


def test_vllm9_a_tag_must_be_a_str():
    with pytest.raises(TypeError):
        with CuMemAllocator.get_instance().use_memory_pool(tag=3):
            pass
