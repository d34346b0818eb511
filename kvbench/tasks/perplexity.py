"""``perplexity``: perplexity of a continuation read through the method's cache.

For each window the context is prefilled into a fresh cache of the method, then the continuation is
scored ``chunk`` tokens per forward (:meth:`kvbench.generate.ModelRunner.score`), every forward
reading all earlier tokens from the stored cache. A quantizing method therefore changes the score;
the usual sliding-window perplexity, which scores the prefill's own logits, would never read the
quantized cache at all. Only continuation tokens are scored.

Text: WikiText-2 raw test as GPTQ and KIVI use it (``wikitext2/wikitext-test.txt``: rows joined with
blank lines), or one PG-19 test book (``pg19/<book>.txt``, the Project Gutenberg file, of which the
body strictly between the ``*** START OF`` and ``*** END OF THE PROJECT GUTENBERG EBOOK`` lines is
used). Line endings are normalised to LF in both: a stray ``\\r`` per line would add trivially
predictable tokens and lower the perplexity. The text is tokenized once without special tokens, and
window ``i`` is tokens ``[i*W, (i+1)*W)`` with ``W = context_length + continuation_length``: the
first ``context_length`` are the context, the rest the continuation.

Lower is better. The task's ppl is ``exp`` of the mean nll over every scored token of every window
(the corpus perplexity), not the mean of per-window perplexities.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.config import check_choice, is_int, require
from kvbench.errors import ConfigError
from kvbench.tasks.base import Task, TaskConfig, register_task

DATASETS = ("wikitext2", "pg19")
WIKITEXT_FILE = "wikitext2/wikitext-test.txt"

# Marker lines, with or without a space after the asterisks, "THIS" or "THE"; a marker may wrap
# onto the next line (10146.txt's does), so the body starts after the line that closes it with "***"
START_RE = re.compile(r"^\*\*\* ?START OF (?:THE|THIS) PROJECT GUTENBERG EBOOK", re.MULTILINE)
END_RE = re.compile(r"^\*\*\* ?END OF (?:THE|THIS) PROJECT GUTENBERG EBOOK", re.MULTILINE)


def to_lf(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def gutenberg_body(text: str, source: str = "text") -> str:
    """The part of a Project Gutenberg file strictly between its START and END marker lines.

    Works on either line ending; the result keeps the input's. ``source`` names the file in errors.
    """
    start = START_RE.search(text)
    end = END_RE.search(text)
    if not start or not end or end.start() < start.end():
        raise ConfigError(
            "data.root", source, "not a Project Gutenberg file: START/END EBOOK markers missing"
        )
    close = text.find("***", start.end())  # the marker's closing asterisks, maybe a line further down
    if close < 0 or close > end.start():
        raise ConfigError("data.root", source, "the Project Gutenberg START marker is not closed by '***'")
    body_start = text.find("\n", close) + 1
    return text[body_start : end.start()]


def data_file(data_root: Path, dataset: str, book: str) -> Path:
    """Where the text lives under the data root; ConfigError naming the file when it is absent."""
    path = Path(data_root) / (WIKITEXT_FILE if dataset == "wikitext2" else f"pg19/{book}.txt")
    if not path.is_file():
        raise ConfigError("data.root", str(data_root), f"missing {path}; `make assets` fetches the data")
    return path


def load_text(data_root: Path, dataset: str, book: str = "10146") -> str:
    """The evaluation text with LF line endings (for pg19, the book body only)."""
    path = data_file(data_root, dataset, book)
    text = path.read_text(encoding="utf-8")
    if dataset == "pg19":
        text = gutenberg_body(text, str(path))
    return to_lf(text)


def split_windows(
    ids: list[int], context: int, continuation: int, n: int
) -> list[tuple[list[int], list[int]]]:
    """``n`` consecutive non-overlapping (context, continuation) pairs from the start of ``ids``.

    Pair ``i`` covers ``ids[i*W : (i+1)*W]`` with ``W = context + continuation``. Raises ValueError
    when ``ids`` is too short (callers turn it into a ConfigError on their own key)."""
    width = context + continuation
    if n * width > len(ids):
        raise ValueError(f"{len(ids)} tokens hold {len(ids) // width} windows of {width}, not {n}")
    return [
        (ids[i * width : i * width + context], ids[i * width + context : (i + 1) * width]) for i in range(n)
    ]


def corpus_metrics(rows: list[dict[str, Any]]) -> dict[str, float]:
    """ppl = exp(total nll / total tokens) over all rows; each row has ``nll_mean`` and ``tokens``."""
    rows = [r for r in rows if r.get("tokens")]
    total = sum(r["nll_mean"] * r["tokens"] for r in rows)
    count = sum(r["tokens"] for r in rows)
    if not count:
        return {"ppl": float("nan"), "nll_mean": float("nan"), "n": 0}
    return {"ppl": math.exp(total / count), "nll_mean": total / count, "n": len(rows)}


@dataclass
class PerplexityConfig(TaskConfig):
    """Lengths are in tokens of the model's tokenizer. ``chunk`` is how many continuation tokens
    each forward feeds (1: strictly token by token, the decode-time access pattern)."""

    name: str = "perplexity"
    version: int = 1
    dataset: str = "wikitext2"
    pg19_book: str = "10146"
    context_length: int = 512
    continuation_length: int = 64
    windows: int = 4
    chunk: int = 1

    def __post_init__(self):
        super().__post_init__()
        check_choice("task.dataset", self.dataset, DATASETS)
        self.pg19_book = str(self.pg19_book)  # Hydra reads a bare 10146 as an int
        require(self.pg19_book.isdigit(), "task.pg19_book", self.pg19_book, "a Project Gutenberg book number")
        for key in ("context_length", "continuation_length", "windows", "chunk"):
            value = getattr(self, key)
            ok = is_int(value) and value > 0
            require(ok, f"task.{key}", value, "a positive int")


@register_task("perplexity")
class Perplexity(Task):
    Config = PerplexityConfig
    primary_metric = "ppl"

    def __init__(self, config: PerplexityConfig, data_root: Path, seed: int = 0):
        super().__init__(config, data_root, seed)
        self._ids: tuple[Any, list[int]] | None = None  # (tokenizer, token ids of the whole text)

    def samples(self) -> list[dict[str, Any]]:
        data_file(self.data_root, self.config.dataset, self.config.pg19_book)  # fail before loading a model
        rows = [{"id": f"w{i}", "window": i} for i in range(self.config.windows)]
        return rows[: self.config.limit] if self.config.limit else rows

    def token_ids(self, tokenizer) -> list[int]:
        """The whole text tokenized once per tokenizer, without special tokens."""
        if self._ids is None or self._ids[0] is not tokenizer:
            text = load_text(self.data_root, self.config.dataset, self.config.pg19_book)
            self._ids = (tokenizer, tokenizer.encode(text, add_special_tokens=False))
        return self._ids[1]

    def window_pairs(self, tokenizer) -> list[tuple[list[int], list[int]]]:
        c = self.config
        ids = self.token_ids(tokenizer)
        try:
            return split_windows(ids, c.context_length, c.continuation_length, c.windows)
        except ValueError as err:
            raise ConfigError("task.windows", c.windows, f"{c.dataset} is too short: {err}") from None

    def check_model(self, shape, tokenizer) -> None:
        c = self.config
        limit = getattr(shape, "max_context", None)
        need = c.context_length + c.continuation_length
        if limit and need > limit:
            raise ConfigError(
                "task.context_length",
                c.context_length,
                f"context_length + continuation_length = {need} exceeds the model's {limit}-token context",
            )
        self.window_pairs(tokenizer)

    def run(self, sample: dict[str, Any], runner) -> dict[str, Any]:
        context, continuation = self.window_pairs(runner.tokenizer)[sample["window"]]
        scored = runner.score(torch.tensor([context]), torch.tensor([continuation]), chunk=self.config.chunk)
        nll_mean = sum(scored.nll) / len(scored.nll)
        return {
            "prompt_tokens": len(context),
            "prediction": "",
            "nll_mean": nll_mean,
            "ppl": math.exp(nll_mean),
            "tokens": len(scored.nll),
            "memory": scored.memory,
            "seconds": scored.seconds,
        }

    def aggregate(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        return corpus_metrics(rows)
