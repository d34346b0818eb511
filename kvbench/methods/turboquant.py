"""``turboquant``: TurboQuant-MSE (Zandieh et al., "TurboQuant: Online Vector Quantization with
Near-optimal Distortion Rate", 2025), the distortion-optimized base quantizer SemKV (arXiv
2608.28911, Sec. 4.9) swaps in for the affine one.

Every key and every value head vector x in R^d (d = head_dim) is quantized on its own:

    u = x / ||x||,   y = Pi u,   q_j = argmin_i |y_j - c_i|   (j = 1..d)
    x_hat = ||x|| * Pi^T c[q]

- ``Pi``: a random orthogonal d x d matrix (QR of a seeded Gaussian matrix, signs fixed), one per
  (layer, kv head), shared by keys and values and by all tokens
  (:func:`kvbench.quant.lloyd_max.random_rotation`).
- ``c``: the L-level Lloyd-Max codebook that is MSE-optimal for one coordinate of a uniformly random
  unit vector, density f(t) ∝ (1 - t^2)^((d-3)/2) on [-1, 1]
  (:func:`kvbench.quant.lloyd_max.lloyd_max_codebook`); bits = log2 L, so fractional widths name
  L = 3, 5, 6, ... levels. The paper's bound is D_mse = E||u - u_hat||^2 <= (sqrt(3) pi / 2) 4^-b.
- ``||x||`` is stored in fp16 (clamped to fp16's largest finite value); a zero vector is
  reconstructed as zero. Note that Pi^T c[q] is not a unit vector (its squared norm is about
  1 - D_mse), so x_hat is shorter than x by that factor, as in the paper: no renormalization.

Storage per token and per K/V (what :meth:`TurboQuantLayer.held_tensors` reports):

- ``codes``: uint8 ``[B, H_kv, T, packed_length(D, L)]`` (:mod:`kvbench.quant.packing`);
- ``norms``: fp16 ``[B, H_kv, T, 1]``;
- ``residual``: with ``residual = R > 0``, the newest R keys and values are kept in ``fp_dtype``
  (like KIVI's value window) and quantized once they leave the window; R = 0 (default) quantizes
  every token as soon as it is stored;
- ``seeds``: the rotations and codebooks are regenerated from the seed and the model shape, never
  stored; the seed is counted as 8 bytes (one int64) per layer.

So with R = 0 the effective width is packed code bits + 16 / d per value, plus 64 bits per layer.
``key_bits``/``value_bits`` default to ``bits``. Backends: the codes are always quantized by torch;
``triton`` reads them with :class:`~kvbench.kernels.triton_parts.TritonReader`.

Outlier channels (``outlier_channels = k > 0``; default 0, the plain codec above). The paper's
KV-cache experiments reach their 2.5- and 3.5-bit settings by splitting the channels into an outlier
set and a regular set and running two independent instances of the codec, the outliers at a higher
width; SemKV's document (Sec. 2) describes the same ("channel-level mixed precision, quantizing the
outlier channels at a higher bit width"). Its 2.5-bit example is 32 of 128 channels at 3 bits and
96 at 2: ``bits=2 outlier_channels=32 outlier_bits=3`` (mean (32 * 3 + 96 * 2) / 128 = 2.5 code
bits); the 3.5-bit one is the same rule a bit higher (``bits=3 outlier_bits=4``; neither source
document gives its outlier count, so k stays the user's: 64 of 128 channels gives 3.5 exactly).
Per (layer, kv head) and separately for K and V, the k channels of largest mean square over the
first tokens stored (the prefill) are the outliers, fixed for the rest of the sequence and held as
``channels`` (one byte each per head); each set has its own fp16 norm per token, its own seeded
rotation of its own dimension and its own Lloyd-Max codebook for that dimension
(:class:`kvbench.cache.rotated.ChannelSplitCodes`). ``outlier_bits`` (null: one bit above
``key_bits``/``value_bits``, i.e. twice the levels) applies to both K and V. Neither the paper's
text we follow nor SemKV's document says how the outlier channels are found; ranking them by their
magnitude over the prompt needs no calibration data, as the codec needs none.

Why the default stays 0: ``bits`` names the codec's code width, as in the paper's distortion bound
and in SemKV's TurboQuant base and cliff grid, and with k > 0 the mean code width is
``bits + k / d * (outlier_bits - bits)``, above ``bits``. On a model whose first layers' keys carry a
large, nearly constant offset in a few channels (Qwen2's key bias) the plain codec buries the varying
part of every key under the offset's error, and a run should set ``outlier_channels``
(tests/methods/test_turboquant.py measures the difference on a tiny Qwen2 of that shape).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.cache.composite import CompositeLayer
from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.rotated import ChannelSplitCodes, HeadRotations, RotatedCodes
from kvbench.config import inert, is_int, require
from kvbench.methods.affine_base import FullPrecisionWindow, kv_bits_label
from kvbench.methods.base import Method, MethodConfig, register_method


@dataclass
class TurboQuantConfig(FullPrecisionWindow, MethodConfig):
    name: str = "turboquant"
    key_bits: float | None = None
    value_bits: float | None = None
    seed: int = 0
    residual: int = 0
    outlier_channels: int = inert(0)
    outlier_bits: float | None = inert(None)

    # triton: the codes are quantized by torch (no Triton quantizer of Lloyd-Max codes; the stored
    # bytes are the same) and read by TritonReader (rotated codebook parts, the channel split).
    backends: ClassVar[tuple[str, ...]] = ("auto", "torch", "triton")
    default_bits: ClassVar[float] = 2.0
    static_step: ClassVar[str | None] = "turboquant (residual 0)"

    def static_step_refusal(self):
        if self.residual:
            return "turboquant with residual > 0 keeps a rolling full-precision window"
        return super().static_step_refusal()

    def __post_init__(self):
        super().__post_init__()
        require(
            0 <= self.seed < 2**63,
            "method.seed",
            self.seed,
            "a non-negative integer (the rotation seed)",
        )
        require(
            self.residual >= 0,
            "method.residual",
            self.residual,
            "a non-negative token count (0: no full-precision window)",
        )
        self.resolve_kv_bits()
        require(
            is_int(self.outlier_channels) and self.outlier_channels >= 0,
            "method.outlier_channels",
            self.outlier_channels,
            "a channel count >= 0 per head (0: no outlier split)",
        )
        if self.outlier_bits is not None:
            require(
                self.outlier_channels > 0,
                "method.outlier_bits",
                self.outlier_bits,
                "null unless method.outlier_channels > 0",
            )
            self.levels(self.outlier_bits, key="method.outlier_bits")
            self.outlier_bits = float(self.outlier_bits)
        for part in ("key_bits", "value_bits"):
            if self.outlier_channels:
                self.levels(self.outlier_width(getattr(self, part)), key="method.outlier_bits")

    def outlier_width(self, bits: float) -> float:
        """The outlier channels' width for a regular width ``bits``: ``outlier_bits``, or one bit
        more (twice the levels)."""
        return self.outlier_bits if self.outlier_bits is not None else float(bits) + 1.0

    def check_model(self, shape):
        require(
            self.outlier_channels < shape.head_dim,
            "method.outlier_channels",
            self.outlier_channels,
            f"fewer than head_dim={shape.head_dim} channels",
        )


class TurboQuantLayer(CompositeLayer):
    def __init__(self, layer_idx: int, cfg: TurboQuantConfig, fp_dtype: torch.dtype):
        super().__init__(layer_idx)
        self.window = cfg.residual
        if cfg.outlier_channels:
            # one rotation per channel set and head, shared by K and V; the seed is held once
            self.rotations = HeadRotations(cfg.seed, layer_idx, tag="regular")
            outliers = HeadRotations(cfg.seed, layer_idx, tag="outlier")
            self.kq, self.vq = (
                ChannelSplitCodes(
                    cfg.levels(bits),
                    cfg.levels(cfg.outlier_width(bits)),
                    cfg.outlier_channels,
                    self.rotations,
                    outliers,
                )
                for bits in (cfg.key_bits, cfg.value_bits)
            )
        else:
            self.rotations = HeadRotations(cfg.seed, layer_idx)  # Pi is regenerated; the seed is held
            self.kq = RotatedCodes(cfg.levels(cfg.key_bits), self.rotations)
            self.vq = RotatedCodes(cfg.levels(cfg.value_bits), self.rotations)
        self.k_res = FullPrecisionTokens(fp_dtype)
        self.v_res = FullPrecisionTokens(fp_dtype)

    def static_stores(self):
        return self.kq, self.vq

    def append(self, keys, values):
        if not self.rotations.tag:
            self.rotations.get(keys)  # the seed is held from the first token on, window or not
        else:  # the regular set's rotations, for the dimension they will rotate
            self.rotations.get(keys[..., self.kq.count :])
        if not self.window:
            self.kq.append(keys)
            self.vq.append(values)
            return
        self.k_res.append(keys)
        self.v_res.append(values)
        overflow = len(self.k_res) - self.window
        if overflow > 0:
            self.kq.append(self.k_res.pop_front(overflow))
            self.vq.append(self.v_res.pop_front(overflow))

    def held_tensors(self):
        return {**super().held_tensors(), "seeds": self.rotations.held_tensors()}


@register_method("turboquant")
class TurboQuant(Method):
    fp16_prefill = True
    arm_batch = True
    Config = TurboQuantConfig
    Layer = TurboQuantLayer

    def label(self) -> str:
        c = self.config
        label = f"turboquant-{kv_bits_label(c)}"
        if c.outlier_channels:
            k, v = c.outlier_width(c.key_bits), c.outlier_width(c.value_bits)
            label += f"-o{c.outlier_channels}x" + (f"{k:g}b" if k == v else f"k{k:g}v{v:g}")
        return label + (f"-r{c.residual}" if c.residual else "")
