"""``python -m kvbench.reproduce``: every experiment node, then the archives and every table.

    python -m kvbench.reproduce                          # every node at its CPU size (make reproduce)
    python -m kvbench.reproduce --dry-run                # the jobs, what is done, the estimated cost
    python -m kvbench.reproduce --only semkv_cliff kivi_gsm8k --threads 2
    python -m kvbench.reproduce --skip kivi_gsm8k --parallel 2
    python -m kvbench.reproduce --profile strong         # the nodes' second-model variants (CPU)
    python -m kvbench.reproduce --profile paper --dry-run                 # GPU hours at the papers' sizes
    python -m kvbench.reproduce --profile paper --launcher slurm --override hydra.launcher.partition=gpu

The nodes are the files ``kvbench/conf/experiment/*.yaml`` (sub-folders are not nodes: ``arms/``
holds method nodes, ``paper/`` the paper settings), found anew on every call, so a node added later
is picked up without a list to edit. Each runs as ``python -m kvbench -m +experiment=NAME`` in a
subprocess, one after another (``--parallel P``: P at once; ``--threads N`` sets
``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` of each, by default the machine's cores shared among the P).
A node that fails is reported and the others still run; then ``python -m kvbench.report --archive
RUNS`` stores the per-sample archives and ``python -m kvbench.report --regenerate`` rewrites every
table, figure and claim verdict from them. The summary table gives each node's jobs, wall seconds
and status; the exit status is 1 when any node or step failed, 2 on bad arguments (an unknown node
in ``--only``/``--skip`` is one line listing the known ones).

Resuming. A run folder's id is a hash of its config and a rerun skips the samples it holds (and,
when all are there, the model load too). On top of that, a node whose every run folder already
holds ``metrics.json`` (written after the last sample) is not started at all: its status is
``done``. So a second ``make reproduce`` redoes nothing and starts only what is missing.

Profiles. ``--profile cpu`` (default) runs each node as it is: the node is the CPU setting. The paper
setting of node NAME is ``conf/experiment/paper/NAME.yaml``, a variant that includes the node
(``defaults: [/experiment/NAME, override /model: ..., _self_]``) and changes only the model, the
context lengths and the sample counts (with ``analysis.n`` to match); its header says where each
value comes from. It composes with plain Hydra: ``python -m kvbench -m +experiment=paper/NAME
hydra/launcher=slurm`` is what ``--profile paper --launcher slurm`` runs. A variant beside the node
keeps each paper setting in one file next to what it changes, inherits everything else (arms, sweep,
analysis plan, output folder), and needs no machinery: a global ``+profile=paper`` group would have
to hold every node's settings in one place, or select a per-node file through a defaults-list
interpolation on the experiment choice, which Hydra does not offer for an appended group. Paper runs
write into the node's own output folder and analysis unit under the paper's model name, so the
claims are evaluated on that model. A node without a paper variant fails under ``--profile paper``
(one line naming the file to add).

The second model (``--profile strong``). The claims the default model floors (FP16 scores 0 on
GSM8K, so KIVI's GSM8K claims are "not testable here") and some whose direction the default model
leaves open are run again on a stronger CPU model: ``conf/experiment/strong/NAME.yaml`` is a variant
like the paper ones (``defaults: [/experiment/NAME, override /model: ..., _self_]``) that changes the
model and the sizes. Only some nodes have one; ``--profile strong`` runs those and leaves the others
out. Its runs write into the node's own output folder and archive under the second model's name,
so the claims page gains that model's verdicts beside the default's. The cost is CPU minutes, the
cost model scaled by ``(parameters / CPU_MODEL_PARAMETERS) ** CPU_MODEL_EXPONENT``: sublinear,
because on two cores a small model's step is dominated by dispatch, not by its weights. The
exponent is fitted to the FP16 GSM8K pilots, against the model's own estimate for the default
model: it models 52 s and 82 s per problem for Qwen2.5-Coder 0.5B and 1.5B, which ran 53 s and
87 s (3.7x and 11.4x the default model's parameters).
``make reproduce`` runs the CPU profile only: archiving it replaces the default model's rows and
keeps the second model's (``kvbench.analysis.archive.merge_models``).

The package, one job per module: :mod:`~kvbench.reproduce.nodes` (the nodes and the profiles'
variants), :mod:`~kvbench.reproduce.pricing` (samples per job and the cost model),
:mod:`~kvbench.reproduce.plan` (a node's jobs composed, what is stored, the dry run's plan),
:mod:`~kvbench.reproduce.summary` (the dry run's tables and the run's summary); running the nodes and
the command line are here. Every name is importable from ``kvbench.reproduce``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.node_plan import NodePlan
from kvbench.paths import CONF_DIR, default_results
from kvbench.reproduce.nodes import (  # noqa: F401
    PARTIAL_PROFILES,
    PROFILES,
    VARIANT_FOLDER,
    ReproduceError,
    config_name,
    discover,
    profile_nodes,
    select,
)
from kvbench.reproduce.plan import OVERRIDE_REFUSED, plan_node  # noqa: F401
from kvbench.reproduce.pricing import (  # noqa: F401
    CPU_MODEL_EXPONENT,
    CPU_MODEL_PARAMETERS,
    CPU_PREFILL_S_PER_KTOK,
    CPU_STEP_S,
    GPU_BYTES_PER_S,
    GPU_FLOPS,
    GPU_STEP_FLOOR_S,
    method_cost,
    model_shape,
    modelled_seconds,
    sample_work,
    samples_per_job,
    stored_seconds,
)
from kvbench.reproduce.summary import dry_run, format_jobs, summary_rows, write_summary  # noqa: F401
from kvbench.results import format_table

DEFAULT_RUNS = "results/runs"


def run_command(cmd: list[str], env: dict[str, str], log: Path | None = None) -> int:
    """Run one command to its end; its exit status. Output goes to the terminal, or to ``log``."""
    if log is None:
        return subprocess.run(cmd, env=env, check=False).returncode
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as handle:
        return subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, check=False).returncode


def node_command(name: str, launcher: str | None, overrides: Sequence[str]) -> list[str]:
    cmd = [sys.executable, "-m", "kvbench", "-m", f"+experiment={name}"]
    if launcher:
        cmd.append(f"hydra/launcher={launcher}")
        if not any(o.startswith("hydra.launcher.points_per_job=") for o in overrides):
            # a node's arms share model and task: one job per group of them shares the model load,
            # the prefills and the calibrations on a cluster as the local run does
            cmd.append("hydra.launcher.points_per_job=auto")
    return [*cmd, *overrides]


def thread_env(threads: int | None) -> dict[str, str]:
    env = dict(os.environ)
    if threads:
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env[key] = str(threads)
    return env


@dataclass
class Outcome:
    node: str
    jobs: Any
    seconds: float
    status: str

    @property
    def failed(self) -> bool:
        return not (self.status == "ok" or self.status.startswith("done"))


def _run_node(plan: NodePlan, args, env: dict[str, str], log: Path | None, say) -> Outcome:
    cmd = node_command(plan.config_name, args.launcher, args.override or [])
    say(f"reproduce: {plan.node}: {' '.join(cmd[1:])}" + (f" (log: {log})" if log else ""))
    started = time.perf_counter()
    try:
        code = run_command(cmd, env, log)
    except OSError as err:
        code, why = -1, str(err)
    else:
        why = f"exit {code}"
    seconds = time.perf_counter() - started
    status = "ok" if code == 0 else f"failed ({why})"
    say(f"reproduce: {plan.node}: {status} after {seconds:.0f} s")
    return Outcome(plan.node, len(plan.jobs), seconds, status)


def reproduce(args, say=print) -> int:
    """Run the selected nodes, then archive and regenerate; print the summary; the exit status."""
    nodes = profile_nodes(
        select(discover(args.conf_dir), args.only, args.skip), args.profile, args.only, args.conf_dir
    )
    overrides = args.override or []
    plans = []
    for node in nodes:
        plan = NodePlan(node, args.profile)
        try:
            plan.config_name = config_name(node, args.profile, args.conf_dir)
        except ValueError as err:
            plan.error = str(err)
        else:
            # Only a node that has stored runs can be complete: compose its jobs to find out.
            probe = plan_node(node, args.profile, overrides, compose=False, conf_dir=args.conf_dir)
            if probe.output_root and Path(probe.output_root).is_dir():
                full = plan_node(node, args.profile, overrides, compose=True, conf_dir=args.conf_dir)
                plan = full if not full.error else plan
            else:
                plan.jobs = probe.jobs
        plans.append(plan)

    began, began_utc = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    parallel = max(1, args.parallel)
    threads = args.threads or (max(1, (os.cpu_count() or 1) // parallel) if parallel > 1 else None)
    env = thread_env(threads)
    logs = Path(args.runs) / ".reproduce" / args.profile
    outcomes: dict[str, Outcome] = {}
    to_run = []
    for plan in plans:
        if plan.error:
            outcomes[plan.node] = Outcome(plan.node, "-", 0.0, f"failed ({plan.error})")
            say(f"reproduce: {plan.node}: {plan.error}")
        elif plan.complete:
            outcomes[plan.node] = Outcome(plan.node, len(plan.jobs), 0.0, "done (every run stored)")
            say(f"reproduce: {plan.node}: every run is stored; not started")
        else:
            to_run.append(plan)
    if parallel == 1:
        for plan in to_run:
            outcomes[plan.node] = _run_node(plan, args, env, None, say)
    else:
        # print writes the line and its newline separately: two lanes unlocked can splice lines
        lock = threading.Lock()

        def locked_say(text: str) -> None:
            with lock:
                say(text)

        with ThreadPoolExecutor(max_workers=parallel) as pool:
            futures = {
                p.node: pool.submit(_run_node, p, args, env, logs / f"{p.node}.log", locked_say)
                for p in to_run
            }
            for node, future in futures.items():
                outcomes[node] = future.result()

    steps = []
    if not args.no_report:
        results = ["--results", args.results] if args.results else []
        for step, extra in (("archive", ["--archive", args.runs]), ("regenerate", ["--regenerate"])):
            cmd = [sys.executable, "-m", "kvbench.report", *extra, *results]
            say(f"reproduce: {step}: {' '.join(cmd[1:])}")
            started = time.perf_counter()
            code = run_command(cmd, dict(os.environ))
            status = "ok" if code == 0 else f"failed (exit {code})"
            steps.append(Outcome(f"[{step}]", "-", time.perf_counter() - started, status))

    table = [*(outcomes[n] for n in nodes), *steps]
    text = format_table(
        [{"node": o.node, "jobs": o.jobs, "wall_s": round(o.seconds), "status": o.status} for o in table]
    )
    say("")
    say(text)
    total = time.perf_counter() - began
    say(f"reproduce: {total / 60:.1f} min in all")
    failed = [o.node for o in table if o.failed]
    write_summary(logs / "summary.md", args, text, began_utc, total, failed, threads, parallel)
    if failed:
        say(f"reproduce: {len(failed)} failed: {', '.join(failed)}")
        return 1
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kvbench.reproduce",
        description="Run every experiment node, then archive the runs and regenerate every table.",
    )
    p.add_argument("--profile", choices=PROFILES, default="cpu", help="node sizes (default: %(default)s)")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these nodes")
    p.add_argument("--skip", nargs="+", metavar="NAME", help="leave these nodes out")
    p.add_argument(
        "--dry-run", action="store_true", help="list the jobs, what is stored and the cost; run nothing"
    )
    p.add_argument("--threads", type=int, help="OMP/MKL threads of each node's process")
    p.add_argument("--parallel", type=int, default=1, metavar="P", help="node processes at once (default: 1)")
    p.add_argument(
        "--launcher", help="hydra/launcher for every node (slurm, slurm_cpu, kvbench_local, kvbench_slurm)"
    )
    p.add_argument(
        "--override", action="append", metavar="KEY=VALUE", help="Hydra override for every node (repeatable)"
    )
    p.add_argument("--runs", default=DEFAULT_RUNS, help="run folders to archive (default: %(default)s)")
    p.add_argument("--results", help="results folder of the archives and tables (default: kvbench.report's)")
    p.add_argument("--no-report", action="store_true", help="skip the archive and regenerate steps")
    p.add_argument("--conf-dir", default=str(CONF_DIR), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.threads is not None and args.threads < 1:
            raise ReproduceError(f"--threads={args.threads}: a positive integer")
        if args.parallel < 1:
            raise ReproduceError(f"--parallel={args.parallel}: a positive integer")
        if args.dry_run:
            nodes = select(discover(args.conf_dir), args.only, args.skip)
            nodes = profile_nodes(nodes, args.profile, args.only, args.conf_dir)
            results = args.results or default_results()
            plans = [
                plan_node(n, args.profile, args.override or [], conf_dir=args.conf_dir, results=results)
                for n in nodes
            ]
            dry_run(plans)
            refused = [p for p in plans if p.error and p.error.startswith(OVERRIDE_REFUSED)]
            if refused:
                raise ReproduceError(f"{refused[0].error} (node {refused[0].node}; {len(refused)} node(s))")
            return 0
        return reproduce(args)
    except ReproduceError as err:
        print(f"kvbench.reproduce: error: {err}", file=sys.stderr)
        return 2
