"""Eviction baselines: which tokens each policy keeps on hand-made attention patterns, the
matched-memory budget, logical positions, accounting and bad input.

Values encode their token index (``v[..., t, :] = t``), so the kept tokens are read off the stored
values; keys and queries are built so the attention pattern is known by hand (``scaling = 1``).
"""

from types import SimpleNamespace

import pytest
import torch

from kvbench.cache import memory_report
from kvbench.cache.accounting import tensor_bytes
from kvbench.errors import ConfigError
from kvbench.methods import ModelShape, build_method

SHAPE = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=4)
MODULE = SimpleNamespace(scaling=1.0, num_key_value_groups=2, is_causal=True, layer_idx=0)


def index_values(t: int, d: int = 4, start: int = 0) -> torch.Tensor:
    """``[1, 2, t, d]`` values whose every entry is the token's index."""
    return torch.arange(start, start + t, dtype=torch.float32)[None, None, :, None].expand(1, 2, t, d).clone()


def step(cache, k, v, q):
    """One forward of layer 0: update, then attention over what the update returned."""
    keys, values = cache.update(k, v, 0)
    out, _ = cache.layers[0].attend(MODULE, q, keys, values, None)
    return out


def kept(cache) -> list[list[int]]:
    """Kept token indices per kv head."""
    return cache.layers[0].v[0, :, :, 0].long().tolist()


def new_cache(node, shape=SHAPE):
    return build_method(node).new_cache(shape, torch.float32)


def test_streamingllm_keeps_sinks_and_the_recent_window_while_decoding():
    cache = new_cache({"name": "streamingllm", "budget": 5, "sinks": 2})
    step(cache, torch.randn(1, 2, 10, 4), index_values(10), torch.randn(1, 4, 10, 4))
    assert kept(cache) == [[0, 1, 7, 8, 9]] * 2
    step(cache, torch.randn(1, 2, 1, 4), index_values(1, start=10), torch.randn(1, 4, 1, 4))
    assert kept(cache) == [[0, 1, 8, 9, 10]] * 2  # the oldest non-sink token left, budget held
    assert cache.get_seq_length() == 11  # logical length: the next token's RoPE position


def harmonic_tail(j: int, t: int) -> float:
    """sum_{i=j}^{t-1} 1/(i+1): what token j receives from t causal queries under uniform attention."""
    return sum(1 / (i + 1) for i in range(j, t))


def test_h2o_scores_are_accumulated_attention_over_the_group_and_evict_the_lightest():
    # zero keys: query i spreads 1/(i+1) over tokens 0..i; each kv head has 2 query heads
    cache = new_cache({"name": "h2o", "budget": 4, "window": 2})
    step(cache, torch.zeros(1, 2, 8, 4), index_values(8), torch.randn(1, 4, 8, 4))
    assert kept(cache) == [[0, 1, 6, 7]] * 2  # heavy hitters {0, 1} of candidates 0..5, window {6, 7}
    expected = torch.tensor([2 * harmonic_tail(j, 8) for j in (0, 1, 6, 7)])
    assert torch.allclose(cache.layers[0].scores[0], expected.expand(2, 4), atol=1e-5)
    # decode token 8: 5 tokens, uniform 1/5 from each of 2 query heads; token 6 is now the lightest
    # candidate outside the window {7, 8}
    step(cache, torch.zeros(1, 2, 1, 4), index_values(1, start=8), torch.randn(1, 4, 1, 4))
    assert kept(cache) == [[0, 1, 7, 8]] * 2
    expected = torch.tensor([2 * harmonic_tail(j, 8) + 0.4 for j in (0, 1, 7)] + [0.4])
    assert torch.allclose(cache.layers[0].scores[0], expected.expand(2, 4), atol=1e-5)


def test_h2o_keeps_the_heavy_hitter_of_each_kv_head():
    keys = torch.zeros(1, 2, 8, 4)
    keys[0, 0, 3, 0] = 10.0  # kv head 0: every query from 3 on attends token 3
    keys[0, 1, 5, 1] = 10.0  # kv head 1: token 5
    query = torch.zeros(1, 4, 8, 4)
    query[0, :2, :, 0] = 1.0  # query heads 0, 1 read kv head 0
    query[0, 2:, :, 1] = 1.0
    cache = new_cache({"name": "h2o", "budget": 4, "window": 2})
    step(cache, keys, index_values(8), query)
    # head 0: F(3) ~ 2*5, F(0) ~ 2*(1 + 1/2 + 1/3), F(1) ~ 2*(1/2 + 1/3), ...: top 2 are {3, 0}
    # head 1: F(5) ~ 2*3, F(0) ~ 2*(1 + ... + 1/5) = 4.57: top 2 are {5, 0}
    assert kept(cache) == [[0, 3, 6, 7], [0, 5, 6, 7]]


def snapkv_pattern():
    """12 tokens; window queries (10, 11) of query heads 0, 1 attend token 4 with logit 20."""
    keys = torch.zeros(1, 2, 12, 4)
    keys[0, 0, 4, 0] = 20.0
    query = torch.zeros(1, 4, 12, 4)
    query[0, :2, :, 0] = 1.0
    return keys, query


def test_snapkv_votes_of_the_window_pooled_over_tokens():
    keys, query = snapkv_pattern()
    node = {"name": "snapkv", "budget": 5, "window": 2, "kernel_size": 3, "pooling": "max"}
    cache = new_cache(node)
    step(cache, keys, index_values(12), query)
    # head 0: votes ~2 on token 4 only; max pooling over 3 spreads them to {3, 4, 5}
    # head 1: zero keys, all votes equal: the earliest candidates win the tie
    assert kept(cache) == [[3, 4, 5, 10, 11], [0, 1, 2, 10, 11]]
    # without pooling token 4 is the only vote above the tie
    cache = new_cache({**node, "kernel_size": 1})
    step(cache, keys, index_values(12), query)
    assert kept(cache)[0] == [0, 1, 4, 10, 11]
    # decoded tokens are appended, never evicted
    step(cache, torch.zeros(1, 2, 1, 4), index_values(1, start=12), torch.zeros(1, 4, 1, 4))
    assert kept(cache)[0] == [0, 1, 4, 10, 11, 12]


def test_snapkv_adds_the_votes_of_the_query_heads_sharing_a_kv_head():
    keys = torch.zeros(1, 2, 12, 4)
    keys[0, 1, 2, 1] = keys[0, 1, 3, 2] = keys[0, 1, 7, 3] = 1.0
    query = torch.zeros(1, 4, 12, 4)
    query[0, 2, :, 1], query[0, 2, :, 2] = 10.0, 9.0  # head 2: token 2 (0.73), token 3 (0.27)
    query[0, 3, :, 3] = 10.0  # head 3: token 7 (~1)
    cache = new_cache({"name": "snapkv", "budget": 4, "window": 2, "kernel_size": 1})
    step(cache, keys, index_values(12), query)
    # summed over heads 2 and 3: token 7 ~2, token 2 ~1.46, token 3 ~0.54 (head 2 alone: {2, 3})
    assert kept(cache)[1] == [2, 7, 10, 11]


def test_random_prune_is_seeded_per_head_and_keeps_the_window():
    def draw(seed):
        cache = new_cache({"name": "random_prune", "budget": 50, "window": 10, "seed": seed})
        step(cache, torch.randn(1, 2, 200, 4), index_values(200), torch.randn(1, 4, 200, 4))
        return cache

    a = draw(0)
    for head in kept(a):
        assert len(head) == 50 and head == sorted(set(head))
        assert head[-10:] == list(range(190, 200))
    assert kept(a)[0] != kept(a)[1]  # independent draws per kv head
    assert kept(draw(0)) == kept(a)
    assert kept(draw(1)) != kept(a)
    # the 40 drawn candidates spread over 0..189 (a uniform draw, not a block)
    drawn = kept(a)[0][:40]
    assert drawn[0] < 40 and drawn[-1] > 150


def test_positions_stay_logical_after_eviction():
    cache = new_cache({"name": "h2o", "budget": 6})
    step(cache, torch.randn(1, 2, 20, 4), index_values(20), torch.randn(1, 4, 20, 4))
    keys, _ = cache.update(torch.randn(1, 2, 1, 4), index_values(1, start=20), 0)
    assert keys.shape[-2] == 7  # 6 kept + the new token are attended
    assert cache.get_seq_length() == 21
    assert cache.layers[0].get_mask_sizes(1) == (22, 0)  # the model's mask spans logical positions


def test_mask_hiding_an_earlier_token_is_refused():
    cache = new_cache({"name": "streamingllm", "budget": 4})
    step(cache, torch.randn(1, 2, 8, 4), index_values(8), torch.randn(1, 4, 8, 4))
    keys, values = cache.update(torch.randn(1, 2, 1, 4), index_values(1, start=8), 0)
    mask = torch.ones(1, 1, 1, 9, dtype=torch.bool)
    mask[..., 2] = False  # e.g. left padding
    with pytest.raises(ValueError, match="padding"):
        cache.layers[0].attend(MODULE, torch.randn(1, 4, 1, 4), keys, values, mask)


def test_update_without_attention_refuses_to_skip_eviction():
    cache = new_cache({"name": "snapkv", "budget": 4, "window": 2})
    cache.update(torch.randn(1, 2, 10, 4), index_values(10), 0)
    with pytest.raises(RuntimeError, match="attn_implementation"):
        cache.update(torch.randn(1, 2, 1, 4), index_values(1, start=10), 0)


BIG = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)


def layer_bytes(layer) -> int:
    return sum(tensor_bytes(t) for t in layer.held_tensors().values())


@pytest.mark.parametrize("name", ["streamingllm", "h2o", "snapkv", "random_prune"])
@pytest.mark.parametrize("matched", [{"name": "kivi", "bits": 2}, {"name": "uniform", "bits": 4}])
def test_matched_memory_holds_the_quantized_bytes_within_one_token(name, matched):
    t = 700
    k, v = torch.randn(2, 1, 2, t, 64).unbind(0)
    quantized = build_method(matched).new_cache(BIG, torch.float32)
    for i in range(BIG.num_layers):
        quantized.update(k, v, i)
    method = build_method({"name": name, "matched_memory": matched})
    cache = method.new_cache(BIG, torch.float32)
    module = SimpleNamespace(scaling=0.125, num_key_value_groups=2, is_causal=True)
    q = torch.randn(1, 4, t, 64)
    for i in range(BIG.num_layers):
        keys, values = cache.update(k, v, i)
        cache.layers[i].attend(SimpleNamespace(**vars(module), layer_idx=i), q, keys, values, None)
    for mine, theirs in zip(cache.layers, quantized.layers, strict=True):
        gap = layer_bytes(theirs) - layer_bytes(mine)
        assert 0 <= gap < mine.bytes_per_token()
        assert mine.kept == mine.budget < t
    assert method.label().startswith(f"{name}-mm-{build_method(matched).label()}")


@pytest.mark.parametrize("name", ["streamingllm", "h2o", "snapkv", "random_prune"])
def test_held_bytes_shrink_with_the_budget(name):
    t = 300
    k, v, q = torch.randn(1, 2, t, 64), torch.randn(1, 2, t, 64), torch.randn(1, 4, t, 64)
    module = SimpleNamespace(scaling=0.125, num_key_value_groups=2, is_causal=True, layer_idx=0)
    sizes = []
    for budget in (16, 64, 0.5):
        cache = build_method({"name": name, "budget": budget}).new_cache(BIG, torch.float32)
        keys, values = cache.update(k, v, 0)
        cache.layers[0].attend(module, q, keys, values, None)
        report = memory_report(cache.layers[:1])
        n = int(budget * t) if isinstance(budget, float) else budget
        per_token = 2 * 2 * 64 * 2 + (2 * 4 if name == "h2o" else 0)  # K, V fp16 (+ H2O's float32 score)
        assert report.total_bytes == n * per_token
        assert report.tokens == t  # logical tokens: bits per value are against the full FP16 cache
        assert report.effective_bits == pytest.approx(8 * n * per_token / (2 * 2 * t * 64))
        sizes.append(report.total_bytes)
    assert sizes[0] < sizes[1] < sizes[2]


@pytest.mark.parametrize(
    "node, key",
    [
        ({"name": "h2o", "budget": 0}, "method.budget"),
        ({"name": "h2o", "budget": 1.5}, "method.budget"),
        ({"name": "snapkv", "budget": -3}, "method.budget"),
        ({"name": "snapkv", "budget": True}, "method.budget"),
        ({"name": "random_prune", "budget": "half"}, "method.budget"),
        ({"name": "h2o", "window": -1}, "method.window"),
        ({"name": "streamingllm", "window": 8}, "method.window"),
        ({"name": "streamingllm", "sinks": -1}, "method.sinks"),
        ({"name": "snapkv", "kernel_size": 4}, "method.kernel_size"),
        ({"name": "snapkv", "pooling": "mean"}, "method.pooling"),
        ({"name": "snapkv", "window": 0}, "method.window"),
        ({"name": "random_prune", "seed": -1}, "method.seed"),
        ({"name": "h2o", "sink_tokens": 2}, "method.sink_tokens"),
        ({"name": "h2o", "matched_memory": "kivi"}, "method.matched_memory"),
        ({"name": "h2o", "matched_memory": {"name": "nope"}}, "method.matched_memory.name"),
        ({"name": "h2o", "matched_memory": {"name": "h2o"}}, "method.matched_memory.name"),
        ({"name": "h2o", "matched_memory": {"name": "kivi", "bitz": 2}}, "method.matched_memory.bitz"),
    ],
)
def test_bad_input_names_key_value_and_allowed(node, key):
    with pytest.raises(ConfigError) as err:
        build_method(node)
    assert err.value.key == key
    assert err.value.allowed


def test_unknown_matched_method_lists_the_registered_ones():
    with pytest.raises(ConfigError) as err:
        build_method({"name": "snapkv", "matched_memory": {"name": "kivvi", "bits": 2}})
    assert err.value.value == "kivvi"
    assert "kivi" in err.value.allowed and "uniform" in err.value.allowed
    assert "snapkv" not in err.value.allowed  # eviction methods cannot set each other's budget


@pytest.mark.slow
def test_generation_with_budget_above_the_context_is_fp16_token_for_token(default_model):
    from kvbench.generate import ModelRunner

    model, tokenizer, shape = default_model
    messages = [
        {"role": "user", "content": "Name three planets of the solar system and one fact about each."}
    ]
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    ids = ids["input_ids"]
    reference = ModelRunner(model, tokenizer, build_method({"name": "fp16"}), shape).generate(ids, 6)
    for name in ("streamingllm", "h2o", "snapkv", "random_prune"):
        gen = ModelRunner(model, tokenizer, build_method({"name": name, "budget": 4096}), shape).generate(
            ids, 6
        )
        assert gen.token_ids == reference.token_ids, name
    # with eviction the held cache is the budget, the sequence length still the logical one
    runner = ModelRunner(model, tokenizer, build_method({"name": "h2o", "budget": 16}), shape)
    cache = runner.new_cache()
    runner.forward(ids, cache)
    runner.forward(torch.tensor([[reference.token_ids[0]]]), cache)
    assert cache.get_seq_length() == ids.shape[1] + 1
    assert all(layer.kept == 16 for layer in cache.layers)


def test_recorded_positions_follow_the_kept_tokens_and_are_not_accounted():
    """StreamingLLM with 4 sinks and a budget of 6 keeps positions 0-3 and the newest two; the
    positions a measurement asks for are bookkeeping, not held memory."""
    from kvbench.cache.capture import replay

    shape = ModelShape(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 18, 8), torch.randn(1, 1, 18, 8), torch.randn(1, 1, 18, 8)
    layer = build_method({"name": "streamingllm", "budget": 6}).new_cache(shape, torch.float32).layers[0]
    layer.record_positions = True
    seen = []
    replay(
        layer,
        q,
        k,
        v,
        15,
        3,
        0.35,
        attend_prefill=True,
        before_attend=lambda t, lay: seen.append(lay.positions),
    )
    assert [p[0, 0].tolist() for p in seen] == [
        [0, 1, 2, 3, 13, 14, 15],
        [0, 1, 2, 3, 14, 15, 16],
        [0, 1, 2, 3, 15, 16, 17],
    ]
    assert layer.positions[0, 0].tolist() == [0, 1, 2, 3, 16, 17]
    assert all(t is not layer.positions for ts in layer.held_tensors().values() for t in ts)
    plain = build_method({"name": "streamingllm", "budget": 6}).new_cache(shape, torch.float32).layers[0]
    replay(plain, q, k, v, 15, 3, 0.35, attend_prefill=True)
    assert plain.positions is None and torch.equal(plain.k, layer.k)


@pytest.mark.parametrize("name", ["snapkv", "random_prune", "h2o", "streamingllm"])
def test_matched_memory_holds_the_bytes_at_the_end_of_a_scored_window(name):
    """A perplexity window (prefill, then every continuation token stored one at a time) ends with
    the eviction cache at most the matched cache's bytes and less than one kept token per layer
    below them, decoded tokens included; a generation that stops before it planned misses, and
    the run says so with the numbers."""
    from tiny_archs import VOCAB, loaded, tiny_model

    model, shape = tiny_model("llama")
    gen = torch.Generator().manual_seed(0)
    ctx, cont = (
        torch.randint(0, VOCAB, (1, 192), generator=gen),
        torch.randint(0, VOCAB, (1, 48), generator=gen),
    )
    matched = {"name": "kivi", "bits": 2}
    lm = loaded(model, shape)
    ref = lm.runner(build_method(matched))
    ref_cache = {}
    ref.method.end_request = lambda cache: ref_cache.setdefault("c", cache)
    ref.score(ctx, cont)
    method = build_method({"name": name, "matched_memory": matched})
    runner = lm.runner(method)
    mine = {}
    method_end = method.end_request
    method.end_request = lambda cache: (mine.setdefault("c", cache), method_end(cache))
    runner.score(ctx, cont)
    for layer, theirs in zip(mine["c"].layers, ref_cache["c"].layers, strict=True):
        gap = layer_bytes(theirs) - layer_bytes(layer)
        assert 0 <= gap < layer.bytes_per_token(), (layer.layer_idx, gap)
        if not layer.evicts_in_decode:
            assert layer.kept == layer.budget + cont.shape[1]
    assert method.run_warnings() == {} and method.requests == 1
    # every token a stop token: nothing is decoded of the 16 planned
    runner.generate(ctx, 17, stop_token_ids=tuple(range(VOCAB)))
    warning = method.run_warnings()["matched_memory_gap"]
    assert "1 of 2 requests" in warning and "effective bits against" in warning
