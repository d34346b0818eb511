"""The prepared device check: kernel parity, kernel bandwidth and decode-step time on one GPU.

Three sections, each printing one line per result, then a summary; a result that could not be
measured is a row with its status (``error: ...``, ``skipped: ...``), never a missing row:

1. **parity** (``gpu_parity.csv``): every Triton kernel against its torch reference, per stored
   format. ``quantize_pack``/``unpack_dequantize`` must equal ``quantize_grouped`` + ``pack`` and
   ``dequantize_grouped`` bit for bit (level count x axis x head_dim, and SpeCache's 1-bit zero
   point); ``fused_decode_attention``
   must match ``decode_attention_reference`` within 1e-4 of the output's scale (KIVI layout: keys
   per channel, values per token, fp16 residual).
2. **bandwidth** (``gpu_bandwidth.csv``): bytes each decode kernel must move once (packed codes,
   scales, zeros, residual, query, output) over its median time, as a share of a device-to-device
   copy moving the same bytes (half read, half written), both timed with ``torch.cuda.Event``
   (``scripts/bench_kernels.py``'s timer: L2 evicted before each repetition, CUDA graphs).
3. **decode** (``gpu_decode.csv``): the time of one decode step of every registered method (2 bits
   where it takes that width, as ``scripts/count_ops.py`` configures them; ``backend=triton`` where
   the method implements it, its torch reference otherwise) against transformers' ``DynamicCache``
   with SDPA, on a randomly initialised Llama-3.1-8B shape (bf16, :data:`LAYERS` layers, the real
   vocabulary), the cache filled with the context's random post-RoPE keys and values as
   ``scripts/count_ops.py`` fills it. Each row says which backend the method asked for, which its
   stores resolved to, and which read the stored tokens
   (:func:`kvbench.kernels.cpu.backend_in_use`). A method with a static decode step
   (``method.cuda_graph``: fp16, uniform) gets a second row (``decode_step``): its step captured
   once as a CUDA graph and replayed (``graph``; ``static`` where it runs eagerly, the dry mode),
   timed against the method's own eager step (``vs_eager``).

Sections run by value (parity, decode, bandwidth), each within its own budget (``--section-s``,
:data:`SECTION_S` on a GPU) and the whole check's (``--budget-s``): rows reached later are written as
skipped, and every CSV is rewritten after each row, so a run stopped by the shell's timeout keeps what
it measured. The CSVs go to ``$OUT/gpu_check`` when ``OUT`` is set (the lent machine returns only
``$OUT``), else ``benchmarks/``. The model of the decode section must pass kvbench's cache-reach
probe (:func:`kvbench.cache.reach.check_cache_reached`): under a transformers that drops ``cache=``
the section stops with that one line instead of timing a cache nothing reads. The exit status is 0
only when every row is ``ok``.

``--dry`` runs the same code on the CPU under ``TRITON_INTERPRET=1`` at tiny sizes (a few hundred
tokens, a 1-layer tiny Llama, a few methods), so the tests can run it in seconds; its numbers are
meaningless, its rows and columns are the real ones.

    bash scripts/gpu_check.sh                 # on the lent GPU; writes benchmarks/gpu_*.csv
    bash scripts/gpu_check.sh --dry --out-dir /tmp/gc
"""

from __future__ import annotations

import os
import sys

# Run as a script, this folder is on sys.path, not the repository: put it first so that kvbench
# imports from this checkout (the lent machine has no installed kvbench).
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

# The interpreter is chosen when a kernel is decorated: decide before anything imports triton.
DRY = "--dry" in sys.argv[1:] or os.environ.get("KVBENCH_GPU_CHECK_DRY", "") not in ("", "0")
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import csv  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent

LAYERS = 4
REFERENCE = "DynamicCache"

# Llama-3.1-8B: attention and MLP widths, vocabulary and RoPE base; the layer count is cut.
LLAMA_8B = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    num_hidden_layers=LAYERS,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=131072,
)
TINY = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
    num_hidden_layers=1,
    vocab_size=128,
    rope_theta=10000.0,
    max_position_embeddings=4096,
)


@dataclass(frozen=True)
class Sizes:
    """What one mode runs: formats checked, kernel shapes timed, decode contexts and methods."""

    quant_levels: tuple[int, ...]
    attn_levels: tuple[int, ...]
    head_dims: tuple[int, ...]
    parity_tokens: int  # T of the parity inputs (a multiple of every group size)
    bw_contexts: tuple[int, ...]
    bw_batches: tuple[int, ...]
    bw_heads: tuple[int, int]  # query heads, kv heads
    bw_head_dim: int
    decode_contexts: tuple[int, ...]
    methods: tuple[str, ...] | None  # None: every registered method
    geometry: dict
    dtype: torch.dtype
    warmup_steps: int
    timed_steps: int
    reps: int
    warmup: int


# Every level count is its own compiled specialization of each kernel (a cold compile takes ~1-5 s
# each, single-threaded): the full check keeps the formats the methods store (2 = 1-bit and SpeCache,
# 3 = a base-L word, 4 = KIVI's 2-bit, 16 = 4-bit), not every level count the kernels accept (the
# CPU tests cover those under the interpreter).
FULL = Sizes(
    quant_levels=(2, 3, 4, 16),
    attn_levels=(4, 16),
    head_dims=(64, 128),
    parity_tokens=512,
    bw_contexts=(8192, 32768),
    bw_batches=(1, 8),
    bw_heads=(32, 8),
    bw_head_dim=128,
    decode_contexts=(8192, 32768),
    methods=None,
    geometry=LLAMA_8B,
    dtype=torch.bfloat16,
    warmup_steps=2,
    timed_steps=5,
    reps=20,
    warmup=5,
)
DRY_SIZES = Sizes(
    quant_levels=(3, 4),
    attn_levels=(4,),
    head_dims=(64,),
    parity_tokens=64,
    bw_contexts=(256,),
    bw_batches=(1,),
    bw_heads=(4, 2),
    bw_head_dim=64,
    decode_contexts=(256,),
    methods=("fp16", "kivi", "kvquant"),
    geometry=TINY,
    dtype=torch.float32,
    warmup_steps=1,
    timed_steps=2,
    reps=2,
    warmup=1,
)
GROUP = 32
RESIDUAL = 128
# Seconds each section may take on a GPU (cold Triton compiles included); the shell gives the whole
# check 360 s. Rows reached later are written as skipped, so the CSVs say what was not measured.
SECTION_S = {"parity": 100.0, "decode": 170.0, "bandwidth": 70.0}
ATTN_REL_TOL = 1e-4


def load_script(name: str):
    """Another script of this folder as a module (registered first: dataclasses look it up)."""
    spec = importlib.util.spec_from_file_location(f"gpu_check_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


@dataclass
class Section:
    """Rows of one CSV and the tally the summary prints."""

    name: str
    columns: list[str]
    rows: list[dict] = field(default_factory=list)
    path: Path | None = None

    deadline: float = float("inf")  # time.monotonic() after which rows are written as skipped
    budget_s: float = 0.0

    def expired(self) -> bool:
        return time.monotonic() > self.deadline

    def skip_note(self) -> str:
        return f"skipped: this section's {self.budget_s:.0f} s (--budget-s, --section-s) were spent"

    def add(self, row: dict, line: str) -> None:
        missing = [c for c in self.columns if c not in row]
        assert not missing, f"{self.name} row lacks {missing}"
        self.rows.append(row)
        print(f"[{self.name}] {line}", flush=True)
        if self.path is not None:  # rewritten per row: a run killed by a timeout keeps what it measured
            self.write()

    def failures(self) -> list[dict]:
        return [r for r in self.rows if not r["status"].startswith(("ok", "skipped"))]

    def skipped(self) -> list[dict]:
        return [r for r in self.rows if r["status"].startswith("skipped")]

    def write(self) -> None:
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns)
            w.writeheader()
            w.writerows(self.rows)
        tmp.replace(self.path)


# ---------------------------------------------------------------------------------------------
# 1. Parity
# ---------------------------------------------------------------------------------------------

PARITY_COLUMNS = [
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


def parity(sizes: Sizes, device: torch.device, section: Section) -> None:
    from kvbench.kernels.decode_attention import PackedKV, fused_decode_attention
    from kvbench.kernels.quant_pack import quantize_pack, unpack_dequantize
    from kvbench.quant.affine import dequantize_grouped, quantize_grouped
    from kvbench.quant.attention_ref import decode_attention_reference
    from kvbench.quant.packing import pack, unpack

    gen = torch.Generator(device=device).manual_seed(0)
    t = sizes.parity_tokens

    def record(kernel, levels, axis, zp, d, tokens, err, tol, ok, note=""):
        status = "ok" if ok else (note or f"FAIL: max abs err {err:.3g} > {tol:.3g}")
        section.add(
            dict(
                kernel=kernel,
                levels=levels,
                axis=axis,
                zero_point=zp,
                head_dim=d,
                tokens=tokens,
                device=device.type,
                max_abs_err="" if err is None else f"{err:.3g}",
                tol=tol,
                status=status,
            ),
            f"{kernel:24s} L={levels:<3d} {axis:7s} {zp:8s} D={d:<3d} "
            f"err={err if err is None else f'{err:.3g}'} {status}",
        )

    def quant_case(d: int, axis: str, levels: int, zp: str) -> None:
        try:
            x = torch.randn(2, 2, t, d, generator=gen, device=device).half()
            packed, scale, zero = quantize_pack(x, levels, axis, GROUP, zp)
            codes, rs, rz = quantize_grouped(x, levels, axis, GROUP, zp)
            ref_packed = pack(codes, levels)
            same = torch.equal(packed, ref_packed) and torch.equal(scale, rs) and torch.equal(zero, rz)
            out = unpack_dequantize(packed, scale, zero, levels, axis, GROUP, d)
            ref = dequantize_grouped(unpack(ref_packed, levels, d), rs, rz, axis, GROUP)
            err = (out - ref).abs().max().item()
            note = "" if same else "FAIL: packed bytes/scale/zero differ from the reference"
            record("quantize_pack+unpack", levels, axis, zp, d, t, err, 0.0, same and err == 0.0, note)
        except Exception as exc:  # noqa: BLE001 - every failure is a row
            record(
                "quantize_pack+unpack",
                levels,
                axis,
                zp,
                d,
                t,
                None,
                0.0,
                False,
                f"error: {one_line(exc)}",
            )

    def attn_case(d: int, levels: int) -> None:
        try:
            b, h_kv, gqa, n0 = 2, 2, 4, t + 40
            tq = t  # quantized tokens (multiple of the group); the rest is the fp16 residual
            q = torch.randn(b, h_kv * gqa, 1, d, generator=gen, device=device)
            spread = 0.5 + torch.randn(d, generator=gen, device=device).abs()
            keys = torch.randn(b, h_kv, n0, d, generator=gen, device=device) * spread
            values = torch.randn(b, h_kv, n0, d, generator=gen, device=device) + 0.3
            kq = PackedKV(*quantize_pack(keys[:, :, :tq], levels, "channel", GROUP), levels, GROUP, "channel")
            vq = PackedKV(*quantize_pack(values[:, :, :tq], levels, "token", GROUP), levels, GROUP, "token")
            k_res, v_res = keys[:, :, tq:].half(), values[:, :, tq:].half()
            out = fused_decode_attention(q, kq, vq, d**-0.5, k_res, v_res)
            ref = decode_attention_reference(q, [kq, k_res], [vq, v_res], d**-0.5)
            err = (out - ref).abs().max().item()
            tol = ATTN_REL_TOL * ref.abs().max().item()
            ok = bool(torch.isfinite(out).all()) and err <= tol
            record("fused_decode_attention", levels, "kivi", "minmax", d, n0, err, f"{tol:.3g}", ok)
        except Exception as exc:  # noqa: BLE001
            record(
                "fused_decode_attention",
                levels,
                "kivi",
                "minmax",
                d,
                t + 40,
                None,
                "",
                False,
                f"error: {one_line(exc)}",
            )

    # by value: the fused decode attention first (what every decode step of KIVI runs), head_dim 128
    # (Llama-8B-class models) before 64; the rows reached after the section's budget are skipped
    dims = sorted(sizes.head_dims, reverse=True)
    cases = [("attn", d, "kivi", levels, "minmax") for d in dims for levels in sizes.attn_levels]
    # SpeCache's 1-bit store has its own zero point
    formats = [*((n, "minmax") for n in sizes.quant_levels), (2, "specache")]
    cases += [("quant", d, axis, lv, zp) for d in dims for axis in ("token", "channel") for lv, zp in formats]
    for what, d, axis, levels, zp in cases:
        kernel = "fused_decode_attention" if what == "attn" else "quantize_pack+unpack"
        if section.expired():
            tokens = t + 40 if what == "attn" else t
            record(kernel, levels, axis, zp, d, tokens, None, "", False, section.skip_note())
        elif what == "attn":
            attn_case(d, levels)
        else:
            quant_case(d, axis, levels, zp)


# ---------------------------------------------------------------------------------------------
# 2. Bandwidth
# ---------------------------------------------------------------------------------------------

BANDWIDTH_COLUMNS = [
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


def kivi_cache(sizes: Sizes, levels: int, context: int, batch: int, device: torch.device, gen):
    """``(q, kq, vq, k_res, v_res)``: a KIVI cache of ``context`` tokens, the newest ``context - T``
    (T = ``context - RESIDUAL`` rounded down to the group) kept fp16."""
    from kvbench.kernels.decode_attention import PackedKV
    from kvbench.kernels.quant_pack import quantize_pack

    h, h_kv = sizes.bw_heads
    d = sizes.bw_head_dim
    tq = max(context - RESIDUAL, 0) // GROUP * GROUP
    q = torch.randn(batch, h, 1, d, generator=gen, device=device).half()
    keys = torch.randn(batch, h_kv, context, d, generator=gen, device=device).half()
    values = torch.randn(batch, h_kv, context, d, generator=gen, device=device).half()
    kq = PackedKV(*quantize_pack(keys[:, :, :tq], levels, "channel", GROUP), levels, GROUP, "channel")
    vq = PackedKV(*quantize_pack(values[:, :, :tq], levels, "token", GROUP), levels, GROUP, "token")
    k_res, v_res = keys[:, :, tq:].contiguous(), values[:, :, tq:].contiguous()
    del keys, values
    return q, kq, vq, k_res, v_res


def kernel_cases(bench, cache, levels: int, d: int) -> dict:
    """``{kernel: (call, bytes it must move once)}`` for one KIVI cache."""
    from kvbench.kernels.decode_attention import fused_decode_attention
    from kvbench.kernels.quant_pack import unpack_dequantize

    q, kq, vq, k_res, v_res = cache
    # shapes only: what the kernels write, for the byte count
    out = torch.empty(q.shape, dtype=q.dtype, device="meta")
    dq = torch.empty(*kq.codes.shape[:-1], d, dtype=torch.float32, device="meta")
    return {
        # read: the cache once and q; write: the output
        "fused_decode_attention": (
            lambda: fused_decode_attention(q, kq, vq, d**-0.5, k_res, v_res),
            bench.packed_bytes(kq) + bench.packed_bytes(vq) + bench.tensor_bytes(k_res, v_res, q, out),
        ),
        # the keys' codes and params read, their float32 reconstruction written
        "unpack_dequantize": (
            lambda: unpack_dequantize(kq.codes, kq.scale, kq.zero, levels, "channel", GROUP, d),
            bench.packed_bytes(kq) + bench.tensor_bytes(dq),
        ),
    }


def bandwidth(sizes: Sizes, device: torch.device, section: Section) -> None:
    bench = load_script("bench_kernels")
    timer = bench.Timer(device, sizes.warmup, sizes.reps, cuda_graph=True, flush_l2=True)
    gen = torch.Generator(device=device).manual_seed(1)
    h, h_kv = sizes.bw_heads
    d = sizes.bw_head_dim
    clock = "cuda-events" if device.type == "cuda" else "perf_counter"
    for context in sizes.bw_contexts:
        for batch in sizes.bw_batches:
            for levels in sizes.attn_levels:
                base = dict(
                    levels=levels, context=context, batch=batch, heads=h, kv_heads=h_kv, head_dim=d,
                    device=device.type,
                )  # fmt: skip
                if section.expired():
                    for kernel in ("fused_decode_attention", "unpack_dequantize"):
                        _bandwidth_row(section, kernel, base, section.skip_note())
                    continue
                try:
                    cases = kernel_cases(
                        bench, kivi_cache(sizes, levels, context, batch, device, gen), levels, d
                    )
                except Exception as exc:  # noqa: BLE001
                    for kernel in ("fused_decode_attention", "unpack_dequantize"):
                        _bandwidth_error(section, kernel, base, exc)
                    continue
                for kernel, (fn, nbytes) in cases.items():
                    try:
                        seconds, mode = timer(fn)
                        half = max(nbytes // 2, 1)
                        src = torch.ones(half, dtype=torch.uint8, device=device)
                        dst = torch.empty_like(src)
                        copy_s, _ = timer(lambda src=src, dst=dst: dst.copy_(src))
                        del src, dst
                        gbps, copy_gbps = nbytes / seconds / 1e9, 2 * half / copy_s / 1e9
                        row = dict(
                            kernel=kernel,
                            **base,
                            bytes=nbytes,
                            us=f"{seconds * 1e6:.2f}",
                            GBps=f"{gbps:.4g}",
                            copy_us=f"{copy_s * 1e6:.2f}",
                            copy_GBps=f"{copy_gbps:.4g}",
                            copy_share=f"{gbps / copy_gbps:.4g}",
                            timing=f"{clock}/{mode}",
                            status="ok",
                        )
                        section.add(
                            row,
                            f"{kernel:24s} L={levels:<3d} N={context:<6d} B={batch:<3d} "
                            f"{seconds * 1e6:10.1f} us {gbps:8.1f} GB/s = {gbps / copy_gbps:6.1%} of copy "
                            f"({copy_gbps:.1f} GB/s)",
                        )
                    except Exception as exc:  # noqa: BLE001
                        _bandwidth_error(section, kernel, base, exc)
                del cases
                _free(device)


def _bandwidth_error(section: Section, kernel: str, base: dict, exc: BaseException) -> None:
    _bandwidth_row(section, kernel, base, f"error: {one_line(exc)}")


def _bandwidth_row(section: Section, kernel: str, base: dict, status: str) -> None:
    blank = dict.fromkeys(("bytes", "us", "GBps", "copy_us", "copy_GBps", "copy_share", "timing"), "")
    row = dict(kernel=kernel, **base, **blank, status=status)
    section.add(row, f"{kernel:24s} L={base['levels']} N={base['context']} B={base['batch']} {row['status']}")


# ---------------------------------------------------------------------------------------------
# 3. Decode step
# ---------------------------------------------------------------------------------------------

DECODE_COLUMNS = [
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


def _free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def step_times(step, device: torch.device, warmup: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step()`` after ``warmup``: CUDA events around each
    call on a GPU (host work inside the step is part of the step), perf_counter on the CPU."""
    for _ in range(warmup):
        step()
    _sync(device)
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    return times


def build_model(sizes: Sizes, device: torch.device, count_ops):
    """``count_ops``' random Llama of ``sizes.geometry`` built on ``device`` (seeded), on kvbench's
    attention, refused where transformers does not hand the cache to kvbench's attention."""
    from kvbench.cache.reach import check_cache_reached

    loaded = count_ops.build_model(sizes.geometry, sizes.dtype, device)
    check_cache_reached(loaded.model, loaded.shape.num_layers)  # refuse a transformers that drops cache=
    return loaded


def method_node(name: str, count_ops) -> dict:
    """``count_ops``' node, with ``backend=triton`` where the method's config accepts it (some that
    list it refuse it in their own checks: the eviction methods, SpeCache); else its default."""
    from kvbench.errors import ConfigError
    from kvbench.methods import METHODS, build_method

    node = count_ops.method_node(name)
    if "triton" not in METHODS.get(name).Config.backends:
        return node
    try:
        build_method({**node, "backend": "triton"})
    except ConfigError:
        return node
    return {**node, "backend": "triton"}


def static_node(name: str, count_ops) -> dict | None:
    """:func:`method_node` with ``cuda_graph=true`` for a method that has a static decode step
    (kvbench/cache/static.py), else None."""
    from kvbench.errors import ConfigError
    from kvbench.methods import METHODS, build_method

    if METHODS.get(name).Config.static_step is None:
        return None
    node = {**method_node(name, count_ops), "cuda_graph": True}
    try:
        build_method(node)
    except ConfigError:
        return None
    return node


def static_step_of(runner, prompt, steps: int, device: torch.device, count_ops):
    """A :class:`~kvbench.cache.static.StaticStep` over a cache reserved for the prompt and
    ``steps`` tokens and filled as :func:`count_ops.fill` fills one; on CUDA it captures a graph at
    its second call (``decode_step`` ``graph``), elsewhere it runs the static step eagerly
    (``static``)."""
    from kvbench.cache.static import StaticStep

    n = prompt.ids.shape[1]
    cache = runner.new_cache()
    cache.reserve(n + steps + 1)
    count_ops.fill(runner, cache, prompt)
    cache.advance(n)
    forward = runner._static_forward(cache)
    return StaticStep(forward, cache, n, device, capture=device.type == "cuda")


def decode(sizes: Sizes, device: torch.device, section: Section) -> None:
    """Rows reached after the section's deadline are written as skipped. A method with
    a static decode step gets a second row, that step (a replayed CUDA graph on CUDA), with its
    time against the method's own eager step (``vs_eager``)."""
    from transformers import DynamicCache

    from kvbench.cache import ATTN_IMPLEMENTATION
    from kvbench.kernels import cpu as cpu_kernels
    from kvbench.methods import METHODS, build_method

    count_ops = load_script("count_ops")
    names = list(sizes.methods or METHODS.names())
    loaded = build_model(sizes, device, count_ops)
    model = loaded.model
    steps = sizes.warmup_steps + sizes.timed_steps
    common = dict(
        layers=loaded.shape.num_layers, dtype=str(sizes.dtype).removeprefix("torch."), device=device.type
    )

    def add(row: dict) -> None:
        section.add(
            row,
            f"{row['label']:40s} {row['decode_step']:6s} N={row['context']:<6d} "
            f"{row['step_ms'] or '-':>9s} ms "
            f"x{row['vs_sdpa'] or '-':>6s} vs SDPA  backend {row['backend_requested']}->"
            f"{row['backend_resolved']} read by {row['backend_in_use']}  {row['status']}",
        )

    for n in sizes.decode_contexts:
        prompt = count_ops.random_prompt(loaded, n, steps, device)
        tokens = [torch.tensor([[t]], device=device) for t in prompt.tokens]
        sdpa_ms = None
        eager_ms = {}
        runs = [(REFERENCE, False)]
        for name in names:
            runs.append((name, False))
            if static_node(name, count_ops) is not None:
                runs.append((name, True))
        for name, static in runs:
            row = dict(
                method=name,
                label=name,
                context=n,
                **common,
                backend_requested="",
                backend_resolved="",
                backend_in_use="",
                decode_step="eager",
                step_ms="",
                step_ms_min="",
                vs_sdpa="",
                vs_eager="",
                steps=sizes.timed_steps,
                status="ok",
            )
            if section.expired():
                row["status"] = section.skip_note()
                add(row)
                continue
            cache = runner = None
            try:
                cpu_kernels.reset_for_tests()  # so backend_in_use names this method's reads only
                if name == REFERENCE:
                    row.update(backend_requested="sdpa", backend_resolved="sdpa", backend_in_use="sdpa")
                    cache = DynamicCache(config=model.config)
                    for i in range(loaded.shape.num_layers):
                        cache.update(prompt.keys[i], prompt.values[i], i)
                    model.set_attn_implementation("sdpa")
                    it = iter(tokens)

                    def step(it=it, cache=cache):
                        with torch.no_grad():
                            model(input_ids=next(it), cache=cache, use_cache=True).logits.float()

                    try:
                        times = step_times(step, device, sizes.warmup_steps, sizes.timed_steps)
                    finally:
                        model.set_attn_implementation(ATTN_IMPLEMENTATION)
                else:
                    node = static_node(name, count_ops) if static else method_node(name, count_ops)
                    method = build_method(node)
                    row.update(
                        label=method.label(),
                        backend_requested=method.config.backend,
                        backend_resolved=method.config.storage_backend(),
                    )
                    runner = loaded.runner(method)
                    if static:
                        cache = static_step_of(runner, prompt, steps, device, count_ops)
                        ids = iter(prompt.tokens)

                        def step(ids=ids, cache=cache):
                            cache(next(ids))

                    else:
                        cache = runner.new_cache()
                        count_ops.fill(runner, cache, prompt)
                        it = iter(tokens)

                        def step(it=it, cache=cache, runner=runner):
                            with torch.no_grad():
                                runner.decode_step(next(it), cache)

                    times = step_times(step, device, sizes.warmup_steps, sizes.timed_steps)
                    if static:
                        row["decode_step"] = cache.mode
                    used = cpu_kernels.backend_in_use()
                    if used == "none":  # a fused path that records no read (KIVI's Triton decode)
                        resolved = row["backend_resolved"]
                        used = resolved if resolved != "auto" else "torch"
                    row["backend_in_use"] = used
                ms = statistics.median(times) * 1e3
                row.update(step_ms=f"{ms:.3f}", step_ms_min=f"{min(times) * 1e3:.3f}")
                if name == REFERENCE:
                    sdpa_ms = ms
                elif sdpa_ms:
                    row["vs_sdpa"] = f"{ms / sdpa_ms:.2f}"
                if static and eager_ms.get(name):
                    row["vs_eager"] = f"{ms / eager_ms[name]:.2f}"
                elif name != REFERENCE:
                    eager_ms[name] = ms
            except Exception as exc:  # noqa: BLE001 - every failure is a row
                row["status"] = f"error: {one_line(exc)}"
                if os.environ.get("KVBENCH_GPU_CHECK_TRACEBACK"):
                    traceback.print_exc()
            add(row)
            del cache, runner
            _free(device)
        del prompt, tokens
        _free(device)


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dry",
        action="store_true",
        help="CPU, TRITON_INTERPRET=1, tiny sizes (also KVBENCH_GPU_CHECK_DRY=1)",
    )
    # only files under $OUT come back from the lent machine
    out = os.environ.get("OUT")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=Path(out) / "gpu_check" if out else ROOT / "benchmarks",
        help="where the CSVs go (default: $OUT/gpu_check when OUT is set, else benchmarks/)",
    )
    # by value: kernel correctness, then what a decode step costs per method, then kernel bandwidth
    p.add_argument("--sections", nargs="+", default=["parity", "decode", "bandwidth"])
    p.add_argument("--only", nargs="+", help="methods for the decode section (default: every registered one)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=300.0,
        help="seconds for the whole check; rows reached later are written as skipped",
    )
    p.add_argument(
        "--section-s",
        nargs="+",
        default=[],
        metavar="SECTION=SECONDS",
        help=f"a section's own budget (default {' '.join(f'{k}={v}' for k, v in SECTION_S.items())} "
        "on a GPU, none in --dry)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(sys.argv[1:] if argv is None else argv)
    dry = args.dry or DRY
    if dry and os.environ.get("TRITON_INTERPRET") != "1":
        print("gpu_check: --dry needs TRITON_INTERPRET=1 set before triton is imported", file=sys.stderr)
        return 2
    bad = sorted(set(args.sections) - {"parity", "bandwidth", "decode"})
    if bad:
        print(f"gpu_check: --sections {bad[0]!r} is not one of parity, bandwidth, decode", file=sys.stderr)
        return 2
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run with --dry for the CPU interpreter check", file=sys.stderr)
        return 2
    sizes = DRY_SIZES if dry else FULL
    if args.only:
        from kvbench.methods import METHODS

        unknown = [m for m in args.only if m not in METHODS.names()]
        if unknown:
            print(
                f"gpu_check: --only {unknown[0]!r} is not a registered method: {', '.join(METHODS.names())}",
                file=sys.stderr,
            )
            return 2
        sizes = Sizes(**{**sizes.__dict__, "methods": tuple(args.only)})
    device = torch.device("cpu" if dry else "cuda")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU {platform.machine()}"
    print(
        f"gpu_check: {'dry (TRITON_INTERPRET=1, tiny sizes)' if dry else 'full'} on {where}, "
        f"torch {torch.__version__}",
        flush=True,
    )

    sections = {
        "parity": (Section("parity", PARITY_COLUMNS), parity),
        "bandwidth": (Section("bandwidth", BANDWIDTH_COLUMNS), bandwidth),
        "decode": (Section("decode", DECODE_COLUMNS), decode),
    }
    caps = {} if dry else dict(SECTION_S)
    for item in args.section_s:
        name, _, seconds = item.partition("=")
        try:
            if name not in sections:
                raise ValueError
            caps[name] = float(seconds)
        except ValueError:
            print(
                f"gpu_check: --section-s {item!r} is not SECTION=SECONDS with SECTION one of "
                "parity, bandwidth, decode",
                file=sys.stderr,
            )
            return 2
    summary = []
    for name in args.sections:
        section, run = sections[name]
        section.path = args.out_dir / f"gpu_{name}.csv"
        section.write()
        t0 = time.monotonic()
        section.deadline = min(started + args.budget_s, t0 + caps.get(name, float("inf")))
        section.budget_s = section.deadline - t0
        crashed = None
        try:
            run(sizes, device, section)
        except Exception as exc:  # noqa: BLE001 - a section that dies still reports
            crashed = one_line(exc)
            traceback.print_exc()
        failed, skipped = len(section.failures()), len(section.skipped())
        summary.append(
            (name, len(section.rows), failed, skipped, crashed, time.monotonic() - t0, section.path)
        )
    print("gpu_check summary:", flush=True)
    worst = 0
    for name, n, failed, skipped, crashed, seconds, path in summary:
        state = f"CRASHED ({crashed})" if crashed else ("ok" if not failed else f"{failed} FAILED")
        state += f", {skipped} skipped" if skipped else ""
        print(f"  {name:10s} {n:4d} rows, {state}, {seconds:.0f} s -> {path}", flush=True)
        if crashed or failed or skipped:  # a row not measured is not a pass
            worst = 1
    return worst


if __name__ == "__main__":
    raise SystemExit(main())
