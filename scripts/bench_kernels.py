"""Decode-attention kernel benchmark: fused KIVI-2 against dequantize-then-SDPA and FP16 SDPA.

For each context length and batch size a KIVI-2 cache is built directly from random keys/values
(fp16, ``[B, H_kv, N, D]``): keys quantized per channel (``axis="channel"``, groups of G tokens),
values per token (``axis="token"``, groups of G channels), 2 bits, packed with the Triton
``quantize_pack``; the newest ``N - T`` tokens stay fp16 in the residual, ``T`` being ``N - R``
rounded down to a multiple of G. One decode step (one new query per sequence) is timed three ways:

1. ``fused``: :func:`kvbench.kernels.decode_attention.fused_decode_attention` on the packed cache;
2. ``dequant``: the torch reference path, ``PackedKV.dequantize`` (float32), cast to fp16,
   concatenated with the residual, then ``F.scaled_dot_product_attention(enable_gqa=True)``;
3. ``fp16``: ``F.scaled_dot_product_attention`` on the unquantized fp16 cache of the same context.

Bytes moved: ``fused`` counts what the kernel must read and write once (packed codes, scales, zeros,
fp16 residual, q, out; its split-softmax partials are listed apart in the CSV); ``fp16`` counts the
fp16 K/V plus q and out; ``dequant`` counts what every aten op of the path reads (tensor inputs)
and writes (tensor outputs), as seen by a dispatch mode on one untimed call, views excluded.
Bandwidth is bytes / median time and is compared with a measured device-to-device copy
(``dst.copy_(src)``, read + write bytes). On CUDA every repetition starts with a 256 MiB memset
that evicts L2, and each path is captured in a CUDA graph (``--no-cuda-graph`` times eager calls)
so Python launch overhead is not timed. Configurations that do not fit in memory are skipped.

Targets (project plan, H200): at 32K context the fused kernel reaches >= 60% of the copy bandwidth
and runs >= 3x faster than FP16 SDPA decode; checked (PASS/FAIL) on CUDA only.

    python scripts/bench_kernels.py                                   # 4K/32K/128K x batch 1/8/32
    python scripts/bench_kernels.py --contexts 32768 --batch 8 --input-precision tf32
    python scripts/bench_kernels.py --smoke --out /tmp/bk.csv         # tiny, CPU interpreter OK
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# Neither imports triton; the kernel modules (which do) are imported inside the functions below.
from kvbench.kernels.runtime import interpreting
from kvbench.quant.attention_ref import PackedKV, decode_attention_reference

# Triton picks its CPU interpreter when a kernel is decorated: set the variable before anything
# imports triton or kvbench.kernels.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

FULL = dict(contexts=[4096, 32768, 131072], batch=[1, 8, 32], heads=32, kv_heads=8, head_dim=128)
SMOKE = dict(contexts=[256], batch=[1], heads=4, kv_heads=2, head_dim=64, reps=2, warmup=1, copy_mib=64)
# Repetitions: CUDA default / CPU default (the interpreter is slow; its timings mean little).
CUDA_REPS, CUDA_WARMUP, CPU_REPS, CPU_WARMUP = 50, 10, 3, 1
CUDA_COPY_MIB, CPU_COPY_MIB = 1024, 256
L2_FLUSH_BYTES = 256 << 20
TARGET_CONTEXT, TARGET_COPY_FRACTION, TARGET_SPEEDUP_FP16 = 32768, 0.60, 3.0


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


class Timer:
    """Median seconds of ``fn()``: CUDA events (L2 flushed before each rep, optionally a CUDA graph)
    on a GPU, ``time.perf_counter`` on the CPU."""

    def __init__(self, device: torch.device, warmup: int, reps: int, cuda_graph: bool, flush_l2: bool):
        self.cuda = device.type == "cuda"
        self.warmup, self.reps = max(warmup, 0), max(reps, 1)
        self.cuda_graph = cuda_graph and self.cuda and not interpreting()
        self.flush = None
        if self.cuda and flush_l2:
            self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)

    def __call__(self, fn: Callable[[], object], graph: bool | None = None) -> tuple[float, str]:
        """``(median seconds, "graph" | "eager")``."""
        use_graph = self.cuda_graph if graph is None else graph and self.cuda_graph
        if not self.cuda:
            for _ in range(self.warmup):
                fn()
            times = []
            for _ in range(self.reps):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return statistics.median(times), "eager"
        mode, run = "eager", fn
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        if use_graph:
            try:
                run, mode = _capture(fn), "graph"
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as exc:  # an op that cannot be captured: time it eagerly
                print(f"  (CUDA graph capture failed, timing eagerly: {exc})", file=sys.stderr)
                torch.cuda.synchronize()
                run = fn
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(self.reps)]
        run()  # one untimed replay
        for start, end in zip(starts, ends, strict=True):
            if self.flush is not None:
                self.flush.zero_()
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        times = [s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True)]
        return statistics.median(times), mode


def _capture(fn: Callable[[], object]) -> Callable[[], None]:
    """A CUDA graph of ``fn`` (already warmed up), returned as its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def copy_bandwidth(device: torch.device, timer: Timer, mib: int) -> float:
    """Bytes/s of ``dst.copy_(src)`` over ``mib`` MiB, counting read + write."""
    n = mib << 20
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds, _ = timer(lambda: dst.copy_(src), graph=False)
    return 2 * n / seconds


# ---------------------------------------------------------------------------------------------
# Byte accounting
# ---------------------------------------------------------------------------------------------


def footprint(t: torch.Tensor) -> int:
    """Bytes of distinct elements a tensor addresses (broadcast dims counted once)."""
    if t.numel() == 0:
        return 0
    return t.element_size() * math.prod(s for s, st in zip(t.shape, t.stride(), strict=True) if st != 0)


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    return sum(footprint(t) for t in tensors if t is not None)


def packed_bytes(part: PackedKV | None) -> int:
    return 0 if part is None else tensor_bytes(part.codes, part.scale, part.zero)


class TrafficCounter(TorchDispatchMode):
    """Bytes read (tensor inputs) and written (tensor outputs) by every aten op run under it.

    Views, allocations and backend-choice queries move nothing and are skipped.
    """

    FREE = {
        "empty",
        "empty_like",
        "empty_strided",
        "_unsafe_view",
        "_fused_sdp_choice",
        "lift_fresh",
        "alias",
    }

    def __init__(self):
        super().__init__()
        self.read = 0
        self.written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.name().split("::")[-1].split(".")[0]
        if func.is_view or name in self.FREE:
            return out
        self.read += sum(footprint(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor))
        self.written += sum(footprint(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
        return out


# ---------------------------------------------------------------------------------------------
# The cache and the three decode paths
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One configuration's inputs: fp16 cache, its KIVI parts, and a query."""

    q: torch.Tensor  # [B, H, 1, D] fp16
    keys: torch.Tensor  # [B, H_kv, N, D] fp16
    values: torch.Tensor
    kq: PackedKV | None
    vq: PackedKV | None
    k_res: torch.Tensor  # [B, H_kv, N - T, D] fp16
    v_res: torch.Tensor
    scaling: float


def build_case(args, context: int, batch: int, device: torch.device, seed: int) -> Case:
    from kvbench.kernels.quant_pack import quantize_pack

    h, h_kv, d, g = args.heads, args.kv_heads, args.head_dim, args.group_size
    levels = 2**args.bits
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float16)

    # Keys with per-channel offsets and spreads (the outlier channels KIVI quantizes per channel for).
    keys = randn(batch, h_kv, context, d)
    keys.mul_(0.5 + randn(d).abs()).add_(randn(d))
    values = randn(batch, h_kv, context, d)
    q = randn(batch, h, 1, d)
    n_quant = max(context - args.residual, 0) // g * g
    kq = vq = None
    if n_quant:
        codes, scale, zero = quantize_pack(keys[:, :, :n_quant], levels, "channel", g)
        kq = PackedKV(codes, scale, zero, levels, g, "channel")
        codes, scale, zero = quantize_pack(values[:, :, :n_quant], levels, "token", g)
        vq = PackedKV(codes, scale, zero, levels, g, "token")
    k_res = keys[:, :, n_quant:].contiguous()
    v_res = values[:, :, n_quant:].contiguous()
    return Case(q, keys, values, kq, vq, k_res, v_res, d**-0.5)


def dequant_sdpa(case: Case) -> torch.Tensor:
    """The torch path: reconstruct the quantized parts, concatenate with the residual, SDPA."""
    d, dtype = case.q.shape[-1], case.q.dtype
    k_parts = [case.kq.dequantize(d).to(dtype)] if case.kq is not None else []
    v_parts = [case.vq.dequantize(d).to(dtype)] if case.vq is not None else []
    keys = torch.cat([*k_parts, case.k_res], dim=-2)
    values = torch.cat([*v_parts, case.v_res], dim=-2)
    return F.scaled_dot_product_attention(case.q, keys, values, scale=case.scaling, enable_gqa=True)


def fp16_sdpa(case: Case) -> torch.Tensor:
    return F.scaled_dot_product_attention(case.q, case.keys, case.values, scale=case.scaling, enable_gqa=True)


def fused(case: Case, args, q: torch.Tensor | None = None) -> torch.Tensor:
    from kvbench.kernels.decode_attention import fused_decode_attention

    return fused_decode_attention(
        case.q if q is None else q,
        case.kq,
        case.vq,
        case.scaling,
        case.k_res,
        case.v_res,
        block_n=args.block_n,
        num_splits=args.num_splits,
        input_precision=args.input_precision,
    )


def fused_plan(case: Case, args) -> tuple[int, int, int]:
    """``(block_n, num_splits, partial bytes)`` the fused launch uses; partials are written then read."""
    import triton

    from kvbench.kernels.decode_attention import _MIN_BLOCK_M, _plan

    batch, h, _, d = case.q.shape
    h_kv = case.keys.shape[1]
    plan = _plan(case.keys.shape[-2], batch * h_kv, case.q.device, args.block_n, args.num_splits, d)
    block_m = max(_MIN_BLOCK_M, triton.next_power_of_2(h // h_kv))
    partial = batch * h_kv * plan.num_splits * block_m * (d + 2) * 4
    return plan.block_n, plan.num_splits, 2 * partial


def check_error(case: Case, args) -> tuple[float, float]:
    """Max |fused - reference| and |dequant-SDPA - reference|, float32 query and output."""
    q32 = case.q.float()
    ref = decode_attention_reference(q32, [case.kq, case.k_res], [case.vq, case.v_res], case.scaling)
    err_fused = (fused(case, args, q32).float() - ref).abs().max().item()
    err_dequant = (dequant_sdpa(case).float() - ref).abs().max().item()
    return err_fused, err_dequant


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", help="context lengths (default 4096 32768 131072)")
    p.add_argument("--batch", type=int, nargs="+", help="batch sizes (default 1 8 32)")
    p.add_argument("--heads", type=int, help="query heads H (default 32)")
    p.add_argument("--kv-heads", type=int, help="kv heads H_kv (default 8)")
    p.add_argument("--head-dim", type=int, help="head dim D (default 128)")
    p.add_argument("--bits", type=int, default=2, help="KIVI code bits for keys and values (default 2)")
    p.add_argument("--group-size", type=int, default=32, help="quantization group G (default 32)")
    p.add_argument("--residual", type=int, default=128, help="fp16 residual tokens R (default 128)")
    p.add_argument("--input-precision", choices=["ieee", "tf32", "tf32x3"], default="ieee")
    p.add_argument("--block-n", type=int, default=None, help="fused kernel tokens per block")
    p.add_argument("--num-splits", type=int, default=None, help="fused kernel token-axis splits")
    p.add_argument("--reps", type=int, help=f"timed repetitions ({CUDA_REPS} on CUDA, {CPU_REPS} on CPU)")
    p.add_argument("--warmup", type=int, help=f"warm-up calls ({CUDA_WARMUP} on CUDA, {CPU_WARMUP} on CPU)")
    p.add_argument("--copy-mib", type=int, help=f"copy-bandwidth buffer, MiB ({CUDA_COPY_MIB} on CUDA)")
    p.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=True,
                   help="time CUDA-graph replays (default on)")  # fmt: skip
    p.add_argument("--flush-l2", action=argparse.BooleanOptionalAction, default=True,
                   help="memset 256 MiB before every timed rep on CUDA (default on)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU interpreter); flags still override")
    p.add_argument("--out", type=Path, default=Path("benchmarks/bench_kernels.csv"))
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    defaults = dict(FULL)
    defaults.update(
        reps=CUDA_REPS if cuda else CPU_REPS,
        warmup=CUDA_WARMUP if cuda else CPU_WARMUP,
        copy_mib=CUDA_COPY_MIB if cuda else CPU_COPY_MIB,
    )
    if args.smoke:
        defaults.update(SMOKE)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.heads % args.kv_heads:
        p.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
    return args


def free_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def bench_config(args, context: int, batch: int, device, timer: Timer, copy_bw: float, check: bool) -> dict:
    """One configuration's row; the cache is freed before returning."""
    row: dict = {"context": context, "batch": batch, "status": "ok"}
    case = None
    try:
        case = build_case(args, context, batch, device, args.seed + context + batch)
    except torch.OutOfMemoryError:
        row["status"] = "skipped: OOM building the cache"
    if case is not None:
        measure(case, row, args, timer, copy_bw, check)
    case = None
    free_memory(device)
    return row


def measure(case: Case, row: dict, args, timer: Timer, copy_bw: float, check: bool) -> None:
    """Fill ``row`` with the byte counts, times and ratios of the three paths on ``case``."""
    device = case.q.device
    row["block_n"], row["num_splits"], row["fused_partials_bytes"] = fused_plan(case, args)
    q_out = 2 * footprint(case.q)
    row["fused_bytes"] = packed_bytes(case.kq) + packed_bytes(case.vq) + tensor_bytes(case.k_res, case.v_res)
    row["fused_bytes"] += q_out
    row["fp16_bytes"] = tensor_bytes(case.keys, case.values) + q_out
    if check:
        try:
            row["max_abs_err_fused"], row["max_abs_err_dequant"] = check_error(case, args)
        except torch.OutOfMemoryError:
            row["status"] = "reference check OOM"
        free_memory(device)
    paths = {
        "fused": lambda: fused(case, args),
        "dequant": lambda: dequant_sdpa(case),
        "fp16": lambda: fp16_sdpa(case),
    }
    oom = []
    for name, fn in paths.items():
        try:
            if name == "dequant":
                counter = TrafficCounter()
                with counter:
                    fn()
                row["dequant_bytes"] = counter.read + counter.written
            seconds, mode = timer(fn)
            row[f"{name}_us"] = 1e6 * seconds
            row[f"{name}_timing"] = mode
            row[f"{name}_GBps"] = row[f"{name}_bytes"] / seconds / 1e9
            row[f"{name}_copy_frac"] = row[f"{name}_bytes"] / seconds / copy_bw
        except torch.OutOfMemoryError:
            oom.append(name)
        free_memory(device)
    if oom:
        row["status"] = "OOM: " + ",".join(oom)
    if "fused_us" in row:
        for name in ("dequant", "fp16"):
            if f"{name}_us" in row:
                row[f"speedup_vs_{name}"] = row[f"{name}_us"] / row["fused_us"]


def target_verdicts(row: dict, device: torch.device) -> tuple[str, str]:
    """PASS/FAIL of the two plan targets for a row at the target context (CUDA only)."""
    if device.type != "cuda":
        return "n/a on CPU", "n/a on CPU"
    if interpreting():
        return "n/a (interpreter)", "n/a (interpreter)"
    frac, speed = row.get("fused_copy_frac"), row.get("speedup_vs_fp16")
    bw = "not measured" if frac is None else ("PASS" if frac >= TARGET_COPY_FRACTION else "FAIL")
    sp = "not measured" if speed is None else ("PASS" if speed >= TARGET_SPEEDUP_FP16 else "FAIL")
    return bw, sp


COLUMNS = [
    "context", "batch", "status", "block_n", "num_splits",
    "fused_us", "dequant_us", "fp16_us",
    "fused_bytes", "dequant_bytes", "fp16_bytes", "fused_partials_bytes",
    "fused_GBps", "dequant_GBps", "fp16_GBps", "copy_GBps",
    "fused_copy_frac", "dequant_copy_frac", "fp16_copy_frac",
    "speedup_vs_dequant", "speedup_vs_fp16",
    "target_copy_frac", "target_speedup_fp16",
    "fused_timing", "dequant_timing", "fp16_timing",
    "max_abs_err_fused", "max_abs_err_dequant",
]  # fmt: skip

# (header, column, format) of the printed table.
TABLE = [
    ("ctx", "context", "d"), ("B", "batch", "d"),
    ("fused us", "fused_us", ".1f"), ("deq us", "dequant_us", ".1f"), ("fp16 us", "fp16_us", ".1f"),
    ("fused MB", "fused_bytes", "MB"), ("deq MB", "dequant_bytes", "MB"), ("fp16 MB", "fp16_bytes", "MB"),
    ("fused GB/s", "fused_GBps", ".0f"), ("deq GB/s", "dequant_GBps", ".0f"),
    ("fp16 GB/s", "fp16_GBps", ".0f"),
    ("fused %cp", "fused_copy_frac", "%"), ("deq %cp", "dequant_copy_frac", "%"),
    ("fp16 %cp", "fp16_copy_frac", "%"),
    ("x deq", "speedup_vs_dequant", ".2f"), ("x fp16", "speedup_vs_fp16", ".2f"),
    ("targets: >=60% copy, >=3x fp16", "targets", "s"), ("status", "status", "s"),
]  # fmt: skip


def cell(row: dict, column: str, spec: str) -> str:
    value = row.get(column)
    if value is None:
        return "-"
    if spec == "MB":
        return f"{value / 1e6:.1f}"
    if spec == "%":
        return f"{100 * value:.0f}%"
    return format(value, spec)


def print_table(rows: list[dict]) -> None:
    cells = [[cell(r, col, spec) for _, col, spec in TABLE] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _, _) in enumerate(TABLE)]
    print(" | ".join(h.rjust(w) for (h, _, _), w in zip(TABLE, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for c in cells:
        print(" | ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)))


def main(argv=None) -> int:
    args = parse_args(argv)
    import triton

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(
        f"device: {name}{' (Triton interpreter)' if interpreting() else ''}; torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}), triton {triton.__version__}, python {platform.python_version()}"
    )
    print(
        f"layout: H={args.heads} H_kv={args.kv_heads} D={args.head_dim}; KIVI-{args.bits}: keys per channel, "
        f"values per token, G={args.group_size}, R={args.residual} fp16; nq=1; q/out fp16; "
        f"input_precision={args.input_precision}, block_n={args.block_n or 'auto'}, "
        f"num_splits={args.num_splits or 'auto'}"
    )
    timer = Timer(device, args.warmup, args.reps, args.cuda_graph, args.flush_l2)
    copy_bw = copy_bandwidth(device, timer, args.copy_mib)
    reps = f"median of {timer.reps} after {timer.warmup} warm-up"
    if timer.cuda:
        graphs = "CUDA graphs" if timer.cuda_graph else "eager"
        print(f"timing: CUDA events, {reps}, {graphs}, L2 flush {'on' if timer.flush is not None else 'off'}")
    else:
        print(f"timing: time.perf_counter, {reps}")
    print(f"copy bandwidth (dst.copy_(src), {args.copy_mib} MiB, read+write): {copy_bw / 1e9:.0f} GB/s")
    free_memory(device)

    rows = []
    started = time.perf_counter()
    for context in args.contexts:
        for batch in args.batch:
            check = not any("max_abs_err_fused" in r for r in rows)
            row = bench_config(args, context, batch, device, timer, copy_bw, check)
            row["copy_GBps"] = copy_bw / 1e9
            if context == TARGET_CONTEXT and row["status"].startswith(("ok", "OOM")):
                bw, speed = target_verdicts(row, device)
                row["target_copy_frac"], row["target_speedup_fp16"] = bw, speed
                row["targets"] = bw if bw == speed and bw.startswith("n/a") else f"bw {bw}, 3x {speed}"
            rows.append(row)
            short = {k: (float(f"{v:.4g}") if isinstance(v, float) else v) for k, v in row.items()}
            print(short, file=sys.stderr, flush=True)
            if "max_abs_err_fused" in row:
                print(
                    f"check (first configuration, ctx={context} B={batch}, fp32 q/out vs "
                    f"decode_attention_reference): max abs err fused {row['max_abs_err_fused']:.3e}, "
                    f"dequant-SDPA (fp16 cast) {row['max_abs_err_dequant']:.3e}"
                )

    print()
    print_table(rows)
    print()
    print(
        f"targets at {TARGET_CONTEXT // 1024}K context (H200 plan): fused >= {TARGET_COPY_FRACTION:.0%} of "
        f"copy bandwidth; fused >= {TARGET_SPEEDUP_FP16:g}x faster than FP16 SDPA"
    )
    target_rows = [r for r in rows if r["context"] == TARGET_CONTEXT]
    if not target_rows:
        print(f"  {TARGET_CONTEXT} not among --contexts: not checked")
    for r in target_rows:
        bw, sp = r.get("target_copy_frac", "skipped"), r.get("target_speedup_fp16", "skipped")
        print(
            f"  B={r['batch']}: copy fraction {cell(r, 'fused_copy_frac', '%')} -> {bw}; "
            f"speedup vs fp16 {cell(r, 'speedup_vs_fp16', '.2f')}x -> {sp}"
        )

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    print(f"written {args.out} ({len(rows)} rows) in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
