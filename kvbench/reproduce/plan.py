"""A node's plan (:class:`kvbench.node_plan.NodePlan`): its jobs composed as Hydra's sweeper lists
them, each job's run folder, what is stored there, and the cost of what is left.

Dry run (``--dry-run``). Every job of every selected node, in Hydra's basic-sweeper order (the
product of the node's ``hydra.sweeper.params`` and any ``--override`` sweep), each composed to find
its run folder: jobs that map to one run (FP16 ignores ``bits``) are marked, and samples already
stored are counted. Then a table per node: jobs, distinct runs, samples per job, samples still to
run, and the estimated cost of what is left, with a total. Samples per job are what the job's task
declares for its config (``Task.planned_samples``: NIAH's lengths x depths, the windows of the
windowed tasks, GSM8K's 1319 test problems, ``limit`` applied), else the plan's declared
``analysis.n``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvbench.node_plan import Job, NodePlan, stored_job_seconds
from kvbench.paths import CONF_DIR, default_results
from kvbench.reproduce.nodes import config_name
from kvbench.reproduce.pricing import modelled_seconds, sample_rows, samples_per_job, stored_seconds


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
    done = {r["sample_id"] for r in sample_rows(folder / "samples.jsonl")}
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

    from kvbench.cli.compose import job_config, sweep_jobs
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
