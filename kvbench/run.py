"""One run: validate everything, load the model, build the method and the task, run the samples,
write the results.

No method or task logic lives here: both come from their registries, and the model, method and cache
factory come from the one run builder (:mod:`kvbench.builder`). :func:`plan_run` is the one place
where a configuration is checked; it reads the model's config.json and tokenizer but no weights and
writes nothing, so a bad input costs seconds and leaves no folder behind.

The top-level ``bits`` reaches the method through the run (:func:`run_config`): it fills the knob
the method's config names (``MethodConfig.bits_knob``) unless the node sets its own, so a method node
carries no ``bits: ${bits}`` line.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import kvbench
from kvbench import paths
from kvbench.config import build_config, check_choice, require, to_plain, unknown_key
from kvbench.data import resolve_data_root
from kvbench.errors import ConfigError, Interrupted, Terminated
from kvbench.kernels.cpu import backend_in_use
from kvbench.methods import Method, build_method
from kvbench.methods.base import with_run_bits
from kvbench.objective import check_objective, objective_names

# format_table lives with the results so that a sweep's driver can print a table without importing torch.
from kvbench.results import (  # noqa: F401
    RunFolder,
    _clean,
    analysis_plan,
    canonical_json,
    format_table,
    run_id,
)
from kvbench.tasks import Task, build_task

# Top-level keys other than RunConfig's own: nodes validated by their own dataclasses.
NODE_KEYS = ("model", "task", "method", "logger", "analysis")
SEED_LIMIT = 2**32  # numpy's generators take seeds below this; torch takes them too


RESUME_CHOICES = (True, False, "force")


@dataclass
class OutputConfig:
    """``resume``: true skips the samples a run folder already holds, provided the same code wrote
    them (commit, kvbench version, method and task versions); ``force`` accepts rows written by
    other code too, and the run records that it did (``provenance.json``); false reruns every
    sample."""

    root: str = "results/runs"
    resume: bool | str = True

    def __post_init__(self):
        require(
            isinstance(self.root, str) and self.root.strip() != "", "output.root", self.root, "a folder path"
        )
        require(
            any(self.resume is c or self.resume == c for c in RESUME_CHOICES if isinstance(c, str))
            or isinstance(self.resume, bool),
            "output.resume",
            self.resume,
            "true, false or force",
        )

    def check_root(self) -> None:
        """The root can be created and written (:func:`kvbench.paths.check_writable_folder`)."""
        paths.check_writable_folder("output.root", self.root, self.root)


@dataclass
class DataConfig:
    root: str | None = None


@dataclass
class RunConfig:
    """The top-level knobs (model, task and method nodes are validated by their own dataclasses)."""

    seed: int = 0
    bits: float | None = None
    device: str = "auto"
    output: OutputConfig = field(default_factory=OutputConfig)
    data: DataConfig = field(default_factory=DataConfig)
    # what the run returns to an optimizing sweeper (kvbench/objective.py): a name or a list of
    # names; null: its summary row
    objective: Any = None

    def __post_init__(self):
        # a negative or fractional seed would run, into a folder named seed-1 or seed1.5
        require(
            0 <= self.seed < SEED_LIMIT,
            "seed",
            self.seed,
            f"an int in 0..{SEED_LIMIT - 1}",
        )
        require(
            self.bits is None or self.bits > 0,
            "bits",
            self.bits,
            "a positive number (log2 of a level count), or null for the method's default",
        )
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        objective_names(self.objective)  # a name or a list of names; which names: the task's (plan_run)
        if self.device == "cuda" and not torch.cuda.is_available():
            why = "torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ConfigError("device", self.device, f"auto or cpu here: {why}")
        if isinstance(self.output, dict):
            self.output = build_config(OutputConfig, self.output, "output")
        if isinstance(self.data, dict):
            self.data = build_config(DataConfig, self.data, "data")

    def torch_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


def _git(*args: str) -> str | None:
    """``git ARGS`` in the package's folder: its stdout, or None outside a checkout."""
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _git_commit() -> str | None:
    return _git("rev-parse", "HEAD") or None


def _git_dirty() -> bool | None:
    """Whether tracked files differ from the commit (untracked files change no computation)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    return None if status is None else status != ""


def code_identity(method: Method, task: Any) -> dict[str, Any]:
    """What wrote a run's rows: the commit (and whether the checkout was modified), kvbench's
    version, and the method's and task's declared versions."""
    return {
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
        "kvbench": kvbench.__version__,
        "method_version": type(method.config).version,
        "task_version": getattr(task.config, "version", None),
    }


# The fields of code_identity that must agree for rows to be resumed (a dirty flag alone is noted).
SAME_CODE_KEYS = ("git_commit", "kvbench", "method_version", "task_version")


def _describe(code: dict[str, Any] | None) -> str:
    if code is None:
        return "code that left no record (a run from before provenance.json)"
    commit = (code.get("git_commit") or "no commit")[:10] + (" (modified)" if code.get("git_dirty") else "")
    return (
        f"commit {commit}, kvbench {code.get('kvbench')}, method v{code.get('method_version')}, "
        f"task v{code.get('task_version')}"
    )


def check_resume(folder: RunFolder, done: int, code: dict[str, Any], resume: bool | str) -> str | None:
    """Refuse (ConfigError) to add rows to ``done`` rows that other code wrote, unless ``resume``
    is ``force``; returns how the resume was accepted (None when nothing was mixed)."""
    if not done:
        return None
    sessions = folder.sessions()
    last = sessions[-1].get("code") if sessions else None
    if last is not None and all(last.get(k) == code[k] for k in SAME_CODE_KEYS):
        return None
    if resume == "force":
        warn(f"{folder.path}: resuming {done} rows written by {_describe(last)} with {_describe(code)}")
        return "force"
    raise ConfigError(
        "output.resume",
        resume,
        f"{folder.path} holds {done} rows written by {_describe(last)}; this is {_describe(code)}. "
        "Pass output.resume=force to add to them (the run records it), or use another output.root "
        "to start afresh",
    )


def versions() -> dict[str, Any]:
    import transformers

    return {
        "kvbench": kvbench.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_commit": _git_commit(),
        "git_dirty": _git_dirty(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def memory_summary(rows: list[dict]) -> dict[str, Any]:
    """Means over samples of the per-sample accounting (each row's cache at its end)."""
    mems = [r["memory"] for r in rows if r.get("memory")]
    summary = {
        k: _mean([m.get(k) for m in mems]) for k in ("effective_bits", "code_bits", "nominal_code_bits")
    }
    summary["compression"] = _mean([m.get("compression") for m in mems])
    summary["kv_bytes_mean"] = _mean([m.get("total_bytes") for m in mems])
    summary["fp16_bytes_mean"] = _mean([m.get("fp16_bytes") for m in mems])
    if mems:
        summary["last_sample_bytes_by_component"] = mems[-1].get("bytes_by_component")
    return summary


@dataclass
class RunPlan:
    """A validated run: what it computes, where its results go, and what it will warn about."""

    config: dict[str, Any]
    run: RunConfig
    model: Any  # a kvbench.models.ModelConfig
    method: Method
    task: Task
    data_root: Path
    samples: list[dict[str, Any]]
    run_id: str
    folder: Path
    model_checked: bool  # the checks against the model's shape and tokenizer ran on its files
    warnings: dict[str, str]


def run_config(cfg: Any) -> dict[str, Any]:
    """The plain config a run writes to config.json and hashes into its run id: ``cfg`` (a Hydra
    DictConfig or a dict) resolved, with the top-level ``bits`` in the method node's bits knob where
    the node leaves it unset (:func:`kvbench.methods.base.with_run_bits`)."""
    config = dict(to_plain(cfg))  # a copy: the caller's dict keeps its node as given
    if isinstance(config.get("method"), dict):
        config["method"] = with_run_bits(config["method"], config.get("bits"))
    return config


def bits_ignored(config: dict[str, Any], method: Method) -> dict[str, str]:
    """Where the top-level ``bits`` changes nothing: no method (the FP16 baseline), a method without
    a bits knob (``MethodConfig.bits_knob``), or a node that sets the knob to another value itself.
    ``config`` is the config as given, before :func:`run_config` fills the knob."""
    bits, node, knob = config.get("bits"), config.get("method"), method.config.bits_knob
    if bits is None:
        return {}
    if not node:
        why = "no +method was given, so this is the FP16 baseline"
    elif knob is None:
        why = f"{method.label()} has no bits"
    elif node.get(knob) is not None and node[knob] != bits:
        why = f"the method node sets method.{knob}={node[knob]:g}"
    else:
        return {}
    return {"bits_ignored": f"bits={bits:g} is ignored: {why}"}


def check_environment() -> None:
    """Every environment variable a run reads, through the reader its owner uses (each raises a
    ConfigError naming the variable): a bad value fails here, before anything loads, rather than
    where it is first used. ``KVBENCH_DATA_DIR`` is checked with the data root it stands for."""
    from kvbench.cache.blockwise import configured_block_size
    from kvbench.kernels.runtime import interpreting
    from kvbench.models.hub import hub_offline

    configured_block_size()
    paths.cache_dir()
    paths.user_config_dirs()  # KVBENCH_CONFIG_PATH: Hydra's search path skips a bad entry silently
    hub_offline()
    interpreting()


def check_conversion(model_cfg: Any) -> None:
    """A GGUF that is not converted yet will be converted into the cache when the model loads: the
    file must be whole and the cache writable, and nothing of the user's may sit where the
    conversion goes (:func:`kvbench.models.gguf.converted_dir` says so)."""
    from kvbench.models import gguf

    if model_cfg.source == "gguf" and gguf.needs_conversion(model_cfg):
        paths.check_cache_writable()
        gguf.check_gguf(model_cfg)


def plan_run(cfg: Any, checked_tasks: dict[str, list] | None = None) -> RunPlan:
    """Check a configuration (a Hydra DictConfig or a plain dict) against itself, the machine, the
    data and the model's files; raise ConfigError on the first problem. Cheapest checks first.

    ``checked_tasks`` lets a sweep check each distinct (task, model, data, seed) once: loading a
    task's samples can take seconds (lm-eval builds its dataset), and most sweeps vary the method."""
    from kvbench.logger import LoggerConfig
    from kvbench.models import ModelConfig, peek_model

    check_environment()
    given = to_plain(cfg)
    config = run_config(given)
    run_keys = [f.name for f in fields(RunConfig)]
    for key in config:
        if key not in run_keys and key not in NODE_KEYS:
            raise ConfigError(key, config[key], unknown_key(key, [*run_keys, *NODE_KEYS]))
    run_cfg = build_config(RunConfig, {k: config[k] for k in run_keys if k in config}, "")
    build_config(LoggerConfig, config.get("logger"), "logger")
    if config.get("analysis") is not None:
        analysis_plan(config["analysis"])
    method = build_method(config.get("method"))
    model_cfg = build_config(ModelConfig, config.get("model"), "model")
    run_cfg.output.check_root()
    data_root = resolve_data_root(run_cfg.data.root)
    task = build_task(config.get("task"), data_root, run_cfg.seed)
    check_objective(run_cfg.objective, task.primary_metric)
    task_key = canonical_json([config.get("task"), config.get("model"), str(data_root), run_cfg.seed])
    known = (checked_tasks or {}).get(task_key)
    samples = known if known is not None else task.samples()  # fails on missing or unreadable data
    check_conversion(model_cfg)
    peeked = peek_model(model_cfg)
    if peeked is not None:
        method.config.check_model(peeked[0])
        if known is None:
            task.check_model(*peeked)
    if checked_tasks is not None:
        checked_tasks[task_key] = samples
    rid = run_id(config)
    folder = run_folder(
        run_cfg.output.root, task.registered_name, model_cfg.name, method.label(), run_cfg.seed, rid
    )
    warnings = {**method.config.context_warnings(task.prompt_lengths()), **bits_ignored(given, method)}
    return RunPlan(
        config,
        run_cfg,
        model_cfg,
        method,
        task,
        data_root,
        samples,
        rid,
        folder,
        peeked is not None,
        warnings,
    )


def run_folder(root: str, task: str, model: str, method: str, seed: int, rid: str) -> Path:
    """``root/task/model/method/seed<seed>-<run id>``. Each part is one safe folder name (the model's
    name is checked by its config; the others are made by kvbench, checked here all the same) and
    the folder resolves inside ``root``: no configuration writes a run anywhere else."""
    parts = {"task.name": task, "model.name": model, "method": method, "run id": f"seed{seed}-{rid}"}
    for key, value in parts.items():
        paths.safe_component(key, value)
    folder = Path(root).joinpath(*parts.values())
    paths.check_inside(folder, root, "output.root", root)
    return folder


def warn(message: str) -> None:
    print(f"kvbench: warning: {message}", file=sys.stderr)


def memory_warnings(memory: dict[str, Any], label: str) -> dict[str, str]:
    """A cache that ended up larger than FP16 defeats the point of the method, whatever the cause."""
    ratio = memory.get("compression")
    if ratio is None or ratio >= 1.0:
        return {}
    return {
        "more_bytes_than_fp16": f"{label} held {1 / ratio:.2f}x the bytes of an FP16 cache "
        f"({memory.get('effective_bits'):.3g} effective bits per value)"
    }


def execute(cfg: Any, progress: bool = True) -> dict[str, Any]:
    """Run one configuration (a Hydra DictConfig or a plain dict); returns the metrics written."""
    plan = plan_run(cfg)
    created = not Path(plan.folder).exists()
    folder = RunFolder(plan.folder)
    try:
        return _execute_in(folder, plan, progress)
    except ConfigError:
        # An error only the run could meet (data a method reads after the model loads): a folder it
        # made and never wrote a sample to goes, so nothing on disk looks like an unfinished run. The
        # same config fails the same way in any process that waited on the lock.
        if created:
            folder.discard_if_unused(Path(plan.run.output.root))
        raise


def _execute_in(folder: RunFolder, plan: Any, progress: bool) -> dict[str, Any]:
    """The run of :func:`execute` inside its folder."""
    config, run_cfg, model_cfg, method, task = plan.config, plan.run, plan.model, plan.method, plan.task
    samples, rid = plan.samples, plan.run_id
    # One process per run folder: a parallel sweep (Slurm array, submitit) can map several points
    # to one folder (fp16 ignores bits); the second waits, then resumes and finds nothing to do.
    with folder.lock():
        folder.write_config({**config, "run_id": rid})
        ids = {s["id"] for s in samples}
        if run_cfg.output.resume:
            done = {r["sample_id"]: r for r in folder.resume_rows(ids)}
        else:
            done = {}
            folder.set_aside_rows("output.resume=false: every sample runs again")
        todo = [s for s in samples if s["id"] not in done]
        finished = folder.path / "metrics.json"
        if not todo and finished.exists():
            # a resubmitted sweep: this point is complete, so skip the model load as well
            stored = trusted_metrics(folder, finished, task, [done[s["id"]] for s in samples])
            if stored is not None:
                from kvbench.logger import log_run

                # the logger's run id is the run's: a finished point logged again updates its
                # wandb run (one per configuration), where a first logging was missed or failed
                log_run(config, stored)
                return {**stored, "folder": str(folder.path)}
        code = code_identity(method, task)
        accepted = check_resume(folder, len(done) if todo else 0, code, run_cfg.output.resume)
        folder.record_session(
            {"code": code, "rows_before": len(done), "resume": accepted or run_cfg.output.resume}
        )

        for message in plan.warnings.values():
            warn(message)
        torch.manual_seed(run_cfg.seed)
        from kvbench.builder import load_for_methods

        loaded = load_for_methods(model_cfg, run_cfg.torch_device())
        # the task's checks against the model ran in plan_run when its files were local already
        runner = loaded.runner(method, plan.data_root, task=None if plan.model_checked else task)

        t_run = time.perf_counter()
        bar = tqdm(
            todo, desc=f"{task.registered_name} {method.label()}", disable=not progress, file=sys.stderr
        )
        try:
            _run_samples(bar, done, folder, task, runner, method, model_cfg, run_cfg)
        except KeyboardInterrupt as err:
            # what is on disk: the signal may land between a row's append and its entry in `done`
            stored = {row.get("id") for row in folder.rows()} | set(done)
            finished_rows = sum(s["id"] in stored for s in samples)
            raise Interrupted(finished_rows, len(samples), isinstance(err, Terminated)) from None
        # the rows in the task's order, whatever order they were appended in
        rows = [done[s["id"]] for s in samples if s["id"] in done]
        memory = memory_summary(rows)
        measured = {**memory_warnings(memory, method.label()), **method.run_warnings()}
        for message in measured.values():
            warn(message)
        metrics = {
            "run_id": rid,
            "task": task.registered_name,
            "task_version": task.config.version,
            "model": model_cfg.name,
            "model_note": model_cfg.weights_note,
            "method": method.label(),
            "method_config": config.get("method") or {"name": "fp16"},
            "seed": run_cfg.seed,
            "primary_metric": task.primary_metric,
            "metrics": task.aggregate(rows),
            "memory": memory,
            # what the model's sliding-window layers held (kvbench.methods.base.SLIDING_RULES)
            "sliding_windows": method.config.sliding_windows if runner.shape.sliding_layers() else "none",
            "warnings": {**plan.warnings, **measured},
            "timings": {
                "model_load_s": loaded.load_s,
                "run_s": time.perf_counter() - t_run,
                "samples_run": len(todo),
                "samples_resumed": len(samples) - len(todo),
                "sample_s_mean": _mean([r.get("seconds") for r in rows]),
            },
            "versions": versions(),
            # which kernels read the stored tokens in this process (compiled, torch, both)
            "attention_backend": backend_in_use(),
            "folder": str(folder.path),
        }
        folder.write_metrics(metrics)
        from kvbench.logger import log_run

        log_run(config, metrics)  # after the folder is written: a logger failure cannot lose results
        return metrics


def trusted_metrics(folder: RunFolder, path: Path, task: Any, rows: list[dict[str, Any]]) -> dict | None:
    """A finished run's ``metrics.json`` checked against its rows: ``metrics.json`` is only a cache
    of what the samples say. Its aggregates are recomputed from the rows; where they differ (a hand
    edit, rows set aside since) a warning shows both values and the file is rewritten. None when it
    does not parse (the caller aggregates the rows again)."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = None
    if not isinstance(stored, dict):
        warn(f"{path} does not parse as a JSON object; it is written again from the samples")
        return None
    fresh = json.loads(json.dumps(_clean(task.aggregate(rows)), sort_keys=True, default=str))
    if stored.get("metrics") != fresh:
        old = stored.get("metrics") or {}
        diffs = [k for k in sorted(set(old) | set(fresh)) if old.get(k) != fresh.get(k)]
        shown = "; ".join(
            f"{k}: {old.get(k)!r} in the file, {fresh.get(k)!r} from the samples" for k in diffs[:3]
        )
        more = f"; and {len(diffs) - 3} more" if len(diffs) > 3 else ""
        warn(f"{path} disagrees with its {len(rows)} sample rows ({shown}{more}); rewritten from the samples")
        stored = {**stored, "metrics": fresh}
        folder.write_metrics({k: v for k, v in stored.items() if k != "folder"})
    return stored


def _run_samples(bar, done, folder, task, runner, method, model_cfg, run_cfg) -> None:
    """Run and append each sample of ``todo`` (``done`` gains each finished row)."""
    for sample in bar:
        t_sample = time.perf_counter()
        row = task.run(sample, runner)
        memory = row.pop("memory", None)
        row = {
            "sample_id": sample["id"],
            "seed": run_cfg.seed,
            "task": task.registered_name,
            "model": model_cfg.name,
            "method": method.label(),
            "bits": method.config.bits,
            **row,
            "memory": memory.to_dict() if memory is not None else None,
            "seconds": time.perf_counter() - t_sample,
        }
        folder.append(row)
        done[sample["id"]] = row
        bar.set_postfix({task.primary_metric: f"{row.get(task.primary_metric, float('nan')):.3g}"})


def summary_line(metrics: dict[str, Any]) -> dict[str, Any]:
    """One row of the end-of-run table."""
    m, mem = metrics["metrics"], metrics["memory"]
    return {
        "task": metrics["task"],
        "model": metrics["model"],
        "method": metrics["method"],
        # A subset of a benchmark (MiniLongBench, ...) is named next to its n, never silently.
        **({"subset": m["subset"]} if m.get("subset") else {}),
        "n": m.get("n"),
        metrics["primary_metric"]: m.get(metrics["primary_metric"]),
        "eff_bits": mem.get("effective_bits"),
        "x_vs_fp16": mem.get("compression"),
        "time_s": metrics["timings"]["run_s"],
        # a self-defeating setting is named in the table itself, where a sweep's reader looks
        **({"notes": ", ".join(metrics["warnings"])} if metrics.get("warnings") else {}),
    }
