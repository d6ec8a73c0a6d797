"""The exceptions the arena raises, all under VmmArenaError.

Defined here, in Python, so that they pickle (multiprocessing, Ray) and so
that InvalidArgument can also be a ValueError. The Rust extension raises
these very classes.
"""

__all__ = [
    "VmmArenaError", "InvalidArgument", "InvalidType", "OutOfMemory", "OutOfAddressSpace",
    "UnknownAllocation", "Pinned", "Asleep", "Stale", "Unsupported", "DriverError", "InternalError",
]


class VmmArenaError(Exception):
    """Base of every error the arena reports."""


class InvalidArgument(VmmArenaError, ValueError):
    """A bad argument: negative or too large a number, a value not allowed
    here (also a ValueError)."""


class InvalidType(InvalidArgument, TypeError):
    """An argument of the wrong type (an InvalidArgument and a TypeError)."""


class OutOfMemory(VmmArenaError):
    """The capacity (or the device) has no room for the request."""


class OutOfAddressSpace(VmmArenaError):
    """The reserved virtual range has no room for the request."""


class UnknownAllocation(VmmArenaError):
    """The allocation was freed, or belongs to another arena."""


class Pinned(VmmArenaError):
    """The allocation is pinned (or has DLPack views alive) and cannot move."""


class Asleep(VmmArenaError):
    """The allocation sleeps: wake its tag first."""


class Stale(VmmArenaError):
    """A prepared two-phase operation whose allocation changed since the prepare; nothing was done."""


class Unsupported(VmmArenaError):
    """Not supported by this backend."""


class DriverError(VmmArenaError):
    """The driver refused a call."""


class InternalError(VmmArenaError):
    """A bug in the library (reported, never a crash)."""


# Pickled and printed under the package's name, where users import them from.
for _cls in (VmmArenaError, InvalidArgument, InvalidType, OutOfMemory, OutOfAddressSpace, UnknownAllocation,
             Pinned, Asleep, Stale, Unsupported, DriverError, InternalError):
    _cls.__module__ = "vmm_arena"
del _cls
