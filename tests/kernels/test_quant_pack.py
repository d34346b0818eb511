"""Bitwise parity of the fused quantize+pack / unpack+dequantize kernels with the torch reference.

The reference is ``pack(quantize_grouped(...))`` and ``dequantize_grouped(unpack(...))``; every
assertion is ``torch.equal``. Without CUDA the kernels run under Triton's CPU interpreter
(tests/kernels/conftest.py sets TRITON_INTERPRET=1), so shapes are small and ragged. Inputs are fresh
random draws each run, with per-channel scales and per-token offsets so that groups differ; the seed
is in every failure message so a failure can be replayed.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvbench.errors import ConfigError
from kvbench.kernels.quant_pack import quantize_pack, unpack_dequantize
from kvbench.kernels.runtime import interpreting, require_triton, triton_available
from kvbench.quant.affine import dequantize_grouped, quantize_grouped
from kvbench.quant.packing import pack, packed_length, unpack

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LEAD = (2, 3)  # [B, H_kv]

needs_triton = pytest.mark.skipif(
    not triton_available(), reason="needs CUDA or TRITON_INTERPRET=1 (set by tests/kernels/conftest.py)"
)


@pytest.fixture
def gen() -> torch.Generator:
    """A generator with a fresh seed each run; ``initial_seed()`` names it in failure messages."""
    return torch.Generator(device=DEVICE).manual_seed(int.from_bytes(os.urandom(4), "little"))


def make_input(
    g: torch.Generator, lead: tuple[int, ...], t: int, d: int, dtype: torch.dtype, contiguous: bool = True
) -> torch.Tensor:
    """Random ``[*lead, t, d]`` in ``dtype``: standard normal times a per-channel scale (log-normal,
    as K channels are) plus a per-token offset, so no two groups share their range.

    ``contiguous=False`` draws ``[..., t, H, d]`` and transposes it to ``[..., H, t, d]``, the
    strided view a model's ``[B, T, H, D]`` projection gives.
    """
    if contiguous or not lead:
        base = torch.randn(*lead, t, d, generator=g, device=DEVICE)
    else:
        base = torch.randn(*lead[:-1], t, lead[-1], d, generator=g, device=DEVICE).transpose(-3, -2)
        assert not base.is_contiguous()
    channel_scale = torch.randn(d, generator=g, device=DEVICE).exp()
    token_offset = torch.randn(t, 1, generator=g, device=DEVICE)
    return (base * channel_scale + token_offset).to(dtype)


def assert_parity(
    x: torch.Tensor,
    levels: int,
    axis: str,
    group_size: int | None,
    note: str,
    zero_point: str = "minmax",
    param_dtype: torch.dtype = torch.float16,
) -> None:
    """Kernel outputs equal the reference's: packed bytes, scale, zero, and the reconstruction."""
    packed, scale, zero = quantize_pack(x, levels, axis, group_size, zero_point, param_dtype)
    codes, ref_scale, ref_zero = quantize_grouped(x, levels, axis, group_size, zero_point, param_dtype)
    ref_packed = pack(codes, levels)
    assert packed.dtype == torch.uint8 and packed.shape == ref_packed.shape, note
    assert torch.equal(packed, ref_packed), note
    assert scale.dtype == ref_scale.dtype == zero.dtype == param_dtype, note
    assert torch.equal(scale, ref_scale), note
    assert torch.equal(zero, ref_zero), note

    d = x.shape[-1]
    out = unpack_dequantize(packed, scale, zero, levels, axis, group_size, d)
    ref = dequantize_grouped(unpack(ref_packed, levels, d), ref_scale, ref_zero, axis, group_size)
    assert out.dtype == torch.float32 and out.shape == x.shape, note
    assert torch.equal(out, ref), note


# (axis, group_size, D, T, input dtype, contiguous): T is ragged (not a power of two); on the channel
# axis it is a multiple of G.
CASES = [
    ("token", 32, 128, 37, torch.float32, False),
    ("token", 64, 64, 45, torch.float16, True),
    ("token", None, 128, 29, torch.bfloat16, True),
    ("channel", 32, 64, 96, torch.float32, True),
    ("channel", 64, 128, 192, torch.bfloat16, False),
    ("channel", None, 64, 50, torch.float16, False),
]


def _case_id(case) -> str:
    axis, g, d, t, dtype, contiguous = case
    return f"{axis}-G{g}-D{d}-T{t}-{str(dtype).removeprefix('torch.')}{'' if contiguous else '-strided'}"


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.parametrize("levels", [*range(2, 17)])
def test_parity(gen, levels, case):
    axis, g, d, t, dtype, contiguous = case
    x = make_input(gen, LEAD, t, d, dtype, contiguous)
    assert_parity(x, levels, axis, g, f"seed={gen.initial_seed()}")


@needs_triton
@pytest.mark.parametrize(
    ("axis", "group_size", "d", "t", "dtype"),
    [("token", 32, 128, 21, torch.float16), ("channel", 64, 64, 128, torch.bfloat16)],
)
@pytest.mark.parametrize("levels", [17, 24, 32, 40, 64, 84, 255, 256])
def test_parity_wide_levels(gen, levels, axis, group_size, d, t, dtype):
    # Multi-byte chunks (L = 32: 8 codes in 5 bytes, 64: 4 in 3; base-L words: 17: 7 codes in 4
    # bytes, 24: 5 in 3, 40: 3 in 2, 84: 5 in 4) and one code per byte (255, 256).
    x = make_input(gen, LEAD, t, d, dtype)
    assert_parity(x, levels, axis, group_size, f"seed={gen.initial_seed()}")


@needs_triton
@pytest.mark.parametrize(("axis", "t"), [("token", 23), ("channel", 96)])
def test_parity_specache(gen, axis, t):
    x = make_input(gen, LEAD, t, 64, torch.float32)
    assert_parity(x, 2, axis, 32, f"seed={gen.initial_seed()}", zero_point="specache")


@needs_triton
@pytest.mark.parametrize("levels", [3, 8])
@pytest.mark.parametrize("axis", ["token", "channel"])
def test_constant_groups(gen, axis, levels):
    """Groups with max == min get s = 0 and code 0, and reconstruct to their value exactly."""
    x = make_input(gen, LEAD, 64, 64, torch.float16)
    if axis == "token":
        x[..., 5, 32:] = 1.75  # second channel group of token 5
        x[..., 9, :32] = 0.0
        flat = (slice(None), slice(None), 5, 1)
    else:
        x[..., 32:, 7] = -0.375  # second token group of channel 7
        x[..., :32, 11] = 0.0
        flat = (slice(None), slice(None), 1, 7)
    note = f"seed={gen.initial_seed()}"
    assert_parity(x, levels, axis, 32, note)
    _, scale, _ = quantize_pack(x, levels, axis, 32)
    assert bool((scale[flat] == 0).all()), note


@needs_triton
@pytest.mark.parametrize("param_dtype", [torch.bfloat16, torch.float32])
def test_param_dtypes(gen, param_dtype):
    x = make_input(gen, LEAD, 33, 64, torch.float32)
    note = f"seed={gen.initial_seed()}"
    assert_parity(x, 5, "token", 32, note, param_dtype=param_dtype)
    assert_parity(x[..., :32, :], 4, "channel", 32, note, param_dtype=param_dtype)


@needs_triton
@pytest.mark.parametrize("lead", [(), (3,), (2, 2, 2)], ids=str)
def test_leading_dims(gen, lead):
    x = make_input(gen, lead, 32, 64, torch.float16)
    note = f"seed={gen.initial_seed()}"
    assert_parity(x, 6, "token", 32, note)
    assert_parity(x, 6, "channel", 16, note)


@needs_triton
def test_empty_and_shapes():
    x = torch.zeros(*LEAD, 0, 64, device=DEVICE)
    packed, scale, zero = quantize_pack(x, 3, "token", 32)
    assert packed.shape == (*LEAD, 0, packed_length(64, 3)) and scale.shape == zero.shape == (*LEAD, 0, 2)
    assert unpack_dequantize(packed, scale, zero, 3, "token", 32, 64).shape == x.shape


@needs_triton
def test_rejects_bad_arguments():
    x = torch.randn(*LEAD, 40, 64, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of group_size"):
        quantize_pack(x, 4, "channel", 32)
    with pytest.raises(ConfigError, match="specache"):
        quantize_pack(x, 4, "token", 32, zero_point="specache")
    with pytest.raises(ValueError, match="levels"):
        quantize_pack(x, 257, "token", 32)
    packed, scale, zero = quantize_pack(x, 4, "token", 32)
    with pytest.raises(ValueError, match="bytes"):
        unpack_dequantize(packed, scale, zero, 4, "token", 32, 60)
    with pytest.raises(ValueError, match="scale/zero shapes"):
        unpack_dequantize(packed, scale[..., :1], zero[..., :1], 4, "token", 32, 64)


def test_require_triton_names_key(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not triton_available()
    with pytest.raises(ConfigError, match="k_backend.*TRITON_INTERPRET=1"):
        require_triton("k_backend")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available()
    require_triton("k_backend")


@pytest.mark.cuda
@pytest.mark.skipif(
    not torch.cuda.is_available() or interpreting(), reason="needs CUDA (not the interpreter)"
)
@pytest.mark.parametrize(("axis", "group_size"), [("token", 32), ("channel", 64), ("channel", None)])
@pytest.mark.parametrize("levels", [2, 3, 4, 5, 8, 16, 32, 64, 128, 256])
def test_full_size_on_cuda(gen, levels, axis, group_size):
    x = make_input(gen, (4, 8), 4096, 128, torch.float16, contiguous=False)
    assert_parity(x, levels, axis, group_size, f"seed={gen.initial_seed()}")
