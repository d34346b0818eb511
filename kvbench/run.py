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
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import kvbench
from kvbench.config import build_config, check_choice, require, to_plain, unknown_key
from kvbench.data import resolve_data_root
from kvbench.errors import ConfigError
from kvbench.kernels.cpu import backend_in_use
from kvbench.methods import Method, build_method
from kvbench.methods.base import with_run_bits

# format_table lives with the results so that a sweep's driver can print a table without importing torch.
from kvbench.results import RunFolder, analysis_plan, canonical_json, format_table, run_id  # noqa: F401
from kvbench.tasks import Task, build_task

# Top-level keys other than RunConfig's own: nodes validated by their own dataclasses.
NODE_KEYS = ("model", "task", "method", "logger", "analysis")
SEED_LIMIT = 2**32  # numpy's generators take seeds below this; torch takes them too


@dataclass
class OutputConfig:
    root: str = "results/runs"
    resume: bool = True

    def __post_init__(self):
        require(
            isinstance(self.root, str) and self.root.strip() != "", "output.root", self.root, "a folder path"
        )

    def check_root(self) -> None:
        """The root can be created and written. Probed by making and removing a temporary folder in
        its nearest existing ancestor: permission bits say yes to root on read-only mounts (/sys)."""
        root = Path(self.root).expanduser()
        existing = next(p for p in (root, *root.parents) if p.exists())
        if not existing.is_dir():
            raise ConfigError("output.root", self.root, f"a folder; {existing} is a file")
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".kvbench-probe-", dir=existing))
        except OSError as err:
            raise ConfigError(
                "output.root", self.root, f"a folder kvbench can create and write; {existing}: {err.strerror}"
            ) from None


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


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent, timeout=5
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, Any]:
    import transformers

    return {
        "kvbench": kvbench.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "git_commit": _git_commit(),
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


def plan_run(cfg: Any, checked_tasks: dict[str, list] | None = None) -> RunPlan:
    """Check a configuration (a Hydra DictConfig or a plain dict) against itself, the machine, the
    data and the model's files; raise ConfigError on the first problem. Cheapest checks first.

    ``checked_tasks`` lets a sweep check each distinct (task, model, data, seed) once: loading a
    task's samples can take seconds (lm-eval builds its dataset), and most sweeps vary the method."""
    from kvbench.logger import LoggerConfig
    from kvbench.models import ModelConfig, peek_model

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
    task_key = canonical_json([config.get("task"), config.get("model"), str(data_root), run_cfg.seed])
    known = (checked_tasks or {}).get(task_key)
    samples = known if known is not None else task.samples()  # fails on missing or unreadable data
    peeked = peek_model(model_cfg)
    if peeked is not None:
        method.config.check_model(peeked[0])
        if known is None:
            task.check_model(*peeked)
    if checked_tasks is not None:
        checked_tasks[task_key] = samples
    rid = run_id(config)
    folder = (
        Path(run_cfg.output.root)
        / task.registered_name
        / model_cfg.name
        / method.label()
        / f"seed{run_cfg.seed}-{rid}"
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
        done = {r["sample_id"]: r for r in folder.resume_rows()} if run_cfg.output.resume else {}
        todo = [s for s in samples if s["id"] not in done]
        finished = folder.path / "metrics.json"
        if not todo and finished.exists():
            # a resubmitted sweep: this point is complete, so skip the model load as well
            try:
                return {**json.loads(finished.read_text()), "folder": str(folder.path)}
            except (ValueError, TypeError):  # damaged by hand: aggregate the rows again
                warn(f"{finished} does not parse as a JSON object; it is written again from the samples")

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

        rows = [done[s["id"]] for s in samples if s["id"] in done]
        memory = memory_summary(rows)
        measured = memory_warnings(memory, method.label())
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
