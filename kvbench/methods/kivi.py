"""``kivi``: KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
ICML 2024).

Quantizer (KIVI Sec. 3, the asymmetric map also quoted in SpeCache Sec. 4.3):

    Q(X) = round((X - z_X) / s_X),  X' = Q(X) * s_X + z_X,  z_X = min X,  s_X = (max X - min X) / (2^B - 1)

computed as KIVI's released code computes it (``arithmetic=kivi``, the default): in the dtype of the
stored full-precision tokens (``fp_dtype``, fp16 by default), the scale rounded once, ``(X - z_X) /
s_X`` clamped to [0, 2^B - 1] and rounded half to even, scale and minimum stored in that dtype, so
the codes equal the reference's bit for bit (``tests/methods/test_kivi_exact.py``). The one
difference is deliberate: a constant group, which the reference divides 0 by 0 in, gets code 0,
scale 0 and its exact minimum. ``arithmetic=fp32`` is kvbench's general affine quantizer instead
(float32, round half up, fp16 parameters rounded before the codes are computed against them, so the
stored parameters reconstruct exactly what was quantized); it differs from the reference by one code
on a few values per thousand and is the arithmetic OTT, SpeCache and ``uniform`` use.
``zero_point=specache`` (which needs ``arithmetic=fp32``) replaces it at 1 bit by SpeCache's
(ICML 2025, Sec. 4.3) z_X = (3 min X + max X) / 4, s_X = (max X - min X) / 2, so the two codes
reconstruct the midpoints of the lower and upper half of [min, max]; at more bits KIVI's map is kept.

Layout and streaming rules (KIVI Sec. 3.2, Algorithm 1): keys per channel over groups of G
consecutive tokens, values per token over groups of G channels, a full-precision residual of up to R
tokens; the storage is :class:`kvbench.cache.kivi_layout.KIVILayer`, whose docstring states the
flush rules.

Defaults follow the paper: G = 32, R = 128. ``key_bits``/``value_bits`` default to ``bits``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.cache.kivi_layout import KIVILayer
from kvbench.config import check_choice, require
from kvbench.methods.affine_base import AffineKVConfig, kv_bits_label
from kvbench.methods.base import Method, register_method
from kvbench.quant.affine import ARITHMETICS


@dataclass
class KIVIConfig(AffineKVConfig):
    name: str = "kivi"
    arithmetic: str = "kivi"

    default_bits: ClassVar[float] = 2.0
    static_step: ClassVar[str | None] = "kivi"

    def __post_init__(self):
        super().__post_init__()
        check_choice("method.arithmetic", self.arithmetic, ARITHMETICS)
        require(
            self.arithmetic == "fp32" or self.zero_point == "minmax",
            "method.zero_point",
            self.zero_point,
            "minmax with method.arithmetic=kivi (KIVI's released arithmetic); specache needs "
            "method.arithmetic=fp32",
        )


@register_method("kivi")
class KIVI(Method):
    fp16_prefill = True
    arm_batch = True
    stack_rows = True
    Config = KIVIConfig

    def make_layer(self, layer_idx, shape, model_dtype):
        layout = self.config.layout(self.config.torch_fp_dtype(model_dtype))
        return KIVILayer(layer_idx, **layout, arithmetic=self.config.arithmetic)

    def base_label(self) -> str:
        zp = "-specache0" if self.config.zero_point == "specache" else ""
        # SpeCache's zero point exists only in the fp32 map, so its label already says it
        fp32 = "-fp32" if self.config.arithmetic == "fp32" and self.config.zero_point == "minmax" else ""
        return f"kivi-{kv_bits_label(self.config)}{zp}{fp32}"
