"""Synthetic runs of one experiment whose arms are built so that each claim rule has a known verdict,
written with the real ``RunFolder`` writer (see ``tests/analysis/test_claims.py``).

Experiment ``semkv_cliff`` (a real node name, so the CLI's node check passes), task ``niah``,
model ``tiny``, 12 samples x 2 seeds = 24 pairs per arm. Per pair ``(i, seed)`` with
``k = i + 12 * seed``:

- ``fp16``: score 1 (0 on sample s00), ``noise`` = ``NOISE[k]``, effective bits 16,
  ``hit_rates = {"exact_topk": {"0.005": 0.95 + NOISE[k] / 10}, "h2o": {"0.005": 0.5}}``;
- ``uniform-4b`` / ``uniform-3b``: fp16's score (effective bits 5 / 4);
- ``uniform-2b``: score 0 (effective bits 3);
- ``kivi-2b`` with ``key_axis: channel`` and ``key_axis: token``: the channel arm scores fp16's
  score, the token arm 0; their ``noise`` is ``NOISE[k] + 0.05`` and ``NOISE[k]``;
- ``ott-2b``: fp16's score less 0.02 on every pair; ``noise`` = ``0.9 * NOISE[(k + 7) % 24]``, so
  fp16's noise less ott's has a mean of about -0.001 with a spread of about 0.48: no effect either
  way, the case for the verdicts that need power (inconclusive, no effect at this power).

``NOISE`` is a fixed draw: N(0, 0.3) with seed 3.

``write_paper`` writes claims (and tables) as a paper file in a folder of their own, the form
``kvbench.analysis.papers.load_papers`` and ``kvbench.report`` read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import yaml

from kvbench.paths import PAPERS_DIR
from kvbench.results import RunFolder, run_id

EXPERIMENT = "semkv_cliff"
SAMPLES = [f"s{i:02d}" for i in range(12)]
SEEDS = (0, 1)
NOISE = np.random.default_rng(3).normal(0.0, 0.3, len(SAMPLES) * len(SEEDS))
PLAN = {"name": EXPERIMENT, "reference": "fp16", "metric": "score", "alpha": 0.05, "margin": 0.1}


def _k(i: int, seed: int) -> int:
    return i + len(SAMPLES) * seed


def fp16_score(i: int) -> float:
    return 0.0 if i == 0 else 1.0


ARMS: list[tuple[str, dict[str, Any] | None, float | None, Any]] = [
    # (label, method node, bits, per-pair fields)
    ("fp16", None, None, lambda i, s: {"score": fp16_score(i), "noise": NOISE[_k(i, s)], "eff": 16.0}),
    ("uniform-4b", {"name": "uniform", "bits": 4}, 4, lambda i, s: {"score": fp16_score(i), "eff": 5.0}),
    ("uniform-3b", {"name": "uniform", "bits": 3}, 3, lambda i, s: {"score": fp16_score(i), "eff": 4.0}),
    ("uniform-2b", {"name": "uniform", "bits": 2}, 2, lambda i, s: {"score": 0.0, "eff": 3.0}),
    (
        "kivi-2b",
        {"name": "kivi", "bits": 2, "key_axis": "channel", "group_size": 32},
        2,
        lambda i, s: {"score": fp16_score(i), "noise": NOISE[_k(i, s)] + 0.05, "eff": 4.0},
    ),
    (
        "kivi-2b",
        {"name": "kivi", "bits": 2, "key_axis": "token", "group_size": 32},
        2,
        lambda i, s: {"score": 0.0, "noise": NOISE[_k(i, s)], "eff": 4.0},
    ),
    (
        "ott-2b",
        {"name": "ott", "bits": 2},
        2,
        lambda i, s: {
            "score": fp16_score(i) - 0.02,
            "noise": 0.9 * NOISE[(_k(i, s) + 7) % len(NOISE)],
            "eff": 4.5,
        },
    ),
]


def write_claim_runs(root: str | Path, model: str = "tiny") -> Path:
    """Write every arm of the synthetic experiment under ``root``; returns ``root``."""
    root = Path(root)
    for label, method, bits, fields in ARMS:
        for seed in SEEDS:
            config = {
                "task": {"name": "niah", "max_new_tokens": 8},
                "model": {"name": model},
                "method": method,
                "bits": bits,
                "seed": seed,
                "analysis": PLAN,
            }
            rid = run_id(config)
            folder = RunFolder(root / EXPERIMENT / model / label / f"seed{seed}-{rid}")
            folder.write_config({**config, "run_id": rid})
            for i, sample in enumerate(SAMPLES):
                values = fields(i, seed)
                row = {
                    "sample_id": sample,
                    "seed": seed,
                    "task": "niah",
                    "model": model,
                    "method": label,
                    "bits": bits,
                    "score": values["score"],
                    "prediction": f"answer {i}",
                    "stopped": True,
                    "generated_tokens": 3,
                    "memory": {"effective_bits": values["eff"]},
                }
                if "noise" in values:
                    row["noise"] = float(values["noise"])
                if label == "fp16":
                    row["hit_rates"] = {
                        "exact_topk": {"0.005": 0.95 + float(NOISE[_k(i, seed)]) / 10},
                        "h2o": {"0.005": 0.5},
                    }
                folder.append(row)
            folder.write_metrics({"run_id": rid, "primary_metric": "score", "method": label})
    return root


def write_paper(
    folder: str | Path,
    claims: list[dict[str, Any]],
    paper: str = "toy",
    tables: list[dict[str, Any]] | None = None,
    order: int = 1,
) -> Path:
    """``folder/<paper>.yaml``: a paper file holding ``claims`` and ``tables`` (mappings in the
    schema of ``kvbench.analysis.papers``); returns ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    doc = {"paper": paper, "title": f"The {paper} paper", "source": f"{paper}.md", "order": order}
    doc |= {"tables": tables or [], "claims": claims}
    (folder / f"{paper}.yaml").write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False))
    return folder


def shipped_tables(paper: str) -> list[dict[str, Any]]:
    """The tables of a shipped paper file, as written there."""
    return yaml.safe_load((PAPERS_DIR / f"{paper}.yaml").read_text()).get("tables") or []


def write_arm_runs(
    root: str | Path,
    arms: list[tuple[str, dict[str, Any] | None, float | None, Any]],
    samples: list[str],
    seeds: tuple[int, ...] = (0,),
    model: str = "tiny",
) -> Path:
    """Write runs of experiment ``EXPERIMENT`` whose arms are given like ``ARMS``: ``(label, method
    node, bits, fields(i, seed) -> {"score": ..., "eff": ..., other numeric columns})``; returns
    ``root``. For archives built around one case (every pair tied, an arm at the ceiling, no spread,
    a single sample)."""
    root = Path(root)
    for label, method, bits, fields in arms:
        for seed in seeds:
            config = {
                "task": {"name": "niah", "max_new_tokens": 8},
                "model": {"name": model},
                "method": method,
                "bits": bits,
                "seed": seed,
                "analysis": PLAN,
            }
            rid = run_id(config)
            folder = RunFolder(root / EXPERIMENT / model / label / f"seed{seed}-{rid}")
            folder.write_config({**config, "run_id": rid})
            for i, sample in enumerate(samples):
                values = dict(fields(i, seed))
                eff = values.pop("eff", 16.0)
                row = {
                    "sample_id": sample,
                    "seed": seed,
                    "task": "niah",
                    "model": model,
                    "method": label,
                    "bits": bits,
                    "prediction": f"answer {i}",
                    "stopped": True,
                    "generated_tokens": 3,
                    "memory": {"effective_bits": eff},
                    **{k: float(v) for k, v in values.items()},
                }
                folder.append(row)
            folder.write_metrics({"run_id": rid, "primary_metric": "score", "method": label})
    return root
