"""The decode-path Triton kernels compile for Hopper (sm_90) and Ampere (sm_80) without register
spills, at the specializations the host code launches on a CUDA device (kvbench/kernels/compile_check.py).

No GPU is needed: ``triton.compile`` with a ``GPUTarget`` runs ptxas (shipped with Triton). The
kernels here are compiled in a child process, since this folder's conftest turns the interpreter on.
One representative specialization per kernel and head dim runs by default (KIVI 2-bit, GQA 32/8,
bf16; the part kernel at a decode step's 4 rows and a prefill chunk's 64, at head_dim 128 and at 64
with 3 levels, the case the full sweep once found with a stack frame); ``KVBENCH_COMPILE_FULL=1``
sweeps level counts 2/3/4/5/6/16 (and 32/64, skipped while the readers refuse them on CUDA), GQA 32/8
and 9/3, fp16 and bf16.
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
         use_dot=r.launch.constant("USE_DOT") if "USE_DOT" in dict(r.launch.signature) else None,
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


def test_the_fused_decode_kernel_uses_the_no_spill_tiles(compiled):
    rows = [r for r in compiled if r["kernel"] == "_decode_partial_kernel"]
    assert {r["d"] for r in rows} == {64, 128}
    for r in rows:
        assert (r["block_n"], r["warps"]) == ((64, 8) if r["d"] == 64 else (32, 8)), r


def test_the_prefill_chunk_part_kernel_fits_its_shared_memory(compiled):
    chunk = [r for r in compiled if r["kernel"] == "_part_kernel" and r["use_dot"]]
    assert {r["d"] for r in chunk} == {64, 128}, "a prefill-chunk (tl.dot) head_dim was not traced"
    for r in chunk:
        assert r["shared"] <= 100 * 1024 and r["stack"] == 0, r
        # head_dim 128: 32 tokens with 8 warps; 64: 16 tokens with 8 (32 left 8 B of stack at 3 and
        # 6 levels on sm_90 under triton 3.9, 16 with 4 warps 8 B at 5 levels on sm_80 under 3.6)
        assert (r["block_n"], r["warps"]) == ((16, 8) if r["d"] == 64 else (32, 8)), r


SKIP_CHILD = r"""
import functools, json
from kvbench.kernels import compile_check as cc
skipped = []
launches = cc.trace_workloads(only={
    "kivi L=32": functools.partial(cc._kivi_decode, 32, 64, (32, 8), cc.torch.bfloat16, 512),
    "parts L=64": functools.partial(cc._part_reads, 64, 64, 4, 256),
    "kivi L=4": functools.partial(cc._kivi_decode, 4, 64, (32, 8), cc.torch.bfloat16, 512),
}, skipped=skipped)
print(json.dumps(dict(kernels=sorted({l.name for l in launches}),
                      skipped=[(s.workload, s.reason, s.launched) for s in skipped],
                      text=cc.describe_skipped(skipped))))
"""


def test_levels_the_readers_refuse_on_cuda_are_skipped_not_fatal():
    """5- and 6-bit codes (GPU_UNCHECKED_LEVELS) raise under the CUDA plan as on a device: the trace
    lists them as skipped, keeps their append launches, and goes on to the next workload."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", SKIP_CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [s[0] for s in got["skipped"]] == ["kivi L=32", "parts L=64"]
    kivi, parts = got["skipped"]
    assert "levels=32" in kivi[1] and "GPU_UNCHECKED_LEVELS" in kivi[1] and kivi[2] > 0  # quantize_pack ran
    assert "levels=64" in parts[1] and parts[2] == 0
    assert "_decode_partial_kernel" in got["kernels"]  # the next workload was traced
    assert "kivi L=32" in got["text"] and "parts L=64" in got["text"]
