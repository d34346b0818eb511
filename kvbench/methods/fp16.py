"""``fp16``: the unquantized baseline.

Keys and values are stored as computed, in ``fp_dtype`` (float16 by default, the papers' FP16
cache; ``auto`` keeps the model's dtype, which makes generation identical to plain transformers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.cache import KVLayer
from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.layer import StoredTokens
from kvbench.methods.base import Method, MethodConfig, register_method


@dataclass
class FP16Config(MethodConfig):
    name: str = "fp16"

    bits_knob: ClassVar[str | None] = None  # nothing is quantized: the run's bits change nothing
    cost_cpu: ClassVar[float] = 1.0  # the unit of every other method's cost
    cost_gpu: ClassVar[float] = 1.0
    static_step: ClassVar[str | None] = "fp16"


class FullPrecisionLayer(KVLayer):
    def __init__(self, layer_idx: int, dtype: torch.dtype):
        super().__init__(layer_idx)
        self.k, self.v = FullPrecisionTokens(dtype), FullPrecisionTokens(dtype)

    def append(self, keys, values):
        self.k.append(keys)
        self.v.append(values)

    def read(self):
        return self.k.data, self.v.data

    def stored(self):
        return StoredTokens(self.k.source(), self.v.source())

    def bytes_reserved(self):
        return self.k.bytes_reserved() + self.v.bytes_reserved()

    def static_stores(self):
        return self.k, self.v

    def held_tensors(self):
        return {"fp": self.k.tensors() + self.v.tensors()}


@register_method("fp16")
class FP16(Method):
    fp16_prefill = True
    arm_batch = True
    stack_rows = True
    Config = FP16Config

    def make_layer(self, layer_idx, shape, model_dtype):
        return FullPrecisionLayer(layer_idx, self.config.torch_fp_dtype(model_dtype))

    def base_label(self) -> str:
        return "fp16"
