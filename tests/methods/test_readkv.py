"""ReadKV: progressive prefixes, the budgeted allocation, and the query-adaptive read."""

import itertools
import math
from types import SimpleNamespace

import pytest
import torch

from kvbench.cache import memory_report
from kvbench.errors import ConfigError
from kvbench.methods import ModelShape, build_method
from kvbench.methods.readkv import budgets, grouped_codes, query_adaptive_attention
from kvbench.quant.affine import dequantize_grouped, fake_quantize_grouped, quantize_grouped
from kvbench.quant.packing import unpack
from kvbench.quant.progressive import allocate_prefix_bits, prefix_reconstruct

SHAPE = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64)


def codes_of(x, bits, axis, group):
    codes, scale, zero = quantize_grouped(x, 2**bits, axis, group)
    return grouped_codes(codes, scale, zero, axis, group)


def test_prefix_reconstruction_hand_case():
    # B = 3, code 5 = 0b101, s = 1, z = 0: prefixes 0, 1, 10, 101 -> bin centres 3.5, 5.5, 4.5, 5
    code, one, zero = torch.tensor([5]), torch.ones(1), torch.zeros(1)
    got = [prefix_reconstruct(code, one, zero, 3, p).item() for p in range(4)]
    assert got == [3.5, 5.5, 4.5, 5.0]


def test_full_prefix_is_the_stored_reconstruction_exactly():
    x = torch.randn(2, 2, 64, 64) * 3
    for axis in ("channel", "token"):
        codes, scale, zero = quantize_grouped(x, 256, axis, 32)
        c = codes_of(x, 8, axis, 32)
        assert torch.equal(
            prefix_reconstruct(c.codes, c.scale, c.zero, 8, 8),
            dequantize_grouped(codes, scale, zero, axis, 32),
        )


def test_prefix_error_bound_per_p():
    x = torch.randn(1, 2, 64, 64)
    c = codes_of(x, 8, "token", 32)
    for p in range(9):
        err = (prefix_reconstruct(c.codes, c.scale, c.zero, 8, p) - x).abs()
        bound = c.scale * 2 ** (8 - p) / 2
        assert (err <= bound * (1 + 1e-4) + 1e-6).all()
        # and the bound is of the right size: the worst value comes within 20% of it
        assert (err / bound).max() > 0.8


def test_allocation_hand_case():
    # gains w * 2^-j: item 0: 8, 4, 2; item 1: 1, .5, .25; item 2: .5, .25, .125; item 3: 0
    w = torch.tensor([8.0, 1.0, 0.5, 0.0])
    assert allocate_prefix_bits(w, 3, 3).tolist() == [3, 0, 0, 0]
    assert allocate_prefix_bits(w, 3, 4).tolist() == [3, 1, 0, 0]
    assert allocate_prefix_bits(w, 3, 6).tolist() == [3, 2, 1, 0]
    assert allocate_prefix_bits(w, 3, 100).tolist() == [3, 3, 3, 3]
    assert allocate_prefix_bits(w, 3, 0).tolist() == [0, 0, 0, 0]


def test_allocation_uses_the_budget_and_is_optimal():
    torch.manual_seed(1)
    bits = 3
    for _ in range(5):
        w = torch.rand(4) * 4
        for budget in (1, 5, 9):
            p = allocate_prefix_bits(w, bits, budget)
            assert int(p.sum()) == budget
            cost = float((w**2 * 4.0 ** (-p.float())).sum())
            best = min(
                float((w**2 * 4.0 ** -torch.tensor(a, dtype=torch.float32)).sum())
                for a in itertools.product(range(bits + 1), repeat=4)
                if sum(a) <= budget
            )
            assert cost == pytest.approx(best, rel=1e-6)


def test_budgets():
    assert budgets(4, 0.5, 64, 96) == (256, 384)  # 4 bits/value on keys and on values
    assert budgets(4, 0.25, 64, 96) == (128, 576)


def readkv_layer(**overrides):
    method = build_method({"name": "readkv", "fp_dtype": "float32", **overrides})
    method.config.check_model(SHAPE)
    return method.make_layer(0, SHAPE, torch.float32)


def dense_attention(q, k, v, scaling):
    """``q [B, H, 1, D]`` over ``k, v [B, H_kv, T, D]`` (GQA), float32 ``[B, H, 1, D]``."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return torch.softmax(q @ k.transpose(-1, -2) * scaling, -1) @ v


def test_full_read_is_dense_attention_over_the_stored_reconstruction():
    torch.manual_seed(0)
    k, v = torch.randn(2, 1, 2, 97, 64).unbind(0)
    layer = readkv_layer(bits=8, read_bits=8)
    layer.update(k[:, :, :96], v[:, :, :96])
    stored_k, stored_v = layer.read()
    keys, values = layer.update(k[:, :, 96:], v[:, :, 96:])
    q = torch.randn(1, 4, 1, 64)
    module = SimpleNamespace(scaling=0.125)
    out, _ = layer.attend(module, q, keys, values, None)
    ref = dense_attention(
        q, torch.cat([stored_k, k[:, :, 96:]], -2), torch.cat([stored_v, v[:, :, 96:]], -2), 0.125
    )
    assert torch.allclose(out.transpose(1, 2), ref, atol=1e-5)
    assert layer.read_bits_per_value() == 8.0


def test_decode_reads_the_budget():
    torch.manual_seed(0)
    k, v = torch.randn(2, 1, 2, 100, 64).unbind(0)
    layer = readkv_layer(bits=8, read_bits=3)
    layer.update(k[:, :, :96], v[:, :, :96])
    for t in range(96, 100):
        keys, values = layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        layer.attend(SimpleNamespace(scaling=0.125), torch.randn(1, 4, 1, 64), keys, values, None)
    assert layer.read_bits_per_value() == 3.0  # 3 * 64 = 192 key bits/token, 3 * 96 * 2 value bits/channel
    report = memory_report([layer])
    assert report.read_bits == 3.0 and report.to_dict()["read_bits"] == 3.0  # reaches every sample row
    assert report.effective_bits > 8.0  # retained bits are the stored 8-bit codes plus params


def test_four_of_eight_beats_stored_four_bits():
    """Same payload read (4 bits/value): ReadKV from an 8-bit cache vs a 4-bit cache read fully."""
    torch.manual_seed(0)
    t, d, scaling = 256, 64, 1 / 8
    k = torch.randn(1, 2, t, d)
    k[..., :4] *= 12  # outlier channels
    k[..., 10:12] += 6
    v = torch.randn(1, 2, t, d)
    v[:, :, ::37] *= 8  # a few outlier tokens
    q = torch.randn(1, 2, 8, d)  # 8 query rows per kv head
    q[..., :4] *= 0.2
    ref = torch.softmax(q @ k.transpose(-1, -2) * scaling, -1) @ v

    kb, vb = budgets(4, 0.5, d, t)
    out, pk, pv = query_adaptive_attention(
        q, codes_of(k, 8, "channel", 32), codes_of(v, 8, "token", 32), 8, kb, vb, scaling
    )
    assert (pk.sum(-1) * t + pv.sum(-1) * d == 2 * 4 * t * d).all()  # exactly 4 bits/value read
    k4, v4 = fake_quantize_grouped(k, 16, "channel", 32), fake_quantize_grouped(v, 16, "token", 32)
    stored4 = torch.softmax(q @ k4.transpose(-1, -2) * scaling, -1) @ v4
    err_readkv = float((out - ref).norm() / ref.norm())
    err_stored4 = float((stored4 - ref).norm() / ref.norm())
    print(f"relative attention-output error: readkv 4-of-8 {err_readkv:.4f}, stored 4-bit {err_stored4:.4f}")
    assert math.isfinite(err_readkv) and err_readkv < err_stored4


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"bits": 9}, "method.bits"),
        ({"bits": 3.5}, "method.bits"),
        ({"bits": 1}, "method.bits"),
        ({"read_bits": 0}, "method.read_bits"),
        ({"bits": 4, "read_bits": 5}, "method.read_bits"),
        ({"read_bits": "4"}, "method.read_bits"),
        ({"key_share": 1.5}, "method.key_share"),
        ({"group_size": 0}, "method.group_size"),
        ({"group_size": 12}, "method.group_size"),  # key planes pack 8 tokens per byte
        ({"residual": -1}, "method.residual"),
    ],
)
def test_bad_config(overrides, key):
    with pytest.raises(ConfigError) as err:
        build_method({"name": "readkv", **overrides})
    assert err.value.key == key


def test_group_must_divide_head_dim():
    with pytest.raises(ConfigError, match=r"method.group_size=48: must divide head_dim=64"):
        build_method({"name": "readkv", "group_size": 48}).config.check_model(SHAPE)


def test_default_read_bits_and_label():
    method = build_method({"name": "readkv"})
    assert (method.config.bits, method.config.read_bits) == (8.0, 4.0)
    assert method.label() == "readkv-4of8b"


def plane_stores(k, v, bits, group=32):
    from kvbench.cache.bitplanes import BitPlaneTokens
    from kvbench.methods.readkv import PlaneStore

    kq, vq = BitPlaneTokens(bits, "channel", group), BitPlaneTokens(bits, "token", group)
    kq.append(k)
    vq.append(v)
    return kq, vq, PlaneStore.of(kq), PlaneStore.of(vq)


@pytest.mark.parametrize("block_size", [32, 96, 4096])
def test_blockwise_read_from_the_planes_equals_the_dense_read(block_size):
    """The layer's read (two passes over the bit planes, plane by plane) equals the dense function
    over fully expanded codes, read bits included."""
    from kvbench.methods.readkv import blockwise_query_adaptive_attention

    torch.manual_seed(3)
    t, d, bits, scaling = 256, 64, 8, 1 / 8
    k, v = torch.randn(1, 2, t, d) * torch.linspace(0.5, 4, d), torch.randn(1, 2, t, d)
    kq, vq, ks, vs = plane_stores(k, v, bits)
    q = torch.randn(1, 2, 6, d)
    exact_k, exact_v = torch.randn(1, 2, 3, d), torch.randn(1, 2, 3, d)
    mask = torch.zeros(1, 2, 6, t + 3)
    mask[..., [5, 77, t + 2]] = float("-inf")
    kb, vb = budgets(3, 0.5, d, t)
    dense = query_adaptive_attention(
        q, codes_of(k, bits, "channel", 32), codes_of(v, bits, "token", 32), bits, kb, vb, scaling,
        exact_k, exact_v, mask,
    )  # fmt: skip
    blockwise = blockwise_query_adaptive_attention(
        q, ks, vs, bits, kb, vb, scaling, exact_k, exact_v, mask, block_size
    )
    torch.testing.assert_close(blockwise[0], dense[0], rtol=1e-5, atol=1e-5)
    assert torch.equal(blockwise[1], dense[1]) and torch.equal(blockwise[2], dense[2])  # same prefix bits


@pytest.mark.parametrize("bits", [2, 5, 8])
def test_the_read_depends_only_on_the_planes_it_counts(bits):
    """Flipping every bit of the planes no query head needs (key plane j of channel c with all
    heads' p_c <= j, value plane j of token t with all p_t <= j) leaves the output unchanged, and
    the counted bytes are exactly the planes that remain."""
    from kvbench.methods.readkv import PlaneStore, blockwise_query_adaptive_attention, planes_moved

    torch.manual_seed(bits)
    t, d, scaling = 128, 64, 1 / 8
    k, v = torch.randn(1, 2, t, d) * torch.linspace(0.5, 4, d), torch.randn(1, 2, t, d)
    _, _, ks, vs = plane_stores(k, v, bits)
    q = torch.randn(1, 2, 3, d)
    kb, vb = budgets(bits / 3, 0.5, d, t)
    out, pk, pv = blockwise_query_adaptive_attention(q, ks, vs, bits, kb, vb, scaling, block_size=64)
    key_need = pk.amax(2)  # [B, H, D]: planes 0..need-1 of each channel are read
    value_need = pv.amax(2)  # [B, H, T]
    assert key_need.max() > key_need.min() and value_need.max() > value_need.min()
    kp = ks.planes.clone().view(1, 2, t // 8, bits, d)
    vp = vs.planes.clone().view(1, 2, t, bits, d // 8)
    plane = torch.arange(bits)
    kp ^= torch.where(key_need[:, :, None, None, :] <= plane[:, None], 255, 0).to(torch.uint8)
    vp ^= torch.where(value_need[:, :, :, None, None] <= plane[:, None], 255, 0).to(torch.uint8)
    flipped_k = PlaneStore(kp.view_as(ks.planes), *ks[1:])
    flipped_v = PlaneStore(vp.view_as(vs.planes), *vs[1:])
    again = blockwise_query_adaptive_attention(q, flipped_k, flipped_v, bits, kb, vb, scaling, block_size=64)
    assert torch.equal(again[0], out) and torch.equal(again[1], pk) and torch.equal(again[2], pv)
    want = int(key_need.sum()) * (t // 8) + int(value_need.sum()) * (d // 8)
    assert int(planes_moved(ks, vs, pk, pv)) == want
    assert want < bits * t * d * 2 * 2 // 8  # fewer than all the planes of keys and values


def test_decode_moves_the_bytes_it_reads():
    """One query head per kv head: the planes moved are the logical read bits / 8, plus every
    scale and zero and the exact tokens; a GQA group moves the union of its heads' prefixes."""
    torch.manual_seed(0)
    d, t = 64, 96
    for heads, kv in ((2, 2), (4, 2)):
        k, v = torch.randn(2, 1, kv, t + 1, d).unbind(0)
        layer = readkv_layer(bits=8, read_bits=3)
        layer.update(k[:, :, :t], v[:, :, :t])
        keys, values = layer.update(k[:, :, t:], v[:, :, t:])
        layer.attend(SimpleNamespace(scaling=0.125), torch.randn(1, heads, 1, d), keys, values, None)
        steps, moved = layer.read_traffic()
        params = 2 * 2 * kv * (t // 32 * d + t * d // 32)  # fp16 scale + zero of keys and values
        logical = layer.read_bits_total // 8
        assert steps == 1
        if heads == kv:
            assert moved == logical + params
        else:
            assert params + logical // (heads // kv) < moved <= params + logical
        report = memory_report([layer])
        assert report.read_bytes_per_step == moved
        assert report.to_dict()["read_bytes_per_step"] == moved


@pytest.mark.parametrize("bits", [1, 3, 8])
@pytest.mark.parametrize(
    ("along", "t", "d"), [("token", 24, 64), ("token", 8, 20), ("channel", 5, 64), ("channel", 3, 20)]
)
def test_planes_round_trip_and_read_one_plane(bits, along, t, d):
    from kvbench.quant.bitplanes import pack_planes, plane_bits, unpack_planes

    g = torch.Generator().manual_seed(bits * 100 + t)
    codes = torch.randint(0, 2**bits, (2, 3, t, d), generator=g).to(torch.uint8)
    planes = pack_planes(codes, bits, along)
    per_plane = t // 8 * d if along == "token" else t * -(-d // 8)
    assert planes.numel() == 2 * 3 * bits * per_plane  # B bits per entry (+ channel padding)
    assert torch.equal(unpack_planes(planes, bits, along, d), codes)
    for j in range(bits):
        assert torch.equal(plane_bits(planes, bits, j, along, d), (codes >> (bits - 1 - j)) & 1)


def test_plane_store_holds_the_quantized_tokens_codes():
    """Same quantization as the packed store: the planes hold its codes, its params, B bits each."""
    from kvbench.cache.bitplanes import BitPlaneTokens
    from kvbench.cache.quantized import QuantizedTokens

    torch.manual_seed(1)
    x = torch.randn(1, 2, 64, 64)
    for axis in ("channel", "token"):
        planes, packed = BitPlaneTokens(8, axis, 32), QuantizedTokens(256, axis, 32)
        for part in (x[:, :, :32], x[:, :, 32:]):
            planes.append(part)
            packed.append(part)
        assert torch.equal(planes.codes(), unpack(packed.codes, 256, 64))
        assert torch.equal(planes.scale, packed.scale) and torch.equal(planes.zero, packed.zero)
        assert planes.planes.numel() == packed.codes.numel()
        assert torch.equal(planes.dequantize(), packed.dequantize())
        src = planes.source()
        torch.testing.assert_close(src.read(8, 45), packed.dequantize()[..., 8:45, :], rtol=0, atol=0)
