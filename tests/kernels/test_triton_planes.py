"""ReadKV's Triton plane kernels (``kvbench/kernels/triton_planes.py``) equal the torch read that
:mod:`kvbench.methods.readkv` takes without compiled kernels.

- ``plane_key_scores`` / ``plane_value_mix`` equal the reference's prefix read (the codes assembled
  by :meth:`~kvbench.methods.readkv.PlaneStore.read_codes` from the planes some row reads,
  reconstructed by :func:`~kvbench.quant.progressive.prefix_reconstruct`, then the dot products) to
  float32 reassociation, on stores cut into several blocks with a partial last one, and read no
  plane beyond the prefixes (flipping the unread planes' bits changes nothing);
- ``allocate_prefix`` equals :func:`~kvbench.quant.progressive.allocate_prefix_bits` exactly on
  tie-free weights (rows cut into several blocks included), and with ties spends the same budget
  for the same objective, taking tied gains as the compiled kernel does (lowest item first);
- ``plane_rms`` is the reference's statistic bit for bit;
- a whole read, and a decode step and a chunked forward of a tiny Llama, give with
  ``backend=triton`` what the torch backend gives.

Under ``TRITON_INTERPRET=1`` (tests/kernels/conftest.py) each program runs as numpy, so the cases
use few, large program instances. Every failure message names its case and seed.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.cache.bitplanes import BitPlaneTokens
from kvbench.kernels.triton_planes import TritonPlanes
from kvbench.methods import build_method
from kvbench.methods.readkv import (
    PlaneStore,
    blockwise_query_adaptive_attention,
    budgets,
    compiled_query_adaptive_attention,
)
from kvbench.quant.progressive import allocate_prefix_bits, prefix_reconstruct

BLOCK = 64  # tokens per program: every store below ends in a partial block
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else TRITON_INTERPRET=1 (conftest.py)


class OnDevice:
    """:class:`TritonPlanes` whose tensor arguments go to ``DEVICE`` and whose results come back to
    the CPU, where the cases are drawn and the references computed."""

    def __init__(self, inner: TritonPlanes):
        self.inner = inner

    def __getattr__(self, name):
        method = getattr(self.inner, name)

        def call(*args):
            out = method(*(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in args))
            return out.cpu()

        return call


@pytest.fixture(scope="module")
def planes():
    return OnDevice(TritonPlanes(block_tokens=BLOCK))


def close(got, want, where, rel=1e-4):
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    bound = rel * max(want.abs().max().item(), 1e-6)
    assert err <= bound, f"{where}: max error {err:.3g} > {bound:.3g}"


def store(g, axis, bits, group, h, t, d, b=2, param_dtype=torch.float16) -> PlaneStore:
    """A ReadKV store of random tokens: keys (``axis="channel"``) with channels of unequal scale."""
    x = torch.randn(b, h, t, d, generator=g)
    if axis == "channel":
        x = x * (torch.rand(d, generator=g) * 3 + 0.1)
    held = BitPlaneTokens(bits, axis, group, param_dtype)
    held.append(x)
    return PlaneStore.of(held)


def stores(seed, bits, group, h, t, d):
    g = torch.Generator().manual_seed(seed)
    return g, store(g, "channel", bits, group, h, t, d), store(g, "token", bits, group, h, t, d)


def reference_scores(kc: PlaneStore, query, pk, scaling):
    """The torch read's logits: codes from the planes some row reads, each row's prefixes."""
    t = kc.num_tokens
    s, z = kc.params(0, t)
    codes = kc.read_codes(pk.amax(2), 0, t)
    k_p = prefix_reconstruct(codes[:, :, None], s[:, :, None], z[:, :, None], kc.bits, pk[:, :, :, None, :])
    return (k_p @ query[..., None])[..., 0] * scaling


def reference_mix(vc: PlaneStore, weights, pv):
    t = vc.num_tokens
    s, z = vc.params(0, t)
    codes = vc.read_codes(pv.amax(2), 0, t)
    v_p = prefix_reconstruct(codes[:, :, None], s[:, :, None], z[:, :, None], vc.bits, pv[..., None])
    return (weights[..., None, :] @ v_p)[..., 0, :]


# (bits, group, head_dim, kv heads, key tokens, value tokens, query rows): key stores hold whole
# groups (as ReadKV appends them); value stores any count (here none a multiple of 8)
CASES = [
    (2, 8, 64, 3, 40, 37, 1),
    (3, 32, 128, 2, 96, 101, 4),
    (4, 16, 64, 3, 208, 203, 4),
    (5, 32, 64, 2, 160, 75, 1),
    (6, 64, 128, 2, 128, 131, 4),
    (7, 8, 64, 3, 72, 45, 4),
    (8, 32, 128, 3, 96, 99, 1),
    (8, 64, 64, 2, 320, 317, 4),
]


@pytest.mark.parametrize("bits,group,d,h,tk,tv,m", CASES)
def test_key_scores_and_value_mix_equal_the_torch_read(planes, bits, group, d, h, tk, tv, m):
    seed = bits * 1000 + tk + m
    g = torch.Generator().manual_seed(seed)
    kc, vc = store(g, "channel", bits, group, h, tk, d), store(g, "token", bits, group, h, tv, d)
    where = f"bits={bits} G={group} D={d} H={h} Tk={tk} Tv={tv} M={m} seed={seed}"
    query = torch.randn(2, h, m, d, generator=g)
    pk = torch.randint(0, bits + 1, (2, h, m, d), generator=g)
    got = planes.plane_key_scores(query, kc.planes, kc.scale, kc.zero, pk, bits, group, 0.125)
    close(got, reference_scores(kc, query, pk, 0.125), f"{where} scores")
    # weights as the read hands them: the stored columns of a wider softmax (strided)
    wide = torch.softmax(torch.randn(2, h, m, tv + 3, generator=g), -1)
    weights = wide[..., :tv]
    pv = torch.randint(0, bits + 1, (2, h, m, tv), generator=g)
    got = planes.plane_value_mix(weights, vc.planes, vc.scale, vc.zero, pv, bits, group, d)
    close(got, reference_mix(vc, weights, pv), f"{where} mix")


@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_other_parameter_dtypes(planes, param_dtype):
    """ReadKV holds fp16 scales and zeros; the kernels read bfloat16 (on its bits: the interpreter's
    own bf16 cast is unreliable) and float32 ones the same way."""
    g = torch.Generator().manual_seed(5)
    bits, group, d, h, m = 4, 32, 64, 2, 4
    kc, vc = (
        store(g, "channel", bits, group, h, 96, d, param_dtype=param_dtype),
        store(g, "token", bits, group, h, 77, d, param_dtype=param_dtype),
    )
    assert kc.scale.dtype == vc.zero.dtype == param_dtype
    query = torch.randn(2, h, m, d, generator=g)
    pk = torch.randint(0, bits + 1, (2, h, m, d), generator=g)
    got = planes.plane_key_scores(query, kc.planes, kc.scale, kc.zero, pk, bits, group, 0.125)
    close(got, reference_scores(kc, query, pk, 0.125), f"{param_dtype} scores")
    weights = torch.softmax(torch.randn(2, h, m, 77, generator=g), -1)
    pv = torch.randint(0, bits + 1, (2, h, m, 77), generator=g)
    got = planes.plane_value_mix(weights, vc.planes, vc.scale, vc.zero, pv, bits, group, d)
    close(got, reference_mix(vc, weights, pv), f"{param_dtype} mix")


def test_kernels_read_no_plane_beyond_the_prefixes(planes):
    bits, group, d, t, m = 6, 32, 64, 96, 4
    g, kc, vc = stores(7, bits, group, 2, t, d)
    query = torch.randn(2, 2, m, d, generator=g)
    weights = torch.rand(2, 2, m, t, generator=g)
    pk = torch.randint(0, 4, (2, 2, m, d), generator=g)  # key planes 4, 5 never read
    pv = torch.randint(0, 3, (2, 2, m, t), generator=g)  # value planes 3..5 never read
    scores = planes.plane_key_scores(query, kc.planes, kc.scale, kc.zero, pk, bits, group, 1.0)
    mix = planes.plane_value_mix(weights, vc.planes, vc.scale, vc.zero, pv, bits, group, d)
    kp, vp = kc.planes.clone(), vc.planes.clone()
    kp.view(2, 2, t // 8, bits, d)[..., 4:, :] ^= 0xFF
    vp.view(2, 2, t, bits, d // 8)[..., 3:, :] ^= 0xFF
    assert torch.equal(planes.plane_key_scores(query, kp, kc.scale, kc.zero, pk, bits, group, 1.0), scores)
    assert torch.equal(planes.plane_value_mix(weights, vp, vc.scale, vc.zero, pv, bits, group, d), mix)
    # a plane some row reads does move them
    kp.view(2, 2, t // 8, bits, d)[..., 0, :] ^= 0xFF
    vp.view(2, 2, t, bits, d // 8)[..., 0, :] ^= 0xFF
    assert not torch.equal(
        planes.plane_key_scores(query, kp, kc.scale, kc.zero, pk, bits, group, 1.0), scores
    )
    assert not torch.equal(planes.plane_value_mix(weights, vp, vc.scale, vc.zero, pv, bits, group, d), mix)


@pytest.mark.parametrize(
    "shape,bits,budgets_,block",
    [
        ((2, 3, 4, 64), 8, (0, 1, 256, 511, 512, 600), None),  # key rows: channels
        ((2, 2, 1, 128), 4, (1, 200, 384), None),
        ((2, 3, 1, 101), 2, (3, 201, 500), 32),  # value rows, four blocks each
        ((2, 2, 4, 203), 3, (1, 304, 608), 64),
        ((2, 2, 4, 75), 5, (150, 374), 16),
        ((1, 3, 2, 96), 7, (0, 336, 671), None),
    ],
)  # fmt: skip
def test_allocation_equals_the_reference_without_ties(shape, bits, budgets_, block):
    planes = OnDevice(TritonPlanes(block_items=block))
    seed = sum(shape) + bits
    g = torch.Generator().manual_seed(seed)
    # spread over many binades, as attention weights are
    w = torch.rand(shape, generator=g) * torch.exp2(-20 * torch.rand(shape, generator=g))
    for budget in budgets_:
        want = allocate_prefix_bits(w, bits, budget)
        got = planes.allocate_prefix(w, bits, budget)
        assert got.dtype == want.dtype, f"{shape} bits={bits} budget={budget}"
        assert torch.equal(got, want), f"{shape} bits={bits} budget={budget} block={block} seed={seed}"


def lowest_first(w, bits, budget):
    """The allocation with tied gains taken from the lowest (item, bit) up: a stable sort of the
    item-major gains, the compiled kernel's tie rule, in plain torch."""
    step = torch.pow(0.5, torch.arange(bits, dtype=torch.float32))
    gains = (w[..., :, None] * step).flatten(-2)
    order = torch.sort(gains, dim=-1, descending=True, stable=True).indices[..., :budget]
    counts = torch.zeros(w.shape, dtype=torch.long)
    return counts.scatter_add_(-1, order // bits, torch.ones_like(order))


def test_allocation_with_ties_takes_the_lowest_items_for_the_same_objective():
    g = torch.Generator().manual_seed(3)
    w = torch.rand(4, 50, generator=g)
    w[:, ::3] = 0.0  # tied zero gains
    w[:, 1] = 2 * w[:, 4]  # w_1 2^-1 ties w_4's first gain
    w[:, 7] = 1e-42  # a subnormal weight: its gains round
    # weights below 2^(8-126), whose gains are tiny normals or subnormals (the gain-by-gain count)
    w[2, 20:30] = torch.rand(10, generator=g) * 1e-37
    w[2, 30:40] = torch.rand(10, generator=g) * 1e-41
    w[3] = 0.25  # equal weights: every item's j-th gain ties every other item's
    planes = OnDevice(TritonPlanes(block_items=16))  # ties carried across blocks
    objective = lambda p: (w * torch.pow(0.5, p.float())).sum(-1)  # noqa: E731
    for budget in (0, 130, 399, 400):
        want = allocate_prefix_bits(w, 8, budget)
        got = planes.allocate_prefix(w, 8, budget)
        where = f"budget={budget}"
        assert torch.equal(got, lowest_first(w, 8, budget)), where
        assert torch.equal(got.sum(-1), want.sum(-1)), where
        torch.testing.assert_close(objective(got), objective(want), rtol=1e-6, atol=0, msg=where)
    # 130 bits over 50 equal items: every item's first two bits, then a third for the first 30
    got = planes.allocate_prefix(w[3:], 8, 130)[0]
    assert got[:30].tolist() == [3] * 30 and got[30:].tolist() == [2] * 20


@pytest.mark.parametrize("shape,dim", [((2, 3, 300, 2), -1), ((2, 3, 5, 128), -2)])
def test_rms_is_the_reference_statistic(planes, shape, dim):
    s = (torch.rand(shape, generator=torch.Generator().manual_seed(shape[2])) * 2).half()
    want = s.float().pow(2).mean(dim).sqrt()
    assert torch.equal(planes.plane_rms(s, dim), want), f"{shape} dim={dim}"


@pytest.mark.parametrize(
    "bits,read_bits,d,m", [(8, 4, 64, 4), (4, 1.5, 128, 1), (3, 2, 64, 1), (2, 2, 128, 4)]
)
def test_triton_read_equals_the_blockwise_read(planes, bits, read_bits, d, m):
    seed = bits * 10 + m
    t = 160
    g, kc, vc = stores(seed, bits, 32, 3, t, d)
    query = torch.randn(2, 3, m, d, generator=g)
    exact_k, exact_v = torch.randn(2, 3, 5, d, generator=g), torch.randn(2, 3, 5, d, generator=g)
    mask = torch.zeros(2, 3, m, t + 5)
    mask[1, :, :, :7] = float("-inf")  # a padded sequence
    kb, vb = budgets(read_bits, 0.5, d, t)
    want = blockwise_query_adaptive_attention(
        query, kc, vc, bits, kb, vb, 0.125, exact_k, exact_v, mask, block_size=64
    )
    got = compiled_query_adaptive_attention(
        planes, query, kc, vc, bits, kb, vb, 0.125, exact_k, exact_v, mask, "triton"
    )
    where = f"bits={bits} read={read_bits} D={d} M={m} seed={seed}"
    assert torch.equal(got[1], want[1]), f"{where}: key prefixes"
    assert torch.equal(got[2], want[2]), f"{where}: value prefixes"
    close(got[0], want[0], f"{where} output")


@pytest.mark.parametrize("arch", ["llama", "llama-hd128"])
def test_readkv_decode_on_triton_matches_torch(arch, monkeypatch):
    """A tiny Llama: prefill, one decode step (query-adaptive read) and a chunk of five tokens
    (the full read) give the same logits with ``backend=triton`` as with ``backend=torch``, and the
    run records that Triton read the planes: both reads of every layer went through the kernels."""
    from tiny_archs import VOCAB, loaded, tiny_model

    from kvbench.kernels import cpu

    launches = {"scores": 0, "mix": 0}
    for name, method in (("scores", "plane_key_scores"), ("mix", "plane_value_mix")):
        original = getattr(TritonPlanes, method)

        def counted(self, *args, _name=name, _original=original):
            launches[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(TritonPlanes, method, counted)
    model, shape = tiny_model(arch)
    model = model.to(DEVICE)
    prompt = torch.randint(VOCAB, (1, 45), generator=torch.Generator().manual_seed(0))
    node = {"name": "readkv", "bits": 6, "read_bits": 3, "group_size": 16, "fp_dtype": "float32"}
    logits, held = {}, {}
    for backend in ("torch", "triton"):
        cpu.reset_for_tests()
        runner = loaded(model, shape).runner(build_method({**node, "backend": backend}))
        cache = runner.new_cache()
        with torch.no_grad():
            first = runner.forward(prompt, cache)[0, -1]
            step = runner.decode_step(torch.tensor([[int(first.argmax())]]), cache)[0, -1]
            chunk = runner.forward(torch.tensor([[3, 14, 15, 92, 65]]), cache)[0]
        logits[backend] = (first, step, chunk)
        layer = cache.layers[0]
        held[backend] = [t.cpu() for ts in layer.held_tensors().values() for t in ts]
        assert layer.read_steps == 1, f"{arch} {backend}: decode reads {layer.read_steps}"
        assert len(layer.kq) == 48, f"{arch} {backend}: stored tokens {len(layer.kq)}"
        used = cpu.backend_in_use()
        assert ("triton" in used) == (backend == "triton"), f"{arch} {backend}: read by {used}"
        assert layer.read_bits_per_value() == 3.0, f"{arch} {backend}: a query-adaptive read"
    assert all(torch.equal(a, b) for a, b in zip(held["torch"], held["triton"], strict=True))  # same bytes
    layers = shape.num_layers
    assert launches == {"scores": 2 * layers, "mix": 2 * layers}, launches  # decode and chunk
    names = ("prefill", "decode", "chunk")
    for name, got, want in zip(names, logits["triton"], logits["torch"], strict=True):
        close(got, want, f"{arch} {name}")


def test_readkv_takes_triton_only_where_the_kernels_read_every_plane(monkeypatch):
    from kvbench.errors import ConfigError

    node = {"name": "readkv", "bits": 8, "read_bits": 4, "backend": "triton"}
    assert build_method(node).config.backend == "triton"
    # behind a sink the planes would be read by the generic blockwise path, not by these kernels
    with pytest.raises(ConfigError, match=r"method.sink_tokens=4.*backend=triton"):
        build_method({**node, "sink_tokens": 4})
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"method.backend='triton': needs a CUDA device"):
        build_method(node)


def test_triton_decode_read_never_waits_and_does_not_grow_with_the_context():
    """DESIGN's kernel contract: a fixed number of calls per read whatever the context, no host
    sync (counted by kvbench.kernels.counting on the torch side of the launches)."""
    from types import SimpleNamespace

    from kvbench.kernels import cpu
    from kvbench.kernels.counting import count_ops
    from kvbench.methods import ModelShape

    shape = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64)
    node = {"name": "readkv", "bits": 8, "read_bits": 3, "fp_dtype": "float32", "backend": "triton"}
    totals = []
    for t in (96, 224):
        g = torch.Generator().manual_seed(t)
        cpu.reset_for_tests()
        layer = build_method(node).build_layers(shape, torch.float32)[0]
        k, v = torch.randn(2, 1, 2, t + 1, 64, generator=g).to(DEVICE).unbind(0)
        query = torch.randn(1, 4, 1, 64, generator=g).to(DEVICE)
        layer.update(k[:, :, :t], v[:, :, :t])
        keys, values = layer.update(k[:, :, t:], v[:, :, t:])
        with count_ops() as counts:
            layer.attend(SimpleNamespace(scaling=0.125), query, keys, values, None)
        assert layer.read_steps == 1 and cpu.backend_in_use() == "triton", f"T={t}: not the Triton read"
        assert counts.total_syncs == 0, counts.describe_syncs()
        totals.append(counts.total_ops)
    assert totals[0] == totals[1], totals


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits,read_bits", [(8, 4), (4, 2)])
def test_full_size_read_on_cuda(bits, read_bits):
    """A Llama-3.1-8B layer's read at 8K tokens (8 kv heads, 4 query heads each, D = 128) through
    the kernels' GPU tiles: the same prefixes as the blockwise torch read on the same device, and
    the same output to float32 reassociation."""
    g = torch.Generator().manual_seed(bits)
    h, t, d, m = 8, 8192, 128, 4
    kc = PlaneStore.of(_cuda_store(g, "channel", bits, h, t, d))
    vc = PlaneStore.of(_cuda_store(g, "token", bits, h, t, d))
    query = torch.randn(1, h, m, d, generator=g).cuda()
    exact_k, exact_v = (torch.randn(1, h, 17, d, generator=g).cuda() for _ in range(2))
    kb, vb = budgets(read_bits, 0.5, d, t)
    want = blockwise_query_adaptive_attention(query, kc, vc, bits, kb, vb, d**-0.5, exact_k, exact_v)
    got = compiled_query_adaptive_attention(
        TritonPlanes(), query, kc, vc, bits, kb, vb, d**-0.5, exact_k, exact_v, None, "triton"
    )
    where = f"bits={bits} read={read_bits}"
    assert torch.equal(got[1], want[1]), f"{where}: key prefixes"
    assert torch.equal(got[2], want[2]), f"{where}: value prefixes"
    close(got[0], want[0], f"{where} output")


def _cuda_store(g, axis, bits, h, t, d):
    x = torch.randn(1, h, t, d, generator=g)
    held = BitPlaneTokens(bits, axis, 32)
    held.append(x.cuda())
    return held
