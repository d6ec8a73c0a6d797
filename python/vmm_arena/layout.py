"""The block-in-chunk KV cache layout: one chunk of a request's allocation
is one block of a paged-attention block table.

Each request's KV cache is one allocation of whole chunks (growable, so it
grows in place). Inside every chunk the cache is laid out layer-major:
layer 0's keys for the chunk's `block_tokens` tokens, layer 0's values,
layer 1's keys, and so on, each `[block_tokens, kv_heads, head_dim]`. So for
one layer the keys of every request form one strided tensor
`[chunks, block_tokens, kv_heads, head_dim]` over the arena's whole range,
whose block stride is the chunk: the shape paged attention kernels take,
indexed by block tables of chunk numbers from the arena's base.

    import torch, vmm_arena
    from vmm_arena.layout import BlockTable, kv_views, layout_for_arena

    arena = vmm_arena.Arena(backend="host", capacity_bytes=64 << 20)
    layout = layout_for_arena(arena, layers=32, kv_heads=8, head_dim=128, dtype=torch.float16)
    kv = arena.alloc_growable(layout.bytes_for_tokens(20), max_size=16 << 20)
    table = BlockTable(arena, kv)              # table.blocks == [n, n + 1]
    views = kv_views(arena, layout, torch.float16)
    k0, v0 = views[0]                          # layer 0: [chunks, 16, 8, 128]
    k0[table.blocks]                           # this request's layer-0 keys, by block

The views cover the arena's range and pin nothing: after a resize
(`table.refresh(arena)`) or a move (`table.on_move`, from the arena's move
callback) rebuild the block table, not the views. `BlockTables` keeps the
tables of many requests and collects which entries changed, for the
engine to upload to the device. Only chunks of live
allocations are memory: read the views only through block tables (touching
other chunks faults, as a kernel reading a stale block would), and not
while the allocation sleeps. The arena refuses `close()` while the views
are alive.
"""

from ._vmm_arena import ArenaRange, BlockTable, ChunkLayout  # noqa: F401
from .errors import InvalidArgument

__all__ = [
    "ArenaRange", "BlockTable", "BlockTables", "ChunkLayout", "block_table_tensor", "kv_views", "layout_for_arena",
]


def _itemsize(dtype):
    try:
        return dtype.itemsize
    except AttributeError:  # torch < 2.1
        import torch

        return torch.empty((), dtype=dtype).element_size()


def layout_for_arena(arena, layers, kv_heads, head_dim, dtype=None, dtype_bytes=None, block_tokens=None):
    """The ChunkLayout for `arena`'s chunk size: element size from `dtype`
    (a torch dtype) or `dtype_bytes`; `block_tokens` tokens a chunk (None:
    as many as fit)."""
    if (dtype is None) == (dtype_bytes is None):
        raise InvalidArgument("give one of dtype and dtype_bytes")
    size = _itemsize(dtype) if dtype is not None else dtype_bytes
    return ChunkLayout(layers, kv_heads, head_dim, size, arena.chunk_bytes, block_tokens)



def kv_views(arena, layout, dtype, range_view=None):
    """Per-layer (keys, values) torch tensors over `arena`'s whole range:
    `[(k, v) for each layer]`, each of shape `[chunks, block_tokens,
    kv_heads, head_dim]` and `dtype`, block stride the chunk, on the
    arena's device (CPU for the host backend). Index them with a block
    table's entries. No copy; `range_view` (an `arena.range_view()`) may be
    given to share one DLPack view. `InvalidArgument` when `dtype`'s size
    is not the layout's, or the layout's chunk is not the arena's."""
    import torch

    if layout.chunk_bytes != arena.chunk_bytes:
        raise InvalidArgument(
            f"the layout's chunk of {layout.chunk_bytes} bytes is not the arena's {arena.chunk_bytes}")
    size = _itemsize(dtype)
    if size != layout.dtype_bytes:
        raise InvalidArgument(f"{dtype} has {size}-byte elements, the layout {layout.dtype_bytes}")
    if layout.chunk_bytes % size:
        raise InvalidArgument(f"a chunk of {layout.chunk_bytes} bytes is not whole {size}-byte elements")
    rng = arena.range_view() if range_view is None else range_view
    raw = torch.from_dlpack(rng)  # uint8[reserved bytes] at the arena's base
    chunks = raw.numel() // layout.chunk_bytes
    typed = raw[: chunks * layout.chunk_bytes].view(dtype)
    shape = (chunks, layout.block_tokens, layout.kv_heads, layout.head_dim)
    stride = (layout.chunk_bytes // size, layout.kv_heads * layout.head_dim, layout.head_dim, 1)
    return [
        (typed.as_strided(shape, stride, layout.k_offset(layer) // size),
         typed.as_strided(shape, stride, layout.v_offset(layer) // size))
        for layer in range(layout.layers)
    ]


def block_table_tensor(tables, device=None, pad=0):
    """The block tables (BlockTable objects or lists of entries) as one
    int32 tensor `[len(tables), longest]`, shorter rows padded with `pad`:
    the block table argument of paged attention kernels."""
    import torch

    rows = [t.blocks if isinstance(t, BlockTable) else list(t) for t in tables]
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), width), pad, dtype=torch.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return out if device is None else out.to(device)


class BlockTables:
    """The block tables of many allocations of one arena, kept right across
    moves: install `arena.set_move_callback(tables.on_move)` (or call
    `on_move` from your own callback), and after a resize call
    `tables.refresh(arena, allocation)`. `take_changed()` returns and
    forgets {allocation id: (start, stop)}, the entries changed since the
    last call (the rows to upload again; entries past the table's length
    were removed)."""

    def __init__(self):
        self._tables = {}
        self._changed = {}

    def add(self, arena, allocation):
        """Makes (or returns) the table of `allocation`."""
        table = BlockTable(arena, allocation)
        self._tables.setdefault(table.id, table)
        return self._tables[table.id]

    def remove(self, allocation):
        """Forgets the table of `allocation` (an Allocation or an id)."""
        key = allocation if isinstance(allocation, int) else allocation.id
        self._tables.pop(key, None)
        self._changed.pop(key, None)

    def __getitem__(self, allocation):
        return self._tables[allocation if isinstance(allocation, int) else allocation.id]

    def __contains__(self, allocation):
        return (allocation if isinstance(allocation, int) else allocation.id) in self._tables

    def __len__(self):
        return len(self._tables)

    def _note(self, key, span):
        if span[0] == span[1]:
            return
        old = self._changed.get(key)
        self._changed[key] = span if old is None else (min(old[0], span[0]), max(old[1], span[1]))

    def on_move(self, id, old_ptr, new_ptr, size):
        """The arena's move callback: updates the moved allocation's table."""
        table = self._tables.get(id)
        if table is not None:
            self._note(id, table.on_move(id, old_ptr, new_ptr, size))

    def refresh(self, arena, allocation):
        """Re-reads `allocation`'s address and size (after a resize);
        returns the entries that changed."""
        table = self[allocation]
        span = table.refresh(arena)
        self._note(table.id, span)
        return span

    def take_changed(self):
        """{allocation id: (start, stop)} changed since the last call."""
        changed, self._changed = self._changed, {}
        return changed
