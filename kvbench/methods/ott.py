"""``ott``: OTT, Outlier Tokens Tracing (Su et al., "Accurate KV Cache Quantization with Outlier
Tokens Tracing", ACL 2025).

OTT is KIVI (KIVI's storage, :class:`kvbench.cache.kivi_layout.KIVILayer`) plus a small
full-precision pool of *outlier tokens*, tracked per (layer, kv head) while decoding.

Layout and quantizer (Sec. 3 "Quantization", following KIVI): keys per channel over groups of G
consecutive tokens, values per token over groups of ``value_group_size`` channels, KIVI's affine
map X' = Q(X) * s + z, z = min X, s = (max X - min X) / (2^B - 1). The paper names a single group
size, G = 128, the number of tokens quantized per step; it gives no channel group for the values,
so ``value_group_size`` keeps KIVI's 32 (it divides head_dim 64 and 128; ``null`` takes the whole
head).

Streaming (Sec. 3 and Sec. 4 setup, "Keys and Values are compressed together every G steps"):
the full-precision part holds the newest R tokens (the sliding window) plus the tokens of the group
not yet full; whenever it holds at least R + G tokens its oldest G tokens, keys and values
together, are quantized as one group. Prefill runs the same rule group by group, so a prefill
stores exactly what feeding the same tokens one at a time stores. R need not be a multiple of G
(the paper's defaults are G = 128, R = 32).

Outlier pool (Sec. 3 "Quantization", Appendix E), per (layer, kv head), capacity N:

- score S_i = ||K_i||_1, the L1 norm of token i's (post-RoPE) key in that head;
- at each quantization step the G group tokens and the tokens already in the pool O^(t) compete:
  O^(t+1) = the N tokens of O^(t) u T^(t) with the *smallest* S_i. Smallest, because the outliers
  the paper finds (Sec. 2, Fig. 1d/1e and the ablation of Fig. 1c) are tokens whose keys are tiny in
  the large-magnitude channels, which stretch the per-channel range [min, max]; keeping the
  smallest-norm keys gave the lowest attention error, the largest-norm ones the highest. Ties go
  to the older token;
- group tokens that enter the pool are replaced, for the group's quantization, by the mean of all
  G tokens of the group (outliers included: "replaced by the average of all tokens"), keys and
  values alike; their codes are stored with the group but never read: reads and attention take
  the pool's full-precision copy at the token's position;
- pool tokens beaten by newer ones cannot go back into their already-quantized group; as in the
  paper they move to an extra full-precision pool (capacity ``extra_pool_size``, 32). Tracing
  stops for a head at the first step whose evictions the extra pool cannot take in full: from that
  step on its groups are quantized plainly, and its pool and extra pool are frozen (no token is
  ever dropped, so the extra pool may stop a few slots short of full);
- the first ``skip_layers`` (2) layers have no pool (N = 0, Sec. 4 ablation "shallow layers");
- ``selection`` is the ablation of Sec. 2 that motivates the smallest-norm rule: ``smallest`` (the
  method), ``largest`` (the N largest S_i, which the paper finds worst) or ``random`` (a uniform
  draw among the candidates, from a generator seeded by the layer index, so a run is repeatable);
  only the ranking changes, the pool, mean replacement and extra pool are the same;
- N <= G, so the pool is full (N tokens in every head) after the first quantization step.

Decoding (Sec. 3 "Decoding"): attention runs over three parts, the quantized cache with the pool
positions left out, the outlier pools (full precision; keys are post-RoPE, so they already carry
their original position) and the full-precision window (then the tokens of this forward, exact),
with one softmax across the three parts: softmax(q K^T * scale + mask) V. :meth:`OTTLayer.stored`
hands the three parts to the blockwise attention of :mod:`kvbench.cache.layer` with each entry's
sequence position (the pooled tokens' quantized entries hidden), so the codes are read a block at a
time and never reconstructed whole. This equals attention over the same values placed at their
positions, which is what :meth:`OTTLayer.read` returns (the reference it is tested against).

Accounting: codes/scales/zeros of every quantized token (pool tokens' unread codes included),
``residual`` for the window, ``outliers`` for the pool and extra pool (fp keys and values, int32
positions) and the per-head tracing flags.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.cache.fp import FullPrecisionSource
from kvbench.cache.kivi_layout import KIVILayer
from kvbench.cache.layer import StoredTokens, cat_tokens, merge_held
from kvbench.cache.outliers import EMPTY, Pool, place
from kvbench.cache.source import ConcatSource
from kvbench.config import check_choice, inert, require
from kvbench.methods.affine_base import AffineCodesConfig, kv_bits_label
from kvbench.methods.base import Method, check_group, register_method


@dataclass
class OTTConfig(AffineCodesConfig):
    name: str = "ott"
    group_size: int = 128
    value_group_size: int | None = 32
    residual: int = 32
    pool_size: int = 3
    skip_layers: int = 2
    extra_pool_size: int = 32
    selection: str = inert("smallest")  # smallest (the method) | largest | random (Sec. 2 ablation)

    SELECTIONS: ClassVar[tuple[str, ...]] = ("smallest", "largest", "random")
    default_bits: ClassVar[float] = 2.0
    group_size_rule: ClassVar[str] = (
        "a positive integer: tokens per quantization step (key channel-group length)"
    )

    def __post_init__(self):
        super().__post_init__()
        require(
            self.value_group_size is None or self.value_group_size > 0,
            "method.value_group_size",
            self.value_group_size,
            "a positive integer dividing head_dim, or null for the whole head",
        )
        require(
            self.residual >= 0,
            "method.residual",
            self.residual,
            "a non-negative integer: the full-precision window of newest tokens",
        )
        require(
            0 <= self.pool_size <= self.group_size,
            "method.pool_size",
            self.pool_size,
            f"an integer from 0 to method.group_size={self.group_size}",
        )
        for key in ("skip_layers", "extra_pool_size"):
            value = getattr(self, key)
            require(value >= 0, f"method.{key}", value, "a non-negative integer")
        check_choice("method.selection", self.selection, self.SELECTIONS)

    def check_model(self, shape):
        check_group("method.value_group_size", self.value_group_size, shape.head_dim, "head_dim")


class OTTLayer(KIVILayer):
    """KIVI's stores (``kq`` keys per channel over G tokens, ``k_res``/``v_res`` the full-precision
    tokens) with values per token over ``value_group_size`` channels, plus the outlier pools.

    Backend triton: KIVI's fused decode kernel reads the quantized store and the window only, so
    OTT never takes it; its decode steps read all three parts of :meth:`stored` through the
    layer's part reader (:class:`~kvbench.kernels.triton_parts.TritonReader`: affine codes and
    full-precision rows, one launch each), with the pooled tokens' codes hidden by position."""

    fused_decode = False

    def __init__(self, layer_idx, cfg: OTTConfig, fp_dtype):
        # KIVI uses G for both axes; OTT's G is a token count, the value channel group is its own knob.
        super().__init__(
            layer_idx,
            cfg.levels(cfg.key_bits),
            cfg.levels(cfg.value_bits),
            cfg.group_size,
            cfg.value_group_size,
            cfg.residual,
            cfg.zero_point,
            fp_dtype,
            cfg.storage_backend(),
        )
        self.pool_size = 0 if layer_idx < cfg.skip_layers else cfg.pool_size
        self.extra_pool_size = cfg.extra_pool_size
        self.selection = cfg.selection
        # the random ranking's draws; seeded per layer so the same run stores the same pools
        self.generator = torch.Generator().manual_seed(layer_idx) if cfg.selection == "random" else None
        self.pool: Pool | None = None  # N tokens, positions ascending
        self.extra: Pool | None = None  # evicted outliers, valid slots first
        self.tracing: torch.Tensor | None = None  # bool [B, H_kv]: still identifying outliers

    # -- storage ------------------------------------------------------------------------------
    def append(self, keys, values):
        self.k_res.append(keys)
        self.v_res.append(values)
        while len(self.k_res) >= self.residual + self.group:
            self._quantize_group(self.k_res.pop_front(self.group), self.v_res.pop_front(self.group))

    def _quantize_group(self, k, v):
        if self.pool_size:
            k, v = self._trace(k, v, start=len(self.kq))
        self.kq.append(k)
        self.vq.append(v)

    def extra_count(self) -> torch.Tensor:
        """Evicted outliers held per head, ``[B, H_kv]``."""
        return (self.extra.pos >= 0).sum(-1)

    def _trace(self, k, v, start):
        """One competition (Appendix E) for the group ``k, v [B, H, G, D]`` at positions
        ``start..start+G-1``; returns the group with its new outliers mean-replaced (float32)."""
        b, h, g, d = k.shape
        pos = torch.arange(start, start + g, device=k.device, dtype=torch.int32).expand(b, h, g)
        if self.pool is None:
            self.pool = Pool(k[..., :0, :], v[..., :0, :], pos[..., :0])
            self.extra = Pool(k[..., :0, :], v[..., :0, :], pos[..., :0])
            self.tracing = torch.ones(b, h, dtype=torch.bool, device=k.device)
        old, n = self.pool, self.pool.pos.shape[-1]
        cand_k = torch.cat([old.k, k.to(old.k.dtype)], dim=-2)
        cand_v = torch.cat([old.v, v.to(old.v.dtype)], dim=-2)
        cand_pos = torch.cat([old.pos, pos], dim=-1)
        score = self._rank_score(cand_k)
        # candidates are in position order (pool older than group): a stable sort breaks ties by age
        chosen = torch.sort(score, dim=-1, stable=True).indices[..., : self.pool_size]
        chosen = chosen.sort(dim=-1).values  # back to position order
        keep = torch.zeros_like(score, dtype=torch.bool).scatter_(-1, chosen, True)
        evicted = ~keep[..., :n]
        room = self.extra_pool_size - self.extra_count()
        active = self.tracing & (evicted.sum(-1) <= room)
        self.tracing = active

        def gather(x):
            return x.gather(-2, chosen[..., None].expand(*chosen.shape, d))

        new = Pool(gather(cand_k), gather(cand_v), cand_pos.gather(-1, chosen))
        if n == self.pool_size:
            # a head that stops keeps its pool (heads only stop once their pool is full)
            a = active[..., None]
            new = Pool(
                torch.where(a[..., None], new.k, old.k),
                torch.where(a[..., None], new.v, old.v),
                torch.where(a, new.pos, old.pos),
            )
        self.pool = new

        gone = evicted & active[..., None]
        if gone.any():
            ek = torch.cat([self.extra.k, old.k], dim=-2)
            ev = torch.cat([self.extra.v, old.v], dim=-2)
            epos = torch.cat([self.extra.pos, torch.where(gone, old.pos, EMPTY)], dim=-1)
            valid = epos >= 0
            order = torch.sort((~valid).to(torch.uint8), dim=-1, stable=True).indices
            order = order[..., : int(valid.sum(-1).max())]
            valid = valid.gather(-1, order)[..., None]
            idx = order[..., None].expand(*order.shape, d)
            self.extra = Pool(
                torch.where(valid, ek.gather(-2, idx), 0),
                torch.where(valid, ev.gather(-2, idx), 0),
                epos.gather(-1, order),
            )

        joined = (keep[..., n:] & active[..., None])[..., None]  # group tokens now in the pool
        k, v = k.float(), v.float()
        k = torch.where(joined, k.mean(-2, keepdim=True), k)
        v = torch.where(joined, v.mean(-2, keepdim=True), v)
        return k, v

    def _rank_score(self, cand_k: torch.Tensor) -> torch.Tensor:
        """``[B, H, n + G]``: the pool keeps the candidates with the smallest score."""
        norm = cand_k.float().abs().sum(-1)  # S_i = ||K_i||_1
        if self.selection == "largest":
            return -norm
        if self.selection == "random":
            return torch.rand(norm.shape, generator=self.generator).to(norm.device)
        return norm

    def stored(self) -> StoredTokens | None:
        """The quantized cache with the outliers' own positions hidden (their codes are never read),
        the outlier pools at their positions (empty slots hidden), then the window, in order."""
        tq = len(self.kq)
        quantized = (self.kq.source(), self.vq.source()) if tq else (None, None)
        window = (self.k_res.source(), self.v_res.source())
        if self.pool is None:
            return StoredTokens(
                ConcatSource([quantized[0], window[0]]), ConcatSource([quantized[1], window[1]])
            )
        pk = torch.cat([self.pool.k, self.extra.k], dim=-2)
        pv = torch.cat([self.pool.v, self.extra.v], dim=-2)
        opos = torch.cat([self.pool.pos, self.extra.pos], dim=-1).long()
        b, h, n = opos.shape
        seq = torch.arange(tq, device=opos.device).expand(b, h, tq)
        # a pooled token's quantized entry: position -1 (written to a scratch column, then dropped)
        hide = torch.where(opos >= 0, opos, tq)
        qpos = torch.cat([seq, seq.new_zeros(b, h, 1)], dim=-1).scatter(-1, hide, EMPTY)[..., :tq]
        wpos = torch.arange(tq, tq + len(self.k_res), device=opos.device).expand(b, h, len(self.k_res))
        return StoredTokens(
            ConcatSource([quantized[0], FullPrecisionSource(pk), window[0]]),
            ConcatSource([quantized[1], FullPrecisionSource(pv), window[1]]),
            torch.cat([qpos, opos, wpos], dim=-1),
        )

    def read(self):
        """The stored tokens in position order: outliers at their positions over the cache (the
        reference that :meth:`stored` is tested against)."""
        qk = self.kq.dequantize() if len(self.kq) else None
        qv = self.vq.dequantize() if len(self.vq) else None
        if qk is not None and self.pool is not None:
            ok = torch.cat([self.pool.k, self.extra.k], dim=-2)
            ov = torch.cat([self.pool.v, self.extra.v], dim=-2)
            opos = torch.cat([self.pool.pos, self.extra.pos], dim=-1).long()
            qk, qv = place(qk, ok, opos), place(qv, ov, opos)
        return cat_tokens(qk, self.k_res.data), cat_tokens(qv, self.v_res.data)

    def held_tensors(self):
        held = super().held_tensors()  # codes, scales, zeros, residual
        if self.pool is None:
            return held
        return merge_held(held, {"outliers": self.pool.tensors() + self.extra.tensors() + [self.tracing]})


@register_method("ott")
class OTT(Method):
    fp16_prefill = True
    arm_batch = True
    Config = OTTConfig
    Layer = OTTLayer

    def label(self) -> str:
        # the class attributes are the paper's defaults (no config is built to read them)
        c = self.config
        pool = "" if c.pool_size == OTTConfig.pool_size else f"-pool{c.pool_size}"
        selection = "" if c.selection == OTTConfig.selection else f"-{c.selection}"
        return f"ott-{kv_bits_label(c)}{pool}{selection}"
