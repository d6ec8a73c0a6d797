"""A drop-in for torch_memory_saver over vmm_arena.

    from vmm_arena.torch_memory_saver import torch_memory_saver
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        weights = torch.empty(..., device="cuda")
    torch_memory_saver.pause()      # or pause("weights")
    torch_memory_saver.resume()

The names and their meaning are torch_memory_saver's (see
docs/python-drop-ins.md for the list of behaviours and the tests that check
them): memory allocated outside any region is never paused; `pause(tag)` /
`resume(tag)` act on one tag, or on every tag when None, on every device;
the CPU backup is chosen per region and so per allocation; `disable()`
allocates outside the regions while inside one; `keep_resident(tensor)`
keeps an allocation out of later pauses; `get_cpu_backup(tensor)` copies a
paused tensor's backup to the CPU; `memory_margin_bytes` refuses an
allocation that would leave less of the arena free. It runs on
vmm_arena.torch (the
hooks are in the installed extension module). `hook_mode = "preload"` in a
process started inside `configure_subprocess()` (LD_PRELOAD of the preload
library) also catches raw cudaMalloc/cudaFree calls made in a region.
"""

from . import torch as _vt

__all__ = ["TorchMemorySaver", "torch_memory_saver", "memory_saver", "configure_subprocess"]

configure_subprocess = _vt.configure_subprocess


class TorchMemorySaver:
    """torch_memory_saver's object; all instances share the one allocator."""

    def region(self, tag="default", enable_cpu_backup=False):
        """Context manager: CUDA memory allocated inside is pausable under `tag`."""
        return _vt.region(tag, enable_cpu_backup)

    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global", tag="default",
                   enable_cpu_backup=False):
        """torch.cuda.graph(...) whose memory pauses with `tag`."""
        return _vt.cuda_graph(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode, tag=tag,
                              enable_cpu_backup=enable_cpu_backup)

    def disable(self):
        """Context manager: inside a region, allocate as if outside it."""
        return _vt.disable()

    def pause(self, tag=None):
        """Releases the physical memory of `tag` (None: every tag)."""
        _vt.pause(tag)

    def resume(self, tag=None):
        """Maps memory back for `tag` (None: every tag) at the same addresses."""
        _vt.resume(tag)

    def keep_resident(self, x):
        """Keeps the allocation holding tensor `x` out of later pauses;
        returns its bytes (0 for an empty tensor or memory not from a region)."""
        return _vt.keep_resident(x)

    @property
    def enabled(self):
        """Always True: the hooks are part of the installed package."""
        return True

    @property
    def hook_mode(self):
        """"torch" (the default) or "preload" (the process runs under the
        preload library: see configure_subprocess())."""
        return _vt.hook_mode()

    @hook_mode.setter
    def hook_mode(self, mode):
        _vt.set_hook_mode(mode)

    @property
    def memory_margin_bytes(self):
        """Bytes of the arena's capacity every allocation must leave free
        (0: none); see vmm_arena.torch.set_memory_margin."""
        return _vt.memory_margin()

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value):
        _vt.set_memory_margin(value)

    def get_cpu_backup(self, x):
        """A CPU copy of paused tensor `x`'s backed-up bytes (its dtype and
        shape), None when it has no backup."""
        return _vt.get_cpu_backup(x)


torch_memory_saver = TorchMemorySaver()
memory_saver = torch_memory_saver
