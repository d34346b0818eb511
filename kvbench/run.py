"""One run: load the model, build the method and the task, run the samples, write the results.

No method or task logic lives here: both come from their registries.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import kvbench
from kvbench.config import build_config, check_choice, to_plain
from kvbench.data import resolve_data_root
from kvbench.methods import build_method

# format_table lives with the results so that a sweep's driver can print a table without importing torch.
from kvbench.results import RunFolder, format_table, run_id  # noqa: F401
from kvbench.tasks import build_task


@dataclass
class OutputConfig:
    root: str = "results/runs"
    resume: bool = True


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
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
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


def execute(cfg: Any, progress: bool = True) -> dict[str, Any]:
    """Run one configuration (a Hydra DictConfig or a plain dict); returns the metrics written."""
    from kvbench.models import ModelConfig, load_model, model_shape

    config = to_plain(cfg)
    run_cfg = build_config(
        RunConfig, {k: config[k] for k in ("seed", "bits", "device", "output", "data") if k in config}, ""
    )
    method = build_method(config.get("method"))
    model_cfg = build_config(ModelConfig, config["model"], "model")
    data_root = resolve_data_root(run_cfg.data.root)
    task = build_task(config["task"], data_root, run_cfg.seed)
    samples = task.samples()  # fails fast on missing data, before the model loads

    rid = run_id(config)
    folder = RunFolder(
        Path(run_cfg.output.root)
        / task.registered_name
        / model_cfg.name
        / method.label()
        / f"seed{run_cfg.seed}-{rid}"
    )
    # One process per run folder: a parallel sweep (Slurm array, submitit) can map several points
    # to one folder (fp16 ignores bits); the second waits, then resumes and finds nothing to do.
    with folder.lock():
        folder.write_config({**config, "run_id": rid})
        done = {r["sample_id"]: r for r in folder.rows()} if run_cfg.output.resume else {}
        todo = [s for s in samples if s["id"] not in done]
        finished = folder.path / "metrics.json"
        if not todo and finished.exists():
            # a resubmitted sweep: this point is complete, so skip the model load as well
            return {**json.loads(finished.read_text()), "folder": str(folder.path)}

        torch.manual_seed(run_cfg.seed)
        t0 = time.perf_counter()
        from kvbench.cache import ATTN_IMPLEMENTATION
        from kvbench.generate import ModelRunner

        model, tokenizer = load_model(
            model_cfg, attn_implementation=ATTN_IMPLEMENTATION, device=run_cfg.torch_device()
        )
        load_s = time.perf_counter() - t0
        shape = model_shape(model, model_cfg.max_context)
        method.config.check_model(shape)
        task.check_model(shape, tokenizer)
        method.prepare(model, tokenizer, shape, data_root)
        runner = ModelRunner(model, tokenizer, method, shape)

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
            "memory": memory_summary(rows),
            "timings": {
                "model_load_s": load_s,
                "run_s": time.perf_counter() - t_run,
                "samples_run": len(todo),
                "samples_resumed": len(samples) - len(todo),
                "sample_s_mean": _mean([r.get("seconds") for r in rows]),
            },
            "versions": versions(),
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
    }
