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
and an empty context becomes the end-of-text token. Over-long inputs lose tokens on the left, as
in lm-eval's HF model. Decoding is greedy; a request that asks for sampling is refused.

After each call, :attr:`KVBenchLM.records` holds one :class:`RequestRecord` per request (prompt
length, memory report of the cache at the end, timings), in request order, for per-sample rows.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from kvbench.cache import MemoryReport, memory_report
from kvbench.errors import ConfigError

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's default for generate_until when a task sets none


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


def _truthy(value: Any) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes")


@register_model("kvbench")
class KVBenchLM(TemplateLM):
    """An lm-eval ``LM`` over a :class:`kvbench.generate.ModelRunner` (model, tokenizer, method).

    ``runner`` is required from Python. From lm-eval's command line (``--model kvbench`` after
    ``import kvbench.lmeval``), ``model=NAME`` (a ``conf/model`` node), ``method=NAME`` and ``bits``
    build one with the method's default knobs through the run builder
    (:func:`kvbench.builder.build_runner`), as the CLI builds its runs.
    """

    def __init__(
        self,
        runner=None,
        chunk: int = 1,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        model: str | None = None,
        method: str | None = None,
        bits: float | None = None,
        device: str = "cpu",
        **unused: Any,
    ):
        super().__init__()
        if runner is None:
            runner = self._build_runner(model or "smollm2-135m", method or "fp16", bits, device)
        if not (isinstance(chunk, int) and chunk > 0):
            raise ConfigError("task.chunk", chunk, "a positive int (continuation tokens per forward)")
        self.runner = runner
        self.tokenizer = runner.tokenizer
        self.chunk = int(chunk)
        self.max_gen_toks = int(max_gen_toks)
        self.records: list[RequestRecord] = []

    @staticmethod
    def _build_runner(model: str, method: str, bits, device: str):
        from kvbench.builder import build_runner

        return build_runner(
            model, {"name": method}, bits=None if bits is None else float(bits), device=device
        )

    # -- what TemplateLM needs -----------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
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

        ``context`` must hold at least one token (lm-eval passes the end-of-text token for an empty
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
        out, self.records = [], []
        for key, context_ids, continuation_ids in requests:
            scored = self.score_tokens(context_ids, continuation_ids)
            result = (scored.logprob, scored.is_greedy)
            out.append(result)
            self.records.append(
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
        return out

    def loglikelihood(self, requests, disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = True) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        out, records = [], []
        for (text,) in [req.args for req in requests]:
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
                    scored[-1].memory,
                    sum(s.seconds for s in scored),
                    nll=[-x for s in scored for x in s.token_logprobs],
                )
            )
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
        self.records = records
        return out

    # -- generation through the cache ----------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = True) -> list[str]:
        out, records = [], []
        for context, gen_kwargs in [req.args for req in requests]:
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
        return out
