"""The decode-path Triton kernels compile for Hopper (sm_90) and Ampere (sm_80) without register
spills, at the specializations the host code launches on a CUDA device (kvbench/kernels/compile_check.py).

No GPU is needed: ``triton.compile`` with a ``GPUTarget`` runs ptxas (shipped with Triton). The
kernels here are compiled in a child process, since this folder's conftest turns the interpreter on.
One representative specialization per kernel and head dim runs by default (KIVI 2-bit, GQA 32/8,
bf16; the part kernel at a decode step's 4 rows and a prefill chunk's 64); ``KVBENCH_COMPILE_FULL=1``
sweeps level counts 2/3/4/5/6/16, GQA 32/8 and 9/3, fp16 and bf16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys
from kvbench.kernels import compile_check as cc
full = sys.argv[1] == "1"
launches = cc.trace_workloads(full)
results = cc.compile_all(launches, cc.TARGETS, jobs=int(sys.argv[2]))
print(json.dumps([
    dict(kernel=r.launch.name, spec=r.launch.describe(), cc=r.cc, regs=r.regs, stack=r.stack,
         shared=r.shared, warps=r.num_warps,
         d=r.launch.constant("D") if "D" in dict(r.launch.signature) else None,
         block_n=r.launch.constant("BLOCK_N") if "BLOCK_N" in dict(r.launch.signature) else None,
         problems=r.problems(), seconds=round(r.seconds, 2))
    for r in results
]))
"""


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    pytest.importorskip("triton")
    full = os.environ.get("KVBENCH_COMPILE_FULL", "0") not in ("", "0")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    jobs = str(max(1, min(4, (os.cpu_count() or 1) // 2)))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, "1" if full else "0", jobs],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800 if full else 300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_launched_kernel_compiles_for_sm90_and_sm80_without_spills(compiled):
    kernels = {r["kernel"] for r in compiled}
    # the decode path (fused decode attention and its reduction), the append path (quantize_pack's
    # parameter and pack kernels) and the TritonReader part kernel
    assert {
        "_decode_partial_kernel",
        "_decode_reduce_kernel",
        "_params_kernel",
        "_pack_kernel",
        "_part_kernel",
    } <= kernels
    assert {r["cc"] for r in compiled} == {90, 80}
    bad = [f"{r['spec']} sm_{r['cc']}: {'; '.join(r['problems'])}" for r in compiled if r["problems"]]
    assert not bad, "\n".join(bad)
    for r in compiled:
        assert r["stack"] == 0 and 0 < r["regs"] <= 255, r


def test_the_fused_decode_kernel_at_head_dim_128_uses_the_no_spill_tile(compiled):
    rows = [r for r in compiled if r["kernel"] == "_decode_partial_kernel"]
    assert {r["d"] for r in rows} == {64, 128}
    for r in rows:
        assert (r["block_n"], r["warps"]) == ((64, 4) if r["d"] == 64 else (32, 8)), r


def test_the_prefill_chunk_part_kernel_fits_its_shared_memory(compiled):
    chunk = [r for r in compiled if r["kernel"] == "_part_kernel" and "USE_DOT=True" in r["spec"]]
    assert chunk, "no prefill-chunk (tl.dot) specialization was traced"
    for r in chunk:
        assert r["shared"] <= 100 * 1024 and r["stack"] == 0, r
