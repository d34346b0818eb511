"""Decode-step time and KV bytes of fp16 and kivi-2 (torch path) on the default model.

For each context length the real prefill is computed once (a plain forward into transformers'
DynamicCache); its keys and values are exactly what any method's prefill would store, since
prefill attends the full-precision states. Each method's cache is then filled from those states
and timed on the same decode steps. Prints one table with the ratio kivi/fp16 and writes it as CSV.

    python scripts/bench_cache.py                      # 1K, 4K, 8K
    python scripts/bench_cache.py --contexts 1024 --steps 4
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from kvbench.builder import load_for_methods
from kvbench.cache import memory_report
from kvbench.data import resolve_data_root
from kvbench.methods import build_method

METHODS = {"fp16": {"name": "fp16"}, "kivi-2": {"name": "kivi", "bits": 2}}
DEFAULT_MODEL = "smollm2-135m"


def haystack_ids(tokenizer, n: int) -> torch.Tensor:
    essays = sorted((resolve_data_root(None) / "niah" / "PaulGrahamEssays").glob("*.txt"))
    text = "\n".join(p.read_text() for p in essays)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    while len(ids) < n:
        ids = ids + ids
    return torch.tensor([ids[:n]])


@torch.no_grad()
def time_decode(model, cache, first_token: int, steps: int, warmup: int) -> list[float]:
    times, token = [], torch.tensor([[first_token]])
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        logits = model(input_ids=token, cache=cache, use_cache=True).logits
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        token = logits[:, -1:].argmax(-1)
    return times


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path("results/bench_cache.csv"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    loaded = load_for_methods(DEFAULT_MODEL, device="cpu")
    model, tokenizer = loaded.model, loaded.tokenizer
    rows = []
    for n in args.contexts:
        ids = haystack_ids(tokenizer, n)
        with torch.no_grad():
            states = DynamicCache(config=model.config)
            out = model(input_ids=ids, cache=states, use_cache=True)
        first = int(out.logits[0, -1].argmax())
        per_method = {}
        for label, node in METHODS.items():
            cache = loaded.runner(build_method(node)).new_cache()
            for i, layer in enumerate(states.layers):
                cache.update(layer.keys, layer.values, i)
            kv_bytes = memory_report(cache.layers).total_bytes
            times = time_decode(model, cache, first, args.steps, args.warmup)
            per_method[label] = (statistics.median(times), kv_bytes)
        fp_t, fp_b = per_method["fp16"]
        kv_t, kv_b = per_method["kivi-2"]
        rows.append(
            {
                "context": n,
                "fp16_step_ms": round(1e3 * fp_t, 2),
                "kivi2_step_ms": round(1e3 * kv_t, 2),
                "time_ratio_kivi2_over_fp16": round(kv_t / fp_t, 3),
                "fp16_kv_bytes": fp_b,
                "kivi2_kv_bytes": kv_b,
                "bytes_ratio_fp16_over_kivi2": round(fp_b / kv_b, 3),
            }
        )
        print(rows[-1], file=sys.stderr, flush=True)

    cols = list(rows[0])
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols)
        writer.writeheader()
        writer.writerows(rows)
    print(f"device: cpu x{torch.get_num_threads()} threads, torch {torch.__version__}; written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
