"""The decode loop shared by tasks: prefill into a method's cache, greedy decoding, scoring.

Batch size 1 (one sample at a time, as the papers evaluate); the model's own forward is used
unchanged, with the method's cache passed as ``cache=``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from kvbench.cache import KVBenchCache, MemoryReport, memory_report
from kvbench.methods import Method, ModelShape


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    prompt_tokens: int
    stopped: bool  # ended on EOS or a stop string rather than on max_new_tokens
    memory: MemoryReport
    prefill_s: float
    decode_s: float
    extra: dict = field(default_factory=dict)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class Scored:
    """Per-token negative log-likelihoods of a continuation read through the cache."""

    nll: list[float]
    memory: MemoryReport
    seconds: float


class ModelRunner:
    """A loaded model plus the method whose cache every request gets."""

    def __init__(self, model, tokenizer, method: Method, shape: ModelShape):
        self.model, self.tokenizer, self.method, self.shape = model, tokenizer, method, shape
        self.device = next(model.parameters()).device
        self.eos_ids = self._eos_ids()

    def _eos_ids(self) -> set[int]:
        ids = set()
        for source in (self.model.generation_config.eos_token_id, self.tokenizer.eos_token_id):
            if source is None:
                continue
            ids.update(source if isinstance(source, (list, tuple)) else [source])
        return ids

    def new_cache(self) -> KVBenchCache:
        return self.method.new_cache(self.shape, self.model.dtype)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: KVBenchCache) -> torch.Tensor:
        """``input_ids [1, t]`` appended to ``cache``; returns float32 logits ``[1, t, vocab]``."""
        input_ids = input_ids.to(self.device)
        logits = self.model(input_ids=input_ids, cache=cache, use_cache=True).logits.float()
        self.method.after_forward(cache, input_ids, logits)
        return logits

    def decode_step(self, input_ids: torch.Tensor, cache: KVBenchCache) -> torch.Tensor:
        """Feed the token just chosen, ``input_ids [1, 1]``; returns the float32 logits ``[1, 1,
        vocab]`` that choose the next one. A method that drives its own decode step (SpeCache's
        two-token forward) defines ``decode_step(runner, cache, input_ids)`` and is delegated to;
        every other method gets one plain :meth:`forward`."""
        step = getattr(self.method, "decode_step", None)
        return self.forward(input_ids, cache) if step is None else step(self, cache, input_ids)

    def encode(self, text: str) -> torch.Tensor:
        return self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        stop_strings: tuple[str, ...] = (),
        stop_token_ids: tuple[int, ...] = (),
        min_new_tokens: int = 0,
    ) -> Generation:
        """Greedy decoding of up to ``max_new_tokens`` after ``input_ids [1, T]``. Decoding stops at
        EOS, at any of ``stop_token_ids`` or once a ``stop_strings`` entry appears; no stop token may
        be chosen among the first ``min_new_tokens`` (a benchmark's ``min_length`` rule)."""
        stops = self.eos_ids | set(stop_token_ids)
        cache = self.new_cache()
        t0 = time.perf_counter()
        logits = self.forward(input_ids, cache)
        prefill_s = time.perf_counter() - t0
        tokens: list[int] = []
        stopped = False
        t0 = time.perf_counter()
        for _ in range(max_new_tokens):
            step = logits[0, -1]
            if len(tokens) < min_new_tokens:
                step = step.clone()
                step[list(stops)] = float("-inf")
            nxt = int(step.argmax())
            if nxt in stops:
                stopped = True
                break
            tokens.append(nxt)
            if stop_strings and any(s in self.tokenizer.decode(tokens) for s in stop_strings):
                stopped = True
                break
            if len(tokens) == max_new_tokens:
                break
            logits = self.decode_step(torch.tensor([[nxt]]), cache)
        decode_s = time.perf_counter() - t0
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        for s in stop_strings:
            text = text.split(s)[0]
        memory = memory_report(cache.layers)
        return Generation(text, tokens, input_ids.shape[1], stopped, memory, prefill_s, decode_s)

    @torch.no_grad()
    def score(self, context_ids: torch.Tensor, continuation_ids: torch.Tensor, chunk: int = 1) -> Scored:
        """Prefill ``context_ids [1, C]`` into a fresh cache, then feed ``continuation_ids [1, N]``
        ``chunk`` tokens per forward, each forward reading everything before it from the cache.
        Token i of the continuation is predicted from the logits at the position before it."""
        cache = self.new_cache()
        t0 = time.perf_counter()
        logits = self.forward(context_ids, cache)[:, -1:]
        nll: list[float] = []
        n = continuation_ids.shape[1]
        for start in range(0, n, chunk):
            piece = continuation_ids[:, start : start + chunk]
            # logits predicting piece: the last context/previous-piece position, then piece[:-1]
            step_logits = torch.cat([logits, self.forward(piece, cache)], dim=1)
            logp = torch.log_softmax(step_logits[0, :-1], dim=-1)
            nll.extend((-logp.gather(-1, piece[0, :, None].to(logp.device))[:, 0]).tolist())
            logits = step_logits[:, -1:]
        memory = memory_report(cache.layers)
        return Scored(nll, memory, time.perf_counter() - t0)
