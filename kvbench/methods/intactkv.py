"""``intactkv``: IntactKV (Liu et al., "IntactKV: Improving Large Language Model Quantization by
Keeping Pivot Tokens Intact", Findings of ACL 2024), for KV-cache quantization.

The first tokens of the input ([BOS], and in chat models the system prompt) are pivot tokens: they
draw most of the attention (attention sinks) and their keys and values carry outliers far larger
than other tokens'. IntactKV keeps their KV lossless and quantizes the rest: the first ``tokens``
entries of every layer's cache are held in ``fp_dtype``, every later token goes through ``base``.
``tokens=1`` is IntactKV_[B]; IntactKV_[P] sets ``tokens`` to the system prompt's token count.

Where the pivot KV comes from (``pivot``):

- ``model`` (the default; every run made before the option): the pivot tokens' KV as the model at
  hand computes it. With weights in full precision that already is the paper's lossless IntactKV.
  On a weight-quantized model (``model.weight_quant``) it is the KV-cache analogue of the paper:
  the weight-quantized model's own pivot KV, kept unquantized.
- ``full_precision``: the paper's IntactKV on a weight-quantized model (its § "pivot tokens" and
  Table 1: "先使用全精度模型生成关键词元的无损 KV 并将其缓存下来", the full-precision model generates
  the pivot tokens' lossless KV, which is cached and handed to the quantized model). With ``w`` the
  weights as loaded, ``ŵ`` their RTN values (:mod:`kvbench.models.weight_quant`), a prompt
  ``x_1..x_T`` and ``p = min(tokens, T - 1)`` pivot tokens, the prefill is two forwards into the
  same cache:

      (K_l[1:p], V_l[1:p]) = KV_l(w; x_1..x_p)                          every layer l, weights w
      h_t = f(ŵ; x_t | K[1:p], V[1:p], K[p+1:t], V[p+1:t]),  t = p+1..T   weights ŵ

  so every later token is computed by the quantized model attending over the full-precision
  model's pivot KV (read from the cache, held in ``fp_dtype``) and its own KV; decoding is the
  quantized model's throughout. The cache stores the same layout as under ``model``: the pivot
  entries in ``fp_dtype``, the rest through ``base`` (which makes this the paper's mixed-precision
  use with KV-cache quantization, its Fig. 4, with ``base`` a quantizer, and its Table 1 setting,
  an unquantized cache, with ``base: {name: fp16}``). ``p`` stops one token short of the prompt
  so that the logits of its last token (what the first generated or scored token is predicted
  from) are always the quantized model's; a prompt of ``tokens`` tokens or fewer therefore has
  fewer full-precision pivot entries, and the rest of the sink is filled by the quantized model,
  as under ``model``. The full-precision weights come from the copy ``model.weight_quant`` keeps
  (:func:`kvbench.models.weight_quant.loaded_weights`), swapped in for the pivot forward only;
  the paper computes IntactKV once for a common prefix and frees the full-precision model, which
  gives the same KV wherever the pivot tokens are the same prefix.

  A model without ``model.weight_quant`` is refused (ConfigError on ``method.pivot``, when the
  method is prepared on the loaded model): its weights are the full-precision ones, so the run
  would be the ``model`` run under another id. The prefill is the method's own
  (:meth:`~kvbench.methods.Method.drives_prefill`): never shared with other arms, and one prompt
  per prefill (a padded batched prefill is refused). It is honoured wherever a prompt is
  prefilled through :meth:`kvbench.generate.ModelRunner.prefill` (generation, perplexity and
  lm-eval scoring); probe tasks that run a forward of their own (attention captures) do not
  prefill through the method.

Whether the pivot KV is stored at full precision (``pivot_bits``):

- null (the default; every run made before the option): the pivot entries are held in
  ``fp_dtype``, lossless, as above (the paper's weight-only setting, Tables 1 and 3-5).
- ``B`` (2..8): the paper's weight-activation setting (its Table 6, "表6", OmniQuant and QuaRot at
  W4A4, and the paragraph above it: with activations quantized the KV cache must be fully low-bit,
  so IntactKV itself is quantized too, its pivot KV being flat enough that little is lost). Every
  pivot entry, key and value, is RTN-quantized per token, asymmetrically over its head's D
  channels, at ``L = 2^B`` levels (the affine quantizer of :mod:`kvbench.quant.affine`,
  ``z = min x``, ``s = (max x - min x) / (L - 1)``, ``c = clamp(floor((x - z) / s + 0.5), 0, L - 1)``,
  ``x' = c * s + z``), and held as packed codes with a scale and a zero per entry in ``fp_dtype``
  (a per-token :class:`~kvbench.cache.quantized.QuantizedTokens` in the sink,
  :meth:`kvbench.cache.sink.SinkLayer.hold_in`): attention reads the dequantized pivot, and the
  accounting counts its codes, scales and zeros with the base's. With ``pivot: full_precision``
  the entries quantized are the full-precision model's; with ``model``, the model's own. A base
  whose layers keep no sink of their own making (KVQuant keeps its sink inside its layer) is
  refused (ConfigError on ``method.pivot_bits``, when the cache is made).

The paper's optional calibration of the cached pivot KV (a training step minimising
``1/2 sum_l ||f_l(w, x) - f_l(ŵ, x; Θ)||^2`` over the IntactKV ``Θ``) is not implemented.

The same storage is the ``sink_tokens`` option every method has; this node names it as a method
of its own so it appears as one in sweeps and tables: ``base`` is any method's node, and ``bits``
is passed to it unless it sets its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvbench.cache.batch import SequenceBatchCache
from kvbench.cache.quantized import QuantizedTokens
from kvbench.cache.sink import SinkLayer
from kvbench.config import check_choice, inert, require
from kvbench.errors import ConfigError
from kvbench.methods.base import Method, MethodConfig, build_method, register_method
from kvbench.models.weight_quant import LoadedWeights, loaded_weights

# Where the pivot tokens' KV comes from (module docstring).
PIVOTS = ("model", "full_precision")
# The widths the pivot KV may be stored at (pivot_bits; null: fp_dtype).
PIVOT_BITS = range(2, 9)


@dataclass
class IntactKVConfig(MethodConfig):
    name: str = "intactkv"
    tokens: int = 1
    base: dict[str, Any] = field(default_factory=lambda: {"name": "kivi"})
    # inert: the runs made before the option computed the pivot KV with the model at hand
    pivot: str = inert("model")
    # inert: null (the pivot KV in fp_dtype) is every run made before the option
    pivot_bits: int | None = inert(None)

    default_bits: ClassVar[float] = 2.0

    def __post_init__(self):
        super().__post_init__()
        require(
            self.tokens >= 1,
            "method.tokens",
            self.tokens,
            "a token count >= 1",
        )
        require(
            self.base.get("name") not in (None, "intactkv"),
            "method.base.name",
            self.base.get("name"),
            "the node of another method (e.g. kivi, uniform)",
        )
        check_choice("method.pivot", self.pivot, PIVOTS)
        bits = self.pivot_bits
        if bits is not None and (
            isinstance(bits, bool) or not isinstance(bits, int) or bits not in PIVOT_BITS
        ):
            raise ConfigError(
                "method.pivot_bits",
                bits,
                f"null (the pivot KV in fp_dtype), or an integer from {PIVOT_BITS.start} to "
                f"{PIVOT_BITS.stop - 1} (per-token RTN codes)",
            )
        # the sliding-window rule is the wrapper's: the runner reads it from this config
        # the backend too (unless the base sets its own): the base's layers are the ones that store
        # and read, and a base that does not implement it refuses it here
        node = {
            "bits": self.bits,
            "fp_dtype": self.fp_dtype,
            "backend": self.backend,
            **self.base,
            "sink_tokens": self.tokens,
            "sliding_windows": self.sliding_windows,
        }
        self.base_method = build_method(node)

    def stored_levels(self):
        own = () if self.pivot_bits is None else (2**self.pivot_bits,)
        return self.base_method.config.stored_levels() + own

    def check_model(self, shape):
        self.base_method.config.check_model(shape)

    def context_warnings(self, lengths):
        return self.base_method.config.context_warnings(lengths)


@register_method("intactkv")
class IntactKV(Method):
    arm_batch = True  # where its base's does (kvbench.generate.joins_arm_batch)
    stack_rows = True
    Config = IntactKVConfig
    fp16_prefill = True  # as its base's is (prefill_is_fp16), with pivot=model

    def __init__(self, config: IntactKVConfig):
        super().__init__(config)
        self.weights: LoadedWeights | None = None  # pivot=full_precision: the weights as loaded

    def new_cache(self, shape, model_dtype):
        cache = self.config.base_method.new_cache(shape, model_dtype)
        bits = self.config.pivot_bits
        if bits is None:
            return cache
        sinks = [layer for layer in cache.layers if isinstance(layer, SinkLayer)]
        if not sinks:
            raise ConfigError(
                "method.pivot_bits",
                bits,
                f"null with base {self.config.base_method.registered_name}, whose layers keep no "
                "separate sink to quantize; or a base built on the common layers (uniform, kivi, fp16)",
            )
        param_dtype = self.config.torch_fp_dtype(model_dtype)
        backend = self.config.storage_backend()
        for layer in sinks:
            layer.hold_in(
                lambda: QuantizedTokens(2**bits, "token", None, param_dtype=param_dtype, backend=backend)
            )
        return cache

    # the cache is the base method's: so is the prefill, unless the pivot KV is the full-precision
    # model's (then the prefill is two forwards of its own)
    def prefill_is_fp16(self) -> bool:
        return not self.drives_prefill() and self.config.base_method.prefill_is_fp16()

    def needs_prefill_logits(self) -> bool:
        return self.config.base_method.needs_prefill_logits()

    def drives_prefill(self) -> bool:
        return self.config.pivot == "full_precision"

    def prepare(self, model, tokenizer, shape, data_root) -> None:
        if self.config.pivot != "full_precision":
            return
        self.weights = loaded_weights(model)
        if self.weights is None:
            raise ConfigError(
                "method.pivot",
                self.config.pivot,
                "full_precision only on a weight- or activation-quantized model (model.weight_quant "
                "or model.act_quant set): this model is already the full-precision one, so its pivot "
                "KV is the model's own; use pivot=model (the default), or set model.weight_quant "
                f"(allowed: {', '.join(PIVOTS)})",
            )

    def release(self) -> None:
        self.weights = None

    def prefill_forward(self, runner, input_ids, cache, logits_to_keep):
        """``pivot=full_precision``: the first ``p = min(tokens, T - 1)`` prompt tokens under the
        weights as loaded, then the rest under the quantized weights over the cache they left
        (module docstring). The logits are those one forward would return: the last
        ``logits_to_keep`` positions (0: all), the pivot forward's for positions before the rest."""
        if not self.drives_prefill():
            return super().prefill_forward(runner, input_ids, cache, logits_to_keep)
        if self.weights is None:
            raise RuntimeError("intactkv with pivot=full_precision: prepare() has not run on the model")
        if isinstance(cache, SequenceBatchCache):
            raise ValueError("intactkv with pivot=full_precision prefills one prompt (or equal rows) a call")
        total = input_ids.shape[1]
        pivot = min(self.config.tokens, total - 1)
        if pivot < 1:  # a one-token prompt: nothing before its last token
            return super().prefill_forward(runner, input_ids, cache, logits_to_keep)
        rest = total - pivot
        # rows of each forward's logits (0: all); the pivot forward's are needed only where more
        # rows are asked for than the rest has (else one row is computed and dropped)
        from_pivot = 0 if logits_to_keep == 0 else max(logits_to_keep - rest, 0)
        keep_head = 0 if logits_to_keep == 0 else max(from_pivot, 1)
        keep_tail = 0 if logits_to_keep == 0 else min(logits_to_keep, rest)
        with self.weights.swapped_in():
            head = runner.forward(input_ids[:, :pivot], cache, logits_to_keep=keep_head)
        tail = runner.forward(input_ids[:, pivot:], cache, logits_to_keep=keep_tail)
        if logits_to_keep == 0 or from_pivot:
            return torch.cat([head, tail], dim=1)
        return tail

    def base_label(self) -> str:
        pivot = "fp" if self.config.pivot == "full_precision" else ""
        stored = "" if self.config.pivot_bits is None else f"-pivot{self.config.pivot_bits}b"
        return f"intactkv{self.config.tokens}{pivot}{stored}-{self.config.base_method.base_label()}"

    def label(self) -> str:
        return self.base_label()
