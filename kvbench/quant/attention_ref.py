"""Plain-torch decode attention over a KV cache held in parts: the reference for the fused kernel.

A cache is read as two token sequences of equal length ``N0``, one of keys and one of values, each the
concatenation of its parts in order (KIVI: ``keys = [Kq, Kres]``, ``values = [Vq, Vres]``; the key and
value parts may split the sequence at different places). A part is either a :class:`PackedKV` (codes
packed as in :mod:`kvbench.quant.packing`, affine parameters as in :mod:`kvbench.quant.affine`) or a
full-precision ``[B, H_kv, t, D]`` tensor. Optional extra entries ``[B, H_kv, E, D]`` (outlier pools,
sinks, prefetched rows) are attended after them.

Queries are ``[B, H, nq, D]`` with ``H = H_kv * group``; query head ``h`` reads kv head ``h // group``
(transformers' ``repeat_kv`` order). With ``nq > 1`` the queries are consecutive new tokens whose own
entries are the newest ``nq`` tokens of the main sequence, so query ``i`` must not see the newest
``nq - 1 - i`` of them (causal rule); extra entries are older tokens and visible to every query.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvbench.quant.affine import AXES, dequantize_grouped
from kvbench.quant.packing import packed_length, unpack


@dataclass(frozen=True)
class PackedKV:
    """One quantized part of a cache, as :class:`kvbench.cache.quantized.QuantizedTokens` holds it.

    Attributes:
        codes: uint8 ``[B, H_kv, T, packed_length(D, levels)]``; each token's D codes packed along
            channels.
        scale, zero: ``[B, H_kv, T // G, D]`` for ``axis="channel"`` (KIVI keys: per channel over
            groups of G tokens), ``[B, H_kv, T, D // G]`` for ``axis="token"`` (KIVI values: per
            token over groups of G channels); any float dtype (fp16 in the caches).
        levels: level count L (2..256).
        group_size: G.
        axis: ``"channel"`` or ``"token"``, as in :func:`kvbench.quant.affine.quantize_grouped`.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    levels: int
    group_size: int
    axis: str

    @property
    def num_tokens(self) -> int:
        return self.codes.shape[-2]

    @classmethod
    def from_store(cls, store) -> PackedKV | None:
        """The part held by a ``QuantizedTokens``; None when it is empty."""
        if store.codes is None or len(store) == 0:
            return None
        group = store.group_size
        if group is None:
            if store.axis != "token":
                # Whole-axis token groups are one group per appended block: no single G describes them.
                raise ValueError("a channel-axis store with group_size=None has no fixed group size")
            group = store.head_dim
        return cls(store.codes, store.scale, store.zero, store.levels, group, store.axis)

    def check(self, head_dim: int) -> None:
        """Raise ValueError unless the tensors agree with each other and with ``head_dim``."""
        if self.axis not in AXES:
            raise ValueError(f"axis must be one of {AXES}, got {self.axis!r}")
        if self.codes.dtype != torch.uint8 or self.codes.dim() != 4:
            raise ValueError(
                f"codes must be uint8 [B, H_kv, T, M], got {self.codes.dtype} {tuple(self.codes.shape)}"
            )
        b, h, t, m = self.codes.shape
        if m != packed_length(head_dim, self.levels):
            raise ValueError(
                f"codes hold {m} bytes per token; D={head_dim} codes at levels={self.levels} take "
                f"{packed_length(head_dim, self.levels)}"
            )
        g = self.group_size
        if self.axis == "channel":
            if t % g:
                raise ValueError(f"channel-axis part holds T={t} tokens, not a multiple of group_size={g}")
            expected = (b, h, t // g, head_dim)
        else:
            if head_dim % g:
                raise ValueError(f"head dim D={head_dim} is not a multiple of group_size={g}")
            expected = (b, h, t, head_dim // g)
        for name, x in (("scale", self.scale), ("zero", self.zero)):
            if tuple(x.shape) != expected:
                raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {expected} (axis={self.axis})")

    def dequantize(self, head_dim: int) -> torch.Tensor:
        """float32 ``[B, H_kv, T, D]``."""
        codes = unpack(self.codes, self.levels, head_dim)
        return dequantize_grouped(codes, self.scale, self.zero, self.axis, self.group_size)


Part = PackedKV | torch.Tensor | None


def materialize(parts: Sequence[Part], head_dim: int) -> torch.Tensor | None:
    """Concatenate parts along tokens in float32, skipping None and empty ones: ``[B, H_kv, N, D]``."""
    dense = [p.dequantize(head_dim) if isinstance(p, PackedKV) else p for p in parts if p is not None]
    dense = [p.float() for p in dense if p.shape[-2] > 0]
    if not dense:
        return None
    return torch.cat(dense, dim=-2)


def causal_tail_mask(nq: int, n_main: int, n_extra: int, device: torch.device) -> torch.Tensor:
    """Boolean ``[nq, n_main + n_extra]``, True where query ``i`` may attend.

    Query ``i`` is the token at main position ``n_main - nq + i``; it sees every main position up to
    and including its own, and every extra entry.
    """
    pos = torch.arange(n_main + n_extra, device=device)
    own = n_main - nq + torch.arange(nq, device=device)
    return (pos[None, :] <= own[:, None]) | (pos[None, :] >= n_main)


def decode_attention_reference(
    q: torch.Tensor,
    k_parts: Sequence[Part],
    v_parts: Sequence[Part],
    scaling: float,
    extra_keys: torch.Tensor | None = None,
    extra_values: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a few new queries over a cache held in parts, in float32.

    Args:
        q: ``[B, H, nq, D]``; the queries' own entries are the newest ``nq`` main tokens.
        k_parts, v_parts: the main key and value sequences, in token order (parts as in the module
            docstring); their concatenations must both hold ``N0 >= nq`` tokens (``N0 >= nq - 1``
            with extras).
        scaling: logit scale, usually ``D ** -0.5``.
        extra_keys, extra_values: ``[B, H_kv, E, D]`` or None; visible to every query.

    Returns:
        ``[B, H, nq, D]`` in ``q.dtype``.
    """
    d = q.shape[-1]
    keys = materialize([*k_parts, extra_keys], d)
    values = materialize([*v_parts, extra_values], d)
    if keys is None or values is None or keys.shape != values.shape:
        shapes = [None if x is None else tuple(x.shape) for x in (keys, values)]
        raise ValueError(f"keys and values must hold the same non-zero token count, got {shapes}")
    n_extra = 0 if extra_keys is None else extra_keys.shape[-2]
    n_main = keys.shape[-2] - n_extra
    nq = q.shape[-2]
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    logits = torch.matmul(q.float(), keys.transpose(-1, -2)) * scaling
    visible = causal_tail_mask(nq, n_main, n_extra, q.device)
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(logits, dim=-1), values).to(q.dtype)
