"""Submitit launchers that see a whole sweep through and report it on the sweep's own terminal.

hydra-submitit-launcher waits on the points of a sweep one after another and re-raises the first
failure, so one bad point ends the wait with a submitit traceback in which kvbench's one-line error
is buried, and the points' summary tables stay in their job logs. With Slurm accounting off (common
on small clusters) its status polls also log a ``sacct`` warning every few seconds.

The launchers here keep the plugin's configuration (every ``hydra.launcher.*`` knob) and its
submission, and change what happens around a point:

- in the job, a failed point is caught and returned as a short message (a kvbench user error as
  its one line, anything else as its last traceback line, the full traceback going to the job log);
- on the submitting side, the launcher waits for every point, prints one line per failed point as
  it fails (naming its log file), then the summary table of all points, and exits 2 when every
  failure was a user error, 1 otherwise;
- Slurm job states come from ``squeue``, which needs no accounting, so no ``sacct`` is called;
- ``hydra.launcher.points_per_job`` (default 1: a job per point) lets one job hold several points
  that share model and task (their composed ``model`` and ``task`` nodes are equal), run one after
  another in one process. A process keeps what its points share (the loaded model, each prompt's
  prefill, KVQuant's calibration: :func:`kvbench.builder.load_kept`, :mod:`kvbench.cache.prefill`),
  so a group loads the model once and prefills each prompt once, as Hydra's basic launcher does for
  a whole sweep. ``auto`` puts all the points that share model and task in one job. Each point of
  a group is still a point of its own: its own Hydra job folder and number, its own one-line failure
  (which does not stop the group's other points), its own row in the summary. The job saves each
  point's result as the point ends (``<job>_point<N>_result.pkl`` beside submitit's result), so the
  sweep's terminal reports points as they finish and a job ended by the scheduler loses only the
  points it had not finished; on a timeout it requeues the points it has not finished, which skip
  every sample already done. ``timeout_min`` and ``array_parallelism`` count jobs, not points.

:func:`register` stores them under names of their own, ``hydra/launcher=kvbench_local`` and
``kvbench_slurm`` (``kvbench/conf/hydra/launcher/slurm*.yaml`` build on the latter). The plugin's
names, ``submitit_local`` and ``submitit_slurm``, stay the plugin's: a researcher who types them gets
the stock launchers, with the stock behaviour (and without ``points_per_job``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, LocalQueueConf, SlurmQueueConf

from kvbench.env import get_logger
from kvbench.errors import ConfigError

log = get_logger(__name__)

# Slurm states in which a job may still write its result (a requeued or preempted job runs again).
SLURM_ACTIVE = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "STOPPED",
    "SUSPENDED",
    "PREEMPTED",
    "RESV_DEL_HOLD",
}
# A job that ended COMPLETED has written its result, which a slow shared file system may show late;
# one that was cancelled or failed is given a moment only.
RESULT_GRACE_S = {"COMPLETED": 15.0}
OTHER_GRACE_S = 2.0


class PointError(Exception):
    """A failed sweep point, as the job reports it: one line, and whether it is a user error
    (``exit_code``: the status the point's run exited with, where it exited)."""

    def __init__(self, message: str, user_error: bool, exit_code: int | str | None = None):
        super().__init__(message, user_error, exit_code)
        self.message, self.user_error, self.exit_code = message, user_error, exit_code

    def __str__(self) -> str:
        return self.message


@dataclass
class Outcome:
    """How one point ended, as seen from the submitting side."""

    job_return: JobReturn | None
    state: str
    error: PointError | None = None
    log_file: str | None = None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no message"


POINTS_PER_JOB = "hydra.launcher.points_per_job"


def points_per_job(value: Any) -> int | str:
    """The knob's value checked: a whole number of points at least 1, or ``auto``; else ConfigError."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        return value
    raise ConfigError(
        POINTS_PER_JOB,
        value,
        "a whole number at least 1 (1: a job per point; N: up to N points that share model and task "
        "in one job), or auto (one job for all the points that share model and task)",
    )


def group_points(keys: Sequence[Any], per_job: int | str) -> list[list[int]]:
    """The sweep's points (by position) grouped into jobs: points with equal keys (model and task),
    in sweep order, at most ``per_job`` of them (``auto``: all); jobs ordered by their first point."""
    by_key: dict[Any, list[int]] = {}
    for position, key in enumerate(keys):
        by_key.setdefault(key, []).append(position)
    groups = []
    for members in by_key.values():
        size = len(members) if per_job == "auto" else int(per_job)
        groups += [members[start : start + size] for start in range(0, len(members), size)]
    return sorted(groups, key=lambda group: group[0])


def point_result_path(result_pickle: Path, num: int) -> Path:
    """Where a job holding several points saves point ``num``'s JobReturn as the point ends."""
    stem = result_pickle.name.removesuffix("_result.pkl")
    return result_pickle.with_name(f"{stem}_point{num}_result.pkl")


def _job_result_pickle() -> Path:
    """submitit's result file of the job this process runs."""
    import submitit

    return Path(submitit.JobEnvironment().paths.result_pickle)


class PointGroup:
    """What a job holding several points runs: each point through the launcher's own ``__call__``,
    one after another, each point's JobReturn saved as it ends; returns them by point number."""

    def __init__(self, launcher: _SweepLauncher):
        self.launcher = launcher
        self._done: list[int] = []

    def __call__(self, points: list[tuple]) -> dict[int, JobReturn]:
        returns = {}
        for count, args in enumerate(points, 1):
            overrides, num = args[0], args[2]
            print(
                f"kvbench: point #{num} ({count} of {len(points)} in this job): "
                f"{' '.join(filter_overrides(overrides)) or '-'}",
                file=sys.stderr,
                flush=True,
            )
            returns[num] = ret = self._run(args)
            error = ret._return_value if ret.status == JobStatus.FAILED else None
            if isinstance(error, PointError) and error.exit_code is not None:
                # The job is being ended (Ctrl-C, SIGTERM, submitit's requeue on a timeout): this
                # point and the rest are not run here; a requeued job runs them (checkpoint()).
                sys.exit(error.exit_code)
            self._save(ret, num)
            self._done.append(num)
        return returns

    def _run(self, args: tuple) -> JobReturn:
        try:
            return self.launcher(*args)
        except Exception as exc:  # raised outside the point's task (composing its config): this point only
            if isinstance(exc, ConfigError):
                print(f"kvbench: error: {exc}", file=sys.stderr)
                error = PointError(str(exc), user_error=True)
            else:
                traceback.print_exc(file=sys.stderr)
                error = PointError(_last_line(f"{type(exc).__name__}: {exc}"), user_error=False)
            return JobReturn(overrides=list(args[0]), status=JobStatus.FAILED, _return_value=error)

    @staticmethod
    def _save(ret: JobReturn, num: int) -> None:
        import cloudpickle

        try:
            path = point_result_path(_job_result_pickle(), num)
            tmp = path.with_name(f"{path.name}.tmp")
            with tmp.open("wb") as out:
                cloudpickle.dump(ret, out)
            os.replace(tmp, path)  # whole or not at all: the submitting side polls for it
        except Exception as err:  # the job's own result still carries it
            log.warning(f"point #{num}: its result could not be saved early ({err})")

    def checkpoint(self, points: list[tuple]) -> Any:
        """On a timeout or preemption: requeue the points not finished (finished samples are skipped)."""
        import submitit

        left = [args for args in points if args[2] not in self._done]
        return submitit.helpers.DelayedSubmission(PointGroup(self.launcher), left)


class _SweepLauncher(plugin.BaseSubmititLauncher):
    """Shared by the local and the Slurm launcher; subclasses say how a job's state is read."""

    def __init__(self, **params: Any) -> None:
        # kvbench's own knob: not a submitit parameter (checked when the sweep is launched)
        self.points_per_job = params.pop("points_per_job", 1)
        super().__init__(**params)

    # -- in the job ---------------------------------------------------------------------------------

    def __call__(
        self,
        sweep_overrides: list[str],
        job_dir_key: str,
        job_num: int,
        job_id: str,
        singleton_state: dict[type, Singleton],
    ) -> JobReturn:
        self._limit_threads()
        try:
            ret = super().__call__(sweep_overrides, job_dir_key, job_num, job_id, singleton_state)
        except SystemExit as stop:
            # kvbench's entry prints a user error as one line and exits 2 from inside the handler,
            # so the ConfigError it handled is the exit's context.
            cause = stop.__context__
            if isinstance(cause, ConfigError):
                error = PointError(str(cause), user_error=True)
            elif stop.code == 2:
                # Exit status 2 is a user error whose one line went to the log; the driver reads it there.
                error = PointError("", user_error=True)
            else:
                code = 0 if stop.code is None else stop.code
                error = PointError(f"exited with status {code}", user_error=False, exit_code=code)
            return JobReturn(overrides=sweep_overrides, status=JobStatus.FAILED, _return_value=error)
        if ret.status == JobStatus.FAILED:
            exc = ret._return_value
            if isinstance(exc, ConfigError):
                print(f"kvbench: error: {exc}", file=sys.stderr)
                error = PointError(str(exc), user_error=True)
            else:
                # Hydra keeps the exception but prints nothing: the job log gets the traceback.
                traceback.print_exception(exc, file=sys.stderr)
                error = PointError(f"{type(exc).__name__}: {exc}", user_error=False)
            # Sent back instead of the exception itself, which need not survive pickling.
            ret.return_value = error
        return ret

    def _limit_threads(self) -> None:
        # Where the scheduler does not pin a job to its CPUs, torch would start one thread per core
        # of the node, and points sharing a node would fight over every core.
        cpus = self.params.get("cpus_per_task")
        if isinstance(cpus, int) and cpus > 0:
            import torch

            if torch.get_num_threads() > cpus:
                torch.set_num_threads(cpus)

    # -- on the submitting side ---------------------------------------------------------------------

    def _executor(self) -> Any:
        import submitit

        init_keys = {"submitit_folder", "max_num_timeout"}
        generic = set(BaseQueueConf.__dataclass_fields__)
        init = {"folder": self.params["submitit_folder"]}
        if "max_num_timeout" in self.params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = self.params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        executor.update_parameters(
            **{
                (key if key in generic else f"{self._EXECUTOR}_{key}"): value
                for key, value in self.params.items()
                if key not in init_keys
            }
        )
        return executor

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        assert self.config is not None and job_overrides
        try:
            per_job = points_per_job(self.points_per_job)
        except ConfigError as err:
            print(f"kvbench: error: {err}", file=sys.stderr)
            sys.exit(2)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        indices = [initial_job_idx + i for i in range(len(job_overrides))]
        labels = _point_labels(job_overrides)
        if self.params.get("name") == self.config.hydra.job.name:
            # the plugin's default (the app's name): the scheduler's queue shows what runs instead
            self.params["name"] = job_name(self.config, job_overrides)
        executor = self._executor()
        state = Singleton.get_state()
        slots: list[tuple[Any, int | None]]  # each point's job, and its number where the job holds a group
        if per_job == 1:
            jobs = executor.map_array(
                self,
                [list(o) for o in job_overrides],
                ["hydra.sweep.dir"] * len(indices),
                indices,
                [f"job_id_for_{i}" for i in indices],
                [state] * len(indices),
            )
            slots = [(job, None) for job in jobs]
            held = ""
        else:
            points = [
                (list(o), "hydra.sweep.dir", i, f"job_id_for_{i}", state)
                for o, i in zip(job_overrides, indices, strict=True)
            ]
            groups = group_points(self._share_keys(job_overrides), per_job)
            jobs = executor.map_array(PointGroup(self), [[points[k] for k in group] for group in groups])
            slots = [(None, None)] * len(points)
            for job, group in zip(jobs, groups, strict=True):
                for k in group:
                    slots[k] = (job, indices[k])
            held = f" in {len(jobs)} job{'s' if len(jobs) > 1 else ''} (points_per_job={per_job})"
        log.info(
            f"{len(slots)} points submitted{held} ({self._EXECUTOR}, job {jobs[0].job_id.split('_')[0]}); "
            f"sweep folder {sweep_dir}"
        )
        try:
            outcomes = self._wait(slots, indices, labels)
        except KeyboardInterrupt:
            # A traceback would say nothing useful: say what goes on and how to pick the sweep up.
            where = ""
            if self._EXECUTOR == "slurm":
                ids = ",".join(sorted({job.job_id.split("_")[0] for job in jobs}))
                where = f" Slurm job {ids} goes on (scancel {ids} stops it);"
            print(
                f"kvbench: interrupted;{where} the same command again skips every finished sample",
                file=sys.stderr,
            )
            sys.exit(130)
        self._report(outcomes, indices, labels)
        failed = [o.error for o in outcomes if o.error is not None]
        if failed:
            # Hydra's sweeper would re-raise the first failure with its traceback; the lines above
            # already said everything.
            sys.exit(2 if all(e.user_error for e in failed) else 1)
        return [o.job_return for o in outcomes]

    def _share_keys(self, job_overrides: Sequence[Sequence[str]]) -> list[str]:
        """Each point's model and task as composed for it (what a job's points must share to share
        work); a point whose config does not compose gets a key of its own (its job says why)."""
        import json

        from omegaconf import OmegaConf

        keys = []
        for position, overrides in enumerate(job_overrides):
            try:
                assert self.hydra_context is not None and self.config is not None
                cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                nodes = [OmegaConf.select(cfg, name) for name in ("model", "task")]
                try:
                    parts = [
                        OmegaConf.to_container(n, resolve=True) if n is not None else None for n in nodes
                    ]
                except Exception:  # an interpolation only a job can resolve: compare them unresolved
                    parts = [OmegaConf.to_container(n) if n is not None else None for n in nodes]
                keys.append(json.dumps(parts, sort_keys=True, default=str))
            except Exception:
                keys.append(f"alone #{position}")
        return keys

    def _wait(
        self, slots: list[tuple[Any, int | None]], indices: list[int], labels: list[str]
    ) -> list[Outcome]:
        jobs = list({job.job_id: job for job, _ in slots}.values())
        outcomes: dict[int, Outcome] = {}
        ended_at: dict[str, float] = {}
        started = time.monotonic()
        while len(outcomes) < len(slots):
            states = self._states(jobs)
            for k, (job, num) in enumerate(slots):
                if k in outcomes:
                    continue
                outcome = _returned(job, num)
                if outcome is None and states.get(job.job_id) is not None:
                    ended_at.setdefault(job.job_id, time.monotonic())
                    grace = RESULT_GRACE_S.get(str(states[job.job_id]), OTHER_GRACE_S)
                    if time.monotonic() - ended_at[job.job_id] > grace:
                        state = states[job.job_id]
                        outcome = Outcome(None, state, PointError(f"ended by the scheduler ({state})", False))
                if outcome is None:
                    continue
                if outcome.error is not None:
                    outcome.log_file = str(job.paths.stderr)
                    if not outcome.error.message:
                        outcome.error.message = _user_error_in(job.paths.stderr)
                    print(_failure_line(indices[k], labels[k], outcome), file=sys.stderr, flush=True)
                outcomes[k] = outcome
            if len(outcomes) < len(slots):
                # Every second at first, then less often: a long sweep should not hammer the scheduler.
                time.sleep(min(30.0, 1.0 + (time.monotonic() - started) / 60))
        return [outcomes[k] for k in range(len(slots))]

    def _states(self, jobs: list[Any]) -> dict[str, str | None]:
        """Job id -> its final state once it has ended without a result, else None (still active)."""
        raise NotImplementedError

    def _report(self, outcomes: list[Outcome], indices: list[int], labels: list[str]) -> None:
        from kvbench.results import format_table

        rows = []
        for index, label, outcome in zip(indices, labels, outcomes, strict=True):
            row: dict[str, Any] = {"#": index, "point": label}
            if outcome.error is None:
                value = outcome.job_return.return_value if outcome.job_return is not None else None
                if isinstance(value, dict) or value is None:
                    row.update({k: v for k, v in (value or {}).items() if k != "folder"})
                else:  # objective=...: the number(s) the point returned to the sweeper
                    row["objective"] = value
            row["state"] = outcome.state
            row["log"] = outcome.log_file
            rows.append(row)
        print(format_table(rows), flush=True)


def _outcome(value: JobReturn) -> Outcome:
    if value.status == JobStatus.COMPLETED:
        return Outcome(value, "COMPLETED")
    return Outcome(value, "FAILED", value._return_value)


def _returned(job: Any, num: int | None) -> Outcome | None:
    """A point's outcome from what its job wrote, or None while there is nothing yet. ``num``: the
    point's number in a job that holds several (None: the job is the point)."""
    from submitit.core.utils import pickle_load

    if num is not None:
        saved = point_result_path(Path(job.paths.result_pickle), num)
        if saved.exists():
            return _outcome(pickle_load(saved))
    if not job.paths.result_pickle.exists():
        return None
    kind, value = pickle_load(job.paths.result_pickle)
    if kind != "success":  # raised outside the task (e.g. composing the point's config in the job)
        return Outcome(None, "FAILED", PointError(_last_line(value), user_error=False))
    if num is not None:
        value = value.get(num) if isinstance(value, dict) else None
        if value is None:
            return Outcome(None, "FAILED", PointError("its job ended without running it", user_error=False))
    return _outcome(value)


def _user_error_in(log_file: Path) -> str:
    """The last ``kvbench: error:`` line of a job's log, without its prefix."""
    prefix = "kvbench: error: "
    try:
        lines = log_file.read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    found = [line[len(prefix) :] for line in lines if line.startswith(prefix)]
    return found[-1] if found else "exited with status 2 (a user error; see the log)"


def _failure_line(index: int, label: str, outcome: Outcome) -> str:
    """The one line a failed point gets on the sweep's terminal."""
    assert outcome.error is not None
    if outcome.error.user_error:
        return f"kvbench: error: point #{index} ({label}): {outcome.error} [log: {outcome.log_file}]"
    return f"kvbench: point #{index} ({label}) {outcome.state}: {outcome.error} [log: {outcome.log_file}]"


JOB_NAME_MAX = 96  # squeue shows a few dozen characters; sacct stores more


def job_name(config: Any, job_overrides: Sequence[Sequence[str]]) -> str:
    """The scheduler's name for a sweep's job array: ``kvbench-<task>-<method>``, each the values the
    points take (``niah-kivi+uniform``; an experiment's arms by arm name), from the points'
    overrides or, where they set none, the sweep's config (no method: ``fp16``)."""
    from omegaconf import OmegaConf

    tasks: dict[str, None] = {}
    methods: dict[str, None] = {}
    for overrides in job_overrides:
        values = {}
        for override in overrides:
            key, _, value = override.lstrip("+~").partition("=")
            values[key] = value
        tasks[values.get("task") or str(OmegaConf.select(config, "task.name", default="task"))] = None
        method = values.get("method") or next((v for k, v in values.items() if k.endswith("@method")), None)
        methods[method or str(OmegaConf.select(config, "method.name", default="fp16"))] = None
    name = f"kvbench-{'+'.join(tasks)}-{'+'.join(methods)}"
    name = "".join(c if c.isalnum() or c in "+-_." else "_" for c in name)
    return name if len(name) <= JOB_NAME_MAX else name[: JOB_NAME_MAX - 3] + "..."


def _point_labels(job_overrides: Sequence[Sequence[str]]) -> list[str]:
    """Each point by the overrides that tell it apart from the others (all of them for one point)."""
    points = [list(filter_overrides(o)) for o in job_overrides]
    if len(points) == 1:
        return [" ".join(points[0]) or "-"]
    common = set.intersection(*(set(p) for p in points))
    return [" ".join(o for o in p if o not in common) or "-" for p in points]


class LocalSweepLauncher(_SweepLauncher):
    _EXECUTOR = "local"

    def _states(self, jobs: list[Any]) -> dict[str, str | None]:
        # A local job is a child process: once it is no longer running, its result is final.
        return {job.job_id: (None if not job.done() else job.state) for job in jobs}


class SlurmSweepLauncher(_SweepLauncher):
    _EXECUTOR = "slurm"
    _warned = False

    def _states(self, jobs: list[Any]) -> dict[str, str | None]:
        arrays = sorted({job.job_id.split("_")[0] for job in jobs})
        try:
            command = ["squeue", "--noheader", "--states=all", "--array", "--format=%i|%T"]
            out = subprocess.run(
                [*command, f"--jobs={','.join(arrays)}"],
                capture_output=True,
                text=True,
                timeout=60,
                check=True,
            ).stdout
        except (OSError, subprocess.SubprocessError) as err:
            if not self._warned:
                log.warning(f"squeue failed ({_last_line(str(err))}); waiting for the jobs' results only")
                self._warned = True
            return {}
        listed = dict(line.split("|", 1) for line in out.splitlines() if "|" in line)
        states: dict[str, str | None] = {}
        for job in jobs:
            state = listed.get(job.job_id)
            if state is None:
                # Gone from the controller's memory (MinJobAge) without writing a result.
                states[job.job_id] = "ENDED (no longer known to squeue)"
            else:
                state = state.split()[0]
                states[job.job_id] = None if state in SLURM_ACTIVE else state
        return states


# Hydra instantiates launchers only from the hydra_plugins package: hydra_plugins/kvbench_launcher
# holds the two concrete classes.
PLUGIN_MODULE = "hydra_plugins.kvbench_launcher"


@dataclass
class _LocalConf(LocalQueueConf):
    _target_: str = f"{PLUGIN_MODULE}.KvbenchLocalLauncher"
    points_per_job: Any = 1  # an int at least 1, or auto (checked by points_per_job())


@dataclass
class _SlurmConf(SlurmQueueConf):
    _target_: str = f"{PLUGIN_MODULE}.KvbenchSlurmLauncher"
    points_per_job: Any = 1


LAUNCHER_NAMES = {"kvbench_local": _LocalConf, "kvbench_slurm": _SlurmConf}


def register() -> None:
    """Store kvbench's launchers as ``hydra/launcher/kvbench_local`` and ``kvbench_slurm``.

    Their names are not the plugin's (``submitit_local``, ``submitit_slurm``), so Hydra's plugin
    scan, which stores the plugin's nodes again whenever it runs, neither undoes these entries nor
    is shadowed by them. Storing twice is harmless; ``hydra_plugins/kvbench_launcher`` also calls
    this when Hydra's scan imports it, so the names compose in any Hydra app of this environment.
    """
    import importlib.util

    from hydra.core.config_store import ConfigStore

    if importlib.util.find_spec(PLUGIN_MODULE) is None:
        # An install made before the plugin package existed: the launcher classes cannot be found.
        log.warning(
            f"{PLUGIN_MODULE} is not installed (pip install -e . again); "
            f"hydra/launcher={'/'.join(LAUNCHER_NAMES)} are not available"
        )
        return
    store = ConfigStore.instance()
    for name, node in LAUNCHER_NAMES.items():
        store.store(group="hydra/launcher", name=name, node=node(), provider="kvbench")
