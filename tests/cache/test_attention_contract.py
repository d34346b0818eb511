"""The attention contract of :mod:`kvbench.cache.cache`: attention reads the storage of the cache
the forward hands it, whatever other cache was updated in between; without a kvbench cache it is
plain SDPA; a forward that hands transformers a kvbench cache but not the attention function is
refused; importing kvbench registers nothing with transformers.

Values encode their token index (``v[..., t, :] = t``) and keys are zero, so every query attends
uniformly and its output is the mean index of what it attended.
"""

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from tiny_archs import tiny_model
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbench.cache.attention import kvbench_attention
from kvbench.methods import ModelShape, build_method

SHAPE = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=4)
MODULE = SimpleNamespace(scaling=1.0, num_key_value_groups=2, is_causal=True, layer_idx=0)


def index_values(t: int, start: int = 0) -> torch.Tensor:
    """``[1, 2, t, 4]`` values whose every entry is the token's index."""
    return torch.arange(start, start + t, dtype=torch.float32)[None, None, :, None].expand(1, 2, t, 4).clone()


def prefilled(start: int, t: int = 8):
    """An fp16 cache whose layer 0 holds ``t`` tokens of values ``start .. start + t - 1``."""
    cache = build_method({"name": "fp16", "fp_dtype": "auto"}).new_cache(SHAPE, torch.float32)
    keys, values = cache.update(torch.zeros(1, 2, t, 4), index_values(t, start), 0)
    kvbench_attention(MODULE, torch.zeros(1, 4, t, 4), keys, values, None, kvbench_cache=cache)
    return cache


def test_two_caches_updated_in_turn_each_attend_their_own_tokens():
    a, b = prefilled(0), prefilled(100)
    q = torch.zeros(1, 4, 1, 4)
    # both updates before either attention, as two generate calls alternating layer by layer
    ka, va = a.update(torch.zeros(1, 2, 1, 4), index_values(1, 8), 0)
    kb, vb = b.update(torch.zeros(1, 2, 1, 4), index_values(1, 108), 0)
    assert ka.shape[-2] == kb.shape[-2] == 1  # the 8 stored tokens are read from each cache's storage
    out_b, _ = kvbench_attention(MODULE, q, kb, vb, None, kvbench_cache=b)
    out_a, _ = kvbench_attention(MODULE, q, ka, va, None, kvbench_cache=a)
    # the mean of 0..8 and of 100..108 over all 9 tokens; attending the new token alone gives 8, 108
    assert torch.allclose(out_a, torch.full((1, 1, 4, 4), 4.0))
    assert torch.allclose(out_b, torch.full((1, 1, 4, 4), 104.0))


def test_what_the_layer_took_for_attention_is_the_stored_tokens():
    cache = prefilled(0)
    cache.update(torch.zeros(1, 2, 1, 4), index_values(1, 8), 0)
    stored = cache.layers[0].stored_for_attention
    assert stored.num_entries == 8 and stored.positions is None


def test_without_a_kvbench_cache_attention_is_sdpa_over_what_it_is_given():
    q, k, v = torch.randn(1, 4, 3, 4), torch.randn(1, 2, 3, 4), index_values(3)
    got, _ = kvbench_attention(MODULE, q, k, v, None, scaling=0.5)
    want, _ = sdpa_attention_forward(MODULE, q, k, v, None, scaling=0.5)
    assert torch.equal(got, want)


def test_keys_other_than_the_update_returned_are_attended_as_given():
    # a model that shares or recomputes keys: the layer's storage is not what this call reads
    cache = prefilled(0)
    keys, values = cache.update(torch.zeros(1, 2, 1, 4), index_values(1, 8), 0)
    got, _ = kvbench_attention(
        MODULE, torch.zeros(1, 4, 1, 4), keys.clone(), values, None, kvbench_cache=cache
    )
    assert torch.allclose(got, torch.full((1, 1, 4, 4), 8.0))  # the new token alone


def test_a_forward_handing_the_cache_to_transformers_only_is_refused():
    model, shape = tiny_model("llama")
    cache = build_method({"name": "fp16", "fp_dtype": "auto"}).new_cache(shape, torch.float32)
    with pytest.raises(RuntimeError, match=r"forward_kwargs\(\)"):
        model(input_ids=torch.tensor([[1, 2, 3]]), cache=cache, use_cache=True)
    fresh = build_method({"name": "fp16", "fp_dtype": "auto"}).new_cache(shape, torch.float32)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]), **fresh.forward_kwargs())
    assert fresh.get_seq_length() == 3


def test_importing_kvbench_registers_no_attention_function():
    code = (
        "import kvbench.builder, kvbench.cache, kvbench.generate, kvbench.lmeval, kvbench.methods,"
        " kvbench.run, kvbench.tasks\n"
        "from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS\n"
        "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS\n"
        "from kvbench.cache import ATTN_IMPLEMENTATION, register_attention\n"
        "registries = (ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS)\n"
        "before = [ATTN_IMPLEMENTATION in r for r in registries]\n"
        "register_attention()\n"
        "after = [ATTN_IMPLEMENTATION in r for r in registries]\n"
        "print(before, after)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[-2] == "[False, False] [True, True]"


def test_the_plain_causal_mask_is_left_to_the_attention():
    from transformers.masking_utils import sdpa_mask, sliding_window_causal_mask_function

    from kvbench.cache.attention import kvbench_mask

    plain = dict(batch_size=1, q_length=2, kv_length=10, q_offset=8, kv_offset=0, attention_mask=None)
    assert kvbench_mask(**plain) is None
    padded = {**plain, "attention_mask": torch.tensor([[0, 0, *[1] * 8]], dtype=torch.bool)}
    sliding = {**plain, "mask_function": sliding_window_causal_mask_function(4), "local_size": 4}
    static = {**plain, "kv_length": 16}  # keys beyond the queries: a preallocated cache
    for kwargs in (padded, sliding, static, {**plain, "allow_is_causal_skip": False}):
        got = kvbench_mask(**kwargs)
        assert got is not None and torch.equal(got, sdpa_mask(**kwargs)), kwargs


@pytest.mark.parametrize("kvbench_cache", [True, False])
def test_a_multi_token_step_over_a_cache_is_causal_for_the_newest_tokens(kvbench_cache):
    # without a mask (kvbench_mask), a 2-token forward after a prefill must still hide the second
    # token from the first, over kvbench's cache and over transformers' own (plain SDPA)
    from transformers import DynamicCache

    model, shape = tiny_model("llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits[:, -2:]
        if kvbench_cache:
            cache = build_method({"name": "fp16", "fp_dtype": "auto"}).new_cache(shape, torch.float32)
            kwargs = cache.forward_kwargs()
        else:
            kwargs = {"cache": DynamicCache(), "use_cache": True}
        model(input_ids=ids[:, :7], **kwargs)
        got = model(input_ids=ids[:, 7:], **kwargs).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
