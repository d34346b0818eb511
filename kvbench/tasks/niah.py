"""``niah``: Greg Kamradt's Needle-in-a-Haystack, scored by key-phrase recall.

The haystack is the Paul Graham essays (``<data_root>/niah/PaulGrahamEssays/*.txt``) joined with
blank lines, repeated when a context needs more tokens than they hold. Their order is a shuffle
seeded by the run's ``seed`` (``haystack_order: seeded``), so runs under different seeds read
different text around the needle and multi-seed statistics rest on independent haystacks;
``haystack_order: sorted`` keeps the file-name order for every seed. For each (context length L,
depth d) the document is built in tokens of the model's own tokenizer:

1. Take the first ``L - buffer - len(needle)`` haystack tokens (as Kamradt does, the needle counts
   inside the ``L - buffer`` budget; ``buffer`` leaves room for the chat template, the question and
   the answer), and drop any trailing partial sentence so the document ends on a sentence end.
2. Insert the needle at ``d%`` of that span, moved back to the nearest preceding sentence end (a
   ``'.'`` token) so it never splits a sentence: d=0 puts it at the very beginning, d=100 at the very
   end.
3. Decode back to text and build the prompt (``chat_template``): in the chat template, a short
   system instruction, then a user turn holding the document followed by the question, with the
   generation prompt appended; or raw text, the same instruction, document and question followed by
   an ``Answer:`` cue, tokenized with the tokenizer's own special tokens (a BOS for Llama).
   ``chat_template: auto`` (default) uses the chat template when the tokenizer has one, else the raw
   prompt; ``on`` requires one (a tokenizer without it is an error before the weights load); ``off``
   always writes the raw prompt. Rows and metrics record which was used as ``prompt_format``
   (``chat`` or ``raw``).

The grid is either the explicit ``context_lengths`` x ``depths`` lists (``grid: explicit``) or
Kamradt's full grid (``grid: kamradt``): ``num_lengths`` context lengths evenly spaced from
``min_length`` to ``max_length`` (the model's context by default) and ``num_depths`` depths evenly
spaced over 0..100 %, each rounded to an integer as his harness does.

Decoding is greedy. The score is the fraction of the needle's key phrases ("eat a sandwich",
"Dolores Park", "sunny day") found in the answer, case-insensitively, in [0, 1]. There is no LLM
judge, so the score is reproducible; it rewards an answer that names the facts, not one that is fluent.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvbench.config import check_choice, inert, require
from kvbench.data import encode_text, missing_file, read_text
from kvbench.errors import ConfigError
from kvbench.tasks.base import (
    GENERATION_ROW_DTYPES,
    Metric,
    Task,
    TaskConfig,
    Work,
    check_batch_size,
    limited,
    register_task,
)

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
QUESTION = "What is the best thing to do in San Francisco?"
KEY_PHRASES = ("eat a sandwich", "Dolores Park", "sunny day")
SYSTEM_PROMPT = (
    "You answer questions about the document the user gives you. "
    "Answer in one short sentence, using only what the document says."
)
HAYSTACK_DIR = "niah/PaulGrahamEssays"


def needle_recall(answer: str, phrases: tuple[str, ...] = KEY_PHRASES) -> float:
    """Fraction of ``phrases`` found in ``answer``, ignoring case and runs of whitespace."""

    def norm(text: str) -> str:
        return " ".join(text.lower().split())

    answer = norm(answer)
    return sum(norm(p) in answer for p in phrases) / len(phrases)


def essay_order(names: list[str], seed: int | None) -> list[str]:
    """``names`` sorted, then (``seed`` not None) shuffled by a generator of that seed alone, so the
    order is the same on every machine and Python version for a given seed."""
    names = sorted(names)
    if seed is not None:
        random.Random(f"niah-haystack-{seed}").shuffle(names)
    return names


def load_haystack(data_root: Path, seed: int | None = None) -> str:
    """The essays in :func:`essay_order` (``seed=None``: by file name), joined with blank lines (the
    files end without a newline, and joining them bare would run one essay's last sentence into the
    next one's date)."""
    folder = Path(data_root) / HAYSTACK_DIR
    files = {f.name: f for f in folder.glob("*.txt")} if folder.is_dir() else {}
    if not files:
        raise missing_file(data_root, f"{HAYSTACK_DIR}/*.txt", "the NIAH haystack essays")
    return "\n\n".join(read_text(files[name]) for name in essay_order(list(files), seed))


def kamradt_grid(min_length: int, max_length: int, num_lengths: int, num_depths: int):
    """Kamradt's grid: ``num_lengths`` lengths evenly spaced over [min_length, max_length] and
    ``num_depths`` depths evenly spaced over [0, 100], both ends included, rounded to integers."""
    lengths = np.round(np.linspace(min_length, max_length, num_lengths)).astype(int).tolist()
    depths = np.round(np.linspace(0, 100, num_depths)).astype(int).tolist()
    return list(dict.fromkeys(lengths)), list(dict.fromkeys(depths))


def period_ids(tokenizer) -> set[int]:
    """Token ids that are a bare '.', the sentence end the needle may follow."""
    return set(tokenizer.encode(".", add_special_tokens=False))


def last_sentence_end(tokens: list[int], stop: int, periods: set[int]) -> int:
    """Largest ``i <= stop`` such that ``tokens[:i]`` is empty or ends with a period token."""
    i = stop
    while i > 0 and tokens[i - 1] not in periods:
        i -= 1
    return i


def insert_needle(haystack: list[int], needle: list[int], depth: float, periods: set[int]) -> list[int]:
    """``haystack`` token ids with ``needle`` inserted at ``depth`` percent of its length, moved back
    to the nearest preceding sentence end. Returns ``len(haystack) + len(needle)`` ids."""
    at = last_sentence_end(haystack, int(len(haystack) * depth / 100), periods)
    return haystack[:at] + needle + haystack[at:]


def build_context(
    haystack_ids: list[int], needle_ids: list[int], length: int, depth: float, periods
) -> list[int]:
    """The document of ``length`` tokens at most (needle included), ending on a sentence end."""
    span = haystack_ids[: max(length - len(needle_ids), 0)]
    span = span[: last_sentence_end(span, len(span), periods)]
    return insert_needle(span, needle_ids, depth, periods)


CHAT_TEMPLATE_MODES = ("auto", "on", "off")


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def prompt_format(mode: str, tokenizer, key: str = "task.chat_template") -> str:
    """``chat`` or ``raw``: what ``task.chat_template=mode`` (auto, on, off) makes of this tokenizer.
    ``on`` with a tokenizer that has no chat template is a ConfigError naming ``key``."""
    if mode == "off":
        return "raw"
    if has_chat_template(tokenizer):
        return "chat"
    if mode == "on":
        name = getattr(tokenizer, "name_or_path", None) or "this model"
        raise ConfigError(
            key,
            mode,
            f"auto or off: the tokenizer of {name} has no chat template (auto uses the raw prompt then)",
        )
    return "raw"


def raw_prompt(context: str, question: str = QUESTION) -> str:
    """The prompt as plain text, for a model without a chat template: the instruction, the
    document, the question, and an answer cue."""
    return f"{SYSTEM_PROMPT}\n\n{context}\n\nQuestion: {question}\nAnswer:"


def chat_prompt(tokenizer, context: str, question: str = QUESTION) -> str:
    """The chat-templated prompt text (special tokens written out), ending with the assistant turn."""
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"{context}\n\n{question}"},
    ]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@dataclass
class NIAHConfig(TaskConfig):
    """Context lengths are in tokens of the model's tokenizer and include the prompt template;
    depths are percentages of the document. ``grid: kamradt`` replaces ``context_lengths`` and
    ``depths`` by :func:`kamradt_grid` of the four ``*_length``/``num_*`` knobs."""

    name: str = "niah"
    version: int = 2
    grid: str = "explicit"
    context_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 3072])
    depths: list[float] = field(default_factory=lambda: [0, 50, 100])
    min_length: int = 1024
    max_length: int = 8192
    num_lengths: int = 8
    num_depths: int = 11
    haystack_order: str = "seeded"
    buffer: int = 200
    max_new_tokens: int = 32
    chat_template: str = inert("auto")
    batch_size: int | str = "auto"

    def __post_init__(self):
        super().__post_init__()
        check_choice("task.chat_template", self.chat_template, CHAT_TEMPLATE_MODES)
        check_batch_size(self.batch_size)
        require(self.buffer >= 0, "task.buffer", self.buffer, "an int >= 0")
        require(self.max_new_tokens > 0, "task.max_new_tokens", self.max_new_tokens, "a positive int")
        check_choice("task.grid", self.grid, GRIDS)
        check_choice("task.haystack_order", self.haystack_order, HAYSTACK_ORDERS)
        if self.grid == "kamradt":
            require(
                self.min_length > 0 and self.min_length > self.buffer,
                "task.min_length",
                self.min_length,
                f"an int above task.buffer={self.buffer}",
            )
            require(
                self.max_length >= self.min_length,
                "task.max_length",
                self.max_length,
                f"an int >= task.min_length={self.min_length}",
            )
            require(self.num_lengths > 0, "task.num_lengths", self.num_lengths, "a positive int")
            require(self.num_depths >= 2, "task.num_depths", self.num_depths, "an int >= 2")
            self.context_lengths, self.depths = kamradt_grid(
                self.min_length, self.max_length, self.num_lengths, self.num_depths
            )
        lengths = _as_list(self.context_lengths)
        require(
            bool(lengths) and all(n > 0 and n > self.buffer for n in lengths),
            "task.context_lengths",
            self.context_lengths,
            f"a non-empty list of ints, each above task.buffer={self.buffer}",
        )
        require(len(set(lengths)) == len(lengths), "task.context_lengths", lengths, "no repeated lengths")
        depths = _as_list(self.depths)
        require(
            bool(depths) and all(0 <= d <= 100 for d in depths),
            "task.depths",
            self.depths,
            "a non-empty list of percentages, each in 0..100",
        )
        require(len(set(depths)) == len(depths), "task.depths", depths, "no repeated depths")
        self.context_lengths, self.depths = lengths, depths


GRIDS = ("explicit", "kamradt")
HAYSTACK_ORDERS = ("seeded", "sorted")


def _as_list(x: Any) -> list | None:
    """A plain list from any sequence (an OmegaConf ListConfig included), else None."""
    return list(x) if isinstance(x, Sequence) and not isinstance(x, (str, bytes)) else None


def sample_id(length: int, depth: float) -> str:
    return f"L{length}_d{depth:g}"


@register_task("niah")
class NIAH(Task):
    Config = NIAHConfig
    primary_metric = "score"
    metrics = {"score": Metric(True, "fraction of the needle's key phrases recalled")}
    figures = {"niah_heatmap": "kvbench.analysis.niah:niah_heatmap"}
    row_dtypes = {**GENERATION_ROW_DTYPES, "context_length": "Int64", "depth": "Int64"}

    @classmethod
    def planned_samples(cls, config: NIAHConfig) -> int:
        return limited(len(config.context_lengths) * len(config.depths), config)

    @classmethod
    def sample_work(cls, config: NIAHConfig) -> Work:
        # the kamradt grid's mean length is taken as the midpoint of its range
        if config.grid == "kamradt":
            prompt = (config.min_length + config.max_length) / 2
        else:
            prompt = sum(config.context_lengths) / len(config.context_lengths)
        return Work(prompt, config.max_new_tokens, prompt)

    def __init__(self, config: NIAHConfig, data_root: Path, seed: int = 0):
        super().__init__(config, data_root, seed)
        # (tokenizer, its haystack ids): tokenizing 640 KB of essays takes a second or two, so it is
        # done once per tokenizer, not once per sample
        self._haystack: tuple[Any, list[int]] | None = None

    def haystack_seed(self) -> int | None:
        return self.seed if self.config.haystack_order == "seeded" else None

    def samples(self) -> list[dict[str, Any]]:
        load_haystack(self.data_root)  # fail before any model work when the data is missing
        rows = [
            {"id": sample_id(n, d), "context_length": n, "depth": d}
            for n in self.config.context_lengths
            for d in self.config.depths
        ]
        return rows[: self.config.limit] if self.config.limit else rows

    def check_model(self, shape, tokenizer) -> None:
        limit = shape.max_context
        too_long = [n for n in self.config.context_lengths if limit and n > limit]
        if too_long:
            raise ConfigError(
                "task.context_lengths",
                too_long,
                f"the model's context is {limit} tokens; use lengths <= {limit}",
            )
        prompt_format(self.config.chat_template, tokenizer)

    def prompt_lengths(self) -> list[int]:
        return list(self.config.context_lengths)

    def haystack_ids(self, tokenizer, n: int) -> list[int]:
        """At least ``n`` haystack token ids: the essays tokenized once, repeated as text if short."""
        if self._haystack is None or self._haystack[0] is not tokenizer or len(self._haystack[1]) < n:
            essays = load_haystack(self.data_root, self.haystack_seed())
            text = essays
            ids = encode_text(tokenizer, text)
            while len(ids) < n:
                text = f"{text}\n\n{essays}"
                ids = encode_text(tokenizer, text)
            self._haystack = (tokenizer, ids)
        return self._haystack[1]

    def prompt_format(self, tokenizer) -> str:
        """``chat`` or ``raw`` for this tokenizer under ``task.chat_template``."""
        return prompt_format(self.config.chat_template, tokenizer)

    def build_prompt(self, tokenizer, length: int, depth: float) -> str:
        """The full prompt text for one (context length, depth), in :meth:`prompt_format`."""
        budget = length - self.config.buffer
        needle = tokenizer.encode(NEEDLE, add_special_tokens=False)
        periods = period_ids(tokenizer)
        context = build_context(self.haystack_ids(tokenizer, budget), needle, budget, depth, periods)
        document = tokenizer.decode(context)
        if self.prompt_format(tokenizer) == "chat":
            return chat_prompt(tokenizer, document)
        return raw_prompt(document)

    def encode(self, tokenizer, prompt: str) -> torch.Tensor:
        """``input_ids [1, T]``: a chat prompt holds its special tokens in its text (they parse as
        such, and none are added); a raw prompt gets the tokenizer's own (a BOS for Llama)."""
        raw = self.prompt_format(tokenizer) == "raw"
        return tokenizer(prompt, return_tensors="pt", add_special_tokens=raw).input_ids

    def run(self, sample: dict[str, Any], runner) -> dict[str, Any]:
        input_ids = self.input_ids(sample, runner.tokenizer)
        gen = runner.generate(input_ids, self.config.max_new_tokens)
        return self.row(sample, runner.tokenizer, input_ids, gen)

    def run_batch(self, samples: list[dict[str, Any]], runner) -> list[dict[str, Any]]:
        """The samples decoded as rows of one batch (:meth:`ModelRunner.generate_batch`, each
        prompt prefilled alone)."""
        if len(samples) == 1:
            return [self.run(samples[0], runner)]
        ids = [self.input_ids(s, runner.tokenizer) for s in samples]
        gens = runner.generate_batch(ids, self.config.max_new_tokens, prefill="alone")
        return [self.row(s, runner.tokenizer, i, g) for s, i, g in zip(samples, ids, gens, strict=True)]

    def input_ids(self, sample: dict[str, Any], tokenizer) -> torch.Tensor:
        prompt = self.build_prompt(tokenizer, sample["context_length"], sample["depth"])
        return self.encode(tokenizer, prompt)

    def row(self, sample: dict[str, Any], tokenizer, input_ids: torch.Tensor, gen) -> dict[str, Any]:
        score = needle_recall(gen.text)
        return {
            "prompt_tokens": int(input_ids.shape[1]),
            "prediction": gen.text,
            "score": score,
            "prompt_format": self.prompt_format(tokenizer),
            "needle_recall": score,
            "context_length": sample["context_length"],
            "depth": sample["depth"],
            "generated_tokens": gen.new_tokens,
            "stopped": gen.stopped,
            "memory": gen.memory,
            "prefill_s": gen.prefill_s,
            "decode_s": gen.decode_s,
        }

    def aggregate(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Mean score over all rows, plus the mean per context length as ``score_L{n}``, and the
        ``prompt_format`` the rows were prompted in (``chat``, ``raw``, or ``mixed`` if a resumed
        run holds both)."""
        out: dict[str, Any] = super().aggregate(rows)
        formats = sorted({r["prompt_format"] for r in rows if r.get("prompt_format")})
        if formats:
            out["prompt_format"] = formats[0] if len(formats) == 1 else "mixed"
        by_length: dict[int, list[float]] = {}
        for r in rows:
            if r.get("score") is not None:
                by_length.setdefault(int(r["context_length"]), []).append(r["score"])
        for n, values in sorted(by_length.items()):
            out[f"score_L{n}"] = sum(values) / len(values)
        return out
