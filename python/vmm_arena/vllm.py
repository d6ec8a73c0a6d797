"""A drop-in for vLLM's CuMemAllocator (vllm.device_allocator.cumem) over
vmm_arena.

    from vmm_arena.vllm import CuMemAllocator
    allocator = CuMemAllocator.get_instance()
    with allocator.use_memory_pool(tag="weights"):
        model = load_model()
    allocator.sleep(offload_tags=("weights",))   # weights backed up, the rest discarded
    allocator.wake_up()                          # or wake_up(["weights"])

The names and their meaning are vLLM's (docs/python-drop-ins.md lists the
behaviours and the tests): only memory allocated inside `use_memory_pool`
sleeps; `sleep(offload_tags)` backs up the tags named (default: "default")
and discards the others, on every device; `wake_up(tags)` maps back the
tags named (None: all), restoring the backed-up bytes; `get_current_usage()`
is the bytes of the pool's live allocations, asleep or awake.
"""

import contextlib

from . import torch as _vt

__all__ = ["CuMemAllocator"]


class CuMemAllocator:
    """vLLM's singleton: get it with CuMemAllocator.get_instance()."""

    instance = None
    default_tag = "default"

    @staticmethod
    def get_instance():
        """The one instance."""
        if CuMemAllocator.instance is None:
            CuMemAllocator.instance = CuMemAllocator()
        return CuMemAllocator.instance

    @contextlib.contextmanager
    def use_memory_pool(self, tag=None):
        """Memory allocated inside comes from the pool and carries `tag`
        (None: "default")."""
        if tag is None:
            tag = CuMemAllocator.default_tag
        if not isinstance(tag, str):
            raise TypeError(f"tag must be a str, not {type(tag).__name__}")
        with _vt.region(tag):
            yield

    def sleep(self, offload_tags=None):
        """Releases the pool's memory on every device: the tags in
        `offload_tags` (a str, a tuple of them, or None for ("default",))
        are copied to host memory first, the others discarded."""
        if offload_tags is None:
            offload_tags = (CuMemAllocator.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        offload = set(offload_tags)
        _vt._sleep(lambda name: True, lambda t: _vt.name_of(t) in offload)

    def wake_up(self, tags=None):
        """Maps the pool's memory of `tags` (None: every tag) back at the same
        addresses; offloaded bytes come back, discarded ones are undefined."""
        if isinstance(tags, str):
            tags = [tags]
        wanted = None if tags is None else set(tags)
        _vt._wake(lambda name: wanted is None or name in wanted)

    def get_current_usage(self):
        """Bytes of the pool's live allocations, on every device."""
        return sum(size for d in _vt.devices() for _, size, t in _vt.allocations(d) if t >= 2)
