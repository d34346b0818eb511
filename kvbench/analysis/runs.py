"""Stored runs as pandas tables."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd


def load_runs(root: str | Path) -> pd.DataFrame:
    """One row per finished run (a folder with ``metrics.json``) under ``root``: task, model, method,
    seed, n, the primary metric, effective and code bits, compression and run time."""
    rows = []
    for path in sorted(Path(root).rglob("metrics.json")):
        m = json.loads(path.read_text())
        metric = m["primary_metric"]
        rows.append(
            {
                "task": m["task"],
                "model": m["model"],
                "method": m["method"],
                "seed": m["seed"],
                "n": m["metrics"].get("n"),
                "metric": metric,
                "score": m["metrics"].get(metric),
                "effective_bits": m["memory"].get("effective_bits"),
                "code_bits": m["memory"].get("code_bits"),
                "compression": m["memory"].get("compression"),
                "run_s": m["timings"].get("run_s"),
                "folder": str(path.parent),
            }
        )
    return pd.DataFrame(rows)


def load_samples(root: str | Path) -> pd.DataFrame:
    """Every ``samples.jsonl`` row under ``root``, with the run's folder; memory fields flattened."""
    frames = []
    for path in sorted(Path(root).rglob("samples.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        frame = pd.json_normalize(rows)
        frame["folder"] = str(path.parent)
        frames.append(frame)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
