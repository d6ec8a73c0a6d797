"""The rest of the Python API on the host backend: typed stats, close() and
the context manager, prefetch and maintain, shared prefixes, batched
resizes, quiesce."""
from dataclasses import fields

import numpy as np
import pytest

import vmm_arena as va

K = 64 << 10


def arena(**kw):
    return va.Arena(backend="host", capacity_bytes=64 * K, reserve_bytes=256 * K, chunk_bytes=K, **kw)


def test_every_counter_is_a_typed_attribute():
    a = arena()
    x = a.alloc(3 * K)
    names = {f.name for f in fields(va.Stats)} - {"other", "bad_frees"}
    assert set(a.stats_dict()) == names, "Stats and the Rust counters disagree"
    assert set(a.snapshot()["stats"]) <= names, "the snapshot has a counter Stats lacks"
    s = a.stats()
    assert s.other == () and s.live_allocations == 1 and s.mapped_bytes == 3 * K and s.chunk_bytes == K
    assert all(isinstance(getattr(s, n), int) for n in names)
    x.free()


def test_close_frees_everything_gives_memory_back_and_refuses_new_work():
    a = arena()
    a.alloc(3 * K)
    a.alloc(100, tag=2)
    b = a.alloc_growable(K, max_size=4 * K)
    v = np.from_dlpack(b)
    with pytest.raises(va.Pinned):
        a.close()
    assert not a.closed and a.stats().live_allocations == 3, "a refused close changes nothing"
    del v
    a.close()
    s = a.stats()
    assert a.closed and s.live_allocations == 0 and s.mapped_bytes == 0 and s.pooled_bytes == 0
    with pytest.raises(va.InvalidArgument):
        a.alloc(K)
    a.close()  # twice: nothing


def test_the_context_manager_closes():
    with arena() as a:
        x = a.alloc(K)
        assert isinstance(a, va.Arena)
    assert a.closed
    with pytest.raises(va.UnknownAllocation):
        x.free()


def test_prefetch_is_done_by_maintain():
    a = arena()
    a.set_prefetch(4 * K, 0)
    a.maintain()
    assert a.stats().pooled_bytes >= 4 * K
    a.set_prefetch(0, 0)
    with pytest.raises(TypeError):
        a.set_prefetch("4", 0)


def test_alloc_shared_maps_a_prefix_without_copying():
    a = arena()
    src = a.alloc_growable(2 * K, max_size=4 * K)
    src.write(b"prefix")
    mapped = a.stats().mapped_bytes
    twin = a.alloc_shared(src, 0, K, max_size=4 * K)
    assert isinstance(twin, va.Buffer) and twin.read(0, 6) == b"prefix"
    assert a.stats().mapped_bytes == mapped and a.stats().shared_bytes == K
    twin.resize(3 * K)  # grows on its own chunks
    src.free()
    assert twin.read(0, 6) == b"prefix"
    with pytest.raises(va.InvalidArgument):
        a.alloc_shared(twin, 0, 100)  # not whole chunks


def test_resize_many_is_all_or_nothing():
    a = arena()
    x, y = a.alloc_growable(K, max_size=8 * K), a.alloc_growable(K, max_size=8 * K)
    ptrs = a.resize_many([(x, 2 * K), (y.id, 3 * K)])
    assert ptrs == [x.ptr, y.ptr] and (x.size, y.size) == (2 * K, 3 * K)
    with pytest.raises(va.OutOfMemory):
        a.resize_many([(x, 4 * K), (y, 200 * K)])
    assert (x.size, y.size) == (2 * K, 3 * K), "a failed batch changes nothing"
    with pytest.raises(TypeError):
        a.resize_many([x])
    v = np.from_dlpack(x)
    with pytest.raises(va.Pinned):
        a.resize_many([(x, K)])
    del v


def test_quiesce_and_unquiesce():
    a = arena()
    x = a.alloc_growable(2 * K, max_size=4 * K)
    a.quiesce_on_stream(x, 0)
    a.unquiesce(x)
    x.free()
    with pytest.raises(va.UnknownAllocation):
        a.quiesce_on_stream(x, 0)
