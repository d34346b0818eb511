"""TritonReader (kvbench/kernels/triton_parts.py) against the torch reference of every part it reads,
and every method that allows ``backend=triton`` against its ``backend=torch`` decode step.

The reference of a part is the source's own ``scores(q, 0, T)`` / ``mix(p, 0, T)``. Cases run under
Triton's CPU interpreter (this folder's conftest): few heads, one program per head, token counts
that are not a multiple of the blocks, so the masked tails are read.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from kvbench.cache.affine_source import PerChannelAffineSource, PerTokenAffineSource
from kvbench.cache.codebook_source import CodebookSource
from kvbench.cache.dense_sparse import DenseSparseTokens
from kvbench.cache.fp import FullPrecisionSource
from kvbench.cache.rotated import ChannelSplitCodes, HeadRotations, RotatedCodes
from kvbench.cache.source import RoPESource
from kvbench.errors import ConfigError
from kvbench.kernels import cpu, triton_parts
from kvbench.kernels.counting import count_ops
from kvbench.kernels.cpu.parts import read_kernels
from kvbench.kernels.runtime import GPU_UNCHECKED_LEVELS, cuda_launch_plan
from kvbench.kernels.triton_parts import TritonReader, covers
from kvbench.methods import build_method
from kvbench.quant.affine import quantize_grouped
from kvbench.quant.packing import pack
from kvbench.quant.rope import cos_sin

B, H = 2, 2
READER = TritonReader()
# The part-level tests run on CUDA where there is one (scripts/gpu_check.sh runs this file there);
# the method-level ones build their model on the CPU and are the interpreter's.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
interpreter_only = pytest.mark.skipif(
    torch.cuda.is_available(),
    reason="CPU model under the interpreter; gpu_check.py's decode runs methods on CUDA",
)


def on_device(x):
    """``x`` (a source, a tensor, or a tuple/list of them) with every tensor it holds on
    :data:`DEVICE`; the CPU original is left as it is, so the reference reads the same values."""
    if DEVICE.type == "cpu":
        return x
    if isinstance(x, torch.Tensor):
        return x.to(DEVICE)
    if isinstance(x, (tuple, list)):
        return type(x)(on_device(v) for v in x)
    if hasattr(x, "__dict__") and not isinstance(x, type):
        moved = copy.copy(x)
        for name, value in vars(x).items():
            if isinstance(value, (torch.Tensor, tuple, list)) or type(value).__module__.startswith(
                "kvbench."
            ):
                setattr(moved, name, on_device(value))
        return moved
    return x


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_matches(part, d: int, rows: int, seed: int = 0, mix: bool = True) -> None:
    """Scores (and mix) of ``part`` for ``rows`` query rows against the part's own torch
    reference, within 1e-4 of the reference's largest magnitude."""
    g = gen(seed)
    t = part.num_tokens
    query = torch.randn(B, H, rows, d, generator=g)
    weights = torch.rand(B, H, rows, t, generator=g)
    dev = on_device(part)
    pairs = [(READER.scores(dev, query.to(DEVICE)).cpu(), part.scores(query, 0, t))]
    if mix:
        pairs.append((READER.mix(dev, weights.to(DEVICE)).cpu(), part.mix(weights, 0, t)))
    for got, want in pairs:
        assert got.dtype == torch.float32 and got.shape == want.shape
        scale = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale)


def keys_like(t: int, d: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Keys with a few channels of large magnitude, as real keys have."""
    g = gen(seed)
    return (torch.randn(B, H, t, d, generator=g) * (0.5 + 4 * torch.rand(d, generator=g))).to(dtype)


# -- full-precision rows --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, d, rows",
    [(torch.float16, 64, 4), (torch.bfloat16, 128, 6), (torch.float32, 64, 1)],
)
def test_full_precision_rows(dtype, d, rows):
    assert_matches(FullPrecisionSource(keys_like(203, d, 1, dtype)), d, rows)


# -- affine codes: every packing, several groups --------------------------------------------------

AFFINE = [  # levels, group, head_dim, query rows: base-L words and bit streams of every width
    (2, 32, 64, 4),
    (3, 16, 128, 6),
    (4, 64, 64, 1),
    (5, 32, 128, 4),
    (6, 8, 64, 6),
    (8, 32, 128, 1),
    (16, 16, 64, 4),
]


@pytest.mark.parametrize("levels, group, d, rows", AFFINE)
def test_per_token_affine(levels, group, d, rows):
    x = keys_like(197, d, levels)
    param = torch.bfloat16 if levels == 5 else torch.float16  # bf16 parameters move as bits
    codes, scale, zero = quantize_grouped(x, levels, "token", group, param_dtype=param)
    assert_matches(PerTokenAffineSource(pack(codes, levels), scale, zero, levels, group, d), d, rows)


@pytest.mark.parametrize("levels, group, d, rows", AFFINE)
def test_per_channel_affine(levels, group, d, rows):
    x = keys_like(group * (200 // group), d, 10 + levels)  # a whole number of token groups
    codes, scale, zero = quantize_grouped(x, levels, "channel", group)
    assert_matches(PerChannelAffineSource(pack(codes, levels), scale, zero, levels, group, d), d, rows)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "group, rows, sum_tile", [(32, 1, 4096), (32, 1, 8192), (64, 1, 8192), (32, 4, 32768)]
)
def test_three_bit_per_channel_on_cuda(monkeypatch, group, rows, sum_tile):
    # Token blocks of 32 and 64 over 3-bit per-channel codes at head_dim 128: the shapes that read
    # wrong on the H200 before the second byte's load took an address per lane (kvbench.kernels.runtime).
    monkeypatch.setattr(triton_parts, "GPU_SUM_TILE", sum_tile)
    x = keys_like(group * (200 // group), 128, 18)
    codes, scale, zero = quantize_grouped(x, 8, "channel", group)
    assert_matches(PerChannelAffineSource(pack(codes, 8), scale, zero, 8, group, 128), 128, rows)


@pytest.mark.parametrize("levels", sorted(GPU_UNCHECKED_LEVELS))
def test_cuda_plan_refuses_unchecked_bit_widths(levels):
    x = keys_like(64, 64, levels)
    codes, scale, zero = quantize_grouped(x, levels, "channel", 32)
    part = PerChannelAffineSource(pack(codes, levels), scale, zero, levels, 32, 64)
    query = torch.randn(B, H, 1, 64)
    with cuda_launch_plan():
        with pytest.raises(NotImplementedError, match=f"PerChannelAffineSource.*levels={levels}"):
            TritonReader(strict=True).scores(part, query)
        assert TritonReader(strict=False).scores(part, query) is None  # backend=auto: torch reads it


# -- codebook codes -------------------------------------------------------------------------------


def codebook_part(levels, d, t, layout, seed, rotation=False) -> CodebookSource:
    g = gen(seed)
    codes = pack(torch.randint(0, levels, (B, H, t, d), generator=g, dtype=torch.uint8), levels)
    table = torch.sort(torch.randn(levels, generator=g)).values
    shapes = {
        "none": (None, None),
        "per_token": ((B, H, t, 1), (B, H, t, 1)),
        "fixed_row": ((1, H, 1, d), (1, H, 1, d)),
        "per_element": ((B, H, t, d), (1, H, 1, d)),  # scale per token and channel, zero fixed
    }[layout]
    scale, zero = (None if s is None else torch.rand(s, generator=g).half() + 0.5 for s in shapes)
    rot = torch.linalg.qr(torch.randn(H, d, d, generator=g))[0] if rotation else None
    return CodebookSource(codes, levels, d, table, scale, zero, rotation=rot)


@pytest.mark.parametrize(
    "levels, layout, rotation, d, rows",
    [
        (2, "none", False, 64, 4),
        (3, "per_token", True, 128, 6),
        (5, "fixed_row", False, 64, 1),
        (8, "per_element", False, 128, 4),
        (16, "per_token", True, 64, 4),
    ],
)
def test_codebook(levels, layout, rotation, d, rows):
    assert_matches(codebook_part(levels, d, 211, layout, levels, rotation), d, rows)


def dense_sparse(levels, d, t, fixed: bool, seed: int) -> DenseSparseTokens:
    """KVQuant's store filled with keys (fixed per-channel ranges: threshold outliers) or values
    (per-token ranges: the top-k outliers of each vector)."""
    x = keys_like(t, d, seed)
    codebook = torch.linspace(-1, 1, levels)
    rng = None
    if fixed:
        lo, hi = x.amin(dim=(0, 2)) * 0.8, x.amax(dim=(0, 2)) * 0.8  # some elements fall outside
        rng = ((hi - lo).half() / 2, ((hi + lo) / 2).half())
    store = DenseSparseTokens(levels, codebook, 0.02, rng, backend="torch")
    store.append(x)
    return store


@pytest.mark.parametrize("levels, fixed, d, rows", [(3, True, 64, 4), (4, False, 128, 6), (6, True, 128, 1)])
def test_codebook_with_sparse_outliers(levels, fixed, d, rows):
    store = dense_sparse(levels, d, 150, fixed, seed=levels)
    part = store.source()
    assert part.outliers is not None and part.outliers[0].numel() > 0
    assert_matches(part, d, rows)


@pytest.mark.parametrize("levels, d, rows", [(3, 64, 4), (4, 128, 6), (6, 64, 1)])
def test_pre_rope_keys_rotated_in_the_kernel(levels, d, rows):
    first = 5  # the keys stored behind a sink start past position 0
    store = dense_sparse(levels, d, 173, fixed=True, seed=20 + levels)
    table = cos_sin(torch.arange(first + 173 + 40), d, 10000.0)
    part = RoPESource(store.source(), None, first_position=first, table=table)
    assert part.inner.outliers is not None  # the RoPE of the outlier corrections too
    assert_matches(part, d, rows, mix=False)  # keys: scores only
    # the kernel's mix rotates too (no store holds pre-RoPE values, but nothing forbids them)
    plain = RoPESource(codebook_part(levels, d, 99, "fixed_row", levels), None, first, table)
    assert_matches(plain, d, rows)


def test_channel_split_turboquant_outliers():
    d = 128
    split = ChannelSplitCodes(3, 6, 24, HeadRotations(0, 0, "regular"), HeadRotations(0, 0, "outlier"))
    split.append(keys_like(181, d, 7))
    part = split.source()
    assert covers(part)
    assert_matches(part, d, 4)


def test_rotated_codes_of_turboquant():
    d = 64
    store = RotatedCodes(5, HeadRotations(3, 1))
    store.append(keys_like(190, d, 8))
    assert_matches(store.source(), d, 6)


# -- what the reader refuses ----------------------------------------------------------------------


@interpreter_only
def test_strict_reader_refuses_an_uncovered_part_and_auto_falls_back():
    part = codebook_part(4, 64, 40, "per_token", 0, rotation=True)
    one = torch.ones(1)
    part.outliers = (one.to(torch.int32), one.to(torch.int16), one.half())
    assert not covers(part)
    query = torch.randn(B, H, 4, 64)
    with pytest.raises(NotImplementedError, match="refused on triton"):
        read_kernels("triton", "cpu").scores(part, query)
    assert TritonReader(strict=False).scores(part, query) is None  # its torch reference runs


@interpreter_only
def test_read_kernels_picks_triton_for_the_triton_backend():
    cpu.reset_for_tests()
    reader = read_kernels("triton", "cpu")
    assert isinstance(reader, TritonReader) and reader.strict
    assert read_kernels("torch", "cpu") is None
    reader.mix(FullPrecisionSource(torch.randn(B, H, 9, 64)), torch.rand(B, H, 1, 9))
    assert "triton" in cpu.backend_in_use()


# -- methods: triton against torch on a tiny Llama ------------------------------------------------

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "count_ops.py"
CONTEXTS = (320, 1088)  # the contexts of test_op_counts.py: no buffer doubles, no group flushes
# Every method that allows triton, as count_ops configures it; OTT without skipped layers, so the
# tiny model's two layers both hold outlier pools; TurboQuant with and without its channel split.
TRITON_METHODS = {
    "fp16": {},
    "uniform": {"key_axis": "channel"},
    "kivi": {},
    "ott": {"skip_layers": 0},
    "turboquant": {},
    "turboquant-split": {"name": "turboquant", "outlier_channels": 16},
    "kvquant": {},
    "specache": {},  # its substitution path and top-k observer over the part reader
    "intactkv": {"tokens": 4},
    "semkv": {"chunk": 16},  # key_norm: scored at append, read through the parts
    "semkv-turboquant": {"name": "semkv", "base": "turboquant", "chunk": 16},
}
# What the torch reference is told so that it stores what the triton backend stores: KVQuant's
# outlier_layout auto holds key outliers in the fixed layout on triton, ragged with torch on the CPU.
TORCH_SAME_BYTES = {"kvquant": {"outlier_layout": "fixed"}}


@functools.cache
def script():
    spec = importlib.util.spec_from_file_location("count_ops_for_triton", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def tiny_model():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return script().build_model(script().TINY)


@functools.cache
def prompt(context: int):
    return script().random_prompt(tiny_model(), context, 2)


def node_of(case: str) -> dict:
    extra = dict(TRITON_METHODS[case])
    name = extra.pop("name", case)
    return {**script().method_node(name), **extra}


@functools.cache
def decode_step(case: str, backend: str, context: int):
    """Logits ``[1, 1, vocab]`` and op counts of the second decode step after a ``context``-token
    fill, the backends that read the cache during that step, and the cache. ``torch`` is told
    :data:`TORCH_SAME_BYTES`, so that it stores what ``triton`` stores."""
    s = script()
    same_bytes = TORCH_SAME_BYTES.get(case, {}) if backend == "torch" else {}
    method = build_method({**node_of(case), "backend": backend, **same_bytes})
    runner = tiny_model().runner(method)
    cache = runner.new_cache()
    p = prompt(context)
    s.fill(runner, cache, p)
    warm, counted = p.tokens
    runner.decode_step(torch.tensor([[warm]]), cache)
    cpu.reset_for_tests()
    with count_ops(sites=True) as counts:
        logits = runner.decode_step(torch.tensor([[counted]]), cache)
    return logits, counts, cpu.backend_in_use(), cache


@interpreter_only
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("case", list(TRITON_METHODS))
def test_triton_decode_step_matches_torch(case, context):
    want = decode_step(case, "torch", context)[0]
    got, counts, used, _ = decode_step(case, "triton", context)
    assert used == "triton"  # every part read by Triton, none by the torch reference
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
    assert counts.total_ops > 100


@interpreter_only
@pytest.mark.parametrize("case", list(TRITON_METHODS))
def test_triton_decode_step_is_fixed_and_never_waits(case):
    short, long = (decode_step(case, "triton", n)[1] for n in CONTEXTS)
    assert short.total_ops == long.total_ops, (short.ops, long.ops)
    assert short.total_syncs == long.total_syncs == 0, long.describe_syncs()


@interpreter_only
def test_kvquant_on_triton_holds_its_key_outliers_in_the_fixed_layout():
    """``auto`` resolves to the fixed layout on triton: the layout the torch reference above is told,
    whose appends the test above finds free of syncs."""
    cache = decode_step("kvquant", "triton", CONTEXTS[0])[3]
    stores = [layer.inner.kq for layer in cache.layers]
    assert [s.outlier_layout for s in stores] == ["fixed", "fixed"]
    assert all(s.overflow() is not None for s in stores)


@interpreter_only
def test_ott_on_triton_reads_its_outlier_pools():
    """OTT used to inherit KIVI's fused kernel, which reads no pool (its attention then differed
    from torch's). Its layers now never take that kernel, and with full pools in every layer the
    Triton step equals the torch one (test_triton_decode_step_matches_torch)."""
    logits, _, used, cache = decode_step("ott", "triton", CONTEXTS[0])
    assert used == "triton"
    for layer in cache.layers:
        assert not layer.fused_decode and layer.backend == "triton"
        assert layer.pool is not None and bool((layer.pool.pos >= 0).all())
    want = decode_step("ott", "torch", CONTEXTS[0])[0]
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize(
    "node",
    [
        {"name": "semkv", "metric": "attn_sum"},  # scores a reconstructed cache
        {"name": "h2o"},  # eviction: its own attention
    ],
)
def test_methods_without_triton_coverage_are_refused_in_one_line(node):
    with pytest.raises(ConfigError) as info:
        build_method({**node, "backend": "triton"}, 2.39 if node["name"] == "semkv" else 2)
    message = str(info.value)
    assert info.value.key == "method.backend" and "triton" in message and "\n" not in message


@interpreter_only
def test_an_empty_part_reads_as_nothing():
    part = FullPrecisionSource(torch.randn(B, H, 0, 64))
    assert READER.scores(part, torch.randn(B, H, 4, 64)).shape == (B, H, 4, 0)
    assert torch.equal(READER.mix(part, torch.rand(B, H, 4, 0)), torch.zeros(B, H, 4, 64))


@pytest.mark.parametrize("rows", [16, 80])
def test_many_query_rows_take_tl_dot_in_row_tiles(rows):
    """A prefill chunk's rows (16 and more) take tl.dot, 80 rows in two tiles of 64."""
    x = keys_like(150, 64, 3)
    codes, scale, zero = quantize_grouped(x, 3, "token", 32)
    assert_matches(PerTokenAffineSource(pack(codes, 3), scale, zero, 3, 32, 64), 64, rows)
    store = dense_sparse(5, 128, 90, fixed=False, seed=4)
    assert_matches(store.source(), 128, rows)


def test_several_blocks_and_token_slices(monkeypatch):
    """The GPU's geometry: blocks of 16 tokens walked in a loop, three slices per head reduced by the
    split-K sum (the interpreter otherwise takes one block and one slice)."""
    from kvbench.kernels import triton_parts

    monkeypatch.setattr(triton_parts, "INTERPRETER_BLOCK_N", 16)
    monkeypatch.setattr(triton_parts, "INTERPRETER_SPLITS", 3)
    x = keys_like(101, 64, 5)
    codes, scale, zero = quantize_grouped(x, 5, "token", 16)
    assert_matches(PerTokenAffineSource(pack(codes, 5), scale, zero, 5, 16, 64), 64, 4)
    assert_matches(FullPrecisionSource(x.half()), 64, 6)


@interpreter_only
def test_a_triton_launch_counts_as_one_operation_by_its_kernel_name():
    """count_ops sees no dispatcher call for a launch: each is counted as ``triton::KERNEL``, once
    per launch, and what the interpreter does inside it is not counted (nor taken for a sync)."""
    part = FullPrecisionSource(torch.randn(1, 2, 100, 64))
    query, weights = torch.randn(1, 2, 4, 64), torch.rand(1, 2, 4, 100)
    READER.scores(part, query)  # the first call rewrites the kernel: outside the count
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    entries = (InterpretedFunction.run, JITFunction.run)
    with count_ops() as counts:
        READER.scores(part, query)
        READER.mix(part, weights)
        READER.mix(part, weights)
    launches = {name: n for name, n in counts.ops.items() if name.startswith("triton::")}
    assert sum(launches.values()) == 3 and len(launches) == 1, counts.ops
    assert counts.total_syncs == 0
    assert (InterpretedFunction.run, JITFunction.run) == entries  # the launch entries restored
