"""What ``python -m kvbench.reproduce`` prints and records: each node's jobs and the dry run's table
with its total, and the summary a run writes beside its logs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbench.node_plan import PROFILE_DEVICE, NodePlan
from kvbench.results import format_table


def _cost(seconds: float, profile: str) -> str:
    return f"{seconds / 60:.1f} min" if PROFILE_DEVICE[profile] == "cpu" else f"{seconds / 3600:.2f} GPU h"


def _cost_column(profile: str) -> str:
    return "est_min" if PROFILE_DEVICE[profile] == "cpu" else "est_gpu_h"


def _cost_value(seconds: float, profile: str) -> float:
    return round(seconds / 60, 1) if PROFILE_DEVICE[profile] == "cpu" else round(seconds / 3600, 2)


def format_jobs(plan: NodePlan) -> str:
    """The node's jobs, one line each."""
    head = f"{plan.node}" + (f" (+experiment={plan.config_name})" if plan.config_name else "")
    if plan.error:
        return f"{head}: {plan.error}"
    lines = [f"{head}: {len(plan.jobs)} jobs, {len(plan.runs)} runs, output {plan.output_root}"]
    width = max((len(j.label) for j in plan.jobs), default=0)
    for i, job in enumerate(plan.jobs):
        if job.same_as is not None:
            state = f"same run as job {job.same_as}"
        elif job.complete:
            state = f"{job.samples} samples, done"
        else:
            state = f"{job.samples} samples, {job.done} stored, {job.seconds:.0f} s/sample ({job.source})"
        lines.append(f"  {i:>3}  {job.label.ljust(width)}  {state}")
    return "\n".join(lines)


def summary_rows(plans: Sequence[NodePlan]) -> list[dict[str, Any]]:
    rows = []
    for p in plans:
        per_job = sorted({j.samples for j in p.jobs})
        rows.append(
            {
                "node": p.node,
                "jobs": len(p.jobs) if not p.error else "-",
                "runs": len(p.runs) if not p.error else "-",
                "samples/job": "/".join(map(str, per_job)) if per_job and not p.error else "-",
                "todo": p.todo if not p.error else "-",
                _cost_column(p.profile): _cost_value(p.estimate_s(), p.profile) if not p.error else "-",
                "status": p.error or ("done" if p.complete else "to run"),
            }
        )
    return rows


def dry_run(plans: Sequence[NodePlan], say=print) -> None:
    for plan in plans:
        say(format_jobs(plan))
        say("")
    say(format_table(summary_rows(plans)))
    ok = [p for p in plans if not p.error]
    profile = plans[0].profile if plans else "cpu"
    total = sum(p.estimate_s() for p in ok)
    say(
        f"total: {sum(len(p.jobs) for p in ok)} jobs, {sum(len(p.runs) for p in ok)} runs, "
        f"{sum(p.todo for p in ok)} samples to run, about {_cost(total, profile)}"
        + (f"; {len(plans) - len(ok)} node(s) cannot run" if len(ok) < len(plans) else "")
    )
    if PROFILE_DEVICE[profile] == "cpu" and any(j.source == "model" for p in ok for j in p.runs):
        say("(modelled times are an idle machine's; runs recorded here beside other jobs took 3-10x longer)")


def write_summary(
    path: Path, args, table: str, began: str, seconds: float, failed, threads, parallel
) -> None:
    """The run's own record of what it ran and how long it took (``<runs>/.reproduce/<profile>/
    summary.md``): a timing of this machine, kept beside the logs, never under ``results/``."""
    from kvbench.run import _git_commit

    chosen = "".join(f"; --{k} {' '.join(v)}" for k, v in (("only", args.only), ("skip", args.skip)) if v)
    lines = [
        f"# python -m kvbench.reproduce --profile {args.profile}",
        "",
        f"- started: {began}; wall time in all: {seconds / 60:.1f} min ({seconds:.0f} s)",
        f"- nodes at once: {parallel}; threads per node: {threads or 'default'}; cores: {os.cpu_count()}",
        f"- commit: {_git_commit()}{chosen}",
        f"- failed: {', '.join(failed) if failed else 'none'}",
        "",
        "```",
        table,
        "```",
        "",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
