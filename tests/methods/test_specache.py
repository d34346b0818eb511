"""SpeCache's equations on hand-made layers, and its decode driver on the real model."""

from types import SimpleNamespace

import pytest
import torch
from stored_reference import dense_stored

from kvbench.cache import memory_report
from kvbench.errors import ConfigError
from kvbench.generate import ModelRunner
from kvbench.methods import ModelShape, build_method
from kvbench.methods.specache import HOST_BLOCK, PRE_DECODE, SPECULATIVE_STEP, Plan, TopKScores


def specache_layer(head_dim=8, **overrides):
    node = {"name": "specache", "bits": 1, "group_size": 2, "residual": 2, **overrides}
    method = build_method(node)
    method.config.check_model(ModelShape(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=head_dim))
    return method.make_layer(0, None, torch.float32)


def attend(layer, query, keys, values, scaling=1.0):
    out, _ = layer.attend(SimpleNamespace(scaling=scaling), query, keys, values, None, scaling=scaling)
    return out  # [B, q, H, D]


def reference_attention(query, keys, values, scaling):
    """Causal softmax attention with the query heads sharing KV heads in order (GQA)."""
    rep = query.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1)
    q, s = query.shape[-2], keys.shape[-2]
    scores = query @ k.transpose(-1, -2) * scaling
    allowed = torch.arange(s)[None, :] <= s - q + torch.arange(q)[:, None]
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return (probs @ v).transpose(1, 2)


def test_one_bit_zero_point_and_scale_through_the_layer():
    # tokens x channels, one KV head; G = 2, R = 2: the 4 keys are quantized per channel in two token
    # groups, the first 2 values per token, the last 2 values stay in the residual
    keys = torch.tensor([[0.0, -2.0], [4.0, 2.0], [1.0, 10.0], [3.0, 6.0]])[None, None]
    values = torch.tensor([[0.0, 8.0], [-4.0, 4.0], [5.0, 7.0], [1.0, -1.0]])[None, None]
    layer = specache_layer(head_dim=2)
    layer.update(keys, values)
    got_k, got_v = layer.read()
    # z = (3 min + max) / 4, s = (max - min) / 2: codes reconstruct z and z + s
    # channel 0, tokens 0-1: [0, 4] -> z = 1, s = 2; channel 1: [-2, 2] -> z = -1, s = 2
    # channel 0, tokens 2-3: [1, 3] -> z = 1.5, s = 1; channel 1: [10, 6] -> z = 7, s = 2
    want_k = torch.tensor([[1.0, -1.0], [3.0, 1.0], [1.5, 9.0], [2.5, 7.0]])
    # token 0: [0, 8] -> z = 2, s = 4; token 1: [-4, 4] -> z = -2, s = 4; tokens 2-3 exact
    want_v = torch.tensor([[2.0, 6.0], [-2.0, 2.0], [5.0, 7.0], [1.0, -1.0]])
    assert torch.equal(got_k[0, 0], want_k)
    assert torch.equal(got_v[0, 0], want_v)
    # the host keeps the exact FP16 cache
    assert torch.equal(layer.host_k.buf.float(), keys) and torch.equal(layer.host_v.buf.float(), values)


def test_minmax_zero_point_is_kivi_at_one_bit():
    keys = torch.tensor([[0.0], [4.0]])[None, None]
    layer = specache_layer(head_dim=1, zero_point="minmax", group_size=1)
    layer.update(keys, keys)
    assert torch.equal(layer.read()[0][0, 0, :, 0], torch.tensor([0.0, 4.0]))  # z = min, s = max - min


def observe(probs: torch.Tensor, row: int, stored: int, positions=None, replaced=None) -> TopKScores:
    """Feed a TopKScores the logits of ``probs [B, H_kv, rep, q, S]`` (m = 0, l = 1, so its
    probabilities are ``probs``): ``stored`` entries in one block, then the q exact tokens."""
    b, h, rep, q, total = probs.shape
    logits = probs.log().reshape(b, h, rep * q, total)  # rows ordered (rep, position)
    length = total - q - (0 if replaced is None else replaced.shape[-1])
    scores = TopKScores(row, q, rep, positions, length, replaced)
    scores.block(0, stored, logits[..., :stored])
    scores.block(stored, stored + q, logits[..., stored:])
    scores.done(torch.zeros(b, h, rep * q, 1), torch.ones(b, h, rep * q, 1))
    return scores


def test_topk_sums_the_query_heads_of_a_kv_head():
    # [B, H_kv, rep, q, S]: row 1 (the speculative token) over 6 tokens, two query heads
    probs = torch.zeros(1, 1, 2, 2, 6)
    probs[0, 0, 0, 1] = torch.tensor([0.1, 0.0, 0.0, 0.5, 0.1, 0.3])
    probs[0, 0, 1, 1] = torch.tensor([0.0, 0.2, 0.1, 0.1, 0.6, 0.0])
    probs[0, 0, :, 0, 0] = 1.0  # row 0 attends token 0 only: must not be the one used
    # sums: [0.1, 0.2, 0.1, 0.6, 0.7, 0.3]
    assert sorted(observe(probs, 1, 4).top(2, 6)[0, 0].tolist()) == [3, 4]
    assert sorted(observe(probs, -1, 4).top(2, 4)[0, 0].tolist()) == [1, 3]  # candidates: first 4
    assert observe(probs, 0, 4).top(2, 6)[0, 0, 0].item() == 0
    assert observe(probs, 1, 4).top(0, 6) is None
    # entries out of order: positions say where each stored entry sits; -1 is never counted
    shuffled = probs[..., [2, 0, 3, 1, 4, 5]]
    positions = torch.tensor([[[2, 0, -1, 1]]])  # entry 2 (position 3) hidden
    scores = observe(shuffled, 1, 4, positions)
    assert torch.allclose(scores.scores[0, 0, :6], torch.tensor([0.1, 0.2, 0.1, 0.0, 0.7, 0.3]))
    # in order, with a replacement of position 3 after the 4 stored entries: the hidden entry's
    # probability is 0 and the replacement's is counted at position 3
    swapped = torch.cat([probs[..., :4], probs[..., 3:4], probs[..., 4:]], dim=-1)
    swapped[..., 3] = 0.0
    scores = observe(swapped, 1, 5, replaced=torch.tensor([[[3]]]))
    assert torch.allclose(scores.scores[0, 0, :6], torch.tensor([0.1, 0.2, 0.1, 0.6, 0.7, 0.3]))


def test_speculative_row_chooses_the_prefetch():
    torch.manual_seed(0)
    layer = specache_layer(topk=2, bits=8)  # 8 bits: the hand-made keys survive quantization
    keys = 10 * torch.eye(8)[None, None]  # token j's key is 10 e_j
    layer.update(keys, torch.randn(1, 1, 8, 8))
    layer.plan = SPECULATIVE_STEP
    new = torch.zeros(1, 1, 2, 8)
    k_all, v_all = layer.update(new, torch.randn(1, 1, 2, 8))
    assert layer.num_tokens == 9  # the speculative token is not stored
    query = torch.zeros(1, 2, 2, 8)
    query[:, :, 0, 1] = 1.0  # the output token looks at token 1
    query[:, :, 1, 2] = query[:, :, 1, 5] = 1.0  # the speculative token at tokens 2 and 5
    attend(layer, query, k_all, v_all)
    assert sorted(layer.fetched_idx[0, 0].tolist()) == [2, 5]
    assert layer.prefetch_stats() == (1, 2, 2 * 2 * 8 * 2)


def test_substitution_puts_the_prefetched_fp16_rows_back():
    torch.manual_seed(0)
    layer = specache_layer(topk=2)
    k, v = torch.randn(2, 1, 1, 9, 8).unbind(0)
    layer.update(k[:, :, :8], v[:, :, :8])
    low_k, low_v = layer.read()
    layer.fetch(torch.tensor([[[1, 6]]]), asynchronous=False)
    layer.plan = Plan(store=1, select=None, use_fetched=True)
    new_k, new_v = layer.update(k[:, :, 8:], v[:, :, 8:])
    assert torch.equal(new_k, k[:, :, 8:]) and torch.equal(new_v, v[:, :, 8:])  # attended exactly
    got_k, got_v = dense_stored(layer.stored_for_attention, 8)  # what the step attends from storage
    for got, low, exact in ((got_k, low_k, k), (got_v, low_v, v)):
        fetched = exact[:, :, [1, 6]].half().float()
        assert torch.equal(got[:, :, [1, 6]], fetched)
        rest = [0, 2, 3, 4, 5, 7]
        assert torch.equal(got[:, :, rest], low[:, :, rest].float())
        assert not torch.equal(low[:, :, [1, 6]], fetched)  # the substitution changed something


@pytest.mark.parametrize("speculative", [True, False])
def test_k_covering_the_context_is_full_precision_attention(speculative):
    torch.manual_seed(1)
    layer = specache_layer(topk=1000, speculative=speculative)
    k, v = torch.randn(2, 1, 1, 42, 8).unbind(0)
    q = torch.randn(1, 2, 2, 8)
    scaling = 8**-0.5
    layer.update(k[:, :, :40], v[:, :, :40])
    past_k, past_v = k[:, :, :40].half().float(), v[:, :, :40].half().float()
    if speculative:
        layer.plan = PRE_DECODE  # the output token alone over C': chooses every candidate
        keys, values = layer.update(k[:, :, 40:41], v[:, :, 40:41])
        attend(layer, q[:, :, :1], keys, values, scaling)
        assert layer.fetched_idx.shape[-1] == len(layer.kq) == 40  # every low-bit key is fetched
        layer.plan = SPECULATIVE_STEP
        keys, values = layer.update(k[:, :, 40:], v[:, :, 40:])
        got = attend(layer, q, keys, values, scaling)
        want = reference_attention(
            q, torch.cat([past_k, k[:, :, 40:]], 2), torch.cat([past_v, v[:, :, 40:]], 2), scaling
        )
    else:
        keys, values = layer.update(k[:, :, 40:41], v[:, :, 40:41])
        got = attend(layer, q[:, :, :1], keys, values, scaling)
        want = reference_attention(
            q[:, :, :1],
            torch.cat([past_k, k[:, :, 40:41]], 2),
            torch.cat([past_v, v[:, :, 40:41]], 2),
            scaling,
        )
    assert layer.fetched_idx.shape[-1] == 40
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    low_bit = reference_attention(
        q[:, :, :1],
        torch.cat([layer.read()[0][:, :, :40], k[:, :, 40:41]], 2),
        torch.cat([layer.read()[1][:, :, :40], v[:, :, 40:41]], 2),
        scaling,
    )
    assert (low_bit - want[:, :1]).abs().max() > 1e-2  # the low-bit cache alone is visibly different


def test_host_and_device_bytes_are_separate():
    torch.manual_seed(0)
    layer = specache_layer(topk=4, group_size=8, residual=8)
    b, h, t, d = 1, 1, 64, 8
    k, v = torch.randn(2, b, h, t + 10, d).unbind(0)
    layer.update(k[:, :, :t], v[:, :, :t])
    report = memory_report([layer])
    fp16_kv = 2 * b * h * t * d * 2
    assert report.host_bytes == fp16_kv == report.fp16_bytes
    host_ptrs = {x.data_ptr() for x in layer.host_tensors()["host_fp"]}
    held = [x for xs in layer.held_tensors().values() for x in xs]
    assert not host_ptrs & {x.data_ptr() for x in held}
    assert report.device_bytes == report.total_bytes == sum(x.numel() * x.element_size() for x in held)
    assert report.effective_bits == 8 * report.device_bytes / report.n_values
    assert report.device_bytes < fp16_kv / 2
    # decoding: a fetch adds k FP16 pairs per KV head on the device, the host grows by blocks
    for i in range(t, t + 10):
        layer.fetch(torch.tensor([[[0, 1, 2, 3]]]), asynchronous=False)
        layer.update(k[:, :, i : i + 1], v[:, :, i : i + 1])
    report = memory_report([layer])
    assert report.bytes_by_component["prefetched"] == 2 * b * h * 4 * d * 2
    cap = layer.host_k.buf.shape[-2]
    assert t + 10 <= cap < t + 10 + HOST_BLOCK
    assert report.host_bytes == 2 * b * h * cap * d * 2
    assert torch.equal(layer.host_k.buf[:, :, : t + 10].float(), k.half().float())
    assert report.prefetch_entries_per_step == 4 and report.prefetch_bytes_per_step == 2 * 4 * d * 2
    assert report.to_dict()["host_bytes"] == report.host_bytes


def test_methods_without_a_host_copy_report_none():
    method = build_method({"name": "kivi", "bits": 2})
    layer = method.make_layer(0, None, torch.float32)
    layer.update(torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64))
    report = memory_report([layer])
    assert report.host_bytes == 0 and report.prefetch_bytes_per_step is None
    assert report.device_bytes == report.total_bytes


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"topk": -1}, "method.topk"),
        ({"topk": 2.5}, "method.topk"),
        ({"speculative": "yes"}, "method.speculative"),
        ({"sink_tokens": 4}, "method.sink_tokens"),
        ({"residual": 48}, "method.residual"),
        ({"zero_point": "mean"}, "method.zero_point"),
        ({"bits": 1.3}, "bits"),
    ],
)
def test_bad_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        build_method({"name": "specache", **overrides})
    assert err.value.key == key


def test_defaults_follow_the_paper():
    c = build_method({"name": "specache"}).config
    assert (c.topk, c.residual, c.group_size, c.bits, c.zero_point, c.speculative) == (
        64,
        64,
        32,
        1.0,
        "specache",
        True,
    )


# -- the real model --------------------------------------------------------------------------------

TEXT = "The quick brown fox jumps over the lazy dog. My favourite number is 7391. " * 7


@pytest.fixture(scope="module")
def prompt(default_model):
    _, tokenizer, _ = default_model
    msg = [{"role": "user", "content": TEXT + "What is my favourite number?"}]
    ids = tokenizer.apply_chat_template(
        msg, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return ids["input_ids"]  # ~170 tokens: past R = 64, so most of the cache is low-bit


def runner(default_model, node):
    model, tokenizer, shape = default_model
    return ModelRunner(model, tokenizer, build_method(node), shape)


@pytest.mark.slow
def test_model_full_k_equals_fp16_and_k0_equals_kivi(default_model, prompt):
    n = 8
    fp = runner(default_model, {"name": "fp16"})
    want = fp.generate(prompt, n)
    full = runner(default_model, {"name": "specache", "topk": 10**6})
    got = full.generate(prompt, n)
    assert got.token_ids == want.token_ids
    assert got.memory.host_bytes >= got.memory.fp16_bytes
    # the first decode step's logits: pre-decoding, then [T_1, T'_2] over C' U C_K = the FP16 cache
    cache_fp, cache_sc = fp.new_cache(), full.new_cache()
    first = int(fp.forward(prompt, cache_fp)[0, -1].argmax())
    full.forward(prompt, cache_sc)
    nxt = torch.tensor([[first]])
    torch.testing.assert_close(full.decode_step(nxt, cache_sc), fp.forward(nxt, cache_fp), atol=2e-3, rtol=0)
    exact = runner(default_model, {"name": "specache", "topk": 10**6, "speculative": False}).generate(
        prompt, n
    )
    assert exact.token_ids == want.token_ids
    # k = 0: the low-bit cache alone, i.e. KIVI-1 with the same residual, token for token
    k0 = runner(default_model, {"name": "specache", "topk": 0}).generate(prompt, n)
    kivi = runner(
        default_model,
        {"name": "kivi", "bits": 1, "zero_point": "specache", "arithmetic": "fp32", "residual": 64},
    )
    kivi_out = kivi.generate(prompt, n)
    assert k0.token_ids == kivi_out.token_ids
    assert k0.memory.device_bytes == kivi_out.memory.total_bytes  # same low-bit copy, nothing fetched


@pytest.mark.slow
def test_model_speculative_token_does_not_touch_the_output(default_model, prompt):
    """The two-token forward's output row equals a one-token forward that attends the same
    prefetched sets, injected: the speculative token only chooses what is fetched."""
    n = 6
    r = runner(default_model, {"name": "specache", "topk": 16})
    cache = r.new_cache()
    for layer in cache.layers:
        layer.log = []
    tokens = [int(r.forward(prompt, cache)[0, -1].argmax())]
    spec_logits = []
    for _ in range(n):
        spec_logits.append(r.decode_step(torch.tensor([[tokens[-1]]]), cache))
        tokens.append(int(spec_logits[-1][0, -1].argmax()))
    assert cache.get_seq_length() == prompt.shape[1] + n  # only output tokens were stored
    assert all(len(layer.log) == n for layer in cache.layers)

    replay = r.new_cache()
    r.forward(prompt, replay)
    replay.set_plan(Plan(store=1, select=None, use_fetched=True))
    for i in range(n):
        for spec_layer, layer in zip(cache.layers, replay.layers, strict=True):
            layer.fetch(spec_layer.log[i], asynchronous=False)
        logits = r.forward(torch.tensor([[tokens[i]]]), replay)
        assert int(logits[0, -1].argmax()) == tokens[i + 1]
        # Same stored bytes and fetched rows; only the GEMM shapes differ (two query rows against
        # one), which moves float32 logits of magnitude ~20 by a few 1e-3 after 30 layers.
        torch.testing.assert_close(logits, spec_logits[i], atol=5e-3, rtol=0)
