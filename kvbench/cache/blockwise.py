"""Attention of a query block over stored tokens, block by block, without materialising the cache.

The stored keys and values are :class:`~kvbench.cache.source.TokenSource` s (what the cache holds,
dequantized one range at a time). :func:`blockwise_attention` walks the stored tokens in blocks of
``block_size`` and merges the blocks with an online softmax (running max ``m``, running sum ``l``
and a rescaled accumulator, float32):

    m' = max(m, max_t s_t),   l' = l e^(m - m') + sum_t e^(s_t - m'),
    acc' = acc e^(m - m') + sum_t e^(s_t - m') v_t,       out = acc / l

so a decode step needs O(block) transient memory instead of O(cache). Read rule (the one
:mod:`kvbench.cache.layer` documents): stored tokens come from the sources and every query sees all
of them; the current forward's own tokens (``exact_keys``/``exact_values``, full precision) are
attended last, causally among themselves. Each block is two source operations, ``scores`` and
``mix``.

Decode steps take the single-call path (:func:`single_call_attention`) instead of the block loop:
every stored part (a :class:`~kvbench.cache.source.ConcatSource` is read part by part) answers
``scores`` over all its tokens in one call, the logits of every part and of the exact tokens get one
softmax, and every part answers ``mix`` in one call, so the number of calls per layer does not grow
with the context. It runs when the logits of all stored tokens fit :data:`SINGLE_CALL_BUDGET` (a
decode step's few query rows), the block loop otherwise (prefill chunks over a long cache). The
sources' own ``scores``/``mix`` over the whole part are the reference; a ``reader``
(:class:`PartReader`: the compiled CPU kernels of :mod:`kvbench.kernels.cpu`, or Triton's on
CUDA) may answer a part instead, reading its bytes in place.

Masks: ``attention_mask`` may be transformers' boolean (True: attend) or additive float mask of shape
``[B or 1, 1 or H_q, q, T + q]`` over the stored tokens followed by the current ones; when given, it
replaces the built-in causal rule of the current tokens. Rows that see no token at all return 0.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Protocol

import torch

from kvbench.cache.source import ConcatSource, TokenSource
from kvbench.env import env_positive_int

DEFAULT_BLOCK_SIZE = 1024
BLOCK_SIZE_ENV = "KVBENCH_BLOCK_SIZE"
# Most bytes of float32 logits the single-call path holds at once (all stored tokens x query rows x
# kv heads); a decode step over 8K tokens of the default model needs 0.3 MB.
SINGLE_CALL_BUDGET = 4 << 20
# A decode step (at most DECODE_ROWS query positions: SpeCache's speculative step has two) always
# reads in single calls up to this much: its logits are a small fraction of the cache it reads
# (32K tokens of a Llama-3.1-8B layer: 4 MB of logits per query position against 64 MB of fp16 KV),
# and the block loop would make its calls grow with the context.
DECODE_ROWS = 2
DECODE_BUDGET = 256 << 20


def block_ranges(num_tokens: int, block_size: int, cuts: Sequence[int] = ()) -> list[tuple[int, int]]:
    """``[start, stop)`` ranges of at most ``block_size`` tokens covering ``[0, num_tokens)``, cut at
    every index in ``cuts`` (so no range straddles two parts of a source)."""
    edges = sorted({0, num_tokens, *(c for c in cuts if 0 < c < num_tokens)})
    ranges = []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        ranges.extend((s, min(s + block_size, hi)) for s in range(lo, hi, block_size))
    return ranges


def _mask_rows(mask: torch.Tensor, heads: int, n_rep: int) -> torch.Tensor:
    """``[B', 1 or H_q, q, n]`` -> ``[B', 1 or H_kv, n_rep * q, n]`` in the query-row order used here."""
    b, h, q, n = mask.shape
    if h == 1:
        return mask[:, :, None].expand(b, 1, n_rep, q, n).reshape(b, 1, n_rep * q, n)
    return mask.reshape(b, heads, n_rep * q, n)


def _as_additive(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, -math.inf)
    return mask.float()


class _OnlineSoftmax:
    """Running ``(m, l, acc)`` over blocks of logits ``[B, H_kv, M, n]``, float32."""

    def __init__(self, shape: tuple[int, int, int], head_dim: int, device):
        b, h, m = shape
        self.m = torch.full((b, h, m, 1), -math.inf, device=device)
        self.l = torch.zeros(b, h, m, 1, device=device)
        self.acc = torch.zeros(b, h, m, head_dim, device=device)

    def weights(self, logits: torch.Tensor) -> torch.Tensor:
        """Fold the block's max into the state, rescale, and return its unnormalized weights."""
        m_new = torch.maximum(self.m, logits.amax(dim=-1, keepdim=True))
        # a row that has seen only -inf so far keeps reference 0, so exp() gives 0, not NaN
        ref = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(logits - ref)
        alpha = torch.exp(self.m - ref)
        self.l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
        self.acc.mul_(alpha)
        self.m = m_new
        return p

    def add(self, mixed: torch.Tensor) -> None:
        self.acc.add_(mixed)

    def result(self) -> torch.Tensor:
        return self.acc / torch.where(self.l > 0, self.l, torch.ones_like(self.l))


def _positional_mask(positions: torch.Tensor, mask: torch.Tensor | None, rows: int) -> torch.Tensor:
    """Additive ``[B, H_kv, rows or 1, n]`` bias of stored tokens at ``positions [B, H_kv, n]``: -inf
    where the position is -1, else the mask's column at that position (0 without a mask)."""
    hidden = positions < 0
    if mask is None:
        zero = torch.zeros((), device=positions.device)
        return torch.where(hidden, -math.inf, zero)[:, :, None, :]
    return _mask_columns(mask, positions.clamp(min=0), rows).masked_fill(hidden[:, :, None, :], -math.inf)


def _mask_columns(mask: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """``[B, H_kv, rows, n]``: the columns ``index [B, H_kv, n]`` of ``mask [B or 1, 1 or H_kv,
    rows, T + q]``, per kv head."""
    b, h, n = index.shape
    m = mask.expand(max(b, mask.shape[0]), h, rows, mask.shape[-1])
    return m.gather(-1, index[:, :, None, :].expand(m.shape[0], h, rows, n))


def replaced_positions(replaced: torch.Tensor, stored: int) -> torch.Tensor:
    """The ``positions [B, H_kv, stored]`` of a store whose last k entries replace the entries
    ``replaced [B, H_kv, k]`` of the first ``stored - k`` (held in order): the replaced ones -1, the
    replacements at their positions."""
    b, h, k = replaced.shape
    n = stored - k
    seq = torch.arange(n, device=replaced.device).expand(b, h, n)
    return torch.cat([seq.scatter(-1, replaced, -1), replaced], dim=-1)


def _replace_logits(
    logits: torch.Tensor, replaced: torch.Tensor, mask: torch.Tensor | None, rows: int
) -> torch.Tensor:
    """Logits ``[B, H_kv, rows, n + k]`` of in-order entries followed by k replacements of the entries
    ``replaced [B, H_kv, k]``: the mask's columns added (the replacements take their entries'), the
    replaced entries hidden. In place."""
    b, h, _, total = logits.shape
    k = replaced.shape[-1]
    n = total - k
    if mask is not None:
        logits[..., :n] += mask[..., :n]
        logits[..., n:] += _mask_columns(mask, replaced, rows)
    return logits.scatter_(-1, replaced[:, :, None, :].expand(b, h, rows, k), -math.inf)


class LogitObserver:
    """Sees what :func:`blockwise_attention` computes, for methods that choose tokens by attention
    (SpeCache's top-k): :meth:`block` gets each block's scaled, masked logits ``[B, H_kv, rows, n]``
    (rows ordered ``(rep, position)``) for stored tokens ``[start, stop)`` and then for the exact
    tokens (``start`` = T); :meth:`done` the final running max ``m`` and sum ``l`` ``[B, H_kv, rows,
    1]``, so that a probability is ``exp(logit - m) / l``. The default does nothing."""

    def block(self, start: int, stop: int, logits: torch.Tensor) -> None:
        pass

    def done(self, m: torch.Tensor, l: torch.Tensor) -> None:  # noqa: E741
        pass


def _exact_logits(
    qf: torch.Tensor, exact_keys: torch.Tensor, mask: torch.Tensor | None, q: int
) -> torch.Tensor:
    """Logits ``[B, H_kv, rows, t]`` of the scaled query rows ``qf`` over this forward's own ``t``
    tokens: the mask's last ``t`` columns when given, else causal among the ``q`` queries (query i
    is exact token ``t - q + i``)."""
    logits = torch.matmul(qf, exact_keys.float().transpose(-1, -2))
    t = exact_keys.shape[-2]
    if mask is not None:
        return logits + mask[..., mask.shape[-1] - t :]
    if t > 1:
        own = torch.arange(qf.shape[-2], device=qf.device) % q + (t - q)
        hidden = torch.arange(t, device=qf.device)[None, :] > own[:, None]
        logits = logits.masked_fill(hidden, -math.inf)
    return logits


def blockwise_attention(
    query: torch.Tensor,
    keys: TokenSource | None,
    values: TokenSource | None,
    scaling: float,
    block_size: int = DEFAULT_BLOCK_SIZE,
    exact_keys: torch.Tensor | None = None,
    exact_values: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    observer: LogitObserver | None = None,
) -> torch.Tensor:
    """Attention of ``query`` over stored tokens and the current forward's own tokens.

    Args:
        query: ``[B, H_q, q, D]``, ``H_q = H_kv * n_rep``; query head h reads kv head ``h // n_rep``
            (transformers' ``repeat_kv`` order).
        keys, values: sources of the T stored tokens (equal ``num_tokens``), or None when nothing is
            stored yet.
        scaling: logit scale (``D ** -0.5``).
        block_size: stored tokens per block (blocks are also cut where a source changes parts).
        exact_keys, exact_values: ``[B, H_kv, q, D]`` (any float dtype), the tokens of this forward,
            attended in full precision; query i sees exact tokens ``0..i``.
        attention_mask: optional ``[B or 1, 1 or H_q, q, T + q]`` boolean (True: attend) or additive
            float mask; replaces the causal rule of the exact tokens.
        positions: None when the stored tokens are held in sequence order (stored token i is
            position i). Else int64 ``[B, H_kv, T]``: the sequence position of each stored token per
            kv head (sources that hold a head's tokens out of order: outlier pools, two-level
            stores, prefetched rows), or -1 for a stored entry that is never attended (a quantized
            copy superseded by an exact one). The mask's stored columns are indexed by position.
        observer: optional :class:`LogitObserver`, shown every block's masked logits (stored
            blocks, then the exact tokens) and the final softmax state.

    Returns:
        ``[B, q, H_q, D]`` in ``query.dtype`` (the layout transformers' attention functions return).
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if (keys is None) != (values is None) or (exact_keys is None) != (exact_values is None):
        raise ValueError("keys and values (and exact_keys and exact_values) must be given together")
    stored = 0 if keys is None else keys.num_tokens
    if keys is not None and values.num_tokens != stored:
        raise ValueError(f"keys hold {stored} tokens but values hold {values.num_tokens}")
    if stored == 0 and exact_keys is None:
        raise ValueError("nothing to attend: no stored tokens and no exact tokens")
    b, hq, q, d = query.shape
    hkv = exact_keys.shape[1] if exact_keys is not None else keys.num_heads
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    n_rep = hq // hkv
    rows = n_rep * q
    qf = (query.float() * scaling).reshape(b, hkv, rows, d)  # rows ordered (rep, position)
    if attention_mask is not None:
        mask = _as_additive(_mask_rows(attention_mask, hkv, n_rep))
    if positions is not None:
        if tuple(positions.shape) != (b, hkv, stored):
            raise ValueError(
                f"positions must be [B, H_kv, T] = {(b, hkv, stored)}, got {tuple(positions.shape)}"
            )
        positions = positions.long()
    state = _OnlineSoftmax((b, hkv, rows), d, query.device)
    if stored:
        cuts = set(keys.boundaries()) | set(values.boundaries())
        for start, stop in block_ranges(stored, block_size, sorted(cuts)):
            logits = keys.scores(qf, start, stop)
            if positions is not None:
                logits = logits + _positional_mask(
                    positions[..., start:stop], mask if attention_mask is not None else None, rows
                )
            elif attention_mask is not None:
                logits = logits + mask[..., start:stop]
            if observer is not None:
                observer.block(start, stop, logits)
            p = state.weights(logits)
            state.add(values.mix(p, start, stop))
    if exact_keys is not None:
        logits = _exact_logits(qf, exact_keys, mask if attention_mask is not None else None, q)
        if observer is not None:
            observer.block(stored, stored + exact_keys.shape[-2], logits)
        p = state.weights(logits)
        state.add(torch.matmul(p, exact_values.float()))
    if observer is not None:
        observer.done(state.m, state.l)
    out = state.result().reshape(b, hq, q, d)
    return out.transpose(1, 2).contiguous().to(query.dtype)


class PartReader(Protocol):
    """Answers whole-part ``scores``/``mix`` for the parts it covers (compiled kernels), None for the
    others, which then run their torch reference."""

    def scores(self, part: TokenSource, query: torch.Tensor) -> torch.Tensor | None: ...

    def mix(self, part: TokenSource, weights: torch.Tensor) -> torch.Tensor | None: ...


def source_parts(source: TokenSource) -> list[TokenSource]:
    """The stored parts of a source in token order (a :class:`ConcatSource` flattened)."""
    if isinstance(source, ConcatSource):
        return [leaf for p in source.parts for leaf in source_parts(p)]
    return [source]


def part_scores(parts: list[TokenSource], query: torch.Tensor, reader: PartReader | None) -> torch.Tensor:
    """``[B, H_kv, M, T]``: the logits of every part, one call each, concatenated along tokens."""
    pieces = []
    for part in parts:
        out = reader.scores(part, query) if reader is not None else None
        pieces.append(out if out is not None else part.scores(query, 0, part.num_tokens))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


def part_mix(parts: list[TokenSource], weights: torch.Tensor, reader: PartReader | None) -> torch.Tensor:
    """``[B, H_kv, M, D]``: ``weights [B, H_kv, M, T]`` times the values of every part, summed."""
    total, start = None, 0
    for part in parts:
        w = weights[..., start : start + part.num_tokens]
        start += part.num_tokens
        out = reader.mix(part, w) if reader is not None else None
        if out is None:
            out = part.mix(w, 0, part.num_tokens)
        total = out if total is None else total.add_(out)
    return total


def fits_single_call(query: torch.Tensor, num_kv_heads: int, stored: int) -> bool:
    """Whether the logits of ``query [B, H_q, q, D]`` over ``stored`` tokens fit the budget."""
    b, hq, q, _ = query.shape
    logits = b * hq * q * stored * 4
    return logits <= SINGLE_CALL_BUDGET or q <= DECODE_ROWS and logits <= DECODE_BUDGET


def single_call_attention(
    query: torch.Tensor,
    keys: TokenSource,
    values: TokenSource,
    scaling: float,
    exact_keys: torch.Tensor | None = None,
    exact_values: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    observer: LogitObserver | None = None,
    reader: PartReader | None = None,
    replaced: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`blockwise_attention` (same arguments, same read rule, same result up to float
    reassociation) with one ``scores`` and one ``mix`` call per stored part and one softmax over
    all logits, stored and exact; ``reader`` may answer parts with compiled kernels. The observer
    sees the stored logits as one block ``[0, T)``, then the exact ones.

    ``replaced``: instead of ``positions``, int64 ``[B, H_kv, k]``: the last k stored entries are
    exact copies of the entries ``replaced`` of the first ``T - k``, which are held in sequence order
    (SpeCache's prefetched rows over its low-bit copy): the replaced entries are hidden with one
    scatter instead of a positional mask over every entry (:func:`replaced_positions` is the same
    store in ``positions`` form).

    ``hidden``: bool ``[T]`` on the device, True at stored entries not written yet (static stores
    read over their whole capacity, :mod:`kvbench.cache.static`); they get no weight, by a mask
    computed on the device, so the calls and their shapes do not depend on how many are written."""
    stored = keys.num_tokens
    if values.num_tokens != stored:
        raise ValueError(f"keys hold {stored} tokens but values hold {values.num_tokens}")
    if (exact_keys is None) != (exact_values is None):
        raise ValueError("exact_keys and exact_values must be given together")
    b, hq, q, d = query.shape
    hkv = keys.num_heads
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    n_rep = hq // hkv
    rows = n_rep * q
    qf = (query.float() * scaling).reshape(b, hkv, rows, d)  # rows ordered (rep, position)
    mask = _as_additive(_mask_rows(attention_mask, hkv, n_rep)) if attention_mask is not None else None
    if positions is not None:
        if tuple(positions.shape) != (b, hkv, stored):
            raise ValueError(
                f"positions must be [B, H_kv, T] = {(b, hkv, stored)}, got {tuple(positions.shape)}"
            )
    if replaced is not None:
        if positions is not None:
            raise ValueError("give positions or replaced, not both")
        if replaced.shape[:2] != (b, hkv) or replaced.shape[-1] > stored:
            raise ValueError(
                f"replaced must be [B, H_kv, k <= T] = {(b, hkv)} + (k,), got {tuple(replaced.shape)}"
            )
    key_parts, value_parts = source_parts(keys), source_parts(values)
    logits = part_scores(key_parts, qf, reader)
    if positions is not None:
        logits = logits + _positional_mask(positions.long(), mask, rows)
    elif replaced is not None:
        logits = _replace_logits(logits, replaced.long(), mask, rows)
    elif mask is not None:
        logits = logits + mask[..., :stored]
    if hidden is not None:
        logits = logits.masked_fill(hidden, -math.inf)
    if observer is not None:
        observer.block(0, stored, logits)
    every = [logits]
    if exact_keys is not None:
        exact = _exact_logits(qf, exact_keys, mask, q)
        if observer is not None:
            observer.block(stored, stored + exact_keys.shape[-2], exact)
        every.append(exact)
    every = every[0] if len(every) == 1 else torch.cat(every, dim=-1)
    m = every.amax(dim=-1, keepdim=True)
    # a row that sees no token keeps reference 0, so exp() gives 0, not NaN
    ref = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(every - ref)
    l = p.sum(dim=-1, keepdim=True)  # noqa: E741
    if observer is not None:
        observer.done(m, l)
    out = part_mix(value_parts, p[..., :stored], reader)
    if exact_keys is not None:
        out = out.add_(torch.matmul(p[..., stored:], exact_values.float()))
    out = out / torch.where(l > 0, l, torch.ones_like(l))
    return out.reshape(b, hq, q, d).transpose(1, 2).contiguous().to(query.dtype)


def configured_block_size() -> int:
    """Stored tokens per attention block: ``KVBENCH_BLOCK_SIZE`` from the environment, else 1024.
    A ConfigError naming the variable when it is not a positive integer; a run checks it up front
    (:func:`kvbench.run.check_environment`)."""
    return env_positive_int(BLOCK_SIZE_ENV, DEFAULT_BLOCK_SIZE, "stored tokens per attention block")


def blockwise_attention_forward(
    module,
    query: torch.Tensor,
    keys: TokenSource | None,
    values: TokenSource | None,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    block_size: int | None = None,
    exact_keys: torch.Tensor | None = None,
    exact_values: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    observer: LogitObserver | None = None,
    reader: PartReader | None = None,
    replaced: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """:func:`blockwise_attention` in the shape of transformers' attention functions: returns
    ``(attn_output [B, q, H_q, D], None)`` so that a layer's ``attend`` can return it directly.
    ``block_size`` defaults to ``KVBENCH_BLOCK_SIZE`` from the environment, else 1024. When the
    logits of all stored tokens fit :data:`SINGLE_CALL_BUDGET` (decode steps) and no block size is
    asked for (neither the argument nor ``KVBENCH_BLOCK_SIZE``), :func:`single_call_attention`
    runs instead, with ``reader``'s kernels. ``replaced`` and ``hidden``: see
    :func:`single_call_attention`; the block loop takes them in ``positions`` form."""
    if scaling is None:
        scaling = module.scaling
    if (
        block_size is None
        and not os.environ.get(BLOCK_SIZE_ENV)
        and keys is not None
        and keys.num_tokens
        and fits_single_call(query, keys.num_heads, keys.num_tokens)
    ):
        out = single_call_attention(
            query,
            keys,
            values,
            scaling,
            exact_keys,
            exact_values,
            attention_mask,
            positions,
            observer,
            reader,
            replaced,
            hidden,
        )
        return out, None
    if replaced is not None:
        if positions is not None:
            raise ValueError("give positions or replaced, not both")
        positions = replaced_positions(replaced.long(), keys.num_tokens)
    if hidden is not None:
        if positions is not None:
            raise ValueError("give positions or hidden, not both")
        order = torch.arange(keys.num_tokens, device=query.device)
        b, h = query.shape[0], keys.num_heads
        positions = torch.where(hidden, -1, order).expand(b, h, keys.num_tokens)
    if block_size is None:
        block_size = configured_block_size()
    out = blockwise_attention(
        query,
        keys,
        values,
        scaling,
        block_size,
        exact_keys,
        exact_values,
        attention_mask,
        positions,
        observer,
    )
    return out, None
