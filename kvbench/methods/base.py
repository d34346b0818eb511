"""What every method is: a validated config, and a factory of per-layer cache storage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbench.cache import KVBenchCache, KVLayer
from kvbench.cache.sink import SinkLayer
from kvbench.cache.sliding import SlidingWindowLayer
from kvbench.config import DTYPES, build_config, check_choice, inert, is_int, not_in_run_id, require
from kvbench.errors import ConfigError
from kvbench.kernels.runtime import require_triton, triton_available
from kvbench.models import ModelShape
from kvbench.quant.affine import levels_for_bits
from kvbench.registry import Registry

# ``auto``: compiled CPU kernels read the stored tokens on the CPU (torch packs them), triton does
# both on CUDA where it is installed; ``torch``: the plain-torch reference everywhere.
BACKENDS = ("auto", "torch", "triton")
# What a sliding-window layer (Gemma-3's local layers) holds: ``full_precision``, its window in
# fp_dtype as transformers' cache does (the default); ``method``, every token in the method's own
# storage, like a full-attention layer, the window applied by the model's sliding mask.
SLIDING_RULES = ("full_precision", "method")
METHODS: Registry[type[Method]] = Registry("method")
register_method = METHODS.register


@dataclass
class MethodConfig:
    """Fields every method has. ``bits`` is the run's top-level knob; ``None`` means the method's
    default. ``fp_dtype`` is the dtype of whatever a method keeps in full precision (FP16 as in the
    papers; ``auto`` keeps the model's own dtype). ``backend`` chooses who quantizes, packs and
    reads the stored codes: ``auto`` (default: on the CPU torch packs and the compiled kernels of
    :mod:`kvbench.kernels.cpu` read, falling back to torch where they did not build; on CUDA
    triton where installed), ``torch`` (the reference) or ``triton`` (kernels that hold the same
    bytes; needs CUDA or the Triton CPU interpreter). The bytes stored are the same under every
    backend, and reads differ by float reassociation only, so ``auto`` and ``torch`` share run ids
    (:func:`kvbench.results.canonical_config`). ``sink_tokens`` keeps the first k tokens
    of every sequence lossless in ``fp_dtype`` in front of any method's storage (IntactKV; KVQuant's
    attention sink).

    ``bits_knob`` names the field the run's top-level ``bits`` fills (:func:`with_run_bits`):
    ``bits`` for a method whose code width is its bit knob, another field where the run's bits mean
    something else (ReadKV: the read budget), ``None`` for a method without one (FP16, eviction), so
    that a node never has to carry a ``bits: ${bits}`` line to see the run's value.

    ``sliding_windows`` (:data:`SLIDING_RULES`) is the rule for sliding-window layers: by default
    they hold their window in full precision under every method (so a Gemma-3 model keeps 12-15
    effective bits at 1K tokens whatever the method); ``method`` stores those layers as the method
    stores every other layer, as the papers (whose models have no sliding layers) quantize every
    layer's cache. Such a layer holds every token it was given (methods cannot drop a token from
    their codes), the model's sliding mask keeps attention to the window, and its accounting counts
    what it holds: effective bits are then the method's, not transformers' window's. A run records
    the rule it used in its metrics (``sliding_windows``).

    ``cuda_graph`` turns on the static decode step (:mod:`kvbench.cache.static`): the cache is
    preallocated to the request's capacity with device-side lengths, and on CUDA each request's
    decode step is captured once as a CUDA graph and replayed; elsewhere the same static step runs
    eagerly. It stores the same bytes and computes the same attention (over zero-filled, hidden
    rows past the written ones), so it is not part of the run id. Methods declare whether their
    cache has such a step (:meth:`static_step_refusal`)."""

    name: str = ""
    bits: float | None = None
    fp_dtype: str = "float16"
    backend: str = "auto"
    sink_tokens: int = 0
    sliding_windows: str = inert("full_precision")
    cuda_graph: bool = not_in_run_id(False)

    default_bits: ClassVar[float | None] = None
    # Bumped whenever the method's stored bytes or attention change for the same config: a version
    # other than 1 enters the run id (kvbench.results.canonical_config), so a bump starts new runs,
    # and a run folder refuses to resume rows that another version wrote.
    version: ClassVar[int] = 1
    # The backends a method implements; a method with only the torch reference sets ("torch",).
    backends: ClassVar[tuple[str, ...]] = BACKENDS
    bits_knob: ClassVar[str | None] = "bits"
    # Seconds per sample against FP16's on the same work, for the cost estimate of ``python -m
    # kvbench.reproduce --dry-run``: on this CPU (the FP16 and quantized NIAH records here: 133-147 s
    # against 110 s) and on a GPU (unfused torch code reads and dequantizes the cache; assumed).
    cost_cpu: ClassVar[float] = 1.3
    cost_gpu: ClassVar[float] = 2.0
    # What of this method has a static (graph-capturable) decode step, in words for the refusal of
    # the others (None: nothing); static_step_refusal says whether this config is covered.
    static_step: ClassVar[str | None] = None

    def __post_init__(self):
        check_choice("method.fp_dtype", self.fp_dtype, (*DTYPES, "auto"))
        check_choice("method.backend", self.backend, BACKENDS)
        check_choice("method.sliding_windows", self.sliding_windows, SLIDING_RULES)
        if self.backend != "auto" and self.backend not in self.backends:
            raise ConfigError(
                "method.backend",
                self.backend,
                f"only {', '.join(self.backends)} is implemented for {self.name}",
            )
        require(self.sink_tokens >= 0, "method.sink_tokens", self.sink_tokens, "a token count >= 0")
        if self.backend == "triton":
            require_triton("method.backend")
        require(isinstance(self.cuda_graph, bool), "method.cuda_graph", self.cuda_graph, "true or false")
        if self.cuda_graph:
            refusal = self.static_step_refusal()
            if refusal is not None:
                covered = ", ".join(
                    step for n in METHODS.names() if (step := METHODS.get(n).Config.static_step)
                )
                raise ConfigError(
                    "method.cuda_graph", True, f"{refusal}; a static decode step exists for {covered}"
                )
        if self.bits is None:
            self.bits = self.default_bits
        if self.bits is not None:
            self.bits = float(self.bits)

    def storage_backend(self) -> str:
        """Who quantizes and packs: ``backend``, with ``auto`` resolved to ``triton`` on a CUDA
        machine with triton (for a method that implements it) and otherwise left ``auto``: the
        stores then append through the compiled CPU kernels where they cover the layout (on CPU
        tensors; bit-identical to the torch reference) and through torch elsewhere."""
        if self.backend != "auto":
            return self.backend
        if "triton" in self.backends and torch.cuda.is_available() and triton_available():
            return "triton"
        return "auto"

    def resolve_kv_bits(self) -> None:
        """Fill ``key_bits``/``value_bits`` (fields of methods that quantize keys and values
        separately) from ``bits`` where unset, validating each under the key the user actually set."""
        for part in ("key_bits", "value_bits"):
            own = getattr(self, part)
            self.levels(self.bits if own is None else own, key="bits" if own is None else f"method.{part}")
            setattr(self, part, float(self.bits if own is None else own))

    def levels(self, bits: float | None = None, key: str = "bits") -> int:
        return levels_for_bits(self.bits if bits is None else bits, key=key)

    def stored_levels(self) -> tuple[int, ...]:
        """Level counts of the codes this config packs with :mod:`kvbench.quant.packing`; a config
        with one that is not a power of two carries the packing's version in its run id
        (:func:`kvbench.results.canonical_config`). Default: those of ``key_bits``/``value_bits``
        where the config has them."""
        kv = (getattr(self, part, None) for part in ("key_bits", "value_bits"))
        return tuple(self.levels(bits) for bits in kv if bits is not None)

    def check_model(self, shape: ModelShape) -> None:
        """Checks that need the model (group sizes against head_dim, ...). Raise ConfigError."""

    def static_step_refusal(self) -> str | None:
        """Why this config has no static decode step (``method.cuda_graph``), None when it has one.
        Default: the method has none."""
        if self.static_step is None:
            return f"{self.name}'s cache has no static decode step"
        if self.sink_tokens:
            return "sink_tokens > 0 (the sink layer has no static step)"
        return None

    def check_static_model(self, shape: ModelShape) -> None:
        """``method.cuda_graph`` against the model: sliding-window layers keep a rolling window, which
        has no static step."""
        sliding = shape.sliding_layers()
        if self.cuda_graph and sliding:
            raise ConfigError(
                "method.cuda_graph",
                True,
                f"a model without sliding-window layers (this one has them at layers {sliding})",
            )

    def context_warnings(self, lengths: list[int]) -> dict[str, str]:
        """Settings that defeat the method at these prompt lengths (tokens): warning code -> one line.
        They stay legal (an FP16 upper bound is a fair thing to measure), but a long unattended sweep
        must not report such a point as a compressed cache without saying so."""
        return covers_context("sink_tokens", self.sink_tokens, lengths, "every token is kept lossless")

    def torch_fp_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return model_dtype if self.fp_dtype == "auto" else getattr(torch, self.fp_dtype)


def covers_context(key: str, value: Any, lengths: list[int], consequence: str) -> dict[str, str]:
    """The warning for a token count ``method.<key>`` that reaches the prompt length, if it does."""
    covered = [n for n in lengths if is_int(value) and value >= n]
    if not covered:
        return {}
    where = "every prompt length" if len(covered) == len(lengths) else f"prompt lengths {covered}"
    return {
        f"{key}_covers_context": f"method.{key}={value} covers the whole prompt at {where}: {consequence}"
    }


def check_group(key: str, group_size: int | None, dim: int, what: str) -> None:
    if group_size is None:
        return
    require(
        isinstance(group_size, int) and group_size > 0 and dim % group_size == 0,
        key,
        group_size,
        f"must divide {what}={dim} (divisors: {', '.join(str(d) for d in range(1, dim + 1) if not dim % d)})",
    )


class Method:
    """A KV-cache method. Subclasses set ``Config`` and either ``Layer`` or :meth:`make_layer`."""

    Config: ClassVar[type[MethodConfig]] = MethodConfig
    # The layer class, built as ``Layer(layer_idx, config, fp_dtype)`` by the default make_layer.
    Layer: ClassVar[type[KVLayer] | None] = None
    registered_name: ClassVar[str]
    # The contract every registered method passes (tests/methods/test_method_table.py) builds it
    # from ``{"name": NAME, **contract_node}`` on a small shape with a 300-token prompt and 40 decode
    # tokens, and bounds the relative reconstruction error of a method that quantizes (``bits`` set)
    # by ``contract_error``; methods whose defaults do not suit that setting override them here.
    contract_node: ClassVar[dict[str, Any]] = {}
    contract_error: ClassVar[float] = 0.5

    # Whether the prefill forward under this method is the FP16 one (attention over the exact keys
    # and values just computed, nothing read from the forward but the cache's update and attend
    # calls), so that a prefill recorded under any declaring method can be handed to this method's
    # cache instead of running the model again (kvbench.cache.prefill). Declared, never assumed:
    # tests/cache/test_prefill.py checks every declaring method's cache holds the same bytes after
    # a shared prefill as after its own.
    fp16_prefill: ClassVar[bool] = False
    # Whether this method's rows may share a batched forward with other methods' rows (one row per
    # arm of a sweep, each in its own cache: kvbench.generate.score_arms): its storage and hooks act
    # per sequence cache only, never on the model (SemKV's hidden-state hooks see every row of a
    # forward). Declared, never assumed: tests/test_batched_decode.py checks each declaring method
    # scores the same in a batch of arms as in its own batch.
    arm_batch: ClassVar[bool] = False
    # Whether a batch of equal-length sequences may be decoded as one cache of B rows
    # (kvbench.cache.stack): everything the layers hold per sequence stays in batch-first token
    # buffers through the whole request. Declared, never assumed (tests/test_batched_decode.py).
    stack_rows: ClassVar[bool] = False

    def __init__(self, config: MethodConfig):
        self.config = config

    def prefill_is_fp16(self) -> bool:
        """Whether this configuration's prefill may be shared (:attr:`fp16_prefill`, unless a
        configuration reads more of the forward)."""
        return self.fp16_prefill and not self.needs_prefill_logits()

    def needs_prefill_logits(self) -> bool:
        """Whether :meth:`after_forward` reads the prefill's logits at every prompt position (the
        runner otherwise computes only the last positions'). Default: no."""
        return False

    def drives_prefill(self) -> bool:
        """Whether this configuration runs a prompt's prefill itself (:meth:`prefill_forward`), as
        something other than one forward of the model over the prompt; such a prefill is never
        shared and cannot be one left-padded forward of several prompts
        (:meth:`kvbench.generate.ModelRunner.generate_batch` refuses ``prefill="batch"``).
        Default: no."""
        return False

    def prefill_forward(
        self, runner, input_ids: torch.Tensor, cache: KVBenchCache, logits_to_keep: int
    ) -> torch.Tensor:
        """A prompt's prefill that is not shared (:meth:`kvbench.generate.ModelRunner.prefill`):
        ``input_ids [B, T]`` into the fresh ``cache``; returns float32 logits of the last
        ``logits_to_keep`` positions (0: all T), ``[B, r, vocab]``. It must go through
        ``runner.forward`` for every forward it makes. Default: one forward over the prompt; a
        method whose :meth:`drives_prefill` is True replaces it (IntactKV with
        ``pivot=full_precision``: the pivot tokens under the weights as loaded, then the rest)."""
        return runner.forward(input_ids, cache, logits_to_keep=logits_to_keep)

    def prefilled_alone(self, cache: KVBenchCache) -> None:
        """Called after a sequence of a batch was prefilled on its own into ``cache``
        (:meth:`kvbench.generate.ModelRunner.prefill_alone`), before the next sequence's prefill:
        per-request state the method keeps on itself goes onto that sequence now, as a batched
        prefill's :meth:`after_forward_batch` would have put it. Default: nothing."""

    def release(self) -> None:
        """Undo what :meth:`prepare` attached to the model (forward hooks), so that a model kept
        for the next run of the process carries nothing of this one. Default: nothing."""

    def make_layer(self, layer_idx: int, shape: ModelShape, model_dtype: torch.dtype) -> KVLayer:
        """One transformer layer's storage. Default: ``Layer(layer_idx, config, fp_dtype)``, with
        ``fp_dtype`` the dtype of whatever the method keeps in full precision."""
        if self.Layer is None:
            raise NotImplementedError(f"{type(self).__name__} sets neither Layer nor make_layer")
        return self.Layer(layer_idx, self.config, self.config.torch_fp_dtype(model_dtype))

    def after_forward(self, cache: KVBenchCache, input_ids: torch.Tensor, logits: torch.Tensor) -> None:
        """Called by :meth:`kvbench.generate.ModelRunner.forward` after every forward (prefill,
        decode step, scored chunk) with its ``input_ids [B, t]`` and float32 ``logits [B, t, vocab]``:
        methods that decide what to store from the model's outputs (SemKV's logit metrics, delayed
        allocation) act here. Default: nothing."""

    def after_forward_batch(
        self, caches: list[KVBenchCache], input_ids: torch.Tensor, logits: torch.Tensor, starts: list[int]
    ) -> None:
        """:meth:`after_forward` for a batched forward over per-sequence caches
        (:class:`~kvbench.cache.batch.SequenceBatchCache`): row r of ``input_ids [R, t]`` and
        ``logits [R, t, vocab]`` is the sequence of ``caches[r]``, its real tokens from column
        ``starts[r]`` on (left pads before). Default: :meth:`after_forward` on each sequence's own
        cache and columns, so a method sees exactly what it sees alone; a method whose hook reads
        other per-forward state (SemKV's hidden-state records) slices that too."""
        for r, (cache, start) in enumerate(zip(caches, starts, strict=True)):
            self.after_forward(cache, input_ids[r : r + 1, start:], logits[r : r + 1, start:])

    def decode_step(self, runner, cache: KVBenchCache, input_ids: torch.Tensor) -> torch.Tensor:
        """One decode step: feed ``input_ids [B, 1]``, the token just chosen (or, when scoring, the
        next given token), and return float32 logits ``[B, 1, vocab]`` that predict the token after
        it (B > 1: a :class:`~kvbench.cache.batch.SequenceBatchCache`, one row per sequence still
        decoding; per-request state goes on :func:`~kvbench.cache.batch.sequence_caches`). The
        generation loop calls it for every token after the prefill and the scoring loop for every
        one-token forward, so a method that changes how a step runs (SpeCache's two-token
        speculative forward) is decoded and scored alike. It must go through ``runner.forward``
        (which runs :meth:`after_forward`) for every forward it makes, and may keep per-request
        state on ``cache``, which is fresh for every request. Default: one plain forward."""
        return runner.forward(input_ids, cache)

    def new_request(self, new_tokens: int) -> None:
        """Called by the runner before each request's cache is made, with how many tokens the
        request will store after its prompt (a scored continuation's length; a generation's
        ``max_new_tokens - 1``, its last token being stored nowhere). Default: nothing."""

    def end_request(self, cache: KVBenchCache) -> None:
        """Called by the runner with each request's cache once it is done. Default: nothing."""

    def run_warnings(self) -> dict[str, str]:
        """Warnings from the requests this process ran (code -> one line), merged into the run's
        metrics. Default: none."""
        return {}

    def prepare(self, model, tokenizer, shape: ModelShape, data_root) -> None:
        """Called once after the model is loaded and before any sample runs: offline calibration
        (KVQuant's per-channel key ranges and non-uniform datatypes, ...) goes here. Default: none."""

    def new_cache(self, shape: ModelShape, model_dtype: torch.dtype) -> KVBenchCache:
        return KVBenchCache(self.build_layers(shape, model_dtype))

    def build_layers(self, shape: ModelShape, model_dtype: torch.dtype) -> list[KVLayer]:
        """One storage per transformer layer. Layers with sliding-window attention hold their window
        in full precision (``fp_dtype``) in every method, as transformers' own cache holds it
        (:class:`~kvbench.cache.sliding.SlidingWindowLayer`); methods quantize / evict / prefetch
        the full-attention layers only, built by :meth:`make_layer` (behind a lossless sink with
        ``sink_tokens``). A method that builds its own cache class starts from these layers."""
        fp_dtype = self.config.torch_fp_dtype(model_dtype)
        layers: list[KVLayer] = []
        for i in range(shape.num_layers):
            if shape.is_sliding(i) and self.config.sliding_windows == "full_precision":
                layers.append(SlidingWindowLayer(i, shape.sliding_window, fp_dtype))
                continue
            layer = self.make_layer(i, shape, model_dtype)
            if self.config.sink_tokens:
                layer = SinkLayer(layer, self.config.sink_tokens, fp_dtype)
            layers.append(layer)
        for layer in layers:
            for part in (layer, getattr(layer, "inner", None)):
                if isinstance(part, KVLayer):
                    part.read_backend = self.config.backend
        return layers

    def label(self) -> str:
        return self.base_label() + (f"-sink{self.config.sink_tokens}" if self.config.sink_tokens else "")

    def base_label(self) -> str:
        bits = self.config.bits
        return self.registered_name if bits is None else f"{self.registered_name}-{bits:g}b"


def with_run_bits(node: dict[str, Any] | None, bits: float | None) -> dict[str, Any] | None:
    """``node`` with the run's top-level ``bits`` in the field its config names as ``bits_knob``,
    where the node leaves that field unset (absent or null); a value the node sets itself wins.

    The key is written even when ``bits`` is null, so the resolved node reads the same whether or
    not a bit width was given: it is what the run writes to config.json and hashes into its run id
    (:func:`kvbench.results.canonical_config` keeps the top-level ``bits`` exactly when the node has
    a ``bits`` key). ``None`` (no method: the FP16 baseline), a node of a method without a bits
    knob and a node naming no registered method (:func:`build_method` reports that) come back as
    they are."""
    if node is None:
        return None
    node = dict(node)
    name = node.get("name")
    knob = METHODS.get(name).Config.bits_knob if isinstance(name, str) and name in METHODS else None
    if knob is not None and node.get(knob) is None:
        node[knob] = bits
    return node


def build_method(node: dict[str, Any] | None, bits: float | None = None) -> Method:
    """Method object from a ``method`` config node (``None``: the FP16 baseline), with the run's
    top-level ``bits`` filled in by :func:`with_run_bits`."""
    node = dict(with_run_bits(node, bits) or {"name": "fp16"})
    name = node.get("name")
    if not name:
        raise ConfigError("method.name", name, f"registered methods are {', '.join(METHODS.names())}")
    cls = METHODS.get(name)
    return cls(build_config(cls.Config, node, "method"))
