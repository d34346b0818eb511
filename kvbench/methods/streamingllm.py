"""``streamingllm``: attention sinks plus a recent window (Xiao et al., "Efficient Streaming Language
Models with Attention Sinks", ICLR 2024).

StreamingLLM keeps the KV of the first ``sinks`` tokens (the attention sinks: initial tokens that
draw a large share of attention whatever their content, Sec. 3.1) and a rolling window of the most
recent tokens; every other token is evicted. With a budget of ``b`` tokens the cache is

    kept = {0, ..., sinks - 1}  U  {n - (b - sinks), ..., n - 1}

at every step: after the prefill and again after every decoded token, so it never exceeds ``b``
(the recent window is the budget less the sinks; ``window`` must stay null). The paper's default is
4 sinks (Sec. 4.1).

Positions: the paper assigns RoPE positions inside the cache so that streams can run past the
pre-training window; here contexts fit the model's window and, as for every kvbench method, keys keep
the logical positions they were computed at (:mod:`kvbench.cache.eviction`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbench.cache.eviction import EvictionLayer
from kvbench.config import require
from kvbench.methods.base import register_method
from kvbench.methods.eviction import EvictionConfig, EvictionMethod


@dataclass
class StreamingLLMConfig(EvictionConfig):
    name: str = "streamingllm"
    window: Any = None
    sinks: int = 4

    def __post_init__(self):
        super().__post_init__()
        require(self.sinks >= 0, "method.sinks", self.sinks, "an int >= 0")

    def check_window(self):
        require(
            self.window is None, "method.window", self.window, "null: the recent window is budget - sinks"
        )


class StreamingLLMLayer(EvictionLayer):
    evicts_in_decode = True

    def __init__(self, layer_idx, fp_dtype, budget_of, sinks: int):
        super().__init__(layer_idx, fp_dtype, budget_of)
        self.sinks = sinks

    def window_size(self, budget):
        return budget - min(self.sinks, budget)

    def candidate_scores(self, query, keys, mask, scaling, n_candidates):
        # the earliest candidates first: the top `sinks` of them are the sink tokens
        order = -torch.arange(n_candidates, dtype=torch.float32, device=self.k.device)
        return order.expand(self.batch_size, self.num_kv_heads, n_candidates)


@register_method("streamingllm")
class StreamingLLM(EvictionMethod):
    fp16_prefill = True
    Config = StreamingLLMConfig

    def build_layer(self, layer_idx, fp_dtype):
        return StreamingLLMLayer(layer_idx, fp_dtype, self.budget_for, self.config.sinks)
