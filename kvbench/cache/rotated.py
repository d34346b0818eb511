"""Rotated-codebook storage (TurboQuant-MSE's, also SemKV's ``turboquant`` base).

A head vector ``x [D]`` is held as its fp16 norm and the packed Lloyd-Max codes of the rotated unit
vector ``Pi x / ||x||`` (:mod:`kvbench.quant.lloyd_max`); it reads back as ``||x|| Pi^T c[q]``. The
rotations ``Pi`` (one per kv head) are regenerated from a seed and the layer index, never stored: the
layer holds the seed instead (:meth:`HeadRotations.held_tensors`).

:class:`ChannelSplitCodes` is TurboQuant's outlier treatment (Zandieh et al. 2025, the KV-cache
experiments' 2.5- and 3.5-bit settings): a head's channels are split into an outlier set and the
rest, and each set is quantized by its own instance of the codec above (its own norm, rotation and
codebook for its own dimension), the outliers at more levels.
"""

from __future__ import annotations

import hashlib
import math

import torch

from kvbench.cache.codebook_source import CodebookSource
from kvbench.cache.growable import GrowableTokens
from kvbench.cache.source import BlockSource
from kvbench.kernels.channels import gather_channels, scatter_channels
from kvbench.kernels.part_reads import PartReads, register_reads
from kvbench.quant.lloyd_max import lloyd_max_codebook, quantize_scalar, random_rotation
from kvbench.quant.packing import pack, unpack

FP16_MAX = torch.finfo(torch.float16).max


def head_seed(seed: int, layer_idx: int, head: int, tag: str = "") -> int:
    """The rotation seed of one (layer, kv head), a fixed hash of the run seed and the position
    (and of ``tag``, which names a channel subset's rotation; untagged: the whole head's)."""
    name = f"turboquant/{tag}/" if tag else "turboquant/"
    digest = hashlib.blake2b(f"{name}{seed}/{layer_idx}/{head}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # < 2**63, as torch.Generator.manual_seed wants


class HeadRotations:
    """One layer's random orthogonal ``Pi`` per kv head, ``[H_kv, D, D]``, built on first use."""

    def __init__(self, seed: int, layer_idx: int, tag: str = ""):
        self.seed, self.layer_idx, self.tag = seed, layer_idx, tag
        self.matrices: torch.Tensor | None = None
        self.seed_tensor = torch.tensor([seed], dtype=torch.int64)  # what is held instead of Pi

    def get(self, like: torch.Tensor | None = None) -> torch.Tensor:
        """The rotations, built for the heads, head dim and device of ``like [B, H_kv, T, D]`` the
        first time."""
        if self.matrices is None:
            heads, dim = like.shape[1], like.shape[-1]
            self.matrices = torch.stack(
                [
                    random_rotation(dim, head_seed(self.seed, self.layer_idx, h, self.tag), like.device)
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

    # -- static mode (kvbench.cache.static) -----------------------------------------------------
    def reserve(self, capacity: int) -> None:
        self._codes.reserve(capacity)
        self._norms.reserve(capacity)

    def advance(self, t: int) -> None:
        self._codes.advance(t)
        self._norms.advance(t)

    def static_source(self):
        """``(source, length)``: the whole capacity (unwritten tokens: code 0, norm 0, so they read
        as zero vectors) and the device count of tokens written; None before the first append."""
        codes = self._codes.full_view()
        if codes is None:
            return None
        source = CodebookSource(
            codes,
            self.levels,
            self.head_dim,
            self.centroids,
            scale=self._norms.full_view(),
            rotation=self.rotations.get(),
        )
        return source, self._codes.length

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


def top_channels(x: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` channels of largest mean square per kv head of ``x [B, H_kv, T, D]`` (over the
    batch and the tokens), ascending: int64 ``[H_kv, count]``. Ties go to the lower channel."""
    energy = x.float().pow(2).mean(dim=(0, 2))  # [H_kv, D]
    order = torch.sort(energy, dim=-1, descending=True, stable=True).indices
    return order[:, :count].sort(dim=-1).values


class ChannelSplitCodes:
    """One of K or V held as two :class:`RotatedCodes` over a partition of each head's channels:
    the ``outlier_channels`` of largest mean square at ``outlier_levels``, the other channels at
    ``levels``, each with its own per-token fp16 norm, seeded rotation of its own dimension (the two
    :class:`HeadRotations` are shared with the other of K/V) and Lloyd-Max codebook.

    The outlier set is chosen per kv head from the first tokens stored (the prefill), as the
    outlier channels of keys are a property of the head rather than of the token, and fixed after;
    it is held as ``channels`` (uint8 ``[H_kv, outlier_channels]`` for heads up to 256 wide, int16
    beyond). Per token and head the store holds ``packed(k, L_o) + packed(D - k, L)`` code bytes and
    two fp16 norms.

    Why it matters: one rotation over the whole head spreads the error of the largest channels,
    ``||x|| sqrt(D_mse)``, over every coordinate. A head whose keys carry a few channels of a large,
    nearly constant offset (Qwen2's key bias: norms ~277 against ~17 in the other layers) then has
    the small varying part, which sets the attention pattern, buried under that error; split, the
    regular channels are quantized against their own norm, and the nearly constant outlier channels
    get nearly constant codes, whose error shifts every logit alike."""

    def __init__(
        self,
        levels: int,
        outlier_levels: int,
        outlier_channels: int,
        regular_rotations: HeadRotations,
        outlier_rotations: HeadRotations,
    ):
        self.count = outlier_channels
        self.regular = RotatedCodes(levels, regular_rotations)
        self.outlier = RotatedCodes(outlier_levels, outlier_rotations)
        self.channels: torch.Tensor | None = None  # int64 [H_kv, count], ascending
        self.rest: torch.Tensor | None = None  # int64 [H_kv, D - count], ascending
        self.head_dim = 0

    def append(self, x: torch.Tensor) -> None:
        """Quantize ``x [B, H_kv, t, D]``; the first non-empty append fixes the outlier set."""
        if x.shape[-2] == 0:
            return
        if self.channels is None:
            d = x.shape[-1]
            if not 0 < self.count < d:
                raise ValueError(f"outlier channels must be in 1..{d - 1} for head_dim {d}, got {self.count}")
            self.head_dim = d
            self.channels = top_channels(x, self.count)
            keep = torch.ones(x.shape[1], d, dtype=torch.bool, device=x.device)
            keep.scatter_(-1, self.channels, False)
            self.rest = keep.nonzero()[:, 1].reshape(x.shape[1], d - self.count)
        self.outlier.append(gather_channels(x, self.channels))
        self.regular.append(gather_channels(x, self.rest))

    def _held_channels(self) -> torch.Tensor:
        return self.channels.to(torch.uint8 if self.head_dim <= 256 else torch.int16)

    def source(self) -> ChannelSplitSource | None:
        if not len(self):
            return None
        parts = [(self.outlier.source(), self.channels), (self.regular.source(), self.rest)]
        return ChannelSplitSource(parts, self.head_dim)

    def bytes_reserved(self) -> int:
        held = 0 if self.channels is None else self._held_channels().nbytes
        return self.outlier.bytes_reserved() + self.regular.bytes_reserved() + held

    # -- static mode (kvbench.cache.static): the outlier set is chosen by the prefill ------------
    def reserve(self, capacity: int) -> None:
        self.outlier.reserve(capacity)
        self.regular.reserve(capacity)

    def advance(self, t: int) -> None:
        self.outlier.advance(t)
        self.regular.advance(t)

    def static_source(self):
        outlier, regular = self.outlier.static_source(), self.regular.static_source()
        if outlier is None:
            return None
        parts = [(outlier[0], self.channels), (regular[0], self.rest)]
        return ChannelSplitSource(parts, self.head_dim), regular[1]

    def dequantize(self) -> torch.Tensor:
        """float32 ``[B, H_kv, T, D]``: each set's reconstruction at its channels."""
        return scatter_channels(
            [(self.outlier.dequantize(), self.channels), (self.regular.dequantize(), self.rest)],
            self.head_dim,
        )

    def __len__(self) -> int:
        return len(self.regular)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        if not len(self):
            return {"codes": [], "norms": [], "channels": []}
        parts = (self.outlier.held_tensors(), self.regular.held_tensors())
        return {
            "codes": [t for p in parts for t in p["codes"]],
            "norms": [t for p in parts for t in p["norms"]],
            "channels": [self._held_channels()],
        }

    def quantized_values(self) -> int:
        return self.outlier.quantized_values() + self.regular.quantized_values()

    def nominal_code_bits(self) -> float:
        return self.outlier.nominal_code_bits() + self.regular.nominal_code_bits()


class ChannelSplitSource(BlockSource):
    """Stored tokens held as sources over a partition of the channels: ``parts`` is a list of
    ``(source over k channels, channels [H_kv, k])``. Scores add the parts' scores of the query's
    matching channels; reads and mixes put each part's channels back in place."""

    def __init__(self, parts: list[tuple[BlockSource, torch.Tensor]], head_dim: int):
        self.parts, self.head_dim = parts, head_dim

    @property
    def num_tokens(self) -> int:
        return self.parts[0][0].num_tokens

    @property
    def num_heads(self) -> int:
        return self.parts[0][0].num_heads

    def read(self, start: int, stop: int) -> torch.Tensor:
        self._check_range(start, stop)
        return scatter_channels([(src.read(start, stop), ch) for src, ch in self.parts], self.head_dim)

    def scores(self, query: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        self._check_range(start, stop)
        out = None
        for src, ch in self.parts:
            s = src.scores(gather_channels(query, ch), start, stop)
            out = s if out is None else out + s
        return out

    def mix(self, weights: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        self._check_range(start, stop)
        mixed = [(src.mix(weights, start, stop), ch) for src, ch in self.parts]
        return scatter_channels(mixed, self.head_dim)


# -- what the kernels read of this part (kvbench.kernels.part_reads) ----------------------------------
# Triton reads each channel set's part through its own registered read: the query gathered to the
# set's channels, the mixed values scattered back (two launches, whatever the context). The
# compiled CPU reader registers nothing here: the split's torch reference reads it.


def _split_scores(reader, part: ChannelSplitSource, query):
    out = None
    for src, channels in part.parts:
        s = reader.part_scores(src, gather_channels(query, channels))
        out = s if out is None else out.add_(s)
    return out


def _split_mix(reader, part: ChannelSplitSource, weights):
    return scatter_channels([(reader.part_mix(src, weights), ch) for src, ch in part.parts], part.head_dim)


register_reads(
    ChannelSplitSource,
    "triton",
    PartReads(_split_scores, _split_mix, lambda reader, part: all(reader.covers(s) for s, _ in part.parts)),
)
