"""H2O's prefill under ``shared_prefill`` (kvbench.cache.eviction): off unless a block is open;
inside one, caches of other budgets fed the very same tensors get the first cache's prompt attention
and scores, bit for bit, and anything that differs (a written tensor, scaling, query chunk, mask) is
computed anew."""

from types import SimpleNamespace

import pytest
import torch

from kvbench.cache.eviction import shared_prefill
from kvbench.methods import ModelShape, build_method

SHAPE = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8)


def module(scaling=0.5):
    return SimpleNamespace(scaling=scaling, num_key_value_groups=2, is_causal=True, layer_idx=0)


def prefill(q, k, v, budget, scaling=0.5, query_chunk=16, decode=2):
    """An H2O cache fed ``N - decode`` prompt tokens in one forward, then ``decode`` single tokens:
    (prefill output, scores after prefill, kept values, decode outputs)."""
    cache = build_method({"name": "h2o", "budget": budget, "query_chunk": query_chunk}).new_cache(
        SHAPE, torch.float32
    )
    layer, n = cache.layers[0], k.shape[-2] - decode
    keys, values = layer.update(k[..., :n, :], v[..., :n, :])
    out, _ = layer.attend(module(scaling), q[..., :n, :], keys, values, None)
    scores = layer.scores.clone()
    steps = []
    for t in range(n, n + decode):
        keys, values = layer.update(k[..., t : t + 1, :], v[..., t : t + 1, :])
        steps.append(layer.attend(module(scaling), q[..., t : t + 1, :], keys, values, None)[0])
    return out, scores, layer.v.clone(), steps


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[:3], b[:3], strict=True)) and all(
        torch.equal(x, y) for x, y in zip(a[3], b[3], strict=True)
    )


def tensors(seed=0, n=42):
    torch.manual_seed(seed)
    return torch.randn(1, 4, n, 8) * 2, torch.randn(1, 2, n, 8), torch.randn(1, 2, n, 8)


def test_off_unless_a_block_is_open(h2o_prompt_queries):
    q, k, v = tensors()
    a, b = prefill(q, k, v, 6), prefill(q, k, v, 12)
    assert h2o_prompt_queries == [40, 40]
    assert not torch.equal(a[2], b[2])  # different budgets keep different tokens


def test_shared_prompt_attention_is_the_same_bits_for_every_budget(h2o_prompt_queries):
    q, k, v = tensors()
    alone = [prefill(q, k, v, b) for b in (6, 12, 30)]
    h2o_prompt_queries.clear()
    with shared_prefill() as memo:
        shared = [prefill(q, k, v, b) for b in (6, 12, 30)]
    assert h2o_prompt_queries == [40] and (memo.computed, memo.reused) == (1, 2)
    for a, s in zip(alone, shared, strict=True):
        assert same(a, s)


@pytest.mark.parametrize("change", ["written", "other_keys", "scaling", "query_chunk"])
def test_anything_different_is_computed_again(h2o_prompt_queries, change):
    q, k, v = tensors()
    with shared_prefill() as memo:
        prefill(q, k, v, 6)
        kwargs = {}
        if change == "written":
            k[0, 0, 0, 0] += 1  # same tensor, written in place
        elif change == "other_keys":
            k = k.clone()  # same values, another tensor: not assumed to be the same
        elif change == "scaling":
            kwargs["scaling"] = 0.25
        else:
            kwargs["query_chunk"] = 8
        second = prefill(q, k, v, 12, **kwargs)
    assert h2o_prompt_queries == [40, 40] and (memo.computed, memo.reused) == (2, 0)
    assert same(second, prefill(q, k, v, 12, **kwargs))  # outside the block: the same result


def test_another_prompt_length_is_computed_again(h2o_prompt_queries):
    q, k, v = tensors()
    with shared_prefill() as memo:
        prefill(q, k, v, 6)
        prefill(q, k, v, 6, decode=3)  # a shorter prompt: other views, other causal mask
    assert h2o_prompt_queries == [40, 39] and memo.reused == 0
