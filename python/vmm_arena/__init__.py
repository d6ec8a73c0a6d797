"""vmm_arena: a GPU memory arena over CUDA virtual memory management.

One large virtual range backed by physical chunks: allocations grow in
place, move by remapping, compact, and sleep (their memory goes back to the
driver) and wake at the same addresses, by tag.

    import numpy as np, vmm_arena
    arena = vmm_arena.Arena(backend="host", capacity_bytes=64 << 20)
    kv = arena.alloc_growable(1 << 20, max_size=16 << 20, tag=1)
    view = np.from_dlpack(kv)          # uint8[1 MiB], no copy; pins kv
    view[:4] = [1, 2, 3, 4]
    del view                           # kv may move again
    kv.resize(8 << 20)                 # grows in place (inside its reservation)
    arena.sleep(tag=1, backup=True); arena.wake(tag=1)

Errors are exceptions under VmmArenaError (vmm_arena.errors; they pickle):
InvalidArgument (negative or too large numbers, bad values; also a
ValueError) and its subclass InvalidType (a wrong type; also a TypeError),
OutOfMemory, OutOfAddressSpace, UnknownAllocation (freed, or of another
arena), Pinned (pinned, or DLPack views alive), Asleep, Unsupported,
DriverError, InternalError.

Tags: every allocation has one (0 unless given), small ones included: small
allocations (at most half a chunk) share slabs only with allocations of
their tag, so a tag sleeps and wakes with its neighbours untouched.
`Allocation.set_tag` on a small one moves it (a copy) into a slab of the new
tag, refused while it is pinned (Pinned) or asleep (Asleep).

DLPack views (`numpy.from_dlpack(buf)`, `torch.from_dlpack(buf)`) of a
growable `Buffer`: a view covers the bytes the buffer had when it was taken,
at the address it had then, and pins the buffer until it is released, so a
view is never left at an old address: compaction leaves the buffer where it
is, growth inside its reservation is in place (take a new view to see the new
bytes), and growth past the reservation, a shrink and free raise Pinned while
a view is alive. A sleeping buffer keeps its address: views are valid again
after wake, and must not be touched while it sleeps.

Modules: vmm_arena.torch (PyTorch's allocator hooks, regions that pause and
resume), vmm_arena.torch_memory_saver and vmm_arena.vllm (drop-ins with
those projects' names; docs/python-drop-ins.md), vmm_arena.layout (the
block-in-chunk KV layout: block tables and per-layer views in the shape
paged attention kernels take), vmm_arena.transformers. Type stubs ship with
the package (py.typed).
"""

from dataclasses import dataclass, fields
import json as _json

from ._vmm_arena import ALL_TAGS, Allocation, Buffer  # noqa: F401
from .errors import (  # noqa: F401
    Asleep,
    DriverError,
    InternalError,
    InvalidArgument,
    InvalidType,
    OutOfAddressSpace,
    OutOfMemory,
    Pinned,
    Stale,
    Unsupported,
    UnknownAllocation,
    VmmArenaError,
)
from ._vmm_arena import Arena as _Arena
from ._vmm_arena import Group as _Group

__all__ = [
    "ALL_TAGS", "Allocation", "Arena", "Asleep", "Buffer", "DriverError", "Group", "InternalError",
    "InvalidArgument", "InvalidType", "OutOfAddressSpace", "OutOfMemory", "Pinned", "Stale", "Stats", "Unsupported",
    "UnknownAllocation", "VmmArenaError",
]


@dataclass(frozen=True)
class Stats:
    """The arena's counters and sizes, one attribute each (bytes unless named
    otherwise; the meaning of each is documented on vmm_arena::Stats in the
    Rust API). `bad_frees` is the PyTorch hooks' count of frees of pointers
    they never handed out (0 for an Arena); `other` holds any counter this
    version of the package does not know, as (name, value) pairs."""

    live_allocations: int = 0
    live_bytes: int = 0
    mapped_bytes: int = 0
    pooled_bytes: int = 0
    peak_physical_bytes: int = 0
    capacity_bytes: int = 0
    reserved_va_bytes: int = 0
    free_va_bytes: int = 0
    largest_free_va_bytes: int = 0
    retired_va_bytes: int = 0
    moves: int = 0
    driver_creates: int = 0
    driver_releases: int = 0
    driver_maps: int = 0
    driver_unmaps: int = 0
    driver_access_calls: int = 0
    driver_syncs: int = 0
    chunk_bytes: int = 0
    cached_mapped_bytes: int = 0
    idle_cached_bytes: int = 0
    unmapped_pooled_bytes: int = 0
    release_failures: int = 0
    reserve_fallbacks: int = 0
    bytes_copied: int = 0
    small_slabs: int = 0
    asleep_bytes: int = 0
    backup_bytes: int = 0
    imported_allocations: int = 0
    imported_bytes: int = 0
    exported_allocations: int = 0
    caller_driver_calls: int = 0
    caller_creates: int = 0
    caller_syncs: int = 0
    maintain_driver_calls: int = 0
    stream_frees: int = 0
    stream_shrinks: int = 0
    quiesces: int = 0
    event_polls: int = 0
    event_waits: int = 0
    pending_free_bytes: int = 0
    prefetched_bytes: int = 0
    maintain_failures: int = 0
    shared_bytes: int = 0
    bad_frees: int = 0
    other: tuple = ()

    @classmethod
    def _from_dict(cls, d):
        names = {f.name for f in fields(cls)} - {"other"}
        known = {k: int(v) for k, v in d.items() if k in names}
        other = tuple(sorted((k, v) for k, v in d.items() if k not in names))
        return cls(**known, other=other)


class Arena(_Arena):
    """An arena: Arena(backend="host"|"cuda", device=0, capacity_bytes=None,
    reserve_bytes=None, chunk_bytes=None, retain_bytes=None,
    no_implicit_moves=False, background=False, exportable=False). Sizes default as in the
    Rust API (the device's memory, 4x capacity of address space, 2 MiB
    chunks, every freed chunk kept pooled)."""

    def stats(self) -> Stats:
        """The stats as a typed object (fields of the Rust `Stats`)."""
        return Stats._from_dict(self.stats_dict())

    def snapshot(self) -> dict:
        """The JSON snapshot, parsed: {"ranges": [...], "stats": {...}}."""
        return _json.loads(self.snapshot_json())


class Group(_Group):
    """One arena per device, for tensor parallelism: Group(devices,
    backend="host"|"cuda", capacity_bytes=None, reserve_bytes=None,
    chunk_bytes=None, retain_bytes=None, peer_access=False). `alloc(size)`
    and `alloc_growable(size, max_size)` return (group id, [address per
    member]); `resize(id, new_size)` and `free(id)` act on every member, all
    or nothing (a failure names the member, the others are as they were)."""

    def stats(self) -> list:
        """Each member's stats (typed `Stats`), in member order."""
        return [Stats._from_dict(d) for d in self.stats_dicts()]

    def snapshot(self) -> dict:
        """The members' JSON snapshot, parsed."""
        return _json.loads(self.snapshot_json())
