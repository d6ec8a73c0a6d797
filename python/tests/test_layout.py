"""The block-in-chunk KV layout in Python (vmm_arena.layout), on the host
backend: the arithmetic is the Rust library's, the per-layer views over the
arena's range read what the Rust offsets wrote, a paged attention over the
views (block by block through the block table, as a paged kernel reads)
equals a dense attention over the same keys and values, and growth, a move
and compaction keep the block table right."""
import gc

import pytest

torch = pytest.importorskip("torch")

import vmm_arena as va  # noqa: E402
from vmm_arena.layout import (  # noqa: E402
    BlockTable, BlockTables, ChunkLayout, block_table_tensor, kv_views, layout_for_arena,
)

K = 64 << 10
LAYERS, KV_HEADS, HEAD_DIM, GROUP = 3, 2, 8, 2  # 4 query heads share 2 KV heads
DTYPE = torch.float32
BLOCK = 16  # tokens a block


BACKENDS = ["host", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA backend needs a GPU (the views are then CUDA tensors)"))]


def arena(backend="host", **kw):
    if backend == "cuda":
        # The device's chunk granularity (2 MiB) is the smallest chunk there.
        return va.Arena(backend="cuda", capacity_bytes=256 << 20, reserve_bytes=1 << 30, **kw)
    return va.Arena(backend="host", capacity_bytes=64 * K, reserve_bytes=512 * K, chunk_bytes=K, **kw)


def layout(a):
    return layout_for_arena(a, LAYERS, KV_HEADS, HEAD_DIM, dtype=DTYPE, block_tokens=BLOCK)


def random_kv(tokens, seed):
    """Per layer (keys, values), each [tokens, kv_heads, head_dim]."""
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g, dtype=DTYPE),
         torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=g, dtype=DTYPE))
        for _ in range(LAYERS)
    ]


def write_rows(alloc, lay, kv, first=0):
    """Writes tokens first.. of `kv` at the Rust library's offsets, through
    the allocation (not through the views)."""
    for layer, (k, v) in enumerate(kv):
        for t in range(first, k.shape[0]):
            alloc.write(k[t].numpy().tobytes(), lay.token_offset(layer, False, t))
            alloc.write(v[t].numpy().tobytes(), lay.token_offset(layer, True, t))


def dense_attention(q, k, v):
    """softmax(q k^T / sqrt(d)) v over every token: q [heads, d], k and v
    [tokens, kv_heads, d]; grouped-query heads share a KV head."""
    k = k.repeat_interleave(GROUP, dim=1)
    v = v.repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("hd,thd->ht", q, k) / HEAD_DIM**0.5
    return torch.einsum("ht,thd->hd", scores.softmax(dim=-1), v)


class Views:
    """kv_views' tensors behind a repr that reads nothing: printing a whole
    view (pytest does, for a failing test's arguments) reads chunks that are
    not memory and faults."""

    def __init__(self, views):
        self.layers = views

    def __repr__(self):
        return f"<{len(self.layers)} layers of KV views>"


def paged_attention(q, views, layer, table_row, tokens):
    """The same attention as a paged kernel computes it: block by block
    through the block table, with an online softmax, over one layer's views
    [chunks, block_tokens, kv_heads, d]."""
    k_cache, v_cache = views.layers[layer]
    heads = q.shape[0]
    m = torch.full((heads,), float("-inf"), dtype=torch.float64)
    s = torch.zeros(heads, dtype=torch.float64)
    acc = torch.zeros(heads, HEAD_DIM, dtype=torch.float64)
    for j, block in enumerate(table_row.tolist()):
        n = min(BLOCK, tokens - j * BLOCK)
        if n <= 0:
            break
        kb = k_cache[block, :n].cpu().repeat_interleave(GROUP, dim=1).double()
        vb = v_cache[block, :n].cpu().repeat_interleave(GROUP, dim=1).double()
        sc = torch.einsum("hd,thd->ht", q.double(), kb) / HEAD_DIM**0.5
        m_new = torch.maximum(m, sc.max(dim=1).values)
        p = (sc - m_new[:, None]).exp()
        scale = (m - m_new).exp()
        s = s * scale + p.sum(dim=1)
        acc = acc * scale[:, None] + torch.einsum("ht,thd->hd", p, vb)
        m = m_new
    return (acc / s[:, None]).to(q.dtype)


def check_attention(views, tables, requests, seed=99):
    """Paged attention over the views through the block tables equals the
    dense attention over each request's own keys and values, every layer."""
    bt = block_table_tensor(tables)
    g = torch.Generator().manual_seed(seed)
    for r, kv in enumerate(requests):
        tokens = kv[0][0].shape[0]
        for layer, (k, v) in enumerate(kv):
            q = torch.randn(KV_HEADS * GROUP, HEAD_DIM, generator=g, dtype=DTYPE)
            want = dense_attention(q, k, v)
            got = paged_attention(q, views, layer, bt[r], tokens)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layout_arithmetic_is_the_librarys():
    llama = ChunkLayout(32, 8, 128, 2, 2 << 20)
    assert (llama.block_tokens, llama.unused_bytes, llama.slab_bytes) == (16, 0, 16 * 8 * 128 * 2)
    assert llama.v_offset(1) == 3 * 16 * 8 * 128 * 2
    assert llama.v_offset(31) + llama.slab_bytes == 2 << 20
    assert llama.token_offset(2, True, 17) == (2 << 20) + llama.v_offset(2) + 8 * 128 * 2
    assert (llama.blocks_for_tokens(17), llama.bytes_for_tokens(33)) == (2, 3 << 21)
    g70 = ChunkLayout(80, 8, 128, 2, 2 << 20)
    assert (g70.block_tokens, g70.unused_bytes) == (6, (2 << 20) - 6 * 320 * 1024)
    assert ChunkLayout(32, 8, 128, 2, 2 << 20, 8).unused_bytes == 1 << 20
    assert ChunkLayout(32, 8, 128, 2, 2 << 20) == llama and len({llama, ChunkLayout(32, 8, 128, 2, 2 << 20)}) == 1
    for bad in [(0, 8, 128, 2, 2 << 20), (32, 8, 128, 2, 0), (32, 8, 128, 2, (128 << 10) - 1),
                (32, 8, 128, 2, 2 << 20, 17), (2**32, 8, 128, 2, 2 << 20)]:
        with pytest.raises(va.InvalidArgument):
            ChunkLayout(*bad)
    with pytest.raises(va.InvalidArgument):
        llama.k_offset(32)
    with pytest.raises(TypeError):
        ChunkLayout(32.0, 8, 128, 2, 2 << 20)


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_read_what_the_rust_offsets_wrote(backend):
    a = arena(backend)
    K = a.chunk_bytes
    lay = layout(a)
    assert lay.chunk_bytes == K and lay.block_tokens == BLOCK
    req = a.alloc_growable(lay.bytes_for_tokens(40), max_size=8 * K)
    kv = random_kv(40, seed=1)
    write_rows(req, lay, kv)
    table = BlockTable(a, req)
    assert table.blocks == [(req.ptr - a.va_range[0]) // K + i for i in range(3)]
    views = kv_views(a, lay, DTYPE)
    assert len(views) == LAYERS
    shape, stride = tuple(views[0][0].shape), views[0][0].stride()
    assert shape == (a.va_range[1] // K, BLOCK, KV_HEADS, HEAD_DIM)
    assert stride == (K // 4, KV_HEADS * HEAD_DIM, HEAD_DIM, 1)
    for layer, (k, v) in enumerate(kv):
        for t in range(40):
            block, within = table.blocks[t // BLOCK], t % BLOCK
            # (Never a whole view in an assert: its repr would read unmapped chunks.)
            got_k = views[layer][0][block, within].cpu().clone()
            got_v = views[layer][1][block, within].cpu().clone()
            assert torch.equal(got_k, k[t]) and torch.equal(got_v, v[t]), (layer, t)
    # And the other way: a write through a view lands at the Rust offset.
    views[2][1][table.blocks[1], 3] = torch.arange(KV_HEADS * HEAD_DIM, dtype=DTYPE).view(KV_HEADS, HEAD_DIM)
    row = req.read(lay.token_offset(2, True, BLOCK + 3), lay.row_bytes)
    assert row == torch.arange(KV_HEADS * HEAD_DIM, dtype=DTYPE).numpy().tobytes()
    del views
    gc.collect()
    a.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_paged_attention_over_the_views_equals_a_dense_one(backend):
    a = arena(backend)
    K = a.chunk_bytes
    lay = layout(a)
    lengths = [37, 16, 50, 1]
    reqs, tables, data = [], [], []
    for i, n in enumerate(lengths):
        r = a.alloc_growable(lay.bytes_for_tokens(n), max_size=8 * K)
        kv = random_kv(n, seed=10 + i)
        write_rows(r, lay, kv)
        reqs.append(r)
        tables.append(BlockTable(a, r))
        data.append(kv)
    blocks = [b for t in tables for b in t.blocks]
    assert len(blocks) == len(set(blocks)) == sum(lay.blocks_for_tokens(n) for n in lengths)
    bt = block_table_tensor(tables)
    assert bt.dtype == torch.int32 and bt.shape == (4, 4)
    assert bt[1].tolist() == tables[1].blocks + [0, 0, 0]
    views = Views(kv_views(a, lay, DTYPE))
    check_attention(views, tables, data)
    del views
    gc.collect()
    a.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_growth_in_place_appends_blocks_and_keeps_the_data(backend):
    a = arena(backend)
    K = a.chunk_bytes
    lay = layout(a)
    req = a.alloc_growable(lay.bytes_for_tokens(20), max_size=8 * K)
    kv = random_kv(70, seed=3)
    write_rows(req, lay, [(k[:20], v[:20]) for k, v in kv])
    table = BlockTable(a, req)
    before = table.blocks
    views = Views(kv_views(a, lay, DTYPE))
    p = req.ptr
    assert req.resize(lay.bytes_for_tokens(70)) == p, "grows in place inside its reservation"
    assert table.refresh(a) == (2, 5), "three blocks appended"
    assert table.blocks[:2] == before and table.blocks == list(range(before[0], before[0] + 5))
    assert table.refresh(a) == (5, 5), "nothing changed since"
    write_rows(req, lay, kv, first=20)
    check_attention(views, [table], [kv])
    del views
    gc.collect()
    a.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_move_and_compaction_keep_the_table_right(backend):
    a = arena(backend)
    K = a.chunk_bytes
    lay = layout(a)
    base = a.va_range[0]
    filler = a.alloc(4 * K)
    req = a.alloc_growable(lay.bytes_for_tokens(40), max_size=4 * K)
    other = a.alloc_growable(lay.bytes_for_tokens(30), max_size=4 * K)
    kv, kv_other = random_kv(40, seed=5), random_kv(30, seed=6)
    write_rows(req, lay, kv)
    write_rows(other, lay, kv_other)
    tables = [BlockTable(a, req), BlockTable(a, other)]
    changed = []

    def on_move(id, old_ptr, new_ptr, size):
        for i, t in enumerate(tables):
            span = t.on_move(id, old_ptr, new_ptr, size)
            if span[0] != span[1]:
                changed.append((i, span))

    a.set_move_callback(on_move)
    views = Views(kv_views(a, lay, DTYPE))  # built once: moves change tables, not views
    check_attention(views, tables, [kv, kv_other])

    # Compaction: the filler's chunks free up, a request moves into them.
    old = [t.blocks for t in tables]
    filler.free()
    a.compact()
    a.release_retired()  # the old addresses are gone: a stale table would fault or misread
    assert changed, "compaction moved a request"
    for t, r in zip(tables, [req, other]):
        assert t.blocks == [(r.ptr - base) // K + i for i in range(len(t))]
    moved = {i for i, _ in changed}
    assert moved == {i for i in range(2) if tables[i].blocks != old[i]}, "the callback named what moved"
    check_attention(views, tables, [kv, kv_other])

    # Growth past the reservation: the request moves (reported to the callback).
    # No cached chunk left elsewhere (placement prefers a longer free range
    # where it would adopt one): the blocker goes by best fit.
    a.trim()
    blocker = a.alloc(K)
    assert blocker.ptr == req.ptr + req.reserved_bytes, "right after the request's reservation"
    changed.clear()
    kv_big = random_kv(90, seed=7)
    p = req.ptr
    assert req.resize(lay.bytes_for_tokens(90)) != p
    a.release_retired()
    assert [i for i, _ in changed] == [0]
    assert changed[0][1] == (0, len(tables[0])), "every entry changed (appended ones too)"
    assert tables[0].refresh(a) == (len(tables[0]), len(tables[0])), "the callback had it right"
    assert tables[0].blocks == [(req.ptr - base) // K + i for i in range(6)]
    write_rows(req, lay, kv_big, first=40)
    kv_big = [(torch.cat([k[:40], kb[40:]]), torch.cat([v[:40], vb[40:]])) for (k, v), (kb, vb) in zip(kv, kv_big)]
    check_attention(views, tables, [kv_big, kv_other])
    a.set_move_callback(None)
    del views
    gc.collect()
    a.close()


def test_block_tables_collect_what_moves_and_growth_changed():
    a = arena()
    lay = layout(a)
    base = a.va_range[0]
    filler = a.alloc(4 * K)
    reqs = [a.alloc_growable(lay.bytes_for_tokens(n), max_size=4 * K) for n in (40, 30)]
    tables = BlockTables()
    for r in reqs:
        tables.add(a, r)
    assert len(tables) == 2 and reqs[0] in tables and tables.add(a, reqs[0]) is tables[reqs[0]]
    a.set_move_callback(tables.on_move)

    before = {r.id: r.ptr for r in reqs}
    filler.free()
    a.compact()
    changed = tables.take_changed()
    moved = {r.id for r in reqs if r.ptr != before[r.id]}
    assert moved, "compaction moved a request"
    assert changed == {i: (0, len(tables[i])) for i in moved}, "every entry of each moved table, no other"
    for r in reqs:
        t = tables[r]
        assert t.blocks == [(r.ptr - base) // K + i for i in range(len(t))]
    assert tables.take_changed() == {}, "taken once"
    grown = reqs[1]
    n = len(tables[grown])
    p = grown.ptr
    assert grown.resize(lay.bytes_for_tokens(60)) == p  # in place
    assert tables.refresh(a, grown) == (n, 4)
    assert tables.take_changed() == {grown.id: (n, 4)}
    tables.remove(grown)
    assert grown not in tables and len(tables) == 1
    a.set_move_callback(None)
    a.close()


def test_refusals():
    a = arena()
    lay = layout(a)
    small = a.alloc(100)  # shares a slab
    with pytest.raises(va.InvalidArgument):
        BlockTable(a, small)
    req = a.alloc_growable(lay.bytes_for_tokens(10), max_size=2 * K)
    table = BlockTable(a, req)
    with pytest.raises(va.InvalidArgument):
        table.update(a.va_range[0] + 8, K)  # not on a chunk
    assert table.blocks == [(req.ptr - a.va_range[0]) // K], "a refusal leaves the table as it was"
    with pytest.raises(va.InvalidArgument):
        kv_views(a, lay, torch.float16)  # 2-byte elements for a 4-byte layout
    with pytest.raises(va.InvalidArgument):
        kv_views(a, ChunkLayout(LAYERS, KV_HEADS, HEAD_DIM, 4, 2 * K), DTYPE)  # another chunk size
    other = arena()
    with pytest.raises(va.InvalidArgument):
        table.refresh(other)
    with pytest.raises(va.UnknownAllocation):
        BlockTable(other, req)
    # The views of the range keep the arena from closing; released, it closes.
    views = kv_views(a, lay, DTYPE)
    rng = a.range_view()
    assert rng.views == 1 and (rng.base, rng.nbytes) == a.va_range
    with pytest.raises(va.Pinned):
        a.close()
    assert not a.closed and req.size == lay.bytes_for_tokens(10)
    del views
    gc.collect()
    assert rng.views == 0
    a.close()
    with pytest.raises(va.InvalidArgument):
        torch.from_dlpack(rng)
    with pytest.raises(va.InvalidArgument):
        a.range_view()
    other.close()
