"""``kvquant``: KVQuant (Hooper et al., "KVQuant: Towards 10 Million Context Length LLM Inference
with KV Cache Quantization", NeurIPS 2024).

Components (each switchable for the ablation):

- Per-channel keys, per-token values (Sec. 3.1). Keys use one fixed range per (kv head, channel)
  calibrated offline; values use a range computed online for every token.
- Pre-RoPE keys (Sec. 3.2, ``pre_rope``): the cache receives post-RoPE keys; token ``p`` (its
  absolute position, the number of tokens the layer saw before it) is rotated back by ``-p w``
  (:func:`kvbench.quant.rope.rotate` with ``inverse=True``), quantized, and rotated by ``+p w`` again after
  dequantization when read. ``false`` quantizes the post-RoPE keys. Each layer uses its own RoPE
  (``ModelShape.rope``, :class:`kvbench.quant.rope.RoPESpec`: the inverse frequencies transformers
  computes for that layer's type and parameters, per layer type on Gemma-3); the types whose
  rotation is the same at every step are supported (default, linear, llama3). ``dynamic``/``longrope``
  (frequencies that change with the sequence length), ``yarn`` (scaled cos/sin), partial RoPE and
  models without RoPE are refused by ``check_model``, before the weights load.
- Non-uniform datatype (Sec. 3.3, ``datatype``): ``nuq`` uses one codebook of 2^b signposts per
  layer for keys and one for values, 1-D k-means of the calibration values normalized to [-1, 1] by
  their own range (:mod:`kvbench.quant.nuq`). The paper weights the k-means objective by Fisher
  information (squared gradients); this implementation uses the unweighted objective
  (``sensitivity_weighted: true`` is rejected). ``uniform`` uses the affine grid on [lo, hi].
- Dense-and-sparse per-vector outliers (Sec. 3.4, ``outlier_fraction`` f): keys: elements outside
  the calibrated per-channel thresholds (the f/2 and 1-f/2 quantiles of the channel); values: the
  ceil(f D) largest-magnitude elements of each token. Outliers are held in fp16 with their positions
  and excluded from the range; 0 disables (ranges are then min/max and keys are clamped to the
  calibrated range). ``outlier_layout`` decides how the key outliers are held: ``ragged``, every
  element beyond its channel's threshold (as many as the data say: on a device, one host read per
  append); ``fixed``, ``ceil(f D)`` per (token, head) vector, those beyond their threshold by the
  most relative to the channel's range, so that the append never waits for the device (a vector's
  elements beyond the threshold that do not fit are coded and clamped like in-range ones and counted
  as overflow; slots left over hold its most extreme in-range elements, exactly);
  ``auto`` (default), ``fixed`` with backend ``triton`` (whose runs have ids of their own),
  ``ragged`` otherwise, on any device (backend ``auto`` shares run ids across devices, so it keeps
  the CPU runs' bytes and the ids of the runs before the knob). ``fixed`` is written in the label
  (``-o0.01fixed``); a run that held key outliers in the fixed layout without asking for it
  (``auto``), or whose fixed layout overflowed, says so in its warnings
  (``kvquant_fixed_outliers``, from the overflow counted on the device and read once per request).
- Attention sink (Sec. 3.5, ``sink``): the first token is kept in fp16 (``sink_tokens = 1``,
  :class:`kvbench.cache.sink.SinkLayer`) and left out of calibration.
- Offline calibration (Sec. 3.6, ``calibrate``): :meth:`KVQuant.prepare` runs the model over
  the last ``calibration_tokens`` tokens of ``calibration_data`` (default ``wikitext2``: WikiText-2
  test under the data root; or a text file; windows of 512; the paper uses the train split, absent
  here, and the perplexity task scores the start of test), capturing k_proj/v_proj outputs (pre-RoPE
  keys, after k_norm where the model has one; each layer's RoPE is applied for ``pre_rope: false``),
  with a progress bar; the pipeline is
  :mod:`kvbench.methods.kvquant_calibration`. ``false`` computes the same statistics from the
  layer's first stored block (the prompt) instead, frozen afterwards.

Reconstruction: ``x_hat = c[q] * scale + zero`` with outliers overwritten by their fp16 values
(storage: :class:`kvbench.cache.dense_sparse.DenseSparseTokens`).

Held per layer (``held_tensors``): ``codes`` (packed codebook indices of every key and value
element, :mod:`kvbench.quant.packing`), ``scales``/``zeros`` (fp16: per token for values, per
(head, channel) for keys), ``codebook`` (fp16 signposts, ``nuq`` only), ``sparse`` (outliers:
int32 token index, int16 (or int32) index of (batch, head, channel), fp16 value). Backend ``auto``
(default) appends and reads through the compiled CPU kernels where they built (bit-identical
appends; reads equal to float rounding), ``torch`` through the reference only, ``triton`` appends
through the reference (key outliers in the fixed layout unless ``outlier_layout=ragged``: no host
sync) and reads through :class:`~kvbench.kernels.triton_parts.TritonReader`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kvbench.cache import KVLayer
from kvbench.cache.dense_sparse import OUTLIER_LAYOUTS, DenseSparseTokens
from kvbench.cache.layer import StoredTokens
from kvbench.cache.source import RoPESource
from kvbench.config import check_choice, inert, require
from kvbench.errors import ConfigError
from kvbench.methods.base import Method, MethodConfig, register_method
from kvbench.methods.kvquant_calibration import LayerCalibration, calibrate, calibrate_layer
from kvbench.quant.nuq import outlier_count
from kvbench.quant.rope import RoPESpec, layer_rope, pre_rope_problem, rotate

DATATYPES = ("nuq", "uniform")


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
    calibration_data: str = inert("wikitext2")
    sensitivity_weighted: bool = False
    # added after the CPU runs were stored: auto is ragged there, what they computed
    outlier_layout: str = inert("auto")

    # triton: appends run the torch reference (DenseSparseTokens has no Triton quantizer; outlier_layout
    # auto holds the key outliers in the fixed layout there, so no append waits for the device;
    # ragged keeps one nonzero per append, as backend auto does on CUDA), reads run TritonReader
    # (codebook parts, pre-RoPE keys rotated in the kernel, sparse outliers).
    backends: ClassVar[tuple[str, ...]] = ("auto", "torch", "triton")
    default_bits: ClassVar[float] = 3.0

    def __post_init__(self):
        super().__post_init__()
        require(
            not self.sensitivity_weighted,
            "method.sensitivity_weighted",
            self.sensitivity_weighted,
            "not implemented (Fisher-weighted k-means needs gradients); only false (unweighted k-means)",
        )
        check_choice("method.datatype", self.datatype, DATATYPES)
        check_choice("method.outlier_layout", self.outlier_layout, OUTLIER_LAYOUTS)
        f = self.outlier_fraction
        require(
            0 <= f < 0.5,
            "method.outlier_fraction",
            f,
            "a fraction in [0, 0.5) (0 disables the sparse outliers)",
        )
        self.outlier_fraction = float(f)
        n = self.calibration_tokens
        require(
            n >= 2,
            "method.calibration_tokens",
            n,
            "an integer >= 2",
        )
        require(
            isinstance(self.calibration_data, str) and self.calibration_data.strip() != "",
            "method.calibration_data",
            self.calibration_data,
            "a calibration dataset name (wikitext2) or the path of a text file",
        )
        if self.sink:
            self.sink_tokens = max(self.sink_tokens, 1)
        self.resolve_kv_bits()

    def check_model(self, shape):
        if self.pre_rope:
            problem = pre_rope_problem(shape)
            require(
                problem is None, "method.pre_rope", self.pre_rope, f"{problem}; set method.pre_rope=false"
            )
        require(shape.head_dim % 2 == 0, "method.pre_rope", self.pre_rope, "needs an even head_dim")


class KVQuantLayer(KVLayer):
    """``position_offset``: absolute position of the first token this layer stores (the sink
    tokens held in front of it by :class:`SinkLayer` come first). ``rope``: the layer's own RoPE
    (:func:`kvbench.quant.rope.layer_rope`). A stored token's position is the number of tokens
    stored before it, so the layer must see every token (one behind a window that drops tokens
    would need the dropped count added)."""

    def __init__(
        self,
        layer_idx: int,
        cfg: KVQuantConfig,
        calibration: LayerCalibration | None,
        rope: RoPESpec | None,
        position_offset: int = 0,
    ):
        super().__init__(layer_idx)
        self.cfg, self.calibration, self.rope = cfg, calibration, rope
        self.offset = position_offset
        self.k_levels, self.v_levels = cfg.levels(cfg.key_bits), cfg.levels(cfg.value_bits)
        self.kq: DenseSparseTokens | None = None
        self.vq: DenseSparseTokens | None = None
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None
        problem = "has no RoPE" if rope is None else rope.pre_rope_problem()
        if cfg.pre_rope and problem is not None:
            raise ConfigError(
                "method.pre_rope", True, f"layer {layer_idx} {problem}; set method.pre_rope=false"
            )

    def _cos_sin(self, start: int, n: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[n, D]`` of the stored tokens ``start .. start + n - 1`` (absolute positions
        ``offset + start ..``) with the layer's own frequencies, from a table grown by doubling
        (read runs every decode step)."""
        end = self.offset + start + n
        if self._table is None or self._table[0].shape[0] < end or self._table[0].device != like.device:
            size = max(end, 2 * (0 if self._table is None else self._table[0].shape[0]))
            self._table = self.rope.cos_sin(torch.arange(size, device=like.device))
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
        backend = self.cfg.backend
        self.kq = DenseSparseTokens(
            self.k_levels,
            cal.key_codebook,
            f,
            (cal.key_scale, cal.key_zero),
            backend=backend,
            outlier_layout=self.cfg.outlier_layout,
        )
        self.vq = DenseSparseTokens(self.v_levels, cal.value_codebook, f, backend=backend)

    def append(self, keys, values):
        k = keys.float()
        if self.cfg.pre_rope:
            k = rotate(k, *self._cos_sin(self.num_tokens, k.shape[-2], k), inverse=True)
        if self.kq is None:
            self._setup(k, values.float())
        self.kq.append(k)
        self.vq.append(values)

    def stored(self) -> StoredTokens:
        """Keys and values as codebook sources, outliers included; pre-RoPE keys are rotated to their
        positions a block at a time as they are read."""
        keys = self.kq.source()
        if self.cfg.pre_rope:
            like = torch.empty(0, self.kq.shape[2], device=keys.codes.device)  # device and head dim
            self._cos_sin(0, self.num_tokens, like)  # grows the table over every stored position
            # the table always covers the stored keys, so RoPESource never computes default-type angles
            keys = RoPESource(keys, None, first_position=self.offset, table=self._table)
        return StoredTokens(keys, self.vq.source())

    def bytes_reserved(self):
        return 0 if self.kq is None else self.kq.bytes_reserved() + self.vq.bytes_reserved()

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


@register_method("kvquant")
class KVQuant(Method):
    fp16_prefill = True
    arm_batch = True
    Config = KVQuantConfig
    # the contract's shape has no rope_theta and no model to calibrate on: post-RoPE, prompt statistics
    contract_node = {"bits": 2, "calibrate": False, "pre_rope": False}
    contract_error = 0.6

    def __init__(self, config: KVQuantConfig):
        super().__init__(config)
        self.calibration: list[LayerCalibration] | None = None
        # over the requests whose key outliers were held in the fixed layout (run_warnings)
        self.fixed_requests = self.fixed_overflow = self.fixed_key_values = self.fixed_budget = 0

    def end_request(self, cache) -> None:
        """Adds up what the request's key stores held in the fixed outlier layout: their overflow
        counters are read once per request, never per step."""
        stores = [
            layer.kq
            for part in cache.layers
            for layer in (part, getattr(part, "inner", None))
            if isinstance(layer, KVQuantLayer) and layer.kq is not None
        ]
        fixed = [s for s in stores if s.outlier_layout == "fixed" and s.overflow() is not None]
        if not fixed:
            return
        device = fixed[0].overflow().device
        self.fixed_requests += 1
        self.fixed_overflow += int(sum(s.overflow().to(device) for s in fixed))
        self.fixed_key_values += sum(s.quantized_values() for s in fixed)
        self.fixed_budget = outlier_count(fixed[0].shape[2], self.config.outlier_fraction)

    def run_warnings(self) -> dict[str, str]:
        asked = self.config.outlier_layout == "fixed"
        if not self.fixed_requests or (asked and not self.fixed_overflow):
            return {}
        how = (
            "method.outlier_layout=fixed"
            if asked
            else "method.outlier_layout=auto with method.backend=triton"
        )
        share = 100 * self.fixed_overflow / max(self.fixed_key_values, 1)
        return {
            "kvquant_fixed_outliers": (
                f"{self.label()}: key outliers held as a fixed {self.fixed_budget} per vector ({how}), "
                f"not every element beyond its channel's threshold; over {self.fixed_requests} request(s), "
                f"{self.fixed_overflow} of {self.fixed_key_values} key elements ({share:.3g}%) were beyond "
                "it with no slot left and were clamped to the range"
            )
        }

    def prepare(self, model, tokenizer, shape, data_root) -> None:
        self.config.check_model(shape)  # the runner checked already; cheap, for direct callers
        if self.config.calibrate:
            self.calibration = self.calibrate(model, tokenizer, shape, data_root)

    def calibrate(self, model, tokenizer, shape, data_root) -> list[LayerCalibration]:
        return calibrate(model, tokenizer, shape, data_root, self.config)

    def make_layer(self, layer_idx, shape, model_dtype):
        cal = self.calibration[layer_idx] if self.calibration is not None else None
        rope = layer_rope(shape, layer_idx)
        return KVQuantLayer(layer_idx, self.config, cal, rope, self.config.sink_tokens)

    def base_label(self) -> str:
        c = self.config
        bits = f"{c.key_bits:g}" if c.key_bits == c.value_bits else f"k{c.key_bits:g}v{c.value_bits:g}"
        label = f"kvquant-{c.datatype}{bits}b-o{c.outlier_fraction:g}"
        if c.outlier_layout == "fixed" and c.outlier_fraction > 0:
            label += "fixed"  # auto's layout is not known before the append; the run's warnings say it
        if not c.pre_rope:
            label += "-postrope"
        if not c.calibrate:
            label += "-online"
        return label
