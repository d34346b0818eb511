"""Rotated-codebook storage (TurboQuant-MSE's, also SemKV's ``turboquant`` base).

A head vector ``x [D]`` is held as its fp16 norm and the packed Lloyd-Max codes of the rotated unit
vector ``Pi x / ||x||`` (:mod:`kvbench.quant.lloyd_max`); it reads back as ``||x|| Pi^T c[q]``. The
rotations ``Pi`` (one per kv head) are regenerated from a seed and the layer index, never stored: the
layer holds the seed instead (:meth:`HeadRotations.held_tensors`).
"""

from __future__ import annotations

import hashlib
import math

import torch

from kvbench.cache.growable import GrowableTokens
from kvbench.quant.blockwise import CodebookSource
from kvbench.quant.lloyd_max import lloyd_max_codebook, quantize_scalar, random_rotation
from kvbench.quant.packing import pack, unpack

FP16_MAX = torch.finfo(torch.float16).max


def head_seed(seed: int, layer_idx: int, head: int) -> int:
    """The rotation seed of one (layer, kv head), a fixed hash of the run seed and the position."""
    digest = hashlib.blake2b(f"turboquant/{seed}/{layer_idx}/{head}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # < 2**63, as torch.Generator.manual_seed wants


class HeadRotations:
    """One layer's random orthogonal ``Pi`` per kv head, ``[H_kv, D, D]``, built on first use."""

    def __init__(self, seed: int, layer_idx: int):
        self.seed, self.layer_idx = seed, layer_idx
        self.matrices: torch.Tensor | None = None
        self.seed_tensor = torch.tensor([seed], dtype=torch.int64)  # what is held instead of Pi

    def get(self, like: torch.Tensor | None = None) -> torch.Tensor:
        """The rotations, built for the heads, head dim and device of ``like [B, H_kv, T, D]`` the
        first time."""
        if self.matrices is None:
            heads, dim = like.shape[1], like.shape[-1]
            self.matrices = torch.stack(
                [
                    random_rotation(dim, head_seed(self.seed, self.layer_idx, h), like.device)
                    for h in range(heads)
                ]
            )
        return self.matrices

    def held_tensors(self) -> list[torch.Tensor]:
        """The seed, once the rotations exist (one int64 per layer)."""
        return [self.seed_tensor] if self.matrices is not None else []


class RotatedCodes:
    """One of K or V at one level count: per-vector norms and packed Lloyd-Max codes of the rotated
    unit vectors. The codebook is built for the head dim of the first append."""

    def __init__(self, levels: int, rotations: HeadRotations):
        self.levels, self.rotations = levels, rotations
        self.centroids: torch.Tensor | None = None
        self._codes = GrowableTokens(torch.uint8)  # doubling buffers: appends cost O(new tokens)
        self._norms = GrowableTokens(torch.float16)
        self.head_dim = 0

    def codebook(self, like: torch.Tensor) -> torch.Tensor:
        if self.centroids is None:
            c, _ = lloyd_max_codebook(self.levels, like.shape[-1])
            self.centroids = torch.tensor(c, dtype=torch.float32, device=like.device)
        return self.centroids

    def append(self, x: torch.Tensor) -> None:
        """Quantize ``x [B, H_kv, t, D]`` (the rotations and codebook are set up even when t = 0)."""
        rotations, centroids = self.rotations.get(x), self.codebook(x)
        if x.shape[-2] == 0:
            return
        x = x.float()
        norm = x.norm(dim=-1, keepdim=True)
        u = x / torch.where(norm > 0, norm, torch.ones_like(norm))
        y = torch.einsum("bhtd,hed->bhte", u, rotations)  # y = Pi u, per head
        codes = pack(quantize_scalar(y, centroids), self.levels)
        norm = norm.clamp(max=FP16_MAX).to(torch.float16)
        self.head_dim = x.shape[-1]
        self._codes.append(codes)
        self._norms.append(norm)

    @property
    def codes(self) -> torch.Tensor | None:
        """uint8 ``[B, H_kv, T, packed bytes]`` (a view of the rows in use), None while empty."""
        return self._codes.view() if len(self._codes) else None

    @property
    def norms(self) -> torch.Tensor | None:
        """fp16 ``[B, H_kv, T, 1]``, None while empty."""
        return self._norms.view() if len(self._norms) else None

    def source(self) -> CodebookSource | None:
        """The stored tokens as a block source attended in the rotated space (None while empty)."""
        if not len(self):
            return None
        return CodebookSource(
            self.codes,
            self.levels,
            self.head_dim,
            self.centroids,
            scale=self.norms,
            rotation=self.rotations.get(),
        )

    def bytes_reserved(self) -> int:
        return self._codes.bytes_reserved() + self._norms.bytes_reserved()

    def dequantize(self) -> torch.Tensor:
        """float32 ``[B, H_kv, T, D]``: ||x|| * Pi^T c[q]."""
        q = unpack(self.codes, self.levels, self.head_dim)
        c = self.centroids[q.long()]
        return torch.einsum("bhte,hed->bhtd", c, self.rotations.get()) * self.norms.float()

    def __len__(self) -> int:
        return len(self._codes)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        if self.codes is None:
            return {"codes": [], "norms": []}
        return {"codes": [self.codes], "norms": [self.norms]}

    def quantized_values(self) -> int:
        if self.codes is None:
            return 0
        return self.codes.shape[0] * self.codes.shape[1] * len(self) * self.head_dim

    def nominal_code_bits(self) -> float:
        return self.quantized_values() * math.log2(self.levels)
