"""Config pieces shared by the methods that quantize keys and values with their own bit widths and
keep a full-precision window of newest tokens. This module registers no method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.config import check_choice, require
from kvbench.methods.base import MethodConfig, check_group, covers_context
from kvbench.quant.affine import ZERO_POINTS


class FullPrecisionWindow:
    """Mixin for configs with a ``residual`` field (newest tokens kept in full precision): warn when
    the window covers the whole prompt."""

    def context_warnings(self, lengths):
        return {
            **super().context_warnings(lengths),
            **covers_context("residual", self.residual, lengths, "the whole prompt stays in full precision"),
        }


def kv_bits_label(config) -> str:
    """``2b`` when keys and values share a width, ``k2v4`` otherwise."""
    k, v = config.key_bits, config.value_bits
    return f"{k:g}b" if k == v else f"k{k:g}v{v:g}"


@dataclass
class AffineCodesConfig(FullPrecisionWindow, MethodConfig):
    """Affine key and value codes in KIVI's layout (:class:`kvbench.cache.kivi_layout.KIVILayer`)
    behind a full-precision window: ``key_bits`` and ``value_bits`` (default: ``bits``) and the
    ``zero_point`` (``minmax``, or ``specache`` at 1 bit). A subclass declares ``group_size`` G (tokens
    per key group) and ``residual`` R (the window) with its own defaults and rules."""

    key_bits: float | None = None
    value_bits: float | None = None
    zero_point: str = "minmax"

    def __post_init__(self):
        super().__post_init__()
        check_choice("method.zero_point", self.zero_point, ZERO_POINTS)
        require(self.group_size > 0, "method.group_size", self.group_size, self.group_size_rule)
        self.resolve_kv_bits()

    group_size_rule: ClassVar[str] = "a positive integer"


@dataclass
class AffineKVConfig(AffineCodesConfig):
    """KIVI's layout knobs: ``group_size`` G (tokens per key group, channels per value group),
    ``residual`` R (a multiple of G), with :class:`AffineCodesConfig`'s bits and zero point."""

    group_size: int = 32
    residual: int = 128

    def __post_init__(self):
        super().__post_init__()
        require(
            self.residual > 0 and self.residual % self.group_size == 0,
            "method.residual",
            self.residual,
            f"must be a positive multiple of method.group_size={self.group_size}",
        )

    def check_model(self, shape):
        check_group("method.group_size", self.group_size, shape.head_dim, "head_dim")

    def layout(self, fp_dtype) -> dict:
        """Keyword arguments of :class:`~kvbench.cache.kivi_layout.KIVILayer` (after the layer
        index) for these knobs: values grouped over G channels, as in KIVI."""
        return {
            "key_levels": self.levels(self.key_bits),
            "value_levels": self.levels(self.value_bits),
            "group_size": self.group_size,
            "value_group": self.group_size,
            "residual": self.residual,
            "zero_point": self.zero_point,
            "fp_dtype": fp_dtype,
            "backend": self.storage_backend(),
        }
