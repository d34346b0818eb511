"""SemKV's token-importance metrics (Lee, Kim, Kim, "SemKV", arXiv 2608.28911): what each metric
scores and how it is computed from what the model produces. Higher = more important. The method
(:mod:`kvbench.methods.semkv`) decides when the scores are taken and what they allocate; this module
registers no method.

- hidden state: ``hidden_norm`` = ||h_in||, ``hidden_change`` = ||h_out - h_in|| of a decoder layer
  (:func:`hidden_metric`, read through :class:`kvbench.cache.capture.OutputCapture`);
- KV: ``key_norm`` = ||k||, ``value_norm`` = ||v|| (scored at append time);
- logit: ``entropy`` and ``surprisal`` of the next-token distribution (:func:`logit_scores`);
- attention: ``attn_sum``/``attn_max`` of the softmax weights a token receives
  (:func:`attention_update`);
- ``random``: seeded uniform scores (:func:`metric_seed`), the control.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable

import torch

from kvbench.errors import ConfigError

HIDDEN_METRICS = ("hidden_norm", "hidden_change")
KV_METRICS = ("key_norm", "value_norm")
LOGIT_METRICS = ("entropy", "surprisal")
ATTENTION_METRICS = ("attn_sum", "attn_max")
METRICS = (*HIDDEN_METRICS, *KV_METRICS, *LOGIT_METRICS, *ATTENTION_METRICS, "random")
APPEND_TIME_METRICS = (*KV_METRICS, "random")  # scored from what append receives
LOGIT_CHUNK = 256  # positions per log-softmax when scoring logits (bounds memory at large vocab)


def metric_seed(*parts) -> int:
    """A fixed 63-bit seed from the parts' text (the random metric's generator per layer)."""
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def attention_update(
    scores: torch.Tensor,
    query: torch.Tensor,
    keys: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    metric: str,
    query_chunk: int,
) -> torch.Tensor:
    """Accumulate the attention the last ``P = scores.shape[-1]`` keys receive from ``query``.

    ``scores [B, H_kv, P]``, ``query [B, H, q, D]``, ``keys [B, H_kv, kv, D]``; query head
    ``g * rep + r`` reads kv head g. Weights are softmax(q k^T * scaling + mask) over all ``kv`` keys,
    computed ``query_chunk`` queries at a time; ``attn_sum`` adds them over the group's query heads
    and positions, ``attn_max`` takes their max. A boolean mask is True where attention is allowed;
    no mask means causal with the queries as the last ``q`` positions."""
    b, h, q, d = query.shape
    hk, kv = keys.shape[1], keys.shape[-2]
    p = scores.shape[-1]
    rep = h // hk
    qf = query.float().reshape(b, hk, rep, q, d)
    kf = keys.float()
    mask = None
    if attention_mask is not None:
        mask = attention_mask[..., :kv]
        if mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, device=mask.device).masked_fill(~mask, -math.inf)
        mask = mask.float()
        mask = mask.reshape(mask.shape[0], hk, rep, q, kv) if mask.shape[1] == h else mask[:, :, None]
    out = scores.clone()
    for s in range(0, q, query_chunk):
        e = min(s + query_chunk, q)
        logits = torch.einsum("bgrqd,bgkd->bgrqk", qf[:, :, :, s:e], kf) * scaling
        if mask is not None:
            logits = logits + mask[:, :, :, s:e]
        elif q > 1:
            pos = torch.arange(s, e, device=logits.device)[:, None] + (kv - q)
            causal = torch.arange(kv, device=logits.device)[None, :] > pos
            logits = logits.masked_fill(causal, -math.inf)
        w = torch.nan_to_num(torch.softmax(logits, dim=-1)[..., kv - p :], nan=0.0)
        if metric == "attn_sum":
            out = out + w.sum(dim=(2, 3))
        else:
            out = torch.maximum(out, w.amax(dim=(2, 3)))
    return out


def logit_scores(
    metric: str, logits: torch.Tensor, input_ids: torch.Tensor, prev_logprobs: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``scores [B, t]``, last position's log-probabilities ``[B, vocab]``) for ``logits [B, t, V]``.

    ``entropy``: -sum_v p_i(v) log p_i(v). ``surprisal``: -log p_{i-1}(x_i), with ``prev_logprobs``
    (the previous forward's last position) for i = 0, and +inf when there is none."""
    b, t, _ = logits.shape
    ids = input_ids.to(logits.device).long()
    scores = torch.empty(b, t, device=logits.device)
    last = None
    for s in range(0, t, LOGIT_CHUNK):
        e = min(s + LOGIT_CHUNK, t)
        logp = torch.log_softmax(logits[:, s:e].float(), dim=-1)
        if metric == "entropy":
            scores[:, s:e] = -(logp.exp() * logp).sum(-1)
        else:
            # position i predicts token i + 1
            nxt = ids[:, s + 1 : e + 1]
            nll = -logp[:, : nxt.shape[1]].gather(-1, nxt[..., None])[..., 0]
            scores[:, s + 1 : s + 1 + nxt.shape[1]] = nll
        if e == t:
            last = logp[:, -1]
    if metric == "surprisal":
        if prev_logprobs is None:
            scores[:, 0] = math.inf
        else:
            scores[:, 0] = -prev_logprobs.gather(-1, ids[:, :1])[:, 0]
    return scores, last


def decoder_layers(model, num_layers: int) -> list[torch.nn.Module]:
    mods = [m for name, m in model.named_modules() if re.fullmatch(r"(.*\.)?layers\.\d+", name)]
    if len(mods) != num_layers:
        raise ConfigError(
            "method.metric", "hidden", f"found {len(mods)} decoder layers for {num_layers} layers"
        )
    return mods


def hidden_metric(metric: str) -> Callable[[tuple, dict, object], torch.Tensor]:
    """The reduce function of an :class:`~kvbench.cache.capture.OutputCapture` on decoder layers:
    ``[B, t]`` float32 ``||h_in||`` (``hidden_norm``) or ``||h_out - h_in||`` (``hidden_change``)."""

    def reduce(args, kwargs, output):
        h_in = args[0] if args else kwargs["hidden_states"]
        h_out = output[0] if isinstance(output, (tuple, list)) else output
        h_in = h_in.detach().float()
        x = h_in if metric == "hidden_norm" else h_out.detach().float() - h_in
        return x.norm(dim=-1)

    return reduce
