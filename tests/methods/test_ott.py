"""OTT's outlier pool, mean replacement and three-part attention on small hand-made cases."""

from types import SimpleNamespace

import pytest
import torch
import yaml
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbench.cache import memory_report
from kvbench.errors import ConfigError
from kvbench.methods import ModelShape, build_method
from kvbench.methods.ott import OTTConfig
from kvbench.quant.affine import fake_quantize_grouped

SMALL = {"group_size": 4, "residual": 0, "pool_size": 2, "skip_layers": 0, "value_group_size": 2}


def ott_layer(layer_idx=0, head_dim=2, kv_heads=1, fp_dtype="auto", **overrides):
    method = build_method({"name": "ott", "bits": 2, "fp_dtype": fp_dtype, **SMALL, **overrides})
    shape = ModelShape(
        num_layers=layer_idx + 1, num_heads=2 * kv_heads, num_kv_heads=kv_heads, head_dim=head_dim
    )
    method.config.check_model(shape)
    return method.make_layer(layer_idx, shape, torch.float32)


def keys_with_norms(norms):
    """``[1, H, T, 2]`` keys (0.75 n, -0.25 n): L1 norm n."""
    n = torch.tensor(norms, dtype=torch.float32)
    return torch.stack([0.75 * n, -0.25 * n], dim=-1)[None]


def values_like(k):
    return torch.arange(k.numel(), dtype=torch.float32).reshape(k.shape)


def test_defaults_are_the_papers_and_the_yaml_matches():
    c = OTTConfig()
    assert (c.bits, c.group_size, c.residual, c.pool_size, c.skip_layers, c.extra_pool_size) == (
        2,
        128,
        32,
        3,
        2,
        32,
    )
    assert c.value_group_size == 32
    node = yaml.safe_load(open("kvbench/conf/method/ott.yaml"))  # no bits line: the run fills bits
    assert build_method(node).config == OTTConfig()


def test_pool_keeps_the_n_smallest_key_l1_norms_per_head():
    # G=4, N=2. head 0: group 1 norms [5, 1, 3, 2] -> pool {1, 3}; group 2 [4, .5, 6, 1.5] competes
    # with the pool: the two smallest of {1: 1, 3: 2, 4: 4, 5: .5, 6: 6, 7: 1.5} are 5 and 1, so 3
    # is evicted (into the extra pool).
    # head 1: group 1 [1, 5, 2, 3] -> {0, 2}; group 2 [6, 7, .25, 8] -> {6, 0}; 2 is evicted.
    k = keys_with_norms([[5, 1, 3, 2, 4, 0.5, 6, 1.5], [1, 5, 2, 3, 6, 7, 0.25, 8]])
    v = values_like(k)
    layer = ott_layer(kv_heads=2)
    layer.update(k, v)
    assert (len(layer.kq), len(layer.k_res)) == (8, 0)
    assert layer.pool.pos.tolist() == [[[1, 5], [0, 6]]]
    assert layer.extra.pos.tolist() == [[[3], [2]]]
    assert torch.equal(layer.pool.k[0, 0], k[0, 0, [1, 5]]) and torch.equal(
        layer.pool.v[0, 1], v[0, 1, [0, 6]]
    )
    assert torch.equal(layer.extra.k[0, :, 0], k[0, [0, 1], [3, 2]])
    # the same tokens one at a time store the same pools and codes
    step = ott_layer(kv_heads=2)
    for t in range(8):
        step.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert step.pool.pos.tolist() == layer.pool.pos.tolist() and torch.equal(step.extra.k, layer.extra.k)
    assert torch.equal(step.read()[0], layer.read()[0])


def test_largest_selection_keeps_the_n_largest_key_l1_norms():
    # the Sec. 2 ablation on the case above: head 0's group 1 [5, 1, 3, 2] -> {0, 2}; group 2
    # [4, .5, 6, 1.5] competes: the two largest of {0: 5, 2: 3, 4: 4, 6: 6} are 6 and 0, 2 is
    # evicted. Head 1: [1, 5, 2, 3] -> {1, 3}; [6, 7, .25, 8] -> {5, 7}, both 1 and 3 evicted.
    k = keys_with_norms([[5, 1, 3, 2, 4, 0.5, 6, 1.5], [1, 5, 2, 3, 6, 7, 0.25, 8]])
    layer = ott_layer(kv_heads=2, selection="largest")
    layer.update(k, values_like(k))
    assert layer.pool.pos.tolist() == [[[0, 6], [5, 7]]]
    assert layer.extra.pos.tolist() == [[[2, -1], [1, 3]]]


def test_random_selection_is_repeatable_and_differs_from_the_norm_rankings():
    k = keys_with_norms([[float(t % 7 + 1) for t in range(64)]])
    pools = []
    for selection in ("random", "random", "smallest", "largest"):
        layer = ott_layer(selection=selection, group_size=16, pool_size=4)
        layer.update(k, values_like(k))
        pools.append(layer.pool.pos.tolist())
    assert pools[0] == pools[1] and pools[0] not in pools[2:]
    assert build_method({"name": "ott", "bits": 2, "selection": "random"}).label() == "ott-2b-random"
    assert build_method({"name": "ott", "bits": 2}).label() == "ott-2b"
    assert build_method({"name": "ott", "bits": 2, "pool_size": 1}).label() == "ott-2b-pool1"


def test_mean_replacement_sets_the_group_range():
    # one group, G=4: token 2 has the smallest key (L1 .75) and enters the pool (N=1). Its key and
    # value become the mean of all four tokens before the group's parameters are computed:
    # key channel 0: [10, 11, .5, 12] -> mean 8.375 -> [10, 11, 8.375, 12]: z = 8.375, s = 3.625/3
    # key channel 1: [1, 2, .25, 3]   -> mean 1.5625 -> z = 1, s = 2/3 (min .25 without replacement)
    # value of token 2: [5, 6] -> mean of the values [4, 5]: z = 4, s = 1/3 (per token, 2 channels)
    k = torch.tensor([[10, 1], [11, 2], [0.5, 0.25], [12, 3]])[None, None]
    v = torch.tensor([[1.0, 2], [3, 4], [5, 6], [7, 8]])[None, None]
    layer = ott_layer(pool_size=1)
    layer.update(k, v)
    assert layer.pool.pos.tolist() == [[[2]]]
    assert layer.kq.zero[0, 0, 0].tolist() == [8.375, 1.0]
    assert torch.equal(layer.kq.scale[0, 0, 0], torch.tensor([3.625 / 3, 2 / 3]).half())
    assert layer.vq.zero[0, 0, :, 0].tolist() == [1, 3, 4, 7]
    assert torch.equal(layer.vq.scale[0, 0, 2], torch.tensor([1 / 3]).half())
    replaced_k = torch.tensor([[10, 1], [11, 2], [8.375, 1.5625], [12, 3]])[None, None]
    want_k = fake_quantize_grouped(replaced_k, 4, "channel", 4)
    want_k[:, :, 2] = k[:, :, 2]  # the pool's exact copy, not the codes, is read
    got_k, got_v = layer.read()
    assert torch.equal(got_k, want_k)
    assert torch.equal(got_v[:, :, 2], v[:, :, 2])
    assert not torch.equal(layer.kq.dequantize()[:, :, 2], k[:, :, 2])


def test_evicted_tokens_move_to_the_extra_pool_and_tracing_stops_when_it_cannot_take_more():
    # N=1, extra pool of 1. group 1 norms [3, 2, 4, 5] -> pool {1}; group 2 [6, 1, 7, 8] -> pool {5},
    # 1 evicted into the extra pool (now full); group 3 [9, .5, 10, 11] would evict 5: no room, so
    # tracing stops: the pool keeps 5, and group 3 is quantized plainly, token 9 included.
    norms = [3, 2, 4, 5, 6, 1, 7, 8, 9, 0.5, 10, 11]
    k = keys_with_norms([norms])
    v = values_like(k)
    layer = ott_layer(pool_size=1, extra_pool_size=1)
    for t in range(12):
        layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
    assert layer.pool.pos.tolist() == [[[5]]] and layer.extra.pos.tolist() == [[[1]]]
    assert layer.tracing.tolist() == [[False]]
    assert torch.equal(layer.extra.k[0, 0, 0], k[0, 0, 1])
    assert layer.kq.zero[0, 0, 2, 0].item() == pytest.approx(0.75 * 0.5, abs=1e-3)  # raw min of group 3
    got_k, _ = layer.read()
    assert torch.equal(got_k[:, :, [1, 5]], k[:, :, [1, 5]])  # evicted and pooled tokens read exactly
    plain = fake_quantize_grouped(k[:, :, 8:12], 4, "channel", 4)
    assert torch.equal(got_k[:, :, 8:12], plain)
    assert not torch.equal(got_k[:, :, 8:12], k[:, :, 8:12])
    # group 1 was quantized with token 1 replaced by the group mean, whatever became of token 1
    replaced = k[:, :, 0:4].clone()
    replaced[:, :, 1] = k[:, :, 0:4].mean(-2)
    want = fake_quantize_grouped(replaced, 4, "channel", 4)
    assert torch.equal(got_k[:, :, [0, 2, 3]], want[:, :, [0, 2, 3]])


def module(rep=2):
    return SimpleNamespace(num_key_value_groups=rep, is_causal=True, training=False)


@pytest.mark.parametrize("q_len, masked", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("block_size", [5, 1024])
def test_attention_over_the_three_parts_equals_dense_attention_over_the_positions(
    q_len, masked, block_size, monkeypatch
):
    torch.manual_seed(0)
    t, d = 23, 8
    k = torch.randn(1, 2, t + q_len, d) * torch.linspace(0.5, 3, d)
    k[:, :, [2, 6, 9, 13, 14]] *= 0.05  # small keys: the outliers OTT tracks
    v = torch.randn(1, 2, t + q_len, d)
    layer = ott_layer(head_dim=d, kv_heads=2, residual=3, extra_pool_size=2, value_group_size=4)
    layer.update(k[:, :, :t], v[:, :, :t])
    # flushes while R + G = 7 tokens are in full precision: 23 -> 3 left, 5 groups quantized
    assert (len(layer.kq), len(layer.k_res)) == (20, 3)
    assert (layer.extra.pos >= 0).any()
    past_k, past_v = layer.read()  # the reference: outliers exactly at their positions
    opos = torch.cat([layer.pool.pos, layer.extra.pos], dim=-1)
    for h in range(2):
        valid = opos[0, h][opos[0, h] >= 0].long()
        assert torch.equal(past_k[0, h, valid], k[0, h, valid])
        assert not torch.equal(layer.kq.dequantize()[0, h, valid], k[0, h, valid])  # unread codes
    assert not torch.allclose(past_k[:, :, :16], k[:, :, :16], atol=1e-2)
    query = torch.randn(1, 4, q_len, d)
    keys, values = layer.update(k[:, :, t:], v[:, :, t:])
    assert torch.equal(keys, k[:, :, t:])
    # every position 0..t-1 is attended exactly once: hidden entries are the pooled tokens' codes
    pos = layer.stored_for_attention.positions
    for h in range(2):
        seen = pos[0, h][pos[0, h] >= 0]
        assert sorted(seen.tolist()) == list(range(t))
    causal = torch.ones(1, 1, q_len, t + q_len, dtype=torch.bool).tril(t)  # new token i sees 0..t+i
    mask = None
    if masked:
        mask = causal.clone()
        mask[..., [0, int(opos[0, 0, 0]), 17]] = False  # a pool position among them
    monkeypatch.setenv("KVBENCH_BLOCK_SIZE", str(block_size))
    got, _ = layer.attend(module(), query, keys, values, mask, scaling=0.3)
    dense_k = torch.cat([past_k.float(), keys], dim=-2)
    dense_v = torch.cat([past_v.float(), values], dim=-2)
    # (no mask means the causal rule of the newest tokens, which SDPA must be told explicitly)
    want, _ = sdpa_attention_forward(
        module(), query, dense_k, dense_v, causal if mask is None else mask, scaling=0.3
    )
    assert got.shape == (1, q_len, 4, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_first_skip_layers_have_no_pool():
    method = build_method({"name": "ott", "bits": 2, **SMALL, "skip_layers": 2})
    shape = ModelShape(num_layers=3, num_heads=2, num_kv_heads=1, head_dim=2)
    cache = method.new_cache(shape, torch.float32)
    k = keys_with_norms([[5, 1, 3, 2, 4, 0.5, 6, 1.5]])
    for i in range(3):
        cache.update(k, values_like(k), i)
    assert [layer.pool_size for layer in cache.layers] == [0, 0, 2]
    assert cache.layers[0].pool is None and "outliers" not in cache.layers[1].held_tensors()
    assert cache.layers[2].pool.pos.tolist() == [[[1, 5]]]
    # without a pool the layer is KIVI-style: groups of G quantized as they are
    assert torch.equal(cache.layers[0].read()[0], fake_quantize_grouped(k.half().float(), 4, "channel", 4))


def test_accounting_counts_pool_extra_pool_and_every_code():
    # fp16 storage, 1 head, D=2: pool N=2 (keys + values fp16, int32 positions), extra pool 1 slot,
    # tracing flag 1 byte; codes for all 8 quantized tokens, pool tokens' unread codes included.
    k = keys_with_norms([[5, 1, 3, 2, 4, 0.5, 6, 1.5, 7, 8]])
    layer = ott_layer(fp_dtype="float16")
    layer.update(k, values_like(k))
    report = memory_report([layer])
    n, e, d = 2, 1, 2
    assert report.bytes_by_component["outliers"] == n * (2 * d * 2 + 4) + e * (2 * d * 2 + 4) + 1
    assert report.quantized_values == 2 * 8 * d
    assert report.bytes_by_component["residual"] == 2 * 2 * d * 2
    assert report.bytes_by_component["codes"] == 2 * 8 * 1  # 2 codes of 2 bits per token: one byte


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"pool_size": -1}, "method.pool_size"),
        ({"pool_size": 5, "group_size": 4}, "method.pool_size"),
        ({"group_size": 0}, "method.group_size"),
        ({"residual": -1}, "method.residual"),
        ({"skip_layers": -2}, "method.skip_layers"),
        ({"extra_pool_size": 1.5}, "method.extra_pool_size"),
        ({"value_group_size": 0}, "method.value_group_size"),
        ({"key_bits": 12}, "method.key_bits"),
        ({"bits": 2.1}, "bits"),
        ({"zero_point": "mean"}, "method.zero_point"),
        ({"outlier_num": 3}, "method.outlier_num"),
        ({"selection": "median"}, "method.selection"),
    ],
)
def test_bad_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        build_method({"name": "ott", "bits": 2, **overrides})
    assert str(err.value).startswith(f"{key}=")


def test_value_group_must_divide_head_dim():
    method = build_method({"name": "ott", "bits": 2, "value_group_size": 48})
    with pytest.raises(ConfigError, match=r"method.value_group_size=48: must divide head_dim=64"):
        method.config.check_model(ModelShape(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64))


def test_triton_backend_reads_every_part_instead_of_the_fused_kivi_kernel():
    """KIVI's fused Triton decode reads no outlier pools: OTT on triton must never take it (its
    decode reads the codes, the pools and the window through the part reader; the parity with torch
    is tests/kernels/test_triton_parts.py and tests/kernels/test_backend.py)."""
    from kvbench.cache.kivi_layout import KIVILayer
    from kvbench.methods.ott import OTTLayer

    assert "triton" in OTTConfig.backends
    assert KIVILayer.fused_decode and not OTTLayer.fused_decode
    layer = build_method({"name": "ott", "backend": "torch"}, 2).make_layer(0, None, torch.float32)
    layer.backend = "triton"  # as storage_backend() resolves it on a CUDA machine
    k, v = torch.randn(1, 2, 200, 64), torch.randn(1, 2, 200, 64)
    layer.update(k[:, :, :199], v[:, :, :199])
    layer.update(k[:, :, 199:], v[:, :, 199:])
    assert layer._before is None and layer.stored_for_attention is not None  # the part reader's path
