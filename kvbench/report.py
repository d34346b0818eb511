"""``python -m kvbench.report DIR``: tables, statistics and figures from the runs stored under DIR.

    python -m kvbench.report results/runs                 # -> results/runs/report/
    python -m kvbench.report results/semkv_cliff --out /tmp/rep --resamples 2000
    python -m kvbench.report --claims [--model NAME]      # claim verdicts -> results/claims/<model>.md
    python -m kvbench.report --archive results/runs       # runs -> results/<experiment>/samples.csv.gz
    python -m kvbench.report --regenerate                 # make results: everything from the archives
    python -m kvbench.report --paper kivi                 # published beside measured -> results/papers/

Every run under DIR (searched recursively) is read into one sample frame
(``kvbench.analysis.frame.load_frame``) and split into analysis units, one per (task, model,
experiment). Each unit follows its experiment's ``analysis`` plan from ``config.json`` (reference,
metric, alpha, margin; defaults: fp16, the task's primary metric, 0.05, no margin) and gets, under
``OUT/<task>_<model>[_<experiment>]/``:

- ``means.md/.csv``: per configuration, mean with bootstrap CI, effective bits, runaway rate;
- ``paired.md/.csv``: each configuration against the reference, paired by (sample_id, seed): mean
  difference with paired-bootstrap CI, sign-flip p, Holm-adjusted p, TOST at the margin, McNemar
  for binary metrics, verdict;
- ``cliff.md/.csv``: the cliff bracket of each method family with a bit grid;
- ``cliff_map.png``, ``memory_quality.png``, and the figures the unit's task declares
  (``Task.figures``: NIAH's heatmap, the PG-19 hit-rate curves; skipped with a note when a
  declared function is not available).

``OUT/report.md`` gathers the plan, every table and the figure list; ``OUT/samples.csv`` is the
whole frame. Bad input (no such DIR, no runs in it) prints one line and exits with status 2.

``--archive RUNS`` stores each experiment's sample frame as ``results/<experiment>/samples.csv.gz``
(``kvbench.analysis.archive``). ``--regenerate`` (``make results``) rewrites, from those archives
and without a model, each experiment's report under ``results/<experiment>/`` and the claim
verdicts ``results/claims/<model>.md``; ``--claims`` computes and prints the verdicts only
(``kvbench.analysis.claims``). Both read run folders instead with ``--runs DIR``: the outputs are the
same bytes either way.

``--results`` defaults to the checkout's ``results/`` when kvbench runs from a source checkout, and
to ``./results`` otherwise (an installed package: point ``--results`` at a checkout's ``results/``
to read its committed archives). The papers, their tables and their claims are the package's
``kvbench/papers/<paper>.yaml`` (``kvbench.analysis.papers``; ``--declarations DIR``: another folder
of paper files). The rule lives in :mod:`kvbench.paths`.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402

from kvbench import atomic  # noqa: E402
from kvbench.analysis import figures, tables  # noqa: E402
from kvbench.analysis.frame import groups, load_frame  # noqa: E402
from kvbench.analysis.units import analyze  # noqa: E402
from kvbench.paths import CONF_DIR, PAPERS_DIR, default_results  # noqa: E402

# The checkout's results/ when run from a checkout, else ./results (the rule: kvbench.paths).
DEFAULT_RESULTS = default_results()
CONF = CONF_DIR


class ReportError(Exception):
    """Bad input to the report: printed as one line, exit status 2."""


def _slug(*parts: Any) -> str:
    return "_".join(re.sub(r"[^\w.-]+", "-", str(p)) for p in parts if p)


def _write_table(table: pd.DataFrame, path_stem: Path) -> None:
    atomic.write_text(path_stem.with_suffix(".csv"), table.to_csv(index=False))
    atomic.write_text(path_stem.with_suffix(".md"), tables.to_markdown(table))


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
    folder = out / _slug(task, model, experiment)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        unit = analyze((key, frame), seed=seed, n_resamples=n_resamples)
    except ValueError as err:
        raise ReportError(f"{task}/{model}: {err}") from None
    plan, means, paired, cliff, notes = unit.plan, unit.means, unit.paired, unit.cliff, unit.notes
    metric, grid_key = plan["metric"], unit.grid_key
    for name, table in (("means", means), ("paired", paired), ("cliff", cliff)):
        _write_table(table, folder / name)
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


# ------------------------------------------------------------------------------ claims, results


def claims_results(
    frames: dict[str, pd.DataFrame],
    declarations: str | Path | list = PAPERS_DIR,
    models: list[str] | None = None,
    seed: int = 0,
    n_resamples: int = 10_000,
    conf_dir: Path | None = CONF,
) -> dict[str, list]:
    """``{model: [ClaimResult, ...]}`` for every claim on each model: ``models``, or every model
    with runs plus the default one. ``declarations``: a folder of paper files (or one), or the
    papers already loaded. ``conf_dir``: where the claims' experiment nodes must exist (None: not
    checked, for claims on synthetic experiments)."""
    from kvbench.analysis.claims import DEFAULT_MODEL, evaluate_claims
    from kvbench.analysis.papers import claims_of, load_papers

    papers = declarations if isinstance(declarations, list) else load_papers(declarations, conf_dir)
    claims = claims_of(papers)
    if models is None:
        seen = {str(m) for f in frames.values() for m in f["model"].dropna().unique()}
        models = sorted(seen | {DEFAULT_MODEL})
    return {m: evaluate_claims(claims, frames, m, seed=seed, n_resamples=n_resamples) for m in models}


def check_models(frames: dict[str, pd.DataFrame], models: list[str] | None) -> None:
    """``--model`` names a model with runs, or one with a model node (its claims are then "not
    run"); anything else is a ReportError listing both, before a page is written."""
    from kvbench.analysis.claims import DEFAULT_MODEL

    seen = {str(m) for f in frames.values() for m in f["model"].dropna().unique()}
    known = seen | {p.stem for p in CONF.joinpath("model").glob("*.yaml")} | {DEFAULT_MODEL}
    for model in models or []:
        if model not in known:
            raise ReportError(
                f"--model={model}: no runs and no model node of that name; models: {', '.join(sorted(known))}"
            )


def claims_markdown(model: str, results: list, frames: dict[str, pd.DataFrame] | None = None) -> str:
    """The generated verdict table of one model (``results/claims/<model>.md``), then, with the
    frames, what settling each inconclusive claim would cost and each node's size from its pilot
    against the CPU budget of a node (``kvbench.analysis.sizing``)."""
    from kvbench.analysis.claims import (
        accounting_table,
        claims_table,
        fdr_line,
        margin_table,
        verdict_counts,
    )
    from kvbench.analysis.sizing import NODE_BUDGET_MIN, WORKING_DAY_H, node_sizing, sizing_table

    lines = [
        f"# Paper claims on {model}",
        "",
        "Generated by `make results` (`python -m kvbench.report --claims`) from the stored runs of each",
        "claim's experiment; do not edit. Declarations: `kvbench/papers/`; rules and verdicts:",
        "`kvbench/analysis/claims.py`. `measured` gives each rule's estimate with its paired-bootstrap",
        "95 % interval, pairs n and one-sided p-values for the claim and against it. Verdicts:",
        "`reproduced` (the claim's test rejects), `evidence against` (the reverse test rejects), `no",
        "effect at this power` (neither, and an effect of the declared size is rejected), `inconclusive`",
        "(neither: `n_to_confirm` / `n_to_refute` are the pairs that would settle it each way, power 0.8",
        "at the observed spread; `inf` where the data point the other way), `premise not met here` (a",
        "condition the paper presupposes fails on this model, e.g. its recipe's bit widths lie below this",
        "model's cliff), `not run`, `not testable here`. `in proxy`: the rule measures a stand-in for the",
        "paper's quantity, and the rule column names the task-level claim beside it; proxy verdicts are",
        "counted apart from task-level ones. Bounded scores (task scores, recall, hit rates) take exact,",
        "tie-aware tests (`kvbench.stats.exact`): no p-value comes from a zero spread, and a rule whose",
        "arms all sit at the ceiling or floor reads `not testable here` with that reason. Storage claims",
        "(`accounted` rules) are counted the paper's own way (its `accounting` in `kvbench/papers/`),",
        "with kvbench's own bytes beside them (below).",
        "",
        verdict_counts(results),
        "",
        fdr_line(results),
        "",
        tables.to_markdown(claims_table(results)).rstrip(),
    ]
    accounted = accounting_table(results)
    if len(accounted):
        lines += [
            "",
            "## Storage claims: the paper's accounting, kvbench's bytes",
            "",
            "Each storage rule on two lines. First, kvbench's configuration counted as the paper counts",
            "(`kvbench/papers/<paper>.yaml`, `accounting`: what enters, what is left out, the reference),",
            "from what the runs store (code bits, levels, outlier fraction, read bits), against the",
            "paper's number at the precision it is written with: this line decides the verdict, by",
            "arithmetic (no test). Second, the same runs counted by the bytes kvbench holds, with the",
            "difference and what the paper's count leaves out: a convention, never evidence against.",
            "",
            tables.to_markdown(accounted).rstrip(),
        ]
    margins = margin_table(results)
    if len(margins):
        lines += [
            "",
            "## Margins kvbench chose",
            "",
            "Each margin rule whose margin the project chose (not the paper), judged at half the margin,",
            "at the margin and at twice it: a verdict that changes across them rests on the choice.",
            "",
            tables.to_markdown(margins).rstrip(),
        ]
    if frames is not None:
        sizing = sizing_table(results, frames)
        lines += [
            "",
            "## What the inconclusive claims would need",
            "",
            "Pairs to confirm and to refute each inconclusive claim (power 0.8 at the observed spread;",
            "confirming plans at the observed effect when it points the claim's way, refuting when it",
            "points against); `s_per_pair`: mean wall seconds per sample of the configurations the claim",
            "compares, summed, on the machine that made the runs; `hours_to_*`: the missing pairs at that",
            f"cost; `fits_a_day`: the cheaper direction within {WORKING_DAY_H:g} h.",
            "",
            tables.to_markdown(sizing).rstrip() if len(sizing) else "No claim is inconclusive.",
        ]
        nodes, notes = node_sizing(results, frames)
        lines += [
            "",
            "## Sizing",
            "",
            "Each node with claims, sized from its stored runs as a pilot: `n_now`, the pairs",
            "(sample_id, seed) its configurations hold; `n_needed`, the largest n any of its open",
            "(inconclusive) claims needs at power 0.8, alpha as declared, at the pilot's effect and",
            "spread and in the direction the pilot points (`confirm`: the claim's side; `refute`: the",
            "other), with the claim; `minutes_at_n`, the CPU minutes the whole node would take at that",
            "n (`kvbench.reproduce`'s cost model: each run's samples scaled to n, at the seconds per",
            "sample stored for its model and method on the machine of the runs, plus a model load per",
            f"run); `within_budget`, whether that fits the {NODE_BUDGET_MIN:g} CPU-minute budget of a",
            "node (`kvbench.analysis.sizing.NODE_BUDGET_MIN`); `resize_to`, the n the node would be",
            "resized to: the largest needed n that fits the budget, with its minutes. No node is resized",
            "here: the n of every node is still the one its stored runs were made at.",
            "",
            tables.to_markdown(nodes).rstrip() if len(nodes) else "No node has claims.",
        ]
        if notes:
            lines += ["", *(f"- {note}" for note in notes)]
    return "\n".join(lines) + "\n"


def write_claims(
    results_by_model: dict[str, list], out: str | Path, frames: dict[str, pd.DataFrame] | None = None
) -> list[Path]:
    """``out/<model>.md`` and ``.csv`` per model; returns the markdown paths."""
    from kvbench.analysis.claims import claims_table

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for model, results in results_by_model.items():
        path = out / f"{_slug(model)}.md"
        atomic.write_text(path, claims_markdown(model, results, frames))
        atomic.write_text(path.with_suffix(".csv"), claims_table(results).to_csv(index=False))
        paths.append(path)
    return paths


def models_markdown(by_model: dict[str, list]) -> str:
    """``results/claims/by_model.md``: every claim's verdict on each model with runs, side by side
    (``kvbench.analysis.claims.models_table``), the default model first."""
    from kvbench.analysis.claims import models_table, verdict_counts

    table = models_table(by_model)
    models = list(table.columns[3:])
    lines = [
        "# Paper claims, model by model",
        "",
        "Generated by `make results` from the stored runs; do not edit. One column per model whose",
        "runs some claim reads: its verdict and pairs n (each model's page `results/claims/<model>.md`",
        "gives the estimates, intervals, p-values and rules). The default model runs every CPU node",
        "(`make reproduce`); the second model runs the nodes with a `conf/experiment/strong/` variant",
        "(`python -m kvbench.reproduce --profile strong`): the claims the default model floors, so",
        "its other claims read `not run`.",
        "",
        *(f"- {m}: {verdict_counts(by_model[m])}" for m in models),
        "",
        tables.to_markdown(table).rstrip(),
    ]
    return "\n".join(lines) + "\n"


def paper_markdown(
    paper,
    results: list,
    frames: dict[str, pd.DataFrame],
    model: str,
    seed: int = 0,
    n_resamples: int = 10_000,
) -> str:
    """One paper's page: its claims with the published value beside the measured one and the
    verdict, then the paper's own tables (``kvbench.analysis.papers``: the paper's rows and
    columns, each cell the per-configuration mean with its bootstrap interval and, where the paper
    gives one, the published value beside it), then, for each claim's experiment node that no table
    reads, the mean of the node's metric per configuration (bootstrap interval, effective bits).
    ``paper``: a :class:`kvbench.analysis.papers.Paper`."""
    from kvbench.analysis import papers as paper_tables
    from kvbench.analysis.units import analyze

    mine = [r for r in results if r.claim.paper == paper.id]
    lines = [
        f"# {paper.title}: published against measured on {model}",
        "",
        "Generated by `make results` (`python -m kvbench.report --paper " + paper.id + "`); do not edit.",
        "",
        "## Claims",
        "",
    ]
    rows = [
        {
            "claim": r.claim.id,
            "where": r.claim.where,
            "published": str(r.claim.published),
            "measured": r.measured if r.verdict not in ("not run", "not testable here") else "-",
            "verdict": r.shown_verdict,
        }
        for r in mine
    ]
    lines.append(
        tables.to_markdown(
            pd.DataFrame(rows, columns=["claim", "where", "published", "measured", "verdict"])
        ).rstrip()
    )
    if paper.notes:
        lines += [""] + [f"- {note}" for note in paper.notes]
    for layout in paper.tables:
        lines += [""] + paper_tables.render(layout, frames, model, seed, n_resamples)
    covered = paper.covered_nodes
    for experiment in sorted({r.claim.experiment for r in mine if r.claim.experiment} - covered):
        frame = frames.get(experiment)
        sub = frame[frame["model"] == model] if frame is not None else None
        lines += ["", f"## {experiment}", ""]
        if sub is None or sub.empty:
            lines.append(f"No runs on {model} yet: `python -m kvbench -m +experiment={experiment}`.")
            continue
        for key, unit_frame in groups(sub):
            try:
                unit = analyze((key, unit_frame), seed=seed, n_resamples=n_resamples)
            except ValueError as err:
                lines.append(f"- {key[0]}: not analyzable ({err})")
                continue
            cols = ["method", "n", "mean", "ci_low", "ci_high", "effective_bits"]
            lines += [
                f"{key[0]}, metric `{unit.plan['metric']}`:",
                "",
                tables.to_markdown(unit.means[cols]).rstrip(),
                "",
            ]
    return "\n".join(lines).rstrip() + "\n"


def write_papers(
    by_model: dict[str, list],
    frames: dict[str, pd.DataFrame],
    out: str | Path,
    seed: int = 0,
    n_resamples: int = 10_000,
    papers: list | None = None,
) -> list[Path]:
    """``out/<paper>_<model>.md`` for every paper of ``papers`` (default: the package's) and model:
    every paper on the default model, and on another model the papers whose nodes (tables or
    claims) it has runs of, so a model run on a few nodes does not gain pages of empty tables."""
    from kvbench.analysis.claims import DEFAULT_MODEL
    from kvbench.analysis.papers import load_papers

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for model, results in by_model.items():
        run = {name for name, frame in frames.items() if (frame["model"] == model).any()}
        for paper in load_papers() if papers is None else papers:
            nodes = paper.covered_nodes | {claim.experiment for claim in paper.claims}
            if model != DEFAULT_MODEL and not nodes & run:
                continue
            path = out / f"{paper.id}_{_slug(model)}.md"
            atomic.write_text(path, paper_markdown(paper, results, frames, model, seed, n_resamples))
            paths.append(path)
    return paths


README_BEGIN = "<!-- results:begin (written by make results; do not edit) -->"
README_END = "<!-- results:end -->"


def readme_block(
    by_model: dict[str, list],
    frames: dict[str, pd.DataFrame],
    model: str | None = None,
    seed: int = 0,
    n_resamples: int = 10_000,
    papers: list | None = None,
) -> str:
    """The README's results section on ``model`` (default: the default model): the verdict counts,
    a compact claims table (published, measured with its interval and n, verdict, pairs needed)
    and each paper's headline table (its first layout; ``papers``, default: the package's), the
    same cells as its page under ``results/papers/``."""
    from kvbench.analysis import papers as paper_tables
    from kvbench.analysis.claims import DEFAULT_MODEL, claims_table, models_table, verdict_counts

    model = model or DEFAULT_MODEL
    results = by_model.get(model, [])
    claims = claims_table(results)[
        ["id", "published", "measured", "n", "verdict", "n_to_confirm", "n_to_refute"]
    ]
    # the other models with runs: their verdicts as columns beside this model's
    others = models_table(by_model, first=model)
    for other in others.columns[4:]:
        claims[f"on {other}"] = list(others[other])
    mine = [f[f["model"] == model] for f in frames.values()]
    mine = [f for f in mine if not f.empty]
    samples = sum(len(f) for f in mine)
    configs = sum(f["run_id"].nunique() for f in mine)
    seconds = sum(float(pd.to_numeric(f["seconds"], errors="coerce").sum()) for f in mine if "seconds" in f)
    lines = [
        README_BEGIN,
        "",
        f"The archives hold {samples} samples of {configs} runs on {model} from {len(mine)} experiment "
        f"nodes; the samples took {seconds / 60:.0f} minutes of wall time (prefill and decode, summed) "
        "on the machine that ran them.",
        "",
        f"### Claims on {model}",
        "",
        verdict_counts(results) + f" (`results/claims/{_slug(model)}.md` adds each rule and its experiment).",
        "",
        tables.to_markdown(claims).rstrip(),
    ]
    for paper in paper_tables.load_papers() if papers is None else papers:
        if not paper.tables:
            continue
        block = paper_tables.render(paper.tables[0], frames, model, seed, n_resamples)
        # one level down under the README's section; the paper's page has the rest
        block[0] = "#" + block[0]
        block = [
            line.replace("### task variant", "#### task variant") if i else line
            for i, line in enumerate(block)
        ]
        lines += [
            "",
            *block,
            "",
            f"All of {paper.id}'s tables: `results/papers/{paper.id}_{_slug(model)}.md`.",
        ]
    return "\n".join(lines + ["", README_END]) + "\n"


def write_readme_block(readme: Path, block: str) -> bool:
    """Replace the text between the README's results markers with ``block``; False (nothing
    written) when the README or its markers are absent (an installed package, a user's folder)."""
    if not readme.is_file():
        return False
    text = readme.read_text()
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        return False
    new = text[:start] + block.rstrip("\n") + text[end + len(README_END) :]
    if new != text:
        atomic.write_text(readme, new)
    return True


def regenerate(
    frames: dict[str, pd.DataFrame],
    results: str | Path,
    declarations: str | Path = PAPERS_DIR,
    models: list[str] | None = None,
    seed: int = 0,
    n_resamples: int = 10_000,
    say=print,
    conf_dir: Path | None = CONF,
) -> list[Path]:
    """Every output under ``results`` from the frames of each experiment: ``<experiment>/report.md``
    with its unit folders (tables, figures), and ``claims/<model>.md`` / ``.csv``. The same frames
    give the same bytes, whether they come from the archives or straight from the run folders.
    ``declarations``: the folder of paper files (identity, tables, claims)."""
    from kvbench.analysis.papers import load_papers

    papers = load_papers(declarations, conf_dir)
    results = Path(results)
    if results.is_dir():
        atomic.remove_stale_temporaries(results)  # what an interrupted run left
    written = []
    for name, frame in sorted(frames.items()):
        try:
            report = write_report(
                frame, results / name, f"`{name}`", seed, n_resamples, say, write_samples=False
            )
        except ReportError as err:
            say(f"note: {err}")
            continue
        written.append(report["out"] / "report.md")
    by_model = claims_results(frames, papers, models, seed, n_resamples, conf_dir)
    written += write_claims(by_model, results / "claims", frames)
    atomic.write_text(results / "claims" / "by_model.md", models_markdown(by_model))
    written.append(results / "claims" / "by_model.md")
    written += write_papers(by_model, frames, results / "papers", seed, n_resamples, papers)
    # the checkout's README shows the claims table and each paper's headline table
    readme = results.parent / "README.md"
    block = readme_block(by_model, frames, seed=seed, n_resamples=n_resamples, papers=papers)
    if write_readme_block(readme, block):
        written.append(readme)
    return written


def _frames(runs: str | None, results: Path) -> dict[str, pd.DataFrame]:
    """The experiments' frames: from the run folders under ``runs`` when given, else from the
    archives under ``results``."""
    from kvbench.analysis.archive import frames_from_runs, load_archives

    if runs is not None:
        if not Path(runs).is_dir():
            raise ReportError(f"--runs={runs}: no such directory")
        return frames_from_runs(runs)
    return load_archives(results)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvbench.report", description="Tables, statistics and figures from stored runs."
    )
    parser.add_argument(
        "dir", nargs="?", metavar="DIR", help="folder holding run folders (searched recursively)"
    )
    parser.add_argument("--out", help="output folder (default: DIR/report)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap and permutation resamples")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples per interval")
    parser.add_argument(
        "--claims",
        action="store_true",
        help="compute every claim's verdict, print the table and write RESULTS/claims/<model>.md",
    )
    parser.add_argument(
        "--model", action="append", help="with --claims / --paper: only this model (repeatable)"
    )
    parser.add_argument(
        "--paper", action="append", help="write RESULTS/papers/<paper>_<model>.md: published beside measured"
    )
    parser.add_argument(
        "--declarations",
        metavar="DIR",
        default=str(PAPERS_DIR),
        help="folder of paper files, <paper>.yaml: identity, tables, claims (default: %(default)s)",
    )
    parser.add_argument(
        "--archive",
        metavar="RUNS",
        help="write RESULTS/<experiment>/samples.csv.gz, each experiment's per-sample archive, from RUNS",
    )
    parser.add_argument(
        "--compare",
        metavar="RUNS",
        help="check the runs under RUNS against the committed archives, sample by sample (exit 1 if any "
        "row is missing from them or differs in a measured column)",
    )
    parser.add_argument(
        "--regenerate",
        action="store_true",
        help="rewrite every table, figure and claim verdict under RESULTS from the archives (make results)",
    )
    parser.add_argument(
        "--runs",
        help="with --claims or --regenerate: read the run folders under RUNS instead of the archives",
    )
    parser.add_argument(
        "--results", default=str(DEFAULT_RESULTS), help="results folder (default: %(default)s)"
    )
    parser.add_argument(
        "--wandb", action="store_true", help="also log the figures and tables to Weights & Biases"
    )
    args = parser.parse_args(argv)
    results = Path(args.results)
    try:
        if args.resamples < 1:
            raise ReportError(f"--resamples={args.resamples}: must be a positive integer")
        if args.archive is not None:
            from kvbench.analysis.archive import write_archives

            if not Path(args.archive).is_dir():
                raise ReportError(f"--archive={args.archive}: no such directory")
            written = write_archives(args.archive, results)
            if not written:
                raise ReportError(f"--archive={args.archive}: no runs found")
            for path in written.values():
                print(f"archive: {path} ({path.stat().st_size} bytes)")
            return 0
        if args.compare is not None:
            from kvbench.analysis.archive import compare_runs
            from kvbench.results import format_table

            if not Path(args.compare).is_dir():
                raise ReportError(f"--compare={args.compare}: no such directory")
            table = compare_runs(args.compare, results)
            if table.empty:
                raise ReportError(f"--compare={args.compare}: no runs found")
            print(format_table(table.to_dict("records")))
            bad = table[(table["archived"] < table["rows"]) | (table["identical"] < table["rows"])]
            rows, same = int(table["rows"].sum()), int(table["identical"].sum())
            print(f"compare: {same} of {rows} rows identical to the archives in every measured column")
            return 1 if len(bad) else 0
        if args.regenerate:
            frames = _frames(args.runs, results)
            check_models(frames, args.model)
            paths = regenerate(frames, results, args.declarations, args.model, args.seed, args.resamples)
            for path in paths:
                print(f"wrote: {path}")
            return 0
        if args.paper:
            from kvbench.analysis.papers import load_papers

            papers = load_papers(args.declarations, CONF)
            known = {p.id: p for p in papers}
            for name in args.paper:
                if name not in known:
                    raise ReportError(f"--paper={name}: no such paper; papers: {', '.join(known)}")
            frames = _frames(args.runs, results)
            check_models(frames, args.model)
            by_model = claims_results(frames, papers, args.model, args.seed, args.resamples)
            chosen = [known[name] for name in args.paper]
            for path in write_papers(by_model, frames, results / "papers", args.seed, args.resamples, chosen):
                print(path.read_text())
                print(f"wrote: {path}")
            return 0
        if args.claims:
            from kvbench.analysis.claims import claims_table, verdict_counts

            frames = _frames(args.runs, results)
            check_models(frames, args.model)
            by_model = claims_results(frames, args.declarations, args.model, args.seed, args.resamples)
            for model, claim_results in by_model.items():
                print(f"## {model}\n")
                print(tables.to_markdown(claims_table(claim_results)), end="")
                print("\n" + verdict_counts(claim_results) + "\n")
            for path in write_claims(by_model, results / "claims", frames):
                print(f"wrote: {path}")
            return 0
        if args.dir is None:
            raise ReportError("DIR=(missing): give a folder of runs, or --claims / --regenerate / --archive")
        result = build_report(args.dir, args.out, args.seed, args.resamples)
    except ReportError as err:
        print(f"kvbench.report: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # claims schema errors name the claim and field; damaged archives
        print(f"kvbench.report: error: {err}", file=sys.stderr)
        return 2
    except atomic.WriteError as err:  # a full disk, a read-only folder: the file and the reason
        print(f"kvbench.report: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "kvbench.report: interrupted; each file is either as it was or completely rewritten; "
            "the same command finishes the job",
            file=sys.stderr,
        )
        return 130
    if args.wandb:
        from kvbench.logger import log_report

        log_report(result)
    print(f"report: {result['out'] / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
