"""Sliding-window layers (kvbench/cache/sliding.py): every method holds a sliding layer's window in
full precision, exactly as transformers' DynamicSlidingWindowLayer does, and the FP16 reference of
the memory report is what transformers' own cache holds."""

from __future__ import annotations

import pytest
import torch
from tiny_archs import SLIDING_WINDOW, kvbench_logits, loaded, reference, tiny_model
from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config
from transformers.cache_utils import DynamicSlidingWindowLayer

from kvbench.cache import memory_report
from kvbench.cache.sink import SinkLayer
from kvbench.cache.sliding import WINDOW_COMPONENT, SlidingWindowLayer, with_window_layers
from kvbench.errors import ConfigError
from kvbench.generate import ModelRunner
from kvbench.methods import METHODS, Method, ModelShape, build_method
from kvbench.methods.eviction import EvictionLayer, kept_tokens
from kvbench.methods.fp16 import FullPrecisionLayer
from kvbench.models.shape import shape_of_config

MIXED = ModelShape(
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
    sliding_window=SLIDING_WINDOW,
)


# --- the layer against transformers' DynamicSlidingWindowLayer ------------------------------------


@pytest.mark.parametrize("window", [2, 5, 8])
@pytest.mark.parametrize("chunks", [[1] * 12, [3, 1, 1, 9, 1, 2, 1], [20, 1, 1], [4, 4, 4]])
def test_the_window_layer_holds_and_masks_what_transformers_does(window, chunks):
    ours = SlidingWindowLayer(0, window, torch.float32)
    theirs = DynamicSlidingWindowLayer(sliding_window=window)
    gen = torch.Generator().manual_seed(0)
    for t in chunks:
        k, v = torch.randn(2, 1, 2, t, 16, generator=gen).unbind(0)
        before = ours.stored()
        returned_k, returned_v = ours.update(k, v)
        full_k, full_v = theirs.update(k, v)
        # what this forward attends: the stored window, then its own exact tokens
        past_k = before.keys.read(0, before.num_entries) if before is not None else k[..., :0, :]
        past_v = before.values.read(0, before.num_entries) if before is not None else v[..., :0, :]
        assert torch.equal(torch.cat([past_k, returned_k], dim=-2), full_k)
        assert torch.equal(torch.cat([past_v, returned_v], dim=-2), full_v)
        held_k, held_v = ours.read()
        assert torch.equal(held_k, theirs.keys) and torch.equal(held_v, theirs.values)
        assert ours.get_seq_length() == theirs.get_seq_length() == ours.cumulative_length
        assert ours.reference_tokens() == theirs.keys.shape[-2] == min(ours.num_tokens, window - 1)
        for q in (1, 3):
            assert ours.get_mask_sizes(q) == theirs.get_mask_sizes(q)
    assert ours.is_sliding and ours.get_max_length() == theirs.get_max_length() == window
    # a long forward never enters the buffer beyond the window
    assert ours.k.buffer.capacity <= max(16, 2 * window)


def test_store_limit_stores_the_first_tokens_only():
    layer = SlidingWindowLayer(0, 4, torch.float32)
    k = torch.randn(1, 1, 5, 8)
    layer.update(k[..., :2, :], k[..., :2, :])
    layer.store_limit = 1
    returned, _ = layer.update(k[..., 2:4, :], k[..., 2:4, :])
    assert torch.equal(returned, k[..., 2:4, :])  # both attended
    assert layer.num_tokens == 3 and torch.equal(layer.read()[0], k[..., :3, :])
    layer.store_limit = 0
    layer.update(k[..., 4:, :], k[..., 4:, :])
    assert layer.num_tokens == 3
    layer.store_limit = None
    layer.update(k[..., 4:, :], k[..., 4:, :])
    assert torch.equal(layer.read()[0], k[..., [1, 2, 4], :])


def test_the_fp16_reference_counts_the_window():
    window = SlidingWindowLayer(0, 8, torch.float16)
    full = FullPrecisionLayer(1, torch.float16)
    k = torch.randn(1, 2, 30, 16)
    window.update(k, k)
    full.update(k, k)
    report = memory_report([window, full])
    assert report.tokens == 30
    assert report.n_values == 2 * 2 * 16 * (7 + 30)
    assert report.bytes_by_component == {WINDOW_COMPONENT: 2 * 2 * 7 * 16 * 2, "fp": 2 * 2 * 30 * 16 * 2}
    assert report.total_bytes == report.fp16_bytes


def test_a_window_of_one_holds_nothing():
    layer = SlidingWindowLayer(0, 1, torch.float32)
    k = torch.randn(1, 1, 3, 8)
    keys, _ = layer.update(k, k)
    assert torch.equal(keys, k) and layer.reference_tokens() == 0 and layer.stored() is None
    assert layer.get_mask_sizes(1) == (1, 3)
    with pytest.raises(ValueError, match="sliding_window"):
        SlidingWindowLayer(0, 0, torch.float32)


# --- the shape and the methods' caches ------------------------------------------------------------


def test_shapes_name_the_sliding_layers_as_transformers_caches_them():
    small = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=32)
    gemma = shape_of_config(Gemma3TextConfig(**small, num_hidden_layers=6, sliding_window=8))
    assert gemma.sliding_window == 8 and gemma.sliding_layers() == [0, 1, 2, 3, 4]  # pattern 6
    assert gemma.layer_types[5] == "full_attention"
    # Mistral v0.1: a window on every layer; v0.2 on: none
    assert shape_of_config(MistralConfig(**small, num_hidden_layers=2)).sliding_layers() == [0, 1]
    mistral = shape_of_config(MistralConfig(**small, num_hidden_layers=2, sliding_window=None))
    assert (mistral.layer_types, mistral.sliding_window) == (None, None)
    qwen = shape_of_config(Qwen2Config(**small, num_hidden_layers=2))
    assert (qwen.layer_types, qwen.sliding_window) == (None, None)
    qwen_sw = Qwen2Config(
        **small, num_hidden_layers=3, use_sliding_window=True, sliding_window=16, max_window_layers=1
    )
    assert shape_of_config(qwen_sw).sliding_layers() == [1, 2]
    llama = shape_of_config(LlamaConfig(**small, num_hidden_layers=2))
    assert (llama.layer_types, llama.sliding_window, llama.sliding_layers()) == (None, None, [])


@pytest.mark.parametrize("name", METHODS.names())
def test_every_method_holds_sliding_layers_as_windows(name):
    node = {"name": name, **METHODS.get(name).contract_node}
    if name == "intactkv":
        node["tokens"] = 2  # a sink in front of the full-attention layers only
    method = build_method(node)
    cache = method.new_cache(MIXED, torch.float32)
    for i, layer in enumerate(cache.layers):
        assert layer.layer_idx == i
        if MIXED.is_sliding(i):
            assert type(layer) is SlidingWindowLayer and layer.sliding_window == SLIDING_WINDOW
        else:
            assert not isinstance(layer, SlidingWindowLayer) and not layer.is_sliding
    assert cache.is_sliding == [True, False, True, False]
    if name == "intactkv":
        assert isinstance(cache.layers[1], SinkLayer)


def test_window_layers_replace_only_what_is_not_one():
    fp = [FullPrecisionLayer(i, torch.float16) for i in range(3)]
    window = SlidingWindowLayer(2, 8, torch.float16)
    out = with_window_layers([fp[0], fp[1], window], [0, 2], 8, torch.float16)
    assert isinstance(out[0], SlidingWindowLayer) and out[1] is fp[1] and out[2] is window


# --- a tiny Gemma-3 (local and global layers) against transformers -------------------------------

PROMPT = 12  # past the window of 8
STEPS = 10


@pytest.fixture(scope="module")
def gemma():
    model, shape = tiny_model("gemma3")
    prompt = torch.randint(0, 96, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    return model, shape, prompt, reference(model, prompt, STEPS)


def test_fp16_equals_transformers_past_the_window(gemma):
    model, shape, prompt, ref = gemma
    assert shape.sliding_layers() == [0, 2]
    runner = loaded(model, shape).runner(build_method({"name": "fp16", "fp_dtype": "auto"}))
    gen = runner.generate(prompt, STEPS)
    assert gen.token_ids == ref.tokens
    logits, cache = kvbench_logits(runner, prompt, ref.tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)
    # the cache holds what transformers' holds, byte for byte (float32 model, fp_dtype auto)
    report = memory_report(cache.layers)
    elements, nbytes = ref.held[STEPS - 1]
    assert report.total_bytes == nbytes and report.n_values == elements
    assert [layer.reference_tokens() for layer in cache.layers] == [
        7,
        PROMPT + STEPS - 1,
        7,
        PROMPT + STEPS - 1,
    ]
    # chunked scoring attends the window with the mask's offset
    scored = runner.score(prompt, torch.tensor([ref.tokens]), chunk=3)
    assert scored.nll == pytest.approx(ref.nll(), abs=1e-4) and scored.greedy


def test_the_fp16_baseline_holds_transformers_cache_in_fp16(gemma):
    model, shape, prompt, ref = gemma
    runner = loaded(model, shape).runner(build_method(None))
    gen = runner.generate(prompt, STEPS)
    elements, _ = ref.held[STEPS - 1]
    assert gen.memory.fp16_bytes == gen.memory.total_bytes == 2 * elements
    logits, _ = kvbench_logits(runner, prompt, ref.tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=0, atol=2e-2)


def test_a_quantizing_method_holds_less_than_transformers(gemma):
    model, shape, _, ref = gemma
    prompt = torch.randint(0, 96, (1, 200), generator=torch.Generator().manual_seed(2))
    runner = loaded(model, shape).runner(build_method({"name": "uniform", "bits": 2}))
    gen = runner.generate(prompt, 3)
    elements = 2 * 2 * 64 * (2 * 7 + 2 * (200 + 2))  # windows in the local layers, all in the global
    assert gen.memory.n_values == elements
    assert gen.memory.total_bytes < gen.memory.fp16_bytes / 2
    assert gen.memory.bytes_by_component[WINDOW_COMPONENT] == 2 * 2 * 2 * 7 * 64 * 2


@pytest.mark.parametrize("name", ["h2o", "streamingllm", "snapkv", "random_prune"])
def test_eviction_runs_and_leaves_the_windows_alone(gemma, name):
    model, shape, prompt, _ = gemma
    long = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(3))
    node = {"name": name, "budget": 16} | ({"window": 4} if name in ("snapkv", "random_prune") else {})
    runner = loaded(model, shape).runner(build_method(node))
    cache = runner.new_cache()
    runner.forward(long, cache)
    for t in range(5):
        runner.decode_step(torch.tensor([[t]]), cache)
    held = kept_tokens(cache)
    assert held[0] == held[2] == SLIDING_WINDOW - 1
    assert all(isinstance(cache.layers[i], EvictionLayer) for i in (1, 3))
    assert all(n <= 16 + 5 for n in (held[1], held[3]))
    report = memory_report(cache.layers)
    assert report.tokens == 45 and report.total_bytes < report.fp16_bytes


def test_specache_stores_no_speculative_token_in_the_windows(gemma):
    model, shape, _, _ = gemma
    prompt = torch.randint(0, 96, (1, 150), generator=torch.Generator().manual_seed(4))
    runner = loaded(model, shape).runner(build_method({"name": "specache", "bits": 2}))
    cache = runner.new_cache()
    runner.forward(prompt, cache)
    for t in range(4):
        runner.decode_step(torch.tensor([[t]]), cache)
    assert [layer.num_tokens for layer in cache.layers] == [154] * 4
    assert cache.layers[0].reference_tokens() == SLIDING_WINDOW - 1


class _OwnCache(Method):
    """A method that builds its own cache without Method.build_layers."""

    def new_cache(self, shape, model_dtype):
        from kvbench.cache import KVBenchCache

        return KVBenchCache([FullPrecisionLayer(i, torch.float16) for i in range(shape.num_layers)])


def test_the_runner_holds_every_cache_to_the_window_rule(gemma):
    model, shape, prompt, _ = gemma
    method = _OwnCache(build_method(None).config)
    cache = ModelRunner(model, loaded(model, shape).tokenizer, method, shape).new_cache()
    assert [type(layer) for layer in cache.layers] == [SlidingWindowLayer, FullPrecisionLayer] * 2
    assert cache.layers[0].k.dtype == torch.float16


def test_sliding_windows_method_stores_the_local_layers_as_the_method_does(gemma):
    """``method.sliding_windows=method``: the local layers hold every token in the method's storage
    and the model's sliding mask keeps attention to the window, so FP16 still equals transformers
    token for token, and a quantizing method's effective bits become its own instead of being held
    up by full-precision windows."""
    model, shape, prompt, ref = gemma
    node = {"name": "fp16", "fp_dtype": "auto", "sliding_windows": "method"}
    runner = loaded(model, shape).runner(build_method(node))
    assert runner.generate(prompt, STEPS).token_ids == ref.tokens
    logits, cache = kvbench_logits(runner, prompt, ref.tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)
    assert not any(isinstance(layer, SlidingWindowLayer) for layer in cache.layers)
    assert [layer.reference_tokens() for layer in cache.layers] == [PROMPT + STEPS - 1] * 4
    scored = runner.score(prompt, torch.tensor([ref.tokens]), chunk=3)
    assert scored.nll == pytest.approx(ref.nll(), abs=1e-4) and scored.greedy

    long = torch.randint(0, 96, (1, 200), generator=torch.Generator().manual_seed(2))
    bits = {}
    for rule in ("full_precision", "method"):
        method = build_method({"name": "uniform", "bits": 2, "sliding_windows": rule})
        bits[rule] = loaded(model, shape).runner(method).generate(long, 3).memory.effective_bits
    # uniform-2b at G=32 with fp16 scale and zero: 3 bits per value in every layer it stores
    assert bits["method"] == pytest.approx(3.0, abs=0.01)
    assert bits["full_precision"] > bits["method"] + 0.4, bits  # the fp16 windows: 3.44 bits
    with pytest.raises(ConfigError, match="method.sliding_windows"):
        build_method({"name": "snapkv", "sliding_windows": "method"})
    with pytest.raises(ConfigError, match="full_precision, method"):
        build_method({"name": "uniform", "sliding_windows": "quantized"})
