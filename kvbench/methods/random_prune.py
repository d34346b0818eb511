"""``random_prune``: seeded random token pruning, the control of SemKV's pruning comparison (arXiv
2608.28911, contribution 4: random pruning is statistically indistinguishable from metric-based
pruning and collapses the same way).

At prefill, per (layer, kv head), the newest ``window`` prompt tokens are kept and ``budget - window``
of the earlier ones are drawn uniformly without replacement; the rest are evicted. Decoded tokens are
appended without eviction, as SnapKV's are, so the two compare at the same memory. The draw comes
from a generator seeded with ``(seed, layer)``: the same configuration keeps the same tokens on
every run (``seed`` defaults to the run's top-level seed, so seeds sweep the random pattern).

The scores are drawn on the device of the keys, by a generator of that device: nothing is built on
the host and copied over at each prefill. On the CPU that is the same generator and the same draw as
ever (the golden outputs hold); a CUDA generator with the same seed draws a different (Philox)
stream, so a CUDA run keeps a different, equally seeded and reproducible, selection than a CPU run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvbench.cache.eviction import EvictionLayer
from kvbench.config import require
from kvbench.methods.base import register_method
from kvbench.methods.eviction import EvictionConfig, EvictionMethod


@dataclass
class RandomPruneConfig(EvictionConfig):
    name: str = "random_prune"
    seed: int = 0

    def __post_init__(self):
        super().__post_init__()
        require(self.seed >= 0, "method.seed", self.seed, "an int >= 0")


class RandomPruneLayer(EvictionLayer):
    def __init__(self, layer_idx, fp_dtype, budget_of, window: int, seed: int):
        super().__init__(layer_idx, fp_dtype, budget_of)
        self.window, self.seed = window, seed

    def window_size(self, budget):
        return self.window

    def candidate_scores(self, query, keys, mask, scaling, n_candidates):
        # i.i.d. uniform scores: their top-k is a uniform draw of k candidates without replacement,
        # drawn where the keys are (on the CPU exactly the CPU generator's draw of before)
        device = keys.device
        gen = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + self.layer_idx)
        return torch.rand(self.batch_size, self.num_kv_heads, n_candidates, generator=gen, device=device)


@register_method("random_prune")
class RandomPrune(EvictionMethod):
    fp16_prefill = True
    Config = RandomPruneConfig

    def build_layer(self, layer_idx, fp_dtype):
        c = self.config
        return RandomPruneLayer(layer_idx, fp_dtype, self.budget_for, c.window, c.seed)

    def base_label(self) -> str:
        return f"{super().base_label()}-s{self.config.seed}"
