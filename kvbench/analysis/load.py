"""One call for every stored result: the committed archives and run folders alike, as one typed
pandas DataFrame.

    from kvbench.analysis import load_results

    df = load_results()                                  # the checkout's results/ (committed archives)
    df = load_results("results", experiment="semkv_cliff")
    df = load_results("results/runs")                    # run folders, searched recursively
    df.groupby(["experiment", "method"])["score"].mean()

What ``path`` may be, tried in this order:

- an archive file ``.../samples.csv.gz`` or an experiment folder holding one: that experiment;
- a folder of experiment folders (``results/``: ``results/<experiment>/samples.csv.gz``): all of
  them, or those named in ``experiment``;
- anything else: every run folder under it (``config.json`` + ``samples.jsonl``, see
  :func:`kvbench.analysis.frame.load_frame`), filtered by ``experiment`` when given.

Archives take precedence: a ``results/`` folder that holds both archives and ``runs/`` gives the
archives; point at ``results/runs`` for the runs. Either way the frame has one row per (run,
sample), the columns of :func:`~kvbench.analysis.frame.load_frame` under their plain names
(``run_id``, not the archive header's ``run_id:str``), and the dtypes the runs wrote (floats,
ints, bools, text; ``method_config`` and other nested fields as dicts). Experiments that do not
share a column leave it missing in the others' rows: integer and boolean columns become pandas'
nullable ``Int64`` / ``boolean`` there, not floats. The row fields a task declares whole numbers
or flags (``Task.row_dtypes``: ``context_length``, ``depth``, ``generated_tokens`` as ``Int64``,
``stopped`` as ``boolean``) have those nullable dtypes always, from archives and run folders alike
(an archive stores such a column with gaps as floats or JSON, a run folder of one task as
``int64``/``bool``: the same column would otherwise change dtype with its source).
``frame.attrs`` carries the runs left out (``superseded``) and the repeated rows dropped
(``duplicate_rows``).

Nothing found is a warning (:class:`NoResultsWarning`, naming the folder and what was looked for)
and an empty frame that still has the identity columns, so ``df["experiment"]`` never raises.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pandas as pd

from kvbench import paths
from kvbench.analysis.archive import ARCHIVE, archive_name, normalize, read_archive, split
from kvbench.analysis.frame import IDENTITY_COLUMNS, load_frame


class NoResultsWarning(UserWarning):
    """``load_results`` found no archive and no run folder where it looked."""


def _names(experiment: str | Iterable[str] | None) -> set[str] | None:
    if experiment is None:
        return None
    return {experiment} if isinstance(experiment, str) else set(experiment)


def _archive_folders(path: Path, wanted: set[str] | None) -> list[Path] | None:
    """The experiment folders to read as archives, or None when ``path`` holds no archive."""
    if path.is_file() and path.name == ARCHIVE:
        return [path.parent]
    if (path / ARCHIVE).is_file():
        return [path]
    found = sorted(p.parent for p in path.glob(f"*/{ARCHIVE}"))
    if not found:
        return None
    return [f for f in found if wanted is None or f.name in wanted]


def _concat(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """Stack per-experiment frames. A column absent from some of them would turn ints into floats
    and bools into objects: those columns take pandas' nullable dtypes instead."""
    if len(parts) == 1:
        return parts[0]
    frame = pd.concat(parts, ignore_index=True, sort=False)
    for column in frame.columns:
        holders = [p[column] for p in parts if column in p.columns]
        if len(holders) == len(parts) or not frame[column].isna().any():
            continue
        if all(pd.api.types.is_bool_dtype(h) for h in holders):
            frame[column] = frame[column].astype("boolean")
        elif all(pd.api.types.is_integer_dtype(h) for h in holders):
            frame[column] = frame[column].astype("Int64")
    frame.attrs = {
        "superseded": sorted(f for p in parts for f in p.attrs.get("superseded", [])),
        "duplicate_rows": {f: n for p in parts for f, n in p.attrs.get("duplicate_rows", {}).items()},
    }
    return frame


def _empty(path: Path, looked_for: str) -> pd.DataFrame:
    warnings.warn(f"kvbench: no results under {path}: {looked_for}", NoResultsWarning, stacklevel=4)
    frame = pd.DataFrame(
        {c: pd.Series(dtype="float64" if c == "bits" else "object") for c in IDENTITY_COLUMNS}
    )
    frame.attrs = {"superseded": [], "duplicate_rows": {}}
    return frame


def _whole(value) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and float(value).is_integer()


def _declared_dtypes(frame: pd.DataFrame) -> pd.DataFrame:
    """``frame`` with each column a task declares (:func:`kvbench.tasks.declared_row_dtypes`) in
    its declared nullable dtype, missing values as ``<NA>``. A column whose values do not fit (a
    fraction in a whole-number column, text in a flag column) is left as it is."""
    from kvbench.tasks import declared_row_dtypes

    fits = {"Int64": _whole, "boolean": lambda v: isinstance(v, (bool, np.bool_))}
    for column, dtype in declared_row_dtypes().items():
        if column not in frame.columns or str(frame[column].dtype) == dtype or dtype not in fits:
            continue
        values = [None if _missing(v) else v for v in frame[column]]
        if not all(v is None or fits[dtype](v) for v in values):
            continue
        cast = [v if v is None else (int(v) if dtype == "Int64" else bool(v)) for v in values]
        frame[column] = pd.array(cast, dtype=dtype)
    return frame


def _missing(value) -> bool:
    return value is None or value is pd.NA or (isinstance(value, (float, np.floating)) and np.isnan(value))


def load_results(
    path: str | Path | None = None, experiment: str | Iterable[str] | None = None
) -> pd.DataFrame:
    """Every stored sample under ``path`` (default: the checkout's ``results/``, see
    :func:`kvbench.paths.default_results`) as one DataFrame, from archives or run folders (see the
    module docstring). ``experiment``: one experiment name or several, to read only those.
    FileNotFoundError when ``path`` does not exist; a :class:`NoResultsWarning` and an empty frame
    when it holds nothing (or nothing of the experiments named)."""
    frame = _load(path, experiment)
    return _declared_dtypes(frame) if not frame.empty else frame


def _load(path: str | Path | None, experiment: str | Iterable[str] | None) -> pd.DataFrame:
    """:func:`load_results` before the declared dtypes: each source's own dtypes."""
    path = Path(path) if path is not None else paths.default_results()
    if not path.exists():
        raise FileNotFoundError(
            f"kvbench: {path}: no such file or folder (a results/ folder, or a folder of runs)"
        )
    wanted = _names(experiment)
    folders = _archive_folders(path, wanted)
    if folders is not None:
        known = sorted(p.parent.name for p in path.glob(f"*/{ARCHIVE}")) if path.is_dir() else []
        missing = sorted((wanted or set()) - {f.name for f in folders}) if known else []
        if missing:
            message = f"no archive of {', '.join(missing)} (archived experiments: {', '.join(known)})"
            if len(missing) == len(wanted or ()):
                return _empty(path, message)
            warnings.warn(f"kvbench: under {path}: {message}", NoResultsWarning, stacklevel=3)
        parts = [part for part in (read_archive(f) for f in folders) if not part.empty]
        if not parts:
            return _empty(path, f"the archives there hold no rows ({', '.join(f.name for f in folders)})")
        return _concat(parts)
    frame = load_frame(path)
    if frame.empty:
        return _empty(path, f"no {ARCHIVE} archive and no run folder (config.json + samples.jsonl)")
    if wanted is not None:
        names = [archive_name(e, t) for e, t in zip(frame["experiment"], frame["task"], strict=True)]
        keep = [n in wanted for n in names]
        if not any(keep):
            return _empty(path, f"no runs of {', '.join(sorted(wanted))}")
        attrs = frame.attrs
        frame = frame[keep].reset_index(drop=True)
        frame.attrs = attrs
    return frame


def load_experiments(path: str | Path | None = None) -> dict[str, pd.DataFrame]:
    """``{experiment: frame}``: what :func:`load_results` reads, split by experiment (runs outside any
    node under ``adhoc-<task>``), each part holding only its own columns, as the archives store
    them: what :mod:`kvbench.analysis.claims` and :mod:`kvbench.analysis.papers` read. Empty, with a
    :class:`NoResultsWarning`, when nothing is found."""
    path = Path(path) if path is not None else paths.default_results()
    if path.exists():
        folders = _archive_folders(path, None)
        if folders:
            return {f.name: read_archive(f) for f in folders}
    frame = _load(path, None)  # split parts keep the dtypes the archives store
    return split(normalize(frame, path)) if not frame.empty else {}
