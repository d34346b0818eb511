"""Compile the Triton kernels for Hopper and Ampere on a machine without a GPU.

No GPU is needed to know whether a kernel compiles for a GPU, how many registers it takes, whether it
spills and how much shared memory a block needs: ``triton.compile`` with a ``GPUTarget`` runs the
whole pipeline down to the cubin (ptxas ships with Triton), and ``cuobjdump --dump-resource-usage``
(also shipped) reads the registers, stack frame (spills) and shared memory back from it.

The specializations compiled are the ones the host code launches: :func:`trace` runs the kernels'
Python wrappers on CPU tensors with :func:`JITFunction.run <triton.runtime.jit.JITFunction.run>`
replaced by a recorder (Triton's own binder and ``_pack_args`` turn the arguments into the
signature, constexprs and divisibility attributes a launch on the device would compile) and the
host code planning as for a CUDA device with :data:`SM_COUNT` SMs
(:func:`kvbench.kernels.runtime.cuda_launch_plan`). Nothing is launched.

    python -m kvbench.kernels.compile_check                 # representative set, sm_90 and sm_80
    python -m kvbench.kernels.compile_check --full --jobs 8 --md benchmarks/triton_compile.md

Level counts the Triton readers refuse on CUDA (:data:`kvbench.kernels.runtime.GPU_UNCHECKED_LEVELS`:
5- and 6-bit codes) raise ``NotImplementedError`` inside the trace, as they would on the device: the
workload is then listed as skipped (in the printed summary and the markdown header) with what it
did launch before the refusal (the append path's kernels still run on the device) and nothing after.

Run it without ``TRITON_INTERPRET``: under the interpreter the kernels are not compilable objects.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

SM_COUNT = 132  # H100 / H200
TARGETS = (90, 80)
# Shared memory a block may use: 227 KB on sm_90, 163 KB on sm_80 (the opt-in maxima).
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
# The prefill-chunk kernel's own budget (issue 42): at most 100 KB per block.
PART_KERNEL_SHARED = 100 * 1024


@dataclass(frozen=True)
class Launch:
    """One compiled specialization: the kernel (module, name), what Triton compiles it with, and
    the workload that launched it first."""

    module: str
    name: str
    signature: tuple  # ((arg, type), ...)
    constexprs: tuple  # ((path, value), ...)
    attrs: tuple  # ((path, attributes), ...)
    num_warps: int
    num_stages: int
    options: tuple  # ((key, value), ...) the launch's own compile options
    workload: str = field(compare=False, default="")

    def key(self) -> str:
        text = repr((self.module, self.name, self.signature, self.constexprs, self.attrs, self.options))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def constant(self, name: str):
        """The value of constexpr parameter ``name``."""
        names = [k for k, _ in self.signature]
        return dict(self.constexprs)[(names.index(name),)]

    def describe(self) -> str:
        names = [k for k, _ in self.signature]
        consts = {names[p[0]]: v for p, v in self.constexprs if len(p) == 1 and names[p[0]].isupper()}
        shown = " ".join(f"{k}={v}" for k, v in consts.items() if k in _SHOWN)
        return f"{self.name} {shown}".strip()


_SHOWN = (
    "D", "BLOCK_M", "BLOCK_N", "BLOCK_D", "K_LEVELS", "V_LEVELS", "LEVELS", "MIX", "USE_DOT", "KIND",
    "DOT_PRECISION", "ROWS", "NQ",
)  # fmt: skip


@dataclass
class Compiled:
    """What one launch compiled to for one target (``error`` set instead when it did not)."""

    launch: Launch
    cc: int
    regs: int = 0
    stack: int = 0  # bytes of stack frame per thread: spilled registers (these kernels hold no arrays)
    shared: int = 0
    num_warps: int = 0
    seconds: float = 0.0
    error: str = ""

    def problems(self) -> list[str]:
        """Why this compile does not pass (empty when it does)."""
        out = []
        if self.error:
            return [f"compile error: {self.error}"]
        if self.stack:
            out.append(f"{self.stack} bytes of spill (stack frame) per thread")
        limit = SHARED_LIMIT[self.cc]
        if self.launch.name == "_part_kernel":
            limit = min(limit, PART_KERNEL_SHARED)
        if self.shared > limit:
            out.append(f"{self.shared} bytes of shared memory > {limit}")
        return out


def _require_compiler() -> None:
    from kvbench.kernels.runtime import interpreting

    if interpreting():
        raise RuntimeError(
            "compile_check needs TRITON_INTERPRET unset (under the interpreter the kernels are not "
            "compilable); run it in a process of its own"
        )


@contextlib.contextmanager
def trace(records: dict[str, Launch], cc: int = 90, sm_count: int = SM_COUNT, workload: str = ""):
    """Within the block, every kernel launch is recorded into ``records`` (by :meth:`Launch.key`)
    instead of run, planned as on a CUDA device of ``sm_count`` SMs with compute capability ``cc``."""
    _require_compiler()
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime import jit

    from kvbench.kernels.runtime import cuda_launch_plan

    backend = make_backend(GPUTarget("cuda", cc, 32))
    original = jit.JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        binder = jit.create_function_from_signature(self.signature, self.params, backend)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound, specialization, options
        )
        own = tuple(sorted((k, v) for k, v in kwargs.items() if k in options.__dict__))
        launch = Launch(
            module=self.fn.__module__,
            name=self.fn.__name__,
            signature=tuple(signature.items()),
            constexprs=tuple(sorted(constexprs.items())),
            attrs=tuple(sorted((k, tuple(tuple(a) for a in v)) for k, v in attrs.items())),
            num_warps=options.num_warps,
            num_stages=options.num_stages,
            options=own,
            workload=workload,
        )
        records.setdefault(launch.key(), launch)
        return None

    jit.JITFunction.run = record
    try:
        with cuda_launch_plan(sm_count):
            yield records
    finally:
        jit.JITFunction.run = original


# ---------------------------------------------------------------------------------------------
# Workloads: the decode and append paths at the shapes that matter
# ---------------------------------------------------------------------------------------------

GROUP = 32
RESIDUAL = 128


def _kivi_decode(
    levels: int, d: int, heads: tuple[int, int], dtype: torch.dtype, context: int = 4096
) -> None:
    """KIVI's decode step: its keys per channel and values per token appended (quantize_pack), then
    the fused decode attention over them and the fp residual (one new query per sequence)."""
    from kvbench.kernels.decode_attention import PackedKV, fused_decode_attention
    from kvbench.kernels.quant_pack import quantize_pack

    h, h_kv = heads
    tq = (context - RESIDUAL) // GROUP * GROUP
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, h_kv, context, d, generator=g).to(dtype)
    values = torch.randn(1, h_kv, context, d, generator=g).to(dtype)
    kq = PackedKV(*quantize_pack(keys[:, :, :tq], levels, "channel", GROUP), levels, GROUP, "channel")
    vq = PackedKV(*quantize_pack(values[:, :, :tq], levels, "token", GROUP), levels, GROUP, "token")
    q = torch.randn(1, h, 1, d, generator=g).to(dtype)
    fused_decode_attention(q, kq, vq, d**-0.5, keys[:, :, tq:], values[:, :, tq:])


def _part_reads(levels: int, d: int, rows: int, context: int = 4096) -> None:
    """TritonReader scores and mix over per-token affine codes (``rows`` query rows per kv head:
    a decode step's GQA group, or a prefill chunk's 64), the launch a per-token affine part makes."""
    from kvbench.kernels.part_reads import PackedCodes
    from kvbench.kernels.triton_parts import TritonReader
    from kvbench.quant.affine import quantize_grouped
    from kvbench.quant.packing import pack

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 8, context, d, generator=g)
    codes, scale, zero = quantize_grouped(x, levels, "token", GROUP)
    part = PackedCodes(pack(codes, levels), levels, d, scale=scale, zero=zero)
    reader = TritonReader()
    reader.token_affine_scores(torch.randn(1, 8, rows, d, generator=g), part)
    reader.token_affine_mix(torch.rand(1, 8, rows, context, generator=g), part, GROUP)


# Level counts of the full sweep: 2/3/4/5/6/16 (1-4-bit codes, base-L packing at 3, 5, 6) and the
# 5- and 6-bit bit streams (32, 64), which the readers refuse on CUDA while they are in
# GPU_UNCHECKED_LEVELS (then skipped, see trace_workloads) and which compile once they are not.
FULL_LEVELS = (2, 3, 4, 5, 6, 16, 32, 64)


def workloads(full: bool = False) -> dict[str, callable]:
    """``{name: call}``: the launches to trace. The default is one representative specialization
    per kernel and head_dim (KIVI 2-bit, GQA 32/8, bf16); ``full`` sweeps the level counts of
    :data:`FULL_LEVELS`, head_dim 64 and 128, GQA 32/8 and 9/3, fp16 and bf16."""
    out = {}
    if not full:
        for d in (64, 128):
            out[f"kivi L=4 D={d} gqa 32/8 bf16"] = functools.partial(
                _kivi_decode, 4, d, (32, 8), torch.bfloat16
            )
        out["parts L=4 D=128 rows 4"] = functools.partial(_part_reads, 4, 128, 4)
        out["parts L=4 D=128 rows 64 (prefill chunk)"] = functools.partial(_part_reads, 4, 128, 64)
        # the one prefill-chunk case the full sweep found with a stack frame (8 B, sm_90, BLOCK_N 32)
        out["parts L=3 D=64 rows 64 (prefill chunk)"] = functools.partial(_part_reads, 3, 64, 64)
        return out
    for d in (64, 128):
        for levels in FULL_LEVELS:
            for heads in ((32, 8), (9, 3)):
                for dtype in (torch.float16, torch.bfloat16):
                    name = f"kivi L={levels} D={d} gqa {heads[0]}/{heads[1]} {str(dtype)[6:]}"
                    out[name] = functools.partial(_kivi_decode, levels, d, heads, dtype)
            for rows in (3, 4, 64):
                out[f"parts L={levels} D={d} rows {rows}"] = functools.partial(_part_reads, levels, d, rows)
    return out


@dataclass(frozen=True)
class Skipped:
    """A workload the CUDA plan refuses (``NotImplementedError``: level counts in
    :data:`kvbench.kernels.runtime.GPU_UNCHECKED_LEVELS`); ``launched`` of its launches were traced
    before the refusal (and are compiled with the others)."""

    workload: str
    reason: str
    launched: int = 0


def trace_workloads(
    full: bool = False, cc: int = 90, skipped: list[Skipped] | None = None, only: dict | None = None
) -> list[Launch]:
    """The distinct launches of :func:`workloads` (or of ``only``, ``{name: call}``), in first-launch
    order. A workload that raises ``NotImplementedError`` under the CUDA plan (the Triton readers'
    refusal of 5-7-bit codes) is appended to ``skipped`` instead of failing the trace; what it
    launched before the refusal is kept, as the device would launch it too."""
    records: dict[str, Launch] = {}
    for name, call in (workloads(full) if only is None else only).items():
        before = len(records)
        try:
            with trace(records, cc=cc, workload=name):
                call()
        except NotImplementedError as exc:
            if skipped is None:
                raise
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            skipped.append(Skipped(name, reason, len(records) - before))
    return list(records.values())


def describe_skipped(skipped: list[Skipped]) -> str:
    """One line per refusal (empty when none), naming the workloads it skipped and how many launches
    they traced before it, for the printed summary and the table."""
    by_reason: dict[str, list[Skipped]] = {}
    for s in skipped:
        by_reason.setdefault(s.reason, []).append(s)
    return "\n".join(
        f"- {reason}: {len(group)} workloads ({', '.join(s.workload for s in group)}), "
        f"{sum(s.launched for s in group)} launches traced before the refusal"
        for reason, group in by_reason.items()
    )


# ---------------------------------------------------------------------------------------------
# Compiling
# ---------------------------------------------------------------------------------------------

_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """``(registers, stack bytes)`` per thread of the one kernel in ``cubin`` (cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [_tool("cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    found = _USAGE.search(out)
    if found is None:
        raise RuntimeError(f"cuobjdump printed no resource usage: {out[-300:]!r}")
    return int(found.group(1)), int(found.group(2)) + int(found.group(4))


def compile_launch(launch: Launch, cc: int) -> Compiled:
    """Compile ``launch`` for compute capability ``cc`` (Triton's cache is used as usual)."""
    _require_compiler()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(launch.module), launch.name)
    src = ASTSource(
        fn,
        dict(launch.signature),
        dict(launch.constexprs),
        {k: [list(a) for a in v] for k, v in launch.attrs},
    )
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages, **dict(launch.options)}
    t0 = time.perf_counter()
    try:
        kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
        regs, stack = resource_usage(kernel.asm["cubin"])
    except Exception as exc:  # noqa: BLE001 - a compile failure is a result
        text = str(exc).strip().splitlines()
        return Compiled(
            launch,
            cc,
            seconds=time.perf_counter() - t0,
            error=f"{type(exc).__name__}: {text[0] if text else ''}"[:300],
        )
    return Compiled(
        launch, cc, regs=regs, stack=stack, shared=kernel.metadata.shared,
        num_warps=kernel.metadata.num_warps, seconds=time.perf_counter() - t0,
    )  # fmt: skip


def _compile_job(job: tuple[Launch, int]) -> Compiled:
    return compile_launch(*job)


def compile_all(launches: list[Launch], targets=TARGETS, jobs: int = 1) -> list[Compiled]:
    """Every launch for every target, ``jobs`` processes at a time."""
    work = [(launch, cc) for launch in launches for cc in targets]
    if jobs <= 1:
        return [compile_launch(*w) for w in work]
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(_compile_job, work))


def table(results: list[Compiled]) -> str:
    """A markdown table of ``results``."""
    head = (
        "| kernel | specialization | target | registers | spill (stack B) | shared B | warps | compile s "
        "| status |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in results:
        status = "; ".join(r.problems()) or "ok"
        lines.append(
            f"| {r.launch.name} | {r.launch.describe()} | sm_{r.cc} | {r.regs} | {r.stack} | {r.shared} | "
            f"{r.num_warps} | {r.seconds:.1f} | {status} |"
        )
    return "\n".join(lines)


def headline(results: list[Compiled]) -> str:
    """Per kernel, head_dim and target: compiles, most registers, most spill bytes, most shared
    memory, warps seen (a markdown table)."""
    groups: dict[tuple, list[Compiled]] = {}
    for r in results:
        names = dict(r.launch.signature)
        d = r.launch.constant("D") if "D" in names else "-"
        groups.setdefault((r.launch.name, d, r.cc), []).append(r)
    lines = [
        "| kernel | head_dim | target | compiles | max registers | max spill B | max shared B | warps "
        "| problems |",
        "|" + "---|" * 9,
    ]
    for (name, d, cc), rows in groups.items():
        ok = [r for r in rows if not r.error]
        warps = sorted({r.num_warps for r in ok})
        lines.append(
            f"| {name} | {d} | sm_{cc} | {len(rows)} | {max((r.regs for r in ok), default=0)} | "
            f"{max((r.stack for r in ok), default=0)} | {max((r.shared for r in ok), default=0)} | "
            f"{'/'.join(map(str, warps))} | {sum(1 for r in rows if r.problems())} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import triton

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--full", action="store_true", help="every level count, head_dim, GQA and dtype")
    p.add_argument("--cc", type=int, nargs="+", default=list(TARGETS), help="compute capabilities (90 80)")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1) // 2))
    p.add_argument("--md", type=Path, help="also write the table (markdown) here")
    args = p.parse_args(argv)
    bad = [c for c in args.cc if c not in SHARED_LIMIT]
    if bad:
        print(f"compile_check: --cc {bad[0]} is not one of {sorted(SHARED_LIMIT)}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    skipped: list[Skipped] = []
    launches = trace_workloads(args.full, skipped=skipped)
    print(
        f"compile_check: {len(launches)} distinct launches traced in {time.perf_counter() - t0:.1f} s, "
        f"{len(skipped)} workloads refused on CUDA (skipped)",
        flush=True,
    )
    if skipped:
        print(describe_skipped(skipped), flush=True)
    results = compile_all(launches, args.cc, args.jobs)
    text = table(results)
    print(text)
    failed = [r for r in results if r.problems()]
    summary = (
        f"triton {triton.__version__}, {len(results)} compiles in {time.perf_counter() - t0:.0f} s, "
        f"{len(failed)} with problems"
    )
    print(f"compile_check: {summary}")
    if args.md:
        from kvbench.kernels.runtime import GPU_UNCHECKED_LEVELS

        note = ""
        if skipped:
            note = (
                f"\n\nSkipped: {len(skipped)} workloads whose level counts the Triton readers refuse on CUDA "
                f"(`kvbench.kernels.runtime.GPU_UNCHECKED_LEVELS` = {sorted(GPU_UNCHECKED_LEVELS)}: "
                "5-7-bit codes, wrong on the H200 check); their append-path launches before the refusal "
                "are compiled with the others, the readers' are not:\n\n" + describe_skipped(skipped)
            )
        args.md.write_text(
            f"# Triton compile check\n\n`python -m kvbench.kernels.compile_check"
            f"{' --full' if args.full else ''}`: {summary}.{note}\n\n{headline(results)}\n\n{text}\n"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
