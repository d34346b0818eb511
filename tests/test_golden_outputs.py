"""Every method's greedy tokens, scores and bytes on the default model stay what they were.

``tests/fixtures/golden/outputs.json`` holds, for each method at 2 bits (SemKV at its default
width, eviction methods at their default budget), one short NIAH sample (its prediction, score and
the cache's bytes by component) and one perplexity window (mean NLL through the cache and its
bytes), recorded by the CLI from the code before a refactor of the cache or the decode loop. A
refactor must reproduce them: the same predicted text, the same bytes, and the same NLL up to
floating-point reassociation (``NLL_TOL``).

Re-record (only when a change of numbers is intended, and say so in the commit):
``KVBENCH_RECORD_GOLDEN=1 pytest tests/test_golden_outputs.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "fixtures" / "golden" / "outputs.json"
RECORD = os.environ.get("KVBENCH_RECORD_GOLDEN") == "1"
NLL_TOL = 1e-4  # absolute, on a mean NLL of ~2-5 nats: reassociation, not a behaviour change

NIAH = ["task=niah", "task.context_lengths=[600]", "task.depths=[50]", "task.max_new_tokens=16"]
PERPLEXITY = ["task=perplexity", "task.context_length=256", "task.continuation_length=32", "task.windows=1"]
# Every method registered when the record was made; a method added later is simply not pinned.
RECORDED_METHODS = [
    "fp16",
    "uniform",
    "kivi",
    "ott",
    "kvquant",
    "intactkv",
    "turboquant",
    "semkv",
    "readkv",
    "specache",
    "streamingllm",
    "h2o",
    "snapkv",
    "random_prune",
]


# SemKV's two-level mix needs an average width between two level counts: its own default.
OWN_BITS = ["semkv"]


def _sweep(task_args: list[str], root: Path, data_root: Path) -> dict[str, dict]:
    """Two multiruns (one process each) over every recorded method; returns the first sample row of
    each run folder, keyed by the method's label."""
    at_two = [m for m in RECORDED_METHODS if m not in OWN_BITS]
    for methods, bits in ((at_two, ["bits=2"]), (OWN_BITS, [])):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvbench",
                "-m",
                f"+method={','.join(methods)}",
                *bits,
                *task_args,
                f"output.root={root}",
                f"data.root={data_root}",
            ],
            capture_output=True,
            text=True,
            timeout=3600,
            env=dict(os.environ),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {}
    for path in root.rglob("samples.jsonl"):
        row = json.loads(path.read_text().splitlines()[0])
        rows[row["method"]] = row
    return rows


def _niah_record(row: dict) -> dict:
    return {
        "prediction": row["prediction"],
        "score": row["score"],
        "generated_tokens": row["generated_tokens"],
        "prompt_tokens": row["prompt_tokens"],
        "bytes_by_component": row["memory"]["bytes_by_component"],
        "host_bytes": row["memory"]["host_bytes"],
    }


def _ppl_record(row: dict) -> dict:
    return {
        "nll_mean": row["nll_mean"],
        "tokens": row["tokens"],
        "bytes_by_component": row["memory"]["bytes_by_component"],
        "host_bytes": row["memory"]["host_bytes"],
    }


@pytest.fixture(scope="module")
def current(tmp_path_factory, data_root) -> dict[str, dict]:
    # A fixed root lets an interrupted recording resume where it stopped.
    fixed = os.environ.get("KVBENCH_GOLDEN_ROOT")
    root = Path(fixed) if fixed else tmp_path_factory.mktemp("golden")
    niah = _sweep(NIAH, root / "niah", data_root)
    ppl = _sweep(PERPLEXITY, root / "perplexity", data_root)
    return {
        "niah": {k: _niah_record(v) for k, v in niah.items()},
        "perplexity": {k: _ppl_record(v) for k, v in ppl.items()},
    }


def _label_map(current_task: dict[str, dict]) -> dict[str, dict]:
    """Run folders are named by method label (``kivi-2b``); map them back to method names."""
    out = {}
    for label, record in current_task.items():
        name = next(
            (m for m in sorted(RECORDED_METHODS, key=len, reverse=True) if label.startswith(m)), label
        )
        out[name] = record
    return out


def test_record_or_load(current):
    result = {task: _label_map(records) for task, records in current.items()}
    for task in ("niah", "perplexity"):
        assert set(result[task]) == set(RECORDED_METHODS), (task, sorted(result[task]))
    if RECORD:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps(result, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    golden = json.loads(GOLDEN.read_text())
    mismatches = []
    for method in RECORDED_METHODS:
        want, got = golden["niah"][method], result["niah"][method]
        if want != got:
            mismatches.append(f"niah {method}: want {want}, got {got}")
        want, got = golden["perplexity"][method], result["perplexity"][method]
        if abs(want["nll_mean"] - got["nll_mean"]) > NLL_TOL or {**want, "nll_mean": 0} != {
            **got,
            "nll_mean": 0,
        }:
            mismatches.append(f"perplexity {method}: want {want}, got {got}")
    assert not mismatches, "\n".join(mismatches)
