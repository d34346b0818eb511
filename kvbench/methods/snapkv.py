"""``snapkv``: observation-window voting at prefill (Li et al., "SnapKV: LLM Knows What You are
Looking for Before Generation", NeurIPS 2024).

The last ``w = window`` prompt tokens (the observation window) vote for the earlier ones (the prefix,
``T - w`` tokens), per layer (Sec. 4.1, Listing 1):

    A = softmax(Q_obs K^T / sqrt(d) + causal mask)          [H, w, T]   (over all T keys)
    C = sum over the w window queries of A[:, :, :T-w]      [H, T-w]     (the votes)
    C' = pool1d(C, kernel_size, stride 1, padding kernel_size // 2)      (max or avg, per head)
    keep = top-(budget - w) of C' per kv head, plus the window itself

Pooling clusters the selection so that a selected token brings its neighbours (Sec. 4.2); average
pooling counts the zero padding, like PyTorch's default. GQA: the query heads that share a kv head
add their pooled votes before the top-k (query head ``g * rep + r`` reads kv head ``g``), so the kv
head keeps one set of tokens for all of them. Only the prompt is compressed; decoded tokens are
appended without eviction (the paper compresses once, before generation). The prefill's own
attention is exact SDPA over the whole prompt; the window's weights are recomputed for the vote.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvbench.cache.eviction import EvictionLayer, grouped_logits
from kvbench.config import check_choice, require
from kvbench.methods.base import register_method
from kvbench.methods.eviction import EvictionConfig, EvictionMethod

POOLINGS = ("max", "avg")


@dataclass
class SnapKVConfig(EvictionConfig):
    name: str = "snapkv"
    window: int = 32
    kernel_size: int = 7
    pooling: str = "max"

    def __post_init__(self):
        super().__post_init__()
        require(self.window >= 1, "method.window", self.window, "an int >= 1 (the observation window)")
        require(
            self.kernel_size >= 1 and self.kernel_size % 2 == 1,
            "method.kernel_size",
            self.kernel_size,
            "an odd int >= 1 (1: no pooling)",
        )
        check_choice("method.pooling", self.pooling, POOLINGS)


def snapkv_votes(
    query: torch.Tensor, keys: torch.Tensor, window: int, kernel_size: int, pooling: str, scaling: float
) -> torch.Tensor:
    """Pooled votes ``[B, H_kv, T - window]`` of the prefix, from the prefill's ``query [B, H, q, D]``
    (its last q positions, ``window <= q <= T``: a prefill that attends only its last queries, as
    ``scripts/count_ops.py`` fills a cache, votes the same) and ``keys [B, H_kv, T, D]`` (the window
    is the last ``window`` positions, causal)."""
    b, h, q, _ = query.shape
    hk, t = keys.shape[1], keys.shape[-2]
    pos = torch.arange(t - window, t, device=query.device)
    causal = torch.arange(t, device=query.device)[None, :] <= pos[:, None]  # [w, T]
    weights = torch.softmax(
        grouped_logits(query[:, :, q - window :], keys, causal[None, None], scaling), dim=-1
    )
    votes = weights[..., : t - window].sum(dim=-2).reshape(b * h, 1, t - window)  # [B*H, 1, T-w]
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    pooled = pool(votes, kernel_size, stride=1, padding=kernel_size // 2)
    return pooled.reshape(b, hk, h // hk, t - window).sum(dim=2)


class SnapKVLayer(EvictionLayer):
    def __init__(self, layer_idx, fp_dtype, budget_of, cfg: SnapKVConfig):
        super().__init__(layer_idx, fp_dtype, budget_of)
        self.window, self.kernel_size, self.pooling = cfg.window, cfg.kernel_size, cfg.pooling

    def window_size(self, budget):
        return self.window

    def candidate_scores(self, query, keys, mask, scaling, n_candidates):
        return snapkv_votes(
            query, keys, keys.shape[-2] - n_candidates, self.kernel_size, self.pooling, scaling
        )


@register_method("snapkv")
class SnapKV(EvictionMethod):
    fp16_prefill = True
    Config = SnapKVConfig

    def build_layer(self, layer_idx, fp_dtype):
        return SnapKVLayer(layer_idx, fp_dtype, self.budget_for, self.config)
