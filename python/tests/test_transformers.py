"""vmm_arena.transformers.ArenaCache against transformers' own DynamicCache,
on the host backend, with a small Llama built from a config with seeded
random weights (nothing downloaded).

Logits are compared with torch.testing.assert_close's float32 tolerance
(rtol 1.3e-6, atol 1e-5): the arena's views are strided where DynamicCache's
tensors are contiguous, so a kernel may sum in another order; in practice
they come out equal."""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

import vmm_arena as va  # noqa: E402
from vmm_arena.transformers import ArenaCache, ArenaLayer  # noqa: E402

# The host's smallest chunk: a layer's 128-byte token rows fill one every 32
# tokens, so a generation of 256 tokens maps new chunks many times.
CHUNK = 4096
NEW_TOKENS = 256
RTOL, ATOL = 1.3e-6, 1e-5


def tiny_llama(attn="sdpa", seed=0, **over):
    cfg = dict(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    cfg.update(over)
    config = LlamaConfig(**cfg)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def generate(model, inputs, cache, new_tokens=NEW_TOKENS, **kw):
    return model.generate(
        **inputs, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
        output_logits=True, return_dict_in_generate=True, pad_token_id=0, **kw,
    )


class Watch:
    """Wraps every layer's update to check what attention receives: views of
    the arena's memory, never copies, with only the live KV mapped."""

    def __init__(self, cache):
        self.cache = cache
        self.updates = 0
        self.max_overshoot = 0
        for layer in cache.layers:
            layer.update = self._wrap(layer, layer.update)

    def _wrap(self, layer, update):
        def checked(key_states, value_states, *args, **kwargs):
            keys, values = update(key_states, value_states, *args, **kwargs)
            base, size = self.cache.arena.va_range
            for t, buf in ((keys, layer._k.buf), (values, layer._v.buf)):
                assert t.shape[2] == layer.length and t.shape[:2] == key_states.shape[:2]
                assert t.data_ptr() == buf.ptr, "attention must get the arena's bytes, not a copy"
                assert base <= t.data_ptr() < base + size
                b, h, _, d = t.shape
                assert t.stride(2) == b * h * d, "tokens outermost in memory: [seq, batch, heads, dim]"
            st = self.cache.arena.stats()
            live = self.cache.live_bytes()
            assert st.mapped_bytes >= live
            self.max_overshoot = max(self.max_overshoot, st.mapped_bytes - live)
            assert st.mapped_bytes <= live + st.live_allocations * CHUNK, "more than one chunk per allocation past the live KV"
            assert st.bytes_copied == 0 and st.moves == 0
            self.updates += 1
            return keys, values

        return checked


def assert_same_generation(ref, got):
    assert torch.equal(ref.sequences, got.sequences), "greedy ids differ"
    assert len(ref.logits) == len(got.logits) == NEW_TOKENS
    for step, (a, b) in enumerate(zip(ref.logits, got.logits)):
        torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL, msg=lambda m, s=step: f"step {s}: {m}")


def check_arena_after(cache, model, batch, total):
    layers = model.config.num_hidden_layers
    kv = model.config.num_key_value_heads
    hd = model.config.hidden_size // model.config.num_attention_heads
    assert cache.get_seq_length() == total
    assert cache.live_bytes() == layers * 2 * total * batch * kv * hd * 4
    st = cache.arena.stats()
    assert st.live_allocations == 2 * layers
    assert st.bytes_copied == 0 and st.moves == 0 and cache.copied_bytes == 0
    assert cache.live_bytes() <= st.mapped_bytes <= cache.live_bytes() + 2 * layers * CHUNK


def test_batch_1_matches_dynamic_cache_at_every_step():
    model = tiny_llama("sdpa")
    torch.manual_seed(1)
    inputs = {"input_ids": torch.randint(3, 512, (1, 12))}
    ref = generate(model, inputs, DynamicCache(config=model.config))
    cache = ArenaCache(model.config, chunk_bytes=CHUNK)
    watch = Watch(cache)
    got = generate(model, inputs, cache)
    assert_same_generation(ref, got)
    # The last generated token is never fed back: 12 + 256 - 1 cached.
    check_arena_after(cache, model, 1, 12 + NEW_TOKENS - 1)
    assert watch.updates == NEW_TOKENS * model.config.num_hidden_layers


def test_padded_batch_of_several_lengths_matches_dynamic_cache():
    model = tiny_llama("eager", seed=3)
    torch.manual_seed(4)
    lengths = [5, 17, 30, 9]
    width = max(lengths)
    ids = torch.zeros((len(lengths), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):  # left padding, as generation wants
        ids[row, width - n:] = torch.randint(3, 512, (n,))
        mask[row, width - n:] = 1
    inputs = {"input_ids": ids, "attention_mask": mask}
    ref = generate(model, inputs, DynamicCache(config=model.config))
    cache = ArenaCache(model.config, chunk_bytes=CHUNK)
    Watch(cache)
    got = generate(model, inputs, cache)
    assert_same_generation(ref, got)
    check_arena_after(cache, model, len(lengths), width + NEW_TOKENS - 1)


def test_crop_gives_chunks_back_and_generation_continues_like_dynamic_cache():
    model = tiny_llama()
    torch.manual_seed(5)
    ids = torch.randint(3, 512, (1, 200))
    ref, cache = DynamicCache(config=model.config), ArenaCache(model.config, chunk_bytes=CHUNK)
    with torch.no_grad():
        model(ids, cache=ref, use_cache=True)
        model(ids, cache=cache, use_cache=True)
        before = cache.arena.stats().mapped_bytes
        ref.crop(-150)
        cache.crop(-150)
        assert cache.get_seq_length() == ref.get_seq_length() == 50
        after = cache.arena.stats().mapped_bytes
        assert after < before
        assert cache.live_bytes() <= after <= cache.live_bytes() + 4 * CHUNK
        nxt = torch.randint(3, 512, (1, 40))
        a = model(nxt, cache=ref, use_cache=True).logits
        b = model(nxt, cache=cache, use_cache=True).logits
    torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)
    assert cache.get_seq_length() == 90
    with pytest.raises(ValueError, match="negative"):
        cache.crop(3)


def test_crop_keeps_the_mapping_while_a_caller_holds_a_view():
    model = tiny_llama()
    cache = ArenaCache(model.config, chunk_bytes=CHUNK)
    with torch.no_grad():
        model(torch.randint(3, 512, (1, 100)), cache=cache, use_cache=True)
    held = cache.layers[0].keys  # a view the caller keeps: the chunks under it must stay
    before = cache.arena.stats().mapped_bytes
    cache.crop(-90)
    assert cache.get_seq_length() == 10
    st = cache.arena.stats()
    assert st.mapped_bytes < before, "the other layers shrink"
    assert cache.layers[0]._k.buf.size >= held.shape[2] * cache.layers[0]._k.row_bytes
    assert held.sum().isfinite()  # still readable
    del held


def test_reset_then_a_new_generation_matches():
    model = tiny_llama()
    torch.manual_seed(6)
    inputs = {"input_ids": torch.randint(3, 512, (1, 8))}
    cache = ArenaCache(model.config, chunk_bytes=CHUNK)
    generate(model, inputs, cache, new_tokens=100)
    cache.reset()
    assert cache.get_seq_length() == 0
    assert cache.arena.stats().mapped_bytes == cache.arena.stats().live_allocations * CHUNK
    ref = generate(model, inputs, DynamicCache(config=model.config), new_tokens=40)
    got = generate(model, inputs, cache, new_tokens=40)
    assert torch.equal(ref.sequences, got.sequences)


def test_beam_search_reorders_in_place_like_dynamic_cache():
    model = tiny_llama(seed=7)
    torch.manual_seed(8)
    inputs = {"input_ids": torch.randint(3, 512, (2, 10))}
    kw = dict(max_new_tokens=24, min_new_tokens=24, num_beams=3, do_sample=False, pad_token_id=0)
    ref = model.generate(**inputs, cache=DynamicCache(config=model.config), **kw)
    cache = ArenaCache(model.config, chunk_bytes=CHUNK)
    got = model.generate(**inputs, cache=cache, **kw)
    assert torch.equal(ref, got)
    assert cache.copied_bytes > 0, "beam reordering is the one copy, and it is counted"
    assert cache.arena.stats().bytes_copied == 0


def test_tokens_past_max_cache_len_are_refused_and_nothing_changes():
    model = tiny_llama()
    cache = ArenaCache(model.config, max_cache_len=48, chunk_bytes=CHUNK)
    with torch.no_grad():
        model(torch.randint(3, 512, (1, 40)), cache=cache, use_cache=True)
        keys = cache.layers[0].keys.clone()
        mapped = cache.arena.stats().mapped_bytes
        with pytest.raises(ValueError, match="max_cache_len of 48"):
            model(torch.randint(3, 512, (1, 9)), cache=cache, use_cache=True)
    assert cache.get_seq_length() == 40
    assert torch.equal(cache.layers[0].keys, keys)
    assert cache.arena.stats().mapped_bytes == mapped


def test_batch_size_changes_offloading_and_sliding_windows_are_refused():
    model = tiny_llama()
    cache = ArenaCache(model.config, chunk_bytes=CHUNK)
    with torch.no_grad():
        model(torch.randint(3, 512, (2, 5)), cache=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="batch size"):
        cache.batch_select_indices(torch.tensor([0]))
    with pytest.raises(NotImplementedError, match="batch size"):
        cache.batch_repeat_interleave(2)
    with pytest.raises(NotImplementedError, match="offloading"):
        cache.layers[0].offload()
    with pytest.raises(ValueError, match="do not fit"):
        cache.update(torch.zeros(1, 2, 1, 16), torch.zeros(1, 2, 1, 16), 0)
    assert cache.get_seq_length() == 5
    mistral = transformers.MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, sliding_window=16,
    )
    with pytest.raises(NotImplementedError, match="sliding_attention"):
        ArenaCache(mistral, chunk_bytes=CHUNK)


def test_release_frees_every_allocation_and_a_shared_arena_serves_two_caches():
    model = tiny_llama()
    arena = va.Arena(backend="host", chunk_bytes=CHUNK, capacity_bytes=64 << 20)
    a, b = ArenaCache(model.config, arena=arena), ArenaCache(model.config, arena=arena, tag=3)
    with torch.no_grad():
        model(torch.randint(3, 512, (1, 70)), cache=a, use_cache=True)
        model(torch.randint(3, 512, (1, 30)), cache=b, use_cache=True)
    assert arena.stats().live_allocations == 8
    assert all(layer._k.buf.tag == 3 for layer in b.layers)
    a.release()
    assert arena.stats().live_allocations == 4
    b.release()
    assert arena.stats().live_allocations == 0
    with pytest.raises(ValueError, match="ignored"):
        ArenaCache(model.config, arena=arena, chunk_bytes=CHUNK)
    assert isinstance(a.layers[0], ArenaLayer)


def test_an_update_the_arena_cannot_map_fails_cleanly_and_leaves_the_arena_as_it_was():
    model = tiny_llama()
    # 60 tokens take 2 chunks of 4 KiB in each of the 4 allocations, 100
    # tokens 4: with 14 chunks, layer 0 grows and layer 1's keys cannot.
    arena = va.Arena(backend="host", chunk_bytes=CHUNK, capacity_bytes=14 * CHUNK, reserve_bytes=1 << 20)
    cache = ArenaCache(model.config, arena=arena)
    with torch.no_grad():
        model(torch.randint(3, 512, (1, 60)), cache=cache, use_cache=True)
        keys = [layer.keys.clone() for layer in cache.layers]
        values = [layer.values.clone() for layer in cache.layers]
        before = arena.stats()
        with pytest.raises(va.OutOfMemory):
            model(torch.randint(3, 512, (1, 40)), cache=cache, use_cache=True)
        after = arena.stats()
        assert (after.mapped_bytes, after.live_bytes, after.live_allocations) == (
            before.mapped_bytes, before.live_bytes, before.live_allocations)
        assert cache.get_seq_length() == 60
        for layer, k, v in zip(cache.layers, keys, values):
            assert layer.get_seq_length() == 60
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
        nxt = torch.randint(3, 512, (1, 4))
        ref = DynamicCache(config=model.config)
        ref.update(keys[0], values[0], 0)
        ref.update(keys[1], values[1], 1)
        a = model(nxt, cache=ref, use_cache=True).logits
        b = model(nxt, cache=cache, use_cache=True).logits  # it still works after the failure
    torch.testing.assert_close(b, a, rtol=RTOL, atol=ATOL)


def test_a_first_forward_that_fails_frees_what_it_allocated():
    model = tiny_llama()
    # Room for layer 0 (2 chunks each for keys and values), not for layer 1.
    arena = va.Arena(backend="host", chunk_bytes=CHUNK, capacity_bytes=5 * CHUNK, reserve_bytes=1 << 20)
    cache = ArenaCache(model.config, arena=arena)
    with torch.no_grad(), pytest.raises(va.OutOfMemory):
        model(torch.randint(3, 512, (1, 60)), cache=cache, use_cache=True)
    st = arena.stats()
    assert (st.live_allocations, st.mapped_bytes) == (0, 0)
    assert cache.get_seq_length() == 0 and not any(layer.is_initialized for layer in cache.layers)
