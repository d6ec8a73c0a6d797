"""Arguments and exceptions at the Python boundary: bytes-like writes, numbers
out of the C types' range, wrong types, pins of sleeping buffers, and
exceptions that survive pickling (multiprocessing, Ray)."""
import array
import pickle

import numpy as np
import pytest

import vmm_arena as va

K = 64 << 10


def arena(**kw):
    return va.Arena(backend="host", capacity_bytes=64 * K, reserve_bytes=256 * K, chunk_bytes=K, **kw)


@pytest.mark.parametrize(
    "data",
    [
        bytearray(b"abcdefgh"),
        memoryview(b"abcdefgh"),
        np.frombuffer(b"abcdefgh", dtype=np.uint8),
        np.frombuffer(b"abcdefgh", dtype=np.uint32),  # any item size: its bytes
        array.array("B", b"abcdefgh"),
    ],
    ids=["bytearray", "memoryview", "numpy-u8", "numpy-u32", "array"],
)
def test_write_takes_any_bytes_like_object(data):
    a = arena()
    x = a.alloc(64)
    x.write(data, 8)
    assert x.read(8, 8) == b"abcdefgh"


def test_write_of_a_strided_array_takes_its_bytes_in_order_and_wrong_types_are_refused():
    a = arena()
    x = a.alloc(64)
    x.write(np.arange(16, dtype=np.uint8)[::2], 16)
    assert x.read(16, 8) == bytes(range(0, 16, 2))
    for bad in ("text", 12, None, [1, 2]):
        with pytest.raises(TypeError):
            x.write(bad)
    assert x.read(0, 8) == bytes(8), "a refused write changes nothing"


@pytest.mark.parametrize("device", [2**40, 2**31, -1, -(2**40)])
def test_device_out_of_range_is_invalid_argument(device):
    with pytest.raises(va.InvalidArgument):
        va.Arena(backend="host", device=device)


def test_capacity_zero_is_refused_and_none_means_default():
    with pytest.raises(va.InvalidArgument):
        va.Arena(backend="host", capacity_bytes=0)
    for kw in ("reserve_bytes", "chunk_bytes"):
        with pytest.raises(va.InvalidArgument):
            va.Arena(backend="host", capacity_bytes=64 * K, **{kw: 0})
    va.Arena(backend="host", capacity_bytes=64 * K, reserve_bytes=None, chunk_bytes=None)


def test_invalid_argument_is_a_value_error_and_wrong_types_a_type_error():
    a = arena()
    assert issubclass(va.InvalidArgument, ValueError) and issubclass(va.InvalidArgument, va.VmmArenaError)
    with pytest.raises(ValueError):
        a.alloc(-1)
    for bad in ("12", 1.5, [1], True):
        with pytest.raises(TypeError):
            a.alloc(bad)
        with pytest.raises(va.InvalidArgument):
            a.alloc(bad)
    with pytest.raises(TypeError):
        va.Arena(backend="host", device="0")
    with pytest.raises(TypeError):
        va.Arena(backend=3)


def test_pin_of_a_sleeping_buffer_raises_asleep_with_or_without_views():
    a = arena()
    plain = a.alloc_growable(K, tag=1)
    viewed = a.alloc_growable(K, tag=1)
    v = np.from_dlpack(viewed)
    a.sleep(tag=1)
    with pytest.raises(va.Asleep):
        plain.pin()
    with pytest.raises(va.Asleep):
        viewed.pin()
    a.wake(tag=1)
    viewed.pin()  # awake again: allowed
    viewed.unpin()
    del v
    assert not va._vmm_arena._pinned_by_views(viewed)


@pytest.mark.parametrize(
    "exc",
    [va.VmmArenaError, va.InvalidArgument, va.OutOfMemory, va.OutOfAddressSpace, va.UnknownAllocation,
     va.Pinned, va.Asleep, va.Unsupported, va.DriverError, va.InternalError],
)
def test_exceptions_pickle_round_trip(exc):
    e = exc("what happened")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is exc and str(back) == "what happened"


def test_a_raised_arena_error_pickles():
    a = arena()
    with pytest.raises(va.OutOfMemory) as info:
        a.alloc(1000 * K)
    back = pickle.loads(pickle.dumps(info.value))
    assert type(back) is va.OutOfMemory and str(back) == str(info.value)
