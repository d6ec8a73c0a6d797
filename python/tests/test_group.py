"""vmm_arena.Group (one arena per device, allocations on every member at
once, all or nothing) on the host backend: two or three arenas stand for
the devices of a tensor-parallel group."""
import ctypes

import pytest

import vmm_arena as va

MiB = 1 << 20


def group(devices=(0, 1), **kw):
    kw.setdefault("capacity_bytes", 16 * MiB)
    kw.setdefault("chunk_bytes", 64 << 10)
    return va.Group(list(devices), backend="host", **kw)


def test_an_allocation_is_made_on_every_member_with_its_own_address():
    g = group((0, 1, 2))
    assert g.devices == [0, 1, 2] and len(g) == 3
    gid, ptrs = g.alloc(1 * MiB)
    assert len(ptrs) == 3 and len(set(ptrs)) == 3
    for i, p in enumerate(ptrs):
        ctypes.memset(p, i + 1, MiB)
    assert [ctypes.string_at(p, 4) for p in ptrs] == [bytes([i + 1]) * 4 for i in range(3)]
    assert [q["size"] for q in g.query(gid)] == [MiB] * 3
    assert [q["ptr"] for q in g.query(gid)] == ptrs
    assert len(g.member_ids(gid)) == 3
    assert g.live_allocations == 1
    assert [s.live_allocations for s in g.stats()] == [1, 1, 1]
    assert isinstance(g.stats()[0], va.Stats)
    g.free(gid)
    assert g.live_allocations == 0 and [s.live_bytes for s in g.stats()] == [0, 0, 0]
    with pytest.raises(va.UnknownAllocation):
        g.free(gid)


def test_growable_allocations_resize_on_every_member():
    g = group()
    gid, before = g.alloc_growable(256 << 10, 4 * MiB)
    ctypes.memset(before[1], 7, 256 << 10)
    after = g.resize(gid, 2 * MiB)
    assert len(after) == 2
    assert [q["size"] for q in g.query(gid)] == [2 * MiB] * 2
    assert ctypes.string_at(after[1], 16) == bytes([7]) * 16, "growth keeps the bytes"
    # Past the reservation of a growable allocation that cannot move: an
    # error, and every member keeps its size.
    with pytest.raises(va.VmmArenaError):
        g.resize(gid, 64 * MiB)
    assert [q["size"] for q in g.query(gid)] == [2 * MiB] * 2
    g.free(gid)


def test_a_failure_leaves_every_member_as_it_was():
    g = group(capacity_bytes=2 * MiB)
    gid, _ = g.alloc(1 * MiB)
    with pytest.raises(va.OutOfMemory):
        g.alloc(4 * MiB)
    assert g.live_allocations == 1
    assert [s.live_allocations for s in g.stats()] == [1, 1]
    g.free(gid)


def test_bad_arguments_are_refused_clearly():
    with pytest.raises(va.InvalidArgument):
        group((0, 0))  # devices must be distinct
    with pytest.raises(va.InvalidArgument):
        va.Group([0], backend="tpu")
    with pytest.raises(TypeError):
        group(("a", 1))
    g = group()
    with pytest.raises(va.UnknownAllocation):
        g.free(0)
    with pytest.raises(va.UnknownAllocation):
        g.query(12345)
    with pytest.raises(TypeError):
        g.alloc("big")
    with pytest.raises(ValueError):
        g.alloc(-1)


def test_snapshot_covers_the_members():
    g = group()
    gid, _ = g.alloc(MiB)
    snap = g.snapshot()
    assert snap["devices"] == [0, 1]
    assert [(a["id"], a["size"], len(a["ids"])) for a in snap["allocations"]] == [(gid, MiB, 2)]
    g.free(gid)
