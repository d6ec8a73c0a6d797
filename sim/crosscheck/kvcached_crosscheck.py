"""Drives kvcached's own Python code (KVCacheManager and vLLM's
ElasticBlockPool) through a small seeded trace on a CPU and writes the trace
with the pages in use and reserved after each step, which the Rust model of
kvcached must reproduce (sim/tests/kvcached_crosscheck.rs).

kvcached is not vendored: export its Python package to a directory outside
the repository and point KVCACHED_SRC at it, e.g.

    git --git-dir=<kvcached.git> archive HEAD kvcached | tar x -C /tmp/kvx
    KVCACHED_SRC=/tmp/kvx python3 sim/crosscheck/kvcached_crosscheck.py \
        > sim/tests/data/kvcached_crosscheck.json

What is mocked (nothing else is): torch and posix_ipc (MagicMock, as
kvcached's benchmarks/bench_idle_footprint/sim_eviction.py does); vLLM (a
BlockPool base class and a KVCacheBlock with block_id, ref_cnt, is_null,
block_hash); kvcached.integration.vllm.interfaces (should_use_worker_ipc ->
False); and the C++ extension kvcached.vmm_ops: PageAllocator and
InternalPage below transcribe csrc/page_allocator.cpp (the prealloc thread
runs at once when triggered; group_indices_by_page keeps first-appearance
order), kv_tensors_created -> True. kvcached/kv_cache_manager.py and
kvcached/integration/vllm/patches.py (ElasticBlockPool) run unmodified.
"""
import collections
import json
import os
import random
import sys
import types
from unittest import mock

sys.path.insert(0, os.environ["KVCACHED_SRC"])

PAGE = 2 << 20
MIN_RES, MAX_RES = 5, 10


class InternalPage:
    def __init__(self, page_id, page_size):
        self.page_id, self.page_size = page_id, page_size
        self.free_list, self.start, self.end = [], 0, 0

    @staticmethod
    def get_block_range(page_id, page_size, bms):
        return ((page_id * page_size + bms - 1) // bms, ((page_id + 1) * page_size) // bms)

    @staticmethod
    def get_num_blocks(page_size, bms):
        return page_size // bms

    def init(self, bms):
        self.start, self.end = self.get_block_range(self.page_id, self.page_size, bms)
        self.free_list = list(range(self.start, self.end))

    def alloc(self, n):
        if len(self.free_list) < n:
            raise RuntimeError("Not enough free blocks in page")
        out, self.free_list = self.free_list[:n], self.free_list[n:]
        return out

    def free_batch(self, ids):
        self.free_list.extend(ids)

    def empty(self):
        return len(self.free_list) == self.end - self.start

    def full(self):
        return not self.free_list

    def num_free_blocks(self):
        return len(self.free_list)


class PageAllocator:
    def __init__(self, num_layers, mem_size, page_size, world_size, **kw):
        self.page_size = page_size
        n = mem_size // page_size
        self.total = self.free = n
        self.free_list = collections.deque(range(n))
        self.reserved = collections.deque()
        self.min_res, self.max_res = min(n, MIN_RES), min(n, MAX_RES)
        self.needed = False

    def set_use_worker_ipc(self, v):
        pass

    def get_resize_target(self):
        return -1

    def start_prealloc_thread(self):
        self.needed = True
        self._prealloc()

    def _prealloc(self):
        if not self.needed:
            return
        self.needed = False
        n = min(max(0, self.min_res - len(self.reserved)), len(self.free_list))
        for _ in range(n):
            self.reserved.append(self.free_list.popleft())

    def alloc_page(self):
        if self.reserved:
            pid = self.reserved.popleft()
            self.free -= 1
            if len(self.reserved) < self.min_res:
                self.needed = True
                self._prealloc()
            return InternalPage(pid, self.page_size)
        if not self.free_list:
            raise RuntimeError("No free pages left")
        pid = self.free_list.popleft()
        self.free -= 1
        self.needed = True
        self._prealloc()
        return InternalPage(pid, self.page_size)

    def free_pages(self, ids):
        self.free += len(ids)
        room = max(0, self.max_res - len(self.reserved))
        self.reserved.extend(ids[:room])
        self.free_list.extend(ids[room:])

    def trim(self):
        self.free_list.extend(self.reserved)
        self.reserved.clear()

    def get_num_free_pages(self):
        return self.free

    def get_num_inuse_pages(self):
        return self.total - self.free

    def get_num_reserved_pages(self):
        return len(self.reserved)

    def get_avail_physical_pages(self):
        return 1 << 40

    def group_indices_by_page(self, ids, bms):
        out = {}
        for i in ids:
            out.setdefault(i * bms // self.page_size, []).append(i)
        return out


_torch = mock.MagicMock()
_torch.__version__ = "2.6.0"
sys.modules["torch"] = _torch
sys.modules["torch.cuda"] = _torch.cuda
sys.modules["posix_ipc"] = mock.MagicMock()
vmm_ops = types.ModuleType("kvcached.vmm_ops")
vmm_ops.PageAllocator = PageAllocator
vmm_ops.InternalPage = InternalPage
vmm_ops.kv_tensors_created = lambda group_id=0: True
for name in ("map_to_kv_tensors", "unmap_from_kv_tensors"):
    setattr(vmm_ops, name, mock.MagicMock())
sys.modules["kvcached.vmm_ops"] = vmm_ops
interfaces = types.ModuleType("kvcached.integration.vllm.interfaces")
interfaces.should_use_worker_ipc = lambda: False
sys.modules["kvcached.integration.vllm.interfaces"] = interfaces

from kvcached.kv_cache_manager import KVCacheManager  # noqa: E402
from kvcached.integration.vllm.patches import ElasticBlockPoolPatch  # noqa: E402


class Block:
    def __init__(self, block_id):
        self.block_id, self.ref_cnt, self.is_null, self.block_hash = block_id, 0, False, None


class Request:
    def __init__(self, hashes):
        self.block_hashes = hashes


# Geometry: one layer, 512 KiB blocks (16 tokens x 32 KiB cells): 4 a page.
BLOCK_TOKENS, CELL, LAYERS, NUM_BLOCKS, CAP = 16, 32 << 10, 1, 256, 12


def make_pool():
    mgr = KVCacheManager(NUM_BLOCKS, BLOCK_TOKENS, CELL, LAYERS, reserve_null_block=True)
    mod = types.ModuleType("vllm_block_pool")
    mod.BlockPool = object
    mod.KVCacheBlock = Block
    interfaces.get_kv_cache_manager = lambda *a, **k: mgr
    ElasticBlockPoolPatch().inject_elastic_block_pool(mod)
    pool = mod.ElasticBlockPool(num_gpu_blocks=NUM_BLOCKS, block_size=BLOCK_TOKENS, cell_size=CELL,
                                num_layers=LAYERS, enable_caching=True, max_cached_blocks=CAP)
    return pool, mgr


class Scheduler:
    """vLLM's KVCacheManager calls, as KvcachedPool makes them in Rust."""

    def __init__(self, pool):
        self.pool, self.seqs = pool, {}

    def admit(self, rid, hashes, prompt):
        keys = [str(h) for h in hashes]
        hit = []
        for k in keys[:(prompt - 1) // BLOCK_TOKENS]:
            b = self.pool.get_cached_block(k)
            if b is None:
                break
            hit.append(b)
        need = -(-prompt // BLOCK_TOKENS) - len(hit)
        hit_evictable = sum(1 for b in hit if b.block_id in self.pool._evictable_blocks)
        if need > self.pool.get_num_free_blocks() - hit_evictable:
            return None
        self.pool.touch(hit)
        new = self.pool.get_new_blocks(need)
        blocks = hit + new
        full = min(prompt // BLOCK_TOKENS, len(keys))
        if full > len(hit):
            self.pool.cache_full_blocks(Request(keys), blocks, len(hit), full, BLOCK_TOKENS, 0)
        self.seqs[rid] = [blocks, keys, max(full, len(hit))]
        return len(hit) * BLOCK_TOKENS

    def decode(self, rid, tokens):
        s = self.seqs[rid]
        need = -(-tokens // BLOCK_TOKENS)
        if need > len(s[0]):
            if need - len(s[0]) > self.pool.get_num_free_blocks():
                return False
            s[0] += self.pool.get_new_blocks(need - len(s[0]))
        full = min(tokens // BLOCK_TOKENS, len(s[1]))
        if full > s[2]:
            self.pool.cache_full_blocks(Request(s[1]), s[0], s[2], full, BLOCK_TOKENS, 0)
            s[2] = full
        return True

    def finish(self, rid):
        s = self.seqs.pop(rid)
        self.pool.free_blocks(list(reversed(s[0])))


def make_trace(seed=28, n_req=60):
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1 << 40) for _ in range(rng.randint(1, 4))] for _ in range(4)]
    steps, live, nxt = [], {}, 0
    while nxt < n_req or live:
        ops = []
        for rid in sorted(live):
            prompt, out, done = live[rid]
            if done + 1 >= out:
                ops.append(["finish", rid])
                del live[rid]
            else:
                live[rid][2] = done + 1
                ops.append(["decode", rid, prompt + done + 1])
        while nxt < n_req and len(live) < 6 and rng.random() < 0.7:
            prompt, out = rng.randint(8, 120), rng.randint(1, 48)
            shared = prefixes[rng.randrange(4)] if rng.random() < 0.4 else []
            total = -(-(prompt + out) // BLOCK_TOKENS)
            hashes = (shared + [rng.randrange(1 << 40) for _ in range(total)])[:total]
            ops.append(["admit", nxt, prompt, hashes])
            live[nxt] = [prompt, out, 0]
            nxt += 1
        steps.append(ops)
    return steps


def main():
    pool, mgr = make_pool()
    sched = Scheduler(pool)
    trace = make_trace()
    out = []
    for ops in trace:
        results = []
        for op in ops:
            if op[0] == "admit":
                results.append(sched.admit(op[1], op[3], op[2]))
            elif op[0] == "decode":
                results.append(sched.decode(op[1], op[2]))
            else:
                sched.finish(op[1])
                results.append(None)
        pa = mgr.page_allocator
        out.append({"ops": ops, "results": results, "inuse_pages": pa.get_num_inuse_pages(),
                    "reserved_pages": pa.get_num_reserved_pages(),
                    "evictable_blocks": len(pool._evictable_blocks)})
    mgr.trim()
    json.dump({"geometry": {"block_tokens": BLOCK_TOKENS, "cell_bytes": CELL, "layers": LAYERS,
                            "num_blocks": NUM_BLOCKS, "max_cached_blocks": CAP},
               "steps": out,
               "after_trim": {"inuse_pages": mgr.page_allocator.get_num_inuse_pages(),
                              "reserved_pages": mgr.page_allocator.get_num_reserved_pages()}},
              sys.stdout, separators=(",", ":"))


if __name__ == "__main__":
    main()
