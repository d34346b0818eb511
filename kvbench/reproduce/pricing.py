"""What a job of an experiment node costs: the samples it runs and the seconds each takes.

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

import json
import re
from pathlib import Path
from typing import Any

from kvbench.node_plan import PROFILE_DEVICE, add_seconds, frame_seconds

# The CPU cost model is fitted on the default model: other models scale by their parameters.
CPU_MODEL_PARAMETERS = 1.35e8
CPU_MODEL_EXPONENT = 0.4

# Cost model constants (the module docstring; the model load per run: kvbench.node_plan).
CPU_PREFILL_S_PER_KTOK = 5.0
CPU_STEP_S = 0.1
GPU_FLOPS = 150e12
GPU_BYTES_PER_S = 1.5e12
GPU_STEP_FLOOR_S = 0.025


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


def sample_rows(path: Path):
    """The rows of a ``samples.jsonl`` that name a sample (a damaged line or file is skipped)."""
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
            for row in sample_rows(path):
                add_seconds(found, row.get("model"), row.get("method"), row.get("seconds"))
    return found
