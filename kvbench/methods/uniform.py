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

from kvbench.cache.composite import CompositeLayer
from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.quantized import QuantizedTokens
from kvbench.config import check_choice, require
from kvbench.methods.base import Method, MethodConfig, check_group, register_method
from kvbench.quant.affine import AXES, ZERO_POINTS, zero_point_for


@dataclass
class UniformConfig(MethodConfig):
    name: str = "uniform"
    key_axis: str = "token"
    value_axis: str = "token"
    group_size: int | None = 32
    zero_point: str = "minmax"

    default_bits: ClassVar[float] = 2.0
    static_step: ClassVar[str | None] = "uniform (key_axis and value_axis token)"

    def __post_init__(self):
        super().__post_init__()
        check_choice("method.key_axis", self.key_axis, AXES)
        check_choice("method.value_axis", self.value_axis, AXES)
        check_choice("method.zero_point", self.zero_point, ZERO_POINTS)
        self.levels()
        if "channel" in (self.key_axis, self.value_axis):
            require(
                self.group_size is not None and self.group_size > 0,
                "method.group_size",
                self.group_size,
                "a positive token count when an axis is 'channel'",
            )

    def stored_levels(self):
        return (self.levels(),)

    def static_step_refusal(self):
        if "channel" in (self.key_axis, self.value_axis):
            return "uniform with a channel axis keeps a full-precision tail until a group fills"
        return super().static_step_refusal()

    def check_model(self, shape):
        if "token" in (self.key_axis, self.value_axis):
            check_group("method.group_size", self.group_size, shape.head_dim, "head_dim")


class UniformLayer(CompositeLayer):
    """``kq``/``vq`` hold the quantized tokens; ``k_res``/``v_res`` the pending tail of a per-channel
    group (always empty on a per-token axis)."""

    def __init__(self, layer_idx, cfg: UniformConfig, fp_dtype):
        super().__init__(layer_idx)
        levels = cfg.levels()
        zero_point = zero_point_for(cfg.zero_point, levels)
        self.group_size = cfg.group_size
        self.kq = QuantizedTokens(
            levels, cfg.key_axis, cfg.group_size, zero_point, backend=cfg.storage_backend()
        )
        self.vq = QuantizedTokens(
            levels, cfg.value_axis, cfg.group_size, zero_point, backend=cfg.storage_backend()
        )
        self.k_res, self.v_res = FullPrecisionTokens(fp_dtype), FullPrecisionTokens(fp_dtype)

    def _store(self, store: QuantizedTokens, pending: FullPrecisionTokens, x) -> None:
        if store.axis == "token":
            store.append(x)
            return
        pending.append(x)
        full = len(pending) // self.group_size * self.group_size
        if full:
            store.append(pending.pop_front(full))

    def static_stores(self):
        return self.kq, self.vq

    def append(self, keys, values):
        self._store(self.kq, self.k_res, keys)
        self._store(self.vq, self.v_res, values)


@register_method("uniform")
class Uniform(Method):
    fp16_prefill = True
    arm_batch = True
    stack_rows = True
    Config = UniformConfig
    Layer = UniformLayer
