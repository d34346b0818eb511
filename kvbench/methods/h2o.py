"""``h2o``: Heavy-Hitter Oracle (Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative
Inference of Large Language Models", NeurIPS 2023).

Every kept token carries its accumulated attention score (Sec. 4, the greedy H2 eviction of
Algorithm 1), per layer and kv head:

    F(j) = sum over every query i that has attended token j of softmax(q_i K^T / sqrt(d))_j

summed over the query heads that share the kv head (GQA). The scores come from this forward's own
attention weights, computed eagerly inside :meth:`H2OLayer.attention` (softmax(QK^T/sqrt(d)) V,
``query_chunk`` queries at a time), so the attention the model uses and the scores are one
computation. The first forward's (the prefill's, from zero scores) goes through
:func:`kvbench.cache.eviction.remembered_prefill`: computed every time, except inside an instrument's
``shared_prefill`` block, where caches of other budgets fed the same tensors get a copy of it.

Eviction: the cache holds the ``window`` most recent tokens (H2O's recent budget) and the
``budget - window`` heavy hitters: the earlier tokens with the largest F. After the prefill the whole
prompt's attention (every query's weights, summed by key) ranks the prompt; after each decoded token
its weights are added to F and the cache is brought back to ``budget`` by evicting the lowest-F
tokens outside the window (one per step), so memory stays at the budget while decoding. The paper
splits the budget evenly between heavy and recent tokens; ``window: null`` does that
(``budget // 2``). The scores are held ([B, H_kv, n] float32) and counted in the memory report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbench.cache.eviction import EvictionLayer, eager_attention, remembered_prefill
from kvbench.config import is_int, require
from kvbench.methods.base import register_method
from kvbench.methods.eviction import EvictionConfig, EvictionMethod


@dataclass
class H2OConfig(EvictionConfig):
    name: str = "h2o"
    window: Any = None
    query_chunk: int = 256

    def __post_init__(self):
        super().__post_init__()
        require(
            self.query_chunk > 0,
            "method.query_chunk",
            self.query_chunk,
            "a positive int",
        )

    def check_window(self):
        require(
            self.window is None or (is_int(self.window) and self.window >= 0),
            "method.window",
            self.window,
            "null (budget // 2, H2O's even split) or an int >= 0",
        )


class H2OLayer(EvictionLayer):
    evicts_in_decode = True

    def __init__(self, layer_idx, fp_dtype, budget_of, window: int | None, query_chunk: int):
        super().__init__(layer_idx, fp_dtype, budget_of)
        self.window, self.query_chunk = window, query_chunk
        self.scores: torch.Tensor | None = None  # [B, H_kv, kept] float32, F of every kept token

    def window_size(self, budget):
        return budget // 2 if self.window is None else self.window

    def bytes_per_token(self):
        return super().bytes_per_token() + self.batch_size * self.num_kv_heads * 4

    def held_tensors(self):
        held = super().held_tensors()
        held["scores"] = [] if self.scores is None else [self.scores]
        return held

    def attention(self, module, query, keys, values, mask, **kwargs):
        scaling = kwargs.get("scaling") or module.scaling
        prior = self.scores

        def weighted():
            b, hk, n = keys.shape[0], keys.shape[1], keys.shape[-2]
            acc = torch.zeros(b, hk, n, device=keys.device)
            if prior is not None:
                acc[..., : prior.shape[-1]] = prior

            def accumulate(w):  # w [B, H_kv, rep, c, n]
                acc.add_(w.sum(dim=(2, 3)))

            return eager_attention(query, keys, values, mask, scaling, self.query_chunk, accumulate), acc

        if prior is None:  # the prefill: the same for every budget (shared under shared_prefill)
            out, self.scores = remembered_prefill(
                (type(self), self.query_chunk), query, keys, values, mask, scaling, weighted
            )
        else:
            out, self.scores = weighted()
        return out, None

    def candidate_scores(self, query, keys, mask, scaling, n_candidates):
        return self.scores[..., :n_candidates]

    def keep(self, idx):
        super().keep(idx)
        self.scores = self.scores.gather(2, idx.to(self.scores.device))


@register_method("h2o")
class H2O(EvictionMethod):
    Config = H2OConfig

    def build_layer(self, layer_idx, fp_dtype):
        c = self.config
        return H2OLayer(layer_idx, fp_dtype, self.budget_for, c.window, c.query_chunk)
