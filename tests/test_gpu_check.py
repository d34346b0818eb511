"""``scripts/gpu_check.sh --dry``: the prepared device check, end to end on the CPU interpreter.

The dry mode runs the code paths of the GPU check (Triton kernels under ``TRITON_INTERPRET=1``, a
1-layer random Llama, three methods and ``DynamicCache``) in seconds; these tests read the CSVs it
writes. The compiled CPU kernels are turned off in the child so that it never waits for their build
and KVQuant's reads are the torch reference's, which the decode CSV must then say.
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

pytestmark = pytest.mark.slow

PARITY = [
    "kernel",
    "levels",
    "axis",
    "zero_point",
    "head_dim",
    "tokens",
    "device",
    "max_abs_err",
    "tol",
    "status",
]
BANDWIDTH = [
    "kernel",
    "levels",
    "context",
    "batch",
    "heads",
    "kv_heads",
    "head_dim",
    "device",
    "bytes",
    "us",
    "GBps",
    "copy_us",
    "copy_GBps",
    "copy_share",
    "timing",
    "status",
]
DECODE = [
    "method",
    "label",
    "context",
    "layers",
    "dtype",
    "device",
    "backend_requested",
    "backend_resolved",
    "backend_in_use",
    "decode_step",
    "step_ms",
    "step_ms_min",
    "vs_sdpa",
    "vs_eager",
    "steps",
    "status",
]


def run_check(out_dir: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "KVBENCH_CPU_KERNELS": "0", "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)  # the script must set it itself
    return subprocess.run(
        ["bash", str(SCRIPT), "--dry", "--out-dir", str(out_dir), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def read(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("gpu_check")
    return out, run_check(out)


def test_dry_run_passes_and_summarises(dry_run):
    _, proc = dry_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gpu_check summary:" in proc.stdout
    assert "gpu_check.sh summary (dry)" in proc.stdout
    assert "gpu_check.py: ok" in proc.stdout
    # one printed line per result
    assert proc.stdout.count("[parity] ") == 7
    assert proc.stdout.count("[bandwidth] ") == 2
    assert proc.stdout.count("[decode] ") == 6


def test_parity_csv_has_one_row_per_format(dry_run):
    out, _ = dry_run
    columns, rows = read(out / "gpu_parity.csv")
    assert columns == PARITY
    formats = {(r["kernel"], int(r["levels"]), r["axis"], r["zero_point"], int(r["head_dim"])) for r in rows}
    expected = {
        ("quantize_pack+unpack", L, axis, zp, 64)
        for L, zp in ((3, "minmax"), (4, "minmax"), (2, "specache"))
        for axis in ("token", "channel")
    }
    expected.add(("fused_decode_attention", 4, "kivi", "minmax", 64))
    assert formats == expected and len(rows) == len(expected)
    for r in rows:
        assert r["status"] == "ok" and r["device"] == "cpu", r
        if r["kernel"] == "quantize_pack+unpack":
            assert float(r["max_abs_err"]) == 0.0, r  # bit-identical to the reference
        else:
            assert 0 <= float(r["max_abs_err"]) <= float(r["tol"]), r


def test_bandwidth_csv_compares_with_a_copy(dry_run):
    out, _ = dry_run
    columns, rows = read(out / "gpu_bandwidth.csv")
    assert columns == BANDWIDTH
    assert sorted(r["kernel"] for r in rows) == ["fused_decode_attention", "unpack_dequantize"]
    for r in rows:
        assert r["status"] == "ok", r
        seconds, nbytes = float(r["us"]) / 1e6, int(r["bytes"])
        assert seconds > 0 and nbytes > 0
        assert math.isclose(float(r["GBps"]), nbytes / seconds / 1e9, rel_tol=0.05, abs_tol=1e-3)
        assert math.isclose(float(r["copy_share"]), float(r["GBps"]) / float(r["copy_GBps"]), rel_tol=0.05)
    # 2-bit codes with fp16 scales and a 128-token fp16 residual: fewer bytes than the fp16 cache
    fused = next(r for r in rows if r["kernel"] == "fused_decode_attention")
    fp16_cache = 2 * int(fused["kv_heads"]) * int(fused["context"]) * int(fused["head_dim"]) * 2
    assert int(fused["bytes"]) < fp16_cache


def test_decode_csv_has_one_row_per_method_and_names_the_backend(dry_run):
    out, _ = dry_run
    columns, rows = read(out / "gpu_decode.csv")
    assert columns == DECODE
    assert [r["method"] for r in rows] == ["DynamicCache", "fp16", "fp16", "kivi", "kivi", "kvquant"]
    # fp16 and kivi have a static decode step: a second row each, run eagerly on the CPU, timed
    # against the method's eager row
    assert [r["decode_step"] for r in rows] == ["eager", "eager", "static", "eager", "static", "eager"]
    for i in (2, 4):
        static, eager = rows[i], rows[i - 1]
        ratio = float(static["step_ms"]) / float(eager["step_ms"])
        assert math.isclose(float(static["vs_eager"]), ratio, rel_tol=0.01, abs_tol=0.005)
        assert static["backend_in_use"] == "triton" and static["status"] == "ok"
        assert static["label"] == eager["label"]
    assert all(r["vs_eager"] == "" for i, r in enumerate(rows) if i not in (2, 4))
    by = {r["method"]: r for r in rows if r["decode_step"] == "eager"}
    for r in rows:
        assert r["status"] == "ok" and r["context"] == "256" and r["layers"] == "1", r
        assert float(r["step_ms"]) >= float(r["step_ms_min"]) > 0, r
    sdpa = float(by["DynamicCache"]["step_ms"])
    for name in ("fp16", "kivi", "kvquant"):
        # written with two decimals: 0.005 of rounding, more than 1% of a ratio below 0.5
        ratio = float(by[name]["step_ms"]) / sdpa
        assert math.isclose(float(by[name]["vs_sdpa"]), ratio, rel_tol=0.01, abs_tol=0.005)
    # every method here implements triton and asks for it, and Triton reads all of its parts
    for name in ("fp16", "kivi", "kvquant"):
        assert (by[name]["backend_requested"], by[name]["backend_in_use"]) == ("triton", "triton"), name
    assert by["kivi"]["label"].startswith("kivi-2")


def test_a_bad_method_fails_loudly(tmp_path):
    proc = run_check(tmp_path, "--only", "nosuch", "--sections", "decode")
    assert proc.returncode != 0
    assert "'nosuch' is not a registered method" in proc.stdout + proc.stderr
    assert "gpu_check.py: FAILED" in proc.stdout


def test_rows_past_the_budget_are_written_as_skipped_and_fail_the_run(tmp_path):
    proc = run_check(tmp_path, "--sections", "decode", "--only", "fp16", "--budget-s", "0")
    assert proc.returncode != 0
    columns, rows = read(tmp_path / "gpu_decode.csv")
    assert columns == DECODE
    assert [r["method"] for r in rows] == ["DynamicCache", "fp16", "fp16"]
    assert all(r["status"].startswith("skipped: ") and r["step_ms"] == "" for r in rows), rows
    assert "3 skipped" in proc.stdout
    assert proc.stdout.count("[decode] ") == 3


def test_results_and_logs_go_under_OUT_when_it_is_set(tmp_path):
    """Only files under $OUT come back from the lent machine: the CSVs, the check's log and the
    summary go to $OUT/gpu_check without --out-dir; a section's own budget skips its rows."""
    env = {**os.environ, "PYTHON": sys.executable, "KVBENCH_CPU_KERNELS": "0", "OUT": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--dry", "--sections", "parity", "--section-s", "parity=0"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = tmp_path / "gpu_check"
    assert proc.returncode != 0  # skipped rows are not a pass
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "gpu_parity.csv", "summary.txt"]
    _, rows = read(out / "gpu_parity.csv")
    assert len(rows) == 7 and all(r["status"].startswith("skipped: ") for r in rows), rows
    # by value: the fused decode attention row comes first
    assert rows[0]["kernel"] == "fused_decode_attention"
    assert "gpu_check.py: FAILED" in (out / "summary.txt").read_text()
    assert "7 skipped" in (out / "gpu_check.log").read_text()
