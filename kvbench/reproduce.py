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

Dry run (``--dry-run``). Every job of every selected node, in Hydra's basic-sweeper order (the
product of the node's ``hydra.sweeper.params`` and any ``--override`` sweep), each composed to find
its run folder: jobs that map to one run (FP16 ignores ``bits``) are marked, and samples already
stored are counted. Then a table per node: jobs, distinct runs, samples per job, samples still to
run, and the estimated cost of what is left, with a total. Samples per job are what the job's task
declares for its config (``Task.planned_samples``: NIAH's lengths x depths, the windows of the
windowed tasks, GSM8K's 1319 test problems, ``limit`` applied), else the plan's declared
``analysis.n``.

Cost estimate, seconds per sample, in this order:

1. stored: the mean ``seconds`` of the node's stored rows for the same model and method label (its
   archive ``results/NAME/samples.csv.gz`` and the run folders under its ``output.root``), else for
   the same model in the node;
2. a cost model of the work in one sample, as the task declares it (``Task.sample_work``, a
   :class:`kvbench.tasks.Work`): ``T`` prompt tokens prefilled, ``S`` forward steps after it, the
   mean cache length ``t`` of those steps, and a factor for work beyond them (the PG-19 hit rate
   simulates every policy at every measured position and layer). A task that declares nothing
   costs ``T`` = 1024, ``S`` = 32.

   CPU (the default model on this 2-core machine): ``5 s x T/1000 + 0.1 s x S``, fitted to the FP16
   NIAH runs recorded here (12 s per 2K-token sample with 32 new tokens, 7 s per 1K-token sample),
   times the method's ``cost_cpu`` (a class attribute of its config: 1 for FP16, 1.3 by default,
   more where the method says why). Measured once more for this estimate: a 1K-token NIAH sample
   under ``nice -n 19`` beside a long experiment took 68 s (the model says 7 s), and the records
   made beside other jobs show 3-10x, so the dry run says so under a modelled CPU total.

   GPU (the papers' 7-8B models in float16 on one A100/H100-class GPU, assumed, not measured):
   prefill ``(2 P T + 2 L d T^2) / 150 TFLOP/s`` (P parameters, L layers, d model width: the
   weights' and the causal attention's multiply-adds at about half of peak), each step
   ``max(25 ms, (2 P + k t) / 1.5 TB/s)`` (the float16 weights and the cache of ``t`` tokens, ``k``
   bytes per token, read once per step; 25 ms is an eager-mode step's floor), times the method's
   ``cost_gpu`` (2 by default: its cache is read and dequantized by unfused torch code). Each run
   adds its model load (CPU 15 s, GPU 120 s). P, L, d and k come from the model node's ``shape``; a
   node without one is taken from the ``NNb`` in its name with a 7B-class shape.

The CPU profile prints minutes, the paper profile GPU hours. The claims page's Sizing section
(``kvbench.analysis.sizing.node_sizing``) prices each node at the n its claims need through the
same stored times (``stored_job_seconds``) and per-run load (``NodePlan.estimate_s``), both in
:mod:`kvbench.node_plan` with the plan itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.node_plan import PROFILE_DEVICE, Job, NodePlan, add_seconds, frame_seconds, stored_job_seconds
from kvbench.paths import CONF_DIR, default_results
from kvbench.results import format_table

PROFILES = ("cpu", "strong", "paper")
# The folder under conf/experiment holding each profile's variants; None: the node itself.
VARIANT_FOLDER = {"cpu": None, "strong": "strong", "paper": "paper"}
# Profiles whose variants exist for some nodes only: the others are left out, not failed.
PARTIAL_PROFILES = ("strong",)
# The CPU cost model is fitted on the default model: other models scale by their parameters.
CPU_MODEL_PARAMETERS = 1.35e8
CPU_MODEL_EXPONENT = 0.4
DEFAULT_RUNS = "results/runs"

# Cost model constants (see the module docstring; the model load per run: kvbench.node_plan).
CPU_PREFILL_S_PER_KTOK = 5.0
CPU_STEP_S = 0.1
GPU_FLOPS = 150e12
GPU_BYTES_PER_S = 1.5e12
GPU_STEP_FLOOR_S = 0.025


class ReproduceError(Exception):
    """Bad arguments: printed as one line, exit status 2."""


# ------------------------------------------------------------------------------------------ nodes


def discover(conf_dir: str | Path = CONF_DIR) -> list[str]:
    """Every experiment node: ``conf/experiment/*.yaml`` (not the sub-folders: arms, variants)."""
    return sorted(p.stem for p in (Path(conf_dir) / "experiment").glob("*.yaml"))


def select(nodes: Sequence[str], only: Sequence[str] | None, skip: Sequence[str] | None) -> list[str]:
    """``nodes`` restricted to ``only`` (in the conf folder's order) and without ``skip``; an unknown
    name in either is a ReproduceError listing the known nodes."""
    for flag, names in (("--only", only), ("--skip", skip)):
        unknown = [n for n in names or [] if n not in nodes]
        if unknown:
            raise ReproduceError(
                f"{flag}: unknown node {', '.join(unknown)}; known nodes: {', '.join(nodes)}"
            )
    chosen = [n for n in nodes if not only or n in only]
    return [n for n in chosen if n not in (skip or [])]


def profile_nodes(
    nodes: Sequence[str], profile: str, only: Sequence[str] | None, conf_dir: str | Path = CONF_DIR
) -> list[str]:
    """``nodes`` that ``profile`` runs: all of them, except under a profile whose variants exist for
    some nodes only (``strong``), where a node without one is left out unless ``--only`` names it
    (then it fails with the file to add)."""
    folder = VARIANT_FOLDER[profile]
    if profile not in PARTIAL_PROFILES or folder is None:
        return list(nodes)
    return [
        n
        for n in nodes
        if (only and n in only) or (Path(conf_dir) / "experiment" / folder / f"{n}.yaml").is_file()
    ]


def config_name(node: str, profile: str, conf_dir: str | Path = CONF_DIR) -> str:
    """The ``+experiment=`` choice of ``node`` under ``profile``: ``NAME`` or ``paper/NAME``.
    ValueError (one line) when the profile's variant does not exist."""
    folder = VARIANT_FOLDER[profile]
    if folder is None:
        return node
    path = Path(conf_dir) / "experiment" / folder / f"{node}.yaml"
    if not path.is_file():
        raise ValueError(f"no {profile} setting: add conf/experiment/{folder}/{node}.yaml")
    return f"{folder}/{node}"


# -------------------------------------------------------------------------------------- samples


def _task(config: dict[str, Any]):
    """``(Task class, its built config)`` of the job's task node, or ``(None, None)`` for a node that
    names no registered task."""
    from kvbench.config import build_config
    from kvbench.tasks import TASKS

    node = dict(config.get("task") or {})
    name = node.get("name")
    if not isinstance(name, str) or name not in TASKS:
        return None, None
    cls = TASKS.get(name)
    return cls, build_config(cls.Config, node, "task")


def samples_per_job(config: dict[str, Any]) -> int:
    """Samples one job runs: what its task declares for its config (``Task.planned_samples``), else
    the experiment's declared ``analysis.n``."""
    declared = int((config.get("analysis") or {}).get("n") or 1)
    cls, task = _task(config)
    n = cls.planned_samples(task) if cls is not None else None
    return declared if n is None else n


def sample_work(config: dict[str, Any]):
    """The work in one sample (:class:`kvbench.tasks.Work`: prompt tokens prefilled, forward steps
    after the prefill, the mean cache length of those steps, a factor for work beyond them), as the
    job's task declares it (``Task.sample_work``)."""
    from kvbench.tasks import Work

    cls, task = _task(config)
    return cls.sample_work(task) if cls is not None else Work(1024, 32, 1024)


def model_shape(model: dict[str, Any] | None) -> tuple[float, float, float, float]:
    """``(parameters, layers, model width, float16 KV bytes per token)`` from the model node's
    ``shape``; a node without one is taken from the ``NNb`` in its name with a 7B-class shape."""
    from kvbench.config import build_config
    from kvbench.models import ModelConfig

    cfg = build_config(ModelConfig, model, "model")
    if cfg.shape is not None:
        shape = cfg.shape
        return shape["parameters"], shape["layers"], shape["hidden_size"], cfg.kv_bytes_per_token()
    size = re.search(r"(\d+(?:\.\d+)?)b\b", str(cfg.name).lower())
    params = float(size.group(1)) * 1e9 if size else 7e9
    return params, 32, 4096, 2 * 32 * 8 * 128 * 2


def method_cost(config: dict[str, Any], profile: str) -> float:
    """The job's method's seconds per sample against FP16's (``cost_cpu``/``cost_gpu`` of its config)."""
    from kvbench.methods import build_method

    method = build_method(config.get("method")).config
    return method.cost_cpu if PROFILE_DEVICE[profile] == "cpu" else method.cost_gpu


def modelled_seconds(config: dict[str, Any], profile: str) -> float:
    """Seconds per sample from the cost model (module docstring)."""
    work = sample_work(config)
    factor = work.factor * method_cost(config, profile)
    params, layers, width, kv_bytes = model_shape(config.get("model"))
    if PROFILE_DEVICE[profile] == "cpu":
        scale = (params / CPU_MODEL_PARAMETERS) ** CPU_MODEL_EXPONENT
        return factor * scale * (CPU_PREFILL_S_PER_KTOK * work.prompt / 1000 + CPU_STEP_S * work.steps)
    prefill = (2 * params * work.prompt + 2 * layers * width * work.prompt**2) / GPU_FLOPS
    step = max(GPU_STEP_FLOOR_S, (2 * params + kv_bytes * work.context) / GPU_BYTES_PER_S)
    return factor * (prefill + work.steps * step)


# ---------------------------------------------------------------------------------------- stored


def _rows(path: Path):
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("sample_id"), str):
            yield row


def stored_seconds(node: str, output_root: str | Path, results: str | Path) -> dict[tuple, list[float]]:
    """``{(model, method label): [seconds per sample, ...]}`` from the node's archive and the run
    folders under its output root."""
    found: dict[tuple, list[float]] = {}
    archive = Path(results) / node
    if (archive / "samples.csv.gz").is_file():
        from kvbench.analysis.archive import read_archive

        try:
            found = frame_seconds(read_archive(archive))
        except (OSError, ValueError):
            pass
    root = Path(output_root)
    if root.is_dir():
        for path in root.rglob("samples.jsonl"):
            for row in _rows(path):
                add_seconds(found, row.get("model"), row.get("method"), row.get("seconds"))
    return found


# ----------------------------------------------------------------------------------------- plans


def _run_folder(config: dict[str, Any]) -> tuple[Path, str, str]:
    """``(folder, method label, model name)`` the run of ``config`` writes, as
    :func:`kvbench.run.plan_run` names it, without reading data or model files."""
    from kvbench.config import build_config
    from kvbench.methods import build_method
    from kvbench.models import ModelConfig
    from kvbench.results import run_id
    from kvbench.spec import run_config, run_folder

    config = run_config(config)
    method = build_method(config.get("method"))
    label = method.label()
    model = build_config(ModelConfig, config.get("model"), "model").name
    seed = config.get("seed", 0)
    rid = run_id(config, method.config)
    folder = run_folder(config["output"]["root"], config["task"]["name"], model, label, seed, rid)
    return folder, label, model


def _stored_progress(folder: Path) -> tuple[int, bool]:
    """(samples stored, finished) of a run folder."""
    if not folder.is_dir():
        return 0, False
    done = {r["sample_id"] for r in _rows(folder / "samples.jsonl")}
    return len(done), (folder / "metrics.json").is_file()


def _planning_overrides(overrides: Sequence[str]) -> list[str]:
    # The launcher and its knobs change where a job runs, not what it computes or writes.
    return [o for o in overrides if not o.lstrip("+~").startswith("hydra")]


# How a node's plan says that the user's --override makes one of its points invalid.
OVERRIDE_REFUSED = "--override: "


def plan_node(
    node: str,
    profile: str = "cpu",
    overrides: Sequence[str] = (),
    compose: bool = True,
    conf_dir: str | Path = CONF_DIR,
    results: str | Path | None = None,
) -> NodePlan:
    """The jobs ``node`` launches under ``profile``. With ``compose`` every job is composed to find
    its run folder, what is stored there and its cost; without, only the first job is (job count,
    samples per job and the cost model hold for the node). Errors land in ``NodePlan.error``."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from kvbench.__main__ import job_config, sweep_jobs
    from kvbench.errors import ConfigError

    plan = NodePlan(node, profile)
    try:
        plan.config_name = config_name(node, profile, conf_dir)
    except ValueError as err:
        plan.error = str(err)
        return plan
    argv = [f"+experiment={plan.config_name}", *_planning_overrides(overrides)]
    if overrides:  # the points are checked as runs (spec imports torch: only when asked)
        from kvbench.spec import RunSpec
    results = Path(results) if results is not None else default_results()
    try:
        with initialize_config_dir(config_dir=str(conf_dir), version_base="1.3", job_name="kvbench"):
            loader = GlobalHydra.instance().config_loader()
            sweep = sweep_jobs(argv)
            if sweep is None:
                plan.error = "the node's sweeper is not Hydra's basic sweeper: its jobs are not listed"
                return plan
            master, jobs = sweep
            plan.output_root = str(master.output.root)
            stored = stored_seconds(node, plan.output_root, results)
            folders: dict[Path, int] = {}
            plan.jobs = [Job(label, job_overrides) for label, job_overrides in jobs]
            for i, job in enumerate(plan.jobs):
                if i > 0 and not compose:
                    first = plan.jobs[0]
                    job.samples, job.seconds, job.source = first.samples, first.seconds, first.source
                    continue
                config = job_config(loader.load_sweep_config(master, job.overrides))
                if overrides:  # the user's --override: each point is checked as a run checks it
                    try:
                        RunSpec.from_config(config)
                    except ConfigError as err:
                        plan.error = f"{OVERRIDE_REFUSED}{err}"
                        return plan
                job.samples = samples_per_job(config)
                job.folder, job.method, job.model = _run_folder(config)
                if compose:
                    first_of_run = folders.setdefault(job.folder, i)
                    job.same_as = first_of_run if first_of_run != i else None
                    job.done, job.complete = _stored_progress(job.folder)
                known = stored_job_seconds(stored, job.model, job.method)
                if known is not None:
                    job.seconds, job.source = known
                else:
                    job.seconds = modelled_seconds(config, profile)
            if not compose:
                for job in plan.jobs:
                    job.folder = None
    except ConfigError as err:
        plan.error = str(err)
    except Exception as err:  # a node that does not compose is that node's failure, not the run's
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        plan.error = f"{type(err).__name__}: {first}"
    return plan


# ---------------------------------------------------------------------------------------- output


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


# ------------------------------------------------------------------------------------------- run


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
    p.add_argument("--launcher", help="hydra/launcher for every node (slurm, slurm_cpu, submitit_local)")
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


if __name__ == "__main__":
    sys.exit(main())
