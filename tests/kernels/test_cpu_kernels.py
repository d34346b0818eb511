"""The compiled CPU kernels (:mod:`kvbench.kernels.cpu`) equal the plain-torch reference of every
stored format they cover, and a decode step reads each stored part in one call.

Tolerance: float32 reassociation only, ``|kernel - reference| <= 2e-5 * max|reference|`` (the
kernels sum in another order and fold the affine parameters into the query or the weights). Every
failure message names the case and its seed.
"""

from __future__ import annotations

import pytest
import torch

from kvbench.cache.affine_source import PerChannelAffineSource, PerTokenAffineSource
from kvbench.cache.blockwise import single_call_attention
from kvbench.cache.codebook_source import CodebookSource
from kvbench.cache.fp import FullPrecisionSource
from kvbench.cache.source import ConcatSource, RoPESource
from kvbench.kernels import cpu
from kvbench.kernels.cpu.parts import CompiledReader, read_kernels
from kvbench.quant.packing import chunk_layout, pack, unpack
from kvbench.quant.rope import cos_sin

# every level count up to 16 (one-byte chunks, base-L words of 2..4 bytes, bit streams), then a few
# of each wider layout
LEVELS = [*range(2, 17), 17, 24, 32, 40, 64, 84, 85, 128, 256]


@pytest.fixture(scope="module")
def reader(compiled_kernels):
    return CompiledReader(compiled_kernels)


def close(got, want, where):
    assert got is not None, f"{where}: no kernel answered"
    assert got.shape == want.shape, f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    bound = 2e-5 * max(want.abs().max().item(), 1e-6)
    assert err <= bound, f"{where}: max error {err:.3g} > {bound:.3g}"


def both(reader, part, query, weights, where):
    t = part.num_tokens
    close(reader.scores(part, query), part.scores(query, 0, t), f"{where} scores")
    close(reader.mix(part, weights), part.mix(weights, 0, t), f"{where} mix")


def inputs(seed, b, h, m, t, d):
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(b, h, m, d, generator=g)
    weights = torch.rand(b, h, m, t, generator=g)
    return g, query, weights


def random_codes(g, levels, b, h, t, d):
    codes = torch.randint(0, levels, (b, h, t, d), generator=g, dtype=torch.int64).to(torch.uint8)
    return pack(codes, levels)


def grown_view(x, extra=5):
    """``x`` as the view of a larger buffer along tokens, as the doubling buffers hand it out."""
    b, h, t, d = x.shape
    buf = torch.zeros(b, h, t + extra, d, dtype=x.dtype)
    buf[:, :, :t] = x
    return buf[:, :, :t]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [64, 128, 20])
def test_full_precision_rows(reader, dtype, d):
    for seed, (m, t) in enumerate([(1, 1), (3, 203), (4, 1030)]):
        g, q, p = inputs(seed, 2, 3, m, t, d)
        data = grown_view(torch.randn(2, 3, t, d, generator=g).to(dtype))
        both(reader, FullPrecisionSource(data), q, p, f"fp {dtype} d={d} m={m} t={t} seed={seed}")


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("d", [64, 128])
def test_per_channel_affine_codes(reader, levels, d):
    for seed, (m, group, groups, dtype) in enumerate(
        [(3, 32, 7, torch.float16), (1, 8, 33, torch.float32), (4, 5, 61, torch.float16)]
    ):
        t = group * groups
        g, q, p = inputs(seed, 1, 3, m, t, d)
        codes = grown_view(random_codes(g, levels, 1, 3, t, d))
        scale = grown_view((torch.rand(1, 3, groups, d, generator=g) + 0.1).to(dtype))
        zero = grown_view(torch.randn(1, 3, groups, d, generator=g).to(dtype))
        part = PerChannelAffineSource(codes, scale, zero, levels, group, d)
        both(reader, part, q, p, f"per-channel L={levels} d={d} m={m} G={group} t={t} seed={seed}")


@pytest.mark.parametrize("levels", LEVELS)
@pytest.mark.parametrize("d", [64, 128])
def test_per_token_affine_codes(reader, levels, d):
    for seed, (m, group, t, dtype) in enumerate(
        [
            (3, 32, 203, torch.float16),
            (1, 16, 1, torch.float32),
            (4, d, 517, torch.float16),
            (3, 4, 77, torch.bfloat16),
        ]
    ):
        g, q, p = inputs(seed, 2, 1, m, t, d)
        codes = grown_view(random_codes(g, levels, 2, 1, t, d))
        scale = grown_view((torch.rand(2, 1, t, d // group, generator=g) + 0.1).to(dtype))
        zero = grown_view(torch.randn(2, 1, t, d // group, generator=g).to(dtype))
        part = PerTokenAffineSource(codes, scale, zero, levels, group, d)
        both(reader, part, q, p, f"per-token L={levels} d={d} m={m} G={group} t={t} seed={seed}")


@pytest.mark.parametrize("d", [64, 20])
def test_kernels_read_every_code_exactly(reader, d):
    # One-hot queries against the identity table read the codes back (small integers, exact in
    # float32), so every layout's decoding is compared code by code with the packing's unpack.
    for levels in range(2, 257):
        g = torch.Generator().manual_seed(levels)
        codes = torch.randint(0, levels, (1, 2, 37, d), generator=g, dtype=torch.int64).to(torch.uint8)
        codes[..., 0, :] = levels - 1
        packed = grown_view(pack(codes, levels))
        eye = torch.eye(d).expand(1, 2, d, d)
        c, m = chunk_layout(levels)
        ident = torch.arange(levels, dtype=torch.float32)
        got = reader.k.code_scores(eye, packed, ident, None, None, levels, d, c, m, 1, 1, None, None, 0)
        want = unpack(packed, levels, d).float().transpose(-1, -2)
        assert torch.equal(got, want), f"code_scores L={levels} d={d} seed={levels}"
        # the folded per-channel kernel with unit scale and zero 0 over one group of all tokens
        scale = torch.ones(1, 2, 1, d)
        got = reader.k.affine_channel_scores(eye, packed, scale, 0 * scale, levels, d, c, m, 37)
        assert torch.equal(got, want), f"affine_channel_scores L={levels} d={d} seed={levels}"
        # one-hot weights over the tokens: the folded per-token kernel and the generic mix
        pick = torch.eye(37).expand(1, 2, 37, 37)
        unit = torch.ones(1, 2, 37, 1)
        got = reader.k.affine_token_mix(pick, packed, unit, 0 * unit, levels, d, c, m, d)
        assert torch.equal(got, want.transpose(-1, -2)), f"affine_token_mix L={levels} d={d} seed={levels}"
        got = reader.k.code_mix(pick, packed, ident, None, None, levels, d, c, m, 1, 1)
        assert torch.equal(got, want.transpose(-1, -2)), f"code_mix L={levels} d={d} seed={levels}"


def outliers(g, b, h, t, d, count):
    """``count`` distinct entries, token index ascending (the dense-and-sparse store's order)."""
    flat = torch.randperm(t * b * h * d, generator=g)[:count].sort().values
    rows, cols = flat // (b * h * d), flat % (b * h * d)
    return rows.to(torch.int32), cols.to(torch.int32), torch.randn(count, generator=g).half() * 8


@pytest.mark.parametrize("levels", [2, 3, 4, 5, 7, 8, 9, 10, 11, 16, 17, 32])
def test_codebook_codes(reader, levels):
    b, h, d = 1, 3, 64
    for seed, (kind, m, t) in enumerate(
        [
            ("token-scale", 3, 203),
            ("token-range", 4, 130),
            ("fixed-range", 1, 150),
            ("rotated", 4, 99),
            ("outliers", 3, 301),
        ]
    ):
        g, q, p = inputs(seed, b, h, m, t, d)
        codes = grown_view(random_codes(g, levels, b, h, t, d))
        codebook = torch.randn(levels, generator=g).sort().values
        kw = {}
        if kind == "token-scale":
            kw["scale"] = grown_view(torch.rand(b, h, t, 1, generator=g).half() + 0.5)
        if kind == "token-range":
            kw["scale"] = grown_view(torch.rand(b, h, t, 1, generator=g).half() + 0.5)
            kw["zero"] = grown_view(torch.randn(b, h, t, 1, generator=g).half())
        if kind in ("fixed-range", "outliers"):
            kw["scale"] = torch.rand(1, h, 1, d, generator=g) + 0.5
            kw["zero"] = torch.randn(1, h, 1, d, generator=g)
        if kind == "outliers":
            kw["scale"] = torch.rand(b, h, t, 1, generator=g).half() + 0.5
            kw["outliers"] = outliers(g, b, h, t, d, 40)
        if kind == "rotated":
            kw["scale"] = torch.rand(b, h, t, 1, generator=g).half() + 0.5
            kw["rotation"] = torch.linalg.qr(torch.randn(h, d, d, generator=g))[0]
        part = CodebookSource(codes, levels, d, codebook, **kw)
        both(reader, part, q, p, f"codebook {kind} L={levels} m={m} t={t} seed={seed}")


@pytest.mark.parametrize("with_outliers", [False, True])
def test_pre_rope_codebook_keys(reader, with_outliers):
    b, h, d, t, m, levels = 1, 2, 64, 177, 3, 8
    g, q, p = inputs(11, b, h, m, t, d)
    codes = random_codes(g, levels, b, h, t, d)
    kw = {"scale": torch.rand(1, h, 1, d, generator=g) + 0.5, "zero": torch.randn(1, h, 1, d, generator=g)}
    if with_outliers:
        kw["outliers"] = outliers(g, b, h, t, d, 30)
    inner = CodebookSource(codes, levels, d, torch.randn(levels, generator=g).sort().values, **kw)
    first = 9
    table = cos_sin(torch.arange(first + t + 4), d, 10000.0)
    part = RoPESource(inner, None, first_position=first, table=table)
    close(reader.scores(part, q), part.scores(q, 0, t), f"pre-RoPE keys outliers={with_outliers} seed=11")
    assert reader.mix(part, p) is None  # pre-RoPE values do not exist; the reference would answer


def test_single_call_attention_equals_the_blockwise_reference(reader):
    """Whole decode attention over a sink | body | window cache, masks and positions included."""
    from kvbench.cache.blockwise import blockwise_attention

    g = torch.Generator().manual_seed(5)
    b, h, d, n_rep, levels, group = 1, 3, 64, 3, 4, 32
    body = 10 * group
    sink = FullPrecisionSource(torch.randn(b, h, 4, d, generator=g).half())
    kq = PerChannelAffineSource(
        random_codes(g, levels, b, h, body, d),
        torch.rand(b, h, body // group, d, generator=g).half() + 0.1,
        torch.randn(b, h, body // group, d, generator=g).half(),
        levels,
        group,
        d,
    )
    vq = PerTokenAffineSource(
        random_codes(g, levels, b, h, body, d),
        torch.rand(b, h, body, d // group, generator=g).half() + 0.1,
        torch.randn(b, h, body, d // group, generator=g).half(),
        levels,
        group,
        d,
    )
    window_k = FullPrecisionSource(torch.randn(b, h, 37, d, generator=g).half())
    window_v = FullPrecisionSource(torch.randn(b, h, 37, d, generator=g).half())
    keys, values = ConcatSource([sink, kq, window_k]), ConcatSource([sink, vq, window_v])
    t = keys.num_tokens
    for q_len in (1, 2):
        query = torch.randn(b, h * n_rep, q_len, d, generator=g)
        ek, ev = torch.randn(2, b, h, q_len, d, generator=g).unbind(0)
        mask = torch.ones(b, 1, q_len, t + q_len, dtype=torch.bool).tril(t)
        mask[..., 7] = False
        positions = torch.arange(t).flip(0).expand(b, h, t).clone()
        positions[:, 1, 3] = -1
        for kw in ({}, {"attention_mask": mask}, {"positions": positions, "attention_mask": mask}):
            want = blockwise_attention(query, keys, values, 0.125, 100, ek, ev, **kw)
            for r in (None, reader):
                got = single_call_attention(query, keys, values, 0.125, ek, ev, reader=r, **kw)
                where = f"q={q_len} {sorted(kw)} reader={type(r).__name__} seed=5"
                close(got, want, where)


def test_a_decode_step_is_a_fixed_number_of_part_calls(reader, monkeypatch):
    """The calls per step do not grow with the context: one scores and one mix per stored part,
    whether the body holds 320 tokens or 8,000, and the block loop never runs."""
    import kvbench.cache.blockwise as blockwise

    monkeypatch.setattr(blockwise, "block_ranges", lambda *a, **k: pytest.fail("the block loop ran"))
    counts = []
    for body in (320, 8000):
        g = torch.Generator().manual_seed(body)
        d, levels = 64, 4
        kq = PerChannelAffineSource(
            random_codes(g, levels, 1, 3, body, d),
            torch.rand(1, 3, body // 32, d, generator=g).half(),
            torch.randn(1, 3, body // 32, d, generator=g).half(),
            levels,
            32,
            d,
        )
        window = FullPrecisionSource(torch.randn(1, 3, 100, d, generator=g).half())
        vq = FullPrecisionSource(torch.randn(1, 3, body, d, generator=g).half())
        calls: list[str] = []

        class Counting:
            def __init__(self, seen):
                self.seen = seen

            def scores(self, part, query):
                self.seen.append("scores")
                return reader.scores(part, query)

            def mix(self, part, weights):
                self.seen.append("mix")
                return reader.mix(part, weights)

        query = torch.randn(1, 9, 1, d, generator=g)
        blockwise.blockwise_attention_forward(
            None, query, ConcatSource([kq, window]), ConcatSource([vq, window]), scaling=0.125,
            exact_keys=torch.randn(1, 3, 1, d), exact_values=torch.randn(1, 3, 1, d), reader=Counting(calls),
        )  # fmt: skip
        counts.append(len(calls))
    assert counts == [4, 4]


def test_a_failed_build_warns_once_and_the_reference_runs(monkeypatch, capsys):
    def broken():
        raise RuntimeError("Error building extension 'kvbench_cpu_attention'\ng++: not found")

    saved = dict(cpu._state)
    monkeypatch.setattr(cpu, "_build", broken)
    cpu.reset_for_tests()
    try:
        assert read_kernels("auto", "cpu") is None
        assert read_kernels("auto", "cpu") is None  # no second attempt, no second warning
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(lines) == 1, lines
        assert lines[0].startswith("kvbench: warning: the compiled CPU kernels are unavailable")
        assert "Traceback" not in lines[0] and "torch reference" in lines[0]
        assert cpu.backend_in_use() == "torch"
    finally:
        cpu._state.update(saved)


def test_auto_hashes_as_torch():
    """The stored bytes do not depend on who reads them, so runs made before ``auto`` keep their id;
    triton stays a separate run."""
    from kvbench.results import run_id

    base = {"task": {"name": "niah"}, "bits": 2, "seed": 0}
    ids = {
        backend: run_id({**base, "method": {"name": "kivi", "bits": 2, "backend": backend}})
        for backend in ("auto", "torch", "triton")
    }
    assert ids["auto"] == ids["torch"] != ids["triton"]


@pytest.mark.parametrize("arithmetic", ["fp32", "kivi"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_token_append_is_bit_identical_to_the_reference(reader, arithmetic, dtype):
    """The compiled append (quantize + pack of new tokens, per-token groups) stores exactly the
    reference's bytes, at every level count and group size, with constant groups and values on the
    rounding boundaries among the inputs."""
    from kvbench.quant.affine import quantize_grouped

    k = reader.k
    for seed, levels in enumerate([2, 3, 4, 5, 7, 8, 16, 17, 64, 256]):
        for group in (8, 32, 64):
            g = torch.Generator().manual_seed(seed * 100 + group)
            x = (torch.randn(2, 3, 9, 64, generator=g) * 3).to(dtype)
            x[0, 0, 0, :group] = 1.25  # a constant group: scale 0, codes 0
            x[1, 2, 3] = torch.arange(64, dtype=dtype) % (levels + 1)  # codes on exact grid points and halves
            zero_points = ["minmax", "specache"] if levels == 2 and arithmetic == "fp32" else ["minmax"]
            for zp in zero_points:
                where = f"L={levels} G={group} {arithmetic} {dtype} {zp} seed={seed}"
                codes, scale, zero = quantize_grouped(
                    x, levels, "token", group, zp, torch.float16, arithmetic
                )
                c, m = chunk_layout(levels)
                got = k.token_quantize_pack(
                    x, levels, group, int(arithmetic == "kivi"), int(zp == "specache"), torch.float16, c, m
                )
                assert torch.equal(got[0], pack(codes, levels)), f"{where}: codes differ"
                assert got[1].dtype == scale.dtype and torch.equal(got[1], scale), f"{where}: scales differ"
                assert got[2].dtype == zero.dtype and torch.equal(got[2], zero), f"{where}: zeros differ"


def test_a_killed_builds_lock_is_cleared_and_a_live_one_kept(tmp_path, capsys):
    """torch's extension loader waits for ever on a lock file a killed build left behind."""
    import os
    import time

    lock = tmp_path / "lock"
    lock.write_text("")
    cpu._clear_stale_lock(tmp_path)
    assert lock.exists(), "a fresh lock belongs to a build in progress"
    old = time.time() - cpu.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    cpu._clear_stale_lock(tmp_path)
    assert not lock.exists()
    assert "stale kernel build lock" in capsys.readouterr().err


# the vector digit decoder (non-power-of-two levels, chunks of 1-3 bytes): head_dims that leave a
# partial chunk and a partial block of 8 chunks, and code tensors that end exactly at the last row
# (the decoder's reads past a row must stay inside the storage)
@pytest.mark.parametrize("levels", [3, 5, 6, 7, 9, 10, 11, 12, 13, 15])
@pytest.mark.parametrize("d", [20, 40, 96])
@pytest.mark.parametrize("grown", [False, True])
def test_digit_decoded_codes_at_any_head_dim(reader, levels, d, grown):
    view = grown_view if grown else (lambda x: x.contiguous())
    for seed, (m, t) in enumerate([(3, 37), (1, 1), (6, 260)]):
        g, q, p = inputs(100 + seed, 1, 2, m, t, d)
        codes = view(random_codes(g, levels, 1, 2, t, d))
        scale = view((torch.rand(1, 2, t, 1, generator=g) + 0.1).half())
        zero = view(torch.randn(1, 2, t, 1, generator=g).half())
        where = f"digits L={levels} d={d} m={m} t={t} grown={grown} seed={100 + seed}"
        both(reader, PerTokenAffineSource(codes, scale, zero, levels, d, d), q, p, f"{where} affine")
        codebook = torch.randn(levels, generator=g).sort().values
        part = CodebookSource(codes, levels, d, codebook, scale=scale, zero=zero)
        both(reader, part, q, p, f"{where} codebook")
