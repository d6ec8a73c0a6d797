"""Shared by the tests of the PyTorch hooks and the drop-in modules: fresh
host-backend arenas for the hooks, and helpers to call them as PyTorch would."""
import ctypes

import pytest

import vmm_arena.torch as vt

MiB = 1 << 20
CONF = "backend:host,capacity:64MiB,chunk:2MiB"


@pytest.fixture()
def hooks():
    """The hooks' library with fresh arenas (host backend) for one test."""
    for d in vt.devices():
        assert vt.release(d), f"a test left allocations on device {d}"
    vt.configure(CONF)
    lib = vt._load()
    live = []

    def malloc(n, device=0):
        p = lib.vmm_arena_torch_malloc(n, device, None)
        assert p, lib.vmm_arena_torch_last_error()
        live.append((p, device))
        return p

    def free(p):
        dev = next(d for q, d in live if q == p)
        live.remove((p, dev))
        lib.vmm_arena_torch_free(p, 0, dev, None)

    lib.malloc, lib.free_ = malloc, free
    yield lib
    vt.resume()
    for p, d in list(live):
        lib.vmm_arena_torch_free(p, 0, d, None)
    for d in vt.devices():
        assert vt.release(d)


def mapped(device=0):
    return vt.stats(device).mapped_bytes


def fill(p, byte, n=1000):
    ctypes.memset(p, byte, n)


def holds(p, byte, n=1000):
    return ctypes.string_at(p, n) == bytes([byte]) * n
