"""The report of a sample frame (``python -m kvbench.report DIR``, and each experiment's report under
``results/``): one folder per analysis unit with its tables and figures, and ``report.md`` gathering
the plan, every table and the figure list (the package docstring lists the files)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from kvbench import atomic
from kvbench.analysis import figures, tables
from kvbench.analysis.frame import groups, load_frame
from kvbench.analysis.units import analyze
from kvbench.report.output import ReportError, slug, write_table


def _save_optional(name: str, spec: str, frame: pd.DataFrame, folder: Path, say) -> list[Path]:
    """Run a figure a task declares (``Task.figures``: name -> ``"module:function"``); a missing
    module or function is a note, a failure inside it a warning: neither stops the report."""
    func = figures.optional_figure(spec)
    shown = spec.replace(":", ".")
    if func is None:
        say(f"note: {shown} is not available; {name} skipped")
        return []
    try:
        result = func(frame)
    except Exception as err:  # another module's figure must not take the whole report down
        say(f"warning: {shown} failed ({type(err).__name__}: {err}); {name} skipped")
        return []
    figs = result if isinstance(result, (list, tuple)) else [result]
    paths = []
    for i, fig in enumerate(f for f in figs if f is not None):
        stem = name if len(figs) == 1 else f"{name}_{i}"
        paths.append(figures.save(fig, folder / f"{stem}.png"))
    return paths


def task_figures(task: str) -> dict[str, str]:
    """The figures task ``task`` declares (``Task.figures``); none for a task not registered here."""
    from kvbench.tasks import TASKS

    return dict(TASKS.get(task).figures) if task in TASKS else {}


def report_unit(
    key: tuple[str, str, str | None],
    frame: pd.DataFrame,
    out: Path,
    seed: int = 0,
    n_resamples: int = 10_000,
    say=print,
) -> dict[str, Any]:
    """Tables and figures of one (task, model, experiment) unit into ``out/<slug>/``."""
    task, model, experiment = key
    folder = out / slug(task, model, experiment)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        unit = analyze((key, frame), seed=seed, n_resamples=n_resamples)
    except ValueError as err:
        raise ReportError(f"{task}/{model}: {err}") from None
    plan, means, paired, cliff, notes = unit.plan, unit.means, unit.paired, unit.cliff, unit.notes
    metric, grid_key = plan["metric"], unit.grid_key
    for name, table in (("means", means), ("paired", paired), ("cliff", cliff)):
        write_table(table, folder / name)
    figs = [
        figures.save(
            figures.cliff_map(means, paired, plan["reference"], metric, unit.title, grid_key),
            folder / "cliff_map.png",
        ),
        figures.save(
            figures.memory_quality(means, plan["reference"], metric, unit.title),
            folder / "memory_quality.png",
        ),
    ]
    for name, spec in task_figures(task).items():
        figs += _save_optional(name, spec, frame, folder, say)
    for note in notes:
        say(f"note: {task}/{model}: {note}")
    return {
        "key": key,
        "folder": folder,
        "plan": plan,
        "means": means,
        "paired": paired,
        "cliff": cliff,
        "figures": figs,
        "notes": notes,
    }


def _plan_lines(plan: dict[str, Any]) -> list[str]:
    margin = plan["margin"]
    return [
        f"- reference: `{plan['reference']}`; metric: `{plan['metric']}`; alpha: {plan['alpha']}",
        f"- TOST margin: {margin if margin is not None else 'not declared (no equivalence test)'}",
        f"- declared n per seed: {plan['n']}; seeds: {plan['seeds']}",
        f"- grid ({plan['grid_key']}): {plan['grid']}",
    ]


def modified_checkout_runs(frame: pd.DataFrame) -> list[tuple[str, str]]:
    """``(folder, commit)`` of every run in ``frame`` whose rows some session wrote from a modified
    checkout (``provenance.json``; ``metrics.json`` for runs made before it), where the folders are
    at hand (a report on run folders; archives carry no folders)."""
    import json

    out = []
    for folder in sorted(set(frame["folder"].dropna())) if "folder" in frame else []:
        path = Path(str(folder))
        try:
            sessions = json.loads((path / "provenance.json").read_text()).get("sessions", [])
            codes = [s.get("code") or {} for s in sessions]
        except (OSError, ValueError, AttributeError):
            try:
                codes = [json.loads((path / "metrics.json").read_text()).get("versions") or {}]
            except (OSError, ValueError, AttributeError):
                continue
        dirty = [c for c in codes if c.get("git_dirty")]
        if dirty:
            out.append((str(folder), ", ".join(sorted({str(c.get("git_commit"))[:10] for c in dirty}))))
    return out


def write_report(
    frame: pd.DataFrame,
    out: str | Path,
    title: str,
    seed: int = 0,
    n_resamples: int = 10_000,
    say=print,
    write_samples: bool = True,
) -> dict[str, Any]:
    """The report of a sample frame into ``out``: ``report.md`` headed ``# Report: TITLE``, one
    folder per analysis unit and, with ``write_samples``, the frame as ``samples.csv``. Returns the
    frame, the output folder and each unit's tables and figure paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if write_samples:
        plain = frame.drop(columns=[c for c in frame.columns if frame[c].map(type).eq(dict).any()])
        atomic.write_text(out / "samples.csv", plain.to_csv(index=False))
    units, skipped = [], []
    for key, sub in groups(frame):
        try:
            units.append(report_unit(key, sub, out, seed, n_resamples, say))
        except ReportError as err:  # one unit that cannot be analyzed must not hide the others
            skipped.append(str(err))
            say(f"note: skipped {err}")
    if not units:
        raise ReportError(f"{title}: no analyzable runs ({'; '.join(skipped)})")

    lines = [f"# Report: {title}", ""]
    lines.append(f"{len(frame)} sample rows from {frame['run_id'].nunique()} runs.")
    if skipped:
        lines += ["", "Skipped:", ""] + [f"- {s}" for s in skipped]
    duplicates = frame.attrs.get("duplicate_rows", {})
    if duplicates:
        lines += ["", "Repeated sample rows dropped (the first row of each sample kept):", ""]
        lines += [f"- `{folder}`: {n}" for folder, n in duplicates.items()]
        for folder, n in duplicates.items():
            say(f"note: {folder}: {n} repeated sample row(s) dropped")
    # from run folders only: the archives' folders are the machine's that ran them, not this one's
    dirty = modified_checkout_runs(frame) if write_samples else []
    if dirty:
        lines += ["", "Runs made from a checkout with uncommitted changes (not the commit named):", ""]
        lines += [f"- `{folder}`: {commit}" for folder, commit in dirty]
        say(f"note: {len(dirty)} run(s) were made from a modified checkout; see report.md")
    superseded = frame.attrs.get("superseded", [])
    if superseded:
        lines += ["", "Runs left out (a fuller or newer run of the same configuration exists):", ""]
        lines += [f"- `{s}`" for s in superseded]
    for unit in units:
        task, model, experiment = unit["key"]
        lines += ["", f"## {task} / {model}" + (f" / {experiment}" if experiment else ""), ""]
        lines += _plan_lines(unit["plan"])
        lines += [f"- note: {n}" for n in unit["notes"]]
        hib = unit["paired"].attrs.get("higher_is_better", True)
        orient = "method - reference" if hib else "reference - method (lower is better)"
        for title_, table in (
            ("Per configuration", unit["means"]),
            (f"Paired against the reference (difference = {orient}; positive = better)", unit["paired"]),
            ("Cliff", unit["cliff"]),
        ):
            lines += ["", f"### {title_}", "", tables.to_markdown(table).rstrip()]
        lines += ["", "### Figures", ""]
        lines += [f"- `{p.relative_to(out)}`" for p in unit["figures"]]
    atomic.write_text(out / "report.md", "\n".join(lines) + "\n")
    return {"frame": frame, "out": out, "units": units}


def build_report(
    root: str | Path, out: str | Path | None = None, seed: int = 0, n_resamples: int = 10_000, say=print
) -> dict[str, Any]:
    """Read every run under ``root`` and write the report into ``out`` (default ``root/report``).
    Returns the frame, the output folder and each unit's tables and figure paths."""
    root = Path(root)
    if not root.is_dir():
        raise ReportError(f"DIR={root}: no such directory")
    frame = load_frame(root)
    if frame.empty:
        raise ReportError(f"DIR={root}: no runs found (no folder with config.json and samples.jsonl)")
    out = Path(out) if out is not None else root / "report"
    try:
        return write_report(frame, out, f"`{root}`", seed, n_resamples, say)
    except ReportError as err:
        raise ReportError(f"DIR={root}: {str(err).split(': ', 1)[1]}") from None
