"""Attention masks for layers that compute attention over their own storage."""

from __future__ import annotations

import torch


def newest_causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """bool ``[1, 1, q, kv]``: the causal rule of the newest ``q_len`` of ``kv_len`` tokens (SDPA's
    ``is_causal`` aligns the diagonal top-left, which is this rule only when ``q_len == kv_len``)."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)[None, None]


def additive_mask(attention_mask, q_len: int, kv_len: int, device) -> torch.Tensor:
    """float32 ``[B|1, H|1, q, kv]``: 0 where a query may attend, -inf elsewhere. ``None`` is the
    causal rule of the newest ``q_len`` tokens; a bool mask is True where attended; a float mask is
    already additive."""
    if attention_mask is None:
        attention_mask = newest_causal_mask(q_len, kv_len, device)
    attention_mask = attention_mask[..., :kv_len]
    if attention_mask.dtype == torch.bool:
        zero = torch.zeros((), device=device)
        return torch.where(attention_mask, zero, torch.tensor(float("-inf"), device=device))
    return attention_mask.float()


def grouped_additive_mask(
    attention_mask, batch: int, kv_heads: int, rep: int, q_len: int, kv_len: int, device
):
    """:func:`additive_mask` laid out for queries grouped by kv head: ``[B, H_kv, rep * q, kv]``, row
    ``r * q + i`` being query head ``kv * rep + r`` at query position ``i`` (transformers' repeat-kv
    order)."""
    mask = additive_mask(attention_mask, q_len, kv_len, device)
    if mask.shape[1] == 1:
        mask = mask.repeat(1, 1, rep, 1)
    else:
        mask = mask.reshape(mask.shape[0], kv_heads, rep * q_len, kv_len)
    return mask.expand(batch, kv_heads, rep * q_len, kv_len)
