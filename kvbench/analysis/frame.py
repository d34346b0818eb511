"""Every stored sample of every run under a folder, as one pandas DataFrame.

One row per (run, sample): the run's identity (run id, folder, task, model, method label, method
name, bits, seed), the run's whole method node (``method_config``, a dict: what claims select their
arms by), the experiment's analysis plan (``config.json``'s ``analysis`` block, if any),
the per-sample scores, the generation fields the runaway rate needs (prediction, stopped,
generated tokens, the task's ``max_new_tokens``) and the per-sample memory accounting flattened
(``effective_bits``, ``code_bits``, ...). A run folder is any folder holding ``config.json`` and
``samples.jsonl``; ``metrics.json`` is optional (an unfinished run contributes its finished rows
and ``finished`` is False).

The same method label can be stored under several run ids: when a knob was added later (the
old run lacks it, the new one holds its default), which is the same configuration run twice, or
when an experiment's arms differ in a knob the label does not show, which are different
configurations. ``load_frame`` tells them apart by comparing the runs' method and task nodes on
the keys they share (see ``load_frame``): pairing needs exactly one row per (sample_id, seed) per
configuration.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench.env import get_logger
from kvbench.results import RunFolder
from kvbench.sweep import sweep_run_folders

# The plan's keys (see the experiment nodes' ``analysis:`` block) and their defaults.
PLAN_DEFAULTS: dict[str, Any] = {
    "name": None,
    "reference": "fp16",
    "metric": None,  # None: the task's primary metric
    "alpha": 0.05,
    "margin": None,  # None: no equivalence margin declared, so no TOST
    "n": None,
    "seeds": None,
    "grid": None,
    "grid_key": "bits",
}

IDENTITY_COLUMNS = [
    "run_id",
    "experiment",
    "task",
    "model",
    "method",
    "method_name",
    "bits",
    "seed",
    "sample_id",
]

# Row fields that are bookkeeping, not scores.
_NOT_METRICS = {
    "sample_id",
    "seed",
    "task",
    "model",
    "method",
    "bits",
    "prediction",
    "stopped",
    "generated_tokens",
    "memory",
    "seconds",
    "prefill_s",
    "decode_s",
    "prompt_tokens",
}


def higher_is_better(metric: str, task: str | None = None) -> bool:
    """Whether a larger value of ``metric`` is better, as the task that reports it declares
    (``Task.metrics``; ``task`` None: whichever registered task declares it). A dotted path into a
    dict column (``rel_err_by_layer.4``) goes the way of its column; a metric no task declares
    (``effective_bits``, a method's own statistic) is higher-is-better."""
    from kvbench.tasks import declared_metric

    declared = declared_metric(metric, task)
    return True if declared is None else declared.higher_is_better


def _is_nan(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _seconds(row: dict[str, Any]) -> float:
    if _is_number(row.get("seconds")):
        return float(row["seconds"])
    parts = [row.get("prefill_s"), row.get("decode_s")]
    return float(sum(parts)) if all(_is_number(x) for x in parts) else math.nan


def _run_rows(folder: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of one run folder and a summary of the run (for de-duplication)."""
    config = _read_json(folder / "config.json") or {}
    metrics = _read_json(folder / "metrics.json")
    rows, rejected = RunFolder(folder).scan() if (folder / "samples.jsonl").exists() else ([], [])
    if rejected:
        where = "; ".join(f"line {r['line']}: {r['reason']}" for r in rejected[:3])
        more = f"; and {len(rejected) - 3} more" if len(rejected) > 3 else ""
        get_logger(__name__).warning(
            f"{folder / 'samples.jsonl'}: {len(rejected)} line(s) that are not sample rows left out "
            f"({where}{more}); a rerun of the run sets them aside"
        )
    method_cfg = config.get("method") or {"name": "fp16"}
    task_cfg = config.get("task") or {}
    plan = {**PLAN_DEFAULTS, **(config.get("analysis") or {})}
    run_id = config.get("run_id") or (metrics or {}).get("run_id") or folder.name
    primary = (metrics or {}).get("primary_metric")
    out, seen, duplicates = [], set(), 0
    for row in rows:
        # Two processes running one config at once can both append a sample: keep the first row.
        if (str(row["sample_id"]), row.get("seed")) in seen:
            duplicates += 1
            continue
        seen.add((str(row["sample_id"]), row.get("seed")))
        memory = row.get("memory") or {}
        bits = row.get("bits", method_cfg.get("bits", config.get("bits")))
        record = {
            "run_id": run_id,
            "experiment": plan["name"],
            "task": row.get("task") or task_cfg.get("name"),
            "model": row.get("model") or (config.get("model") or {}).get("name"),
            "method": row.get("method") or (metrics or {}).get("method") or method_cfg.get("name"),
            "method_name": method_cfg.get("name", "fp16"),
            "method_config": method_cfg,
            "bits": float(bits) if _is_number(bits) else math.nan,
            "seed": int(row.get("seed", config.get("seed", 0))),
            "sample_id": str(row["sample_id"]),
            "primary_metric": primary,
            "prediction": row.get("prediction"),
            "stopped": row.get("stopped"),
            "generated_tokens": row.get("generated_tokens"),
            "max_new_tokens": task_cfg.get("max_new_tokens"),
            "finished": metrics is not None,
            "folder": str(folder),
            # wall seconds of the sample (prefill + decode): what sizing an experiment costs per pair
            "seconds": _seconds(row),
        }
        for key, value in row.items():
            if key not in _NOT_METRICS and key not in record and (_is_number(value) or value is None):
                record[key] = math.nan if value is None else value
            elif key not in _NOT_METRICS and key not in record and isinstance(value, dict):
                # Nested per-sample results (e.g. hit rates by policy) stay as objects for their owners.
                record[key] = value
        for key, value in memory.items():
            if _is_number(value) or value is None:
                record[key] = math.nan if value is None else value
        for key, value in plan.items():
            record[f"plan_{key}"] = value
        out.append(record)
    samples_path = folder / "samples.jsonl"
    summary = {
        "folder": str(folder),
        "n_rows": len(out),
        "mtime": samples_path.stat().st_mtime if samples_path.exists() else 0.0,
        "duplicates": duplicates,
    }
    return out, summary


def run_folders(root: str | Path) -> list[Path]:
    """Every run folder (holding ``config.json``) under ``root``, sorted; ``root`` itself included.
    A sweep's folder (``output.root/multirun/<date>/<time>``) holds no run folder of its own: its
    points' records name the run folders it made, and exactly those are read
    (:func:`kvbench.sweep.sweep_run_folders`)."""
    root = Path(root)
    found = {p.parent for p in root.rglob("config.json") if (p.parent / "samples.jsonl").exists()}
    if not found:
        found = {f for f in sweep_run_folders(root) if (f / "samples.jsonl").exists()}
    return sorted(found)


def _flat(node: Any, prefix: str) -> dict[str, str]:
    """A config node as ``{"method.key_axis": json value}`` (lists and scalars as JSON text)."""
    if isinstance(node, dict):
        out: dict[str, str] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: json.dumps(node, sort_keys=True, default=str)}


def _agree(a: dict[str, str], b: dict[str, str]) -> bool:
    """Two flattened configs describe the same configuration when every key they share has the same
    value: a key only one of them has is a knob added later with its default, not a difference."""
    return all(a[k] == b[k] for k in a.keys() & b.keys())


def _grid_value(config: dict[str, Any], grid_key: str) -> Any:
    """The value of the plan's grid key (``bits`` or a dotted path such as ``method.topk``)."""
    node: Any = config
    for part in str(grid_key).split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _cluster(runs: list[dict[str, Any]], key: str) -> list[list[dict[str, Any]]]:
    """Runs grouped into configurations that agree on every shared key of ``run[key]`` (fullest and
    newest first, so each cluster's first run is its representative); largest cluster first."""
    runs = sorted(runs, key=lambda r: (r["n_rows"], r["mtime"]), reverse=True)
    clusters: list[list[dict[str, Any]]] = []
    for run in runs:
        home = next((c for c in clusters if _agree(c[0][key], run[key])), None)
        if home is None:
            clusters.append([run])
        else:
            home.append(run)
    clusters.sort(key=lambda c: sum(r["n_rows"] for r in c), reverse=True)
    return clusters


def _differences(clusters: list[list[dict[str, Any]]], key: str, prefix: str) -> list[str]:
    """For each cluster, ``"knob=value,..."`` over the shared knobs whose values differ between the
    clusters ("" when there is a single cluster)."""
    if len(clusters) < 2:
        return [""]
    flats = [c[0][key] for c in clusters]
    shared = set.intersection(*(set(f) for f in flats))
    differing = sorted(k for k in shared if len({f[k] for f in flats}) > 1)
    return [",".join(f"{k.removeprefix(prefix)}={json.loads(f[k])}" for k in differing) for f in flats]


def load_frame(root: str | Path) -> pd.DataFrame:
    """One row per sample per run under ``root`` (see the module docstring); empty if none.

    Runs of one (task, model, experiment) whose task nodes disagree on a shared key are task
    variants, kept apart in ``variant`` (e.g. ``context_lengths=[512],max_new_tokens=24``; None for
    a single variant) and analysed as separate units. Within a variant, runs with one method label
    whose method nodes agree on every shared key are one configuration; of its runs, each seed keeps
    the one with the most rows (then the newest), and ``frame.attrs["superseded"]`` lists the
    others. Distinct configurations under one label (arms that differ in a knob the label does not
    show, e.g. ``uniform`` with per-token or per-channel keys) get the differing knobs appended:
    ``uniform-2b[key_axis=token]``. ``grid_value`` holds the value of the plan's ``grid_key``.
    Rows are sorted by task, model, method, seed and sample id.
    """
    summaries = []
    for folder in run_folders(root):
        rows, summary = _run_rows(folder)
        if not rows:
            continue
        config = _read_json(folder / "config.json") or {}
        first = rows[0]
        summary.update(
            rows=rows,
            seed=first["seed"],
            method_flat=_flat(config.get("method") or {}, "method"),
            task_flat=_flat(config.get("task") or {}, "task"),
            grid_value=_grid_value(config, first["plan_grid_key"]),
            unit=(first["task"], first["model"], first["experiment"] or ""),
            label=first["method"],
        )
        summaries.append(summary)
    # Task variants: runs of one (task, model, experiment) whose task nodes disagree (other context
    # lengths, other generation length) measure different things and become separate units.
    by_unit: dict[tuple, list[dict[str, Any]]] = {}
    for summary in summaries:
        by_unit.setdefault(summary["unit"], []).append(summary)
    groups_: dict[tuple, list[dict[str, Any]]] = {}
    for unit, runs in by_unit.items():
        variants = _cluster(runs, "task_flat")
        names = _differences(variants, "task_flat", "task.")
        for variant, name in zip(variants, names, strict=True):
            for run in variant:
                run["variant"] = name
                groups_.setdefault((*unit, name, run["label"]), []).append(run)
    kept, superseded = [], []
    for runs in groups_.values():
        clusters = _cluster(runs, "method_flat")
        suffixes = _differences(clusters, "method_flat", "method.")
        for cluster, suffix in zip(clusters, suffixes, strict=True):
            seen_seeds: set[int] = set()
            for run in cluster:
                if run["seed"] in seen_seeds:
                    superseded.append(run["folder"])
                    continue
                seen_seeds.add(run["seed"])
                for row in run["rows"]:
                    row["method"] += f"[{suffix}]" if suffix else ""
                    row["grid_value"] = run["grid_value"]
                    row["variant"] = run["variant"] or None
                    kept.append(row)
    frame = pd.DataFrame(kept)
    if not frame.empty:
        frame = frame.sort_values(["task", "model", "method", "seed", "sample_id"], kind="stable")
        frame = frame.reset_index(drop=True)
    frame.attrs["superseded"] = sorted(superseded)
    frame.attrs["duplicate_rows"] = {r["folder"]: r["duplicates"] for r in summaries if r["duplicates"]}
    return frame


def plan_of(frame: pd.DataFrame) -> dict[str, Any]:
    """The analysis plan of a frame's runs: the declared one when every run carries the same plan,
    else the defaults; ``metric`` falls back to the task's primary metric."""
    plan = dict(PLAN_DEFAULTS)
    columns = [c for c in frame.columns if c.startswith("plan_")]
    for column in columns:
        values = {json.dumps(v, sort_keys=True, default=str) for v in frame[column]}
        if len(values) == 1:
            value = frame[column].iloc[0]
            # An all-None column can come back as NaN: that is "not declared", not a value.
            plan[column.removeprefix("plan_")] = None if _is_nan(value) else value
    # Unfinished runs have no metrics.json and so no primary metric: read it from the finished ones.
    if plan["metric"] is None and "primary_metric" in frame:
        primaries = frame["primary_metric"].dropna().unique()
        plan["metric"] = primaries[0] if len(primaries) else None
    return plan


def groups(frame: pd.DataFrame) -> list[tuple[tuple[str, str, str | None], pd.DataFrame]]:
    """The frame split into analysis units: one per (task, model, experiment) and task variant,
    each with its own reference and plan. The key's third element is the experiment name, with the
    variant appended in brackets when there are several (None for neither)."""

    def name(row_experiment: Any, row_variant: Any) -> str:
        experiment = row_experiment if isinstance(row_experiment, str) else ""
        variant = row_variant if isinstance(row_variant, str) else ""
        return experiment + (f"[{variant}]" if variant else "")

    variant = frame["variant"] if "variant" in frame else pd.Series([None] * len(frame), index=frame.index)
    unit_name = [name(e, v) for e, v in zip(frame["experiment"], variant, strict=True)]
    out = []
    for (task, model, unit), sub in frame.assign(_unit=unit_name).groupby(
        ["task", "model", "_unit"], sort=True
    ):
        out.append(((task, model, unit or None), sub.drop(columns="_unit")))
    return out
