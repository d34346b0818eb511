"""Decode-step time, KV bytes and transient memory of every registered method and of transformers'
own caches, measured side by side in one process on the default model.

Caches compared at each context length:

- every method in the registry at 2 bits where it has a bit width (SemKV at its own default width,
  since its two-level mix must lie between two level counts; eviction methods at their default
  budget), through kvbench's decode step (the method's own hooks included);
- ``DynamicCache``: transformers' plain cache (SDPA over full-precision keys and values);
- ``QuantizedCache(quanto, 2 bits)`` with KIVI's group size 32 and residual 128, when
  ``optimum-quanto`` is installed (``pip install -e ".[bench]"``);
- ``QuantizedCache(fp8)``, which needs nothing extra.

Every cache gets a real prefill of the same haystack prompt through its own forward. Then the decode
steps are **interleaved**: step i of every cache runs before step i+1 of any, in a rotating order,
so drifting machine load hits all caches alike. Each step feeds the same token to every cache (the
greedy path of ``DynamicCache``), so the work per step is identical. Reported per cache: the median
step time over ``--steps`` steps after ``--warmup``, its ratio to ``DynamicCache`` and to kvbench
``fp16``, the KV bytes held (kvbench: its accounting; transformers' caches: every tensor the layers
hold, quantized payloads flattened to their data, scales and shifts), and the peak transient
memory of one more decode step: the most bytes held at once by tensors created during that step
(tracked at the aten level, so it counts what the step allocates beyond the cache it reads).

    python scripts/bench_cache.py --threads 2    # 1K, 4K, 8K; writes benchmarks/bench_cache.{csv,md}
    python scripts/bench_cache.py --contexts 1024 --steps 4 --only fp16 kivi DynamicCache
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache, QuantizedCache

from kvbench.builder import LoadedModel, load_for_methods
from kvbench.cache import memory_report
from kvbench.cache.transient import PeakTransient
from kvbench.data import resolve_data_root
from kvbench.errors import ConfigError
from kvbench.generate import ModelRunner
from kvbench.kernels.counting import count_ops
from kvbench.kernels.cpu import backend_in_use
from kvbench.methods import METHODS, build_method

BENCH_BITS = 2
PEER_LABELS = ("DynamicCache", "QuantizedCache-quanto-2b", "QuantizedCache-fp8")


def haystack_ids(tokenizer, n: int) -> torch.Tensor:
    essays = sorted((resolve_data_root(None) / "niah" / "PaulGrahamEssays").glob("*.txt"))
    text = "\n".join(p.read_text() for p in essays)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    while len(ids) < n:
        ids = ids + ids
    return torch.tensor([ids[:n]])


def method_node(name: str) -> dict:
    """The registry's node for ``name`` at :data:`BENCH_BITS` when the method takes a bit width and
    accepts that one; else its defaults."""
    node = {"name": name, "bits": BENCH_BITS}
    try:
        build_method(node)
    except (ConfigError, TypeError):
        node = {"name": name}
    return node


def tensor_bytes(obj) -> int:
    """Bytes of a tensor, a tensor subclass flattened to its inner tensors (quanto's packed
    payload, scale and shift), a tuple or list of them (the fp8 layer's ``(payload, scale)``), or 0
    for anything else."""
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x) for x in obj)
    if not isinstance(obj, torch.Tensor):
        return 0
    if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
        names, _ = obj.__tensor_flatten__()
        return sum(tensor_bytes(getattr(obj, n)) for n in names)
    return obj.numel() * obj.element_size()


def peer_bytes(cache) -> int:
    return sum(tensor_bytes(v) for layer in cache.layers for v in vars(layer).values())


@dataclasses.dataclass
class Contender:
    """One cache under test: how to prefill it and how to run one decode step on it."""

    label: str
    prefill: Callable[[torch.Tensor], torch.Tensor]  # ids [1, T] -> logits
    step: Callable[[torch.Tensor], torch.Tensor]  # token [1, 1] -> logits
    kv_bytes: Callable[[], int]
    times: list[float] = dataclasses.field(default_factory=list)


def kvbench_contender(label: str, runner: ModelRunner) -> Contender:
    cache = runner.new_cache()
    return Contender(
        label,
        prefill=lambda ids: runner.forward(ids, cache),
        step=lambda tok: runner.decode_step(tok, cache),
        kv_bytes=lambda: memory_report(cache.layers).total_bytes,
    )


def transformers_contender(label: str, model, cache) -> Contender:
    @torch.no_grad()
    def forward(ids):
        return model(input_ids=ids, cache=cache, use_cache=True).logits.float()

    return Contender(label, prefill=forward, step=forward, kv_bytes=lambda: peer_bytes(cache))


def peers(model) -> list[Contender]:
    out = [transformers_contender("DynamicCache", model, DynamicCache(config=model.config))]
    try:
        import optimum.quanto  # noqa: F401

        quanto = QuantizedCache("quanto", model.config, nbits=2, q_group_size=32, residual_length=128)
        out.append(transformers_contender("QuantizedCache-quanto-2b", model, quanto))
    except ImportError:
        print("optimum-quanto is not installed: QuantizedCache(quanto) is left out", file=sys.stderr)
    out.append(transformers_contender("QuantizedCache-fp8", model, QuantizedCache("fp8", model.config)))
    return out


def bench_context(loaded: LoadedModel, n: int, labels: list[str], steps: int, warmup: int) -> list[dict]:
    ids = haystack_ids(loaded.tokenizer, n)
    contenders = []
    for name in METHODS.names():
        if labels and name not in labels:
            continue
        method = build_method(method_node(name))
        contenders.append(kvbench_contender(name, loaded.runner(method, resolve_data_root(None))))
    contenders += [c for c in peers(loaded.model) if not labels or c.label in labels]
    # The greedy path of the reference cache is fed to every cache.
    reference = next((c for c in contenders if c.label == "DynamicCache"), contenders[0])
    with torch.no_grad():
        for c in contenders:
            logits = c.prefill(ids)
            if c is reference:
                tokens = [int(logits[0, -1].argmax())]
            print(f"  prefilled {c.label} at {n}", file=sys.stderr, flush=True)
        for i in range(steps + warmup + 1):
            order = contenders[i % len(contenders) :] + contenders[: i % len(contenders)]
            for c in order:
                tok = torch.tensor([[tokens[i]]])
                t0 = time.perf_counter()
                logits = c.step(tok)
                elapsed = time.perf_counter() - t0
                if i >= warmup and i < warmup + steps:
                    c.times.append(elapsed)
                if c is reference:
                    tokens.append(int(logits[0, -1].argmax()))
        peaks, counts = {}, {}
        for c in contenders:
            gc.collect()
            with PeakTransient() as tracker:
                c.step(torch.tensor([[tokens[-1]]]))
            peaks[c.label] = tracker.peak
            # one more step under the op counter (after the timed ones: counting slows it down)
            with count_ops() as counted:
                c.step(torch.tensor([[tokens[-1]]]))
            counts[c.label] = counted
    by_label = {c.label: statistics.median(c.times) for c in contenders}
    dyn, fp16 = by_label.get("DynamicCache"), by_label.get("fp16")
    rows = []
    for c in contenders:
        t = by_label[c.label]
        rows.append(
            {
                "context": n,
                "cache": c.label,
                "step_ms": round(1e3 * t, 2),
                "vs_DynamicCache": round(t / dyn, 3) if dyn else None,
                "vs_fp16": round(t / fp16, 3) if fp16 else None,
                "kv_bytes": c.kv_bytes(),
                "peak_transient_bytes": peaks[c.label],
                "ops_per_step": counts[c.label].total_ops,
                "syncs_per_step": counts[c.label].total_syncs,
            }
        )
        print(rows[-1], file=sys.stderr, flush=True)
    return rows


def markdown(rows: list[dict], args) -> str:
    lines = [
        "# Decode step: every kvbench method against transformers' caches, default model",
        "",
        f"`python scripts/bench_cache.py --threads {args.threads}` (CSV: `{args.out.with_suffix('.csv')}`). "
        f"Machine: {platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
        "float32 model (SmolLM2-135M-Instruct, 30 layers, 3 KV heads x 64).",
        f"Steps interleaved across caches; median of {args.steps} steps after {args.warmup} warm-up. "
        "Peak transient: the most bytes held at once by tensors created during one decode step.",
        f"Stored tokens read by: {args.readers} (kvbench's `method.backend=auto`; `compiled` is "
        "kvbench/kernels/cpu, `torch` the reference where a part has no kernel).",
        "",
        "Ops and syncs: aten operations and host synchronisations of one more step, counted by "
        "kvbench.kernels.counting (a compiled kernel call is one operation).",
        "",
        "| context | cache | step ms | vs DynamicCache | vs kvbench fp16 | KV bytes | peak transient bytes "
        "| ops/step | syncs/step |",
        "|--:|:--|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['context']} | {r['cache']} | {r['step_ms']:.2f} | {r['vs_DynamicCache']} | "
            f"{r['vs_fp16']} | {r['kv_bytes']:,} | {r['peak_transient_bytes']:,} | "
            f"{r['ops_per_step']:,} | {r['syncs_per_step']} |"
        )
    lines += ["", *targets(rows)]
    return "\n".join(lines) + "\n"


EVICTION = ("h2o", "snapkv", "streamingllm", "random_prune")


def targets(rows: list[dict]) -> list[str]:
    """The cache core's targets, checked against the measured rows (met / missed, with the ratio)."""
    at = {(r["context"], r["cache"]): r for r in rows}
    contexts = sorted({r["context"] for r in rows})
    quantizing = [
        c
        for c in dict.fromkeys(r["cache"] for r in rows)
        if c not in PEER_LABELS and c != "fp16" and c not in EVICTION
    ]
    out = ["## Targets", "", "| target | context | cache | measured | met |", "|:--|--:|:--|--:|:--|"]

    def row(target, n, cache, value, ok):
        out.append(f"| {target} | {n} | {cache} | {value} | {'yes' if ok else 'no'} |")

    for n in [c for c in contexts if c >= 4096]:
        if (n, "fp16") in at and (n, "DynamicCache") in at:
            ratio = at[(n, "fp16")]["step_ms"] / at[(n, "DynamicCache")]["step_ms"]
            row("kvbench fp16 <= 1.0x DynamicCache", n, "fp16", f"{ratio:.3f}x", ratio <= 1.0)
    big, small = max(contexts), min(contexts)
    if (small, "kivi") in at and (small, "fp16") in at and small < big:
        ratio = at[(small, "kivi")]["step_ms"] / at[(small, "fp16")]["step_ms"]
        row("kivi <= 1.25x kvbench fp16", small, "kivi", f"{ratio:.3f}x", ratio <= 1.25)
    for cache in quantizing:
        if (big, cache) not in at or (big, "fp16") not in at:
            continue
        ratio = at[(big, cache)]["step_ms"] / at[(big, "fp16")]["step_ms"]
        # the issue's targets: kivi at most fp16's time, readkv (which moves 4 of 8 bits) 2x, others 1.5x
        bound = {"kivi": 1.0, "readkv": 2.0}.get(cache, 1.5)
        row(f"{cache} <= {bound}x kvbench fp16", big, cache, f"{ratio:.3f}x", ratio <= bound)
    for n in contexts:
        quanto = at.get((n, "QuantizedCache-quanto-2b"))
        # kivi is the target at every length; the other methods are reported where the cache is long
        for cache in quantizing if n >= 4096 else ["kivi"]:
            if quanto is None or (n, cache) not in at:
                continue
            ratio = at[(n, cache)]["step_ms"] / quanto["step_ms"]
            row("faster than QuantizedCache (quanto 2-bit)", n, cache, f"{ratio:.3f}x", ratio < 1.0)
    for cache in quantizing + ["fp16"]:
        if (big, cache) in at:
            r = at[(big, cache)]
            share = r["peak_transient_bytes"] / max(r["kv_bytes"], 1)
            row(
                "peak transient O(block), not O(cache)",
                big,
                cache,
                f"{r['peak_transient_bytes']:,} B ({share:.2f}x its KV bytes)",
                share < 0.5,
            )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--only", nargs="+", default=[], help="cache labels to keep (method names, peer labels)"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/bench_cache.csv"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    loaded = load_for_methods("smollm2-135m", device="cpu")
    rows = []
    for n in args.contexts:
        rows += bench_context(loaded, n, args.only, args.steps, args.warmup)
    args.readers = backend_in_use()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    args.out.with_suffix(".md").write_text(markdown(rows, args))
    print(markdown(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
