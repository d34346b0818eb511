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

import hashlib
import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.cache import KVLayer
from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.layer import cat_tokens
from kvbench.config import is_int, require
from kvbench.errors import ConfigError
from kvbench.methods.base import Method, MethodConfig, covers_context, register_method
from kvbench.quant.lloyd_max import lloyd_max_codebook, quantize_scalar, random_rotation
from kvbench.quant.packing import pack, unpack

FP16_MAX = torch.finfo(torch.float16).max


@dataclass
class TurboQuantConfig(MethodConfig):
    name: str = "turboquant"
    key_bits: float | None = None
    value_bits: float | None = None
    seed: int = 0
    residual: int = 0

    default_bits: ClassVar[float] = 2.0

    def __post_init__(self):
        if self.backend == "triton":
            raise ConfigError("method.backend", self.backend, "only torch is implemented for turboquant")
        super().__post_init__()
        require(
            is_int(self.seed) and 0 <= self.seed < 2**63,
            "method.seed",
            self.seed,
            "a non-negative integer (the rotation seed)",
        )
        require(
            is_int(self.residual) and self.residual >= 0,
            "method.residual",
            self.residual,
            "a non-negative token count (0: no full-precision window)",
        )
        self.resolve_kv_bits()

    def context_warnings(self, lengths):
        return {
            **super().context_warnings(lengths),
            **covers_context("residual", self.residual, lengths, "the whole prompt stays in full precision"),
        }


def head_seed(seed: int, layer_idx: int, head: int) -> int:
    """The rotation seed of one (layer, kv head), a fixed hash of the run seed and the position."""
    digest = hashlib.blake2b(f"turboquant/{seed}/{layer_idx}/{head}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # < 2**63, as torch.Generator.manual_seed wants


class RotatedCodes:
    """One of K or V: per-vector norms and packed Lloyd-Max codes of the rotated unit vectors."""

    def __init__(self, levels: int):
        self.levels = levels
        self.codes: torch.Tensor | None = None
        self.norms: torch.Tensor | None = None
        self.head_dim = 0

    def append(self, x: torch.Tensor, rotations: torch.Tensor, centroids: torch.Tensor) -> None:
        if x.shape[-2] == 0:
            return
        x = x.float()
        norm = x.norm(dim=-1, keepdim=True)
        u = x / torch.where(norm > 0, norm, torch.ones_like(norm))
        y = torch.einsum("bhtd,hed->bhte", u, rotations)  # y = Pi u, per head
        codes = pack(quantize_scalar(y, centroids), self.levels)
        norm = norm.clamp(max=FP16_MAX).to(torch.float16)
        self.head_dim = x.shape[-1]
        if self.codes is None:
            self.codes, self.norms = codes, norm
        else:
            self.codes = torch.cat([self.codes, codes], dim=-2)
            self.norms = torch.cat([self.norms, norm], dim=-2)

    def dequantize(self, rotations: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
        """float32 ``[B, H_kv, T, D]``: ||x|| * Pi^T c[q]."""
        q = unpack(self.codes, self.levels, self.head_dim)
        c = centroids[q.long()]
        return torch.einsum("bhte,hed->bhtd", c, rotations) * self.norms.float()

    def __len__(self) -> int:
        return 0 if self.codes is None else self.codes.shape[-2]

    def tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return ([], []) if self.codes is None else ([self.codes], [self.norms])

    def quantized_values(self) -> int:
        if self.codes is None:
            return 0
        return self.codes.shape[0] * self.codes.shape[1] * len(self) * self.head_dim

    def nominal_code_bits(self) -> float:
        return self.quantized_values() * math.log2(self.levels)


class TurboQuantLayer(KVLayer):
    def __init__(self, layer_idx: int, cfg: TurboQuantConfig, fp_dtype: torch.dtype):
        super().__init__(layer_idx)
        self.seed, self.window = cfg.seed, cfg.residual
        self.kq = RotatedCodes(cfg.levels(cfg.key_bits))
        self.vq = RotatedCodes(cfg.levels(cfg.value_bits))
        self.k_res = FullPrecisionTokens(fp_dtype)
        self.v_res = FullPrecisionTokens(fp_dtype)
        self.seed_tensor = torch.tensor([cfg.seed], dtype=torch.int64)  # what is held instead of Pi
        self.rotations: torch.Tensor | None = None  # [H_kv, D, D], regenerated, not accounted
        self._centroids: dict[int, torch.Tensor] = {}

    def _setup(self, x: torch.Tensor) -> None:
        if self.rotations is not None:
            return
        heads, dim = x.shape[1], x.shape[-1]
        self.rotations = torch.stack(
            [random_rotation(dim, head_seed(self.seed, self.layer_idx, h), x.device) for h in range(heads)]
        )
        for levels in {self.kq.levels, self.vq.levels}:
            c, _ = lloyd_max_codebook(levels, dim)
            self._centroids[levels] = torch.tensor(c, dtype=torch.float32, device=x.device)

    def _quantize(self, store: RotatedCodes, x: torch.Tensor) -> None:
        store.append(x, self.rotations, self._centroids[store.levels])

    def _read(self, store: RotatedCodes) -> torch.Tensor | None:
        return store.dequantize(self.rotations, self._centroids[store.levels]) if len(store) else None

    def append(self, keys, values):
        self._setup(keys)
        if not self.window:
            self._quantize(self.kq, keys)
            self._quantize(self.vq, values)
            return
        self.k_res.append(keys)
        self.v_res.append(values)
        overflow = len(self.k_res) - self.window
        if overflow > 0:
            self._quantize(self.kq, self.k_res.pop_front(overflow))
            self._quantize(self.vq, self.v_res.pop_front(overflow))

    def read(self):
        k = cat_tokens(self._read(self.kq), self.k_res.data)
        v = cat_tokens(self._read(self.vq), self.v_res.data)
        return k, v

    def held_tensors(self):
        k_codes, k_norms = self.kq.tensors()
        v_codes, v_norms = self.vq.tensors()
        return {
            "codes": k_codes + v_codes,
            "norms": k_norms + v_norms,
            "residual": self.k_res.tensors() + self.v_res.tensors(),
            "seeds": [self.seed_tensor] if self.rotations is not None else [],
        }

    def quantized_values(self):
        return self.kq.quantized_values() + self.vq.quantized_values()

    def nominal_code_bits(self):
        return self.kq.nominal_code_bits() + self.vq.nominal_code_bits()


@register_method("turboquant")
class TurboQuant(Method):
    Config = TurboQuantConfig

    def make_layer(self, layer_idx, shape, model_dtype):
        return TurboQuantLayer(layer_idx, self.config, self.config.torch_fp_dtype(model_dtype))

    def label(self) -> str:
        c = self.config
        bits = f"{c.key_bits:g}b" if c.key_bits == c.value_bits else f"k{c.key_bits:g}v{c.value_bits:g}"
        return f"turboquant-{bits}" + (f"-r{c.residual}" if c.residual else "")
