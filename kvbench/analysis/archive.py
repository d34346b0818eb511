"""The per-sample archive behind committed results: the sample frame of one experiment, small
enough for git, from which ``make results`` regenerates every table, figure and claim verdict
without the run folders (``results/runs/`` is not committed) and without a model.

Layout, one folder per experiment node (runs outside any node go under ``adhoc-<task>``)::

    results/<experiment>/samples.csv.gz   one row per (run, sample): the frame of ``load_frame``
    results/<experiment>/archive.json     provenance: row and run counts, models, tasks, the runs
                                          left out and the repeated rows dropped, the csv's sha256

The CSV keeps every column of the frame, typed by a suffix on its header so that reading it back
gives the same frame (``pandas.testing.assert_frame_equal`` holds, floats bit for bit):

- ``name:float``: Python's shortest round-trip ``repr`` (empty = NaN);
- ``name:int`` / ``name:bool``: integers and booleans without missing values;
- ``name:str``: text without missing values, verbatim;
- ``name:strna``: text with missing values, one JSON string or ``null`` per cell;
- ``name:json``: anything else (lists, dicts such as ``method_config`` or ``hit_rates``, values
  mixed with None), one JSON document per cell with sorted keys.

Folder paths are stored relative to the runs root, so an archive does not carry the machine it was
written on. The gzip stream has no timestamp or file name, so an unchanged frame rewrites the same
bytes and git sees no change.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import math
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from kvbench import atomic
from kvbench.analysis.frame import _cluster, _differences, _flat, load_frame

ARCHIVE = "samples.csv.gz"
MANIFEST = "archive.json"
FORMAT = 1
_KINDS = ("float", "int", "bool", "str", "strna", "json")


def archive_name(experiment: Any, task: Any) -> str:
    """The results folder of an experiment's archive; ``adhoc-<task>`` for runs outside a node."""
    if isinstance(experiment, str) and experiment:
        return experiment
    return f"adhoc-{task}"


def _relative(path: Any, root: Path) -> Any:
    if not isinstance(path, str):
        return path
    try:
        return str(Path(path).relative_to(root))
    except ValueError:
        return path


def normalize(frame: pd.DataFrame, root: str | Path) -> pd.DataFrame:
    """The frame with its ``folder`` column and its ``superseded`` / ``duplicate_rows`` attributes
    relative to the runs ``root``: what an archive stores and what the results are built from."""
    root = Path(root)
    out = frame.copy()
    if "folder" in out:
        out["folder"] = [_relative(f, root) for f in out["folder"]]
    out.attrs = {
        "superseded": sorted(_relative(f, root) for f in frame.attrs.get("superseded", [])),
        "duplicate_rows": {
            _relative(f, root): int(n) for f, n in sorted(frame.attrs.get("duplicate_rows", {}).items())
        },
    }
    return out


def split(frame: pd.DataFrame) -> dict[str, pd.DataFrame]:
    """The frame split by experiment (``archive_name``), each part with a fresh index and only the
    attributes of its own runs."""
    if frame.empty:
        return {}
    names = [archive_name(e, t) for e, t in zip(frame["experiment"], frame["task"], strict=True)]
    parts = {}
    for name, sub in frame.groupby(pd.Series(names, index=frame.index), sort=True):
        part = sub.reset_index(drop=True)
        # Keep only the columns this experiment's runs filled (a column another task added is all
        # missing here), so the archive of one experiment does not depend on which others ran.
        part = part[[c for c in part.columns if not part[c].isna().all() or c in _ALWAYS]]
        folders = {str(Path(f).parent) for f in part["folder"]} if "folder" in part else set()
        part.attrs = {
            # A superseded run sits beside a kept run of its configuration (the same label folder).
            "superseded": [f for f in frame.attrs.get("superseded", []) if str(Path(f).parent) in folders],
            "duplicate_rows": {
                f: n
                for f, n in frame.attrs.get("duplicate_rows", {}).items()
                if f in set(part.get("folder", []))
            },
        }
        parts[name] = part
    return parts


# Identity columns stay even when empty (fp16-only experiments have no bits).
_ALWAYS = {"run_id", "experiment", "task", "model", "method", "method_name", "bits", "seed", "sample_id"}


def _kind(column: pd.Series) -> str:
    dtype = column.dtype
    if pd.api.types.is_bool_dtype(dtype):
        return "bool"
    if pd.api.types.is_integer_dtype(dtype):
        return "int"
    if pd.api.types.is_float_dtype(dtype):
        return "float"
    if isinstance(dtype, pd.StringDtype) or all(isinstance(v, str) for v in column):
        return "str" if column.notna().all() else "strna"
    return "json"


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"cannot archive a value of type {type(value).__name__}")


def _encode(value: Any, kind: str) -> str:
    if kind == "float":
        value = float(value)
        return "" if math.isnan(value) else repr(value)
    if kind in ("int", "bool"):
        return str(int(value)) if kind == "int" else ("true" if value else "false")
    if kind == "str":
        return value
    if kind == "strna" and not isinstance(value, str):
        return "null"
    return json.dumps(value, sort_keys=True, default=_plain)


def _decode(cells: list[str], kind: str) -> pd.Series:
    if kind == "float":
        return pd.Series([math.nan if c == "" else float(c) for c in cells], dtype="float64")
    if kind == "int":
        return pd.Series([int(c) for c in cells], dtype="int64")
    if kind == "bool":
        return pd.Series([c == "true" for c in cells], dtype="bool")
    if kind == "str":
        # Inferred, as load_frame's DataFrame constructor infers it (pandas' text dtype).
        return pd.Series(cells)
    if kind == "strna":
        return pd.Series([json.loads(c) for c in cells])
    return pd.Series([json.loads(c) for c in cells], dtype="object")


def to_csv_bytes(frame: pd.DataFrame) -> bytes:
    """The frame as typed CSV text (see the module docstring), UTF-8."""
    kinds = {c: _kind(frame[c]) for c in frame.columns}
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow([f"{c}:{kinds[c]}" for c in frame.columns])
    columns = [[_encode(v, kinds[c]) for v in frame[c]] for c in frame.columns]
    writer.writerows(zip(*columns, strict=True))
    return buffer.getvalue().encode()


def from_csv_bytes(data: bytes) -> pd.DataFrame:
    """The frame back from ``to_csv_bytes``; ValueError on a header without a known type suffix."""
    rows = list(csv.reader(io.StringIO(data.decode()), strict=True))
    if not rows:
        raise ValueError("empty archive: no header row")
    header, body = rows[0], rows[1:]
    names, kinds = [], []
    for cell in header:
        name, _, kind = cell.rpartition(":")
        if kind not in _KINDS or not name:
            raise ValueError(f"archive column {cell!r}: expected NAME:TYPE with TYPE in {', '.join(_KINDS)}")
        names.append(name)
        kinds.append(kind)
    cells = list(zip(*body, strict=True)) if body else [()] * len(names)
    data_ = {n: _decode(list(c), k) for n, k, c in zip(names, kinds, cells, strict=True)}
    return pd.DataFrame(data_, columns=names)


def _gzip(data: bytes) -> bytes:
    buffer = io.BytesIO()
    # mtime=0 and no file name: the same frame always compresses to the same bytes.
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0, compresslevel=9) as handle:
        handle.write(data)
    return buffer.getvalue()


class ArchiveError(ValueError):
    """An archive that cannot be read: one line naming the file and how to rewrite it."""


# What a user does about a damaged archive: rebuild it from the runs, or take the committed one.
REWRITE = (
    "rewrite it with `python -m kvbench.report --archive RUNS` from the run folders, "
    "or restore the committed copy with `git checkout -- results/`"
)


def _reason(err: BaseException) -> str:
    text = str(err).splitlines()[0] if str(err) else ""
    return f"{type(err).__name__}: {text[:200]}" if text else type(err).__name__


def write_archive(frame: pd.DataFrame, folder: str | Path) -> Path:
    """Write one experiment's frame as ``folder/samples.csv.gz`` with its ``archive.json``;
    returns the archive path."""
    folder = Path(folder)
    data = _gzip(to_csv_bytes(frame))
    path = folder / ARCHIVE
    # the archive first, its manifest last: a kill between the two leaves a new archive beside the
    # old manifest, which read_archive reports (checksum) instead of reading stale counts
    atomic.write_bytes(path, data)
    manifest = {
        "format": FORMAT,
        "rows": len(frame),
        "runs": int(frame["run_id"].nunique()) if "run_id" in frame else 0,
        "models": sorted(map(str, frame["model"].dropna().unique())) if "model" in frame else [],
        "tasks": sorted(map(str, frame["task"].dropna().unique())) if "task" in frame else [],
        "superseded": list(frame.attrs.get("superseded", [])),
        "duplicate_rows": dict(frame.attrs.get("duplicate_rows", {})),
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
    }
    atomic.write_text(folder / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return path


def read_archive(folder: str | Path) -> pd.DataFrame:
    """One experiment's frame from ``folder/samples.csv.gz``, with the attributes from its
    ``archive.json``. ValueError when the archive does not match the manifest's checksum."""
    folder = Path(folder)
    path, manifest_path = folder / ARCHIVE, folder / MANIFEST
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ArchiveError(f"{path}: unreadable ({_reason(err)}); {REWRITE}") from None
    try:
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    except (OSError, ValueError) as err:
        raise ArchiveError(f"{manifest_path}: unreadable ({_reason(err)}); {REWRITE}") from None
    if not isinstance(manifest, dict):
        raise ArchiveError(f"{manifest_path}: not a JSON object; {REWRITE}")
    if manifest.get("sha256") not in (None, hashlib.sha256(data).hexdigest()):
        raise ArchiveError(f"{path}: checksum differs from {manifest_path}; {REWRITE}")
    try:
        frame = from_csv_bytes(gzip.decompress(data))
    except (OSError, EOFError, zlib.error, UnicodeDecodeError, csv.Error, ValueError) as err:
        raise ArchiveError(f"{path}: corrupt or truncated archive ({_reason(err)}); {REWRITE}") from None
    frame.attrs = {
        "superseded": list(manifest.get("superseded", [])),
        "duplicate_rows": dict(manifest.get("duplicate_rows", {})),
    }
    return frame


# The order load_frame gives an experiment's rows (the key is the same whatever the runs root holds).
_ROW_ORDER = ["task", "model", "method", "seed", "sample_id"]


def _model_rows(frame: pd.DataFrame, models: set[str]) -> pd.DataFrame:
    """The rows of ``frame`` on ``models``, with only the columns they fill and the attributes of
    their own run folders (as ``split`` keeps them)."""
    part = frame[frame["model"].astype(str).isin(models)].reset_index(drop=True)
    part = part[[c for c in part.columns if not part[c].isna().all() or c in _ALWAYS]]
    folders = set(part["folder"]) if "folder" in part else set()
    parents = {str(Path(f).parent) for f in folders}
    part.attrs = {
        "superseded": [f for f in frame.attrs.get("superseded", []) if str(Path(f).parent) in parents],
        "duplicate_rows": {f: n for f, n in frame.attrs.get("duplicate_rows", {}).items() if f in folders},
    }
    return part


def merge_models(new: pd.DataFrame, old: pd.DataFrame) -> pd.DataFrame:
    """One experiment's archive frame after new runs: ``new``'s rows for every model it holds, and
    ``old``'s rows for the models it does not (an archive is replaced model by model, so archiving
    the runs of one model keeps the other models' stored results). The parts are joined in model
    order and the rows sorted as ``load_frame`` sorts them, so the frame is the same whichever
    model's runs came last: the one a runs root holding both would give."""
    if old is None or old.empty or "model" not in old or "model" not in new:
        return new
    kept = set(map(str, old["model"].dropna().unique())) - set(map(str, new["model"].dropna().unique()))
    if not kept:
        return new
    parts = [(str(m), _model_rows(new, {str(m)})) for m in new["model"].dropna().unique()]
    parts += [(m, _model_rows(old, {m})) for m in kept]
    parts.sort(key=lambda p: p[0])
    frame = pd.concat([p for _, p in parts], ignore_index=True, sort=False)
    frame = frame.sort_values(_ROW_ORDER, kind="stable").reset_index(drop=True)
    frame.attrs = {
        "superseded": sorted(f for _, p in parts for f in p.attrs["superseded"]),
        "duplicate_rows": dict(
            sorted((f, n) for _, p in parts for f, n in p.attrs["duplicate_rows"].items())
        ),
    }
    return frame


def add_runs(new: pd.DataFrame, old: pd.DataFrame | None) -> pd.DataFrame:
    """One experiment's archive frame after adding runs to it: ``old``'s rows of every run that
    ``new`` does not hold (a run is its ``folder``: the same configuration reruns into the same
    folder), then ``new``'s rows, for every model. For arms added to a node whose other runs are
    stored only in the archive (a second model's column, whose runs took hours): archiving the new
    runs alone would otherwise replace that model's rows by them (``merge_models``).

    The method labels are made again over the union, as ``load_frame`` makes them over one runs
    root: runs of one (task, model, experiment, label) whose method nodes differ get the knobs that
    differ as a ``[knob=value,...]`` suffix, so a run that was alone under its label and now has a
    sibling is told apart from it. Runs are taken in the order of their rows' count (largest first),
    as a runs root holding them all would take them, up to ties."""
    if old is None or old.empty:
        return new
    replaced = set(new["folder"]) if "folder" in new else set()
    kept = old[~old["folder"].isin(replaced)] if "folder" in old else old
    frame = pd.concat([kept, new], ignore_index=True, sort=False)
    # load_frame's unit of labelling: (task, model, experiment, task variant, label)
    key = [k for k in ("task", "model", "experiment", "variant") if k in frame]
    runs: dict[Any, dict[str, Any]] = {}
    for folder, rows in frame.groupby("folder", sort=True):
        first = rows.iloc[0]
        label = str(first["method"])
        flat = _flat(first["method_config"] if isinstance(first["method_config"], dict) else {}, "method")
        # The stored label carries the suffix of the archive it came from: take the part before it.
        stored = label.rsplit("[", 1)
        base = stored[0] if label.endswith("]") and len(stored) == 2 else label
        runs[folder] = {
            "unit": tuple(str(first[k]) for k in key),
            "base": base,
            "method_flat": flat,
            "seed": first["seed"],
            "n_rows": len(rows),
            "mtime": int(folder in replaced),  # a new run before a stored one of the same size
            "folder": folder,
        }
    labels: dict[Any, str] = {}
    superseded: set[str] = set()
    by_group: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs.values():
        by_group.setdefault((*run["unit"], run["base"]), []).append(run)
    for (*_, base), members in by_group.items():
        clusters = _cluster(members, "method_flat")
        for cluster, suffix in zip(clusters, _differences(clusters, "method_flat", "method."), strict=True):
            seen_seeds: set[Any] = set()
            for run in cluster:
                # one run per configuration and seed, the fullest and newest, as load_frame keeps
                if run["seed"] in seen_seeds:
                    superseded.add(run["folder"])
                seen_seeds.add(run["seed"])
                labels[run["folder"]] = base + (f"[{suffix}]" if suffix else "")
    frame = frame[~frame["folder"].isin(superseded)].copy()
    frame["method"] = [labels.get(f, m) for f, m in zip(frame["folder"], frame["method"], strict=True)]
    frame = frame.sort_values(_ROW_ORDER, kind="stable").reset_index(drop=True)
    frame.attrs = {
        "superseded": sorted(
            set(old.attrs.get("superseded", [])) | set(new.attrs.get("superseded", [])) | superseded
        ),
        "duplicate_rows": {**old.attrs.get("duplicate_rows", {}), **new.attrs.get("duplicate_rows", {})},
    }
    return frame


def write_archives(runs_root: str | Path, results: str | Path, add: bool = False) -> dict[str, Path]:
    """Every run under ``runs_root`` into one archive per experiment under ``results``; returns
    ``{experiment: archive path}`` (empty when there are no runs). Within an experiment the runs
    replace the archive's rows of their models only: another model's stored rows are kept
    (``merge_models``), so a clean clone that reruns the default model's nodes keeps the second
    model's column. ``add``: the runs are added to the archive's runs instead (``add_runs``), for
    new arms of a node whose other runs are stored only in the archive."""
    runs_root = Path(runs_root)
    frame = normalize(load_frame(runs_root), runs_root)
    if Path(results).is_dir():
        atomic.remove_stale_temporaries(results)
    written = {}
    for name, part in split(frame).items():
        folder = Path(results) / name
        try:
            old = read_archive(folder) if (folder / ARCHIVE).is_file() else None
        except ArchiveError:
            old = None  # a damaged archive holds nothing to keep: rewritten from the runs alone
        written[name] = write_archive(add_runs(part, old) if add else merge_models(part, old), folder)
    return written


def load_archives(results: str | Path) -> dict[str, pd.DataFrame]:
    """``{experiment: frame}`` for every ``results/*/samples.csv.gz``, by folder name."""
    return {
        path.parent.name: read_archive(path.parent) for path in sorted(Path(results).glob(f"*/{ARCHIVE}"))
    }


def frames_from_runs(runs_root: str | Path) -> dict[str, pd.DataFrame]:
    """What ``load_archives`` would return after ``write_archives(runs_root, ...)``, straight from the
    run folders (the frames the archive stores, before any writing)."""
    runs_root = Path(runs_root)
    return split(normalize(load_frame(runs_root), runs_root))


# what a rerun may change without computing anything differently: the clock, where it ran and the
# node's analysis plan (its grid placement and test settings are read from the node, not measured)
_TIMING = ("seconds", "time", "latency", "per_s", "throughput", "folder")
_NOT_MEASURED = ("plan_", "grid_value")


def compare_runs(runs_root: str | Path, results: str | Path) -> pd.DataFrame:
    """Every run under ``runs_root`` against the archived rows of the same (experiment, model,
    method, seed, sample): one row per configuration with its rows, how many the archive holds, how
    many agree in every measured float column (timings, paths and the plan left out) and in the
    generated text, and the largest absolute difference of a float; ``differs`` names the columns
    that do not agree, each with its count of rows. A rerun of a committed node reproduces it when
    every row is matched and identical."""
    keys = ["model", "method", "seed", "sample_id"]
    rows = []
    archives = load_archives(results)
    for name, new in frames_from_runs(runs_root).items():
        old = archives.get(name)
        for (model, method), part in new.groupby(["model", "method"], sort=True):
            row = {"experiment": name, "model": model, "method": method, "rows": len(part)}
            theirs = None if old is None else old[(old["model"] == model) & (old["method"] == method)]
            if theirs is None or theirs.empty:
                rows.append(row | {"archived": 0, "identical": 0, "max_abs_diff": math.nan, "differs": ""})
                continue
            columns = [
                c
                for c in part.columns
                if c in theirs.columns
                and c not in keys
                and (pd.api.types.is_float_dtype(part[c]) or c == "prediction")
                and not any(t in c for t in _TIMING)
                and not c.startswith(_NOT_MEASURED)
            ]
            both = part[keys + columns].merge(theirs[keys + columns], on=keys, suffixes=("", "@archive"))
            same = pd.Series(True, index=both.index)
            worst, differs = 0.0, []
            for c in columns:
                if c == "prediction":
                    equal = (both[c].fillna("") == both[f"{c}@archive"].fillna("")).to_numpy()
                else:
                    a, b = both[c].to_numpy(float), both[f"{c}@archive"].to_numpy(float)
                    equal = (a == b) | (np.isnan(a) & np.isnan(b))
                    if not equal.all():
                        worst = max(worst, float(np.nanmax(np.abs(a - b))))
                same &= equal
                if not equal.all():
                    differs.append(f"{c} ({int((~equal).sum())})")
            rows.append(
                row
                | {
                    "archived": len(both),
                    "identical": int(same.sum()),
                    "max_abs_diff": worst,
                    "differs": ", ".join(differs),
                }
            )
    return pd.DataFrame(
        rows,
        columns=["experiment", "model", "method", "rows", "archived", "identical", "max_abs_diff", "differs"],
    )
