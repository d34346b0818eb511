"""Smoke test of ``scripts/bench_kernels.py``: its tiny configuration end to end.

Without CUDA the kernels run under Triton's CPU interpreter (``conftest.py`` in this folder sets it
before triton is imported); the run takes a few seconds.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_kernels.py"


def load_script():
    """Import the script as a module (registered first: dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location("bench_kernels_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module


def test_smoke_run_writes_one_checked_row(tmp_path, capsys):
    out = tmp_path / "results" / "bench_kernels.csv"
    assert load_script().main(["--smoke", "--out", str(out)]) == 0

    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["context"], r["batch"], r["status"]) for r in rows] == [("256", "1", "ok")]
    row = rows[0]
    for path in ("fused", "dequant", "fp16"):
        assert float(row[f"{path}_us"]) > 0, path
        assert float(row[f"{path}_GBps"]) > 0, path
        assert 0 < float(row[f"{path}_copy_frac"]) < math.inf, path
    fused, dequant, fp16 = (int(row[f"{p}_bytes"]) for p in ("fused", "dequant", "fp16"))
    # 2-bit codes + fp16 params + 128 fp16 residual tokens of 256 < the fp16 cache < the torch path's traffic.
    assert 0 < fused < fp16 < dequant
    assert float(row["copy_GBps"]) > 0
    assert float(row["speedup_vs_fp16"]) > 0 and float(row["speedup_vs_dequant"]) > 0

    err = float(row["max_abs_err_fused"])
    assert math.isfinite(err) and err < 1e-3, err
    printed = capsys.readouterr().out
    assert "max abs err fused" in printed
    assert "copy bandwidth" in printed
    assert "not among --contexts" in printed
