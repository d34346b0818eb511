"""Where a decode step's time goes: the PyTorch profiler over a few decode steps of kvbench methods on
the default model, after a real prefill of the haystack prompt.

For each method: the step's total CPU time, the share spent inside the layers' attention over the
cache (``KVLayer.attend`` and what it calls: reading packed storage block by block, the online
softmax) and inside the cache update (appends, quantization), and the operators with the most self
time. Writes ``benchmarks/profile_decode.md``.

    python scripts/profile_decode.py --threads 2 --context 8192 --methods fp16 kivi ott
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from kvbench.builder import load_for_methods
from kvbench.cache.cache import KVBenchCache
from kvbench.cache.layer import KVLayer
from kvbench.methods import build_method

sys.path.insert(0, str(Path(__file__).parent))
from bench_cache import haystack_ids, method_node  # noqa: E402


def instrument() -> None:
    """Label every layer's attention and cache update in the profile (each method's own override
    included, through the cache's entry points)."""
    update = KVBenchCache.update

    def labelled_update(self, *args, **kwargs):
        with record_function("kvbench.update"):
            return update(self, *args, **kwargs)

    KVBenchCache.update = labelled_update
    for cls in [KVLayer, *_subclasses(KVLayer)]:
        if "attend" in vars(cls):
            cls.attend = _labelled(cls.attend)


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _labelled(fn):
    def attend(self, *args, **kwargs):
        with record_function("kvbench.attend"):
            return fn(self, *args, **kwargs)

    return attend


def profile_method(loaded, name: str, ids: torch.Tensor, steps: int) -> dict:
    runner = loaded.runner(build_method(method_node(name)))
    cache = runner.new_cache()
    logits = runner.forward(ids, cache)
    token = logits[:, -1:].argmax(-1)
    for _ in range(2):  # warm-up
        token = runner.decode_step(token, cache)[:, -1:].argmax(-1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            token = runner.decode_step(token, cache)[:, -1:].argmax(-1)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    by_name = {e.key: e for e in events}
    share = {
        label: by_name[label].cpu_time_total / total if label in by_name else 0.0
        for label in ("kvbench.attend", "kvbench.update")
    }
    ops = sorted(
        (e for e in events if not e.key.startswith("kvbench.")), key=lambda e: -e.self_cpu_time_total
    )[:8]
    return {
        "method": name,
        "step_ms": total / steps / 1000,
        "attend": share["kvbench.attend"],
        "update": share["kvbench.update"],
        "ops": [(e.key, e.self_cpu_time_total / total, e.count // steps) for e in ops],
    }


def markdown(rows: list[dict], args) -> str:
    lines = [
        "# Where a decode step's time goes (PyTorch profiler, CPU)",
        "",
        f"`python scripts/profile_decode.py --threads {args.threads} --context {args.context}` "
        f"({args.steps} profiled decode steps after a {args.context}-token prefill and 2 warm-up steps). "
        f"Machine: {platform.machine()}, {args.threads} threads, torch {torch.__version__}, default model "
        "(SmolLM2-135M, 30 layers). Step ms: profiled CPU time per step (profiler overhead included, so "
        "above the benchmark's wall time). Attend / update: share of the step inside the layers' "
        "attention over the cache / the cache update, everything they call included.",
        "",
        "| method | step ms (profiled) | in attend | in update | top operators by self time "
        "(share, calls per step) |",
        "|:--|--:|--:|--:|:--|",
    ]
    for r in rows:
        ops = "; ".join(f"{k} {s:.0%} ({c})" for k, s, c in r["ops"])
        lines.append(
            f"| {r['method']} | {r['step_ms']:.1f} | {r['attend']:.0%} | {r['update']:.0%} | {ops} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=["fp16", "kivi", "ott", "kvquant", "turboquant"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/profile_decode.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    instrument()
    loaded = load_for_methods("smollm2-135m", device="cpu")
    ids = haystack_ids(loaded.tokenizer, args.context)
    rows = [profile_method(loaded, name, ids, args.steps) for name in args.methods]
    text = markdown(rows, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
