"""``uniform``: one affine quantizer for keys and values, no residual window.

The sweep quantizer of SemKV (arXiv 2608.28911, Sec. 3): every stored token is quantized with
the same affine map at L levels, bits = log2(L) (L = 3, 5, 6 give the fractional grid points
1.585, 2.322, 2.585). Per group of values,

    z = min X,  s = (max X - min X) / (L - 1),  Q(X) = clamp(floor((X - z) / s + 0.5), 0, L - 1),
    X' = Q(X) * s + z

(KIVI's Eq. for the asymmetric quantizer; round half up). ``key_axis``/``value_axis`` choose
per-token statistics (over groups of ``group_size`` channels) or per-channel statistics (over
groups of ``group_size`` tokens). A per-channel group needs ``group_size`` tokens before it can be
quantized, so up to G-1 newest tokens wait in full precision (counted as ``residual`` bytes); with
per-token axes nothing is ever kept in full precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.cache import KVLayer
from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.layer import cat_tokens, merge_held
from kvbench.cache.quantized import QuantizedTokens
from kvbench.config import check_choice, require
from kvbench.methods.base import Method, MethodConfig, check_group, register_method

AXES = ("token", "channel")
ZERO_POINTS = ("minmax", "specache")


def zero_point_for(choice: str, levels: int) -> str:
    """SpeCache's zero point is defined for 1-bit codes; at more levels it is KIVI's min/max."""
    return "specache" if choice == "specache" and levels == 2 else "minmax"


@dataclass
class UniformConfig(MethodConfig):
    name: str = "uniform"
    key_axis: str = "token"
    value_axis: str = "token"
    group_size: int | None = 32
    zero_point: str = "minmax"

    default_bits: ClassVar[float] = 2.0

    def __post_init__(self):
        super().__post_init__()
        check_choice("method.key_axis", self.key_axis, AXES)
        check_choice("method.value_axis", self.value_axis, AXES)
        check_choice("method.zero_point", self.zero_point, ZERO_POINTS)
        self.levels()
        if "channel" in (self.key_axis, self.value_axis):
            require(
                isinstance(self.group_size, int) and self.group_size > 0,
                "method.group_size",
                self.group_size,
                "a positive token count when an axis is 'channel'",
            )

    def check_model(self, shape):
        if "token" in (self.key_axis, self.value_axis):
            check_group("method.group_size", self.group_size, shape.head_dim, "head_dim")


class AxisStore:
    """One of K or V: quantized tokens, plus a pending full-precision tail for per-channel groups."""

    def __init__(self, levels, axis, group_size, zero_point, fp_dtype, backend):
        zero_point = zero_point_for(zero_point, levels)
        self.q = QuantizedTokens(levels, axis, group_size, zero_point, backend=backend)
        self.pending = FullPrecisionTokens(fp_dtype)
        self.axis, self.group_size = axis, group_size

    def append(self, x):
        if self.axis == "token":
            self.q.append(x)
            return
        self.pending.append(x)
        full = len(self.pending) // self.group_size * self.group_size
        if full:
            self.q.append(self.pending.pop_front(full))

    def read(self):
        return cat_tokens(self.q.dequantize() if len(self.q) else None, self.pending.data)


class UniformLayer(KVLayer):
    def __init__(self, layer_idx, cfg: UniformConfig, fp_dtype):
        super().__init__(layer_idx)
        levels = cfg.levels()
        self.k = AxisStore(levels, cfg.key_axis, cfg.group_size, cfg.zero_point, fp_dtype, cfg.backend)
        self.v = AxisStore(levels, cfg.value_axis, cfg.group_size, cfg.zero_point, fp_dtype, cfg.backend)

    def append(self, keys, values):
        self.k.append(keys)
        self.v.append(values)

    def read(self):
        return self.k.read(), self.v.read()

    def held_tensors(self):
        residual = {"residual": self.k.pending.tensors() + self.v.pending.tensors()}
        return merge_held(self.k.q.held_tensors(), self.v.q.held_tensors(), residual)

    def quantized_values(self):
        return self.k.q.quantized_values() + self.v.q.quantized_values()

    def nominal_code_bits(self):
        return self.k.q.nominal_code_bits() + self.v.q.nominal_code_bits()


@register_method("uniform")
class Uniform(Method):
    Config = UniformConfig

    def make_layer(self, layer_idx, shape, model_dtype):
        return UniformLayer(layer_idx, self.config, self.config.torch_fp_dtype(model_dtype))
