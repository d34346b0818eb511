"""KVQuant: RoPE inversion, dense-and-sparse outliers, nuq codebooks, ablation switches, accounting."""

import json
import math
from pathlib import Path

import pytest
import torch

from kvbench.cache import memory_report
from kvbench.cache.dense_sparse import DenseSparseTokens
from kvbench.errors import ConfigError
from kvbench.kernels.counting import count_ops
from kvbench.methods import ModelShape, build_method
from kvbench.methods.kvquant_calibration import LayerCalibration, calibrate_layer
from kvbench.models import shape_of_config
from kvbench.quant.nuq import (
    channel_thresholds,
    key_outliers,
    key_outliers_fixed,
    kmeans_1d,
    nearest_code,
    topk_outlier_mask,
)
from kvbench.quant.rope import apply_rope, invert_rope

THETA = 100000.0
SHAPE = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64, rope_theta=THETA)
REAL_CONFIG = Path.home() / ".cache" / "kvbench" / "models" / "smollm2-135m" / "config.json"


def _real_llama_config():
    from transformers import LlamaConfig

    if REAL_CONFIG.is_file():
        return LlamaConfig(**json.loads(REAL_CONFIG.read_text()))
    # SmolLM2-135M's attention geometry and RoPE
    return LlamaConfig(
        hidden_size=576,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
    )


# -- RoPE ------------------------------------------------------------------------------------------


def test_rope_hand_case_two_channels():
    # D = 2: one frequency w = 1, so position p turns (a, b) by p radians
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    out = apply_rope(x, torch.tensor([1, 2]), theta=10.0)
    expected = torch.tensor([[math.cos(1), math.sin(1)], [-2 * math.sin(2), 2 * math.cos(2)]])
    assert torch.allclose(out, expected, atol=1e-6)


def test_rope_round_trip():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 40, 64)
    pos = torch.arange(1000, 1040)
    assert torch.allclose(invert_rope(apply_rope(x, pos, THETA), pos, THETA), x, atol=1e-5)
    assert torch.allclose(apply_rope(invert_rope(x, pos, THETA), pos, THETA), x, atol=1e-5)


def test_rope_equals_transformers_on_the_real_config():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    config = _real_llama_config()
    theta = config.rope_parameters["rope_theta"]
    assert config.rope_parameters.get("rope_type", "default") == "default" and theta == THETA
    torch.manual_seed(1)
    q, k = torch.randn(2, 1, 3, 30, 64).unbind(0)
    pos = torch.arange(500, 530)
    cos, sin = LlamaRotaryEmbedding(config)(k, pos[None])
    _, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.allclose(apply_rope(k, pos, theta), k_ref, atol=1e-5)
    assert torch.allclose(invert_rope(k_ref, pos, theta), k, atol=1e-5)


# -- dense-and-sparse outliers --------------------------------------------------------------------


def test_topk_outlier_mask_keeps_the_largest_magnitudes_per_vector():
    x = torch.tensor([[0.1, -5.0, 0.2, 3.0, 0.0, 1.0, -0.5, 0.3], [9.0, 0.0, 0.0, -0.1, 0.0, 0.0, 0.0, -8.0]])
    mask = topk_outlier_mask(x, 0.25)  # ceil(0.25 * 8) = 2 per vector
    expected = torch.zeros_like(x, dtype=torch.bool)
    expected[0, [1, 3]] = True
    expected[1, [0, 7]] = True
    assert torch.equal(mask, expected)
    assert topk_outlier_mask(torch.randn(3, 64), 0.01).sum(-1).tolist() == [1, 1, 1]  # ceil(0.64)
    assert not topk_outlier_mask(x, 0.0).any()


def test_value_outliers_are_exact_and_excluded_from_the_range():
    torch.manual_seed(2)
    x = torch.randn(1, 2, 5, 16).half().float()  # fp16-representable, so fp16 outliers are exact
    x[0, 1, 3, 7] = 40.0
    store = DenseSparseTokens(4, torch.linspace(-1, 1, 4), fraction=0.1)  # ceil(1.6) = 2 per token
    store.append(x)
    mask = topk_outlier_mask(x, 0.1)
    assert mask.sum() == 2 * 10 and store.num_outliers() == 20
    out = store.dequantize()
    assert torch.equal(out[mask], x[mask])
    # the range of token (1, 3) is that of its dense part: the 40 does not widen it
    dense = x[0, 1, 3][~mask[0, 1, 3]]
    assert store.scale[0, 1, 3, 0].item() == pytest.approx((dense.max() - dense.min()).item() / 2, rel=1e-3)
    assert (out[~mask] - x[~mask]).abs().max() < 2.5


def test_key_outliers_follow_the_calibrated_channel_thresholds():
    scale = torch.ones(1, 4).half()
    zero = torch.zeros(1, 4).half()
    x = torch.tensor([[[[0.5, -1.5, 0.25, 3.0], [-0.5, 0.0, 1.0, -1.25]]]])  # [1, 1, 2, 4]
    store = DenseSparseTokens(2, torch.tensor([-1.0, 1.0]), 0.01, (scale, zero))
    store.append(x)
    out = store.dequantize()
    outside = x.abs() > 1
    assert store.num_outliers() == 3
    assert torch.equal(out[outside], x[outside])
    # the rest is coded on the two signposts -1, +1 of [zero - scale, zero + scale]
    assert torch.equal(out[~outside], torch.sign(x[~outside]) + (x[~outside] == 0) * -1.0)


# channels of different ranges, so that the exceedance relative to the range ranks otherwise than the
# absolute one; every value fp16-exact
FIXED_SCALE = torch.tensor([[1.0, 4.0, 1.0, 2.0, 1.0, 1.0, 0.5, 1.0]]).half()  # [H_kv = 1, D = 8]
FIXED_ZERO = torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0]]).half()
FIXED_KEYS = torch.tensor(
    [
        # one beyond (channel 6: |0.75| / 0.5 = 1.5); the next slot: channel 1 (3 / 4 = 0.75, in range)
        [0.5, 3.0, 1.0, -1.0, 0.25, 0.0, 0.75, 0.0],
        # three beyond: channels 0 (3 / 1 = 3), 1 (9 / 4 = 2.25), 3 (4.25 / 2 = 2.125); the absolute
        # exceedance would keep 1 (5) and 3 (2.25) over 0 (2): channel 3 overflows
        [3.0, -9.0, 1.5, 4.25, 0.0, -0.5, 0.25, 0.0],
        # none beyond: the two nearest their bounds, channels 4 (0.875) and 2 (0.75)
        [0.0, -2.0, 1.75, 1.0, -0.875, 0.5, 0.0, 0.0],
    ]
)[None, None]  # [B = 1, H_kv = 1, T = 3, D = 8]


def test_fixed_key_outliers_keep_the_largest_exceedances_of_each_vector_by_hand():
    scale, zero = FIXED_SCALE.float()[None, :, None], FIXED_ZERO.float()[None, :, None]
    top, overflow = key_outliers_fixed(FIXED_KEYS, scale, zero, 0.25)  # ceil(0.25 * 8) = 2 per vector
    assert top.tolist() == [[[[1, 6], [0, 1], [2, 4]]]]
    assert overflow.tolist() == [[[0, 1, 0]]]
    assert key_outliers_fixed(FIXED_KEYS, scale, zero, 0.0) is None

    fixed = DenseSparseTokens(
        2, torch.tensor([-1.0, 1.0]), 0.25, (FIXED_SCALE, FIXED_ZERO), outlier_layout="fixed"
    )
    fixed.append(FIXED_KEYS)
    rows, cols, vals = fixed.sparse()
    assert rows.tolist() == [0, 0, 1, 1, 2, 2] and cols.tolist() == [1, 6, 0, 1, 2, 4]
    assert vals.tolist() == [3.0, 0.75, 3.0, -9.0, 1.75, -0.875]
    assert fixed.num_outliers() == 6 and fixed.overflow().item() == 1
    out = fixed.dequantize()
    assert out[0, 0, 1, 3].item() == 2.0  # the overflow, clamped to zero + scale
    # the codes are those of the ragged layout, which keeps the 1 + 3 + 0 elements beyond threshold
    ragged = DenseSparseTokens(2, torch.tensor([-1.0, 1.0]), 0.25, (FIXED_SCALE, FIXED_ZERO), backend="torch")
    ragged.append(FIXED_KEYS)
    assert ragged.outlier_layout == "ragged" and ragged.overflow() is None
    assert torch.equal(fixed.codes, ragged.codes)
    assert ragged.sparse()[1].tolist() == [6, 0, 1, 3]
    # held: exactly 2 entries per vector (int32 token, int16 column, fp16 value)
    assert sum(t.numel() * t.element_size() for t in fixed.held_tensors()["sparse"]) == 3 * 2 * (4 + 2 + 2)


def _key_store(layout: str, backend: str, d: int = 64) -> tuple[DenseSparseTokens, torch.Tensor]:
    """A key store after a 40-token prefill, and one decode token to append (about 1% of the
    elements beyond their channel's threshold)."""
    g = torch.Generator().manual_seed(11)
    rng = ((torch.rand(2, d, generator=g) + 1.0).half(), (0.1 * torch.randn(2, d, generator=g)).half())
    store = DenseSparseTokens(4, torch.linspace(-1, 1, 4), 0.02, rng, backend=backend, outlier_layout=layout)
    store.append(0.5 * torch.randn(1, 2, 40, d, generator=g))
    return store, 0.5 * torch.randn(1, 2, 1, d, generator=g)


def test_fixed_layout_appends_without_a_host_sync_where_ragged_reads_its_count():
    ragged, token = _key_store("auto", "torch")  # auto on the CPU with torch: ragged, as before
    with count_ops(sites=True) as counts:
        ragged.append(token)
    assert ragged.outlier_layout == "ragged" and counts.syncs["aten::nonzero"] == 1, counts.syncs
    for layout, backend in (("fixed", "torch"), ("auto", "triton"), ("fixed", "auto")):
        store, token = _key_store(layout, backend)
        with count_ops(sites=True) as counts:
            store.append(token)
        assert store.outlier_layout == "fixed", (layout, backend)
        assert counts.total_syncs == 0, counts.describe_syncs()
        # 2 per vector (ceil(0.02 * 64)) over 2 heads and 41 tokens, whatever the data
        assert store.num_outliers() == 2 * 2 * 41
        assert store.overflow() is not None and store.overflow().dtype == torch.int64
    # fixed on the CPU's auto backend is the torch append (the compiled call lays out ragged only)
    want, token = _key_store("fixed", "torch")
    want.append(token)
    for a, b in zip(want.sparse(), store.sparse(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(want.codes, store.codes)


def test_channel_thresholds_are_the_tail_quantiles():
    x = torch.arange(101.0)[:, None]  # one channel, 0..100
    lo, hi = channel_thresholds(x, 0.1)
    assert lo.item() == pytest.approx(5.0) and hi.item() == pytest.approx(95.0)
    lo, hi = channel_thresholds(x, 0.0)
    assert (lo.item(), hi.item()) == (0.0, 100.0)


@pytest.mark.parametrize("seed", range(12))
def test_tail_quantiles_are_torch_quantiles_bits(seed):
    """The thresholds from the columns' tails are ``torch.quantile``'s bits: random sizes, ties,
    the calibration's shape, quantiles at a rank and between two; and its fallbacks (a NaN, a
    quantile in the middle) are ``torch.quantile`` itself."""
    from kvbench.quant.nuq import tail_quantiles

    g = torch.Generator().manual_seed(seed)
    n, c = [(2044, 192), (101, 1), (37, 5), (5000, 3)][seed % 4]
    x = torch.randn(n, c, generator=g) * (1 + seed)
    if seed % 3 == 0:
        x = (x * 2).round() / 2  # ties
    f = [0.01, 0.02, 0.1][seed % 3]
    q = torch.tensor([f / 2, 1 - f / 2])
    assert torch.equal(tail_quantiles(x, q), torch.quantile(x, q, dim=0))
    mid = torch.tensor([0.3, 0.7])
    assert torch.equal(tail_quantiles(x, mid), torch.quantile(x, mid, dim=0))
    x[0, 0] = float("nan")
    assert torch.equal(tail_quantiles(x, q).isnan(), torch.quantile(x, q, dim=0).isnan())


# -- nuq -------------------------------------------------------------------------------------------


def test_kmeans_codebook_is_the_fixed_point_of_a_hand_case():
    values = torch.tensor([-1.0, -0.8, 0.7, 0.9, 1.0])
    c = kmeans_1d(values, 2)
    assert torch.allclose(c, torch.tensor([-0.9, 2.6 / 3]))
    # fixed point: every signpost is the mean of the values nearest to it
    q = nearest_code(values, c).long()
    for i in range(2):
        assert c[i].item() == pytest.approx(values[q == i].mean().item())


def test_nuq_beats_uniform_on_a_skewed_distribution():
    torch.manual_seed(3)
    v = torch.randn(4000).clamp(-3, 3) / 3
    errs = {}
    for name, c in {"nuq": kmeans_1d(v, 4), "uniform": torch.linspace(-1, 1, 4)}.items():
        errs[name] = ((c[nearest_code(v, c).long()] - v) ** 2).mean().item()
    assert errs["nuq"] < 0.7 * errs["uniform"]


# -- the layer -------------------------------------------------------------------------------------


def _fill(node, k, v, prefill):
    method = build_method(node)
    method.config.check_model(SHAPE)
    cache = method.new_cache(SHAPE, torch.float32)
    cache.update(k[:, :, :prefill], v[:, :, :prefill], 0)
    for t in range(prefill, k.shape[-2]):
        cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], 0)
    return method, cache


def _roped_keys(n, seed=4):
    gen = torch.Generator().manual_seed(seed)
    # pre-RoPE keys with strong per-channel offsets, as in real models (outlier channels)
    pre = 4 * torch.randn(1, 2, 1, 64, generator=gen) + 0.3 * torch.randn(1, 2, n, 64, generator=gen)
    return pre, apply_rope(pre, torch.arange(n), THETA)


def test_pre_rope_positions_include_the_sink():
    _, k = _roped_keys(30)
    v = torch.randn(1, 2, 30, 64)
    node = {"name": "kvquant", "bits": 8, "calibrate": False, "datatype": "uniform"}
    _, cache = _fill(node, k, v, 20)
    stored_k, _ = cache.layers[0].read()
    assert (stored_k - k).norm() / k.norm() < 5e-3  # wrong positions would turn keys by radians


def test_pre_rope_quantization_beats_post_rope_on_channel_outliers():
    _, k = _roped_keys(200)
    v = torch.randn(1, 2, 200, 64)
    errs = {}
    for pre_rope in (True, False):
        node = {"name": "kvquant", "bits": 2, "calibrate": False, "pre_rope": pre_rope}
        _, cache = _fill(node, k, v, 150)
        errs[pre_rope] = ((cache.layers[0].read()[0] - k).norm() / k.norm()).item()
    assert errs[True] < 0.5 * errs[False]


def test_ablation_switches_change_what_is_stored():
    torch.manual_seed(5)
    k, v = torch.randn(2, 1, 2, 40, 64).unbind(0)
    base = {"name": "kvquant", "bits": 2, "calibrate": False}
    held = {}
    for label, extra in {
        "base": {},
        "uniform": {"datatype": "uniform"},
        "dense": {"outlier_fraction": 0},
        "nosink": {"sink": False},
        "postrope": {"pre_rope": False},
    }.items():
        method, cache = _fill({**base, **extra}, k, v, 30)
        held[label] = (method, cache.layers[0].held_tensors(), cache)
    assert {"codes", "sparse", "scales", "zeros", "codebook", "sink"} <= set(held["base"][1])
    assert "codebook" not in held["uniform"][1]
    assert held["dense"][1]["sparse"] == []
    assert "sink" not in held["nosink"][1] and held["nosink"][0].config.sink_tokens == 0
    assert held["base"][0].config.sink_tokens == 1
    assert not torch.equal(held["base"][1]["codes"][0], held["postrope"][1]["codes"][0])
    assert not torch.equal(held["base"][1]["codes"][0], held["uniform"][1]["codes"][0])


def test_calibrated_ranges_are_used_for_every_key():
    torch.manual_seed(6)
    cal = LayerCalibration(
        key_scale=torch.full((2, 64), 0.5).half(),
        key_zero=torch.full((2, 64), 0.25).half(),
        key_codebook=torch.linspace(-1, 1, 4),
        value_codebook=torch.linspace(-1, 1, 4),
    )
    method = build_method({"name": "kvquant", "bits": 2, "pre_rope": False, "outlier_fraction": 0})
    method.calibration = [cal]
    cache = method.new_cache(SHAPE, torch.float32)
    k = torch.randn(1, 2, 10, 64)
    cache.update(k, torch.randn(1, 2, 10, 64), 0)
    stored_k, _ = cache.layers[0].read()
    # sink token first; every other key is clamped into [-0.25, 0.75] and lands on its grid
    grid = torch.linspace(-1, 1, 4).half().float() * 0.5 + 0.25  # the codebook is held in fp16
    assert torch.allclose(stored_k[:, :, 1:], grid[(stored_k[:, :, 1:, :, None] - grid).abs().argmin(-1)])
    assert stored_k[:, :, 1:].min() >= -0.25 and stored_k[:, :, 1:].max() <= 0.75
    # calibrate=true without prepare has nothing to use
    fresh = build_method({"name": "kvquant", "bits": 2, "pre_rope": False}).new_cache(SHAPE, torch.float32)
    with pytest.raises(RuntimeError, match="prepare"):
        fresh.update(k, k, 0)


def test_accounting_counts_codes_sparse_scales_and_codebook():
    torch.manual_seed(7)
    k, v = torch.randn(2, 1, 2, 41, 64).unbind(0)
    node = {"name": "kvquant", "bits": 2, "calibrate": False, "pre_rope": False}
    _, cache = _fill(node, k, v, 31)
    layer = cache.layers[0].inner
    report = memory_report(cache.layers)
    t = 40  # one token in the sink
    n_out = layer.kq.num_outliers() + layer.vq.num_outliers()
    assert layer.vq.num_outliers() == 2 * t  # ceil(0.01 * 64) = 1 per value token and head
    assert report.bytes_by_component == {
        "codes": 2 * (2 * t * 16),  # 2-bit codes: 64 channels in 16 bytes
        "sparse": n_out * (4 + 2 + 2),  # int32 token, int16 (head, channel), fp16 value
        "scales": 2 * (2 * t) + 2 * (2 * 64),  # fp16 per value token + per key channel
        "zeros": 2 * (2 * t) + 2 * (2 * 64),
        "codebook": 2 * (4 + 4),
        "sink": 2 * (2 * 64) * 2,
    }
    assert report.quantized_values == 2 * 2 * t * 64
    assert report.nominal_code_bits == 2.0


def test_fixed_layout_holds_k_per_vector_and_the_run_reports_its_overflow():
    torch.manual_seed(7)
    k, v = torch.randn(2, 1, 2, 41, 64).unbind(0)
    node = {"name": "kvquant", "bits": 2, "calibrate": False, "pre_rope": False}
    method, cache = _fill({**node, "outlier_layout": "fixed"}, k, v, 31)
    assert method.label() == "kvquant-nuq2b-o0.01fixed-postrope-online-sink1"
    layer = cache.layers[0].inner
    t = 40  # one token in the sink
    assert layer.kq.outlier_layout == "fixed" and layer.kq.num_outliers() == 2 * t  # 1 per vector
    assert memory_report(cache.layers).bytes_by_component["sparse"] == (2 * t + 2 * t) * (4 + 2 + 2)
    # the overflow: the elements beyond threshold that a vector's one slot does not hold
    cal = layer.calibration
    scale, zero = (p.float()[None, :, None, :] for p in (cal.key_scale, cal.key_zero))
    beyond = key_outliers(k[:, :, 1:], scale, zero, 0.01).sum(-1)
    expected = int((beyond - 1).clamp(min=0).sum())
    assert expected > 0 and layer.kq.overflow().item() == expected
    assert method.run_warnings() == {}  # read at the end of a request, never per step
    method.end_request(cache)
    warning = method.run_warnings()["kvquant_fixed_outliers"]
    assert f"over 1 request(s), {expected} of {2 * t * 64} key elements" in warning
    # auto on the CPU: ragged, as before the knob, and nothing to report
    method, cache = _fill(node, k, v, 31)
    method.end_request(cache)
    assert cache.layers[0].inner.kq.outlier_layout == "ragged" and method.run_warnings() == {}
    assert method.label() == "kvquant-nuq2b-o0.01-postrope-online-sink1"


def test_outlier_layout_at_its_default_keeps_the_run_ids_of_earlier_runs():
    from kvbench.results import run_id

    before = {"bits": 2, "method": {"name": "kvquant", "bits": 2, "calibrate": False}}
    ids = {
        layout: run_id({**before, "method": {**before["method"], "outlier_layout": layout}})
        for layout in ("auto", "ragged", "fixed")
    }
    assert ids["auto"] == run_id(before) and len(set(ids.values())) == 3


def test_outlier_layout_error_names_the_choices():
    with pytest.raises(ConfigError, match="allowed: auto, ragged, fixed"):
        build_method({"name": "kvquant", "bits": 2, "outlier_layout": "topk"})


# -- calibration through prepare -------------------------------------------------------------------


class _ByteTokenizer:
    def __call__(self, text, return_tensors="pt"):
        class Out:
            input_ids = torch.tensor([list(text.encode())]) % 100

        return Out()


def test_prepare_calibrates_from_pre_rope_k_proj_outputs(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={"rope_type": "default", "rope_theta": THETA},
    )
    torch.manual_seed(8)
    model = LlamaForCausalLM(config).eval()
    (tmp_path / "wikitext2").mkdir()
    (tmp_path / "wikitext2" / "wiki.test.raw").write_text(
        "The quick brown fox jumps over the lazy dog. " * 20
    )
    shape = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=THETA)
    method = build_method({"name": "kvquant", "bits": 2, "calibration_tokens": 80, "outlier_fraction": 0})
    method.prepare(model, _ByteTokenizer(), shape, tmp_path)
    ids = _ByteTokenizer()("The quick brown fox jumps over the lazy dog. " * 20).input_ids[:, :80]
    with torch.no_grad():
        h = model.model.embed_tokens(ids)
        x = model.model.layers[0].input_layernorm(h)
        keys = model.model.layers[0].self_attn.k_proj(x).reshape(80, 2, 16)[1:]  # the sink left out
    cal = method.calibration[0]
    assert torch.equal(cal.key_zero, ((keys.amax(0) + keys.amin(0)) / 2).half())
    assert torch.equal(cal.key_scale, ((keys.amax(0) - keys.amin(0)) / 2).half())
    assert len(method.calibration) == 2 and cal.key_codebook.shape == (4,)
    assert torch.equal(cal.key_codebook, cal.key_codebook.half().float())
    # the default calibration_data is that file: naming it by path calibrates identically
    wiki = str(tmp_path / "wikitext2" / "wiki.test.raw")
    by_path = build_method(
        {
            "name": "kvquant",
            "bits": 2,
            "calibration_tokens": 80,
            "outlier_fraction": 0,
            "calibration_data": wiki,
        }
    )
    by_path.prepare(model, _ByteTokenizer(), shape, tmp_path / "nowhere")
    for a, b in zip(method.calibration, by_path.calibration, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values(), strict=True))
    # a missing calibration file names the data root
    with pytest.raises(ConfigError, match="data.root"):
        method.prepare(model, _ByteTokenizer(), shape, tmp_path / "nowhere")
    # other RoPE types are rejected by check_model, from the config alone
    config.rope_parameters = {"rope_type": "yarn", "rope_theta": THETA, "factor": 2.0}
    with pytest.raises(ConfigError, match="method.pre_rope"):
        method.config.check_model(shape_of_config(config))


def test_calibration_is_computed_once_per_inputs(tmp_path, monkeypatch):
    """The arms of an ablation in one process: the same inputs give the same calibration without a
    second forward over the text; other bits reuse the captured text but fit anew, and the result
    equals a fresh calibration's; another model starts afresh."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvbench.methods import kvquant_calibration as kc

    config = LlamaConfig(
        vocab_size=100, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": THETA},
    )  # fmt: skip
    torch.manual_seed(8)
    model = LlamaForCausalLM(config).eval()
    (tmp_path / "wikitext2").mkdir()
    text = "The quick brown fox jumps over the lazy dog. " * 20
    (tmp_path / "wikitext2" / "wiki.test.raw").write_text(text)
    shape = ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=THETA)
    captures, fits = [], []
    real_capture, real_fit = kc._capture, kc._fit
    monkeypatch.setattr(kc, "_capture", lambda *a: captures.append(1) or real_capture(*a))
    monkeypatch.setattr(kc, "_fit", lambda *a: fits.append(1) or real_fit(*a))

    def prepared(bits, layout="auto", sink=True):
        node = {
            "name": "kvquant",
            "bits": bits,
            "calibration_tokens": 80,
            "outlier_layout": layout,
            "sink": sink,
        }
        method = build_method(node)
        method.prepare(model, _ByteTokenizer(), shape, tmp_path)
        return method.calibration

    def same(a, b):
        return all(
            torch.equal(x, y)
            for p, q in zip(a, b, strict=True)
            for x, y in zip(vars(p).values(), vars(q).values(), strict=True)
        )

    first = prepared(2)
    assert prepared(2, layout="fixed") is first and (len(captures), len(fits)) == (1, 1)
    three = prepared(3)
    assert (len(captures), len(fits)) == (1, 2)
    no_sink = prepared(2, sink=False)  # the same forward, a fit over every token
    assert (len(captures), len(fits)) == (1, 3) and not same(no_sink, first)
    kc._MEMO.model = None  # a fresh process
    fresh = prepared(3)
    assert (len(captures), len(fits)) == (2, 4) and same(three, fresh)
    kc._MEMO.model = None
    assert same(prepared(2, sink=False), no_sink) and len(captures) == 3


def test_calibrate_layer_excludes_outliers_from_the_codebook_values():
    torch.manual_seed(9)
    keys = torch.randn(200, 1, 8)
    values = torch.randn(200, 1, 8)
    cal = calibrate_layer(keys, values, 4, 4, 0.02, "nuq")
    assert cal.key_codebook.min() >= -1 and cal.key_codebook.max() <= 1
    assert torch.all(cal.key_codebook[1:] > cal.key_codebook[:-1])


# -- config errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"datatype": "int"}, "method.datatype"),
        ({"outlier_fraction": 0.7}, "method.outlier_fraction"),
        ({"outlier_fraction": "1%"}, "method.outlier_fraction"),
        ({"sensitivity_weighted": True}, "method.sensitivity_weighted"),
        ({"calibration_tokens": 0}, "method.calibration_tokens"),
        ({"pre_rope": "yes"}, "method.pre_rope"),
        ({"backend": "cuda"}, "method.backend"),
        ({"outlier_layout": "topk"}, "method.outlier_layout"),
        ({"key_bits": 2.5}, "method.key_bits"),
        ({"group_size": 32}, "method.group_size"),
    ],
)
def test_bad_config_names_the_key(extra, key):
    with pytest.raises(ConfigError) as err:
        build_method({"name": "kvquant", "bits": 2, **extra})
    assert err.value.key == key


def test_pre_rope_needs_rope_theta():
    method = build_method({"name": "kvquant", "bits": 2})
    with pytest.raises(ConfigError) as err:
        method.config.check_model(ModelShape(num_layers=1, num_heads=2, num_kv_heads=2, head_dim=64))
    assert err.value.key == "method.pre_rope"


# -- RoPE variants: per-layer frequencies on tiny random models -------------------------------------

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
GEMMA3_LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _tiny_model(kind):
    """A tiny random Llama with llama3 RoPE scaling, or a tiny Gemma-3 (k_norm, sliding and full
    layers with their own RoPE: theta 1e4 default, theta 1e6 linear x8), with kvbench attention."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

    from kvbench.cache import use_kvbench_attention

    sizes = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
    )
    torch.manual_seed(10)
    if kind == "llama3":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, rope_parameters=dict(LLAMA3_ROPE), **sizes))
    else:
        config = Gemma3TextConfig(
            num_hidden_layers=4,
            sliding_window=4,
            layer_types=list(GEMMA3_LAYER_TYPES),
            rope_parameters={
                "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            **sizes,
        )
        model = Gemma3ForCausalLM(config)
    use_kvbench_attention(model.eval())
    return model, shape_of_config(model.config)


@torch.no_grad()
def _keys_around_rope(model, shape, positions):
    """Per layer: the pre-RoPE keys the model computes (k_proj output, after k_norm where the
    attention has one) and the post-RoPE keys and values its attention receives, ``[1, H_kv, T, D]``."""
    from kvbench.cache.capture import OutputCapture, capture_attention

    attns = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    t = positions.shape[0]

    def reduce(_args, _kwargs, out):  # k_proj: [1, T, H_kv * D]; Gemma-3's k_norm: [1, H_kv, T, D]
        return (
            out.reshape(1, t, shape.num_kv_heads, shape.head_dim).transpose(1, 2) if out.dim() == 3 else out
        )

    ids = torch.randint(0, 100, (1, t), generator=torch.Generator().manual_seed(11))
    modules = [getattr(a, "k_norm", None) or a.k_proj for a in attns]
    with OutputCapture(modules, reduce) as pre, capture_attention() as post:
        model(ids, position_ids=positions[None], use_cache=False)
    return [(pre.records[i], post.records[i].keys, post.records[i].values) for i in range(len(attns))]


@pytest.mark.parametrize("kind", ["llama3", "gemma3"])
def test_each_layer_rotates_its_pre_rope_keys_to_the_models_post_rope_keys(kind):
    from kvbench.quant.rope import layer_rope, rotate

    model, shape = _tiny_model(kind)
    positions = torch.arange(1000, 1012)  # far enough for the llama3 and linear scalings to matter
    layers = _keys_around_rope(model, shape, positions)
    for i, (pre, post, _) in enumerate(layers):
        cos, sin = layer_rope(shape, i).cos_sin(positions)
        torch.testing.assert_close(rotate(pre, cos, sin), post, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(rotate(post, cos, sin, inverse=True), pre, rtol=1e-5, atol=1e-5)
    # the check can fail: the plain default frequencies of the same theta do not fit
    pre, post, _ = layers[2 if kind == "gemma3" else 0]
    theta = 1e6 if kind == "gemma3" else LLAMA3_ROPE["rope_theta"]
    assert not torch.allclose(apply_rope(pre, positions, theta), post, atol=1e-3)


@pytest.mark.parametrize("kind", ["llama3", "gemma3"])
def test_pre_rope_cache_reads_back_the_models_keys_on_every_layer(kind):
    model, shape = _tiny_model(kind)
    n = 24
    layers = _keys_around_rope(model, shape, torch.arange(n))
    method = build_method({"name": "kvquant", "bits": 8, "calibrate": False, "datatype": "uniform"})
    method.config.check_model(shape)
    cache = method.new_cache(shape, torch.float32)
    for i, (_, k, v) in enumerate(layers):
        cache.update(k[:, :, :16], v[:, :, :16], i)
        for t in range(16, n):
            cache.update(k[:, :, t : t + 1], v[:, :, t : t + 1], i)
        stored_k, _ = cache.layers[i].read()
        if shape.is_sliding(i):
            # sliding-window layers hold their window in full precision, not KVQuant's codes
            assert torch.allclose(stored_k.float(), k[:, :, n - stored_k.shape[-2] :], atol=1e-2), i
            continue
        assert (stored_k - k).norm() / k.norm() < 5e-3, i  # another layer's frequencies: radians off
        keys = cache.layers[i].inner.stored().keys  # the blockwise path (RoPESource), sink excluded
        assert (keys.read(0, n - 1) - k[:, :, 1:]).norm() / k.norm() < 5e-3, i
    assert kind != "gemma3" or 0 < len(shape.sliding_layers()) < shape.num_layers


def test_gemma3_calibrates_on_k_norm_outputs_and_post_rope_per_layer(tmp_path, capsys):
    from kvbench.cache.capture import OutputCapture

    model, shape = _tiny_model("gemma3")
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    node = {"name": "kvquant", "bits": 2, "calibration_tokens": 80, "outlier_fraction": 0}
    method = build_method({**node, "calibration_data": str(text)})
    method.config.check_model(shape)
    method.prepare(model, _ByteTokenizer(), shape, tmp_path / "no-data-root-needed")
    assert "kvquant calibration" in capsys.readouterr().err  # the progress bar
    ids = _ByteTokenizer()(text.read_text()).input_ids[:, -80:]
    attns = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    with torch.no_grad(), OutputCapture([a.k_norm for a in attns], lambda _a, _k, out: out) as normed:
        model(ids, use_cache=False)
    for i, cal in enumerate(method.calibration):
        keys = normed.records[i][0, :, 1:].transpose(0, 1)  # [T - 1, H_kv, D], the sink left out
        assert torch.equal(cal.key_zero, ((keys.amax(0) + keys.amin(0)) / 2).half()), i
        assert torch.equal(cal.key_scale, ((keys.amax(0) - keys.amin(0)) / 2).half()), i
    # post-RoPE calibration turns each layer's keys by that layer's own RoPE
    post_method = build_method({**node, "calibration_data": str(text), "pre_rope": False})
    post_method.prepare(model, _ByteTokenizer(), shape, tmp_path)
    layers = _keys_around_rope_of(model, shape, ids)
    for i, cal in enumerate(post_method.calibration):
        keys = layers[i][0, :, 1:].transpose(0, 1)
        torch.testing.assert_close(cal.key_zero.float(), ((keys.amax(0) + keys.amin(0)) / 2).half().float())


@torch.no_grad()
def _keys_around_rope_of(model, shape, ids):
    from kvbench.cache.capture import capture_attention

    with capture_attention() as post:
        model(ids, use_cache=False)
    return [post.records[i].keys for i in range(shape.num_layers)]


def _refusal(config, pre_rope=True):
    method = build_method({"name": "kvquant", "bits": 2, "pre_rope": pre_rope})
    with pytest.raises(ConfigError) as err:
        method.config.check_model(shape_of_config(config))
    assert err.value.key == "method.pre_rope" and "\n" not in str(err.value)
    return str(err.value)


def test_rope_types_pre_rope_cannot_undo_are_refused_in_one_line():
    from transformers import GPT2Config, LlamaConfig

    sizes = dict(
        hidden_size=32, num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_hidden_layers=4
    )
    dynamic = LlamaConfig(
        rope_parameters={"rope_type": "dynamic", "rope_theta": THETA, "factor": 2.0}, **sizes
    )
    assert _refusal(dynamic) == (
        "method.pre_rope=True: layer 0 uses rope_type='dynamic', which pre-RoPE keys cannot undo "
        "(supported: default, linear, llama3); set method.pre_rope=false"
    )
    yarn = LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": THETA, "factor": 4.0}, **sizes)
    assert "rope_type='yarn'" in _refusal(yarn)
    no_rope = GPT2Config(n_layer=2, n_embd=32, n_head=2)
    assert "has no rotary position embedding" in _refusal(no_rope)
    # post-RoPE keys need no inversion: those models pass
    for config in (dynamic, yarn, no_rope):
        build_method({"name": "kvquant", "bits": 2, "pre_rope": False}).config.check_model(
            shape_of_config(config)
        )
    # the supported types pass too
    llama3 = LlamaConfig(rope_parameters=dict(LLAMA3_ROPE), **sizes)
    build_method({"name": "kvquant", "bits": 2}).config.check_model(shape_of_config(llama3))


# -- calibration data ------------------------------------------------------------------------------


def test_calibration_data_names_a_dataset_or_a_file(tmp_path):
    from kvbench.methods.kvquant_calibration import calibration_file, calibration_text

    (tmp_path / "wikitext2").mkdir()
    wiki = tmp_path / "wikitext2" / "wikitext-test.txt"
    wiki.write_text("wiki")
    assert calibration_file(tmp_path) == wiki  # the default: wikitext2 under the data root
    (tmp_path / "mine.txt").write_text("my text")
    assert calibration_text(tmp_path, "mine.txt") == "my text"  # relative: under the data root
    (tmp_path / "docs.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    assert calibration_text(tmp_path, str(tmp_path / "docs.jsonl")) == "a\n\nb"
    with pytest.raises(ConfigError) as err:
        calibration_text(tmp_path, "nowhere/missing.txt")
    assert err.value.key == "method.calibration_data" and "no such file" in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError) as err:
        build_method({"name": "kvquant", "bits": 2, "calibration_data": ""})
    assert err.value.key == "method.calibration_data"


def test_calibration_data_missing_file_fails_prepare_naming_the_key(tmp_path):
    method = build_method({"name": "kvquant", "bits": 2, "calibration_data": str(tmp_path / "gone.txt")})
    with pytest.raises(ConfigError, match="method.calibration_data"):
        method.prepare(torch.nn.Linear(1, 1), _ByteTokenizer(), SHAPE, tmp_path)
