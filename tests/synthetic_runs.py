"""A small synthetic set of run folders, written with the real ``RunFolder`` writer, for the report,
analysis and notebook tests. Scores are chosen so that every statistic has a known answer.

Layout: task ``niah``, model ``tiny``, experiment ``synthetic_cliff`` (reference fp16, metric
``score``, margin 0.1), seeds 0 and 1, 12 samples each, with ``context_length`` and ``depth``
columns like the NIAH task's. Configurations:

- ``fp16``: score 1 on every pair except sample ``s00`` (0), so 22 of 24 pairs are correct;
- ``uniform-4b``: the same scores as fp16 (difference 0 on every pair);
- ``uniform-3b``: fp16's scores with samples ``s01`` and ``s02`` of seed 0 turned to 0;
- ``uniform-2b``: 0 everywhere, and every generation hits the length limit (runaway).

Effective bits per value: 16 for fp16, ``bits + 1`` for uniform-b. One extra, unfinished run of
``uniform-4b`` seed 0 with 3 rows and a different config is written first, so it is superseded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvbench.results import RunFolder, run_id

PLAN = {
    "name": "synthetic_cliff",
    "reference": "fp16",
    "metric": "score",
    "alpha": 0.05,
    "margin": 0.1,
    "n": 12,
    "seeds": [0, 1],
    "grid": [4, 3, 2],
    "grid_key": "bits",
}
SAMPLES = [f"s{i:02d}" for i in range(12)]
SEEDS = (0, 1)
MAX_NEW_TOKENS = 8
CONFIGS: list[tuple[str, float | None]] = [("fp16", None), ("uniform", 4), ("uniform", 3), ("uniform", 2)]


def score(method: str, bits: float | None, sample: str, seed: int) -> float:
    """The synthetic score of one (configuration, sample, seed)."""
    if method == "uniform" and bits == 2:
        return 0.0
    if method == "uniform" and bits == 3 and seed == 0 and sample in ("s01", "s02"):
        return 0.0
    return 0.0 if sample == "s00" else 1.0


def label(method: str, bits: float | None) -> str:
    return method if bits is None else f"{method}-{bits:g}b"


def _write_run(
    root: Path,
    method: str,
    bits: float | None,
    seed: int,
    samples: list[str],
    extra: dict[str, Any],
    model: str = "tiny",
) -> tuple[Path, str]:
    config = {
        "task": {"name": "niah", "max_new_tokens": MAX_NEW_TOKENS, **extra},
        "model": {"name": model},
        "method": None if bits is None else {"name": method, "bits": bits},
        "bits": bits,
        "seed": seed,
        "analysis": PLAN,
    }
    rid = run_id(config)
    folder = RunFolder(root / "niah" / model / label(method, bits) / f"seed{seed}-{rid}")
    folder.write_config({**config, "run_id": rid})
    runaway = method == "uniform" and bits == 2
    for i, sample in enumerate(samples):
        s = score(method, bits, sample, seed)
        folder.append(
            {
                "sample_id": sample,
                "seed": seed,
                "task": "niah",
                "model": model,
                "method": label(method, bits),
                "bits": bits,
                "context_length": 1024 * (1 + i % 3),
                "depth": 50 * (i // 3 % 3),
                "score": s,
                "needle_recall": s,
                "prediction": f"answer number {i} for seed {seed}",
                "stopped": not runaway,
                "generated_tokens": MAX_NEW_TOKENS if runaway else 3,
                "memory": {
                    "effective_bits": 16.0 if bits is None else bits + 1.0,
                    "code_bits": None if bits is None else float(bits),
                },
            }
        )
    return folder.path, rid


def write_runs(root: str | Path, model: str = "tiny") -> Path:
    """Write the synthetic run set of ``model`` under ``root``; returns ``root``."""
    root = Path(root)
    # A partial run of an older config of uniform-4b: fewer rows, so load_frame must leave it out.
    _write_run(root, "uniform", 4, 0, SAMPLES[:3], {"old_knob": 1}, model)
    for method, bits in CONFIGS:
        for seed in SEEDS:
            path, rid = _write_run(root, method, bits, seed, SAMPLES, {}, model)
            RunFolder(path).write_metrics(
                {
                    "run_id": rid,
                    "task": "niah",
                    "model": model,
                    "method": label(method, bits),
                    "seed": seed,
                    "primary_metric": "score",
                    "metrics": {"score": sum(score(method, bits, s, seed) for s in SAMPLES) / len(SAMPLES)},
                    "memory": {"effective_bits": 16.0 if bits is None else bits + 1.0},
                    "timings": {"run_s": 1.0},
                }
            )
    return root
