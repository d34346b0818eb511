"""The lm-evaluation-harness entry: the ``kvbench`` model lm-eval builds from ``model_args``
(:class:`KVBenchLM`, registered with lm-eval as ``kvbench``) and the ``kvbench-lm-eval`` command.

The model is :class:`kvbench.lmeval_adapter.RunnerLM`, the adapter that runs every request lm-eval
hands it through a kvbench method's cache (its module docstring: the three kinds of request, the
two log-likelihood protocols of ``chunk``, batching, tokenization and the prefix token, the
records), over a runner built here as a kvbench run builds one: :class:`KVBenchLM` reads
``model_args``, checks every node before the model loads, builds the runner, hashes the arm's id
(:func:`arm_id`) and scores the FP16 baseline's log-likelihoods in one forward under ``chunk=auto``
(:func:`one_forward_scores`). The adapter's names are importable from here too.

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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (lm-eval's own models, registered before kvbench's: see below)
import torch
from lm_eval.api.registry import register_model

from kvbench.errors import ConfigError
from kvbench.lmeval_adapter import (  # noqa: F401  (the adapter's names, importable from here as before)
    AUTO_BATCH_SIZE,
    DEFAULT_MAX_GEN_TOKS,
    LOGITS_BUDGET_BYTES,
    MemoryTally,
    Pending,
    RequestRecord,
    RunnerLM,
    Scored,
    checked_batch_size,
    checked_chunk,
    checked_max_batch_size,
    covered_requests,
    model_sha,
)

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


def one_forward_scores(method) -> bool:
    """Whether ``chunk=auto`` scores ``method``'s log-likelihoods in one forward per request: the FP16
    baseline (:class:`kvbench.methods.fp16.FP16`), whose cache stores every token in full precision,
    so that scoring through the stored cache would give the one forward's numbers plus the rounding
    of the stored keys and values to ``fp_dtype``. Every other method is scored through its cache."""
    from kvbench.methods.fp16 import FP16

    return isinstance(method, FP16)


# lm-eval registers its own models (hf, vllm, ...) only when its registry is empty, and registering
# kvbench's first would leave `--model hf` unknown next to it: lm_eval.models is imported above.
@register_model("kvbench")
class KVBenchLM(RunnerLM):
    """The lm-eval ``LM`` over a :class:`kvbench.generate.ModelRunner` (model, tokenizer, method):
    the adapter :class:`kvbench.lmeval_adapter.RunnerLM` with what lm-eval's door adds.

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
        super().__init__(runner, chunk, max_gen_toks, prefix_token_id, announce, batch_size, max_batch_size)

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

    def one_forward_scores(self) -> bool:
        """:func:`one_forward_scores` of the runner's method: the FP16 baseline scores in one forward."""
        return one_forward_scores(self.method)

    def run_id(self) -> str | None:
        """:func:`arm_id` of the nodes built from ``model_args``; None with a ``runner=`` given."""
        if self.model_node is not None and self.method_node is not None:
            return arm_id(self.model_node, self.method_node, self.args.bits)
        return None


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
