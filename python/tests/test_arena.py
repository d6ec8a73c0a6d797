"""vmm_arena on the host backend: views through numpy and torch (CPU),
moves, growth, compaction, sleep and wake, tags on small allocations, bad
inputs, and a soak from two threads."""
import random
import sys
import threading

import numpy as np
import pytest

import vmm_arena as va

K = 64 << 10


def arena(cap=64, reserve=256, **kw):
    return va.Arena(backend="host", capacity_bytes=cap * K, reserve_bytes=reserve * K, chunk_bytes=K, **kw)


def test_numpy_view_survives_growth_in_place_and_reads_back():
    a = arena()
    b = a.alloc_growable(3 * K, max_size=16 * K)
    blocker = a.alloc(K)  # right after the reservation: growth past it must move
    assert blocker.ptr == b.ptr + 16 * K
    v = np.from_dlpack(b)
    assert v.shape == (3 * K,) and v.dtype == np.uint8
    v[:] = np.arange(3 * K) % 251
    p = b.ptr
    assert b.resize(10 * K) == p, "growth inside the reservation is in place"
    assert np.array_equal(np.frombuffer(b.read(0, 3 * K), np.uint8), np.arange(3 * K) % 251)
    assert np.array_equal(v, np.arange(3 * K) % 251), "the old view still reads the same bytes"
    blocker.pin()  # so that growth past the reservation cannot move it away instead
    with pytest.raises((va.Pinned, va.OutOfAddressSpace)):
        b.resize(40 * K)  # past the reservation: b would have to move
    assert b.ptr == p
    with pytest.raises(va.Pinned):
        b.resize(K)  # a shrink under a view
    with pytest.raises(va.Pinned):
        b.free()
    del v
    assert b.views == 0
    b.resize(40 * K)
    assert np.array_equal(np.frombuffer(b.read(0, 3 * K), np.uint8), np.arange(3 * K) % 251)


def test_torch_view_then_compaction_moves_it_and_the_callback_fires():
    torch = pytest.importorskip("torch")
    a = arena()
    moves = []
    a.set_move_callback(lambda i, old, new, size: moves.append((i, old, new, size)))
    hole = a.alloc(4 * K)
    b = a.alloc_growable(2 * K, max_size=2 * K)
    t = torch.from_dlpack(b)
    t.copy_(torch.arange(2 * K) % 199)
    hole.free()
    assert a.compact()["moved_allocations"] == 0, "a viewed buffer never moves"
    del t
    before = b.ptr
    report = a.compact()
    assert report["moved_allocations"] == 1 and b.ptr != before
    assert moves and moves[-1][0] == b.id and moves[-1][1] == before and moves[-1][2] == b.ptr
    t2 = torch.from_dlpack(b)
    assert torch.equal(t2, (torch.arange(2 * K) % 199).to(torch.uint8))


def test_an_exception_in_the_move_callback_does_not_poison_the_arena(monkeypatch):
    a = arena()
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_value))

    def bad(*_):
        raise RuntimeError("callback failed")

    a.set_move_callback(bad)
    hole = a.alloc(2 * K)
    b = a.alloc(2 * K)
    b.write(b"kept")
    hole.free()
    a.compact()
    assert [str(e) for e in reported] == ["callback failed"], "reported once, to sys.unraisablehook"
    assert b.read(0, 4) == b"kept"
    c = a.alloc(K)
    c.free()
    a.set_move_callback(None)
    assert a.stats().live_allocations == 1


def test_a_callback_calling_into_the_arena_is_refused_without_deadlock(monkeypatch):
    a = arena()
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_value))
    a.set_move_callback(lambda *_: a.stats())  # the arena is locked while it runs
    hole = a.alloc(2 * K)
    b = a.alloc(2 * K)
    hole.free()
    assert a.compact()["moved_allocations"] == 1
    assert len(reported) == 1 and isinstance(reported[0], va.InvalidArgument), reported
    assert a.stats().live_allocations == 1


def test_sleep_and_wake_with_backup_at_the_same_address():
    a = arena()
    w = a.alloc_growable(3 * K, max_size=8 * K, tag=1)
    k = a.alloc_growable(K, tag=2)
    np.from_dlpack(w)[:] = 5
    np.from_dlpack(k)[:] = 6
    p = w.ptr
    mapped = a.stats().mapped_bytes
    a.sleep(tag=1, backup=True)
    assert w.asleep and not k.asleep
    assert a.stats().mapped_bytes == mapped - 3 * K
    with pytest.raises(va.Asleep):
        np.from_dlpack(w)
    with pytest.raises(va.Asleep):
        w.resize(4 * K)
    a.wake(tag=1)
    assert w.ptr == p
    assert (np.from_dlpack(w) == 5).all() and (np.from_dlpack(k) == 6).all()


def test_backup_cache_keeps_the_last_cycles_backups_until_released():
    a = arena()
    w = a.alloc_growable(3 * K, max_size=8 * K, tag=1)
    np.from_dlpack(w)[:] = 7
    a.set_backup_cache(True)
    for _ in range(3):
        a.sleep(tag=1, backup=True)
        assert a.backup_cache_bytes == 0  # the buffer holds the sleeper's bytes
        a.wake(tag=1)
        assert a.backup_cache_bytes == 3 * K
        assert (np.from_dlpack(w) == 7).all()
    assert a.release_backup_cache() == 3 * K
    assert a.backup_cache_bytes == 0
    a.set_backup_cache(False)
    a.sleep(tag=1, backup=True)
    a.wake(tag=1)
    assert a.backup_cache_bytes == 0
    assert (np.from_dlpack(w) == 7).all()


def test_small_allocations_of_two_tags_one_asleep_the_other_intact():
    a = arena()
    ws = [a.alloc(1000, tag=1) for _ in range(4)]
    ks = [a.alloc(1000, tag=2) for _ in range(4)]
    assert {x.ptr // K for x in ws}.isdisjoint({x.ptr // K for x in ks})
    for i, x in enumerate(ws + ks):
        x.write(bytes([i]) * 1000)
    a.sleep(tag=1)
    assert all(x.asleep for x in ws) and not any(x.asleep for x in ks)
    for i, x in enumerate(ks, start=4):
        assert x.read() == bytes([i]) * 1000
    with pytest.raises(va.Asleep):
        ws[0].read()
    a.wake(tag=1)
    # A small allocation takes a new tag by moving into that tag's slab.
    ks[0].set_tag(1)
    assert ks[0].tag == 1 and ks[0].ptr // K == ws[0].ptr // K
    assert ks[0].read() == bytes([4]) * 1000


@pytest.mark.parametrize("bad", [-1, 2**64, 2**70, "12", 1.5, None, True, [1]])
def test_bad_sizes_raise_invalid_argument(bad):
    a = arena()
    with pytest.raises(va.InvalidArgument):
        a.alloc(bad)
    with pytest.raises(va.InvalidArgument):
        a.alloc_growable(K, max_size=bad if bad is not None else -1)


def test_every_bad_input_raises_the_documented_exception():
    a, other = arena(cap=4), arena()
    x = a.alloc(K)
    x.free()
    with pytest.raises(va.UnknownAllocation):
        x.free()
    with pytest.raises(va.UnknownAllocation):
        x.resize(10)
    with pytest.raises(va.UnknownAllocation):
        a.free(other.alloc(K))
    with pytest.raises(va.UnknownAllocation):
        a.free(12345)
    with pytest.raises(va.UnknownAllocation):
        a.free(0)
    with pytest.raises(va.InvalidArgument):
        a.alloc(0)
    with pytest.raises(va.InvalidArgument):
        a.alloc_growable(2 * K, max_size=K)
    with pytest.raises(va.OutOfMemory):
        a.alloc(100 * K)
    with pytest.raises(va.InvalidArgument):
        va.Arena(backend="tpu")
    with pytest.raises(va.InvalidArgument):
        a.sleep(tag=-1)
    with pytest.raises(va.InvalidArgument):
        a.set_move_callback(42)
    y = a.alloc(K)
    with pytest.raises(va.InvalidArgument):
        y.write(b"x" * (K + 1))
    with pytest.raises(va.InvalidArgument):
        y.read(0, K + 1)
    with pytest.raises(va.InvalidArgument):
        y.set_tag(2**32)
    y.pin()
    s = a.alloc(100)
    s.pin()
    with pytest.raises(va.Pinned):
        s.set_tag(3)
    assert issubclass(va.Pinned, va.VmmArenaError) and issubclass(va.OutOfAddressSpace, va.VmmArenaError)


def test_stats_snapshot_trim_and_free_on_stream():
    a = arena()
    x = a.alloc(3 * K)
    s = a.stats()
    assert isinstance(s, va.Stats) and s.live_allocations == 1 and s.mapped_bytes == 3 * K
    snap = a.snapshot()
    assert any(r["kind"] == "live" for r in snap["ranges"])
    a.free_on_stream(x, 0)
    assert a.stats().live_allocations == 0
    assert a.trim(0) == 3 * K and a.stats().pooled_bytes == 0


def test_soak_two_threads():
    a = arena(cap=64, reserve=512)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        mine = []
        try:
            for _ in range(1500):
                op = rng.random()
                if op < 0.35 or not mine:
                    size = rng.choice([100, 5000, K, 3 * K])
                    try:
                        x = a.alloc_growable(size, max_size=4 * K) if rng.random() < 0.5 else a.alloc(size, tag=seed)
                    except (va.OutOfMemory, va.OutOfAddressSpace):
                        continue
                    fill = bytes([rng.randrange(256)]) * 64
                    x.write(fill)
                    mine.append((x, fill))
                elif op < 0.6:
                    x, fill = mine.pop(rng.randrange(len(mine)))
                    assert x.read(0, 64) == fill
                    x.free()
                elif op < 0.8:
                    x, fill = rng.choice(mine)
                    try:
                        x.resize(rng.choice([64, 2 * K, 5 * K]))
                    except (va.OutOfMemory, va.OutOfAddressSpace, va.Pinned):
                        pass
                    assert x.read(0, 64) == fill
                elif op < 0.9:
                    x, fill = rng.choice(mine)
                    if isinstance(x, va.Buffer):
                        v = np.from_dlpack(x)
                        assert bytes(v[:64]) == fill
                        del v
                else:
                    a.compact()
            for x, fill in mine:
                assert x.read(0, 64) == fill
                x.free()
        except Exception as e:  # reported to the main thread
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(i,)) for i in (1, 2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    assert a.stats().live_allocations == 0


def test_torch_module_imports_and_names_tags_without_cuda():
    pytest.importorskip("torch")
    import vmm_arena.torch as vt

    assert vt.tag_of(None) == 0
    t = vt.tag_of("weights")
    assert vt.tag_of("weights") == t and vt.tag_of("kv_cache") != t
    with pytest.raises(TypeError):
        vt.tag_of(1.5)
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):
            vt.use()


def test_export_send_and_import_recv_share_the_memory_across_arenas():
    import socket

    ex = arena(exportable=True)
    im = arena()
    x = ex.alloc(3 * K)
    x.write(bytes([11]) * (3 * K))
    left, right = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with left, right:
        ex.export_send(x, left)
        y = im.import_recv(right)
        assert y.size == 3 * K and y.ptr != x.ptr
        assert y.read() == bytes([11]) * (3 * K)
        y.write(bytes([99]) * 7)  # the same memory: seen through the exporter
        assert x.read(0, 8) == bytes([99]) * 7 + bytes([11])
        # Refusals: an arena made without exportable chunks, a bad socket,
        # a peer that sent something else.
        plain = arena()
        with pytest.raises(va.Unsupported):
            plain.export_send(plain.alloc(K), left)
        with pytest.raises(va.InvalidArgument):
            ex.export_send(x, -1)
        left.send(b"not an export")
        with pytest.raises(va.InvalidArgument):
            im.import_recv(right)
    im.free(y)
    ex.free(x)
    assert im.stats().live_allocations == 0


def test_a_block_pool_of_one_chunk_allocations_makes_no_driver_call_once_warm():
    """An engine's paged KV pool over the arena (examples/block_pool.rs):
    a block is a one-chunk allocation, its block-table entry the chunk's
    number from the arena's base. Freed blocks' chunks stay mapped where
    they lie, so a second wave needing no more blocks at once is served
    with no driver call, from the same chunks; trim gives them back."""
    a = arena(cap=64)
    base, _ = a.va_range

    def calls():
        s = a.stats()
        return s.driver_creates + s.driver_maps + s.driver_unmaps + s.driver_releases + s.driver_access_calls

    def wave(blocks):
        held = [a.alloc(K) for _ in range(blocks)]
        for i, b in enumerate(held):
            b.write(i.to_bytes(8, "little"))
        chunks = {(b.ptr - base) // K for b in held}
        assert all(b.ptr % K == base % K for b in held), "a block is a whole chunk"
        for i, b in enumerate(held):
            assert b.read(0, 8) == i.to_bytes(8, "little")
        for b in held[::2] + held[1::2]:  # freed out of order
            a.free(b)
        return chunks

    first = wave(40)
    cold = calls()
    assert a.stats().driver_creates == 40
    second = wave(33)
    assert calls() == cold, "a warm pool makes no driver call"
    assert second <= first, "every block of the second wave is a chunk of the first"
    assert a.trim(0) == 40 * K
    assert a.stats().pooled_bytes == 0
