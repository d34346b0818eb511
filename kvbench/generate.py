"""The generation loop and the scoring loop: every task and the lm-eval adapter run requests through
these two, so every method hook is honoured the same way everywhere.

- :meth:`ModelRunner.generate`: prefill into a fresh cache of the method, then greedy decoding; every
  token after the prefill goes through the method's decode step (:meth:`Method.decode_step`).
- :meth:`ModelRunner.score`: per-token negative log-likelihoods of a continuation read through a
  fresh cache, under one of two protocols (see there); every one-token forward goes through the same
  decode step, so a method with its own (SpeCache) is scored as it decodes.

Both call :meth:`Method.after_forward` after every forward (:meth:`ModelRunner.forward`). Batch size 1
(one sample at a time, as the papers evaluate); the model's own forward is used unchanged, with the
method's cache passed as ``cache=``.

- :meth:`ModelRunner.generate_batch`: B prompts of any lengths at once, left-padded, each sequence in
  its own cache of the method (:mod:`kvbench.cache.batch`, the ``per_sequence`` path), so that each
  sequence's tokens equal its :meth:`ModelRunner.generate` alone and its logits do up to the
  rounding of batched matrix products. The tasks still run batch 1: their stored results and run
  ids do not depend on this path.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import torch

from kvbench.cache import KVBenchCache, MemoryReport, memory_report
from kvbench.cache.batch import SequenceBatchCache, sequence_caches
from kvbench.cache.prefill import SHARED_PREFILLS, record_prefill, replay_prefill, token_digest
from kvbench.cache.sliding import with_window_layers
from kvbench.cache.stack import split_sequences, stack_sequences
from kvbench.cache.static import StaticStep, note_decode_step
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


# The prompt positions whose logits a prefill computes (the last ones; only the last is used). Not
# 1: the output projection of one row is a matrix-vector product, whose float32 sums are not those
# of the same row inside a matrix product on the CPU's BLAS (2.7e-5 apart on the default model);
# from 16 rows on the last row is bit-identical to the whole prompt's (tests/cache/test_prefill.py
# checks it), and the other positions' projections, 15-40 % of a 0.3-2K-token prefill, are skipped.
PREFILL_LOGIT_ROWS = 16

# How a batch of prompts is prefilled (see ModelRunner.generate_batch).
PREFILL_MODES = ("alone", "batch")

# How the first continuation token is predicted (see ModelRunner.score).
SCORE_FIRST = ("prefill", "cache")


@dataclass
class Scored:
    """Per-token negative log-likelihoods of a continuation read through the cache; ``greedy``: every
    continuation token is the argmax of the logits that predict it."""

    nll: list[float]
    memory: MemoryReport
    seconds: float
    greedy: bool = True


def scoring_inputs(
    context_ids: torch.Tensor, continuation_ids: torch.Tensor, first: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(stored, fed)`` of a scored request (:meth:`ModelRunner.score`): the tokens prefilled, then
    the tokens fed after them, one forward per piece. ``first="prefill"``: the whole context, then
    the whole continuation; ``first="cache"``: the context less its last token, then that token and
    the continuation less its last."""
    if first == "prefill":
        return context_ids, continuation_ids
    return context_ids[:, :-1], torch.cat([context_ids[:, -1:], continuation_ids[:, :-1]], dim=1)


def declared(method: Method, flag: str) -> bool:
    """Whether ``method`` declares the class flag ``flag`` (``stack_rows``, ``arm_batch``), and so
    does the method it stores as, where it has one (IntactKV's base)."""
    base = getattr(method.config, "base_method", None)
    return bool(getattr(method, flag)) and (base is None or declared(base, flag))


def check_scoring_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]], first: str, who: str) -> int:
    """The continuation length N that every pair of a batched scoring shares; ValueError naming
    ``who`` where ``first`` is unknown, the lengths differ, or a context is too short for ``first``."""
    if first not in SCORE_FIRST:
        raise ValueError(f"first={first!r}: one of {', '.join(SCORE_FIRST)}")
    lengths = {c.shape[1] for _, c in pairs}
    if not pairs or len(lengths) != 1:
        raise ValueError(f"{who} takes pairs whose continuations have one length, got {sorted(lengths)}")
    need = 1 if first == "prefill" else 2
    if any(ctx.shape[1] < need for ctx, _ in pairs):
        raise ValueError(f"scoring with first={first!r} in a batch needs at least {need} context tokens")
    return lengths.pop()


def padded_forward(model, input_ids: torch.Tensor, cache: SequenceBatchCache, device) -> tuple:
    """One forward of ``input_ids [R, q]`` over a :class:`SequenceBatchCache`, with the batch's
    attention mask and each sequence's own positions (``cumsum(mask) - 1``, as transformers'
    ``generate`` builds them). Returns ``(float32 logits [R, q, vocab], each row's first real
    column)``; the method hooks are the caller's."""
    q = input_ids.shape[1]
    starts = cache.starts(q)
    mask = cache.attention_mask(q, device)
    position_ids = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)[:, -q:]
    logits = model(
        input_ids=input_ids, attention_mask=mask, position_ids=position_ids, **cache.forward_kwargs()
    ).logits.float()
    return logits, starts


class _BatchScoring:
    """The bookkeeping of a batched scoring (:meth:`ModelRunner.score_batch`,
    :func:`score_arms`): what each pair stores and feeds (:func:`scoring_inputs`), its rows
    repeated ``repeat`` times (one block per arm), and each row's negative log-likelihoods and
    greedy flag as the forwards' logits arrive."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], first: str, repeat: int = 1):
        split = [scoring_inputs(ctx, cont, first) for ctx, cont in pairs]
        self.first = first
        self.stored = [s for s, _ in split]
        self.fed = torch.cat([f for _, f in split]).repeat(repeat, 1)
        self.targets = torch.cat([cont for _, cont in pairs]).repeat(repeat, 1)  # [R, N]
        rows, n = self.targets.shape
        self.nll = torch.empty(rows, n)
        self.greedy = torch.ones(rows, dtype=torch.bool)
        self.pending: torch.Tensor | None = None

    def begin(self, last: torch.Tensor) -> None:
        """``last [R, vocab]``: each row's prefill logits, predicting its first continuation token."""
        self.pending = last[:, None]

    def pieces(self, chunk: int):
        """``(start, fed tokens [R, c])`` of each forward, ``chunk`` tokens at a time."""
        for start in range(0, self.fed.shape[1], chunk):
            yield start, self.fed[:, start : start + chunk]

    def take(self, start: int, logits: torch.Tensor) -> None:
        """The logits ``[R, c, vocab]`` of the piece fed at ``start``."""
        if self.first == "prefill":
            step_logits = torch.cat([self.pending, logits], dim=1)
            self.pending = step_logits[:, -1:]
            logits = step_logits[:, :-1]
        c = logits.shape[1]
        logp = torch.log_softmax(logits, dim=-1)  # [R, c, vocab]
        target = self.targets[:, start : start + c].to(logp.device)
        self.nll[:, start : start + c] = -logp.gather(-1, target[..., None])[..., 0].cpu()
        self.greedy &= (logp.argmax(-1) == target).all(dim=-1).cpu()

    def scored(self, row: int, cache: KVBenchCache, method: Method, seconds: float) -> Scored:
        """Row ``row``'s :class:`Scored`, its cache's memory report read before the method ends
        the request."""
        memory = memory_report(cache.layers)
        method.end_request(cache)
        return Scored(self.nll[row].tolist(), memory, seconds, bool(self.greedy[row]))


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
        """A fresh cache of the method for one request. Its sliding-window layers (if the model has
        any) are :class:`~kvbench.cache.sliding.SlidingWindowLayer`s whatever the method built
        (:meth:`Method.build_layers` makes them so; a method building its own cache class is held to
        the same rule here), so the model's sliding masks and the FP16 reference match
        transformers' own cache."""
        cache = self.method.new_cache(self.shape, self.model.dtype)
        sliding = self.shape.sliding_layers()
        if sliding and self.method.config.sliding_windows == "full_precision":
            fp_dtype = self.method.config.torch_fp_dtype(self.model.dtype)
            cache.layers[:] = with_window_layers(cache.layers, sliding, self.shape.sliding_window, fp_dtype)
        return cache

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, cache: KVBenchCache) -> torch.Tensor:
        """The prompt ``input_ids [1, T]`` into the fresh ``cache``; returns float32 logits of its
        last ``min(T, PREFILL_LOGIT_ROWS)`` positions ``[1, r, vocab]`` (all T where the method reads
        them, :meth:`Method.needs_prefill_logits`).

        Where the method's prefill is the FP16 one (:meth:`Method.prefill_is_fp16`), the forward is
        shared (:mod:`kvbench.cache.prefill`): the first request for these tokens on this model in
        the process runs the model and is recorded, and every later one, of any declaring method,
        hands the record to its cache instead of running the model again. Either way the cache
        holds the same bytes and the logits are the same. A prefill that is not shared is the
        method's :meth:`Method.prefill_forward` (one forward, unless the method runs it itself)."""
        all_rows = self.method.needs_prefill_logits()
        rows = 0 if all_rows else min(input_ids.shape[1], PREFILL_LOGIT_ROWS)
        store = SHARED_PREFILLS
        share = (
            input_ids.shape[0] == 1
            and not isinstance(cache, SequenceBatchCache)
            and not cache.static
            and self.method.prefill_is_fp16()
            and store.enabled
        )
        if not share:
            # one forward, unless the method runs its prefill itself (Method.drives_prefill)
            return self.method.prefill_forward(self, input_ids, cache, rows)
        key = ("prefill", token_digest(input_ids), rows)
        record = store.get(self.model, key)
        if record is not None:
            replay_prefill(cache, record)
            logits = record.logits.clone()
            self.method.after_forward(cache, input_ids.to(self.device), logits)
            return logits
        with record_prefill(cache) as recorder:
            logits = self.forward(input_ids, cache, logits_to_keep=rows)
        record = recorder.finish(logits)
        if record is not None:
            store.put(self.model, key, record)
        return logits

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, cache: KVBenchCache, logits_to_keep: int = 0) -> torch.Tensor:
        """``input_ids [1, t]`` appended to ``cache``; returns float32 logits ``[1, t, vocab]``. Over a
        :class:`~kvbench.cache.batch.SequenceBatchCache`, ``input_ids [R, t]`` is one row per
        sequence the cache currently carries (left-padded in the prefill), given the batch's
        attention mask and each sequence's own positions (``cumsum(mask) - 1``, as transformers'
        ``generate`` builds them); logits ``[R, t, vocab]``, pad positions meaningless."""
        input_ids = input_ids.to(self.device)
        if isinstance(cache, SequenceBatchCache):
            return self._forward_batch(input_ids, cache)
        kept = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
        logits = self.model(input_ids=input_ids, **kept, **cache.forward_kwargs()).logits.float()
        self.method.after_forward(cache, input_ids, logits)
        if cache.static:
            cache.advance(input_ids.shape[1])
        return logits

    def _static_forward(self, cache: KVBenchCache):
        """The forward of a :class:`~kvbench.cache.static.StaticStep`: ``(input_ids [1, 1],
        position_ids [1, 1]) -> logits [1, 1, vocab]``, moving ``position_ids`` on by one on the
        device. It never counts tokens on the host (the step does, after it)."""

        def forward(input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
            out = self.model(input_ids=input_ids, position_ids=position_ids, **cache.forward_kwargs())
            logits = out.logits.float()
            self.method.after_forward(cache, input_ids, logits)
            position_ids.add_(1)
            return logits

        return forward

    def _forward_batch(self, input_ids: torch.Tensor, cache: SequenceBatchCache) -> torch.Tensor:
        logits, starts = padded_forward(self.model, input_ids, cache, self.device)
        self.method.after_forward_batch(sequence_caches(cache), input_ids, logits, starts)
        return logits

    def decode_step(self, input_ids: torch.Tensor, cache: KVBenchCache) -> torch.Tensor:
        """Feed the token just chosen, ``input_ids [1, 1]`` (``[R, 1]`` over a batch cache); returns
        the float32 logits ``[1, 1, vocab]`` (``[R, 1, vocab]``) that choose the next one, through
        the method's :meth:`Method.decode_step` (one plain :meth:`forward` unless the method drives
        its own step, as SpeCache does)."""
        return self.method.decode_step(self, cache, input_ids)

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
        self.method.new_request(max_new_tokens - 1)
        cache = self.new_cache()
        static_step = None
        if self.method.config.cuda_graph:
            # every token the request can store: the prompt and all but the last new token
            cache.reserve(input_ids.shape[1] + max(max_new_tokens - 1, 0))
        t0 = time.perf_counter()
        logits = self.prefill(input_ids, cache)
        prefill_s = time.perf_counter() - t0
        if cache.static:
            capture = self.device.type == "cuda"
            static_step = StaticStep(
                self._static_forward(cache), cache, input_ids.shape[1], self.device, capture
            )
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
            if static_step is not None:
                logits = static_step(nxt)
            else:
                logits = self.decode_step(torch.tensor([[nxt]]), cache)
        decode_s = time.perf_counter() - t0
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        for s in stop_strings:
            text = text.split(s)[0]
        memory = memory_report(cache.layers)
        self.method.end_request(cache)
        extra = {} if static_step is None else {"decode_step": static_step.mode}
        note_decode_step("eager" if static_step is None else static_step.mode)
        return Generation(text, tokens, input_ids.shape[1], stopped, memory, prefill_s, decode_s, extra)

    def new_batch_cache(self, batch: int) -> SequenceBatchCache:
        """A :class:`~kvbench.cache.batch.SequenceBatchCache` of ``batch`` fresh caches of the method
        (:meth:`new_cache` each, so each sequence's storage is the batch-1 one). Refused on models
        with sliding-window layers, whose window masks the per-sequence path does not replay."""
        sliding = self.shape.sliding_layers()
        if sliding:
            raise NotImplementedError(
                f"batched decoding is not supported on models with sliding-window layers "
                f"(layers {sliding}): decode one sequence at a time"
            )
        return SequenceBatchCache([self.new_cache() for _ in range(batch)])

    def pad_batch(self, prompts: list[torch.Tensor], pad_token_id: int | None = None):
        """Left-pad ``prompts`` (each ``[1, T_i]`` or ``[T_i]``, ``T_i >= 1``): ``(input_ids [B, T_max],
        attention_mask [B, T_max])``, 1 at real tokens. Left, so that every row's last column is its
        newest token and decode steps append in one column. The pad id only has to be a valid token:
        pad rows are never stored nor attended (:mod:`kvbench.cache.batch`)."""
        rows = [torch.as_tensor(p).reshape(-1) for p in prompts]
        if not rows or any(r.numel() == 0 for r in rows):
            raise ValueError("generate_batch takes one or more prompts of at least one token each")
        if pad_token_id is None:
            pad_token_id = getattr(self.tokenizer, "pad_token_id", None)
        pad = 0 if pad_token_id is None else int(pad_token_id)
        longest = max(r.numel() for r in rows)
        ids = torch.full((len(rows), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), longest), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, longest - r.numel() :] = r
            mask[i, longest - r.numel() :] = 1
        return ids, mask

    @torch.no_grad()
    def generate_batch(
        self,
        prompts: list[torch.Tensor],
        max_new_tokens: int,
        stop_strings: tuple[str, ...] = (),
        stop_token_ids: tuple[int, ...] = (),
        min_new_tokens: int = 0,
        pad_token_id: int | None = None,
        keep_logits: bool = False,
        prefill: str = "alone",
    ) -> list[Generation]:
        """:meth:`generate` for several prompts at once (each ``[1, T_i]`` or ``[T_i]``, lengths may
        differ): one :class:`Generation` per prompt, in order, each equal to that prompt's
        :meth:`generate` alone (tokens, stop, memory report; logits up to float rounding).

        The prompts are left-padded into one prefill forward; then greedy decoding, every step one
        batched forward through the method's decode step, with per-sequence stop (EOS, stop ids,
        stop strings, ``max_new_tokens``): a sequence that stops leaves the batch and its cache is
        no longer fed, so its storage is what it is alone. Each sequence has its own cache of the
        method (:meth:`new_batch_cache`, path ``per_sequence``, recorded as ``extra["batch_path"]``);
        ``prefill_s``/``decode_s`` are the whole batch's. :meth:`Method.new_request` is called once
        for the batch (every sequence plans the same ``max_new_tokens - 1`` stored tokens, as alone),
        :meth:`Method.end_request` once per sequence with its own cache. ``keep_logits``:
        ``extra["logits"]`` is the float32 ``[steps, vocab]`` of the logits that chose each token
        (the stop token's included), before the ``min_new_tokens`` rule.

        ``prefill``: ``alone`` (the default) prefills each prompt on its own (:meth:`prefill`: the
        batch-1 forward, shared across methods where declared) and joins the caches for the decode
        steps (:meth:`prefill_alone`), so each sequence's prefill and first token are its batch-1
        run's bit for bit and only the decode steps are batched; ``batch`` prefills the left-padded
        prompts in one forward (one weight read for all prompts, each row's arithmetic that of a
        padded batch)."""
        if prefill not in PREFILL_MODES:
            raise ValueError(f"prefill={prefill!r}: one of {', '.join(PREFILL_MODES)}")
        if prefill == "batch" and self.method.drives_prefill():
            raise ValueError(
                f"prefill='batch': {self.method.label()} runs each prompt's prefill itself "
                "(Method.drives_prefill), not as one padded forward; use prefill='alone'"
            )
        stops = self.eos_ids | set(stop_token_ids)
        self.method.new_request(max_new_tokens - 1)
        t0 = time.perf_counter()
        if prefill == "alone":
            cache, logits, lengths = self.prefill_alone(prompts)
            padded = max(lengths)
        else:
            input_ids, mask = self.pad_batch(prompts, pad_token_id)
            cache = self.new_batch_cache(input_ids.shape[0])
            cache.set_padding(mask)
            logits = self.forward(input_ids, cache)[:, -1]
            lengths, padded = mask.sum(dim=1).tolist(), input_ids.shape[1]
        prefill_s = time.perf_counter() - t0
        batch = len(lengths)
        tokens: list[list[int]] = [[] for _ in range(batch)]
        kept: list[list[torch.Tensor]] = [[] for _ in range(batch)]
        stopped = [False] * batch
        active = list(range(batch)) if max_new_tokens > 0 else []
        t0 = time.perf_counter()
        while active:
            if keep_logits:
                for r, s in enumerate(active):
                    kept[s].append(logits[r])
            barred = [r for r, s in enumerate(active) if len(tokens[s]) < min_new_tokens]
            if barred and stops:
                logits = logits.clone()
                rows = torch.tensor(barred, device=logits.device)[:, None]
                logits[rows, torch.tensor(sorted(stops), device=logits.device)[None, :]] = float("-inf")
            choices = logits.argmax(-1).tolist()  # one host sync per step for the whole batch
            going, feed = [], []
            for r, s in enumerate(active):
                nxt = choices[r]
                if nxt in stops:
                    stopped[s] = True
                    continue
                tokens[s].append(nxt)
                if stop_strings and any(x in self.tokenizer.decode(tokens[s]) for x in stop_strings):
                    stopped[s] = True
                    continue
                if len(tokens[s]) == max_new_tokens:
                    continue
                going.append(s)
                feed.append(nxt)
            if not going:
                break
            if going != active:
                cache.keep(going)
            active = going
            logits = self.decode_step(torch.tensor(feed)[:, None], cache)[:, -1]
        decode_s = time.perf_counter() - t0
        out = []
        for s in range(batch):
            text = self.tokenizer.decode(tokens[s], skip_special_tokens=True)
            for x in stop_strings:
                text = text.split(x)[0]
            sub = cache.sequences[s]
            memory = memory_report(sub.layers)
            self.method.end_request(sub)
            extra = {"batch_path": cache.path, "batch_size": batch, "padded_length": padded}
            if keep_logits:
                extra["logits"] = torch.stack(kept[s]) if kept[s] else torch.empty(0)
            prompt_tokens = int(lengths[s])
            out.append(
                Generation(text, tokens[s], prompt_tokens, stopped[s], memory, prefill_s, decode_s, extra)
            )
        return out

    @torch.no_grad()
    def prefill_alone(
        self, prompts: list[torch.Tensor]
    ) -> tuple[SequenceBatchCache, torch.Tensor, list[int]]:
        """Each prompt (``[1, T_i]`` or ``[T_i]``, ``T_i >= 1``) prefilled on its own into its own
        cache of the method (:meth:`prefill`), the caches joined into one
        :class:`~kvbench.cache.batch.SequenceBatchCache` for batched decode steps
        (:meth:`SequenceBatchCache.adopt_prefilled`). Returns ``(cache, logits [B, vocab] of each
        prompt's last position, prompt lengths)``. :meth:`Method.new_request` is the caller's."""
        rows = [torch.as_tensor(p).reshape(1, -1) for p in prompts]
        if not rows or any(r.shape[1] == 0 for r in rows):
            raise ValueError("a batch takes one or more prompts of at least one token each")
        cache = self.new_batch_cache(len(rows))  # every sequence's cache first, as a batch makes them
        logits = []
        for row, sub in zip(rows, cache.sequences, strict=True):
            logits.append(self.prefill(row, sub)[0, -1])
            self.method.prefilled_alone(sub)
        lengths = [r.shape[1] for r in rows]
        cache.adopt_prefilled(lengths)
        return cache, torch.stack(logits), lengths

    def stacked(self, cache: SequenceBatchCache) -> KVBenchCache | None:
        """The batch's sequences (each holding the same tokens) as one cache of B rows
        (:func:`kvbench.cache.stack.stack_sequences`), or None where the method's storage or hooks
        act per sequence: a method that drives its own step or reads each forward's outputs keeps
        the per-sequence path, as does a static (graph) step."""
        method = type(self.method)
        if method.decode_step is not Method.decode_step or method.after_forward is not Method.after_forward:
            return None
        if not declared(self.method, "stack_rows"):
            return None
        first = cache.sequences[0]
        if first.static:
            return None
        layers = stack_sequences([sub.layers for sub in cache.sequences])
        if layers is None:
            return None
        out = copy.copy(first)
        out.layers = layers
        out._returned = {}
        return out

    @torch.no_grad()
    def score_batch(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor]], chunk: int = 1, first: str = "prefill"
    ) -> list[Scored]:
        """:meth:`score` of several ``(context_ids [1, C], continuation_ids [1, N])`` pairs at once,
        every continuation of the same length N: each context prefilled alone
        (:meth:`prefill_alone`), then the continuations fed ``chunk`` tokens per forward as rows of
        one batch, each row through its own cache of the method. Each pair's scores equal its
        :meth:`score` alone up to the rounding of batched matrix products
        (tests/test_batched_decode.py); its ``seconds`` is the batch's time over the pairs."""
        n = check_scoring_pairs(pairs, first, "score_batch")
        t0 = time.perf_counter()
        self.method.new_request(n)
        scoring = _BatchScoring(pairs, first)
        cache, last, lengths = self.prefill_alone(scoring.stored)
        # equal lengths need no padding: the rows go into one cache of B rows where the method's
        # storage allows (kvbench.cache.stack), one attention call and one append per part
        stacked = self.stacked(cache) if len(set(lengths)) == 1 else None
        step_cache = stacked if stacked is not None else cache
        scoring.begin(last)
        for start, piece in scoring.pieces(chunk):
            if piece.shape[1] == 1:
                logits = self.decode_step(piece, step_cache)
            else:
                logits = self.forward(piece, step_cache)
            scoring.take(start, logits)
        seconds = (time.perf_counter() - t0) / len(pairs)
        if stacked is not None:  # each sequence's rows back into its own cache
            for sub, layers in zip(cache.sequences, split_sequences(stacked.layers, len(pairs)), strict=True):
                sub.layers = layers
        out = [scoring.scored(i, sub, self.method, seconds) for i, sub in enumerate(cache.sequences)]
        note_decode_step("eager")
        return out

    @torch.no_grad()
    def score(
        self,
        context_ids: torch.Tensor,
        continuation_ids: torch.Tensor,
        chunk: int = 1,
        first: str = "prefill",
    ) -> Scored:
        """Negative log-likelihood of each token of ``continuation_ids [1, N]`` after ``context_ids
        [1, C]`` (``C >= 1``), read through a fresh cache. The continuation is fed ``chunk`` tokens
        per forward, each forward reading everything before it from the cache; a one-token forward
        is a :meth:`decode_step`. The protocols differ in the first continuation token only:

        - ``first="prefill"`` (the perplexity task): the whole context is prefilled and the prefill's
          last logits predict continuation token 0; the continuation is then fed, its last token
          included (its logits are unused; it is stored as decoding would store it). Token 0 is
          predicted by a forward that attends its own tokens exactly, so it never reads the cache;
          tokens 1.. are predicted by forwards of the continuation tokens before them.
        - ``first="cache"`` (lm-eval's loglikelihood): the context less its last token is prefilled;
          the last context token and the continuation less its last token are fed, so that every
          continuation token, the first included, is predicted by a forward that reads the earlier
          tokens from the cache.

        Under ``chunk=1`` the two agree token for token where they make the same forwards: tokens
        1.. of ``first="prefill"`` are exactly ``first="cache"``'s scores of ``continuation[1:]``
        after ``context + continuation[:1]``."""
        if first not in SCORE_FIRST:
            raise ValueError(f"first={first!r}: one of {', '.join(SCORE_FIRST)}")
        if context_ids.shape[1] < 1:
            raise ValueError("scoring needs at least one context token")
        self.method.new_request(continuation_ids.shape[1])
        cache = self.new_cache()
        t0 = time.perf_counter()
        stored, fed = scoring_inputs(context_ids, continuation_ids, first)
        # "prefill": the logits predicting the first token of the next piece, carried between pieces
        pending = self.prefill(stored, cache)[:, -1:] if stored.shape[1] else None
        nll: list[float] = []
        greedy = True
        for start in range(0, continuation_ids.shape[1], chunk):
            piece = fed[:, start : start + chunk]
            target = continuation_ids[0, start : start + piece.shape[1]]
            logits = self.decode_step(piece, cache) if piece.shape[1] == 1 else self.forward(piece, cache)
            if first == "prefill":
                # logits predicting piece: the previous position's, then those of piece[:-1]
                step_logits = torch.cat([pending, logits], dim=1)
                pending = step_logits[:, -1:]
                logits = step_logits[:, :-1]
            logp = torch.log_softmax(logits[0], dim=-1)  # [c, vocab]
            target = target.to(logp.device)
            nll.extend((-logp.gather(-1, target[:, None])[:, 0]).tolist())
            greedy = greedy and bool((logp.argmax(-1) == target).all())
        memory = memory_report(cache.layers)
        self.method.end_request(cache)
        note_decode_step("eager")
        return Scored(nll, memory, time.perf_counter() - t0, greedy)


def joins_arm_batch(method: Method) -> bool:
    """Whether ``method``'s rows may share a batched forward with other methods' rows
    (:func:`score_arms`): it declares :attr:`Method.arm_batch` and runs its decode steps as plain
    forwards (a method that drives its own step, as SpeCache does, cannot share it)."""
    return declared(method, "arm_batch") and type(method).decode_step is Method.decode_step


@torch.no_grad()
def score_arms(
    runners: list[ModelRunner],
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    chunk: int = 1,
    first: str = "prefill",
) -> list[list[Scored]]:
    """:meth:`ModelRunner.score_batch` of the same ``pairs`` by every runner (one per arm of a
    sweep, all on one model), with every arm's rows in one batched forward: ``[A arms x P pairs]``
    rows, each through its own cache of its own method, so the weights are read once per chunk for
    all arms. Each arm's contexts are prefilled alone as its :meth:`~ModelRunner.prefill_alone`
    does (shared through :data:`kvbench.cache.prefill.SHARED_PREFILLS` where the method declares an
    FP16 prefill); each method's hooks see its own rows only (:meth:`Method.after_forward_batch`).
    A pair's scores equal those of its arm's :meth:`~ModelRunner.score_batch` up to the rounding of
    batched matrix products (tests/test_batched_decode.py states the tolerance). Returns one list of
    :class:`Scored` per runner, in the pairs' order; each row's ``seconds`` is the batch's time over
    all its rows."""
    if not runners or not pairs:
        raise ValueError("score_arms takes one or more runners and pairs")
    lead = runners[0]
    if any(r.model is not lead.model for r in runners):
        raise ValueError("score_arms: every arm's runner must be on the same model object")
    refused = [r.method.label() for r in runners if not joins_arm_batch(r.method)]
    if refused:
        raise ValueError(f"score_arms: {', '.join(refused)} cannot share a batched forward with other arms")
    n = check_scoring_pairs(pairs, first, "score_arms")
    t0 = time.perf_counter()
    arms, per_arm = len(runners), len(pairs)
    scoring = _BatchScoring(pairs, first, repeat=arms)
    caches, last, lengths = [], [], []
    for runner in runners:
        runner.method.new_request(n)
        arm, arm_last, arm_lengths = runner.prefill_alone(scoring.stored)
        caches += arm.sequences
        last.append(arm_last)
        lengths += arm_lengths
    cache = SequenceBatchCache(caches)
    cache.adopt_prefilled(lengths)
    scoring.begin(torch.cat(last))
    for start, piece in scoring.pieces(chunk):
        piece = piece.to(lead.device)
        logits, starts = padded_forward(lead.model, piece, cache, lead.device)
        for a, runner in enumerate(runners):
            own = slice(a * per_arm, (a + 1) * per_arm)
            runner.method.after_forward_batch(caches[own], piece[own], logits[own], starts[own])
        scoring.take(start, logits)
    seconds = (time.perf_counter() - t0) / len(caches)
    out = [
        [scoring.scored(i, caches[i], runner.method, seconds) for i in range(a * per_arm, (a + 1) * per_arm)]
        for a, runner in enumerate(runners)
    ]
    note_decode_step("eager")
    return out
