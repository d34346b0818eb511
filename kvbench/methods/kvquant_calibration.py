"""KVQuant's offline calibration (Hooper et al., NeurIPS 2024, Sec. 3.6): per-(kv head, channel)
key ranges and the non-uniform codebooks, from the model's own keys and values on calibration text.

:func:`calibrate` runs the model over the last ``calibration_tokens`` tokens of WikiText-2 test
(windows of 512; the paper uses the train split, absent here, and the perplexity task scores the
start of test), capturing the k_proj/v_proj outputs (pre-RoPE keys; RoPE is applied for
``pre_rope: false``) with :class:`kvbench.cache.capture.OutputCapture`, and reduces each layer's
values to a :class:`LayerCalibration` (:func:`calibrate_layer`). The storage that uses it is
:class:`kvbench.cache.dense_sparse.DenseSparseTokens`. This module registers no method.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvbench.cache.capture import OutputCapture
from kvbench.errors import ConfigError
from kvbench.quant.nuq import (
    channel_thresholds,
    key_outliers,
    kmeans_1d,
    masked_range,
    normalize,
    scale_zero,
    topk_outlier_mask,
    uniform_codebook,
)
from kvbench.quant.rope import apply_rope

CALIBRATION_FILES = ("wikitext2/wiki.test.raw", "wikitext2/wikitext-test.txt")
CALIBRATION_WINDOW = 512
KMEANS_SAMPLES = 2**16  # normalized values per k-means fit (a seeded random subset)


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


def projection_outputs(shape):
    """The reduce of an :class:`OutputCapture` on k_proj/v_proj: ``[B, H_kv, T, D]`` float32."""

    def reduce(_args, _kwargs, out):
        b, t, _ = out.shape
        return out.detach().float().reshape(b, t, shape.num_kv_heads, shape.head_dim).transpose(1, 2)

    return reduce


@torch.no_grad()
def calibrate(model, tokenizer, shape, data_root, c) -> list[LayerCalibration]:
    """One :class:`LayerCalibration` per layer for the KVQuant config ``c`` (module docstring)."""
    text = calibration_text(data_root)
    # The paper calibrates on WikiText-2 *train*; only the test split ships here, and the
    # perplexity task scores windows from its start, so calibration reads its end instead.
    ids = tokenizer(text[-8 * c.calibration_tokens :], return_tensors="pt").input_ids[0]
    ids = ids[-c.calibration_tokens :]
    captured: dict[tuple[str, int], list[torch.Tensor]] = {}
    reduce = projection_outputs(shape)
    with (
        OutputCapture(_projections(model, "k_proj", shape.num_layers), reduce) as k_proj,
        OutputCapture(_projections(model, "v_proj", shape.num_layers), reduce) as v_proj,
    ):
        device = next(model.parameters()).device
        for start in range(0, len(ids), CALIBRATION_WINDOW):
            window = ids[start : start + CALIBRATION_WINDOW]
            if len(window) > c.sink_tokens:
                model(window[None].to(device), use_cache=False)
                for kind, capture in (("k_proj", k_proj), ("v_proj", v_proj)):
                    for i, x in capture.records.items():
                        captured.setdefault((kind, i), []).append(x)
                    capture.records.clear()
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
