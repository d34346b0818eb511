"""``semkv``: SemKV (Lee, Kim, Kim, "SemKV: Quality-Cliff-Guided Semantic Mixed-Precision KV Cache
Quantization for Long-Context LLM Inference", arXiv 2608.28911).

Full-token retention with token-wise two-level mixed precision. Every stored token's key and value
head vectors are quantized per token at one of two level counts on the fractional bit grid,
``L_hi`` (default 6, 2.585 bits) or ``L_lo`` (default 5, 2.322 bits), both above the measured
quality cliff. The top fraction

    p = (b_target - log2 L_lo) / (log2 L_hi - log2 L_lo)

of tokens by an importance metric get ``L_hi``; the default target 2.39 bits (p = 0.259) is the
paper's working point. The count per allocation unit is ``round(p n)`` with the remainder carried
across units (:mod:`kvbench.quant.mixed`), so the realized mean of log2 L over the stored tokens
is ``round(p N)``-exact for every prefix.

Importance metrics (``metric``), higher = more important = higher precision:

- hidden state (per layer, one ranking shared by the layer's kv heads): ``hidden_norm`` = ||h_in||
  of the decoder layer's input hidden state at the token; ``hidden_change`` = ||h_out - h_in||.
  Read by an :class:`~kvbench.cache.capture.OutputCapture` on the decoder layers, attached in
  :meth:`SemKV.prepare`.
- KV (per layer and kv head): ``key_norm`` = ||k|| (post-RoPE), ``value_norm`` = ||v||.
- logit (model level, the same ranking in every layer): ``entropy`` = -sum_v p_i(v) log p_i(v) of
  the next-token distribution at position i; ``surprisal`` = -log p(x_i | x_<i), from the logits of
  position i - 1 (the previous forward's last position for the first token of a forward; the very
  first token of a sequence has no prediction and gets +inf, i.e. it is always high).
- attention (per layer and kv head): ``attn_sum`` = sum over the queries that have seen the token
  (all query heads of its kv-head group, every query position of every forward while the token is
  pending) of its softmax weight; ``attn_max`` = the max of those weights. Computed in
  :meth:`SemKVLayer.attend` for the pending tokens only, in chunks of ``query_chunk`` queries.
- ``random``: uniform scores from a generator seeded by (``seed``, layer): the control.

Delayed allocation (chunk-wise): new tokens are held in ``fp_dtype`` (``residual`` bytes, their
scores ``scores`` bytes) until scored. The first forward that stores tokens (the prefill) is
allocated as one unit once scored; afterwards pending tokens are allocated in units of ``chunk``
tokens as soon as ``chunk`` of them are pending (generated tokens, later turns), and fewer than
``chunk`` stay in full precision. KV and random scores exist at append time, so those layers
allocate inside ``append`` (also when driven through ``cache.update`` alone); hidden, logit and
attention scores are complete only after the forward, so :meth:`SemKV.after_forward` hands them
over and allocates.

Storage (``held_tensors``): per K/V one store per level count (``codes`` packed per token along
channels, :mod:`kvbench.quant.packing`), the base quantizer's parameters, and the allocation map
(``index``: one bit per token and kv head, packed, shared by K and V). Base quantizers (``base``):

- ``uniform`` (default): the affine per-token quantizer of :mod:`kvbench.quant.affine` with
  ``group_size`` channels per scale/zero pair. The default (``null``) is the paper's grouping:
  one fp16 scale/zero pair per :data:`PAPER_GROUP` = 128 channels on heads a multiple of 128 wide,
  the whole head otherwise (G = min(128, head_dim) on the usual 64/128/256-wide heads). With fp16
  parameters that is 32 / G bits per value: 0.25 at G = 128, which with the index bit
  (1 / (2 head_dim)) is the paper's 2.39 nominal code bits -> ~2.65 effective bits on its
  head_dim-128 models (the document states the 2.65, which only this grouping gives); a
  head_dim-256 head is two groups, not one (one pair over 256 channels measured worse than uniform
  at fewer bits). The packed bytes held here cost 2.4 bits per code for L = 5 (10 codes in a
  3-byte word) and 8/3 for L = 6 (3 codes per byte, :mod:`kvbench.quant.packing`), which
  ``effective_bits`` reports as they are;
- ``turboquant``: TurboQuant-MSE (:mod:`kvbench.cache.rotated`: per-vector fp16 norm, seeded
  rotation per (layer, kv head), Lloyd-Max codebook of L levels); ``seeds`` is one int64 per layer.

``bits`` (the run's top-level knob) is the target average when ``target_bits`` is unset.
Backends: the stores are always packed by torch; ``triton`` reads them with
:class:`~kvbench.kernels.triton_parts.TritonReader`, except under the attention metrics, which
reconstruct the cache to score it and so refuse ``triton``. Attention metrics need the layer's own
``attend``, which a ``sink_tokens`` wrapper bypasses, so that combination is rejected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.cache import KVLayer
from kvbench.cache.capture import OutputCapture
from kvbench.cache.composite import CompositeLayer
from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.layer import StoredTokens, cat_tokens
from kvbench.cache.quantized import QuantizedTokens
from kvbench.cache.rotated import HeadRotations, RotatedCodes
from kvbench.cache.source import ConcatSource
from kvbench.config import check_choice, require
from kvbench.errors import ConfigError
from kvbench.methods.base import Method, MethodConfig, check_group, register_method
from kvbench.methods.semkv_metrics import (
    APPEND_TIME_METRICS,
    ATTENTION_METRICS,
    HIDDEN_METRICS,
    LOGIT_METRICS,
    METRICS,
    attention_update,
    decoder_layers,
    hidden_metric,
    logit_scores,
    metric_seed,
)
from kvbench.quant.levels import BITS_TOLERANCE
from kvbench.quant.mixed import (
    RunningAllocator,
    high_fraction,
    merge_by_mask,
    pack_mask,
    split_by_mask,
    top_k_mask,
    unpack_mask,
)

BASES = ("uniform", "turboquant")
PAPER_GROUP = 128  # channels per scale/zero pair in the paper's accounting (2.39 -> 2.65 bits)


@dataclass
class SemKVConfig(MethodConfig):
    name: str = "semkv"
    target_bits: float | None = None  # null: bits (default 2.39)
    high_levels: int = 6
    low_levels: int = 5
    metric: str = "key_norm"
    chunk: int = 64
    base: str = "uniform"
    group_size: int | None = None  # uniform base: channels per scale/zero (null: min(128, head_dim))
    seed: int = 0
    query_chunk: int = 128

    # triton: the stores are packed by torch and read by TritonReader (affine or rotated codebook
    # parts and the pending window); attention metrics take the reconstructing path instead of the
    # parts, so they refuse it (__post_init__)
    backends: ClassVar[tuple[str, ...]] = ("auto", "torch", "triton")
    default_bits: ClassVar[float] = 2.39
    # 2: group_size null groups 128 channels (was: the whole head) on heads wider than 128
    version: ClassVar[int] = 2

    def __post_init__(self):
        super().__post_init__()
        for key in ("high_levels", "low_levels"):
            value = getattr(self, key)
            require(
                2 <= value <= 256,
                f"method.{key}",
                value,
                "an integer level count 2..256",
            )
        require(
            self.low_levels < self.high_levels,
            "method.low_levels",
            self.low_levels,
            f"fewer levels than method.high_levels={self.high_levels}",
        )
        key = "method.target_bits" if self.target_bits is not None else "bits"
        target = self.target_bits if self.target_bits is not None else self.bits
        lo, hi = math.log2(self.low_levels), math.log2(self.high_levels)
        allowed = (
            f"an average code width in [log2 {self.low_levels}, log2 {self.high_levels}]"
            f" = [{lo:.4f}, {hi:.4f}], each end to within {BITS_TOLERANCE}"
        )
        try:
            high_fraction(float(target), self.low_levels, self.high_levels)
        except ValueError:
            raise ConfigError(key, target, allowed) from None
        self.target_bits = self.bits = float(target)
        check_choice("method.metric", self.metric, METRICS)
        check_choice("method.base", self.base, BASES)
        require(self.chunk > 0, "method.chunk", self.chunk, "a positive token count")
        require(self.query_chunk > 0, "method.query_chunk", self.query_chunk, "a positive query count")
        require(
            0 <= self.seed < 2**63,
            "method.seed",
            self.seed,
            "a non-negative integer",
        )
        if self.base == "turboquant":
            require(
                self.group_size is None,
                "method.group_size",
                self.group_size,
                "null with base=turboquant (it quantizes whole head vectors)",
            )
        if self.metric in ATTENTION_METRICS:
            require(
                self.backend != "triton",
                "method.backend",
                self.backend,
                f"auto or torch with metric={self.metric} (attention metrics reconstruct the cache "
                "instead of reading its parts, which triton does not cover)",
            )
            require(
                self.sink_tokens == 0,
                "method.sink_tokens",
                self.sink_tokens,
                f"0 with metric={self.metric}: not implemented"
                " (the sink wrapper bypasses the layer's attend)",
            )

    @property
    def high_fraction(self) -> float:
        return high_fraction(self.target_bits, self.low_levels, self.high_levels)

    def stored_levels(self):
        return (self.high_levels, self.low_levels)

    def channel_group(self, head_dim: int) -> int | None:
        """Channels per scale/zero pair of the uniform base on a head of ``head_dim`` (None: the
        whole head, as :class:`~kvbench.cache.quantized.QuantizedTokens` reads it)."""
        if self.group_size is not None:
            return self.group_size
        return PAPER_GROUP if head_dim > PAPER_GROUP and head_dim % PAPER_GROUP == 0 else None

    def check_model(self, shape):
        check_group("method.group_size", self.group_size, shape.head_dim, "head_dim")


class SemKVLayer(KVLayer):
    def __init__(self, layer_idx: int, cfg: SemKVConfig, fp_dtype: torch.dtype, head_dim: int = 0):
        super().__init__(layer_idx)
        self.cfg = cfg
        self.metric = cfg.metric
        self.k_pend, self.v_pend = FullPrecisionTokens(fp_dtype), FullPrecisionTokens(fp_dtype)
        self.scores: torch.Tensor | None = None  # float32 [B, H_kv or 1, scored pending tokens]
        self.unscored = 0  # pending tokens whose scores arrive after the forward
        self.allocator = RunningAllocator(cfg.high_fraction)
        self.started = False  # the first unit (the prefill) has been allocated
        self.masks: list[torch.Tensor] = []  # packed allocation maps, one per unit
        self.unit_sizes: list[int] = []
        self._generator: torch.Generator | None = None
        # (units allocated, positions of the stored tokens): a decode step that allocates nothing
        # reuses them instead of unpacking and sorting the whole map again
        self._positions: tuple[int, torch.Tensor] | None = None
        self.rotations = HeadRotations(cfg.seed, layer_idx) if cfg.base == "turboquant" else None
        if cfg.base == "uniform":
            group = cfg.channel_group(head_dim)
            make = lambda levels: QuantizedTokens(levels, "token", group)  # noqa: E731
        else:
            make = lambda levels: RotatedCodes(levels, self.rotations)  # noqa: E731
        # per K/V: (store of the tokens at L_hi, store of the tokens at L_lo)
        self.stores = {kv: (make(cfg.high_levels), make(cfg.low_levels)) for kv in ("k", "v")}

    # -- helpers ----------------------------------------------------------------------------------

    def pending(self) -> int:
        return len(self.k_pend)

    def allocated_tokens(self) -> int:
        return sum(self.unit_sizes)

    def _append_scores(self, s: torch.Tensor) -> None:
        s = s.float()  # one layout per metric: [B, H_kv, t] (KV, attention, random) or [B, 1, t]
        self.scores = s if self.scores is None else torch.cat([self.scores, s], dim=-1)

    def _append_time_scores(self, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        if self.metric == "key_norm":
            return keys.float().norm(dim=-1)
        if self.metric == "value_norm":
            return values.float().norm(dim=-1)
        if self._generator is None:
            self._generator = torch.Generator().manual_seed(
                metric_seed("semkv", self.cfg.seed, self.layer_idx)
            )
        b, h, t, _ = keys.shape
        return torch.rand(b, h, t, generator=self._generator).to(keys.device)

    # -- storage ----------------------------------------------------------------------------------
    def append(self, keys, values):
        self.k_pend.append(keys)
        self.v_pend.append(values)
        b, h, t, _ = keys.shape
        if self.metric in APPEND_TIME_METRICS:
            self._append_scores(self._append_time_scores(keys, values))
            self.allocate()
        elif self.metric in ATTENTION_METRICS:
            self._append_scores(torch.zeros(b, h, t, device=keys.device))  # filled in attend
        else:
            self.unscored += t

    def add_scores(self, scores: torch.Tensor) -> None:
        """Scores ``[B, t]`` (or ``[B, H_kv, t]``) of a whole forward's tokens; the last
        ``unscored`` of them are this layer's pending tokens (a sink may have taken the first)."""
        if not self.unscored:
            return
        if scores.dim() == 2:
            scores = scores[:, None]
        if scores.shape[-1] < self.unscored:
            raise RuntimeError(
                f"semkv layer {self.layer_idx}: {self.unscored} tokens await scores, got {scores.shape[-1]}"
            )
        self._append_scores(scores[..., scores.shape[-1] - self.unscored :])
        self.unscored = 0

    def allocate(self) -> None:
        """Quantize the pending tokens that are due: the whole prefill, then whole chunks."""
        if self.unscored:
            raise RuntimeError(f"semkv layer {self.layer_idx}: {self.unscored} pending tokens have no scores")
        n = self.pending()
        if not n:
            return
        if not self.started:
            self.started = True
            self._allocate_unit(n)
            return
        for _ in range(n // self.cfg.chunk):
            self._allocate_unit(self.cfg.chunk)

    def _allocate_unit(self, n: int) -> None:
        k = self.allocator.take(n)
        b, h = self.k_pend.data.shape[:2]
        mask = top_k_mask(self.scores[..., :n].expand(b, h, n), k)
        self.scores = self.scores[..., n:] if self.scores.shape[-1] > n else None
        for kv, x in (("k", self.k_pend.pop_front(n)), ("v", self.v_pend.pop_front(n))):
            high, low = split_by_mask(x, mask)
            self.stores[kv][0].append(high)
            self.stores[kv][1].append(low)
        self.masks.append(pack_mask(mask))
        self.unit_sizes.append(n)

    def allocation_mask(self) -> torch.Tensor | None:
        """bool ``[B, H_kv, allocated tokens]``: True where the token holds the higher level count."""
        if not self.masks:
            return None
        return torch.cat([unpack_mask(m, n) for m, n in zip(self.masks, self.unit_sizes, strict=True)], -1)

    def stored(self) -> StoredTokens | None:
        """The two stores (each holding its tokens in order) and the pending tokens, with every
        entry's position: a head's tokens at L_hi are at the True places of its allocation map.
        None for attention metrics, which score the pending tokens from the full softmax over every
        key and so take the reconstructing path."""
        if self.metric in ATTENTION_METRICS:
            return None
        parts = {"k": [], "v": []}
        positions = []
        if self.masks:
            positions.append(self._stored_positions())
            for kv in ("k", "v"):
                parts[kv].extend(store.source() if len(store) else None for store in self.stores[kv])
        allocated = self.allocated_tokens()
        if self.pending():
            b, h = self.k_pend.data.shape[:2]
            pend = torch.arange(allocated, allocated + self.pending(), device=self.k_pend.data.device)
            positions.append(pend.expand(b, h, self.pending()))
            parts["k"].append(self.k_pend.source())
            parts["v"].append(self.v_pend.source())
        return StoredTokens(ConcatSource(parts["k"]), ConcatSource(parts["v"]), torch.cat(positions, dim=-1))

    def _stored_positions(self) -> torch.Tensor:
        """``[B, H_kv, allocated]``: the position of every stored entry, the L_hi store's tokens
        first, then the L_lo store's, each in token order."""
        if self._positions is None or self._positions[0] != len(self.masks):
            mask = self.allocation_mask()
            order = torch.sort((~mask).to(torch.uint8), dim=-1, stable=True).indices
            self._positions = (len(self.masks), order)
        return self._positions[1]

    def bytes_reserved(self):
        stores = [s for pair in self.stores.values() for s in pair] + [self.k_pend, self.v_pend]
        return sum(s.bytes_reserved() for s in stores)

    def read(self):
        mask = self.allocation_mask()
        out = []
        for kv, pend in (("k", self.k_pend), ("v", self.v_pend)):
            stored = None
            if mask is not None:
                high, low = self.stores[kv]
                dequantized = CompositeLayer.dequantized
                stored = merge_by_mask(mask, dequantized(high), dequantized(low))
            out.append(cat_tokens(stored, pend.data))
        return out[0], out[1]

    # -- attention metrics ------------------------------------------------------------------------
    def attend(self, module, query, keys, values, attention_mask, **kwargs):
        if self.metric in ATTENTION_METRICS and self.scores is not None:
            scaling = kwargs.get("scaling") or module.scaling
            self._score_attention(query, keys, attention_mask, scaling)
        return super().attend(module, query, keys, values, attention_mask, **kwargs)

    @torch.no_grad()
    def _score_attention(self, query, keys, attention_mask, scaling) -> None:
        self.scores = attention_update(
            self.scores, query, keys, attention_mask, scaling, self.metric, self.cfg.query_chunk
        )

    # -- accounting -------------------------------------------------------------------------------
    def held_tensors(self):
        held: dict[str, list[torch.Tensor]] = {}
        for high, low in self.stores.values():
            for store in (high, low):
                for component, tensors in store.held_tensors().items():
                    held.setdefault(component, []).extend(tensors)
        held["index"] = list(self.masks)
        held["residual"] = self.k_pend.tensors() + self.v_pend.tensors()
        held["scores"] = [] if self.scores is None else [self.scores]
        if self.rotations is not None:
            held["seeds"] = self.rotations.held_tensors()
        return held

    def quantized_values(self):
        return sum(s.quantized_values() for pair in self.stores.values() for s in pair)

    def nominal_code_bits(self):
        return sum(s.nominal_code_bits() for pair in self.stores.values() for s in pair)


def semkv_layers(cache) -> list[SemKVLayer]:
    """The SemKV layers of a cache, looking through sink wrappers."""
    out = []
    for layer in cache.layers:
        layer = getattr(layer, "inner", layer)
        if isinstance(layer, SemKVLayer):
            out.append(layer)
    return out


@register_method("semkv")
class SemKV(Method):
    """Per-request state (the previous forward's last log-probabilities, for ``surprisal``) lives
    here and is reset by :meth:`new_cache`, one cache per request. In a batch (one cache per
    sequence, :mod:`kvbench.cache.batch`) each sequence's is kept apart, by its cache, and swapped
    in around that sequence's :meth:`after_forward`."""

    fp16_prefill = True

    Config = SemKVConfig
    Layer = SemKVLayer

    def __init__(self, config: SemKVConfig):
        super().__init__(config)
        self.hidden: OutputCapture | None = None  # decoder layer -> [B, t] scores of the last forward
        self.last_logprobs: torch.Tensor | None = None
        # id(cache) -> that sequence's last_logprobs, for the caches of the batch being decoded
        self._batch_logprobs: dict[int, torch.Tensor | None] = {}

    def prefill_is_fp16(self) -> bool:
        # the hidden-state metrics read the decoder layers' outputs through forward hooks, which a
        # shared prefill does not run; the logit metrics read every position's logits
        return self.config.metric not in HIDDEN_METRICS and super().prefill_is_fp16()

    def needs_prefill_logits(self) -> bool:
        return self.config.metric in LOGIT_METRICS

    def prefilled_alone(self, cache) -> None:
        self._batch_logprobs[id(cache)] = self.last_logprobs
        self.last_logprobs = None

    def release(self) -> None:
        if self.hidden is not None:
            self.hidden.close()
            self.hidden = None

    def new_cache(self, shape, model_dtype):
        self.last_logprobs = None
        self._batch_logprobs.clear()
        return super().new_cache(shape, model_dtype)

    def make_layer(self, layer_idx, shape, model_dtype):
        fp_dtype = self.config.torch_fp_dtype(model_dtype)
        return SemKVLayer(layer_idx, self.config, fp_dtype, shape.head_dim)

    def prepare(self, model, tokenizer, shape, data_root) -> None:
        if self.config.metric not in HIDDEN_METRICS:
            return
        if self.hidden is not None:
            self.hidden.close()
        self.hidden = OutputCapture(
            decoder_layers(model, shape.num_layers), hidden_metric(self.config.metric)
        )

    def after_forward(self, cache, input_ids, logits) -> None:
        layers = semkv_layers(cache)
        metric = self.config.metric
        if metric in LOGIT_METRICS:
            scores, self.last_logprobs = logit_scores(metric, logits, input_ids, self.last_logprobs)
            for layer in layers:
                layer.add_scores(scores)
        elif metric in HIDDEN_METRICS:
            hidden = {} if self.hidden is None else self.hidden.records
            for layer in layers:
                if layer.unscored:
                    if layer.layer_idx not in hidden:
                        raise RuntimeError(
                            f"semkv: no hidden states for layer {layer.layer_idx} (no prepare?)"
                        )
                    layer.add_scores(hidden[layer.layer_idx])
            hidden.clear()
        for layer in layers:
            layer.allocate()

    def after_forward_batch(self, caches, input_ids, logits, starts) -> None:
        """Each sequence's :meth:`after_forward` on its own row and real columns, with its own
        ``last_logprobs`` and the hidden-state records (``[R, t]`` per decoder layer, pads
        included) cut to that row and those columns: what the sequence's forward gives alone."""
        records = {} if self.hidden is None else dict(self.hidden.records)
        try:
            for r, (cache, start) in enumerate(zip(caches, starts, strict=True)):
                if self.hidden is not None:
                    self.hidden.records.clear()
                    self.hidden.records.update({i: x[r : r + 1, start:] for i, x in records.items()})
                self.last_logprobs = self._batch_logprobs.get(id(cache))
                self.after_forward(cache, input_ids[r : r + 1, start:], logits[r : r + 1, start:])
                self._batch_logprobs[id(cache)] = self.last_logprobs
        finally:
            self.last_logprobs = None
            if self.hidden is not None:
                self.hidden.records.clear()

    def base_label(self) -> str:
        c = self.config
        base = "" if c.base == "uniform" else f"-{c.base}"
        return f"semkv-{c.target_bits:g}b-L{c.low_levels}-{c.high_levels}-{c.metric}{base}"
