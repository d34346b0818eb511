"""``perplexity``: perplexity of a continuation read through the method's cache.

For each window the context is prefilled into a fresh cache of the method, then the continuation is
scored ``chunk`` tokens per forward by the shared scoring loop
(:meth:`kvbench.generate.ModelRunner.score`, ``first="prefill"``), every forward reading all earlier
tokens from the stored cache. A quantizing method therefore changes the score; the usual
sliding-window perplexity, which scores the prefill's own logits, would never read the quantized
cache at all. Only continuation tokens are scored: the first from the prefill's last logits (the one
prediction that reads no stored token), every later one from a forward of the token before it.

One-token forwards are the method's decode step, as in generation, so a method that drives its own
step is scored as it decodes: SpeCache's pre-decoding and speculative two-token forwards run here as
they do in ``generate``. With ``chunk: 1`` tokens 1.. of a window therefore score exactly as the
lm-eval adapter's ``loglikelihood`` of the continuation's tail after the context and its first token.
Only SpeCache's numbers changed when this loop began calling the decode step (before, its scored
forwards skipped the hook): with the task's defaults on the default model, speculative SpeCache went
from 16.69 to 18.33 at 1 bit and from 15.05 to 15.12 at 2 bits, with the same bytes held; its
non-speculative variant, and every other method, whose decode step is the plain forward, score
exactly as before. That change is task version 2, so a stored version-1 run is never resumed into
a version-2 one.

Text (``dataset``):

- ``wikitext2``: WikiText-2 raw test as GPTQ and KIVI use it (``wikitext2/wikitext-test.txt``:
  ``"\\n\\n".join(rows)``);
- ``pg19``: PG-19 test books (``pg19/<book>.txt``, Project Gutenberg files, of which the body strictly
  between the ``*** START OF`` and ``*** END OF THE PROJECT GUTENBERG EBOOK`` lines is used);
  ``pg19_book`` names one book, a list of books, or ``all`` (every ``pg19/*.txt``, by number), whose
  bodies are joined with blank lines in that order;
- ``c4``: the first ``c4_documents`` documents (GPTQ uses 1100) of the C4 ``en`` validation shard
  ``c4-validation.00000-of-00008.json.gz`` joined with single spaces, the GPTQ C4 evaluation text.
  The shard is read from ``<data_root>/c4/`` (``.json.gz`` or ``.json``/``.jsonl``, one JSON object
  with a ``text`` field per line); without it, from the Hub (``allenai/c4`` through ``datasets``),
  and a ConfigError says so when the Hub cannot be reached.

Line endings are normalised to LF: a stray ``\\r`` per line would add trivially predictable tokens
and lower the perplexity. The text is tokenized once without special tokens, and
window ``i`` is tokens ``[i*W, (i+1)*W)`` with ``W = context_length + continuation_length``: the
first ``context_length`` are the context, the rest the continuation.

Lower is better. The task's ppl is ``exp`` of the mean nll over every scored token of every window
(the corpus perplexity), not the mean of per-window perplexities.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.config import check_choice, require
from kvbench.data import missing_file, read_text
from kvbench.errors import ConfigError
from kvbench.tasks.base import Task, TaskConfig, register_task

DATASETS = ("wikitext2", "pg19", "c4")
WIKITEXT_FILE = "wikitext2/wikitext-test.txt"
C4_SHARD = "c4-validation.00000-of-00008"
C4_HUB = ("allenai/c4", f"en/{C4_SHARD}.json.gz")

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


def _missing(data_root: Path, path: Path) -> ConfigError:
    relpath = path.relative_to(data_root).as_posix()
    what = "the WikiText-2 test split" if relpath.startswith("wikitext2/") else "a PG-19 book"
    return missing_file(data_root, relpath, what)


def pg19_books(data_root: Path, book: str | list[str]) -> list[Path]:
    """The book files ``book`` names (one id, a list of ids, or ``all``), in that order."""
    folder = Path(data_root) / "pg19"
    if book == "all":
        paths = sorted(folder.glob("*.txt"), key=lambda p: (len(p.stem), p.stem)) if folder.is_dir() else []
        if not paths:
            raise _missing(data_root, folder / "*.txt")
        return paths
    paths = [folder / f"{b}.txt" for b in ([book] if isinstance(book, str) else book)]
    for path in paths:
        if not path.is_file():
            raise _missing(data_root, path)
    return paths


def c4_local_file(data_root: Path) -> Path | None:
    """The C4 validation shard under ``<data_root>/c4/``, if present."""
    folder = Path(data_root) / "c4"
    for suffix in (".json.gz", ".json", ".jsonl"):
        path = folder / f"{C4_SHARD}{suffix}"
        if path.is_file():
            return path
    return None


def read_c4_documents(path: Path, n: int) -> list[str]:
    """The ``text`` of the first ``n`` documents of a C4 shard (JSON lines, gzipped or not)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    docs = []
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    docs.append(json.loads(line)["text"])
                if len(docs) == n:
                    break
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        # a corrupt shard is a data problem, named as such, not a traceback from the JSON reader
        raise ConfigError(
            "data.root",
            str(path),
            f"a C4 shard of JSON lines with a text field; document {len(docs) + 1}: {err}",
        ) from None
    return docs


def hub_c4_documents(n: int) -> list[str]:
    """The first ``n`` documents of the validation shard from the Hub (needs a network)."""
    import datasets

    repo, shard = C4_HUB
    rows = datasets.load_dataset(repo, data_files={"validation": shard}, split="validation")
    return list(rows.select(range(min(n, len(rows))))["text"])


def c4_documents(data_root: Path, n: int) -> list[str]:
    """The first ``n`` C4 validation documents: the local shard, else the Hub, else a ConfigError."""
    local = c4_local_file(data_root)
    if local is not None:
        return read_c4_documents(local, n)
    try:
        return hub_c4_documents(n)
    except Exception as err:  # any failure to reach or read the Hub means: no C4 here
        raise ConfigError(
            "task.dataset",
            "c4",
            f"no {C4_SHARD}.json.gz under {Path(data_root) / 'c4'} and loading {C4_HUB[0]} from the Hub "
            f"failed ({type(err).__name__}); put the shard there or give the machine Hub access",
        ) from None


def data_file(data_root: Path, dataset: str, book: str | list[str]) -> Path | None:
    """Check the text is available before any model work; ConfigError naming what is absent. Returns
    the file for wikitext2, the first book for pg19, the local shard (or None: the Hub) for c4."""
    if dataset == "wikitext2":
        path = Path(data_root) / WIKITEXT_FILE
        if not path.is_file():
            raise _missing(data_root, path)
        return path
    if dataset == "pg19":
        return pg19_books(data_root, book)[0]
    return c4_local_file(data_root)


def load_text(data_root: Path, dataset: str, book: str | list[str] = "10146", c4_docs: int = 1100) -> str:
    """The evaluation text with LF line endings (for pg19, the book bodies only)."""
    if dataset == "c4":
        return to_lf(" ".join(c4_documents(data_root, c4_docs)))
    if dataset == "pg19":
        bodies = [to_lf(gutenberg_body(read_text(p), str(p))) for p in pg19_books(data_root, book)]
        return "\n\n".join(bodies)
    return to_lf(read_text(data_file(data_root, dataset, book)))


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
    version: int = 2
    dataset: str = "wikitext2"
    pg19_book: str | list[str] = "10146"
    c4_documents: int = 1100
    context_length: int = 512
    continuation_length: int = 64
    windows: int = 4
    chunk: int = 1

    def __post_init__(self):
        super().__post_init__()
        check_choice("task.dataset", self.dataset, DATASETS)
        if isinstance(self.pg19_book, (list, tuple)) or type(self.pg19_book).__name__ == "ListConfig":
            books = [str(b) for b in self.pg19_book]  # Hydra reads a bare 10146 as an int
            ok = bool(books) and all(b.isdigit() for b in books) and len(set(books)) == len(books)
            self.pg19_book = books
        else:
            self.pg19_book = str(self.pg19_book)
            ok = self.pg19_book.isdigit() or self.pg19_book == "all"
        require(
            ok, "task.pg19_book", self.pg19_book, "a Project Gutenberg book number, a list of them, or all"
        )
        for key in ("context_length", "continuation_length", "windows", "chunk", "c4_documents"):
            value = getattr(self, key)
            ok = value > 0
            require(ok, f"task.{key}", value, "a positive int")


@register_task("perplexity")
class Perplexity(Task):
    Config = PerplexityConfig
    primary_metric = "ppl"

    def __init__(self, config: PerplexityConfig, data_root: Path, seed: int = 0):
        super().__init__(config, data_root, seed)
        self._ids: tuple[Any, list[int]] | None = None  # (tokenizer, token ids of the whole text)
        self._text: str | None = None

    def text(self) -> str:
        if self._text is None:
            c = self.config
            self._text = load_text(self.data_root, c.dataset, c.pg19_book, c.c4_documents)
        return self._text

    def samples(self) -> list[dict[str, Any]]:
        c = self.config
        if data_file(self.data_root, c.dataset, c.pg19_book) is None:  # c4 from the Hub
            self.text()  # reach it now: fail before loading a model
        rows = [{"id": f"w{i}", "window": i} for i in range(self.config.windows)]
        return rows[: self.config.limit] if self.config.limit else rows

    def token_ids(self, tokenizer) -> list[int]:
        """The whole text tokenized once per tokenizer, without special tokens."""
        if self._ids is None or self._ids[0] is not tokenizer:
            self._ids = (tokenizer, tokenizer.encode(self.text(), add_special_tokens=False))
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
        limit = shape.max_context
        need = c.context_length + c.continuation_length
        if limit and need > limit:
            raise ConfigError(
                "task.context_length",
                c.context_length,
                f"context_length + continuation_length = {need} exceeds the model's {limit}-token context",
            )
        self.window_pairs(tokenizer)

    def prompt_lengths(self) -> list[int]:
        return [self.config.context_length]

    def score(self, window: int, runner):
        """Window ``window`` scored through ``runner``'s cache: a :class:`kvbench.generate.Scored`."""
        context, continuation = self.window_pairs(runner.tokenizer)[window]
        ids = torch.tensor([context]), torch.tensor([continuation])
        return runner.score(*ids, chunk=self.config.chunk, first="prefill")

    def run(self, sample: dict[str, Any], runner) -> dict[str, Any]:
        context = self.window_pairs(runner.tokenizer)[sample["window"]][0]
        scored = self.score(sample["window"], runner)
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
