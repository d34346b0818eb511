"""An lm-evaluation-harness model, registered with lm-eval as ``kvbench``, that runs every request
through a kvbench method's cache.

lm-eval hands a model three kinds of request; each one here gets a fresh cache of the runner's
method, so no request sees another's state and the KV method shapes every number lm-eval computes:

- ``generate_until`` (context, gen_kwargs): the context is prefilled into the cache and decoded
  greedily through it (:meth:`kvbench.generate.ModelRunner.generate`) until one of ``until`` or
  ``max_gen_toks`` new tokens. As in the papers, the first new token comes from the prefill
  forward; every later one reads the whole context back from the method's storage. With
  ``batch_size`` N, requests with the same ``until`` and ``max_gen_toks`` go N at a time through
  kvbench's batched decode (:meth:`~kvbench.generate.ModelRunner.generate_batch`: each prompt
  prefilled alone, the decode steps batched, each sequence in its own cache), whose tokens are
  each prompt's batch-1 tokens.
- ``loglikelihood`` (context, continuation): ``log P(continuation | context)`` and whether greedy
  decoding would produce the continuation, scored by one of two protocols (``chunk``, below).
- ``loglikelihood_rolling`` (text,): the text is cut into lm-eval's disjoint rolling windows of at
  most ``max_length`` tokens (``lm_eval.utils.get_rolling_token_windows``, context length 1) and each
  window is scored like a ``loglikelihood`` request with its own fresh cache; the sum is returned.

Scoring a log-likelihood (``chunk``)
------------------------------------
- **One forward per request** (``chunk=auto``, the default, for the method that stores every token
  in full precision, the FP16 baseline: :func:`one_forward_scores`): context and continuation go
  through the model in one forward, as lm-eval's ``--model hf`` scores them, each row into a fresh
  cache of the method; the logits of the continuation's positions score it. Such a cache changes
  nothing a forward reads (a forward attends its own tokens exactly, by the read rule of
  :mod:`kvbench.cache.layer`), so scoring token by token through it would only add the rounding of
  the stored keys and values to ``fp_dtype``: the FP16 baseline is the model's own number,
  ``--model hf``'s, at one forward's cost. With ``batch_size`` N, N requests share one left-padded
  forward (each row in its own cache; rows are cut so that the batch's float32 logits stay under
  :data:`LOGITS_BUDGET_BYTES`).
- **Through the cache** (``chunk=auto`` for every other method, ``chunk=N`` for any method): the
  protocol of kvbench's perplexity task (:mod:`kvbench.tasks.perplexity`), which must run where a
  method quantizes, evicts or otherwise changes what it stores: the context is prefilled into the
  cache first, so the method has stored (quantized) it before any continuation token is scored,
  and the continuation is then fed ``chunk`` tokens per forward, every forward reading all earlier
  tokens from storage (:meth:`kvbench.generate.ModelRunner.score`; one-token forwards go through
  the method's decode step, so a method with its own, SpeCache, is scored as it decodes).
  ``chunk=auto`` means 1 here, the decode-time access pattern, as the perplexity task's default;
  a larger ``chunk`` is faster, and the tokens inside one chunk then see each other exactly. It
  differs from the perplexity task in the first continuation token only: here it is predicted by a
  forward of the last context token that reads the rest of the context from storage
  (``first="cache"``: the context less its last token is prefilled), since the prefill's own
  logits, which the perplexity task uses for it, never read the cache, and a one-token
  continuation, the usual multiple-choice answer, would score the same under every method. A
  context of a single token (an empty context's prefix token; every rolling window) has nothing
  before it to store, and is prefilled as the perplexity task does (``first="prefill"``: under
  ``chunk=1`` the same forwards, that token's a prefill rather than a decode step, and the last
  continuation token stored as well); this lets such requests, whose contexts ``score_batch`` could
  not split, be batched too. With ``batch_size`` N,
  requests whose continuations have the same length are scored N at a time
  (:meth:`~kvbench.generate.ModelRunner.score_batch`: each context prefilled alone, the
  continuations fed as rows of one batch, each row through its own cache), equal to batch 1 up to
  the rounding of batched matrix products.

An explicit ``chunk=N`` scores every method through the cache, ``fp16`` included (``chunk=1``: its
stored FP16 rounding is read, as kvbench's own ``task=lmeval`` runs, whose ``task.chunk`` is 1).
Until ``chunk=auto`` every method, FP16 included, was scored through the cache at ``chunk=1``, one
token per forward: right for the methods that change what they store, a forward per token of
overhead and a storage rounding away from ``--model hf`` for the baseline.

``batch_size``: a positive int, or ``auto``/``auto:N`` (lm-eval's forms): lm-eval's
``--max_batch_size`` if given, else :data:`AUTO_BATCH_SIZE`, halved whenever a batch runs out of
device memory. Models with sliding-window layers run batch 1 (kvbench's batched path does not
replay their window masks). A batch's time is shared equally by its requests' records.

Tokenization follows lm-eval's ``TemplateLM``: no special tokens are added, trailing spaces of a
context move to the continuation, the pair is encoded jointly and split at the context's length,
and an empty context becomes the prefix token. Over-long inputs lose tokens on the left, as in
lm-eval's HF model. Decoding is greedy; a request that asks for sampling is refused.

The prefix token (an empty context's, and the first window's context in ``loglikelihood_rolling``)
is the tokenizer's BOS where it has one, else its end-of-text token, as lm-eval's ``--model hf``
chooses it (``prefix_token_id=`` overrides it, as there), so the same model scores the same
perplexity through either. For SmolLM2 the two differ (BOS ``<|im_start|>``, end-of-text
``<|im_end|>``), and so would the rolling log-likelihoods.

After each call, :attr:`KVBenchLM.records` holds one :class:`RequestRecord` per request (prompt
length, memory report of the cache at the end, timings), in request order, for per-sample rows.

From lm-eval's command line
---------------------------
``kvbench-lm-eval`` (:func:`main`) is lm-eval's own CLI with this model registered and the
default ``--model``, in both of lm-eval 0.4's forms: ``kvbench-lm-eval run --model kvbench
--model_args method=kivi,bits=2 --tasks ...`` (the documented subcommand) and the flag form
without ``run``; ``ls`` and ``validate`` are lm-eval's. The package also declares the model under
the ``lm_eval.models`` entry point group, the form lm-eval's plugin registry loads, so ``lm_eval
--model kvbench`` works with an lm-eval that discovers plugins (0.4.13 does not: use
``kvbench-lm-eval`` there).

``model_args`` are read strictly (:func:`parse_model_args`), the keys of a kvbench run's command
line: ``model`` (a ``conf/model`` node, default ``smollm2-135m``), ``model.<key>`` (any key of that
node: ``model.path``, ``model.dtype``, ``model.max_context``, ...), ``method`` (default ``fp16``),
``method.<key>`` (any knob of the method: ``method.residual``, ``method.group_size``, ...),
``bits``, ``device``, ``batch_size``/``max_batch_size``, and the adapter's ``chunk``,
``max_gen_toks`` and ``prefix_token_id``; and lm-eval's hf names for the model: ``pretrained``
(a local model folder, a ``.gguf`` file, or a Hugging Face Hub id: ``model.path``, ``model.gguf``
or ``model.hub_id``, a Hub id of a committed node taking that node), ``tokenizer`` (a folder or
Hub id whose tokenizer replaces the model's), ``dtype``, ``revision`` and ``max_length`` (the
node's ``dtype``, ``revision``, ``max_context``). lm-eval passes ``model_args`` on to the tasks as
metadata, so tasks that build their own data with the model's tokenizer (RULER) find it in
``pretrained=``/``tokenizer=``. Any other key is a :class:`~kvbench.errors.ConfigError` naming it
and the allowed ones; a key given in ``model_args`` wins over what lm-eval's evaluator adds
(``--device``, whose default ``cuda:0`` always comes, and ``--batch_size``).

The results JSON carries lm-eval's standard model fields in ``config`` (``model_num_parameters``,
``model_dtype``, ``model_revision``, ``model_sha``: the Hub commit where known, a Hub id's or Hub
snapshot folder's, else empty as lm-eval's hf model leaves it; ``model_name``) and, from
``kvbench-lm-eval``, the device the model ran on (lm-eval writes its ``--device`` as given, by
default ``cuda:0`` even on a CPU). Runs are named and filed ``kvbench/<model>/<label>``
(:meth:`KVBenchLM.display_name`), where the label is the method's plus its ``fp_dtype`` wherever that
is not the method's default, so ``method.fp_dtype=auto`` is filed apart from the default FP16 run.
Under ``config.kvbench`` (:meth:`KVBenchLM.get_model_info`) it holds the method's label and
resolved config, the model node, the bits, the id kvbench hashes for this model and method
(:func:`arm_id`), the scoring protocol and batch size, the mean over requests of each request's
cache accounting (``effective_bits``, ``code_bits``, ``compression``, ... as a kvbench run's
``memory`` has them) and the warnings: a method whose lossless window (KIVI's residual, a sink, an
eviction budget) holds every token of some requests ran those in full precision, and says on how
many (:meth:`kvbench.methods.base.MethodConfig.context_warnings` on each request's cache length;
also printed to stderr after each request type ran).

Bad input at this door ends as on kvbench's own command line, in one line naming the key, the value
and what is allowed, exit status 2, before the model loads: a ``model_args`` key or value, an
unknown ``--tasks`` name (with lm-eval's close matches), a ``--limit`` that is not a count >= 1
or a fraction in (0, 1), a ``--batch_size`` that is neither a positive int nor ``auto``; lm-eval's own
argument errors (``--log_samples`` without ``--output_path``, ...) become one line too.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models, registered before kvbench's: see below)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from kvbench.cache import MemoryReport, memory_report
from kvbench.errors import ConfigError
from kvbench.version import __version__

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until when a task sets none
DEFAULT_MODEL = "smollm2-135m"
# lm-eval's CLI passes --device (default cuda:0) to every model whether or not the user gave it
LM_EVAL_DEFAULT_DEVICE = "cuda:0"
# lm-eval's hf model's names for knobs that kvbench keeps on the model node
HF_ALIASES = {"dtype": "dtype", "revision": "revision", "max_length": "max_context"}
ADAPTER_KEYS = (
    "bits",
    "chunk",
    "device",
    "max_gen_toks",
    "method",
    "model",
    "prefix_token_id",
    "pretrained",
    "tokenizer",
)
LM_EVAL_KEYS = ("batch_size", "max_batch_size")  # passed by lm-eval's evaluator itself
# ``batch_size=auto`` without lm-eval's --max_batch_size: the first size tried (halved on running
# out of device memory). kvbench does not probe memory first as lm-eval's hf model does.
AUTO_BATCH_SIZE = 8
# The most float32 logits one batched forward of the one-forward protocol may hold: a batch of long
# requests is cut into smaller ones (a 4096-token row of a 128K vocabulary takes 2 GiB alone).
LOGITS_BUDGET_BYTES = 2 * 2**30
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# What a Hub id replaces on a node that describes other weights (see kvbench/config.py: the nodes'
# own name, context limit, notes and shape describe their own weights only).
HUB_REPLACES = {
    "path": None,
    "gguf": None,
    "gguf_package": None,
    "gguf_file": None,
    "gguf_parts": None,
    "max_context": None,
    "weights_note": "",
    "reference_hub_id": None,
    "shape": None,
}
WEIGHTS_WHAT = "a local model folder, a .gguf file, or a Hugging Face Hub id (owner/name)"


@dataclass
class ModelArgs:
    """lm-eval's ``model_args`` for ``--model kvbench``, parsed (:func:`parse_model_args`).

    ``model_overrides``/``method_overrides``: the ``model.<key>``/``method.<key>`` values (and the
    hf names ``dtype``, ``revision``, ``max_length``), set on the named nodes as ``model.<key>=``
    and ``method.<key>=`` on kvbench's command line are. ``model``: None is the default node, or
    the committed node whose Hub id ``pretrained`` names."""

    model: str | None = None
    model_overrides: dict[str, Any] = field(default_factory=dict)
    method: str = "fp16"
    method_overrides: dict[str, Any] = field(default_factory=dict)
    bits: float | None = None
    device: str = "auto"
    chunk: int | str = "auto"
    max_gen_toks: int = DEFAULT_MAX_GEN_TOKS
    prefix_token_id: int | None = None
    batch_size: int | str = 1
    max_batch_size: int | None = None
    pretrained: str | None = None
    tokenizer: str | None = None

    def __post_init__(self):
        from kvbench.config import is_int, is_number

        for key in ("model", "method"):
            value = getattr(self, key)
            if key == "model" and value is None:
                continue
            if not (isinstance(value, str) and value):
                raise ConfigError(key, value, f"a name (kvbench/conf/{key}/<name>.yaml)")
        if self.bits is not None:
            if not is_number(self.bits) or self.bits <= 0:
                raise ConfigError("bits", self.bits, "a positive number (log2 of a level count)")
            self.bits = float(self.bits)
        self.chunk = checked_chunk("chunk", self.chunk)
        if not (is_int(self.max_gen_toks) and self.max_gen_toks > 0):
            raise ConfigError("max_gen_toks", self.max_gen_toks, "a positive int")
        token = self.prefix_token_id
        if token is not None and not (is_int(token) and token >= 0):
            raise ConfigError("prefix_token_id", self.prefix_token_id, "a token id (int >= 0)")
        self.batch_size = checked_batch_size(self.batch_size)
        self.max_batch_size = checked_max_batch_size(self.max_batch_size)
        self.device = _device(self.device)
        if self.pretrained is not None:
            weights_source("pretrained", self.pretrained)
            given = [k for k in ("path", "gguf", "hub_id") if self.model_overrides.get(k) is not None]
            if given:
                raise ConfigError(
                    "pretrained",
                    self.pretrained,
                    f"give the weights once: pretrained= or model.{given[0]}=, not both",
                )
        if self.tokenizer is not None:
            kind, _ = weights_source("tokenizer", self.tokenizer)
            if kind == "gguf":
                raise ConfigError(
                    "tokenizer", self.tokenizer, "a model folder or a Hub id holding a tokenizer"
                )

    def model_node(self) -> dict[str, Any]:
        """The ``model`` node as a kvbench run resolves it, with the ``model.<key>`` values set;
        ``pretrained=`` sets ``model.path``, ``model.gguf`` or ``model.hub_id`` (a Hub id of a
        committed node, without ``model=``, takes that node)."""
        from kvbench.config import model_slug
        from kvbench.models import model_node

        name, overrides = self.model or DEFAULT_MODEL, dict(self.model_overrides)
        if self.pretrained is not None:
            kind, value = weights_source("pretrained", self.pretrained)
            if kind != "hub":
                overrides = {kind: value, **overrides}
            else:
                own = hub_node(value) if self.model is None else None
                if own is not None:
                    name = own
                elif model_node(name).get("hub_id") != value:
                    slug = model_slug(value.rsplit("/", 1)[-1])
                    overrides = {**HUB_REPLACES, "hub_id": value, "name": slug, **overrides}
        return model_node(name, overrides)

    def method_node(self) -> dict[str, Any]:
        """The ``method`` node as ``+method=<name>`` composes it (``kvbench/conf/method``), with the
        ``method.<key>`` values set and the run's ``bits`` in its bits knob."""
        from omegaconf import OmegaConf

        from kvbench.methods.base import with_run_bits
        from kvbench.paths import CONF_DIR

        path = CONF_DIR / "method" / f"{self.method}.yaml"
        node = OmegaConf.to_container(OmegaConf.load(path), resolve=True) if path.is_file() else {}
        node = {**node, "name": self.method, **self.method_overrides}
        return with_run_bits(node, self.bits)


def checked_chunk(key: str, chunk: Any) -> int | str:
    """``auto`` or a positive int (a string of digits, as a command line gives it, too)."""
    from kvbench.config import is_int

    if isinstance(chunk, str) and chunk.strip().isdigit():
        chunk = int(chunk)
    if chunk == "auto" or (is_int(chunk) and chunk > 0):
        return chunk
    raise ConfigError(
        key,
        chunk,
        "auto (one forward per request where the method stores every token in full precision, "
        "else 1) or a positive int (continuation tokens per forward through the cache)",
    )


def checked_batch_size(value: Any) -> int | str:
    """lm-eval's ``--batch_size``: a positive int (or its digits), ``auto`` or ``auto:N`` (N is how
    often lm-eval's hf model searches again; kvbench halves on running out of memory instead)."""
    from kvbench.config import is_int

    if value is None:
        return 1
    if isinstance(value, str):
        text = value.strip()
        if text.isdigit():
            value = int(text)
        elif text == "auto" or re.fullmatch(r"auto:\d+", text):
            return "auto"
    if is_int(value) and value > 0:
        return value
    raise ConfigError("batch_size", value, "a positive int, auto or auto:N (lm-eval's forms)")


def checked_max_batch_size(value: Any) -> int | None:
    from kvbench.config import is_int

    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value is None or (is_int(value) and value > 0):
        return value
    raise ConfigError("max_batch_size", value, "a positive int (the largest batch auto tries)")


def weights_source(key: str, value: Any) -> tuple[str, str]:
    """``pretrained=``/``tokenizer=`` as ``(kind, value)``: ``path`` (an existing folder), ``gguf``
    (an existing ``.gguf`` file) or ``hub`` (a Hugging Face Hub id, ``name`` or ``owner/name``);
    checked on the disk before anything loads."""
    if not (isinstance(value, str) and value.strip()):
        raise ConfigError(key, value, WEIGHTS_WHAT)
    path = Path(value).expanduser()
    if path.is_dir():
        return "path", value
    if path.is_file() and value.lower().endswith(".gguf"):
        return "gguf", value
    if HUB_ID.fullmatch(value) and not path.exists():
        return "hub", value
    found = "a file, not a model folder" if path.exists() else "no such folder"
    raise ConfigError(key, value, f"{WEIGHTS_WHAT}; {found}")


def hub_node(hub_id: str) -> str | None:
    """The committed ``conf/model`` node whose Hub id is ``hub_id`` (``pretrained=`` of a model
    kvbench ships a node for keeps its context limit and name), else None."""
    from kvbench.models import CONF_DIR, model_node

    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        if model_node(path.stem).get("hub_id") == hub_id:
            return path.stem
    return None


def _device(device: Any) -> str:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``. lm-eval's own default ``cuda:0`` on a machine
    without CUDA means "not given" (it is passed either way) and becomes ``auto``."""
    if device is None:
        return "auto"
    ok = isinstance(device, str) and (device in ("auto", "cpu", "cuda") or device.startswith("cuda:"))
    if not ok:
        raise ConfigError("device", device, "auto, cpu, cuda or cuda:N")
    if device.startswith("cuda") and not torch.cuda.is_available():
        if device == LM_EVAL_DEFAULT_DEVICE:
            return "auto"
        raise ConfigError("device", device, "auto or cpu here: no CUDA device is visible")
    return device


def allowed_keys(method: str | None = None) -> list[str]:
    """Every key ``--model kvbench`` reads: the adapter's, lm-eval's, the hf names, each
    ``model.<key>``, and each ``method.<key>`` of ``method`` (of every registered method when it
    is unknown)."""
    from kvbench.methods.base import METHODS
    from kvbench.models import ModelConfig

    model_keys = [f"model.{f.name}" for f in dataclasses.fields(ModelConfig) if f.init]
    classes = [METHODS.get(method)] if method in METHODS else [METHODS.get(n) for n in METHODS.names()]
    knobs = {f.name for cls in classes for f in dataclasses.fields(cls.Config) if f.init} - {"name"}
    method_keys = sorted(f"method.{k}" for k in knobs)
    return [*ADAPTER_KEYS, *LM_EVAL_KEYS, *HF_ALIASES, *model_keys, *method_keys]


def parse_model_args(args: Mapping[str, Any]) -> ModelArgs:
    """``args`` (lm-eval's parsed ``model_args`` plus what its evaluator adds) as :class:`ModelArgs`;
    one ConfigError line, naming the key and the allowed ones, for a key that is not kvbench's.

    Only the keys (and the adapter's own values) are checked here; each node's values are checked
    by its own config when the model and method are built (:meth:`KVBenchLM._build_runner`)."""
    from kvbench.config import unknown_key
    from kvbench.models import ModelConfig

    args = dict(args)
    method = args.get("method", "fp16")
    model_fields = {f.name for f in dataclasses.fields(ModelConfig) if f.init}
    kwargs: dict[str, Any] = {"model_overrides": {}, "method_overrides": {}}
    for key, value in args.items():
        head, dot, leaf = key.partition(".")
        if dot and head == "model" and leaf in model_fields:
            kwargs["model_overrides"][leaf] = value
        elif dot and head == "method" and leaf and leaf != "name":
            kwargs["method_overrides"][leaf] = value  # the method's config names unknown knobs
        elif key in HF_ALIASES:
            if f"model.{HF_ALIASES[key]}" in args:
                raise ConfigError(key, value, f"give it once: {key}= or model.{HF_ALIASES[key]}=, not both")
            kwargs["model_overrides"][HF_ALIASES[key]] = value
        elif key in ADAPTER_KEYS or key in LM_EVAL_KEYS:
            kwargs[key] = value
        else:
            allowed = allowed_keys(method if isinstance(method, str) else None)
            if key == "method.name":
                raise ConfigError(key, value, "give the method as method=NAME")
            raise ConfigError(key, value, unknown_key(key, allowed))
    return ModelArgs(**kwargs)


def arm_id(model_node: dict[str, Any], method_node: dict[str, Any], bits: float | None) -> str:
    """The id kvbench hashes for a model and method (:func:`kvbench.results.run_id` of the run
    config without its task and seed): the same ``model_args`` give the same id on any task, and a
    different model node, method knob or bit width gives another."""
    from kvbench.results import run_id

    return run_id({"model": model_node, "method": method_node, "bits": bits})


def load_tokenizer(source: str):
    """The tokenizer of ``tokenizer=`` (a folder or Hub id), loaded before the model's weights; one
    ConfigError line where none loads. Without a pad token it pads with end-of-text, as kvbench's
    loader does."""
    from transformers import AutoTokenizer

    from kvbench.models.hub import hub_offline, hub_reachable

    kind, _ = weights_source("tokenizer", source)
    local_only = kind == "path" or hub_offline() or not hub_reachable()
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
    except Exception as err:  # transformers raises OSError, ValueError, EnvironmentError, ...
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        offline = local_only and kind == "hub"
        where = " (offline: only the local Hugging Face cache was read)" if offline else ""
        raise ConfigError("tokenizer", source, f"no tokenizer loads from it{where}: {first}") from err
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def model_sha(model, node: Mapping[str, Any] | None) -> str:
    """The Hub commit of the loaded weights where it is known without asking the Hub: the folder
    they came from is a Hub snapshot (``.../snapshots/<commit>``), or the node's Hub id has a
    snapshot in the local Hugging Face cache; else ``""``, as lm-eval's hf model says when it
    cannot ask."""
    commit = re.compile(r"[0-9a-f]{40}")
    source = Path(str(getattr(model.config, "_name_or_path", "") or ""))
    if len(source.parts) >= 2 and source.parts[-2] == "snapshots" and commit.fullmatch(source.name):
        return source.name
    hub = (node or {}).get("hub_id")
    if hub and not (node or {}).get("path"):
        from huggingface_hub import try_to_load_from_cache

        try:
            found = try_to_load_from_cache(hub, "config.json", revision=(node or {}).get("revision"))
        except Exception:  # a malformed id or cache: the commit is simply not known
            found = None
        if isinstance(found, str):
            folder = Path(found).parent
            if folder.parent.name == "snapshots" and commit.fullmatch(folder.name):
                return folder.name
    return ""


@dataclass
class RequestRecord:
    """What one request did: tokens prefilled/fed, the cache's accounting at its end, timings."""

    request_type: str
    prompt_tokens: int
    memory: MemoryReport
    seconds: float
    new_tokens: int = 0
    stopped: bool | None = None
    nll: list[float] = field(default_factory=list)


@dataclass
class Scored:
    logprob: float
    is_greedy: bool
    token_logprobs: list[float]
    context_tokens: int  # tokens before the continuation, after left truncation
    memory: MemoryReport
    seconds: float


class MemoryTally:
    """Means over requests of each request's cache accounting, kept as sums (a long lm-eval run
    makes millions of requests), and the cache length of each request (tokens held at its end)."""

    KEYS = ("effective_bits", "code_bits", "nominal_code_bits", "compression", "total_bytes", "fp16_bytes")

    def __init__(self):
        self.sums = dict.fromkeys(self.KEYS, 0.0)
        self.counts = dict.fromkeys(self.KEYS, 0)
        self.lengths: Counter[int] = Counter()
        self.requests: Counter[str] = Counter()

    def add(self, record: RequestRecord) -> None:
        self.requests[record.request_type] += 1
        self.lengths[record.memory.tokens] += 1
        values = record.memory.to_dict()
        for key in self.KEYS:
            value = values.get(key)
            if value is not None and math.isfinite(value):
                self.sums[key] += value
                self.counts[key] += 1

    def summary(self) -> dict[str, Any]:
        """The keys of a kvbench run's ``memory`` summary (:func:`kvbench.run.memory_summary`)."""
        mean = {k: self.sums[k] / self.counts[k] if self.counts[k] else None for k in self.KEYS}
        return {
            "effective_bits": mean["effective_bits"],
            "code_bits": mean["code_bits"],
            "nominal_code_bits": mean["nominal_code_bits"],
            "compression": mean["compression"],
            "kv_bytes_mean": mean["total_bytes"],
            "fp16_bytes_mean": mean["fp16_bytes"],
            "requests": dict(self.requests),
        }


def covered_requests(method_config, lengths: Mapping[int, int]) -> dict[str, str]:
    """The method's context warnings (:meth:`MethodConfig.context_warnings`) over requests whose
    caches held ``lengths`` tokens ({length: request count}), each saying on how many requests."""
    total = sum(lengths.values())
    by_code: dict[str, list[int]] = {}
    for length in sorted(lengths):
        for code in method_config.context_warnings([length]):
            by_code.setdefault(code, []).append(length)
    out = {}
    for code, covered in by_code.items():
        n = sum(lengths[x] for x in covered)
        span = f"{covered[0]}" if len(covered) == 1 else f"{covered[0]}-{covered[-1]}"
        message = method_config.context_warnings(covered)[code]
        out[code] = f"{n} of {total} lm-eval requests ({span} tokens): {message}"
    return out


def one_forward_scores(method) -> bool:
    """Whether ``chunk=auto`` scores ``method``'s log-likelihoods in one forward per request: the FP16
    baseline (:class:`kvbench.methods.fp16.FP16`), whose cache stores every token in full precision,
    so that scoring through the stored cache would give the one forward's numbers plus the rounding
    of the stored keys and values to ``fp_dtype``. Every other method is scored through its cache."""
    from kvbench.methods.fp16 import FP16

    return isinstance(method, FP16)


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes")


# one request to score: (its index, context ids, continuation ids), after left truncation
Pending = tuple[int, list[int], list[int]]


# lm-eval registers its own models (hf, vllm, ...) only when its registry is empty, and registering
# kvbench's first would leave `--model hf` unknown next to it: lm_eval.models is imported above.
@register_model("kvbench")
class KVBenchLM(TemplateLM):
    """An lm-eval ``LM`` over a :class:`kvbench.generate.ModelRunner` (model, tokenizer, method).

    From Python, pass ``runner``. From lm-eval (``--model kvbench``), the ``model_args`` build one
    through the run builder (:func:`kvbench.builder.build_runner`'s steps), as kvbench's CLI builds
    its runs: see the module docstring for the keys. ``chunk``: the log-likelihood protocol (module
    docstring); ``batch_size``: requests per batch (a positive int or ``auto``). ``announce``: print
    the context warnings of each request call to stderr (kvbench's own ``task=lmeval`` runs call
    once per document and report through the run instead).
    """

    # the last one lm-eval built from model_args: kvbench-lm-eval names the results after it
    latest: KVBenchLM | None = None

    def __init__(
        self,
        runner=None,
        chunk: int | str = "auto",
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        prefix_token_id: int | None = None,
        announce: bool = True,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        **model_args: Any,
    ):
        super().__init__()
        self.args: ModelArgs | None = None
        self.model_node: dict[str, Any] | None = None
        self.method_node: dict[str, Any] | None = None
        if runner is None:
            given = {
                "chunk": chunk,
                "max_gen_toks": max_gen_toks,
                "prefix_token_id": prefix_token_id,
                "batch_size": batch_size,
                "max_batch_size": max_batch_size,
            }
            args = self.args = parse_model_args({**given, **model_args})
            runner = self._build_runner(args)
            chunk, max_gen_toks, prefix_token_id = args.chunk, args.max_gen_toks, args.prefix_token_id
            batch_size, max_batch_size = args.batch_size, args.max_batch_size
        elif model_args:
            key = sorted(model_args)[0]
            raise ConfigError(key, model_args[key], "not with runner=, which holds the model and method")
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.chunk = checked_chunk("task.chunk", chunk)
        self.max_gen_toks = int(max_gen_toks)
        self.custom_prefix_token_id = prefix_token_id
        self.announce = announce
        self.batch_size = checked_batch_size(batch_size)
        self.max_batch_size = checked_max_batch_size(max_batch_size)
        # the batch size in use: auto starts at the largest and halves on running out of memory
        self._batch = self.batch_size if self.batch_size != "auto" else self.max_batch_size or AUTO_BATCH_SIZE
        self.batch_sizes: dict[str, int] = {"auto": self._batch} if self.batch_size == "auto" else {}
        self.records: list[RequestRecord] = []
        self.tally = MemoryTally()
        self.warnings: dict[str, str] = {}

    def _build_runner(self, args: ModelArgs):
        """Each node checked before the model loads (cheapest first), then built as a run builds."""
        from kvbench.builder import load_for_methods, model_config
        from kvbench.methods import build_method
        from kvbench.spec import bits_ignored

        self.method_node = args.method_node()
        method = build_method(self.method_node)
        self.model_node = args.model_node()
        config = model_config(self.model_node)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer is not None else None
        for message in bits_ignored(
            {"bits": args.bits, "method": {"name": args.method, **args.method_overrides}}, method
        ).values():
            self._warn(message)
        loaded = load_for_methods(config, args.device)
        if tokenizer is not None:
            loaded = dataclasses.replace(loaded, tokenizer=tokenizer)
        runner = loaded.runner(method)
        KVBenchLM.latest = self
        return runner

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> KVBenchLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict | None = None
    ) -> KVBenchLM:
        """lm-eval's constructor from ``model_args`` plus what its evaluator adds (``batch_size``,
        ``max_batch_size``, ``device``); a key given in ``model_args`` wins (lm-eval's own passes
        both, and two values of one keyword would be a TypeError)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @staticmethod
    def _warn(message: str) -> None:
        print(f"kvbench: warning: {message}", file=sys.stderr)

    @property
    def method(self):
        return self.runner.method

    def label(self) -> str:
        """The method's label, plus ``-fp_<fp_dtype>`` where its ``fp_dtype`` is not the method's
        default (``fp16`` with ``method.fp_dtype=auto``: ``fp16-fp_auto``)."""
        config = self.method.config
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        fp = getattr(config, "fp_dtype", None)
        return self.method.label() + ("" if fp == defaults.get("fp_dtype") else f"-fp_{fp}")

    def display_name(self) -> str:
        """``kvbench/<model>/<label>``: what kvbench-lm-eval files the results under."""
        model = (self.model_node or {}).get("name") or getattr(self.tokenizer, "name_or_path", "model")
        return f"kvbench/{model}/{self.label()}"

    def scoring(self) -> str:
        """The log-likelihood protocol: ``one_forward`` or ``cache`` (module docstring)."""
        return "one_forward" if self.chunk == "auto" and one_forward_scores(self.method) else "cache"

    @property
    def cache_chunk(self) -> int:
        """Continuation tokens per forward under the ``cache`` protocol."""
        return 1 if self.chunk == "auto" else int(self.chunk)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval adds to its results' ``config`` (called after the requests ran): lm-eval's
        standard ``model_*`` fields and kvbench's own under ``kvbench``."""
        method, model = self.method, self.runner.model
        scoring = self.scoring()
        info = {
            "version": __version__,
            "name": self.display_name(),
            "method": method.label(),
            "label": self.label(),
            "method_config": dataclasses.asdict(method.config),
            "bits": method.config.bits,
            "model": self.model_node,
            "run_id": None,
            "device": str(self.runner.device),  # lm-eval's own config.device is its --device as given
            "chunk": self.chunk,
            "loglikelihood_scoring": scoring,
            "cache_chunk": None if scoring == "one_forward" else self.cache_chunk,
            "batch_size": self._batch,
            "prefix_token_id": self.prefix_token_id,
            **self.tally.summary(),
            "warnings": dict(self.warnings),
        }
        if self.model_node is not None and self.method_node is not None:
            info["run_id"] = arm_id(self.model_node, self.method_node, self.args.bits)
        if hasattr(model, "num_parameters"):
            parameters = model.num_parameters()
        else:
            parameters = sum(p.numel() for p in model.parameters())
        return {
            "model_name": self.display_name(),
            "model_num_parameters": parameters,
            "model_dtype": str(getattr(model, "dtype", "")),
            "model_revision": (self.model_node or {}).get("revision"),
            "model_sha": model_sha(model, self.model_node),
            "kvbench": info,
        }

    def _finish_call(self, records: list[RequestRecord]) -> None:
        """Account a call's requests and warn where the method's lossless window held all of one."""
        for record in records:
            self.tally.add(record)
        method = getattr(self.runner, "method", None)  # a stand-in runner of a test may have none
        if method is None or not records:
            return
        found = covered_requests(method.config, Counter(r.memory.tokens for r in records))
        if found:
            kind = records[0].request_type
            found = {f"{kind}/{code}": f"{kind}: {message}" for code, message in found.items()}
            self.warnings.update(found)
            if self.announce:
                for message in found.values():
                    self._warn(message)

    def _bar(self, total: int, what: str, disable: bool):
        method = getattr(self.runner, "method", None)
        desc = f"kvbench {what}" + (f" ({method.label()})" if method is not None else "")
        return tqdm(total=total, desc=desc, disable=disable, file=sys.stderr)

    # -- what TemplateLM needs -----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        """``prefix_token_id=`` if given, else BOS where the tokenizer has one, else end-of-text:
        lm-eval's ``--model hf`` rule (TemplateLM's own default is end-of-text)."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return int(self.runner.shape.max_context or self.runner.model.config.max_position_embeddings)

    @property
    def device(self):
        return self.runner.device

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "kvbench").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    # -- batches ---------------------------------------------------------------------------------
    def _can_batch(self) -> bool:
        shape = getattr(self.runner, "shape", None)
        sliding = shape.sliding_layers() if shape is not None else []
        if sliding and self._batch > 1 and "batch/sliding" not in self.warnings:
            self.warnings["batch/sliding"] = (
                f"batch_size {self._batch} ran as 1: the model has sliding-window layers {sliding}, "
                "whose window masks kvbench's batched path does not replay"
            )
            if self.announce:
                self._warn(self.warnings["batch/sliding"])
        return self._batch > 1 and not sliding

    def _in_batches(
        self,
        items: Sequence[Any],
        run: Callable[[list[Any]], None],
        rows: Callable[[list[Any]], int] | None = None,
    ) -> None:
        """``run`` on consecutive slices of ``items`` of the batch size (fewer where ``rows`` says
        a slice must be cut); with ``batch_size=auto`` a slice that runs out of device memory is
        halved and run again (each request has fresh caches, so nothing of the failed try stays)."""
        start, batched = 0, self._can_batch()
        while start < len(items):
            size = min(self._batch if batched else 1, len(items) - start)
            if rows is not None and size > 1:
                size = max(1, min(size, rows(list(items[start : start + size]))))
            try:
                run(list(items[start : start + size]))
            except torch.OutOfMemoryError:
                if self.batch_size != "auto" or size == 1:
                    raise
                self._batch = self.batch_sizes["auto"] = max(1, size // 2)
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                continue
            start += size

    # -- scoring ---------------------------------------------------------------------------------
    def score_pairs(self, pairs: Sequence[tuple[list[int], list[int]]], bar=None) -> list[Scored]:
        """``log P(continuation | context)`` of each ``(context ids, continuation ids)`` pair, each
        with a fresh cache, by the protocol of :meth:`scoring` (module docstring), in batches of the
        batch size; in the pairs' order. A context must hold at least one token (lm-eval passes the
        prefix token for an empty one); inputs longer than ``max_length + 1`` lose tokens on the
        left."""
        out: list[Scored | None] = [None] * len(pairs)
        pending: list[Pending] = []
        for i, (context, continuation) in enumerate(pairs):
            n = len(continuation)
            if n == 0:
                memory = memory_report(self.runner.new_cache().layers)
                out[i] = Scored(0.0, True, [], len(context), memory, 0.0)
                continue
            if not context:
                raise ValueError("scoring needs at least one context token")
            if n > self.max_length:
                raise ValueError(
                    f"a {n}-token continuation exceeds the model's {self.max_length}-token context"
                )
            total = (list(context) + list(continuation))[-(self.max_length + 1) :]
            pending.append((i, total[:-n], total[-n:]))
        if bar is not None:
            bar.update(len(pairs) - len(pending))
        if self.scoring() == "one_forward":
            self._score_one_forward(pending, out, bar)
        else:
            self._score_through_cache(pending, out, bar)
        return out  # type: ignore[return-value]

    def score_tokens(self, context: list[int], continuation: list[int]) -> Scored:
        """:meth:`score_pairs` of one pair."""
        return self.score_pairs([(context, continuation)])[0]

    def _score_one_forward(self, pending: list[Pending], out: list, bar) -> None:
        """Context and continuation in one forward per request (rows of one left-padded forward in a
        batch), each row into a fresh cache of the method; longest requests first, as lm-eval's hf
        model batches them."""
        runner = self.runner
        vocab = int(getattr(runner.model.config, "vocab_size", 0) or 1)

        def rows(batch: list[Pending]) -> int:
            longest = max(len(ctx) + len(cont) - 1 for _, ctx, cont in batch)
            return LOGITS_BUDGET_BYTES // (4 * vocab * longest)

        def run(batch: list[Pending]) -> None:
            t0 = time.perf_counter()
            inputs = [torch.tensor(ctx + cont[:-1]) for _, ctx, cont in batch]
            runner.method.new_request(0)  # every token is the prompt's: nothing is stored after it
            if len(batch) == 1:
                cache = runner.new_cache()
                n = len(batch[0][2])
                logits = [runner.forward(inputs[0][None], cache, logits_to_keep=n)[0]]
                caches = [cache]
            else:
                ids, mask = runner.pad_batch(inputs)
                cache = runner.new_batch_cache(len(batch))
                cache.set_padding(mask)
                full = runner.forward(ids, cache)
                logits = [full[r, -len(cont) :] for r, (_, _, cont) in enumerate(batch)]
                caches = cache.sequences
            seconds = (time.perf_counter() - t0) / len(batch)
            for (i, ctx, cont), row, sub in zip(batch, logits, caches, strict=True):
                logp = torch.log_softmax(row[-len(cont) :].float(), dim=-1)
                target = torch.tensor(cont, device=logp.device)
                token_logprobs = logp.gather(-1, target[:, None])[:, 0].tolist()
                greedy = bool((logp.argmax(-1) == target).all())
                memory = memory_report(sub.layers)
                runner.method.end_request(sub)
                out[i] = Scored(sum(token_logprobs), greedy, token_logprobs, len(ctx), memory, seconds)
            if bar is not None:
                bar.update(len(batch))

        ordered = sorted(pending, key=lambda p: -(len(p[1]) + len(p[2])))
        self._in_batches(ordered, run, rows)

    def _score_through_cache(self, pending: list[Pending], out: list, bar) -> None:
        """The perplexity task's protocol (module docstring): a batch holds requests of one
        continuation length and one ``first`` rule, in request order."""
        runner, chunk = self.runner, self.cache_chunk
        groups: dict[tuple[str, int], list[Pending]] = {}
        for item in pending:
            first = "prefill" if len(item[1]) == 1 else "cache"
            groups.setdefault((first, len(item[2])), []).append(item)

        for (first, _), items in groups.items():

            def run(batch: list[Pending], first: str = first) -> None:
                if len(batch) == 1:
                    _, ctx, cont = batch[0]
                    scored = [runner.score(torch.tensor([ctx]), torch.tensor([cont]), chunk, first=first)]
                else:
                    pairs = [(torch.tensor([ctx]), torch.tensor([cont])) for _, ctx, cont in batch]
                    scored = runner.score_batch(pairs, chunk, first=first)
                for (i, ctx, _), s in zip(batch, scored, strict=True):
                    logprobs = [-x for x in s.nll]
                    out[i] = Scored(sum(logprobs), s.greedy, logprobs, len(ctx), s.memory, s.seconds)
                if bar is not None:
                    bar.update(len(batch))

            self._in_batches(items, run)

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs) -> list[tuple[float, bool]]:
        """``requests``: ((context, continuation), context ids, continuation ids), from TemplateLM."""
        requests = list(requests)
        with self._bar(len(requests), "loglikelihood", disable_tqdm) as bar:
            scored = self.score_pairs([(ctx, cont) for _, ctx, cont in requests], bar)
        out, records = [], []
        for (key, _, _), s in zip(requests, scored, strict=True):
            result = (s.logprob, s.is_greedy)
            out.append(result)
            nll = [-x for x in s.token_logprobs]
            records.append(RequestRecord("loglikelihood", s.context_tokens, s.memory, s.seconds, nll=nll))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        self.records = records
        self._finish_call(records)
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        texts = [req.args[0] for req in requests]
        windows: list[tuple[int, tuple[list[int], list[int]]]] = []
        for r, text in enumerate(texts):
            for w in get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            ):
                windows.append((r, make_disjoint_window(w)))
        with self._bar(len(windows), "loglikelihood_rolling", disable_tqdm) as bar:
            scored = self.score_pairs([pair for _, pair in windows], bar)
        per_request: list[list[Scored]] = [[] for _ in texts]
        for (r, _), s in zip(windows, scored, strict=True):
            per_request[r].append(s)
        out, records = [], []
        for text, parts in zip(texts, per_request, strict=True):
            total = sum(s.logprob for s in parts)
            out.append(total)
            records.append(
                RequestRecord(
                    "loglikelihood_rolling",
                    max(s.context_tokens for s in parts),
                    max((s.memory for s in parts), key=lambda m: m.tokens),
                    sum(s.seconds for s in parts),
                    nll=[-x for s in parts for x in s.token_logprobs],
                )
            )
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        self.records = records
        self._finish_call(records)
        return out

    # -- generation through the cache ----------------------------------------------------------
    def _generation_request(self, context: str, gen_kwargs: Any) -> tuple[list[int], tuple[str, ...], int]:
        """``(prompt ids, stop strings, max new tokens)`` of one request, checked."""
        kwargs = dict(gen_kwargs or {})
        if _truthy(kwargs.get("do_sample", False)):
            raise ConfigError(
                "task.generation_kwargs", "do_sample=True", "kvbench decodes greedily: do_sample: false"
            )
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        eot = self.tok_decode([self.eot_token_id])
        if eot and eot not in until:
            until.append(eot)
        max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
        keep = self.max_length - max_new
        if keep <= 0:
            raise ConfigError(
                "task.max_gen_toks", max_new, f"fewer than the model's {self.max_length}-token context"
            )
        return self.tok_encode(context)[-keep:], tuple(until), max_new

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy generations; with a batch size, requests of the same stop strings and token limit
        go through the batched decode, longest prompts first (module docstring)."""
        args = [req.args for req in requests]
        # every request checked before any runs
        prepared = [self._generation_request(context, kwargs) for context, kwargs in args]
        texts: list[str | None] = [None] * len(args)
        records: list[RequestRecord | None] = [None] * len(args)
        groups: dict[tuple[tuple[str, ...], int], list[int]] = {}
        for i, (_, until, max_new) in enumerate(prepared):
            groups.setdefault((until, max_new), []).append(i)
        runner = self.runner
        with self._bar(len(args), "generate_until", disable_tqdm) as bar:
            for (until, max_new), indices in groups.items():

                def run(batch: list[int], until: tuple[str, ...] = until, max_new: int = max_new) -> None:
                    t0 = time.perf_counter()
                    prompts = [torch.tensor([prepared[i][0]]) for i in batch]
                    if len(batch) == 1:
                        gens = [runner.generate(prompts[0], max_new, stop_strings=until)]
                    else:
                        gens = runner.generate_batch(prompts, max_new, stop_strings=until)
                    seconds = (time.perf_counter() - t0) / len(batch)
                    for i, gen in zip(batch, gens, strict=True):
                        texts[i] = gen.text
                        records[i] = RequestRecord(
                            "generate_until",
                            gen.prompt_tokens,
                            gen.memory,
                            seconds,
                            new_tokens=gen.new_tokens,
                            stopped=gen.stopped,
                        )
                    bar.update(len(batch))

                self._in_batches(sorted(indices, key=lambda i: -len(prepared[i][0])), run)
        for (context, gen_kwargs), text in zip(args, texts, strict=True):
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        self.records = records  # type: ignore[assignment]
        self._finish_call(self.records)
        return texts  # type: ignore[return-value]


# -- the kvbench-lm-eval command ----------------------------------------------------------------

# lm-eval's subcommands (lm-eval 0.4.10+): `run` is the evaluation; `ls` and `validate` take no model
SUBCOMMANDS = ("run", "ls", "validate")
NO_MODEL = ("ls", "validate", "-h", "--help")


def with_default_model(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--model kvbench`` added where no ``--model``/``-M`` is given: after ``run``
    in the subcommand form, in front in the flag form (lm-eval then inserts ``run`` itself)."""
    argv = list(argv)
    given = any(a in ("--model", "-M") or a.startswith(("--model=", "-M=")) for a in argv)
    if not argv or given or argv[0] in NO_MODEL:
        return argv
    if argv[0] == "run":
        return argv if len(argv) == 1 else ["run", "--model", "kvbench", *argv[1:]]
    return ["--model", "kvbench", *argv]


def check_limit(limit: Any) -> None:
    """lm-eval's ``--limit``: a count of documents per task (an integer >= 1) or a fraction of them
    in (0, 1); lm-eval itself would take -1 or 0 as a count of nothing and fail after the model
    loaded."""
    if limit is None:
        return
    number = isinstance(limit, (int, float)) and not isinstance(limit, bool) and math.isfinite(limit)
    if number and (0 < limit < 1 or (limit >= 1 and float(limit).is_integer())):
        return
    shown = int(limit) if number and float(limit).is_integer() else limit
    raise ConfigError(
        "--limit", shown, "a number of documents per task (an integer >= 1) or a fraction of them in (0, 1)"
    )


class UsageError(Exception):
    """One of lm-eval's own argument errors, said in one line by :func:`main`."""


@contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    had = name in vars(owner)
    old = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


@contextmanager
def _cli_checks() -> Iterator[None]:
    """For one :func:`main` call, around lm-eval's CLI: ``--limit`` and ``--tasks`` checked as
    ConfigErrors (both run before lm-eval loads the model), lm-eval's own argument errors as
    :class:`UsageError`, and the results' ``config.device`` set to the device the model ran on."""
    import lm_eval
    from lm_eval.config.evaluate_config import EvaluatorConfig
    from lm_eval.tasks.manager import TaskManager

    managers: list[Any] = []
    match_tasks = TaskManager.match_tasks
    from_cli = EvaluatorConfig.from_cli.__func__
    process_tasks = EvaluatorConfig.process_tasks
    simple_evaluate = lm_eval.simple_evaluate

    def recording_match(self, task_list):
        managers.append(self)
        return match_tasks(self, task_list)

    def checked_from_cli(cls, namespace):
        check_limit(getattr(namespace, "limit", None))
        try:
            config = from_cli(cls, namespace)
        except ConfigError:
            raise
        except (ValueError, TypeError, FileNotFoundError) as err:
            raise UsageError((str(err).strip().splitlines() or [type(err).__name__])[0]) from err
        check_limit(config.limit)  # a --config YAML's
        return config

    def checked_process_tasks(self, metadata=None):
        try:
            return process_tasks(self, metadata)
        except ValueError as err:
            text = str(err)
            if not text.startswith("Tasks not found:"):
                raise
            missing = [t.strip() for t in text.partition(":")[2].split(",") if t.strip()]
            known = managers[-1].all_tasks if managers else []
            close = sorted({m for t in missing for m in difflib.get_close_matches(t, known, n=4)})
            hint = f"; close matches: {', '.join(close)}" if close else ""
            where = f" (nor under --include_path {self.include_path})" if self.include_path else ""
            raise ConfigError(
                "--tasks",
                missing[0] if len(missing) == 1 else ",".join(missing),
                f"not an lm-eval task, group or tag, nor a task YAML{where}{hint}; "
                "`kvbench-lm-eval ls tasks` lists them, --include_path adds a folder of task YAMLs",
            ) from None

    def evaluate_on_the_device(*args, **kwargs):
        results = simple_evaluate(*args, **kwargs)
        lm = KVBenchLM.latest
        if results is not None and lm is not None and kwargs.get("model") == "kvbench":
            results["config"]["device"] = str(lm.runner.device)
        return results

    with (
        _patched(TaskManager, "match_tasks", recording_match),
        _patched(EvaluatorConfig, "from_cli", classmethod(checked_from_cli)),
        _patched(EvaluatorConfig, "process_tasks", checked_process_tasks),
        _patched(lm_eval, "simple_evaluate", evaluate_on_the_device),
    ):
        yield


def _name_results_after_the_method() -> None:
    """lm-eval names a run (its results folder, ``model_name``) after ``pretrained=``/``model=``,
    else a random id; under ``--model kvbench`` it becomes ``kvbench/<model>/<label>``, so each
    arm's results land in their own folder under ``--output_path``."""
    from lm_eval.loggers.evaluation_tracker import GeneralConfigTracker
    from lm_eval.utils import sanitize_model_name

    original = GeneralConfigTracker.log_experiment_args
    if getattr(original, "_kvbench", False):
        return

    def log_experiment_args(self, model_source, model_args, *args, **kwargs):
        original(self, model_source, model_args, *args, **kwargs)
        lm = KVBenchLM.latest
        if model_source == "kvbench" and lm is not None:
            self.model_name = lm.display_name()
            self.model_name_sanitized = sanitize_model_name(self.model_name)

    log_experiment_args._kvbench = True
    GeneralConfigTracker.log_experiment_args = log_experiment_args


# keys a user gives as lm-eval flags rather than in --model_args
FLAG_KEYS = ("batch_size", "max_batch_size", "device")


def main(argv: list[str] | None = None) -> None:
    """``kvbench-lm-eval``: lm-eval's command line with ``--model kvbench`` registered (and the
    default ``--model``), in the ``run`` subcommand form and the flag form. Bad input (a
    ``model_args`` key or value, ``--tasks``, ``--limit``, ``--batch_size``) is one line on stderr
    and exit status 2, as on kvbench's own command line, before the model loads."""
    from lm_eval.__main__ import cli_evaluate

    argv = with_default_model(sys.argv[1:] if argv is None else argv)
    _name_results_after_the_method()
    saved = sys.argv
    sys.argv = ["kvbench-lm-eval", *argv]
    KVBenchLM.latest = None
    try:
        with _cli_checks():
            cli_evaluate()
    except ConfigError as err:
        where = "" if err.key.startswith("--") or err.key in FLAG_KEYS else "model_args: "
        print(f"kvbench-lm-eval: error: {where}{err}", file=sys.stderr)
        sys.exit(2)
    except UsageError as err:
        print(f"kvbench-lm-eval: error: {err}", file=sys.stderr)
        sys.exit(2)
    finally:
        sys.argv = saved
