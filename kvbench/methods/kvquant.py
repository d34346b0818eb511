"""``kvquant``: KVQuant (Hooper et al., "KVQuant: Towards 10 Million Context Length LLM Inference
with KV Cache Quantization", NeurIPS 2024).

Components (each switchable for the ablation):

- Per-channel keys, per-token values (Sec. 3.1). Keys use one fixed range per (kv head, channel)
  calibrated offline; values use a range computed online for every token.
- Pre-RoPE keys (Sec. 3.2, ``pre_rope``): the cache receives post-RoPE keys; token ``p`` (its
  absolute position, the number of tokens the layer saw before it) is rotated back by ``-p w``
  (:func:`kvbench.quant.rope.invert_rope`), quantized, and rotated by ``+p w`` again after
  dequantization when read. ``false`` quantizes the post-RoPE keys. Only default-type RoPE
  (``theta`` from ``ModelShape.rope_theta``) is supported.
- Non-uniform datatype (Sec. 3.3, ``datatype``): ``nuq`` uses one codebook of 2^b signposts per
  layer for keys and one for values, 1-D k-means of the calibration values normalized to [-1, 1] by
  their own range (:mod:`kvbench.quant.nuq`). The paper weights the k-means objective by Fisher
  information (squared gradients); this implementation uses the unweighted objective
  (``sensitivity_weighted: true`` is rejected). ``uniform`` uses the affine grid on [lo, hi].
- Dense-and-sparse per-vector outliers (Sec. 3.4, ``outlier_fraction`` f): keys: elements outside
  the calibrated per-channel thresholds (the f/2 and 1-f/2 quantiles of the channel); values: the
  ceil(f D) largest-magnitude elements of each token. Outliers are held in fp16 with their positions
  and excluded from the range; 0 disables (ranges are then min/max and keys are clamped to the
  calibrated range).
- Attention sink (Sec. 3.5, ``sink``): the first token is kept in fp16 (``sink_tokens = 1``,
  :class:`kvbench.cache.sink.SinkLayer`) and left out of calibration.
- Offline calibration (Sec. 3.6, ``calibrate``): :meth:`KVQuant.prepare` runs the model over
  the last ``calibration_tokens`` tokens of WikiText-2 test (windows of 512; the paper uses the train
  split, absent here, and the perplexity task scores the start of test), capturing k_proj/v_proj outputs
  (pre-RoPE keys; RoPE is applied for ``pre_rope: false``). ``false`` computes the same statistics
  from the layer's first stored block (the prompt) instead, frozen afterwards.

Reconstruction: ``x_hat = c[q] * scale + zero`` with outliers overwritten by their fp16 values.

Held per layer (``held_tensors``): ``codes`` (packed codebook indices of every key and value
element, :mod:`kvbench.quant.packing`), ``scales``/``zeros`` (fp16: per token for values, per
(head, channel) for keys), ``codebook`` (fp16 signposts, ``nuq`` only), ``sparse`` (outliers:
int32 token index, int16 (or int32) index of (batch, head, channel), fp16 value). Only the torch
backend exists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from kvbench.cache import KVLayer
from kvbench.config import check_choice, is_int, is_number, require
from kvbench.errors import ConfigError
from kvbench.methods.base import Method, MethodConfig, register_method
from kvbench.quant.nuq import (
    channel_thresholds,
    kmeans_1d,
    masked_range,
    nearest_code,
    normalize,
    scale_zero,
    topk_outlier_mask,
    uniform_codebook,
)
from kvbench.quant.packing import pack, unpack
from kvbench.quant.rope import apply_rope, cos_sin, rotate

DATATYPES = ("nuq", "uniform")
CALIBRATION_FILES = ("wikitext2/wiki.test.raw", "wikitext2/wikitext-test.txt")
CALIBRATION_WINDOW = 512
KMEANS_SAMPLES = 2**16  # normalized values per k-means fit (a seeded random subset)


@dataclass
class KVQuantConfig(MethodConfig):
    name: str = "kvquant"
    key_bits: float | None = None
    value_bits: float | None = None
    pre_rope: bool = True
    datatype: str = "nuq"
    outlier_fraction: float = 0.01
    sink: bool = True
    calibrate: bool = True
    calibration_tokens: int = 2048
    sensitivity_weighted: bool = False

    default_bits: ClassVar[float] = 3.0

    def __post_init__(self):
        if self.backend == "triton":
            raise ConfigError("method.backend", self.backend, "only torch is implemented for kvquant")
        super().__post_init__()
        for knob in ("pre_rope", "sink", "calibrate", "sensitivity_weighted"):
            value = getattr(self, knob)
            require(isinstance(value, bool), f"method.{knob}", value, "true or false")
        require(
            not self.sensitivity_weighted,
            "method.sensitivity_weighted",
            self.sensitivity_weighted,
            "not implemented (Fisher-weighted k-means needs gradients); only false (unweighted k-means)",
        )
        check_choice("method.datatype", self.datatype, DATATYPES)
        f = self.outlier_fraction
        require(
            is_number(f) and 0 <= f < 0.5,
            "method.outlier_fraction",
            f,
            "a fraction in [0, 0.5) (0 disables the sparse outliers)",
        )
        self.outlier_fraction = float(f)
        n = self.calibration_tokens
        require(
            is_int(n) and n >= 2,
            "method.calibration_tokens",
            n,
            "an integer >= 2",
        )
        if self.sink:
            self.sink_tokens = max(self.sink_tokens, 1)
        self.resolve_kv_bits()

    def check_model(self, shape):
        if self.pre_rope:
            require(
                shape.rope_theta is not None,
                "method.pre_rope",
                self.pre_rope,
                "the model reports no rope_theta (default-type RoPE needed); set method.pre_rope=false",
            )
        require(shape.head_dim % 2 == 0, "method.pre_rope", self.pre_rope, "needs an even head_dim")


@dataclass
class LayerCalibration:
    """One layer's offline statistics: per-(head, channel) key range and the two codebooks."""

    key_scale: torch.Tensor  # fp16 [H_kv, D]
    key_zero: torch.Tensor  # fp16 [H_kv, D]
    key_codebook: torch.Tensor  # float32 [L_k], fp16-representable
    value_codebook: torch.Tensor  # float32 [L_v]


def _subsample(y: torch.Tensor, seed: int) -> torch.Tensor:
    if y.numel() <= KMEANS_SAMPLES:
        return y
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(y.numel(), generator=gen)[:KMEANS_SAMPLES].to(y.device)
    return y[idx]


def _codebook(y: torch.Tensor, levels: int, datatype: str, seed: int) -> torch.Tensor:
    if datatype == "uniform":
        return uniform_codebook(levels)
    return kmeans_1d(_subsample(y.flatten(), seed).cpu(), levels).half().float()


def key_outliers(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, fraction: float):
    """Key outliers: elements outside the calibrated ``[zero - scale, zero + scale]`` of their channel."""
    if fraction <= 0:
        return None
    return (x.float() - zero.float()).abs() > scale.float()


def calibrate_layer(
    keys: torch.Tensor, values: torch.Tensor, k_levels: int, v_levels: int, fraction: float, datatype: str
) -> LayerCalibration:
    """Statistics from ``keys``/``values [N, H_kv, D]`` (keys in the domain they are stored in)."""
    lo, hi = channel_thresholds(keys, fraction)
    k_scale, k_zero = scale_zero(lo, hi)
    k_mask = key_outliers(keys, k_scale, k_zero, fraction)
    y_k = normalize(keys, k_scale, k_zero)
    y_k = y_k if k_mask is None else y_k[~k_mask]
    v_mask = topk_outlier_mask(values, fraction) if fraction > 0 else None
    v_scale, v_zero = scale_zero(*masked_range(values, v_mask))
    y_v = normalize(values, v_scale, v_zero)
    y_v = y_v if v_mask is None else y_v[~v_mask]
    return LayerCalibration(
        k_scale, k_zero, _codebook(y_k, k_levels, datatype, 0), _codebook(y_v, v_levels, datatype, 1)
    )


class DenseSparseTokens:
    """Codebook codes of ``[B, H_kv, T, D]`` plus sparse fp16 outliers. ``channel_range`` (fp16
    ``(scale, zero)`` of shape ``[H_kv, D]``) selects per-channel fixed ranges; ``None`` per-token
    online ranges."""

    def __init__(self, levels: int, codebook: torch.Tensor, fraction: float, channel_range=None):
        self.levels, self.fraction = levels, fraction
        self.codebook = codebook.half()  # what is held
        self.channel_range = channel_range
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None  # per-token ranges (values)
        self.zero: torch.Tensor | None = None
        self.rows: list[torch.Tensor] = []
        self.cols: list[torch.Tensor] = []
        self.vals: list[torch.Tensor] = []
        self.num_tokens = 0
        self.shape: tuple[int, int, int] = (0, 0, 0)  # B, H, D

    def append(self, x: torch.Tensor) -> None:
        if x.shape[-2] == 0:
            return
        x = x.float()
        b, h, t, d = x.shape
        self.shape = (b, h, d)
        if self.channel_range is not None:
            scale, zero = (p.to(x.device)[None, :, None, :] for p in self.channel_range)
            mask = key_outliers(x, scale, zero, self.fraction)
        else:
            mask = topk_outlier_mask(x, self.fraction) if self.fraction > 0 else None
            scale, zero = scale_zero(*masked_range(x, mask))
            self.scale = scale if self.scale is None else torch.cat([self.scale, scale], dim=-2)
            self.zero = zero if self.zero is None else torch.cat([self.zero, zero], dim=-2)
        codes = pack(nearest_code(normalize(x, scale, zero), self.codebook.float().to(x.device)), self.levels)
        self.codes = codes if self.codes is None else torch.cat([self.codes, codes], dim=-2)
        if mask is not None and bool(mask.any()):
            ib, ih, it, id_ = mask.nonzero(as_tuple=True)
            col_dtype = torch.int16 if b * h * d <= torch.iinfo(torch.int16).max else torch.int32
            self.rows.append((it + self.num_tokens).to(torch.int32))
            self.cols.append(((ib * h + ih) * d + id_).to(col_dtype))
            self.vals.append(x[mask].half())
        self.num_tokens += t

    def dequantize(self) -> torch.Tensor:
        """float32 ``[B, H_kv, T, D]``."""
        b, h, d = self.shape
        codes = unpack(self.codes, self.levels, d).long()
        if self.channel_range is not None:
            scale, zero = (p.float().to(codes.device)[None, :, None, :] for p in self.channel_range)
        else:
            scale, zero = self.scale.float(), self.zero.float()
        x = self.codebook.float().to(codes.device)[codes] * scale + zero
        if self.rows:
            rows = torch.cat(self.rows).long()
            cols = torch.cat(self.cols).long()
            flat = ((cols // d) * self.num_tokens + rows) * d + cols % d
            x.view(-1)[flat] = torch.cat(self.vals).float()
        return x

    def __len__(self) -> int:
        return self.num_tokens

    def num_outliers(self) -> int:
        return sum(v.numel() for v in self.vals)

    def held_tensors(self) -> dict[str, list[torch.Tensor]]:
        if self.codes is None:
            return {}
        held = {"codes": [self.codes], "sparse": self.rows + self.cols + self.vals}
        if self.channel_range is not None:
            held["scales"], held["zeros"] = [self.channel_range[0]], [self.channel_range[1]]
        else:
            held["scales"], held["zeros"] = [self.scale], [self.zero]
        return held

    def quantized_values(self) -> int:
        b, h, d = self.shape
        return b * h * self.num_tokens * d

    def nominal_code_bits(self) -> float:
        return self.quantized_values() * math.log2(self.levels)


class KVQuantLayer(KVLayer):
    """``position_offset``: absolute position of the first token this layer stores (the sink
    tokens held in front of it by :class:`SinkLayer` come first)."""

    def __init__(
        self,
        layer_idx: int,
        cfg: KVQuantConfig,
        calibration: LayerCalibration | None,
        theta: float | None,
        position_offset: int = 0,
    ):
        super().__init__(layer_idx)
        self.cfg, self.calibration, self.theta = cfg, calibration, theta
        self.offset = position_offset
        self.k_levels, self.v_levels = cfg.levels(cfg.key_bits), cfg.levels(cfg.value_bits)
        self.kq: DenseSparseTokens | None = None
        self.vq: DenseSparseTokens | None = None
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        if cfg.pre_rope and theta is None:
            raise ConfigError(
                "method.pre_rope", True, "needs the model's rope_theta; set method.pre_rope=false"
            )

    def _cos_sin(self, start: int, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[n, D]`` of the stored tokens ``start .. start + n - 1`` (absolute positions
        ``offset + start ..``), from a table grown by doubling (read runs every decode step)."""
        end = self.offset + start + n
        if self._table is None or self._table[0].shape[0] < end or self._table[0].device != like.device:
            size = max(end, 2 * (0 if self._table is None else self._table[0].shape[0]))
            self._table = cos_sin(torch.arange(size, device=like.device), like.shape[-1], self.theta)
        cos, sin = self._table
        return cos[end - n : end], sin[end - n : end]

    def _setup(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        cal = self.calibration
        if cal is None:
            if self.cfg.calibrate:
                raise RuntimeError(
                    "kvquant with calibrate=true needs Method.prepare before the cache is built"
                )
            h, d = keys.shape[1], keys.shape[-1]
            cal = calibrate_layer(
                keys.transpose(1, 2).reshape(-1, h, d),
                values.transpose(1, 2).reshape(-1, h, d),
                self.k_levels,
                self.v_levels,
                self.cfg.outlier_fraction,
                self.cfg.datatype,
            )
            self.calibration = cal
        f = self.cfg.outlier_fraction
        self.kq = DenseSparseTokens(self.k_levels, cal.key_codebook, f, (cal.key_scale, cal.key_zero))
        self.vq = DenseSparseTokens(self.v_levels, cal.value_codebook, f)

    def append(self, keys, values):
        k = keys.float()
        if self.cfg.pre_rope:
            k = rotate(k, *self._cos_sin(self.num_tokens, k.shape[-2], k), inverse=True)
        if self.kq is None:
            self._setup(k, values.float())
        self.kq.append(k)
        self.vq.append(values)

    def read(self):
        k = self.kq.dequantize()
        if self.cfg.pre_rope:
            k = rotate(k, *self._cos_sin(0, k.shape[-2], k))
        return k, self.vq.dequantize()

    def held_tensors(self):
        if self.kq is None:
            return {}
        held: dict[str, list[torch.Tensor]] = {}
        for store in (self.kq, self.vq):
            for component, tensors in store.held_tensors().items():
                held.setdefault(component, []).extend(tensors)
        if self.cfg.datatype == "nuq":
            held["codebook"] = [self.kq.codebook, self.vq.codebook]
        return held

    def quantized_values(self):
        return 0 if self.kq is None else self.kq.quantized_values() + self.vq.quantized_values()

    def nominal_code_bits(self):
        return 0.0 if self.kq is None else self.kq.nominal_code_bits() + self.vq.nominal_code_bits()


def calibration_text(data_root) -> str:
    for name in CALIBRATION_FILES:
        path = Path(data_root) / name
        if path.is_file():
            return path.read_text(encoding="utf-8")
    raise ConfigError(
        "data.root",
        str(data_root),
        f"kvquant calibration needs one of {', '.join(CALIBRATION_FILES)} (or method.calibrate=false)",
    )


def _projections(model, suffix: str, num_layers: int) -> list[torch.nn.Module]:
    mods = [m for name, m in model.named_modules() if name.endswith(f"self_attn.{suffix}")]
    if len(mods) != num_layers:
        raise ConfigError(
            "method.calibrate", True, f"found {len(mods)} self_attn.{suffix} modules for {num_layers} layers"
        )
    return mods


@register_method("kvquant")
class KVQuant(Method):
    Config = KVQuantConfig

    def __init__(self, config: KVQuantConfig):
        super().__init__(config)
        self.calibration: list[LayerCalibration] | None = None

    def prepare(self, model, tokenizer, shape, data_root) -> None:
        c = self.config
        text_config = model.config.get_text_config()
        params = getattr(text_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default") if isinstance(params, dict) else "default"
        partial = params.get("partial_rotary_factor", 1.0) if isinstance(params, dict) else 1.0
        if c.pre_rope and (rope_type != "default" or partial != 1.0):
            raise ConfigError(
                "method.pre_rope",
                c.pre_rope,
                f"only default-type full RoPE is supported (model has rope_type={rope_type!r}, "
                f"partial_rotary_factor={partial}); set method.pre_rope=false",
            )
        if c.calibrate:
            self.calibration = self.calibrate(model, tokenizer, shape, data_root)

    @torch.no_grad()
    def calibrate(self, model, tokenizer, shape, data_root) -> list[LayerCalibration]:
        c = self.config
        text = calibration_text(data_root)
        # The paper calibrates on WikiText-2 *train*; only the test split ships here, and the
        # perplexity task scores windows from its start, so calibration reads its end instead.
        ids = tokenizer(text[-8 * c.calibration_tokens :], return_tensors="pt").input_ids[0]
        ids = ids[-c.calibration_tokens :]
        captured: dict[tuple[str, int], list[torch.Tensor]] = {}

        def hook(kind, idx):
            def fn(_module, _inputs, out):
                b, t, _ = out.shape
                x = out.detach().float().reshape(b, t, shape.num_kv_heads, shape.head_dim)
                captured.setdefault((kind, idx), []).append(x.transpose(1, 2))  # [B, H, T, D]

            return fn

        handles = []
        for kind in ("k_proj", "v_proj"):
            for i, mod in enumerate(_projections(model, kind, shape.num_layers)):
                handles.append(mod.register_forward_hook(hook(kind, i)))
        try:
            device = next(model.parameters()).device
            for start in range(0, len(ids), CALIBRATION_WINDOW):
                window = ids[start : start + CALIBRATION_WINDOW]
                if len(window) > c.sink_tokens:
                    model(window[None].to(device), use_cache=False)
        finally:
            for handle in handles:
                handle.remove()
        skip = c.sink_tokens  # the sink is kept in fp16, so it is left out of calibration
        out = []
        for i in range(shape.num_layers):
            keys, values = [], []
            for k, v in zip(captured[("k_proj", i)], captured[("v_proj", i)], strict=True):
                if not c.pre_rope:
                    k = apply_rope(k, torch.arange(k.shape[-2], device=k.device), shape.rope_theta)
                keys.append(k[:, :, skip:].transpose(1, 2).reshape(-1, shape.num_kv_heads, shape.head_dim))
                values.append(v[:, :, skip:].transpose(1, 2).reshape(-1, shape.num_kv_heads, shape.head_dim))
            out.append(
                calibrate_layer(
                    torch.cat(keys),
                    torch.cat(values),
                    c.levels(c.key_bits),
                    c.levels(c.value_bits),
                    c.outlier_fraction,
                    c.datatype,
                )
            )
        return out

    def make_layer(self, layer_idx, shape, model_dtype):
        cal = self.calibration[layer_idx] if self.calibration is not None else None
        return KVQuantLayer(layer_idx, self.config, cal, shape.rope_theta, self.config.sink_tokens)

    def base_label(self) -> str:
        c = self.config
        bits = f"{c.key_bits:g}" if c.key_bits == c.value_bits else f"k{c.key_bits:g}v{c.value_bits:g}"
        label = f"kvquant-{c.datatype}{bits}b-o{c.outlier_fraction:g}"
        if not c.pre_rope:
            label += "-postrope"
        if not c.calibrate:
            label += "-online"
        return label
