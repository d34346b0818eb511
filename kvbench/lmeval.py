"""An lm-evaluation-harness model, registered with lm-eval as ``kvbench``, that runs every request
through a kvbench method's cache.

lm-eval hands a model three kinds of request; each one here gets a fresh cache of the runner's
method, so no request sees another's state and the KV method shapes every number lm-eval computes:

- ``generate_until`` (context, gen_kwargs): the context is prefilled into the cache and decoded
  greedily through it (:meth:`kvbench.generate.ModelRunner.generate`) until one of ``until`` or
  ``max_gen_toks`` new tokens. As in the papers, the first new token comes from the prefill
  forward; every later one reads the whole context back from the method's storage.
- ``loglikelihood`` (context, continuation): ``log P(continuation | context)`` and whether greedy
  decoding would produce the continuation, from the scoring loop shared with the perplexity task
  (:meth:`kvbench.generate.ModelRunner.score` with ``first="cache"``): the context minus its last
  token is prefilled into the cache; then the last context token and the continuation (less its
  final token) are fed ``chunk`` tokens per forward, so that the logits predicting *every*
  continuation token, the first included, come from a forward that reads the context from storage
  (one-token forwards go through the method's decode step, so a method with its own is scored as it
  decodes). Scoring the first token from the prefill logits instead would, by the read rule of
  :mod:`kvbench.cache.layer` (a forward attends its own tokens exactly), never read the cache: a
  one-token continuation, the usual multiple-choice answer, would score the same under every method.
- ``loglikelihood_rolling`` (text,): the text is cut into lm-eval's disjoint rolling windows of at
  most ``max_length`` tokens (``lm_eval.utils.get_rolling_token_windows``, context length 1) and each
  window is scored like a ``loglikelihood`` request with its own fresh cache; the sum is returned.

With ``chunk=1`` (the default) every scored token is predicted by a forward of one token that reads
all earlier tokens from storage, the decode-time access pattern. A larger ``chunk`` is faster; the
tokens inside one chunk then see each other exactly.

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
``kvbench-lm-eval`` (:func:`main`) is lm-eval's own CLI with this model registered, so
``kvbench-lm-eval --model kvbench --model_args method=kivi,bits=2,method.residual=32 --tasks ...``
takes every lm-eval option. The package also declares the model under the ``lm_eval.models`` entry
point group, the form lm-eval's plugin registry loads, so ``lm_eval --model kvbench`` works with an
lm-eval that discovers plugins (0.4.13 does not: use ``kvbench-lm-eval`` there).

``model_args`` are read strictly (:func:`parse_model_args`), the keys of a kvbench run's command
line: ``model`` (a ``conf/model`` node, default ``smollm2-135m``), ``model.<key>`` (any key of that
node: ``model.path``, ``model.dtype``, ``model.max_context``, ...), ``method`` (default ``fp16``),
``method.<key>`` (any knob of the method: ``method.residual``, ``method.group_size``, ...),
``bits``, ``device``, and the adapter's ``chunk``, ``max_gen_toks`` and ``prefix_token_id``. Any
other key is a :class:`~kvbench.errors.ConfigError` naming it and the allowed ones: hf-style
``pretrained=`` or ``dtype=`` would otherwise load the default model with the method's defaults.
lm-eval's ``batch_size`` must be 1 or ``auto`` (each request runs alone with its own cache).

The results JSON carries, under ``config.kvbench`` (:meth:`KVBenchLM.get_model_info`), the
method's label and resolved config, the model node, the bits, the id kvbench hashes for this model
and method (:func:`arm_id`), the mean over requests of each request's cache accounting
(``effective_bits``, ``code_bits``, ``compression``, ... as a kvbench run's ``memory`` has them)
and the warnings: a method whose lossless window (KIVI's residual, a sink, an eviction budget)
holds every token of some requests ran those in full precision, and says on how many
(:meth:`kvbench.methods.base.MethodConfig.context_warnings` on each request's cache length; also
printed to stderr after each request type ran).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from kvbench.cache import MemoryReport, memory_report
from kvbench.errors import ConfigError

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until when a task sets none
DEFAULT_MODEL = "smollm2-135m"
# lm-eval's CLI passes --device (default cuda:0) to every model whether or not the user gave it
LM_EVAL_DEFAULT_DEVICE = "cuda:0"
# what lm-eval's hf model calls a knob that kvbench keeps on the model node
HF_EQUIVALENTS = {
    "pretrained": "model.path",
    "dtype": "model.dtype",
    "revision": "model.revision",
    "max_length": "model.max_context",
}
ADAPTER_KEYS = ("bits", "chunk", "device", "max_gen_toks", "method", "model", "prefix_token_id")
LM_EVAL_KEYS = ("batch_size", "max_batch_size")  # passed by lm-eval's evaluator itself


@dataclass
class ModelArgs:
    """lm-eval's ``model_args`` for ``--model kvbench``, parsed (:func:`parse_model_args`).

    ``model_overrides``/``method_overrides``: the ``model.<key>``/``method.<key>`` values, set on
    the named nodes as ``model.<key>=`` and ``method.<key>=`` on kvbench's command line are."""

    model: str = DEFAULT_MODEL
    model_overrides: dict[str, Any] = field(default_factory=dict)
    method: str = "fp16"
    method_overrides: dict[str, Any] = field(default_factory=dict)
    bits: float | None = None
    device: str = "auto"
    chunk: int = 1
    max_gen_toks: int = DEFAULT_MAX_GEN_TOKS
    prefix_token_id: int | None = None

    def __post_init__(self):
        from kvbench.config import is_int, is_number

        for key in ("model", "method"):
            value = getattr(self, key)
            if not (isinstance(value, str) and value):
                raise ConfigError(key, value, f"a name (kvbench/conf/{key}/<name>.yaml)")
        if self.bits is not None:
            if not is_number(self.bits) or self.bits <= 0:
                raise ConfigError("bits", self.bits, "a positive number (log2 of a level count)")
            self.bits = float(self.bits)
        for key in ("chunk", "max_gen_toks"):
            value = getattr(self, key)
            if not (is_int(value) and value > 0):
                raise ConfigError(key, value, "a positive int")
        token = self.prefix_token_id
        if token is not None and not (is_int(token) and token >= 0):
            raise ConfigError("prefix_token_id", self.prefix_token_id, "a token id (int >= 0)")
        self.device = _device(self.device)

    def model_node(self) -> dict[str, Any]:
        """The ``model`` node as a kvbench run resolves it, with the ``model.<key>`` values set."""
        from kvbench.models import model_node

        return model_node(self.model, self.model_overrides)

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
    """Every key ``--model kvbench`` reads: the adapter's, each ``model.<key>``, and each
    ``method.<key>`` of ``method`` (of every registered method when it is unknown)."""
    from kvbench.methods.base import METHODS
    from kvbench.models import ModelConfig

    model_keys = [f"model.{f.name}" for f in dataclasses.fields(ModelConfig) if f.init]
    classes = [METHODS.get(method)] if method in METHODS else [METHODS.get(n) for n in METHODS.names()]
    knobs = {f.name for cls in classes for f in dataclasses.fields(cls.Config) if f.init} - {"name"}
    method_keys = sorted(f"method.{k}" for k in knobs)
    return [*ADAPTER_KEYS, *LM_EVAL_KEYS, *model_keys, *method_keys]


def parse_model_args(args: Mapping[str, Any]) -> ModelArgs:
    """``args`` (lm-eval's parsed ``model_args`` plus what its evaluator adds) as :class:`ModelArgs`;
    one ConfigError line, naming the key and the allowed ones, for a key that is not kvbench's.

    Only the keys are checked here; each node's values are checked by its own config when the
    model and method are built (:meth:`KVBenchLM.from_model_args`)."""
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
        elif key in ADAPTER_KEYS:
            kwargs[key] = value
        elif key in LM_EVAL_KEYS:
            _check_batch_size(key, value)
        else:
            allowed = allowed_keys(method if isinstance(method, str) else None)
            if key in HF_EQUIVALENTS:
                why = f"unknown key (lm-eval's hf model's {key}); use {HF_EQUIVALENTS[key]}; "
                raise ConfigError(key, value, why + f"allowed: {', '.join(allowed)}")
            if key == "method.name":
                raise ConfigError(key, value, "give the method as method=NAME")
            raise ConfigError(key, value, unknown_key(key, allowed))
    return ModelArgs(**kwargs)


def _check_batch_size(key: str, value: Any) -> None:
    if key == "max_batch_size" or value is None:
        return  # an upper bound for auto; 1 is within any
    if value in (1, "1") or (isinstance(value, str) and value.startswith("auto")):
        return
    raise ConfigError(key, value, "1 or auto: kvbench runs each request alone, through its own cache")


def arm_id(model_node: dict[str, Any], method_node: dict[str, Any], bits: float | None) -> str:
    """The id kvbench hashes for a model and method (:func:`kvbench.results.run_id` of the run
    config without its task and seed): the same ``model_args`` give the same id on any task, and a
    different model node, method knob or bit width gives another."""
    from kvbench.results import run_id

    return run_id({"model": model_node, "method": method_node, "bits": bits})


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
        import math

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


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes")


@register_model("kvbench")
class KVBenchLM(TemplateLM):
    """An lm-eval ``LM`` over a :class:`kvbench.generate.ModelRunner` (model, tokenizer, method).

    From Python, pass ``runner``. From lm-eval (``--model kvbench``), the ``model_args`` build one
    through the run builder (:func:`kvbench.builder.build_runner`'s steps), as kvbench's CLI builds
    its runs: see the module docstring for the keys. ``announce``: print the context warnings of
    each request call to stderr (kvbench's own ``task=lmeval`` runs call once per document and
    report through the run instead).
    """

    # the last one lm-eval built from model_args: kvbench-lm-eval names the results after it
    latest: KVBenchLM | None = None

    def __init__(
        self,
        runner=None,
        chunk: int = 1,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        prefix_token_id: int | None = None,
        announce: bool = True,
        **model_args: Any,
    ):
        super().__init__()
        self.args: ModelArgs | None = None
        self.model_node: dict[str, Any] | None = None
        self.method_node: dict[str, Any] | None = None
        if runner is None:
            given = {"chunk": chunk, "max_gen_toks": max_gen_toks, "prefix_token_id": prefix_token_id}
            args = self.args = parse_model_args({**given, **model_args})
            runner = self._build_runner(args)
            chunk, max_gen_toks, prefix_token_id = args.chunk, args.max_gen_toks, args.prefix_token_id
        elif model_args:
            key = sorted(model_args)[0]
            raise ConfigError(key, model_args[key], "not with runner=, which holds the model and method")
        if not (isinstance(chunk, int) and chunk > 0):
            raise ConfigError("task.chunk", chunk, "a positive int (continuation tokens per forward)")
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.chunk = int(chunk)
        self.max_gen_toks = int(max_gen_toks)
        self.custom_prefix_token_id = prefix_token_id
        self.announce = announce
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
        for message in bits_ignored(
            {"bits": args.bits, "method": {"name": args.method, **args.method_overrides}}, method
        ).values():
            self._warn(message)
        runner = load_for_methods(config, args.device).runner(method)
        KVBenchLM.latest = self
        return runner

    @staticmethod
    def _warn(message: str) -> None:
        print(f"kvbench: warning: {message}", file=sys.stderr)

    @property
    def method(self):
        return self.runner.method

    def display_name(self) -> str:
        """``kvbench/<model>/<method label>``: what kvbench-lm-eval files the results under."""
        model = (self.model_node or {}).get("name") or getattr(self.tokenizer, "name_or_path", "model")
        return f"kvbench/{model}/{self.method.label()}"

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval adds to its results' ``config`` (called after the requests ran)."""
        import kvbench

        method = self.method
        info = {
            "version": kvbench.__version__,
            "name": self.display_name(),
            "method": method.label(),
            "method_config": dataclasses.asdict(method.config),
            "bits": method.config.bits,
            "model": self.model_node,
            "run_id": None,
            "device": str(self.runner.device),  # lm-eval's own config.device is its --device as given
            "chunk": self.chunk,
            "prefix_token_id": self.prefix_token_id,
            **self.tally.summary(),
            "warnings": dict(self.warnings),
        }
        if self.model_node is not None and self.method_node is not None:
            info["run_id"] = arm_id(self.model_node, self.method_node, self.args.bits)
        return {"kvbench": info}

    def _finish_call(self, records: list[RequestRecord]) -> None:
        """Account a call's requests and warn where the method's lossless window held all of one."""
        for record in records:
            self.tally.add(record)
        method = getattr(self.runner, "method", None)  # a stand-in runner of a test may have none
        if method is None:
            return
        found = covered_requests(method.config, Counter(r.memory.tokens for r in records))
        if found:
            kind = records[0].request_type
            found = {f"{kind}/{code}": f"{kind}: {message}" for code, message in found.items()}
            self.warnings.update(found)
            if self.announce:
                for message in found.values():
                    self._warn(message)

    def _bar(self, requests, what: str, disable: bool):
        method = getattr(self.runner, "method", None)
        desc = f"kvbench {what}" + (f" ({method.label()})" if method is not None else "")
        return tqdm(requests, desc=desc, disable=disable, file=sys.stderr)

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

    # -- scoring through the cache -------------------------------------------------------------
    def score_tokens(self, context: list[int], continuation: list[int]) -> Scored:
        """``log P(continuation | context)`` with a fresh cache; see the module docstring.

        ``context`` must hold at least one token (lm-eval passes the prefix token for an empty
        context)."""
        runner = self.runner
        n = len(continuation)
        if n == 0:
            return Scored(0.0, True, [], len(context), memory_report(runner.new_cache().layers), 0.0)
        if not context:
            raise ValueError("score_tokens needs at least one context token")
        if n > self.max_length:
            raise ValueError(f"a {n}-token continuation exceeds the model's {self.max_length}-token context")
        total = (list(context) + list(continuation))[-(self.max_length + 1) :]
        scored = runner.score(
            torch.tensor([total[:-n]]), torch.tensor([total[-n:]]), self.chunk, first="cache"
        )
        logprobs = [-x for x in scored.nll]
        return Scored(sum(logprobs), scored.greedy, logprobs, len(total) - n, scored.memory, scored.seconds)

    def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs) -> list[tuple[float, bool]]:
        """``requests``: ((context, continuation), context ids, continuation ids), from TemplateLM."""
        out, records = [], []
        for key, context_ids, continuation_ids in self._bar(requests, "loglikelihood", disable_tqdm):
            scored = self.score_tokens(context_ids, continuation_ids)
            result = (scored.logprob, scored.is_greedy)
            out.append(result)
            records.append(
                RequestRecord(
                    "loglikelihood",
                    scored.context_tokens,
                    scored.memory,
                    scored.seconds,
                    nll=[-x for x in scored.token_logprobs],
                )
            )
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, result)
        self.records = records
        self._finish_call(records)
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out, records = [], []
        for (text,) in self._bar([req.args for req in requests], "loglikelihood_rolling", disable_tqdm):
            windows = [
                make_disjoint_window(w)
                for w in get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                )
            ]
            scored = [self.score_tokens(ctx, cont) for ctx, cont in windows]
            total = sum(s.logprob for s in scored)
            out.append(total)
            records.append(
                RequestRecord(
                    "loglikelihood_rolling",
                    max(s.context_tokens for s in scored),
                    max((s.memory for s in scored), key=lambda m: m.tokens),
                    sum(s.seconds for s in scored),
                    nll=[-x for s in scored for x in s.token_logprobs],
                )
            )
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        self.records = records
        self._finish_call(records)
        return out

    # -- generation through the cache ----------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out, records = [], []
        for context, gen_kwargs in self._bar([req.args for req in requests], "generate_until", disable_tqdm):
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
            ids = self.tok_encode(context)
            keep = self.max_length - max_new
            if keep <= 0:
                raise ConfigError(
                    "task.max_gen_toks", max_new, f"fewer than the model's {self.max_length}-token context"
                )
            ids = ids[-keep:]
            t0 = time.perf_counter()
            gen = self.runner.generate(torch.tensor([ids]), max_new, stop_strings=tuple(until))
            out.append(gen.text)
            records.append(
                RequestRecord(
                    "generate_until",
                    gen.prompt_tokens,
                    gen.memory,
                    time.perf_counter() - t0,
                    new_tokens=gen.new_tokens,
                    stopped=gen.stopped,
                )
            )
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), gen.text)
        self.records = records
        self._finish_call(records)
        return out


# -- the kvbench-lm-eval command ----------------------------------------------------------------


def _name_results_after_the_method() -> None:
    """lm-eval names a run (its results folder, ``model_name``) after ``pretrained=``/``model=``,
    else a random id; under ``--model kvbench`` it becomes ``kvbench/<model>/<method label>``, so
    each arm's results land in their own folder under ``--output_path``."""
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


def main(argv: list[str] | None = None) -> None:
    """``kvbench-lm-eval``: lm-eval's command line with ``--model kvbench`` registered (and the
    default ``--model``). A ConfigError (a bad ``model_args`` key or value) is one line on stderr and
    exit status 2, as on kvbench's own command line."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    if (
        argv
        and not any(a == "--model" or a.startswith("--model=") for a in argv)
        and argv[0]
        not in (
            "ls",
            "validate",
            "-h",
            "--help",
        )
    ):
        argv = ["--model", "kvbench", *argv]
    _name_results_after_the_method()
    saved = sys.argv
    sys.argv = ["kvbench-lm-eval", *argv]
    try:
        cli_evaluate()
    except ConfigError as err:
        print(f"kvbench-lm-eval: error: model_args: {err}", file=sys.stderr)
        sys.exit(2)
    finally:
        sys.argv = saved
