"""Token eviction: keep a budget of tokens in full precision and drop the rest from memory.

This is the storage the eviction baselines (``streamingllm``, ``h2o``, ``snapkv``, ``random_prune``)
share; each policy only says which tokens it prefers. The comparison they serve (SemKV, arXiv
2608.28911, Sec. 1 contribution 4) sets "keep fewer tokens in FP16" against "keep every token at low
precision" at the same number of bytes.

Storage. Kept keys and values are ``[B, H_kv, n, D]`` tensors in ``fp_dtype`` with the same number
``n`` of kept tokens in every kv head (each head may keep different tokens). Eviction gathers the
kept rows into new, smaller tensors, so the memory report (from :meth:`held_tensors`) shrinks.
``num_tokens`` stays the logical length of the sequence: the model reads ``get_seq_length`` for the
RoPE position of the next token, and keys are stored post-RoPE, so every kept token keeps the
position it was computed at and later tokens get their logical positions.

Selection. With ``n`` tokens held, a budget ``b`` and a recent window ``w <= b``, the last ``w``
tokens are always kept, and the ``b - w`` best of the ``n - w`` earlier ones (the candidates) by
the policy's score, per kv head (:func:`select_kept`). Nothing is evicted while ``n <= b``.

Order (the read rule of :mod:`kvbench.cache.layer`): :meth:`EvictionLayer.update` appends the new
tokens and returns the kept tokens followed by the new ones, exact; :meth:`EvictionLayer.attend`
computes this forward's attention over exactly those keys and only then evicts. In prefill the
whole prompt is therefore attended exactly before it is compressed; every later query sees only the
kept tokens. Policies that evict only at prefill (SnapKV, random pruning) append decode tokens
without eviction; policies that evict during decoding (StreamingLLM, H2O) return to the budget
after every forward.

Masks. Evicted tokens have no place in the kept tensors, so the model's mask (built for the logical
length) is rebuilt for the kept keys: every kept token comes from an earlier forward and is visible to
every query of this one; the new tokens keep the model's own mask among themselves. A mask that hides
some earlier token (left padding) cannot be mapped without holding positions and is refused.
Sliding-window layers never get here: in every method they hold their window in full precision
(:mod:`kvbench.cache.sliding`), and eviction applies to the full-attention layers only.

Shared prefills (opt-in, for measurements). An instrument that replays one layer's captured tensors
through several caches that differ only in their budget (the hit-rate task) has every cache compute
the same prompt attention. Inside :func:`shared_prefill`, a policy that routes its first forward
through :func:`remembered_prefill` computes it once and hands later caches a copy of the same
result; outside it (every run) the computation happens as before, every time.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbench.cache.layer import KVLayer


def budget_tokens(budget: int | float, prompt_len: int) -> int:
    """Tokens kept for a prompt of ``prompt_len``: an int budget as is, a float as a fraction of the
    prompt (floored, at least 1)."""
    if isinstance(budget, float):
        # the small slack keeps e.g. 0.57 * 100 = 56.999... at 57
        return max(1, math.floor(budget * prompt_len + 1e-9))
    return budget


def kept_mask(
    attention_mask: torch.Tensor | None, logical_past: int, n_past: int, q: int, device
) -> torch.Tensor | None:
    """Boolean mask ``[B|1, H|1, q, n_past + q]`` over the kept keys followed by the new ones (True:
    attended), from the model's mask over ``logical_past + q`` logical positions. ``None`` when every
    key may be attended by the single query."""
    if attention_mask is None:
        if q == 1:
            return None
        # the causal rule of the newest q tokens, aligned bottom-right
        allowed = (
            torch.arange(n_past + q, device=device)[None, :]
            <= n_past + torch.arange(q, device=device)[:, None]
        )
        return allowed[None, None]
    m = attention_mask[..., : logical_past + q]
    if m.dtype != torch.bool:
        m = m == 0  # additive: 0 where attended, a large negative number elsewhere
    if logical_past and not bool(m[..., :logical_past].all()):
        raise ValueError(
            "eviction layers hold no token positions: a mask that hides earlier tokens "
            "(padding, sliding windows) cannot be applied to the kept tokens"
        )
    new = m[..., logical_past:]
    past = torch.ones(*new.shape[:-1], n_past, dtype=torch.bool, device=new.device)
    return torch.cat([past, new], dim=-1)


def grouped_logits(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None, scaling: float):
    """``softmax`` logits ``[B, H_kv, rep, q, n]`` in float32 for ``query [B, H, q, D]`` and
    ``keys [B, H_kv, n, D]``: query head ``g * rep + r`` reads kv head ``g`` (transformers'
    ``repeat_kv`` order). ``mask`` is boolean ``[B|1, H|1, q, n]`` or None (all attended)."""
    b, h, q, d = query.shape
    hk = keys.shape[1]
    rep = h // hk
    logits = (
        torch.einsum("bgrqd,bgkd->bgrqk", query.float().reshape(b, hk, rep, q, d), keys.float()) * scaling
    )
    if mask is not None:
        m = mask.reshape(mask.shape[0], hk, rep, *mask.shape[-2:]) if mask.shape[1] == h else mask[:, :, None]
        logits = logits.masked_fill(~m, -math.inf)
    return logits


def eager_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    query_chunk: int,
    on_weights: Callable[[torch.Tensor], None],
) -> torch.Tensor:
    """``softmax(Q K^T * scaling + mask) V`` with the weights in hand, ``query_chunk`` queries at a
    time (bounds the ``[B, H, c, n]`` weight block). ``on_weights`` receives each block as
    ``[B, H_kv, rep, c, n]`` float32. Returns ``[B, q, H, D]`` (transformers' attention output layout)
    in the query's dtype."""
    b, h, q, d = query.shape
    out = []
    for s in range(0, q, query_chunk):
        e = min(s + query_chunk, q)
        m = None if mask is None else mask[..., s:e, :]
        w = torch.softmax(grouped_logits(query[:, :, s:e], keys, m, scaling), dim=-1)
        on_weights(w)
        out.append(torch.einsum("bgrqk,bgkd->bgrqd", w, values.float()).reshape(b, h, e - s, d))
    return torch.cat(out, dim=2).transpose(1, 2).contiguous().to(query.dtype)


def select_kept(scores: torch.Tensor, budget: int, window: int) -> torch.Tensor:
    """Indices ``[B, H_kv, budget]`` (ascending) of the tokens kept out of ``n = m + window``: the
    last ``window`` tokens, and the ``budget - window`` candidates with the largest
    ``scores [B, H_kv, m]`` (ties to the earlier token)."""
    b, hk, m = scores.shape
    recent = torch.arange(m, m + window, device=scores.device).expand(b, hk, window)
    top = stable_topk(scores, budget - window)
    return torch.cat([top, recent], dim=-1).sort(dim=-1).values


def stable_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the ``k`` largest entries along the last axis, equal scores going to the earlier
    token, so a selection never depends on the sort implementation."""
    order = torch.sort(scores.float(), dim=-1, descending=True, stable=True).indices
    return order[..., :k]


class PrefillMemo:
    """The last prefill computed inside a :func:`shared_prefill` block: what it was computed from and
    its result. ``computed``/``reused`` count the misses and hits."""

    def __init__(self):
        self.entry: tuple | None = None  # (tag, scaling, inputs, mask, held inputs, result)
        self.computed = 0
        self.reused = 0


_MEMO: contextvars.ContextVar[PrefillMemo | None] = contextvars.ContextVar("kvbench_prefill", default=None)


@contextmanager
def shared_prefill() -> Iterator[PrefillMemo]:
    """Inside the block, :func:`remembered_prefill` reuses the result of a computation on the very
    same tensors. It holds one result (the last) and its inputs; it is dropped at the end."""
    memo = PrefillMemo()
    token = _MEMO.set(memo)
    try:
        yield memo
    finally:
        _MEMO.reset(token)


def _identity(t: torch.Tensor) -> tuple:
    # same memory, same layout, not written since (views share their base's version counter)
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, t._version)


def remembered_prefill(
    tag,
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scaling: float,
    compute: Callable[[], tuple[torch.Tensor, ...]],
) -> tuple[torch.Tensor, ...]:
    """``compute()``, or inside :func:`shared_prefill` a copy of its result when the last call had the
    same ``tag`` (what else the computation depends on, e.g. the policy and its query chunk),
    ``scaling``, the same ``query``/``keys``/``values`` tensors (identity: storage, layout and
    version, not values) and an equal ``mask``. Outside the block: ``compute()``."""
    memo = _MEMO.get()
    if memo is None:
        return compute()
    inputs = (_identity(query), _identity(keys), _identity(values))
    if memo.entry is not None:
        e_tag, e_scaling, e_inputs, e_mask, _held, result = memo.entry
        same_mask = (e_mask is None and mask is None) or (
            e_mask is not None
            and mask is not None
            and e_mask.shape == mask.shape
            and e_mask.dtype == mask.dtype
            and e_mask.device == mask.device
            and torch.equal(e_mask, mask)
        )
        if e_tag == tag and e_scaling == scaling and e_inputs == inputs and same_mask:
            memo.reused += 1
            return tuple(t.clone() for t in result)
    result = compute()
    memo.computed += 1
    # the inputs are held so that their memory cannot be reused by other tensors while remembered
    held = (query, keys, values)
    kept = None if mask is None else mask.clone()
    memo.entry = (tag, scaling, inputs, kept, held, tuple(t.clone() for t in result))
    return result


class EvictionLayer(KVLayer):
    """A layer that keeps at most ``budget`` tokens (plus, for prefill-only policies, the tokens
    decoded since). Subclasses set :attr:`evicts_in_decode`, :meth:`window_size` and
    :meth:`candidate_scores`, and may override :meth:`attention` (H2O needs the weights of every
    query).

    ``budget_of(layer, prompt_len)`` resolves the budget at the first forward (a fraction of the
    prompt, a token count, or the bytes of a matched quantized cache)."""

    evicts_in_decode: bool = False
    query_chunk: int = 256
    # Instrumentation, off in runs: keep ``positions`` ([B, H_kv, n] int64, the logical position of
    # every kept token) for measurements that ask which tokens a policy kept (the hit-rate task).
    # They are bookkeeping of the measurement, not part of the method, and are not accounted.
    record_positions: bool = False

    def __init__(self, layer_idx: int, fp_dtype: torch.dtype, budget_of: Callable[[EvictionLayer, int], int]):
        super().__init__(layer_idx)
        self.fp_dtype = fp_dtype
        self.budget_of = budget_of
        self.budget: int | None = None
        self.prompt_len = 0  # tokens of the first forward, which resolved the budget
        self.k: torch.Tensor | None = None  # [B, H_kv, n, D], fp_dtype
        self.v: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None  # with record_positions
        self._unattended = False  # tokens appended by a forward whose attention has not run yet
        self._prefill_pending = False  # the first forward's tokens await their compression

    # -- storage ------------------------------------------------------------------------------------
    @property
    def kept(self) -> int:
        return 0 if self.k is None else self.k.shape[-2]

    def append(self, keys, values):
        keys, values = keys.to(self.fp_dtype), values.to(self.fp_dtype)
        self.k = keys if self.k is None else torch.cat([self.k, keys], dim=-2)
        self.v = values if self.v is None else torch.cat([self.v, values], dim=-2)
        if self.record_positions:
            b, h, t, _ = keys.shape
            new = torch.arange(self.num_tokens, self.num_tokens + t, device=keys.device).expand(b, h, t)
            self.positions = new if self.positions is None else torch.cat([self.positions, new], dim=-1)

    def read(self):
        return self.k, self.v

    def held_tensors(self):
        return {"fp": [t for t in (self.k, self.v) if t is not None]}

    def bytes_per_token(self) -> int:
        """Bytes one kept token costs this layer (keys and values of every kv head, plus any
        per-token state the policy holds): what a matched-memory budget divides by."""
        return 2 * self.batch_size * self.num_kv_heads * self.head_dim * self.fp_dtype.itemsize

    def keep(self, idx: torch.Tensor) -> None:
        """Keep the tokens ``idx [B, H_kv, k]`` and free the rest (new, smaller tensors)."""
        gather = idx[..., None].expand(-1, -1, -1, self.head_dim).to(self.k.device)
        self.k = self.k.gather(2, gather)
        self.v = self.v.gather(2, gather)
        if self.positions is not None:
            self.positions = self.positions.gather(2, idx.to(self.positions.device))

    # -- policy ---------------------------------------------------------------------------------
    def window_size(self, budget: int) -> int:
        """Newest tokens always kept, at most ``budget``."""
        raise NotImplementedError

    def candidate_scores(self, query, keys, mask, scaling, n_candidates: int) -> torch.Tensor:
        """``[B, H_kv, n_candidates]``: larger is kept first, for the tokens before the window."""
        raise NotImplementedError

    def attention(self, module, query, keys, values, mask, **kwargs):
        """This forward's attention over the kept and new keys; SDPA unless a policy needs weights."""
        return sdpa_attention_forward(module, query, keys, values, mask, **kwargs)

    # -- cache protocol ------------------------------------------------------------------------------
    def _would_evict(self) -> bool:
        prefill_done = self.num_tokens > 0 and self.budget is not None
        return prefill_done and self.kept > self.budget and (self.evicts_in_decode or self._prefill_pending)

    def update(self, key_states, value_states, *args, **kwargs):
        if self._unattended and self._would_evict():
            raise RuntimeError(
                "an eviction layer evicts after attention: load the model with "
                "attn_implementation='kvbench' so that KVLayer.attend runs"
            )
        if self.num_tokens == 0:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.prompt_len = key_states.shape[-2]
            self.budget = self.budget_of(self, self.prompt_len)
            self._prefill_pending = True
        self._unattended = True
        return super().update(key_states, value_states, *args, **kwargs)

    def attend(self, module, query, keys, values, attention_mask, **kwargs):
        """``query [B, H, q, D]``; ``keys``/``values [B, H_kv, n, D]``: the kept tokens, then the
        ``q`` new ones, as :meth:`update` returned them."""
        if kwargs.get("softcap") is not None:
            raise ValueError("eviction layers do not support attention softcapping")
        self._unattended = False
        q, n = query.shape[-2], keys.shape[-2]
        mask = kept_mask(attention_mask, self.num_tokens - q, n - q, q, query.device)
        out = self.attention(module, query, keys, values, mask, **kwargs)
        if self._prefill_pending or self.evicts_in_decode:
            self.evict(query, keys, mask, kwargs.get("scaling") or module.scaling)
        self._prefill_pending = False
        return out

    @torch.no_grad()
    def evict(self, query, keys, mask, scaling) -> None:
        n = self.kept
        if n <= self.budget:
            return
        window = min(self.window_size(self.budget), self.budget)
        if self.budget > window:
            scores = self.candidate_scores(query, keys, mask, scaling, n - window)
        else:  # nothing to rank: the window is the whole budget
            scores = torch.zeros(self.batch_size, self.num_kv_heads, n - window, device=self.k.device)
        self.keep(select_kept(scores, self.budget, window))
