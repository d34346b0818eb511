"""``kivi``: KIVI (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for KV Cache",
ICML 2024).

Quantizer (KIVI Sec. 3, the asymmetric map also quoted in SpeCache Sec. 4.3):

    Q(X) = round((X - z_X) / s_X),  X' = Q(X) * s_X + z_X,  z_X = min X,  s_X = (max X - min X) / (2^B - 1)

with round half up. ``zero_point=specache`` replaces it at 1 bit by SpeCache's (ICML 2025, Sec. 4.3)
z_X = (3 min X + max X) / 4, s_X = (max X - min X) / 2, so the two codes reconstruct the midpoints
of the lower and upper half of [min, max]; at more bits KIVI's map is kept.

Layout (KIVI Sec. 3.2, Algorithm 1):

- keys per-channel: statistics per channel over groups of G consecutive tokens;
- values per-token: statistics per token over groups of G consecutive channels;
- a full-precision residual of up to R tokens (R a multiple of G).

Streaming rules, for l tokens arriving at once (prefill) or one at a time (decode):

- keys: new keys join the key residual X_Kr; whenever it holds at least R tokens, the oldest
  ``floor(|X_Kr| / R) * R`` are quantized and appended to Q(X_Kg). In prefill this is KIVI's
  r = l mod R split (X_Kg = X_K[:l-r], X_Kr = X_K[l-r:]); in decode the residual fills to R and is
  flushed whole.
- values: new values join the value queue X_Vr; while it holds more than R tokens, the oldest are
  quantized per token and appended to Q(X_Vg), so the newest R values stay in full precision.

Defaults follow the paper: G = 32, R = 128. ``key_bits``/``value_bits`` default to ``bits``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvbench.cache import KVLayer
from kvbench.cache.fp import FullPrecisionTokens
from kvbench.cache.layer import cat_tokens, merge_held
from kvbench.cache.quantized import QuantizedTokens
from kvbench.config import check_choice, require
from kvbench.methods.base import Method, MethodConfig, check_group, covers_context, register_method
from kvbench.methods.uniform import ZERO_POINTS, zero_point_for
from kvbench.quant.attention_ref import PackedKV


@dataclass
class KIVIConfig(MethodConfig):
    name: str = "kivi"
    group_size: int = 32
    residual: int = 128
    key_bits: float | None = None
    value_bits: float | None = None
    zero_point: str = "minmax"

    default_bits: ClassVar[float] = 2.0

    def __post_init__(self):
        super().__post_init__()
        check_choice("method.zero_point", self.zero_point, ZERO_POINTS)
        require(
            isinstance(self.group_size, int) and self.group_size > 0,
            "method.group_size",
            self.group_size,
            "a positive integer",
        )
        require(
            isinstance(self.residual, int) and self.residual > 0 and self.residual % self.group_size == 0,
            "method.residual",
            self.residual,
            f"must be a positive multiple of method.group_size={self.group_size}",
        )
        self.resolve_kv_bits()

    def check_model(self, shape):
        check_group("method.group_size", self.group_size, shape.head_dim, "head_dim")

    def context_warnings(self, lengths):
        return {
            **super().context_warnings(lengths),
            **covers_context("residual", self.residual, lengths, "the whole prompt stays in full precision"),
        }


class KIVILayer(KVLayer):
    """With ``backend=triton``, decode steps (one or two new tokens) skip the reconstruction in
    :meth:`update` and attend through the fused kernel, which reads the packed codes directly; the
    read rule is unchanged: stored tokens as they were before this forward, new tokens exact."""

    def __init__(self, layer_idx, cfg: KIVIConfig, fp_dtype):
        super().__init__(layer_idx)
        self.backend = cfg.backend
        self._before: tuple | None = None  # the stores before this forward's append (fused path)
        self.group, self.residual = cfg.group_size, cfg.residual
        k_levels, v_levels = cfg.levels(cfg.key_bits), cfg.levels(cfg.value_bits)
        self.kq = QuantizedTokens(
            k_levels, "channel", self.group, zero_point_for(cfg.zero_point, k_levels), backend=cfg.backend
        )
        self.vq = QuantizedTokens(
            v_levels, "token", self.group, zero_point_for(cfg.zero_point, v_levels), backend=cfg.backend
        )
        self.k_res = FullPrecisionTokens(fp_dtype)
        self.v_res = FullPrecisionTokens(fp_dtype)

    def append(self, keys, values):
        self.k_res.append(keys)
        flush = len(self.k_res) // self.residual * self.residual
        if flush:
            self.kq.append(self.k_res.pop_front(flush))
        self.v_res.append(values)
        if len(self.v_res) > self.residual:
            self.vq.append(self.v_res.pop_front(len(self.v_res) - self.residual))

    def update(self, key_states, value_states, *args, **kwargs):
        if self.backend != "triton" or key_states.shape[-2] > 2 or not self.num_tokens:
            self._before = None
            return super().update(key_states, value_states, *args, **kwargs)
        # Stores are replaced, never modified in place, on append: these references stay valid.
        self._before = (
            PackedKV.from_store(self.kq),
            self.k_res.data,
            PackedKV.from_store(self.vq),
            self.v_res.data,
        )
        self.append(key_states, value_states)
        self.num_tokens += key_states.shape[-2]
        return key_states, value_states

    def attend(self, module, query, keys, values, attention_mask, **kwargs):
        if self._before is None:
            return super().attend(module, query, keys, values, attention_mask, **kwargs)
        kq, k_res, vq, v_res = self._before
        self._before = None
        if attention_mask is not None:
            # padding or an explicit mask: the kernel only knows the causal rule of the newest
            # tokens, so reconstruct and take the SDPA path
            d = keys.shape[-1]
            keys = cat_tokens(kq.dequantize(d) if kq else None, k_res, keys).to(query.dtype)
            values = cat_tokens(vq.dequantize(d) if vq else None, v_res, values).to(query.dtype)
            return super().attend(module, query, keys, values, attention_mask, **kwargs)
        from kvbench.kernels.decode_attention import fused_decode_attention

        scaling = kwargs.get("scaling") or module.scaling
        out = fused_decode_attention(
            query,
            kq,
            vq,
            scaling,
            key_residual=cat_tokens(k_res, keys),
            value_residual=cat_tokens(v_res, values),
        )
        return out.transpose(1, 2).contiguous(), None

    def read(self):
        k = cat_tokens(self.kq.dequantize() if len(self.kq) else None, self.k_res.data)
        v = cat_tokens(self.vq.dequantize() if len(self.vq) else None, self.v_res.data)
        return k, v

    def held_tensors(self):
        residual = {"residual": self.k_res.tensors() + self.v_res.tensors()}
        return merge_held(self.kq.held_tensors(), self.vq.held_tensors(), residual)

    def quantized_values(self):
        return self.kq.quantized_values() + self.vq.quantized_values()

    def nominal_code_bits(self):
        return self.kq.nominal_code_bits() + self.vq.nominal_code_bits()


@register_method("kivi")
class KIVI(Method):
    Config = KIVIConfig

    def make_layer(self, layer_idx, shape, model_dtype):
        return KIVILayer(layer_idx, self.config, self.config.torch_fp_dtype(model_dtype))

    def base_label(self) -> str:
        c = self.config
        bits = f"{c.key_bits:g}b" if c.key_bits == c.value_bits else f"k{c.key_bits:g}v{c.value_bits:g}"
        zp = "-specache0" if c.zero_point == "specache" else ""
        return f"kivi-{bits}{zp}"
