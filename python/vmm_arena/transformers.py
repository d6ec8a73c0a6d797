"""A Hugging Face transformers KV cache whose keys and values grow in place in
arena memory.

    from vmm_arena.transformers import ArenaCache
    cache = ArenaCache(model.config)                 # host backend; backend="cuda" on a GPU
    out = model.generate(input_ids, cache=cache, max_new_tokens=256)
    print(cache.arena.stats().mapped_bytes)          # only what is live, chunk-rounded

Each attention layer keeps its keys and its values in one growable arena
allocation each, reserved for the model's maximum length (or
`max_cache_len`) and mapped chunk by chunk as tokens arrive. Tokens are the
outermost dimension of the stored layout, `[seq, batch, heads, head_dim]`,
so a new token is an append at the end of the mapped bytes: nothing already
cached is ever copied (`DynamicCache` copies the whole layer with
`torch.cat` on every token; `StaticCache` allocates the maximum length up
front). Attention gets a permuted, strided view `[batch, heads, seq,
head_dim]` of the arena's memory (DLPack), never a copy.

Views pin their buffer: growth inside the reservation is in place, so the
views already handed out stay valid. `crop` and `reset` give the chunks past
the live tokens back when no view outside the cache is alive (else the
mapping stays until the next shrink; the contents stay correct either way).

Supported: full-attention decoder layers (Llama, Mistral, Qwen2, ...),
greedy and sampled generation, padded batches, `crop` (assisted decoding),
`reset`, and `reorder_cache` (beam search: it reorders the live tokens in
place through one temporary, counted in `copied_bytes`). Refused with a
clear error: sliding-window, chunked or linear-attention layers, changing
the batch size (`batch_repeat_interleave`, `batch_select_indices`: the
stored layout is per batch size), offloading, and tokens past
`max_cache_len`.

Failures: a forward whose update fails in some layer (the arena's
OutOfMemory, a shape that does not fit) raises, and the layers it had
already updated go back to their tokens and chunks of before it, so the
cache and the arena are as they were and generation can go on.

On CUDA (`ArenaCache(config, backend="cuda")`) the views are device memory
of the arena's device; a shrink waits for the current stream first, since
the chunks it unmaps may still be read by queued kernels.
"""

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from . import Arena, Pinned

__all__ = ["ArenaCache", "ArenaLayer"]


def _round_up(n, to):
    return -(-n // to) * to


class _Store:
    """One growable allocation viewed as `[tokens, batch, heads, dim]`."""

    def __init__(self, arena, shape_tail, dtype, max_tokens, tag):
        self.arena = arena
        self.tail = tuple(shape_tail)
        self.dtype = dtype
        n = 1
        for d in self.tail:
            n *= d
        self.row_bytes = n * torch.empty((), dtype=dtype).element_size()
        self.chunk = arena.chunk_bytes
        self.max_bytes = _round_up(max(max_tokens * self.row_bytes, 1), self.chunk)
        self.buf = arena.alloc_growable(self.chunk if self.chunk < self.max_bytes else self.max_bytes,
                                        max_size=self.max_bytes, tag=tag)
        self.view = None
        self._take_view()

    def _take_view(self):
        self.size = size = self.buf.size
        rows = size // self.row_bytes
        raw = torch.from_dlpack(self.buf)
        self.view = raw[: rows * self.row_bytes].view(self.dtype).view((rows,) + self.tail)

    @property
    def capacity(self):
        return self.view.shape[0]

    def bytes_for(self, tokens):
        return min(max(_round_up(tokens * self.row_bytes, self.chunk), self.chunk), self.max_bytes)

    def grow(self, tokens):
        """Maps enough chunks for `tokens` (in place: the reservation holds them)."""
        self.buf.resize(self.bytes_for(tokens))
        self._take_view()

    def shrink(self, tokens):
        """Unmaps the chunks past `tokens`, if no view outside the cache is alive."""
        self.shrink_to_bytes(self.bytes_for(tokens))

    def shrink_to_bytes(self, want):
        if want >= self.size:
            return
        self.view = None  # the cache's own view must go for the shrink to be allowed
        try:
            self.buf.resize(want)
        except Pinned:
            pass  # someone still holds a view: keep the mapping
        finally:
            self._take_view()

    def free(self):
        self.view = None
        if self.buf is not None:
            self.buf.free()
            self.buf = None


class ArenaLayer(CacheLayerMixin):
    """One attention layer's keys and values in two growable arena allocations."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, arena, max_cache_len, tag=0):
        super().__init__()
        self.arena = arena
        self.max_cache_len = int(max_cache_len)
        self.tag = tag
        self.length = 0
        self.copied_bytes = 0
        self._k = self._v = None

    def lazy_initialization(self, key_states, value_states):
        want = "cuda" if self.arena.backend == "cuda" else "cpu"
        if key_states.device.type != want:
            raise ValueError(
                f"the arena's backend is {self.arena.backend!r} but the key states are on {key_states.device}: "
                f"make the ArenaCache with backend={'cuda' if key_states.device.type == 'cuda' else 'host'!r}"
            )
        if key_states.dtype != value_states.dtype:
            raise ValueError(f"keys are {key_states.dtype} and values {value_states.dtype}: one dtype expected")
        self.device = key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.k_head_dim = key_states.shape[-1]
        self.v_head_dim = value_states.shape[-1]
        self.dtype = key_states.dtype
        b, h = self.batch_size, self.num_heads
        self._k = _Store(self.arena, (b, h, self.k_head_dim), self.dtype, self.max_cache_len, self.tag)
        try:
            self._v = _Store(self.arena, (b, h, self.v_head_dim), self.dtype, self.max_cache_len, self.tag)
        except BaseException:
            self._k.free()
            self._k = None
            raise
        self.is_initialized = True
        self._publish()

    def _state(self):
        if not self.is_initialized:
            return None
        return self.length, self._k.size, self._v.size

    def _restore(self, state):
        """Goes back to a `_state()`: fewer tokens, and the chunks mapped then."""
        if state is None:
            if self.is_initialized:
                self.release()
            return
        length, k_bytes, v_bytes = state
        if not self.is_initialized or self.length < length:
            return  # nothing this forward added
        self.length = length
        self.keys = self.values = None
        self._k.shrink_to_bytes(k_bytes)
        self._v.shrink_to_bytes(v_bytes)
        self._publish()

    def _publish(self):
        """Points `keys`/`values` at the live tokens, as `[batch, heads, seq, dim]` views."""
        n = self.length
        self.keys = self._k.view[:n].permute(1, 2, 0, 3)
        self.values = self._v.view[:n].permute(1, 2, 0, 3)

    def _check(self, key_states, value_states):
        b, h = self.batch_size, self.num_heads
        if (tuple(key_states.shape[:2]) != (b, h) or key_states.shape[-1] != self.k_head_dim
                or tuple(value_states.shape[:2]) != (b, h) or value_states.shape[-1] != self.v_head_dim
                or key_states.shape[-2] != value_states.shape[-2]):
            raise ValueError(
                f"key/value states of shapes {tuple(key_states.shape)}/{tuple(value_states.shape)} do not fit a cache "
                f"of batch {b}, {h} heads, head dims {self.k_head_dim}/{self.v_head_dim}"
            )
        if key_states.dtype != self.dtype or value_states.dtype != self.dtype:
            raise ValueError(f"states of dtype {key_states.dtype}/{value_states.dtype}, cache of {self.dtype}")

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.max_cache_len:
            raise ValueError(
                f"{end} tokens do not fit the cache's max_cache_len of {self.max_cache_len} (it holds {self.length})"
            )
        k_bytes = self._k.size
        if end > self._k.capacity:
            self._k.grow(end)
        if end > self._v.capacity:
            try:
                self._v.grow(end)
            except BaseException:
                # Give the keys' new chunks back: a failed update leaves the arena as it was.
                self.keys = self.values = None
                self._k.shrink_to_bytes(k_bytes)
                self._publish()
                raise
        # The new tokens are written once, after the ones already there.
        self._k.view[self.length:end].copy_(key_states.permute(2, 0, 1, 3))
        self._v.view[self.length:end].copy_(value_states.permute(2, 0, 1, 3))
        self.length = end
        self._publish()
        return self.keys, self.values

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return self.max_cache_len

    def _shrink(self):
        if self.device.type == "cuda":
            # Queued kernels may still read the chunks about to be unmapped.
            torch.cuda.current_stream(self.device).synchronize()
        self.keys = self.values = None  # the cache's own views: they must not pin the shrink
        self._k.shrink(self.length)
        self._v.shrink(self.length)
        self._publish()

    def crop(self, tokens_to_remove):
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove (as DynamicCache requires)"
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(self.length - abs(tokens_to_remove), 0)
        self._shrink()

    def reset(self):
        if self.is_initialized:
            self.length = 0
            self._shrink()

    def reorder_cache(self, beam_idx):
        if self.length == 0:
            return
        idx = beam_idx.to(self.device)
        for store in (self._k, self._v):
            live = store.view[: self.length]
            # One temporary: the new order reads rows the in-place writes would overwrite.
            live.copy_(live.index_select(1, idx))
            self.copied_bytes += live.numel() * live.element_size()
        self._publish()

    def batch_repeat_interleave(self, repeats):
        raise NotImplementedError(
            "ArenaCache keeps one batch size per allocation: changing it (batch_repeat_interleave) is not supported"
        )

    def batch_select_indices(self, indices):
        raise NotImplementedError(
            "ArenaCache keeps one batch size per allocation: changing it (batch_select_indices) is not supported"
        )

    def offload(self):
        raise NotImplementedError("ArenaCache keeps its tensors in the arena: offloading is not supported")

    def prefetch(self):
        raise NotImplementedError("ArenaCache keeps its tensors in the arena: offloading is not supported")

    def release(self):
        """Frees the two allocations (raises Pinned while a view outside the cache is alive)."""
        self.keys = self.values = None
        for name in ("_k", "_v"):
            store = getattr(self, name)
            if store is not None:
                store.free()
                setattr(self, name, None)
        self.is_initialized = False
        self.length = 0

    def __del__(self):
        try:
            self.release()
        except Exception:  # noqa: BLE001 - a view still alive: the arena frees it when it goes
            pass


class ArenaCache(Cache):
    """A transformers `Cache` over vmm-arena: ArenaCache(config, max_cache_len=None,
    arena=None, tag=0, **arena_kwargs).

    `max_cache_len` defaults to the model's `max_position_embeddings`: it
    sizes each allocation's reservation (address space only); memory is
    mapped as tokens arrive. Without `arena`, one is made with
    `vmm_arena.Arena(**arena_kwargs)` (backend="host" unless given); its
    stats (`cache.arena.stats()`) count only this cache.
    """

    def __init__(self, config, max_cache_len=None, arena=None, tag=0, **arena_kwargs):
        text_config = config.get_text_config(decoder=True)
        layer_types, _ = get_layer_types_and_kwargs(text_config)
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise NotImplementedError(
                f"ArenaCache holds full-attention layers only; this model also has {', '.join(other)} layers"
            )
        if max_cache_len is None:
            max_cache_len = getattr(text_config, "max_position_embeddings", None)
            if not max_cache_len:
                raise ValueError("the config has no max_position_embeddings: pass max_cache_len")
        if int(max_cache_len) <= 0:
            raise ValueError(f"max_cache_len must be positive, not {max_cache_len}")
        if arena is None:
            arena_kwargs.setdefault("backend", "host")
            arena = Arena(**arena_kwargs)
        elif arena_kwargs:
            raise ValueError(f"arena given: {sorted(arena_kwargs)} would be ignored")
        self.arena = arena
        self.max_cache_len = int(max_cache_len)
        layers = [ArenaLayer(arena, self.max_cache_len, tag) for _ in layer_types]
        super().__init__(layers=layers)
        self._before_forward = None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if layer_idx == 0:
            # A new forward: what to go back to if a later layer's update fails.
            self._before_forward = [layer._state() for layer in self.layers]
        try:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException:
            self._roll_back(layer_idx)
            raise

    def _roll_back(self, failed):
        """Puts layers 0..failed back as they were before this forward, so a
        failed forward leaves the cache and the arena as they were (the
        layers before the failed one were already updated)."""
        if self._before_forward is None:
            return
        for layer, state in zip(self.layers[: failed + 1], self._before_forward):
            layer._restore(state)

    @property
    def copied_bytes(self):
        """Bytes of cached tokens the cache copied (beam reordering only; 0 otherwise)."""
        return sum(layer.copied_bytes for layer in self.layers)

    def live_bytes(self):
        """Bytes of the cached tokens, keys and values of every layer."""
        return sum(
            layer.length * (layer._k.row_bytes + layer._v.row_bytes) for layer in self.layers if layer.is_initialized
        )

    def release(self):
        """Frees every layer's allocations."""
        for layer in self.layers:
            layer.release()
