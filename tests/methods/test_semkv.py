"""SemKV: the two-level allocation (target bits with the carried remainder), top-p by metric, each
importance metric on a hand case, chunk-wise delayed allocation, the seeded control, accounting,
and config errors."""

import math

import pytest
import torch

from kvbench.cache import memory_report, use_kvbench_attention
from kvbench.errors import ConfigError
from kvbench.methods import ModelShape, build_method
from kvbench.methods.semkv import semkv_layers
from kvbench.methods.semkv_metrics import METRICS, attention_update, hidden_metric, logit_scores
from kvbench.quant.affine import fake_quantize_grouped
from kvbench.quant.mixed import RunningAllocator, high_fraction, top_k_mask

B5, B6 = math.log2(5), math.log2(6)
P = (2.39 - B5) / (B6 - B5)


def method(**node):
    return build_method({"name": "semkv", **node})


def layer_of(m, shape=None, idx=0):
    shape = shape or ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    m.config.check_model(shape)
    return m.new_cache(shape, torch.float32).layers[idx]


# -- allocation -------------------------------------------------------------------------------------


def test_high_fraction_is_the_linear_interpolation():
    assert high_fraction(2.39, 5, 6) == pytest.approx(P)
    assert P == pytest.approx(0.2587, abs=1e-4)
    assert high_fraction(B5, 5, 6) == 0.0 and high_fraction(B6, 5, 6) == 1.0
    with pytest.raises(ValueError):
        high_fraction(2.6, 5, 6)


@pytest.mark.parametrize("bits, p", [(2.585, 1.0), (2.322, None), (2.58, None), (2.3219, 0.0)])
def test_grid_ends_accept_the_spelling_every_bit_width_accepts(bits, p):
    """``bits=2.585`` names log2 6 for SemKV as for uniform: the same 0.005 tolerance at each end."""
    assert method(bits=2.585).config.high_fraction == 1.0
    assert build_method({"name": "uniform", "bits": bits}).config.levels() in (5, 6)
    got = method(target_bits=bits).config.high_fraction
    assert got == pytest.approx((bits - B5) / (B6 - B5) if p is None else p)
    for outside in (2.591, 2.316):
        with pytest.raises(ConfigError, match="within 0.005"):
            method(target_bits=outside)


def test_carried_remainder_keeps_every_prefix_at_round_p_n():
    alloc = RunningAllocator(P)
    units, total, high = [300, 64, 64, 64, 17, 64, 1, 64], 0, 0
    for n in units:
        k = alloc.take(n)
        total, high = total + n, high + k
        assert high == math.floor(P * total + 0.5)
        avg = (high * B6 + (total - high) * B5) / total
        assert abs(avg - 2.39) <= (B6 - B5) / (2 * total) + 1e-12
    # per-chunk rounding alone would give round(0.2587 * 64) = 17 every chunk: 17 / 64 = 0.2656
    alloc = RunningAllocator(P)
    ks = [alloc.take(64) for _ in range(10)]
    assert sum(ks) == round(P * 640) == 166 and set(ks) == {16, 17}


def test_layer_reaches_the_target_average_exactly():
    # p = 1/4 exactly: 100 prefill + 3 chunks of 64 = 292 tokens -> 73 high tokens, no rounding at all
    target = B5 + 0.25 * (B6 - B5)
    m = method(target_bits=target, chunk=64)
    layer = layer_of(m)
    torch.manual_seed(0)
    x = torch.randn(2, 1, 2, 100 + 3 * 64, 16)
    layer.update(x[0, :, :, :100], x[1, :, :, :100])
    for t in range(100, 100 + 3 * 64):
        layer.update(x[0, :, :, t : t + 1], x[1, :, :, t : t + 1])
    assert layer.pending() == 0 and layer.allocated_tokens() == 292
    assert layer.allocation_mask()[0, 0].sum() == 73  # 25 of the prefill, 16 per chunk
    report = memory_report([layer])
    assert report.nominal_code_bits == pytest.approx(target, abs=1e-12)
    # and at the default 2.39, every prefix is within half a token of the target
    layer = layer_of(method())
    layer.update(x[0, :, :, :100], x[1, :, :, :100])
    assert layer.allocation_mask()[0, 0].sum() == round(P * 100) == 26
    got = memory_report([layer]).nominal_code_bits
    assert got == pytest.approx((26 * B6 + 74 * B5) / 100, abs=1e-12)
    assert abs(got - 2.39) <= (B6 - B5) / 200


def test_top_k_mask_hand_case():
    s = torch.tensor([[3.0, 1.0, 4.0, 1.0, 5.0], [1.0, 1.0, 1.0, 0.0, float("nan")]])
    assert top_k_mask(s, 2).tolist() == [[False, False, True, False, True], [True, True, False, False, False]]
    assert top_k_mask(s, 0).sum() == 0 and top_k_mask(s, 9).all()


def test_top_p_by_key_norm_get_the_higher_level_count():
    # 2 of 8 tokens high (p = 1/4); kv head 0 ranks tokens by ascending norms, head 1 reversed
    m = method(target_bits=B5 + 0.25 * (B6 - B5))
    layer = layer_of(m)
    norms = torch.arange(1.0, 9.0)
    keys = torch.zeros(1, 2, 8, 16)
    keys[0, 0, :, 0] = norms
    keys[0, 1, :, 3] = norms.flip(0)
    values = torch.randn(1, 2, 8, 16)
    layer.update(keys, values)
    mask = layer.allocation_mask()[0]
    assert mask[0].nonzero().flatten().tolist() == [6, 7]
    assert mask[1].nonzero().flatten().tolist() == [0, 1]
    # high tokens are quantized at 6 levels, the others at 5: as quantizing them directly
    k, v = layer.read()
    for h in range(2):
        want_v, held = torch.empty(8, 16), values[0, h].half()  # pending tokens are held in fp16
        want_v[mask[h]] = fake_quantize_grouped(held[mask[h]], 6, "token", None)
        want_v[~mask[h]] = fake_quantize_grouped(held[~mask[h]], 5, "token", None)
        assert torch.equal(v[0, h], want_v)
    high_k, low_k = layer.stores["k"]
    assert high_k.levels == 6 and low_k.levels == 5
    assert len(high_k) == 2 and len(low_k) == 6


def test_value_norm_ranks_values():
    values = torch.zeros(1, 2, 4, 16)
    values[0, :, :, 0] = torch.tensor([1.0, -9.0, 2.0, 3.0])  # norms 1, 9, 2, 3
    layer = layer_of(method(target_bits=B5 + 0.25 * (B6 - B5), metric="value_norm"))
    layer.update(torch.randn(1, 2, 4, 16), values)
    assert layer.allocation_mask()[0, :, 1].all() and layer.allocation_mask()[0].sum() == 2


# -- logit metrics ----------------------------------------------------------------------------------


def test_entropy_and_surprisal_hand_case():
    logits = torch.tensor([[[0.0, 0.0], [math.log(3.0), 0.0], [0.0, math.log(4.0)]]])
    ids = torch.tensor([[0, 1, 0]])
    ent, last = logit_scores("entropy", logits, ids, None)
    h = lambda *p: -sum(x * math.log(x) for x in p)  # noqa: E731
    assert ent[0].tolist() == pytest.approx([h(0.5, 0.5), h(0.75, 0.25), h(0.2, 0.8)])
    assert last[0].exp().tolist() == pytest.approx([0.2, 0.8])
    sur, _ = logit_scores("surprisal", logits, ids, None)
    # token 0 has no prediction (+inf); token 1 from row 0 (p = 1/2), token 2 from row 1 (p = 3/4)
    assert sur[0, 0] == math.inf and sur[0, 1:].tolist() == pytest.approx([math.log(2), -math.log(0.75)])
    sur, _ = logit_scores("surprisal", logits, ids, torch.log(torch.tensor([[0.1, 0.9]])))
    assert sur[0, 0].item() == pytest.approx(-math.log(0.1))


def test_logit_scores_across_position_chunks():
    torch.manual_seed(0)
    logits, ids = torch.randn(1, 300, 7), torch.randint(0, 7, (1, 300))
    logp = torch.log_softmax(logits, -1)
    ent, _ = logit_scores("entropy", logits, ids, None)
    assert torch.allclose(ent, -(logp.exp() * logp).sum(-1), atol=1e-5)
    sur, _ = logit_scores("surprisal", logits, ids, None)
    want = -logp[0, :-1].gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(sur[0, 1:], want, atol=1e-5)


# -- attention metrics ------------------------------------------------------------------------------


def direct_attention(query, keys, mask_bool, scaling):
    rep = query.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(rep, dim=1)
    s = query @ k.transpose(-1, -2) * scaling
    s = s.masked_fill(~mask_bool, -math.inf)
    return torch.softmax(s, -1)  # [B, H, q, kv]


@pytest.mark.parametrize("metric", ["attn_sum", "attn_max"])
@pytest.mark.parametrize("explicit_mask", [False, True])
def test_attention_metrics_against_a_direct_softmax(metric, explicit_mask):
    torch.manual_seed(0)
    q_len, kv, pend = 5, 7, 3
    query, keys = torch.randn(1, 4, q_len, 8), torch.randn(1, 2, kv, 8)
    causal = torch.arange(kv)[None, :] <= torch.arange(q_len)[:, None] + (kv - q_len)
    w = direct_attention(query, keys, causal, 0.3)[..., -pend:].reshape(1, 2, 2, q_len, pend)
    want = w.sum((2, 3)) if metric == "attn_sum" else w.amax((2, 3))
    start = torch.zeros(1, 2, pend)
    mask = causal[None, None] if explicit_mask else None
    got = attention_update(start, query, keys, mask, 0.3, metric, query_chunk=2)
    assert torch.allclose(got, want, atol=1e-6)
    # accumulating: a second forward adds (sum) or keeps the max
    again = attention_update(got, query, keys, mask, 0.3, metric, query_chunk=2)
    assert torch.allclose(again, 2 * want if metric == "attn_sum" else want, atol=1e-6)


# -- delayed allocation -----------------------------------------------------------------------------


def test_a_chunk_stays_full_precision_until_it_fills():
    layer = layer_of(method(chunk=4))
    torch.manual_seed(0)
    k, v = torch.randn(2, 1, 2, 13, 16).unbind(0)
    layer.update(k[:, :, :5], v[:, :, :5])
    assert layer.pending() == 0 and layer.allocated_tokens() == 5  # the prefill at once
    for t in range(5, 8):
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert layer.pending() == t - 4 and layer.allocated_tokens() == 5
        stored_k, _ = layer.read()
        assert torch.equal(stored_k[:, :, 5 : t + 1], k[:, :, 5 : t + 1].half().float())  # full precision
    residual = memory_report([layer]).bytes_by_component["residual"]
    assert residual == 2 * 2 * 3 * 16 * 2  # K and V, 2 heads, 3 tokens, D = 16, fp16
    layer.update(k[:, :, 8:9], v[:, :, 8:9])
    assert layer.pending() == 0 and layer.allocated_tokens() == 9 and layer.unit_sizes == [5, 4]
    for t in range(9, 13):
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert layer.unit_sizes == [5, 4, 4]


def test_accounting_of_codes_index_and_params():
    layer = layer_of(method(chunk=8))
    torch.manual_seed(0)
    k, v = torch.randn(2, 1, 2, 20, 16).unbind(0)
    layer.update(k[:, :, :10], v[:, :, :10])  # 10 allocated: 3 high (round(2.587)), 7 low
    for t in range(10, 13):
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    report = memory_report([layer])
    by = report.bytes_by_component
    # per (K/V, head): 3 high (6-level) codes of 16 in 6 bytes each (3 per byte), 7 low (5-level)
    # in 6 bytes each (two 3-byte words of 10 codes)
    assert by["codes"] == 2 * 2 * (3 * 6 + 7 * 6)
    assert by["scales"] == by["zeros"] == 2 * 2 * 10 * 2  # one fp16 pair per token (G = head_dim)
    assert by["index"] == 2 * 2  # one bit per token and kv head, 10 bits -> 2 bytes per head
    assert by["residual"] == 2 * 2 * 3 * 16 * 2 and by["scores"] == 2 * 3 * 4
    assert report.quantized_values == 2 * 2 * 10 * 16
    assert report.nominal_code_bits == pytest.approx((3 * B6 + 7 * B5) / 10)
    assert report.effective_bits == pytest.approx(8 * report.total_bytes / (2 * 2 * 13 * 16))


def test_turboquant_base_equals_turboquant_per_level():
    node = {"target_bits": B5 + 0.25 * (B6 - B5), "base": "turboquant"}
    layer = layer_of(method(**node))
    torch.manual_seed(0)
    k, v = torch.randn(2, 1, 2, 8, 16).unbind(0)
    layer.update(k, v)
    mask = layer.allocation_mask()
    got_k, _ = layer.read()
    shape = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16)
    for levels, sel in ((6, mask), (5, ~mask)):
        ref = build_method({"name": "turboquant", "bits": math.log2(levels)}).new_cache(shape, torch.float32)
        ref.layers[0].update(k.half().float(), v.half().float())  # semkv quantizes its fp16 pending copy
        want_k, _ = ref.layers[0].read()
        assert torch.allclose(got_k[sel], want_k[sel], atol=1e-6)
    by = memory_report([layer]).bytes_by_component
    assert by["norms"] == 2 * 2 * 8 * 2 and by["seeds"] == 8


# -- the random control and the model-level path ----------------------------------------------------


def test_random_metric_is_seeded():
    torch.manual_seed(0)
    k, v = torch.randn(2, 1, 2, 200, 16).unbind(0)

    def mask(seed):
        layer = layer_of(method(metric="random", seed=seed))
        layer.update(k, v)
        return layer.allocation_mask()

    assert torch.equal(mask(3), mask(3))
    assert not torch.equal(mask(3), mask(4))
    assert mask(3)[0, 0].sum() == round(P * 200)


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
    )
    model = LlamaForCausalLM(config).eval()
    use_kvbench_attention(model)
    return model, ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.mark.parametrize("metric", METRICS)
def test_every_metric_runs_through_a_model_with_delayed_chunks(tiny, metric):
    model, shape = tiny
    m = method(metric=metric, chunk=4)
    m.prepare(model, None, shape, None)
    cache = m.new_cache(shape, torch.float32)

    @torch.no_grad()
    def forward(ids):  # as the decode loop does
        m.after_forward(cache, ids, model(input_ids=ids, **cache.forward_kwargs()).logits.float())

    ids = torch.randint(0, 40, (1, 30))
    forward(ids[:, :20])
    layers = semkv_layers(cache)
    assert [layer.allocated_tokens() for layer in layers] == [20, 20]
    for t in range(20, 26):
        forward(ids[:, t : t + 1])
    assert [(layer.allocated_tokens(), layer.pending()) for layer in layers] == [(24, 2), (24, 2)]
    if metric in ("attn_sum", "attn_max"):  # pending tokens 24, 25 were attended by their queries
        assert layers[0].scores.shape == (1, 2, 2) and (layers[0].scores > 0).all()
    report = memory_report(cache.layers)
    assert report.nominal_code_bits == pytest.approx((round(P * 24) * B6 + (24 - round(P * 24)) * B5) / 24)
    if metric in ("entropy", "surprisal"):  # model level: one ranking, the same in every layer
        assert torch.equal(layers[0].allocation_mask(), layers[1].allocation_mask())
    if m.hidden is not None:
        m.hidden.close()


def test_hidden_metrics_hand_case():
    # token 0: h_in (3, 4), h_out (6, 8); token 1: h_in (0, 1), h_out (0, 1) (the layer left it alone)
    h_in = torch.tensor([[[3.0, 4.0], [0.0, 1.0]]])
    h_out = torch.tensor([[[6.0, 8.0], [0.0, 1.0]]])
    assert hidden_metric("hidden_norm")((h_in,), {}, (h_out,)).tolist() == [[5.0, 1.0]]
    # ||(3, 4)|| = 5 and ||(0, 0)|| = 0; the input may also come by keyword, the output bare
    assert hidden_metric("hidden_change")((), {"hidden_states": h_in}, h_out).tolist() == [[5.0, 0.0]]


@pytest.mark.parametrize("metric", ["hidden_norm", "hidden_change"])
def test_hidden_metrics_read_the_decoder_layers(tiny, metric):
    model, shape = tiny
    m = method(metric=metric)
    m.prepare(model, None, shape, None)
    ids = torch.randint(0, 40, (1, 9))
    try:
        with torch.no_grad():
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    finally:
        m.hidden.close()
    want = hs[0].norm(dim=-1) if metric == "hidden_norm" else (hs[1] - hs[0]).norm(dim=-1)
    assert torch.allclose(m.hidden.records[0], want, atol=1e-5)


def test_logit_metric_waits_for_after_forward():
    m = method(metric="entropy")
    cache = m.new_cache(ModelShape(num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16), torch.float32)
    k, v = torch.randn(2, 1, 2, 4, 16).unbind(0)
    cache.update(k, v, 0)
    layer = cache.layers[0]
    assert layer.pending() == 4 and layer.allocated_tokens() == 0 and layer.unscored == 4
    # entropies 0 (certain), ln 2, ~0, ~ln 3: k = round(P * 4) = 1 high token, the last one
    logits = torch.tensor([[[50.0, 0, 0], [0, 0, -50], [0, 50, 0], [0, 0, 0]]])
    m.after_forward(cache, torch.zeros(1, 4, dtype=torch.long), logits)
    assert layer.pending() == 0 and layer.allocation_mask()[0].tolist() == [[False, False, False, True]] * 2


def test_surprisal_state_is_the_methods_and_starts_over_with_each_cache():
    """The previous forward's log-probabilities score the next forward's first token; they belong to
    the request (reset by new_cache) and are kept on the method, never written onto the cache."""
    m = method(metric="surprisal")
    shape = ModelShape(num_layers=1, num_heads=2, num_kv_heads=2, head_dim=16)
    logits = torch.tensor([[[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]])  # uniform: log p = -ln 3
    first = m.new_cache(shape, torch.float32)
    first.update(*torch.randn(2, 1, 2, 2, 16).unbind(0), 0)
    m.after_forward(first, torch.zeros(1, 2, dtype=torch.long), logits)
    assert torch.allclose(m.last_logprobs, torch.full((1, 3), -math.log(3)))
    assert not any(name.startswith("semkv") for name in vars(first))
    second = m.new_cache(shape, torch.float32)
    assert m.last_logprobs is None  # a new request: its first token has no prediction (+inf)
    layer = second.layers[0]
    second.update(*torch.randn(2, 1, 2, 1, 16).unbind(0), 0)
    scores, _ = logit_scores("surprisal", logits[:, :1], torch.zeros(1, 1, dtype=torch.long), None)
    assert scores[0, 0] == math.inf
    m.after_forward(second, torch.zeros(1, 1, dtype=torch.long), logits[:, :1])
    assert layer.allocated_tokens() == 1 and m.last_logprobs is not None


# -- config -----------------------------------------------------------------------------------------


def test_bad_config_names_the_key():
    with pytest.raises(ConfigError, match="method.metric") as e:
        method(metric="saliency")
    assert all(name in str(e.value) for name in METRICS)
    with pytest.raises(ConfigError, match="method.target_bits"):
        method(target_bits=2.0)
    with pytest.raises(ConfigError, match="bits"):
        method(bits=2.6)
    with pytest.raises(ConfigError, match="method.low_levels"):
        method(low_levels=6, high_levels=6)
    with pytest.raises(ConfigError, match="method.sink_tokens"):
        method(metric="attn_sum", sink_tokens=4)
    with pytest.raises(ConfigError, match="method.chunk"):
        method(chunk=0)
    with pytest.raises(ConfigError, match="method.group_size"):
        method(group_size=5).config.check_model(ModelShape(1, 2, 2, 16))
    assert method(bits=2.5).config.target_bits == 2.5
    assert method().config.target_bits == 2.39 and method().label() == "semkv-2.39b-L5-6-key_norm"


@pytest.mark.parametrize("arch, pairs", [("llama-hd256", 2), ("llama", 1)])
def test_default_grouping_is_the_papers_128_channels(arch, pairs):
    """On a head_dim-256 model the default holds two scale/zero pairs per token and head (128
    channels each, the paper's accounting), not one over the whole head, and reconstructs the
    model's own keys better than one group of 256; on a 64-wide head it is the whole head."""
    from tiny_archs import VOCAB, tiny_model

    model, shape = tiny_model(arch)
    prompt = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(0))
    keys = {}
    hook = model.model.layers[0].self_attn.k_proj.register_forward_hook(
        lambda mod, args, out: keys.setdefault("k", out)
    )
    with torch.no_grad():
        model(input_ids=prompt)
    hook.remove()
    b, t, _ = keys["k"].shape
    k = keys["k"].reshape(b, t, shape.num_kv_heads, shape.head_dim).transpose(1, 2).contiguous()
    v = torch.randn_like(k)

    def error(**node):
        layer = layer_of(method(**node), shape)
        layer.update(k, v)
        high, low = layer.stores["k"]
        assert high.scale.shape[-1] == low.scale.shape[-1] == (pairs if not node else 1)
        rk, _ = layer.read()
        return ((rk - k).norm() / k.norm()).item()

    default = error()
    whole = error(group_size=shape.head_dim)
    if pairs == 1:
        assert default == whole
    else:
        assert default < whole  # each half-head range lies within the whole head's
