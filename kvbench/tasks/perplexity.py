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
- ``c4``: the first ``c4_documents`` documents (GPTQ uses 1100) of a C4 shard joined with single
  spaces, the GPTQ C4 evaluation text (GPTQ reads the ``en`` validation shard
  ``c4-validation.00000-of-00008.json.gz``). The shard is ``path`` when given, else that shard under
  ``<data_root>/c4/``, else the one ``c4-*`` file there (several: name one with ``path``); JSON lines
  (``.json.gz``, ``.json``, ``.jsonl``, ``.jsonl.gz``) or ``.parquet``, the ``text_field`` of each row.
  Only with no local shard is the Hub tried (``allenai/c4`` through ``datasets``), and not at all
  when ``HF_HUB_OFFLINE``/``TRANSFORMERS_OFFLINE`` is set or the Hub does not answer a 3-second
  probe: the ConfigError then comes at once and lists the local names accepted;
- ``text``: any corpus, the file ``path`` (required): ``.txt`` is read whole; JSON lines
  (``.jsonl``, ``.json``, gzipped or not) and ``.parquet`` give one document per row, the string in
  its ``text_field`` (default ``text``), joined with blank lines (``"\\n\\n"``, as GPTQ joins
  WikiText-2's rows). A relative ``path`` is looked for in the working directory, then under the data
  root. No header or footer is stripped: skip front matter with ``offset``.

Line endings are normalised to LF: a stray ``\\r`` per line would add trivially predictable tokens
and lower the perplexity. The text is tokenized once without special tokens, and
window ``i`` is tokens ``[s + i*W, s + (i+1)*W)`` with ``W = context_length + continuation_length``:
the first ``context_length`` are the context, the rest the continuation. ``s`` is where the windows
start, ``offset``: ``0`` (the default, the start of the text), an int N or ``"tokens:N"`` (skip the
first N tokens of the tokenized text), or ``"chars:N"`` (drop the first N characters of the LF text,
then tokenize the rest: a cut inside a word tokenizes that word's tail on its own).

BOS (``add_bos``): GPTQ's loaders, which KIVI and KVQuant's perplexity scripts reuse, tokenize the
whole joined text once and cut it into windows, so no window gets a BOS of its own (a Llama tokenizer
puts a single one at the head of the whole text, before window 0 only). This task has always left
BOS out of every window (task versions 1 and 2), so every window is scored alike; ``add_bos: false``,
the default, keeps that and every default number unchanged. ``add_bos: true`` puts the tokenizer's
BOS token in front of each window's context: the context is then BOS plus the same
``context_length`` text tokens, so the same continuation tokens are scored (``continuation_length``
per window either way; BOS itself is never scored) and the prompt is one token longer. A tokenizer
without a BOS token is a ConfigError.

Where the text came from is recorded with the run's metrics (``metrics.text``): dataset, each file
read (absolute path, bytes, sha256) or the Hub shard, offset, add_bos and the text's length.

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

from kvbench.config import check_choice, inert, is_int, require
from kvbench.data import (
    CORPUS_SUFFIXES,
    RECORD_SUFFIXES,
    corpus_suffix,
    encode_text,
    file_record,
    missing_file,
    read_documents,
    read_text,
    resolve_corpus_path,
)
from kvbench.errors import ConfigError
from kvbench.tasks.base import Metric, Task, TaskConfig, Work, check_batch_size, limited, register_task

DATASETS = ("wikitext2", "pg19", "c4", "text")
PATH_DATASETS = ("text", "c4")  # the datasets that read task.path
WIKITEXT_FILE = "wikitext2/wikitext-test.txt"
C4_SHARD = "c4-validation.00000-of-00008"
C4_HUB = ("allenai/c4", f"en/{C4_SHARD}.json.gz")
C4_ACCEPTED = (
    f"one c4-* file ending {', '.join(RECORD_SUFFIXES)} under <data_root>/c4/ ({C4_SHARD}.* first, "
    "GPTQ's shard), or task.path=FILE"
)
OFFSET_RE = re.compile(r"(tokens|chars):(\d+)")
OFFSET_ALLOWED = "a token count (an int >= 0), 'tokens:N' or 'chars:N' (N >= 0 characters of the text)"

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


def parse_offset(value: Any) -> tuple[str, int] | None:
    """``offset`` as (unit, count): an int is tokens; ``"tokens:N"`` or ``"chars:N"``. None when
    ``value`` is none of these."""
    if is_int(value):
        return ("tokens", value) if value >= 0 else None
    match = OFFSET_RE.fullmatch(value.strip()) if isinstance(value, str) else None
    return (match.group(1), int(match.group(2))) if match else None


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


def c4_local_file(data_root: Path, path: str | None = None) -> Path | None:
    """The local C4 shard: ``path`` (task.path) when given, else GPTQ's validation shard under
    ``<data_root>/c4/`` in any accepted format, else the only ``c4-*`` file there; None when there is
    none. Several other ``c4-*`` files and no validation shard 0 is a ConfigError: name one."""
    if path is not None:
        return resolve_corpus_path(path, data_root, "task.path")
    folder = Path(data_root) / "c4"
    if not folder.is_dir():
        return None
    for suffix in RECORD_SUFFIXES:
        if (folder / f"{C4_SHARD}{suffix}").is_file():
            return folder / f"{C4_SHARD}{suffix}"
    shards = sorted(p for p in folder.glob("c4-*") if p.is_file() and corpus_suffix(p) in RECORD_SUFFIXES)
    if len(shards) > 1:
        names = ", ".join(p.name for p in shards[:4]) + (", ..." if len(shards) > 4 else "")
        raise ConfigError(
            "task.path", None, f"{len(shards)} C4 shards under {folder} ({names}) and no {C4_SHARD}; name one"
        )
    return shards[0] if shards else None


def hub_c4_documents(n: int) -> list[str]:
    """The first ``n`` documents of the validation shard from the Hub (needs a network)."""
    import datasets

    repo, shard = C4_HUB
    rows = datasets.load_dataset(repo, data_files={"validation": shard}, split="validation")
    return list(rows.select(range(min(n, len(rows))))["text"])


def hub_unavailable() -> str | None:
    """Why the Hub cannot serve a dataset now, without waiting on huggingface_hub's retries (an
    offline switch, or no answer to a short probe); None when it may."""
    from kvbench.models.hub import hub_offline, hub_reachable

    if hub_offline():
        return "HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) is set"
    if not hub_reachable():
        return "the Hugging Face Hub does not answer"
    return None


def c4_documents(data_root: Path, n: int, path: str | None = None, field: str = "text") -> list[str]:
    """The first ``n`` C4 documents: the local shard, else the Hub, else a ConfigError at once."""
    local = c4_local_file(data_root, path)
    if local is not None:
        key = "task.path" if path is not None else "data.root"
        return read_documents(local, field, limit=n, key=key)
    no_local = f"no local C4 shard (accepted: {C4_ACCEPTED}; looked in {Path(data_root) / 'c4'})"
    why = hub_unavailable()
    if why is not None:
        raise ConfigError("task.dataset", "c4", f"{no_local}, and {why}, so {C4_HUB[0]} is not tried")
    try:
        return hub_c4_documents(n)
    except Exception as err:  # any failure to reach or read the Hub means: no C4 here
        raise ConfigError(
            "task.dataset",
            "c4",
            f"{no_local}, and loading {C4_HUB[0]} from the Hub failed ({type(err).__name__}); "
            "put a shard there or give the machine Hub access",
        ) from None


def text_file(data_root: Path, path: str | None) -> Path:
    """The file of ``dataset: text``: ``path`` resolved, with a format read_documents reads."""
    if path is None:
        raise ConfigError(
            "task.path", None, f"required with task.dataset=text: a {', '.join(CORPUS_SUFFIXES)} file"
        )
    return resolve_corpus_path(path, data_root, "task.path")


def data_file(
    data_root: Path, dataset: str, book: str | list[str] = "10146", path: str | None = None
) -> Path | None:
    """Check the text is available before any model work; ConfigError naming what is absent. Returns
    the file for wikitext2 and text, the first book for pg19, the local shard (or None: the Hub) for c4."""
    if dataset == "wikitext2":
        file = Path(data_root) / WIKITEXT_FILE
        if not file.is_file():
            raise _missing(data_root, file)
        return file
    if dataset == "pg19":
        return pg19_books(data_root, book)[0]
    if dataset == "text":
        return text_file(data_root, path)
    return c4_local_file(data_root, path)


def source_files(
    data_root: Path, dataset: str, book: str | list[str] = "10146", path: str | None = None
) -> list[Path] | None:
    """Every file the text is read from, in order (None: C4 from the Hub)."""
    if dataset == "pg19":
        return pg19_books(data_root, book)
    file = data_file(data_root, dataset, book, path)
    return None if file is None else [file]


def load_text(
    data_root: Path,
    dataset: str,
    book: str | list[str] = "10146",
    c4_docs: int = 1100,
    path: str | None = None,
    text_field: str = "text",
) -> str:
    """The evaluation text with LF line endings (for pg19, the book bodies only)."""
    if dataset == "c4":
        return to_lf(" ".join(c4_documents(data_root, c4_docs, path, text_field)))
    if dataset == "pg19":
        bodies = [to_lf(gutenberg_body(read_text(p), str(p))) for p in pg19_books(data_root, book)]
        return "\n\n".join(bodies)
    if dataset == "text":
        docs = read_documents(text_file(data_root, path), text_field, key="task.path")
        return to_lf("\n\n".join(docs))
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
    each forward feeds (1: strictly token by token, the decode-time access pattern).

    ``path`` is the corpus file of ``dataset: text`` (required there) or a C4 shard (optional);
    ``text_field`` the field or column of its rows. ``offset`` is where the windows start: an int
    (tokens), ``"tokens:N"`` or ``"chars:N"``. ``add_bos`` (default false: no BOS in any window, the
    GPTQ-style protocol this task has always followed, so default numbers do not change) puts the
    tokenizer's BOS in front of every window's context. See the module docstring for each."""

    name: str = "perplexity"
    version: int = 2
    dataset: str = "wikitext2"
    path: str | None = inert(None)
    text_field: str = inert("text")
    pg19_book: str | list[str] = "10146"
    c4_documents: int = 1100
    offset: int | str = inert(0)
    add_bos: bool = inert(False)
    context_length: int = 512
    continuation_length: int = 64
    windows: int = 4
    chunk: int = 1
    batch_size: int | str = "auto"

    def __post_init__(self):
        super().__post_init__()
        check_choice("task.dataset", self.dataset, DATASETS)
        check_batch_size(self.batch_size)
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
        require(parse_offset(self.offset) is not None, "task.offset", self.offset, OFFSET_ALLOWED)
        require(bool(self.text_field), "task.text_field", self.text_field, "a field (column) name")
        if self.path is not None:
            self.path = str(self.path)
            require(
                self.dataset in PATH_DATASETS,
                "task.path",
                self.path,
                f"read only with task.dataset={' or '.join(PATH_DATASETS)}; {self.dataset} is read "
                "from the data root",
            )
            allowed = CORPUS_SUFFIXES if self.dataset == "text" else RECORD_SUFFIXES
            require(
                corpus_suffix(self.path) in allowed,
                "task.path",
                self.path,
                f"unknown extension; allowed: {', '.join(allowed)}",
            )
        require(
            self.dataset != "text" or self.path is not None,
            "task.path",
            self.path,
            f"required with task.dataset=text: a {', '.join(CORPUS_SUFFIXES)} file",
        )


@register_task("perplexity")
class Perplexity(Task):
    Config = PerplexityConfig
    primary_metric = "ppl"
    metrics = {
        "ppl": Metric(False, "perplexity of the continuation tokens"),
        "nll_mean": Metric(False, "nats per continuation token"),
    }

    @classmethod
    def planned_samples(cls, config: PerplexityConfig) -> int:
        return limited(config.windows, config)

    @classmethod
    def sample_work(cls, config: PerplexityConfig) -> Work:
        # the continuation is scored ``chunk`` tokens per forward step
        context, cont = config.context_length, config.continuation_length
        return Work(context, math.ceil(cont / max(1, config.chunk)), context + cont / 2)

    def __init__(self, config: PerplexityConfig, data_root: Path, seed: int = 0):
        super().__init__(config, data_root, seed)
        self._ids: tuple[Any, list[int]] | None = None  # (tokenizer, token ids from the offset on)
        self._text: str | None = None
        self._source: dict[str, Any] | None = None

    @property
    def offset(self) -> tuple[str, int]:
        """``config.offset`` as (unit, count): ``("tokens", N)`` or ``("chars", N)``."""
        return parse_offset(self.config.offset)

    def text(self) -> str:
        """The whole evaluation text (LF line endings), before ``offset``."""
        if self._text is None:
            c = self.config
            self._text = load_text(
                self.data_root, c.dataset, c.pg19_book, c.c4_documents, c.path, c.text_field
            )
        return self._text

    def source(self) -> dict[str, Any]:
        """Where the text came from, as the run records it (``metrics.text``): the dataset, every
        file read (absolute path, bytes, sha256) or the Hub shard, the offset, add_bos, and the text's
        length in characters before the offset."""
        if self._source is None:
            c = self.config
            text = self.text()
            files = source_files(self.data_root, c.dataset, c.pg19_book, c.path)
            unit, count = self.offset
            self._source = {
                "dataset": c.dataset,
                "files": [file_record(f) for f in files] if files is not None else [],
                **({"hub": f"{C4_HUB[0]}:{C4_HUB[1]}"} if files is None else {}),
                **({"text_field": c.text_field} if c.dataset in PATH_DATASETS else {}),
                "offset": f"{unit}:{count}",
                "add_bos": c.add_bos,
                "chars": len(text),
            }
        return self._source

    def samples(self) -> list[dict[str, Any]]:
        c = self.config
        local = data_file(self.data_root, c.dataset, c.pg19_book, c.path)
        unit, count = self.offset
        # read the text now where it can fail on more than a missing file (its format or field, the
        # Hub, an offset past its end), before any model work
        if local is None or c.dataset in PATH_DATASETS or (unit == "chars" and count):
            self._text_from_offset()
        rows = [{"id": f"w{i}", "window": i} for i in range(self.config.windows)]
        return rows[: self.config.limit] if self.config.limit else rows

    def _text_from_offset(self) -> str:
        """The text to tokenize: all of it, or from character N on for ``offset: chars:N``."""
        unit, count = self.offset
        text = self.text()
        if unit != "chars":
            return text
        if count >= len(text):
            raise ConfigError(
                "task.offset", self.config.offset, f"past the end of the text ({len(text)} characters)"
            )
        return text[count:]

    def token_ids(self, tokenizer) -> list[int]:
        """The text tokenized once per tokenizer, without special tokens, from ``offset`` on."""
        if self._ids is None or self._ids[0] is not tokenizer:
            unit, count = self.offset
            ids = encode_text(tokenizer, self._text_from_offset())
            if unit == "tokens" and count:
                if count >= len(ids):
                    raise ConfigError(
                        "task.offset", self.config.offset, f"past the end of the text ({len(ids)} tokens)"
                    )
                ids = ids[count:]
            self._ids = (tokenizer, ids)
        return self._ids[1]

    def bos_id(self, tokenizer) -> int:
        """The tokenizer's BOS token id; a ConfigError on ``task.add_bos`` when it has none."""
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is None:
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ConfigError(
                "task.add_bos", True, f"the tokenizer ({name}) has no BOS token; set task.add_bos=false"
            )
        return bos

    def window_pairs(self, tokenizer) -> list[tuple[list[int], list[int]]]:
        """Every window's (context, continuation) token ids; with ``add_bos`` the context is BOS
        plus ``context_length`` text tokens."""
        c = self.config
        bos = [self.bos_id(tokenizer)] if c.add_bos else []
        ids = self.token_ids(tokenizer)
        try:
            pairs = split_windows(ids, c.context_length, c.continuation_length, c.windows)
        except ValueError as err:
            after = f" after task.offset={c.offset}" if self.offset[1] else ""
            raise ConfigError("task.windows", c.windows, f"{c.dataset} is too short{after}: {err}") from None
        return [(bos + context, continuation) for context, continuation in pairs]

    def check_model(self, shape, tokenizer) -> None:
        c = self.config
        limit = shape.max_context
        need = c.context_length + c.continuation_length + c.add_bos
        if limit and need > limit:
            terms = "context_length + continuation_length" + (" + 1 (add_bos)" if c.add_bos else "")
            raise ConfigError(
                "task.context_length",
                c.context_length,
                f"{terms} = {need} exceeds the model's {limit}-token context",
            )
        self.window_pairs(tokenizer)

    def prompt_lengths(self) -> list[int]:
        return [self.config.context_length + self.config.add_bos]

    def score(self, window: int, runner):
        """Window ``window`` scored through ``runner``'s cache: a :class:`kvbench.generate.Scored`."""
        context, continuation = self.window_pairs(runner.tokenizer)[window]
        ids = torch.tensor([context]), torch.tensor([continuation])
        return runner.score(*ids, chunk=self.config.chunk, first="prefill")

    def run(self, sample: dict[str, Any], runner) -> dict[str, Any]:
        context = self.window_pairs(runner.tokenizer)[sample["window"]][0]
        return self.row(len(context), self.score(sample["window"], runner))

    def run_batch(self, samples: list[dict[str, Any]], runner) -> list[dict[str, Any]]:
        """The windows' continuations scored as rows of one batch (:meth:`ModelRunner.score_batch`):
        each context prefilled alone, the continuations fed together."""
        if len(samples) == 1:
            return [self.run(samples[0], runner)]
        pairs = [self.window_pairs(runner.tokenizer)[s["window"]] for s in samples]
        ids = [(torch.tensor([c]), torch.tensor([n])) for c, n in pairs]
        scored = runner.score_batch(ids, chunk=self.config.chunk, first="prefill")
        return [self.row(len(c), s) for (c, _), s in zip(pairs, scored, strict=True)]

    @staticmethod
    def row(context_tokens: int, scored) -> dict[str, Any]:
        nll_mean = sum(scored.nll) / len(scored.nll)
        return {
            "prompt_tokens": context_tokens,
            "prediction": "",
            "nll_mean": nll_mean,
            "ppl": math.exp(nll_mean),
            "tokens": len(scored.nll),
            "memory": scored.memory,
            "seconds": scored.seconds,
        }

    def aggregate(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The corpus metrics (:func:`corpus_metrics`) and, under ``text``, :meth:`source`."""
        return {**corpus_metrics(rows), "text": self.source()}
