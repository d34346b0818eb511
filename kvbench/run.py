"""One run: validate everything, load the model, build the method and the task, run the samples,
write the results.

No method or task logic lives here: both come from their registries, and the model, method and cache
factory come from the one run builder (:mod:`kvbench.builder`). A run's configuration arrives as one
typed :class:`kvbench.spec.RunSpec`, resolved and validated once at the entry; nothing here reads a
config node again. :func:`plan_run` adds the checks that read the task's data and the model's
config.json and tokenizer (but no weights) and writes nothing, so a bad input costs seconds and
leaves no folder behind.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from kvbench import paths
from kvbench.cache.static import decode_steps_seen
from kvbench.env import get_logger
from kvbench.errors import ConfigError, Interrupted, Terminated
from kvbench.kernels.cpu import backend_in_use
from kvbench.methods import Method

# format_table lives with the results so that a sweep's driver can print a table without importing torch.
from kvbench.results import (  # noqa: F401
    RunFolder,
    _clean,
    analysis_plan,
    canonical_json,
    format_table,
    run_id,
)

# Moved to kvbench.spec with the run's typed config; named here for the code that imports them from
# the run (kvbench.reproduce, kvbench.lmeval, scripts).
from kvbench.spec import (  # noqa: F401
    NODE_KEYS,
    RESUME_CHOICES,
    SEED_LIMIT,
    DataConfig,
    OutputConfig,
    RunConfig,
    RunSpec,
    bits_ignored,
    check_environment,
    run_config,
    run_folder,
)
from kvbench.version import __version__

log = get_logger(__name__)


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
        "kvbench": __version__,
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
        "kvbench": __version__,
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
    """A validated run: its :class:`~kvbench.spec.RunSpec`, the samples it will run, and whether the
    checks against the model's shape and tokenizer ran on its files (else they run after the load)."""

    spec: RunSpec
    samples: list[dict[str, Any]]
    model_checked: bool

    # the spec's parts, under the names a plan has always had; ``config`` is the plain config the
    # run id hashed (RunSpec.record), for a reader outside the run: nothing here reads it
    config = property(lambda self: self.spec.record.config)
    run = property(lambda self: self.spec.run)
    model = property(lambda self: self.spec.model)
    method = property(lambda self: self.spec.method)
    task = property(lambda self: self.spec.task)
    data_root = property(lambda self: self.spec.data_root)
    run_id = property(lambda self: self.spec.run_id)
    folder = property(lambda self: self.spec.folder)
    warnings = property(lambda self: self.spec.warnings)


def check_conversion(model_cfg: Any) -> None:
    """A GGUF that is not converted yet will be converted into the cache when the model loads: the
    file must be whole and the cache writable, and nothing of the user's may sit where the
    conversion goes (:func:`kvbench.models.gguf.converted_dir` says so)."""
    from kvbench.models import gguf

    if model_cfg.source == "gguf" and gguf.needs_conversion(model_cfg):
        paths.check_cache_writable()
        gguf.check_gguf(model_cfg)


def samples_key(spec: RunSpec) -> str:
    """What decides a run's samples and the task's checks against the model: the task (its name and
    validated config), the model's validated config, the data root and the seed. Typed configs: two
    nodes that build the same objects are one key."""
    task = [spec.task.registered_name, asdict(spec.task.config)]
    return canonical_json([task, asdict(spec.model), str(spec.data_root), spec.seed])


def plan_run(cfg: Any, checked_tasks: dict[str, list] | None = None) -> RunPlan:
    """Check a configuration (a :class:`~kvbench.spec.RunSpec`, or a Hydra DictConfig or plain dict
    made into one) against the data and the model's files; raise ConfigError on the first problem.

    ``checked_tasks`` lets a sweep check each distinct (task, model, data, seed) once: loading a
    task's samples can take seconds (lm-eval builds its dataset), and most sweeps vary the method."""
    from kvbench.models import peek_model

    spec = RunSpec.from_config(cfg)
    task_key = samples_key(spec)
    known = (checked_tasks or {}).get(task_key)
    samples = known if known is not None else spec.task.samples()  # fails on missing or unreadable data
    check_conversion(spec.model)
    peeked = peek_model(spec.model)
    if peeked is not None:
        spec.method.config.check_model(peeked[0])
        spec.method.config.check_static_model(peeked[0])
        if known is None:
            spec.task.check_model(*peeked)
    if checked_tasks is not None:
        checked_tasks[task_key] = samples
    return RunPlan(spec, samples, peeked is not None)


def warn(message: str) -> None:
    """One warning about this run, through the ``kvbench.run`` logger."""
    log.warning(message)


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
    """Run one configuration (a :class:`~kvbench.spec.RunSpec`, or a Hydra DictConfig or plain dict
    made into one); returns the metrics written."""
    plan = plan_run(cfg)
    created = not plan.folder.exists()
    folder = RunFolder(plan.folder)
    try:
        return _execute_in(folder, plan, progress)
    except ConfigError:
        # An error only the run could meet (data a method reads after the model loads): a folder it
        # made and never wrote a sample to goes, so nothing on disk looks like an unfinished run. The
        # same config fails the same way in any process that waited on the lock.
        if created:
            folder.discard_if_unused(Path(plan.spec.output.root))
        raise


def _execute_in(folder: RunFolder, plan: RunPlan, progress: bool) -> dict[str, Any]:
    """The run of :func:`execute` inside its folder."""
    spec = plan.spec
    run_cfg, model_cfg, method, task = spec.run, spec.model, spec.method, spec.task
    samples, rid = plan.samples, spec.run_id
    # One process per run folder: a parallel sweep (Slurm array, submitit) can map several points
    # to one folder (fp16 ignores bits); the second waits, then resumes and finds nothing to do.
    with folder.lock():
        folder.write_config(spec.record.config_json)
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
                log_run(spec, stored)
                return {**stored, "folder": str(folder.path)}
        code = code_identity(method, task)
        accepted = check_resume(folder, len(done) if todo else 0, code, run_cfg.output.resume)
        folder.record_session(
            {"code": code, "rows_before": len(done), "resume": accepted or run_cfg.output.resume}
        )

        for message in spec.warnings.values():
            warn(message)
        from kvbench.builder import load_kept

        # a sweep's runs in one process share the model (and, through it, each prompt's prefill:
        # kvbench.cache.prefill)
        loaded, reused = load_kept(model_cfg, run_cfg.torch_device())
        # seeded after the load, so that a run draws the same numbers whether it loaded the model
        # (whose construction draws) or found it kept
        torch.manual_seed(run_cfg.seed)
        try:
            # the task's checks against the model ran in plan_run when its files were local already
            runner = loaded.runner(method, spec.data_root, task=None if plan.model_checked else task)
            t_run = time.perf_counter()
            bar = tqdm(
                total=len(todo),
                desc=f"{task.registered_name} {method.label()}",
                disable=not progress,
                file=sys.stderr,
            )
            try:
                _run_samples(todo, bar, done, folder, runner, spec)
            finally:
                bar.close()  # the bar's last line before any message about how the run ended
        except KeyboardInterrupt as err:
            # what is on disk: the signal may land between a row's append and its entry in `done`
            stored = {row.get("sample_id") for row in folder.rows()} | set(done)
            finished_rows = sum(s["id"] in stored for s in samples)
            raise Interrupted(finished_rows, len(samples), isinstance(err, Terminated)) from None
        finally:
            method.release()
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
            "method_config": spec.record.method_config,
            "seed": run_cfg.seed,
            "primary_metric": task.primary_metric,
            "metrics": task.aggregate(rows),
            "memory": memory,
            # what the model's sliding-window layers held (kvbench.methods.base.SLIDING_RULES)
            "sliding_windows": method.config.sliding_windows if runner.shape.sliding_layers() else "none",
            "warnings": {**spec.warnings, **measured},
            "timings": {
                "model_load_s": 0.0 if reused else loaded.load_s,
                "model_reused": reused,
                "run_s": time.perf_counter() - t_run,
                "samples_run": len(todo),
                "samples_resumed": len(samples) - len(todo),
                "sample_s_mean": _mean([r.get("seconds") for r in rows]),
            },
            "versions": versions(),
            # which kernels read the stored tokens in this process (compiled, torch, both)
            "attention_backend": backend_in_use(),
            # how decode steps ran: eager, static (method.cuda_graph off CUDA) or graph (captured)
            "decode_step": decode_steps_seen(),
            "folder": str(folder.path),
        }
        folder.write_metrics(metrics)
        from kvbench.logger import log_run

        log_run(spec, metrics)  # after the folder is written: a logger failure cannot lose results
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


def _run_samples(todo, bar, done, folder, runner, spec: RunSpec) -> None:
    """Run and append each sample of ``todo`` (``done`` gains each finished row), as many at once
    as the task decodes together (:meth:`kvbench.tasks.Task.batch_for`); every row of a batch is
    appended as soon as the batch ends, and records the batch it ran in (``batch_size``) and its
    share of the batch's seconds."""
    task, method = spec.task, spec.method
    size = task.batch_for(runner)
    for start in range(0, len(todo), size):
        chunk = todo[start : start + size]
        t_batch = time.perf_counter()
        rows = task.run_batch(chunk, runner)
        seconds = (time.perf_counter() - t_batch) / len(chunk)
        for sample, row in zip(chunk, rows, strict=True):
            memory = row.pop("memory", None)
            row = {
                "sample_id": sample["id"],
                "seed": spec.seed,
                "task": task.registered_name,
                "model": spec.model.name,
                "method": method.label(),
                "bits": method.config.bits,
                **row,
                **({"batch_size": len(chunk)} if size > 1 else {}),
                "memory": memory.to_dict() if memory is not None else None,
                "seconds": seconds,
            }
            folder.append(row)
            done[sample["id"]] = row
            bar.update(1)
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
