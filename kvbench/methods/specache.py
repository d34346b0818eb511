"""``specache``: SpeCache (Jie et al., "SpeCache: Speculative Key-Value Caching for Efficient
Generation of LLMs", ICML 2025, arXiv 2503.16163).

The full-precision (FP16) KV cache ``C`` of every layer lives in host memory; the accelerator keeps a
low-bit copy ``C'`` (KIVI's layout, :class:`kvbench.cache.kivi_layout.KIVILayer`: per-channel keys
and per-token values in groups of G, an FP16 residual of the newest R tokens) and, for each decode step,
the k FP16 pairs ``C_K`` fetched for it.

Quantizer (Sec. 4.3): KIVI's ``Q(X) = round((X - z_X) / s_X)``, ``X' = Q(X) s_X + z_X``; at 1 bit
``zero_point=specache`` takes ``z_X = (3 min X + max X) / 4``, ``s_X = (max X - min X) / 2`` (the two
codes reconstruct the midpoints of the lower and upper half of [min X, max X]); ``minmax`` is
KIVI's ``z_X = min X``, ``s_X = (max X - min X) / (2^B - 1)`` (Table 5's ablation).

Phases (Sec. 4.1-4.2, Algorithms 1-3):

- prefill (Alg. 1): each layer attends its exact keys and values, then quantizes them into ``C'`` and
  offloads ``C`` to host memory, layer by layer;
- pre-decoding (Alg. 2): the first output token T_1 attends ``C'`` alone; its output is the first
  speculative token T'_2, and ``K_1 = ArgTopK(A)`` of its attention starts the first prefetch. T_1's
  KV is not stored here: it is stored by the first decode step, which processes T_1 again;
- decoding (Alg. 3): step t runs ``[T_t, T'_{t+1}]`` in one forward,
  ``O = Attn([T_t, T'_{t+1}], C' U C_{K_t})``, where ``C' U C_{K_t}`` is ``C'`` with its rows
  ``K_t`` replaced by the prefetched FP16 rows. ``K_{t+1} = ArgTopK(A_{1,:})``, the speculative
  row's attention, is prefetched for step t+1. T_t's output is the model's output T_{t+1}; T'_{t+1}'s
  output is the next speculative token. Only T_t's KV is stored and offloaded; the speculative
  token's KV is dropped, and the causal mask keeps T_t from attending to it.

``speculative=false`` is the non-speculative fetch of Table 4: each decode token first attends the
low-bit cache, its own top-k are fetched (synchronously) and its attention is recomputed over
``C' U C_K``; no pre-decoding and one token per forward.

Choices the paper leaves open, made here:

- top-k is taken per KV head over the attention probabilities summed across the query heads that
  share it (grouped-query attention), among the stored tokens whose keys are low-bit (tokens in the
  FP16 key residual are already exact on the accelerator);
- the scores are those of Alg. 3's attention, i.e. over ``C' U C_{K_t}`` plus the forward's own
  tokens; when k covers every candidate, ``C' U C_K`` is the FP16 cache;
- forwards outside the decode driver (scoring a continuation through the cache) store every token,
  attend ``C' U C_K`` with the set chosen by the previous forward's last query, and choose the next
  set from their own last query; the first forward after the prompt attends ``C'`` alone.

Transfers: the rows are gathered on the host, so the top-k indices go there first. A prefetch
chosen by one forward is used by the next, so nothing in the forward that chooses it waits for it:
the indices are copied without blocking (into pinned memory with CUDA), and the rows are gathered
and sent to the accelerator when the next forward substitutes them, by which time the indices have
long arrived (the decode loop reads its token between the two forwards). With CUDA the host store
is pinned, so the row copy to the accelerator does not block either. Only the non-speculative fetch
(Table 4), which attends its own top-k in the same forward, waits for its indices. Offloading new
tokens (every layer, every step) does not block either with CUDA: each layer's keys and values are
copied into the pinned host store on a side stream (:func:`offload_stream`, after the current
stream's work that produced them), and an event recorded after the copy is what the next reader of
the store waits for (:meth:`HostTokens.wait`: the gather of the next forward's prefetch, or a growth
of the buffer), so the host waits only for a copy a forward old. Without CUDA the same logic runs on
the CPU, host and "device" both being host memory, with plain copies and no streams or events.

Accounting: :meth:`SpeCacheLayer.held_tensors` is what the accelerator holds (codes, scales, zeros,
residual, the current prefetched rows); :meth:`SpeCacheLayer.host_tensors` the FP16 host store.
Sliding-window layers (Gemma-3's local layers) are no SpeCache layers: as in every method they hold
their window in FP16 on the accelerator (:mod:`kvbench.cache.sliding`), nothing offloaded or
prefetched, and store only what the plan stores (never the speculative token).
Defaults (Sec. 5): k = 64, R = 64 (KIVI's 128 less the 64 prefetched, so the accelerator holds as
much FP16 as KIVI), G = 32, 1 bit with SpeCache's zero point.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.cache import KVBenchCache
from kvbench.cache.batch import sequence_caches
from kvbench.cache.blockwise import LogitObserver
from kvbench.cache.fp import FullPrecisionSource
from kvbench.cache.kivi_layout import KIVILayer
from kvbench.cache.layer import StoredTokens, merge_held
from kvbench.cache.sliding import SlidingWindowLayer
from kvbench.cache.source import ConcatSource
from kvbench.config import require
from kvbench.methods.affine_base import AffineKVConfig, kv_bits_label
from kvbench.methods.base import Method, covers_context, register_method

# Host buffers hold the prompt exactly and grow during decoding by this many tokens, or by an eighth
# of what they hold when that is more: geometric growth, so a long decode copies the store O(1)
# times per token (a fixed block would copy all of it every block), with at most an eighth spare.
# The spare capacity is held memory and is accounted.
HOST_BLOCK = 64
HOST_GROWTH = 8


@dataclass
class SpeCacheConfig(AffineKVConfig):
    name: str = "specache"
    topk: int = 64
    residual: int = 64
    zero_point: str = "specache"
    speculative: bool = True

    default_bits: ClassVar[float] = 1.0
    # the per-step prefetch: 20x FP16 in specache_niah's CPU records; host prefetch each step on a GPU
    cost_cpu: ClassVar[float] = 20.0
    cost_gpu: ClassVar[float] = 4.0

    def __post_init__(self):
        super().__post_init__()
        require(
            self.topk >= 0,
            "method.topk",
            self.topk,
            "a token count >= 0 (0: no prefetch, the low-bit cache alone)",
        )
        require(
            self.sink_tokens == 0,
            "method.sink_tokens",
            self.sink_tokens,
            "0 (specache keeps every token in full precision on the host and fetches what it needs)",
        )

    def context_warnings(self, lengths):
        return {
            **super().context_warnings(lengths),
            **covers_context(
                "topk",
                self.topk,
                lengths,
                "every token is fetched in FP16 on top of the low-bit copy, more bytes than FP16",
            ),
        }


@dataclass(frozen=True)
class Plan:
    """What the next forward does in every layer.

    ``store``: how many of the forward's tokens are stored (None: all; the speculative token is
    never stored). ``select``: the query row whose attention chooses the next prefetch (None: none).
    ``use_fetched``: attend ``C' U C_K`` with the current prefetched set, else ``C'`` alone.
    ``exact``: Table 4's non-speculative fetch: attend ``C'``, fetch the ``select`` row's own top-k,
    and recompute attention over ``C' U C_K``.
    """

    store: int | None = None
    select: int | None = -1
    use_fetched: bool = True
    exact: bool = False


PRE_DECODE = Plan(store=0, select=0, use_fetched=False)
SPECULATIVE_STEP = Plan(store=1, select=1, use_fetched=True)
EXACT = Plan(store=None, select=-1, use_fetched=False, exact=True)


_OFFLOAD_STREAMS: dict[int, torch.cuda.Stream] = {}


def offload_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream on which SpeCache copies new tokens to the host, one per CUDA device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _OFFLOAD_STREAMS:
        _OFFLOAD_STREAMS[index] = torch.cuda.Stream(device=index)
    return _OFFLOAD_STREAMS[index]


class HostTokens:
    """FP16 tokens ``[B, H_kv, T, D]`` in host memory (pinned when CUDA exists), in a buffer that
    holds the prompt exactly and grows by ``max(HOST_BLOCK, capacity // HOST_GROWTH)`` tokens.

    Tokens from a CUDA device arrive without blocking (a copy on :func:`offload_stream` into the
    pinned buffer, ``copied`` its event); whatever reads or moves the buffer on the host first calls
    :meth:`wait`. CPU tokens are copied at once, as before."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.buf: torch.Tensor | None = None
        self.n = 0
        self.pin = torch.cuda.is_available()
        self.copied: torch.cuda.Event | None = None  # the last pending device-to-host copy

    def _alloc(self, shape) -> torch.Tensor:
        return torch.empty(shape, dtype=self.dtype, device="cpu", pin_memory=self.pin)

    def wait(self) -> None:
        """Block until the pending copies into the buffer have landed (nothing to do on the CPU)."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None

    def append(self, x: torch.Tensor) -> None:
        t = x.shape[-2]
        if t == 0:
            return
        need = self.n + t
        if self.buf is None or need > self.buf.shape[-2]:
            cap = need if self.buf is None else need + max(HOST_BLOCK, self.buf.shape[-2] // HOST_GROWTH)
            grown = self._alloc((*x.shape[:-2], cap, x.shape[-1]))
            if self.n:
                self.wait()  # the old buffer's last rows may still be arriving
                grown[..., : self.n, :].copy_(self.buf[..., : self.n, :])
            self.buf = grown
        dst = self.buf[..., self.n : need, :]
        if x.device.type == "cuda" and self.buf.is_pinned():
            src = x.to(self.dtype)  # cast on the device, on the current stream
            side = offload_stream(x.device)
            side.wait_stream(torch.cuda.current_stream(x.device))  # after the work that made x
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(side)
            src.record_stream(side)  # its memory is not reused before the copy has read it
            self.copied = event  # the side stream is in order: this event covers earlier copies
        else:
            dst.copy_(x.to(self.dtype))
        self.n = need

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows ``idx [B, H_kv, k]`` (host, int64) of every head: ``[B, H_kv, k, D]`` on the host."""
        self.wait()
        b, h, k = idx.shape
        cap, d = self.buf.shape[-2:]
        # one index_select of whole rows over the flat buffer (a gather's per-element index is slower)
        flat = (idx + torch.arange(b * h).view(b, h, 1) * cap).reshape(-1)
        out = self._alloc((b * h * k, d))
        return torch.index_select(self.buf.view(b * h * cap, d), 0, flat, out=out).view(b, h, k, d)

    def tensors(self) -> list[torch.Tensor]:
        """The buffer, for accounting (its size; its last rows may still be arriving: see wait)."""
        return [] if self.buf is None else [self.buf]


class TopKScores(LogitObserver):
    """The attention probabilities of one query row, summed over the query heads that share each kv
    head, by sequence position: what ArgTopK ranks. Watches a blockwise attention
    (:func:`~kvbench.cache.blockwise.blockwise_attention`) over stored entries whose exact tokens
    follow at positions ``length ..``. The stored entries are in order (``positions`` and
    ``replaced`` None: entry i is position i), at ``positions [B, H_kv, n]`` (-1: hidden), or in
    order with their last k replacing the entries ``replaced [B, H_kv, k]`` (SpeCache's prefetched
    rows, :meth:`SpeCacheLayer.substituted`).

    ``row``: the query position (negative counts from the end), ``q``: the forward's query count,
    ``rep``: query heads per kv head."""

    def __init__(
        self,
        row: int,
        q: int,
        rep: int,
        positions: torch.Tensor | None,
        length: int,
        replaced: torch.Tensor | None = None,
    ):
        self.row = row % q
        self.q, self.rep = q, rep
        self.positions, self.length, self.replaced = positions, length, replaced
        if positions is not None:
            self.stored = positions.shape[-1]
        else:
            self.stored = length + (0 if replaced is None else replaced.shape[-1])
        self.blocks: list[tuple[int, int, torch.Tensor]] = []

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, self.row :: self.q]  # rows ordered (rep, position): [B, H_kv, rep, ...]

    def block(self, start: int, stop: int, logits: torch.Tensor) -> None:
        self.blocks.append((start, stop, self._rows(logits)))

    def done(self, m: torch.Tensor, l: torch.Tensor) -> None:  # noqa: E741
        m, norm = self._rows(m), self._rows(l)  # running max and softmax sum of the chosen row
        norm = norm.clamp_min(torch.finfo(torch.float32).tiny)
        ref = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        b, h = m.shape[:2]
        total = self.length + self.q
        self.scores = torch.zeros(b, h, total + 1, device=m.device)  # a scratch column for hidden entries
        for start, stop, logits in self.blocks:
            self._add(start, stop, (torch.exp(logits - ref) / norm).sum(dim=2))
        self.blocks = []

    def _add(self, start: int, stop: int, probs: torch.Tensor) -> None:
        """Add the probabilities ``[B, H_kv, stop - start]`` of entries ``[start, stop)`` (stored ones,
        then the exact tokens from ``self.stored`` on) at their positions."""
        if start >= self.stored:  # the exact tokens
            first = self.length + start - self.stored
            self.scores[..., first : first + stop - start] += probs
            return
        if self.positions is not None:
            pos = self.positions[..., start:stop]
            total = self.scores.shape[-1] - 1
            self.scores.scatter_add_(-1, torch.where(pos >= 0, pos, total), probs)
            return
        # in order up to `length`; a replaced entry's probability is 0 (its logit is -inf) and its
        # replacement's is added at its position
        mid = min(stop, self.length)
        if start < mid:
            self.scores[..., start:mid] += probs[..., : mid - start]
        if stop > mid:
            idx = self.replaced[..., mid - self.length : stop - self.length]
            self.scores.scatter_add_(-1, idx, probs[..., mid - start :])

    def top(self, k: int, candidates: int) -> torch.Tensor | None:
        """``ArgTopK`` among positions ``0 .. candidates - 1``: ``[B, H_kv, min(k, candidates)]``."""
        k = min(k, candidates)
        if k <= 0:
            return None
        return self.scores[..., :candidates].topk(k, dim=-1).indices


class SpeCacheLayer(KIVILayer):
    """KIVI storage on the accelerator, the FP16 cache on the host, and the prefetched rows."""

    # Its decode reads substitute the prefetched rows and watch the logits for the next top-k, so
    # every part goes through the part reader (TritonReader on backend triton), never KIVI's
    # fused kernel, which would read the low-bit entries of the prefetched rows instead.
    fused_decode = False

    def __init__(self, layer_idx, cfg: SpeCacheConfig, fp_dtype):
        super().__init__(layer_idx, **cfg.layout(fp_dtype))
        self.topk = cfg.topk
        self.default_plan = Plan() if cfg.speculative else EXACT
        self.plan = self.default_plan
        self.host_k, self.host_v = HostTokens(fp_dtype), HostTokens(fp_dtype)
        # The prefetched set: indices [B, H_kv, k] and FP16 rows [B, H_kv, k, D] on the accelerator.
        self.fetched_idx: torch.Tensor | None = None
        self.fetched_k: torch.Tensor | None = None
        self.fetched_v: torch.Tensor | None = None
        # a prefetch whose rows are not gathered yet: (host indices, the event of their copy or None)
        self._requested: tuple[torch.Tensor, torch.cuda.Event | None] | None = None
        self._past_len = 0  # stored tokens before the current forward
        self._stored_now = 0  # tokens of the current forward that were stored
        self.fetches = 0
        self.fetched_entries = 0  # (token, KV head) pairs moved host -> accelerator
        self.fetched_bytes = 0
        self.log: list[torch.Tensor] | None = None  # when a list: every prefetched set attended

    # -- storage ---------------------------------------------------------------------------------
    def append(self, keys, values):
        super().append(keys, values)
        self.host_k.append(keys)
        self.host_v.append(values)

    def host_tensors(self) -> dict[str, list[torch.Tensor]]:
        return {"host_fp": self.host_k.tensors() + self.host_v.tensors()}

    def held_tensors(self):
        self._materialize()
        fetched = [t for t in (self.fetched_k, self.fetched_v) if t is not None]
        return merge_held(super().held_tensors(), {"prefetched": fetched} if fetched else {})

    def prefetch_stats(self) -> tuple[int, int, int]:
        """(fetch operations, (token, KV head) entries fetched, bytes fetched) so far."""
        return self.fetches, self.fetched_entries, self.fetched_bytes

    # -- prefetch --------------------------------------------------------------------------------
    def fetch(self, idx: torch.Tensor, asynchronous: bool) -> None:
        """Make the host's FP16 rows ``idx [B, H_kv, k]`` the prefetched set. ``asynchronous``: for
        the next forward; only the indices move now, without blocking, and the rows follow when that
        forward substitutes them (:meth:`_materialize`). Else now, waiting for the indices."""
        device = self.device
        self.fetched_idx = idx.to(device)
        if asynchronous and idx.device.type == "cuda":
            host = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=True)
            host.copy_(idx, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
            self._requested = (host, copied)
        else:
            self._requested = (idx.to("cpu"), None)
        if not asynchronous:
            self._materialize()
        self.fetches += 1
        self.fetched_entries += idx.numel()
        self.fetched_bytes += 2 * idx.numel() * self.host_k.buf.shape[-1] * self.host_k.dtype.itemsize

    def _materialize(self) -> None:
        """Gather the requested rows on the host and send them to the accelerator (once)."""
        if self._requested is None:
            return
        host_idx, copied = self._requested
        self._requested = None
        if copied is not None:
            copied.synchronize()  # recorded a forward ago: long complete
        rows_k, rows_v = self.host_k.gather(host_idx), self.host_v.gather(host_idx)
        pinned = self.device.type == "cuda" and rows_k.is_pinned()
        self.fetched_k = rows_k.to(self.device, non_blocking=pinned)
        self.fetched_v = rows_v.to(self.device, non_blocking=pinned)

    def substituted(self, low_bit: StoredTokens) -> StoredTokens:
        """``C' U C_K``: the low-bit entries at the prefetched positions hidden, the prefetched FP16
        rows added at their positions."""
        self._materialize()
        if self.log is not None:
            self.log.append(self.fetched_idx.clone())
        if low_bit.positions is not None or low_bit.replaced is not None:
            raise ValueError("specache's low-bit copy holds its tokens in order")
        return StoredTokens(
            ConcatSource([low_bit.keys, FullPrecisionSource(self.fetched_k)]),
            ConcatSource([low_bit.values, FullPrecisionSource(self.fetched_v)]),
            replaced=self.fetched_idx,
        )

    # -- transformers' cache update and attention ------------------------------------------------
    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plan = self.plan
        self._past_len = self.num_tokens
        self._low_bit = self.stored() if self.num_tokens else None  # C', before this forward's tokens
        self._pending = self._low_bit
        if self._low_bit is not None and plan.use_fetched and self.fetched_idx is not None:
            self._pending = self.substituted(self._low_bit)
        n = key_states.shape[-2] if plan.store is None else min(plan.store, key_states.shape[-2])
        if n:
            self.append(key_states[..., :n, :], value_states[..., :n, :])
        self._stored_now = n
        self.num_tokens += n
        return key_states, value_states

    def attend(self, module, query, keys, values, attention_mask, **kwargs):
        plan = self.plan
        stored, self._pending = self._pending, None
        low_bit, self._low_bit = self._low_bit, None
        if stored is None or self.topk == 0 or (plan.select is None and not plan.exact):
            # nothing to choose: the prompt attends itself exactly, k = 0 is C' alone, and a plan
            # without selection attends what update() already substituted
            self._pending = stored
            return super().attend(module, query, keys, values, attention_mask, **kwargs)
        rep = query.shape[1] // keys.shape[1]
        scores = TopKScores(
            plan.select, query.shape[2], rep, stored.positions, self._past_len, stored.replaced
        )
        out = self.attend_stored(
            module, query, stored, keys, values, attention_mask, observer=scores, **kwargs
        )
        if plan.exact:
            idx = scores.top(self.topk, min(len(self.kq), self._past_len))
            if idx is None:
                return out
            self.fetch(idx, asynchronous=False)
            return self.attend_stored(
                module, query, self.substituted(low_bit), keys, values, attention_mask, **kwargs
            )
        idx = scores.top(self.topk, min(len(self.kq), self._past_len + self._stored_now))
        if idx is not None:
            self.fetch(idx, asynchronous=True)
        return out


class SpeCacheCache(KVBenchCache):
    """The layers plus the decode driver's state: the pending speculative token."""

    def __init__(self, layers):
        super().__init__(layers)
        self.speculative: torch.Tensor | None = None  # [1, 1] token id, on the logits' device

    def set_plan(self, plan: Plan | None) -> None:
        """``plan`` for the next forward in every SpeCache layer (None: each layer's default). A
        sliding-window layer (:class:`~kvbench.cache.sliding.SlidingWindowLayer`: its window in
        FP16, nothing offloaded or prefetched) follows only the plan's ``store``, so that the
        speculative token enters no layer."""
        for layer in self.layers:
            if isinstance(layer, SlidingWindowLayer):
                layer.store_limit = None if plan is None else plan.store
            else:
                layer.plan = layer.default_plan if plan is None else plan


def _hand_out(caches: list[SpeCacheCache], tokens: torch.Tensor) -> None:
    """Speculative tokens ``[R, 1]``: row r to ``caches[r]``; one cache (batch 1, or a native batch
    whose layers hold every row) takes them all."""
    if len(caches) == 1:
        caches[0].speculative = tokens
        return
    for r, c in enumerate(caches):
        c.speculative = tokens[r : r + 1]


@register_method("specache")
class SpeCache(Method):
    fp16_prefill = True
    Config = SpeCacheConfig
    # the accelerator's low-bit copy is what read() returns; the FP16 host copy is not device memory
    contract_node = {"bits": 2}
    Layer = SpeCacheLayer

    def new_cache(self, shape, model_dtype) -> SpeCacheCache:
        return SpeCacheCache(self.build_layers(shape, model_dtype))

    def decode_step(self, runner, cache: SpeCacheCache, input_ids: torch.Tensor) -> torch.Tensor:
        """One step of the generate loop (:meth:`ModelRunner.generate`'s method hook).

        ``input_ids [B, 1]`` is the output token T_t just chosen; returns the float32 logits
        ``[B, 1, vocab]`` of T_t, whose argmax is T_{t+1}. Speculative: the first call runs
        pre-decoding (T_1 alone over ``C'``), then every call runs ``[T_t, T'_{t+1}]`` and keeps the
        speculative row's argmax as T'_{t+2}. Non-speculative: one exact-fetch forward of T_t.

        B > 1 (a :class:`~kvbench.cache.batch.SequenceBatchCache`): the plan and the speculative
        token are each sequence's own (on its :func:`~kvbench.cache.batch.sequence_caches` cache),
        so a sequence leaving the batch takes its state with it; the sequences start decoding
        together, so they are in the same phase (pre-decode or speculative) at every step.
        """
        if not self.config.speculative:
            return runner.forward(input_ids, cache)
        caches = sequence_caches(cache)
        # the speculative token stays where the logits are: the next forward takes it from there,
        # and reading it on the host would wait for the whole step
        try:
            if caches[0].speculative is None:
                for c in caches:
                    c.set_plan(PRE_DECODE)
                first = runner.forward(input_ids, cache)[:, -1].argmax(-1, keepdim=True)
                _hand_out(caches, first)
            for c in caches:
                c.set_plan(SPECULATIVE_STEP)
            speculative = caches[0].speculative
            if len(caches) > 1:
                speculative = torch.cat([c.speculative for c in caches])
            pair = torch.cat([input_ids.to(speculative.device), speculative], dim=1)
            logits = runner.forward(pair, cache)
        finally:
            for c in caches:
                c.set_plan(None)
        _hand_out(caches, logits[:, 1].argmax(-1, keepdim=True))
        return logits[:, :1]

    def base_label(self) -> str:
        c = self.config
        zp = "-minmax" if c.zero_point == "minmax" and 1.0 in (c.key_bits, c.value_bits) else ""
        return f"specache-{kv_bits_label(c)}{zp}-k{c.topk}" + ("" if c.speculative else "-exact")
