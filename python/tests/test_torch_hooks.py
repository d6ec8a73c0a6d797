"""The PyTorch hooks the extension module exports, and vmm_arena.torch's
region / pause / resume over them, on the host backend: the calls PyTorch's
CUDAPluggableAllocator would make, made here through ctypes on the
installed extension file. `use()` and the MemPools need CUDA: the GPU check
runs them (docs/python-drop-ins.md)."""
import ctypes

import pytest

import vmm_arena as va
import vmm_arena.torch as vt

from conftest import MiB, fill, holds, mapped


def test_the_extension_exports_pytorchs_entry_points():
    lib = ctypes.CDLL(vt.library_path())
    for name in ("vmm_arena_torch_malloc_or_throw", "vmm_arena_torch_free", "vmm_arena_torch_malloc"):
        assert hasattr(lib, name), name
    assert vt.library_path() == va._vmm_arena.__file__


def test_the_host_backend_is_chosen_and_said_when_asked(hooks):
    assert vt.backend(0) == ("host", None)


def test_pause_without_a_tag_pauses_every_region_int_tags_included(hooks):
    # Issue 39, bug 1: region(5)'s memory stayed mapped after pause().
    with vt.region(5):
        a = hooks.malloc(4 * MiB)
    with vt.region("named"):
        b = hooks.malloc(4 * MiB)
    assert mapped() == 8 * MiB
    vt.pause()
    assert mapped() == 0
    vt.resume()
    assert mapped() == 8 * MiB
    fill(a, 1)
    fill(b, 2)


def test_memory_outside_any_region_is_never_paused_and_keeps_its_bytes(hooks):
    outside = hooks.malloc(4 * MiB)
    small_outside = hooks.malloc(1000)
    fill(outside, 7)
    fill(small_outside, 8)
    with vt.region("kv"):
        hooks.malloc(4 * MiB)
    vt.pause()
    assert mapped() == 4 * MiB + 2 * MiB, "only the region's memory went back"
    assert holds(outside, 7) and holds(small_outside, 8)
    vt.pause("kv")  # by name too
    assert holds(outside, 7)


def test_pause_and_resume_by_tag_touch_that_tag_only(hooks):
    with vt.region("weights", enable_cpu_backup=True):
        w = hooks.malloc(4 * MiB)
    with vt.region("kv"):
        k = hooks.malloc(4 * MiB)
    fill(w, 3)
    fill(k, 4)
    vt.pause("kv")
    assert mapped() == 4 * MiB and holds(w, 3)
    vt.pause("weights")
    assert mapped() == 0
    vt.resume("weights")
    assert mapped() == 4 * MiB and holds(w, 3), "restored from the CPU backup"
    vt.resume("kv")
    assert mapped() == 8 * MiB
    fill(k, 5)  # mapped again at the same address


def test_the_cpu_backup_is_chosen_per_allocation_within_one_tag(hooks):
    with vt.region("mixed", enable_cpu_backup=True):
        kept = hooks.malloc(4 * MiB)
    with vt.region("mixed"):
        dropped = hooks.malloc(4 * MiB)
    fill(kept, 9)
    fill(dropped, 9)
    vt.pause("mixed")
    assert vt.stats().backup_bytes == 4 * MiB, "only the backed-up allocation's bytes were copied"
    vt.resume("mixed")
    assert holds(kept, 9)


def test_disable_allocates_outside_the_region(hooks):
    with vt.region("kv"):
        inside = hooks.malloc(4 * MiB)
        with vt.disable():
            outside = hooks.malloc(4 * MiB)
        again = hooks.malloc(2 * MiB)
    tags = {p: t for p, _, t in vt.allocations()}
    assert tags[outside] == vt.OUTSIDE and tags[inside] == tags[again] == vt.tag_of("kv")
    fill(outside, 6)
    vt.pause()
    assert mapped() == 4 * MiB and holds(outside, 6)


def test_keep_resident_keeps_an_allocation_through_tagged_and_global_pauses(hooks):
    with vt.region("mixed", enable_cpu_backup=True):
        resident = hooks.malloc(4 * MiB)
        ordinary = hooks.malloc(4 * MiB)
    # An address inside the allocation names it.
    assert vt.keep_resident(resident + 1024, device=0) == 4 * MiB
    assert vt.keep_resident(resident, device=0) == 4 * MiB
    assert vt.keep_resident(12345, device=0) == 0, "not the arena's"
    fill(resident, 17)
    fill(ordinary, 29)
    for tag in ("mixed", None, "mixed"):
        vt.pause(tag)
        assert mapped() == 4 * MiB
        assert holds(resident, 17)
        vt.resume(tag)
        assert holds(ordinary, 29)
    vt.pause("mixed")
    with pytest.raises(va.Asleep):
        vt.keep_resident(ordinary, device=0)


def test_pause_and_resume_act_on_every_device(hooks):
    with vt.region("kv"):
        hooks.malloc(4 * MiB, device=0)
        hooks.malloc(4 * MiB, device=1)
    assert vt.devices() == [0, 1]
    vt.pause()
    assert mapped(0) == 0 and mapped(1) == 0
    vt.resume("kv")
    assert mapped(0) == 4 * MiB and mapped(1) == 4 * MiB


def test_a_bad_free_is_counted_and_changes_nothing(hooks):
    p = hooks.malloc(4 * MiB)
    hooks.vmm_arena_torch_free(p + 8, 0, 0, None)
    assert b"not allocated here" in hooks.vmm_arena_torch_last_error()
    assert vt.stats().bad_frees == 1 and vt.stats().live_allocations == 1


def test_configure_is_refused_once_an_arena_exists(hooks):
    hooks.malloc(1000)
    with pytest.raises(va.InvalidArgument):
        vt.configure("backend:host")
    with pytest.raises(TypeError):
        vt.tag_of(1.5)
