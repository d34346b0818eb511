"""Run folders: resolved config, samples.jsonl, metrics.json.

Writes never leave a half file behind: JSON files are written to a temporary file and renamed;
each sample row is one ``write`` of a complete line followed by ``fsync``, so a killed run keeps
every finished row, and a partial last line (from a kill mid-write) is ignored and rewritten on
resume.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

# Keys that say where things are, not what is computed: left out of the run id.
PATH_KEYS = {"output", "data", "hydra", "logger"}
# The experiment's pre-declared analysis plan: stored in config.json, but it changes no sample, so
# one run serves every experiment whose plan reads it.
NON_RUN_KEYS = PATH_KEYS | {"analysis"}


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def canonical_config(config: dict[str, Any]) -> dict[str, Any]:
    """What the run id hashes: the resolved config minus paths, loggers and the analysis plan.

    The top-level ``bits`` reaches a method only through its node (``bits: ${bits}``, or a knob
    such as ReadKV's ``read_bits: ${bits}``), and the config is resolved before hashing, so every
    effect of ``bits`` is already in the method node. A node without a ``bits`` key (the FP16
    baseline; no ``method`` at all is the FP16 baseline too) therefore drops the top-level value:
    ``fp16`` inside a bit-width sweep is one run, not one per bit width.
    """
    core = {k: v for k, v in config.items() if k not in NON_RUN_KEYS}
    method = core.get("method") or {"name": "fp16"}
    if "bits" not in method:
        core.pop("bits", None)
    return core


def run_id(config: dict[str, Any]) -> str:
    """Hash of :func:`canonical_config`: the same computation gets the same folder."""
    return hashlib.sha256(canonical_json(canonical_config(config)).encode()).hexdigest()[:12]


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN/inf become null (strict JSON readers reject them)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json_atomic(path: Path, obj: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(_clean(obj), f, indent=2, sort_keys=True, default=str)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class RunFolder:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.samples_path = self.path / "samples.jsonl"
        self.path.mkdir(parents=True, exist_ok=True)

    def write_config(self, config: dict[str, Any]) -> None:
        write_json_atomic(self.path / "config.json", config)

    def write_metrics(self, metrics: dict[str, Any]) -> None:
        write_json_atomic(self.path / "metrics.json", metrics)

    def rows(self) -> list[dict[str, Any]]:
        """Finished rows; a truncated last line is dropped (and cut from the file)."""
        if not self.samples_path.exists():
            return []
        rows, good_bytes = [], 0
        with open(self.samples_path, "rb") as f:
            for raw in f:
                if not raw.endswith(b"\n"):
                    break
                try:
                    rows.append(json.loads(raw))
                except json.JSONDecodeError:
                    break
                good_bytes += len(raw)
        if good_bytes != self.samples_path.stat().st_size:
            with open(self.samples_path, "r+b") as f:
                f.truncate(good_bytes)
        return rows

    def append(self, row: dict[str, Any]) -> None:
        line = json.dumps(_clean(row), sort_keys=True, default=str) + "\n"
        with open(self.samples_path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
