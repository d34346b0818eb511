"""``kivi``: KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
ICML 2024).

Quantizer (KIVI Sec. 3, the asymmetric map also quoted in SpeCache Sec. 4.3):

    Q(X) = round((X - z_X) / s_X),  X' = Q(X) * s_X + z_X,  z_X = min X,  s_X = (max X - min X) / (2^B - 1)

with round half up. ``zero_point=specache`` replaces it at 1 bit by SpeCache's (ICML 2025, Sec. 4.3)
z_X = (3 min X + max X) / 4, s_X = (max X - min X) / 2, so the two codes reconstruct the midpoints
of the lower and upper half of [min, max]; at more bits KIVI's map is kept.

Layout and streaming rules (KIVI Sec. 3.2, Algorithm 1): keys per channel over groups of G
consecutive tokens, values per token over groups of G channels, a full-precision residual of up to R
tokens; the storage is :class:`kvbench.cache.kivi_layout.KIVILayout`, whose docstring states the
flush rules.

Defaults follow the paper: G = 32, R = 128. ``key_bits``/``value_bits`` default to ``bits``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.cache.kivi_layout import KIVILayout
from kvbench.methods.affine_base import AffineKVConfig, kv_bits_label
from kvbench.methods.base import Method, register_method


@dataclass
class KIVIConfig(AffineKVConfig):
    name: str = "kivi"

    default_bits: ClassVar[float] = 2.0


@register_method("kivi")
class KIVI(Method):
    Config = KIVIConfig

    def make_layer(self, layer_idx, shape, model_dtype):
        return KIVILayout(layer_idx, **self.config.layout(self.config.torch_fp_dtype(model_dtype)))

    def base_label(self) -> str:
        zp = "-specache0" if self.config.zero_point == "specache" else ""
        return f"kivi-{kv_bits_label(self.config)}{zp}"
