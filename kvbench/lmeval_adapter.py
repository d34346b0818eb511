"""The lm-evaluation-harness model over a kvbench runner (:class:`RunnerLM`): every request lm-eval
hands it runs through the runner's method cache.

This is the adapter alone, over a runner already built (:class:`kvbench.generate.ModelRunner`):
kvbench's own ``task=lmeval`` (:mod:`kvbench.tasks.lmeval_task`) uses it as it is, so it stands
below the tasks and imports nothing from above the cache. :mod:`kvbench.lmeval` is the lm-eval
entry on top of it: :class:`kvbench.lmeval.KVBenchLM`, the ``kvbench`` model lm-eval builds from
``model_args`` (a subclass that builds the runner as a kvbench run does, hashes the arm's id and
names the method that scores in one forward), and the ``kvbench-lm-eval`` command.

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
  in full precision, the FP16 baseline, as
  :meth:`RunnerLM.one_forward_scores` answers): context and continuation go
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

After each call, :attr:`RunnerLM.records` holds one :class:`RequestRecord` per request (prompt
length, memory report of the cache at the end, timings), in request order, for per-sample rows.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from tqdm import tqdm

from kvbench.cache import MemoryReport, memory_report
from kvbench.env import get_logger
from kvbench.errors import ConfigError
from kvbench.version import __version__

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until when a task sets none
# ``batch_size=auto`` without lm-eval's --max_batch_size: the first size tried (halved on running
# out of device memory). kvbench does not probe memory first as lm-eval's hf model does.
AUTO_BATCH_SIZE = 8
# The most float32 logits one batched forward of the one-forward protocol may hold: a batch of long
# requests is cut into smaller ones (a 4096-token row of a 128K vocabulary takes 2 GiB alone).
LOGITS_BUDGET_BYTES = 2 * 2**30


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


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes")


# one request to score: (its index, context ids, continuation ids), after left truncation
Pending = tuple[int, list[int], list[int]]


# lm-eval registers its own models (hf, vllm, ...) only when its registry is empty, and registering
# kvbench's first would leave `--model hf` unknown next to it: lm_eval.models is imported above.


class RunnerLM(TemplateLM):
    """An lm-eval ``LM`` over a :class:`kvbench.generate.ModelRunner` (model, tokenizer, method).

    ``chunk``: the log-likelihood protocol (module docstring); ``batch_size``: requests per batch (a
    positive int or ``auto``). ``announce``: print the context warnings of each request call to
    stderr (kvbench's own ``task=lmeval`` runs call once per document and report through the run
    instead). lm-eval's ``--model kvbench`` builds :class:`kvbench.lmeval.KVBenchLM`, this adapter
    over a runner it builds from ``model_args``.
    """

    # the nodes the runner was built from, where the adapter knows them (kvbench.lmeval.KVBenchLM)
    model_node: dict[str, Any] | None = None
    method_node: dict[str, Any] | None = None

    def __init__(
        self,
        runner,
        chunk: int | str = "auto",
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        prefix_token_id: int | None = None,
        announce: bool = True,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
    ):
        super().__init__()
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

    @staticmethod
    def _warn(message: str) -> None:
        get_logger(__name__).warning(message)

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

    def one_forward_scores(self) -> bool:
        """Whether ``chunk=auto`` scores the runner's method's log-likelihoods in one forward per
        request. The adapter stands below the methods and cannot tell the FP16 baseline from the
        others: False here, every method through its cache (``task=lmeval`` always gives a
        ``chunk``); :class:`kvbench.lmeval.KVBenchLM` answers for the baseline."""
        return False

    def scoring(self) -> str:
        """The log-likelihood protocol: ``one_forward`` or ``cache`` (module docstring)."""
        return "one_forward" if self.chunk == "auto" and self.one_forward_scores() else "cache"

    def run_id(self) -> str | None:
        """The id kvbench hashes for the runner's model and method, where the adapter knows the nodes
        they were built from (:class:`kvbench.lmeval.KVBenchLM`); else None."""
        return None

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
            "run_id": self.run_id(),
            "device": str(self.runner.device),  # lm-eval's own config.device is its --device as given
            "chunk": self.chunk,
            "loglikelihood_scoring": scoring,
            "cache_chunk": None if scoring == "one_forward" else self.cache_chunk,
            "batch_size": self._batch,
            "prefix_token_id": self.prefix_token_id,
            **self.tally.summary(),
            "warnings": dict(self.warnings),
        }
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
