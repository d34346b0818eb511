"""KIVI's layout as a static store (``method.cuda_graph``, :mod:`kvbench.cache.static`).

The growing layout (:mod:`kvbench.cache.kivi_layout`) moves tokens between stores with host-counted
pops; a static step needs every write at a device-side index and every read over fixed shapes. The
same streaming rules (Liu et al., ICML 2024, Algorithm 1), held as:

- ``kq``/``vq``: the quantized keys (per channel, groups of G) and values (per token), each a
  static :class:`~kvbench.cache.quantized.QuantizedTokens` of the request's capacity (a multiple
  of R) whose token t sits at row t;
- the key residual: a ring of R fp rows, filled from slot 0 after every flush; when it holds R - 1
  keys and one more arrives, those R keys are quantized into ``kq`` (KIVI's "flushed whole") and
  the ring starts again (its rows are not cleared: the count hides them);
- the value residual: a ring of R + 1 fp rows, value t at slot ``t mod (R + 1)``; when it holds R
  values and one more arrives, the oldest (token T - R) is quantized into ``vq`` and the new one
  written over token T - R - 1, which left the window the step before, so the step's attention,
  which reads the window as it was before the step, still finds every value it needs.

Which of those moves a step makes (a key flush; values quantized or not yet) is known on the host
from the token counts, so a decode step comes in at most four kinds (:meth:`KIVIStatic.step_kind`),
each replayable: :class:`~kvbench.cache.static.StaticStep` captures one graph per kind.

Attention of a decode query over the store before this forward (:func:`ring_attention`): logits of
the quantized keys over their capacity and of the key ring, the entries not holding a stored token
hidden; one softmax with the exact new token; then the weights, which are indexed by where each
key sits, are moved to where its value sits (token t: key row t below the flushed count, ring slot
``t - flushed`` above it; value row t below ``T - R``, ring slot ``t mod (R + 1)`` above) with two
gathers, and the value parts mix them. The same attention as the growing layout's, up to float
reassociation.
"""

from __future__ import annotations

import math

import torch

from kvbench.cache.blockwise import part_mix, part_scores
from kvbench.cache.fp import FullPrecisionSource


class KIVIStatic:
    """The rings and device counts of a static KIVI layer (its ``kq``/``vq`` are the layer's)."""

    def __init__(self, layer, capacity: int):
        r = layer.residual
        self.layer, self.r = layer, r
        # the quantized stores hold whole groups of R: round the capacity up
        self.capacity = -(-capacity // r) * r
        layer.kq.reserve(self.capacity)
        layer.vq.reserve(self.capacity)
        self.k_ring: torch.Tensor | None = None  # [B, H_kv, R, D]
        self.v_ring: torch.Tensor | None = None  # [B, H_kv, R + 1, D]
        self.total: torch.Tensor | None = None  # tokens stored, int64 [1] on the device

    # -- host counts (the layer's and kq's, moved by advance) --------------------------------------
    @property
    def tokens(self) -> int:
        return self.layer.num_tokens

    @property
    def flushed(self) -> int:
        """Keys in ``kq``."""
        return self.layer.kq.num_tokens

    def moves(self, t: int) -> tuple[int, int]:
        """``(keys flushed, values quantized)`` by storing ``t`` more tokens."""
        held = self.tokens - self.flushed + t
        return held // self.r * self.r, max(0, self.tokens + t - self.r) - max(0, self.tokens - self.r)

    def step_kind(self) -> tuple[bool, bool]:
        """What a one-token step does: (a key flush, a value quantized)."""
        flush, quantized = self.moves(1)
        return bool(flush), bool(quantized)

    def advance(self, t: int) -> None:
        flush, quantized = self.moves(t)
        if self.tokens + t > self.capacity:
            raise ValueError(
                f"static KIVI store of {self.capacity} tokens cannot take {t} more after {self.tokens}"
            )
        self.layer.kq.advance(flush)
        self.layer.vq.advance(quantized)

    # -- writes -----------------------------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store ``[B, H_kv, t, D]``: any t into an empty store (the prefill), else one token."""
        t = keys.shape[-2]
        if t == 0:
            return
        if self.tokens and t != 1:
            raise ValueError("a static KIVI store takes the prefill, then one token per step")
        layer, r = self.layer, self.r
        if self.k_ring is None:
            b, h, _, d = keys.shape
            dtype = layer.k_res.dtype
            self.k_ring = torch.zeros(b, h, r, d, dtype=dtype, device=keys.device)
            self.v_ring = torch.zeros(b, h, r + 1, d, dtype=dtype, device=keys.device)
            self.total = torch.zeros(1, dtype=torch.long, device=keys.device)
        flush, quantized = self.moves(t)
        held = self.tokens - self.flushed  # keys in the ring
        # what the growing layout quantizes passed through its fp_dtype residual first
        keys, values = keys.to(self.k_ring.dtype), values.to(self.v_ring.dtype)
        layer.kq.allocate_like(keys)  # (KIVI's arithmetic keeps parameters in this dtype)
        layer.vq.allocate_like(values)
        if self.tokens == 0:
            # the prefill: host positions are fine, nothing here is captured
            if flush:
                layer.kq.append(keys[..., :flush, :])
            self.k_ring[..., : t - flush, :] = keys[..., flush:, :]
            if quantized:
                layer.vq.append(values[..., :quantized, :])
            kept = torch.arange(quantized, t, device=keys.device)
            self.v_ring.index_copy_(-2, kept % (r + 1), values[..., quantized:, :])
        else:
            if flush:  # the ring's R - 1 keys and this one, in token order
                layer.kq.append(torch.cat([self.k_ring[..., :held, :], keys], dim=-2))
            else:
                self.k_ring.index_copy_(-2, self.total - layer.kq.written, keys)
            if quantized:  # the oldest value, token T - R, leaves the window
                oldest = (self.total - r) % (r + 1)
                layer.vq.append(self.v_ring.index_select(-2, oldest))
            self.v_ring.index_copy_(-2, self.total % (r + 1), values)
        self.total.add_(t)

    # -- reads ------------------------------------------------------------------------------------
    def snapshot(self) -> tuple:
        """What attention reads, taken before this forward's append: the four parts over their full
        shapes and the device counts ``(tokens, flushed)`` of then."""
        kq, vq = self.layer.kq.static_source(), self.layer.vq.static_source()
        return (
            kq[0],
            FullPrecisionSource(self.k_ring),
            vq[0],
            FullPrecisionSource(self.v_ring),
            self.total.clone(),
            kq[1].clone(),
        )

    def held(self) -> dict[str, list[torch.Tensor]]:
        """The residual rows in use (the key ring's first ones; as many value rows as the window
        holds), for accounting: the bytes of the growing layout's windows."""
        if self.k_ring is None:
            return {"residual": []}
        keys = self.k_ring[..., : self.tokens - self.flushed, :]
        values = self.v_ring[..., : min(self.tokens, self.r), :]
        return {"residual": [x for x in (keys, values) if x.shape[-2]]}

    def bytes_reserved(self) -> int:
        rings = [x for x in (self.k_ring, self.v_ring) if x is not None]
        return sum(x.numel() * x.element_size() for x in rings)


def ring_attention(
    query: torch.Tensor,
    snapshot: tuple,
    r: int,
    scaling: float,
    exact_keys: torch.Tensor,
    exact_values: torch.Tensor,
    reader=None,
) -> torch.Tensor:
    """``query [B, H_q, 1, D]`` over a :meth:`KIVIStatic.snapshot` (stored tokens as they were before
    this forward) and the forward's own token ``exact_keys``/``exact_values [B, H_kv, 1, D]``;
    returns ``[B, H_q, 1, D]`` in the query's dtype (see the module docstring)."""
    kq, k_ring, vq, v_ring, total, flushed = snapshot
    b, hq, q, d = query.shape
    hkv = k_ring.num_heads
    rows = hq // hkv * q
    qf = (query.float() * scaling).reshape(b, hkv, rows, d)
    cap = kq.num_tokens
    dev = query.device
    token = torch.arange(cap, device=dev)
    slot = torch.arange(r, device=dev)
    logits = part_scores([kq, k_ring], qf, reader)  # [B, H_kv, M, cap + R]
    hidden = torch.cat([token >= flushed, slot >= total - flushed])
    logits = logits.masked_fill(hidden, -math.inf)
    every = torch.cat([logits, torch.matmul(qf, exact_keys.float().transpose(-1, -2))], dim=-1)
    m = every.amax(dim=-1, keepdim=True)
    p = torch.exp(every - m)
    l = p.sum(dim=-1, keepdim=True)  # noqa: E741
    # the weight of token t, indexed by token: key row t below the flushed count, ring slot t - flushed
    in_ring = (token - flushed).clamp(0, r - 1) + cap
    by_token = torch.where(token < flushed, p[..., :cap], p[..., in_ring])
    by_token = by_token.masked_fill(token >= total, 0.0)
    # where each value sits: row t below T - R, ring slot t mod (R + 1) for the newest R
    window = (total - r).clamp(min=0)
    v_slot = torch.arange(r + 1, device=dev)
    owner = window + (v_slot - window) % (r + 1)  # the token in slot s, if any
    ring_w = by_token[..., owner.clamp(max=cap - 1)].masked_fill(owner >= total, 0.0)
    quant_w = by_token.masked_fill(token >= window, 0.0)
    weights = torch.cat([quant_w, ring_w], dim=-1)
    out = part_mix([vq, v_ring], weights, reader)
    out = out.add_(p[..., -1:] * exact_values.float())
    out = out / l
    return out.reshape(b, hq, q, d)
