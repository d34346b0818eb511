"""Attention over packed storage equals the rebuild-everything reference, for every method that
attends its stored tokens blockwise.

The reference (kept here, not in the hot path): reconstruct the whole stored cache with the layer's
``read()`` *before* the forward's tokens are appended, concatenate the new tokens, and run
transformers' SDPA with the causal rule of the new tokens (or the given mask). The layer under test
attends the sources it took in ``update()`` block by block (:mod:`kvbench.cache.blockwise`), or,
without a block size, decode steps in one call per stored part through the compiled CPU kernels, so
the two differ by float32 reassociation only: the bound is 2e-5 absolute/relative on attention
outputs of unit-scale inputs.

Cases: block sizes that do not divide the stored length (7, 48) and one larger than it; prompts that
leave the quantized part empty, the residual partly full, and both; decode steps of one token and
chunks of three (with and without an explicit mask that hides stored positions).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from stored_reference import dense_stored
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbench.methods import METHODS, ModelShape, build_method

SHAPE = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64)
SCALING = 64**-0.5

# Methods whose decode attention is the reference by construction once their adaptive part is off:
# SpeCache with k = 0 attends its low-bit copy C' alone (its prefetch substitution is checked in
# tests/methods/test_specache.py); ReadKV reading every bit is dense attention over its B-bit codes
# (its query-adaptive reads are checked against the dense function in tests/methods/test_readkv.py).
NODES = {
    "specache": {"bits": 2, "topk": 0},
    "readkv": {"bits": 4, "read_bits": 4},
    "semkv": {"bits": 2.4, "chunk": 16},
    "semkv-attention": {"name": "semkv", "bits": 2.4, "chunk": 16, "metric": "attn_sum"},
    "turboquant-window": {"name": "turboquant", "bits": 2, "residual": 8},
    "uniform-channel": {"name": "uniform", "bits": 2, "key_axis": "channel", "group_size": 16},
    "kvquant-sink": {"name": "kvquant", "bits": 3, "calibrate": False, "pre_rope": False, "sink_tokens": 2},
}
EVICTING = {"h2o", "snapkv", "streamingllm", "random_prune"}


def node_of(case: str) -> dict:
    if case in NODES:
        return {"name": case, **NODES[case]} if "name" not in NODES[case] else dict(NODES[case])
    return {"name": case, **METHODS.get(case).contract_node}


CASES = [n for n in METHODS.names() if n not in EVICTING] + [c for c in NODES if c not in METHODS.names()]


def module():
    return SimpleNamespace(num_key_value_groups=2, is_causal=True, training=False, scaling=SCALING)


def reference(past, new_k, new_v, query, mask):
    """SDPA over the reconstructed past and the exact new tokens."""
    t, q = (0 if past is None else past[0].shape[-2]), new_k.shape[-2]
    keys = new_k if past is None else torch.cat([past[0].float(), new_k], dim=-2)
    values = new_v if past is None else torch.cat([past[1].float(), new_v], dim=-2)
    if mask is None:
        mask = torch.ones(1, 1, q, t + q, dtype=torch.bool).tril(t)
    return sdpa_attention_forward(module(), query, keys, values, mask, scaling=SCALING)[0]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("prefill", [5, 150])
@pytest.mark.parametrize("block_size", [7, 48, 4096, None])
def test_attention_over_packed_storage_equals_the_rebuild_reference(case, prefill, block_size, monkeypatch):
    # None: no block size asked for, so decode steps take the single-call path through the
    # compiled CPU kernels (backend auto), the rest of the forwards the block loop
    if block_size is None:
        monkeypatch.delenv("KVBENCH_BLOCK_SIZE", raising=False)
    else:
        monkeypatch.setenv("KVBENCH_BLOCK_SIZE", str(block_size))
    torch.manual_seed(0)
    method = build_method(node_of(case))
    method.config.check_model(SHAPE)
    layer = method.new_cache(SHAPE, torch.float32).layers[0]
    n = prefill + 40
    k, v = torch.randn(2, 1, 2, n, 64).unbind(0)
    queries = torch.randn(1, 4, n, 64)
    steps = [(prefill, prefill + 1)] * 1 + [(t, t + 1) for t in range(prefill + 1, prefill + 20)]
    steps += [(t, t + 3) for t in range(prefill + 20, n - 2, 3)]
    pos = 0
    for start, stop in [(0, prefill)] + steps:
        assert start == pos
        past = layer.read() if layer.num_tokens else None
        mask = None
        if stop - start == 3 and start % 2:  # a chunk with an explicit mask hiding stored tokens
            mask = torch.ones(1, 1, 3, stop, dtype=torch.bool).tril(start)
            mask[..., [1, start // 2]] = False
        keys, values = layer.update(k[:, :, start:stop], v[:, :, start:stop])
        got, _ = layer.attend(module(), queries[:, :, start:stop], keys, values, mask, scaling=SCALING)
        want = reference(past, k[:, :, start:stop], v[:, :, start:stop], queries[:, :, start:stop], mask)
        where = f"{case} [{start}, {stop})"
        torch.testing.assert_close(
            got, want, rtol=2e-5, atol=2e-5, msg=lambda m, where=where: f"{where}: {m}"
        )
        pos = stop
    assert layer.num_tokens == pos


@pytest.mark.parametrize("case", [c for c in CASES if c not in ("semkv-attention",)])
def test_decode_attends_sources_not_a_rebuilt_cache(case):
    """After the prompt, update() returns only the forward's tokens (the stored ones are attended
    from the sources it took), and those sources laid out by position equal the reference read."""
    torch.manual_seed(1)
    method = build_method(node_of(case))
    layer = method.new_cache(SHAPE, torch.float32).layers[0]
    k, v = torch.randn(2, 1, 2, 201, 64).unbind(0)
    layer.update(k[:, :, :200], v[:, :, :200])
    past_k, past_v = layer.read()
    keys, values = layer.update(k[:, :, 200:], v[:, :, 200:])
    assert torch.equal(keys, k[:, :, 200:]) and torch.equal(values, v[:, :, 200:])
    dense_k, dense_v = dense_stored(layer.stored_for_attention, 200)
    torch.testing.assert_close(dense_k, past_k.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dense_v, past_v.float(), rtol=1e-6, atol=1e-6)
