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
``key_bits``/``value_bits`` default to ``bits``. Only the torch backend exists for this method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.cache.composite import CompositeLayer
from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.rotated import HeadRotations, RotatedCodes
from kvbench.config import require
from kvbench.methods.affine_base import FullPrecisionWindow, kv_bits_label
from kvbench.methods.base import Method, MethodConfig, register_method


@dataclass
class TurboQuantConfig(FullPrecisionWindow, MethodConfig):
    name: str = "turboquant"
    key_bits: float | None = None
    value_bits: float | None = None
    seed: int = 0
    residual: int = 0

    backends: ClassVar[tuple[str, ...]] = ("torch",)
    default_bits: ClassVar[float] = 2.0

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


class TurboQuantLayer(CompositeLayer):
    def __init__(self, layer_idx: int, cfg: TurboQuantConfig, fp_dtype: torch.dtype):
        super().__init__(layer_idx)
        self.window = cfg.residual
        self.rotations = HeadRotations(cfg.seed, layer_idx)  # Pi is regenerated; the seed is held
        self.kq = RotatedCodes(cfg.levels(cfg.key_bits), self.rotations)
        self.vq = RotatedCodes(cfg.levels(cfg.value_bits), self.rotations)
        self.k_res = FullPrecisionTokens(fp_dtype)
        self.v_res = FullPrecisionTokens(fp_dtype)

    def append(self, keys, values):
        self.rotations.get(keys)  # the seed is held from the first token on, window or not
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
    Config = TurboQuantConfig
    Layer = TurboQuantLayer

    def label(self) -> str:
        c = self.config
        return f"turboquant-{kv_bits_label(c)}" + (f"-r{c.residual}" if c.residual else "")
