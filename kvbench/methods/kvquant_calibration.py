"""KVQuant's offline calibration (Hooper et al., NeurIPS 2024, Sec. 3.6): per-(kv head, channel)
key ranges and the non-uniform codebooks, from the model's own keys and values on calibration text.

:func:`calibrate` runs the model over the last ``calibration_tokens`` tokens of the calibration text
(``method.calibration_data``, :func:`calibration_text`; default ``wikitext2``: WikiText-2 test under
the data root, whose end is used because the paper's train split is absent here and the perplexity
task scores the start of test) in windows of 512, with a progress bar. It captures the pre-RoPE
keys (k_proj outputs, through the attention's ``k_norm`` where the architecture has one, e.g.
Gemma-3 and Qwen3) and the v_proj outputs with :class:`kvbench.cache.capture.OutputCapture`; for
``pre_rope: false`` each layer's own RoPE (:func:`kvbench.quant.rope.layer_rope`) is applied to the
keys. Each layer's values are reduced to a :class:`LayerCalibration` (:func:`calibrate_layer`). The
storage that uses it is :class:`kvbench.cache.dense_sparse.DenseSparseTokens`. This module
registers no method.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvbench.cache.capture import OutputCapture
from kvbench.data import RECORD_SUFFIXES, corpus_suffix, read_documents, read_text, resolve_corpus_path
from kvbench.errors import ConfigError
from kvbench.kernels.lloyd import kmeans_1d
from kvbench.quant.nuq import (
    channel_thresholds,
    key_outliers,
    masked_range,
    normalize,
    scale_zero,
    topk_outlier_mask,
    uniform_codebook,
)
from kvbench.quant.rope import layer_rope

DATA_KEY = "method.calibration_data"
# The calibration datasets known by name, each the files under the data root tried in turn.
CALIBRATION_DATASETS = {"wikitext2": ("wikitext2/wiki.test.raw", "wikitext2/wikitext-test.txt")}
CALIBRATION_FILES = CALIBRATION_DATASETS["wikitext2"]
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


def calibration_file(data_root, source: str = "wikitext2") -> Path:
    """The file ``method.calibration_data`` names: a dataset of :data:`CALIBRATION_DATASETS` (its
    first file present under ``data_root``), else a path (relative: the working directory, then the
    data root). A missing file is a one-line ConfigError."""
    if source in CALIBRATION_DATASETS:
        names = CALIBRATION_DATASETS[source]
        for name in names:
            path = Path(data_root) / name
            if path.is_file():
                return path
        raise ConfigError(
            "data.root",
            str(data_root),
            f"kvquant calibration needs one of {', '.join(names)} there ({DATA_KEY}={source}); set "
            f"data.root, {DATA_KEY}=/path/to/text.txt, or method.calibrate=false",
        )
    try:
        return resolve_corpus_path(source, Path(data_root), DATA_KEY)
    except ConfigError as err:
        raise ConfigError(
            DATA_KEY,
            source,
            f"neither a calibration dataset ({', '.join(CALIBRATION_DATASETS)}) nor an existing file: "
            f"{err.allowed}",
        ) from None


def calibration_text(data_root, source: str = "wikitext2") -> str:
    """The calibration text of ``method.calibration_data`` (:func:`calibration_file`): a plain text
    file is read whole (UTF-8); a JSON-lines or parquet corpus (by its suffix) is its documents'
    ``text`` fields joined by blank lines."""
    path = calibration_file(data_root, source)
    if corpus_suffix(path) in RECORD_SUFFIXES:
        return "\n\n".join(read_documents(path, "text", key=DATA_KEY, field_key=DATA_KEY))
    return read_text(path, DATA_KEY)


def _projections(model, suffix: str, num_layers: int) -> list[torch.nn.Module]:
    mods = [m for name, m in model.named_modules() if name.endswith(f"self_attn.{suffix}")]
    if len(mods) != num_layers:
        raise ConfigError(
            "method.calibrate", True, f"found {len(mods)} self_attn.{suffix} modules for {num_layers} layers"
        )
    return mods


def _key_norms(model, num_layers: int) -> list[torch.nn.Module | None]:
    """Each layer's ``self_attn.k_norm`` (the per-head norm some architectures apply to the keys
    between k_proj and RoPE: Gemma-3, Qwen3), None where the attention has none."""
    names = [name for name, _ in model.named_modules() if name.endswith("self_attn.k_proj")]
    norms = [getattr(model.get_submodule(name.rsplit(".", 1)[0]), "k_norm", None) for name in names]
    return norms if len(norms) == num_layers else [None] * num_layers


def projection_outputs(shape, keep_dtype: bool = False):
    """The reduce of an :class:`OutputCapture` on k_proj/v_proj: ``[B, H_kv, T, D]`` float32 (in
    the model's dtype with ``keep_dtype``, for a k_norm to run on what the model feeds it)."""

    def reduce(_args, _kwargs, out):
        b, t, _ = out.shape
        x = out.detach() if keep_dtype else out.detach().float()
        return x.reshape(b, t, shape.num_kv_heads, shape.head_dim).transpose(1, 2)

    return reduce


def _post_rope(k: torch.Tensor, shape, layer_idx: int) -> torch.Tensor:
    """Keys ``[B, H_kv, T, D]`` of one window turned by layer ``layer_idx``'s own RoPE (positions
    0 .. T-1); a layer without RoPE keeps them as they are."""
    spec = layer_rope(shape, layer_idx)
    if spec is None:
        return k
    if spec.inv_freq is None:
        raise ConfigError(
            "method.pre_rope",
            False,
            f"post-RoPE calibration needs layer {layer_idx}'s RoPE frequencies (rope_type="
            f"{spec.rope_type!r}: {spec.problem}); set method.calibrate=false",
        )
    return spec.apply(k, torch.arange(k.shape[-2], device=k.device))


class _Memo:
    """What this process calibrated, by its inputs, for one model at a time: the captured keys and
    values by (model, calibration file and its modification time, token count), and the fitted
    calibrations by those plus everything of the config that :func:`calibrate` reads. The arms of a
    KVQuant ablation that differ elsewhere (outlier layout, backend) share both; arms with other
    bits, datatypes or sinks share the forward over the text (the sink only decides which captured
    tokens a fit leaves out). The
    results are the same tensors a fresh calibration computes (it is deterministic: seeded
    subsamples, k-means from fixed starts)."""

    def __init__(self):
        self.model: weakref.ref | None = None
        self.captured: dict[tuple, dict] = {}
        self.fitted: dict[tuple, list[LayerCalibration]] = {}

    def for_model(self, model) -> _Memo:
        if self.model is None or self.model() is not model:
            self.captured.clear()
            self.fitted.clear()
            self.model = weakref.ref(model)
        return self


_MEMO = _Memo()


@torch.no_grad()
def calibrate(model, tokenizer, shape, data_root, c) -> list[LayerCalibration]:
    """One :class:`LayerCalibration` per layer for the KVQuant config ``c`` (module docstring),
    computed once per process for the same inputs (:class:`_Memo`)."""
    source = getattr(c, "calibration_data", "wikitext2")
    path = calibration_file(data_root, source)
    memo = _MEMO.for_model(model)
    read = (str(path.resolve()), path.stat().st_mtime_ns, c.calibration_tokens)
    fit = (
        *read,
        c.sink_tokens,
        c.pre_rope,
        c.levels(c.key_bits),
        c.levels(c.value_bits),
        c.outlier_fraction,
        c.datatype,
    )
    if fit not in memo.fitted:
        if read not in memo.captured:
            memo.captured[read] = _capture(model, tokenizer, shape, data_root, c)
        memo.fitted[fit] = _fit(memo.captured[read], shape, c)
    return memo.fitted[fit]


def _capture(model, tokenizer, shape, data_root, c) -> dict[tuple[str, int], list[torch.Tensor]]:
    """The pre-RoPE keys and the values of every layer over the calibration windows."""
    source = getattr(c, "calibration_data", "wikitext2")
    text = calibration_text(data_root, source)
    # The paper calibrates on WikiText-2 *train*; only the test split ships here, and the
    # perplexity task scores windows from its start, so calibration reads the end of the text.
    ids = tokenizer(text[-8 * c.calibration_tokens :], return_tensors="pt").input_ids[0]
    ids = ids[-c.calibration_tokens :]
    captured: dict[tuple[str, int], list[torch.Tensor]] = {}
    norms = _key_norms(model, shape.num_layers)
    has_norm = any(norm is not None for norm in norms)
    reduce = projection_outputs(shape)
    # every window, whatever the sink: each is its own forward, and a fit drops those its sink fills
    windows = [ids[s : s + CALIBRATION_WINDOW] for s in range(0, len(ids), CALIBRATION_WINDOW)]
    bar = tqdm(
        windows,
        desc=f"kvquant calibration ({Path(source).name}, {len(ids)} tokens)",
        unit="window",
        file=sys.stderr,
    )
    with (
        OutputCapture(
            _projections(model, "k_proj", shape.num_layers), projection_outputs(shape, has_norm)
        ) as k_proj,
        OutputCapture(_projections(model, "v_proj", shape.num_layers), reduce) as v_proj,
    ):
        device = next(model.parameters()).device
        for window in bar:
            model(window[None].to(device), use_cache=False)
            for i, x in k_proj.records.items():
                # the pre-RoPE key is what the layer's k_norm (if any) makes of the k_proj output
                x = x if norms[i] is None else norms[i](x)
                captured.setdefault(("k_proj", i), []).append(x.float())
            for i, x in v_proj.records.items():
                captured.setdefault(("v_proj", i), []).append(x)
            k_proj.records.clear()
            v_proj.records.clear()
    return captured


def _fit(captured: dict[tuple[str, int], list[torch.Tensor]], shape, c) -> list[LayerCalibration]:
    """Each layer's :class:`LayerCalibration` from its captured keys and values."""
    skip = c.sink_tokens  # the sink is kept in fp16, so it is left out of calibration
    out = []
    for i in range(shape.num_layers):
        keys, values = [], []
        for k, v in zip(captured[("k_proj", i)], captured[("v_proj", i)], strict=True):
            if k.shape[2] <= skip:
                continue  # a window no longer than the sink: nothing of it is quantized
            if not c.pre_rope:
                k = _post_rope(k, shape, i)
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
