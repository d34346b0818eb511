"""End-to-end decode throughput and the largest batch that fits a memory budget: fp16 against
kivi-2 and kivi-1 (the max-batch tables of KIVI and SpeCache).

For each method and context length, a batch of identical prompts is prefilled into the method's
cache and decoded greedily for ``--new-tokens`` steps; throughput is generated tokens per second
over the decode phase. Two paths, recorded in each row's ``path``:

- ``native`` (default): one cache of the method whose layers hold the whole batch
  (``[B, H_kv, T, D]``), fed by the model's own forward without the runner's per-step hooks; the
  prompts are identical, so no row needs padding;
- ``per_sequence`` (``--ragged``): prompts of ragged lengths (``context`` down to about half of it),
  left-padded into one forward through :meth:`kvbench.generate.ModelRunner.forward` and
  ``decode_step`` over a :class:`kvbench.cache.batch.SequenceBatchCache` (one cache of the method
  per sequence, pads never stored, attention per sequence): the path whose outputs equal each
  sequence's batch-1 run (tests/test_batched_decode.py). ``context`` is then the longest prompt.
 The largest batch is found by doubling then bisecting, a batch "fits" when
the run completes and its peak memory stays under ``--budget-gb``: on CUDA the peak is measured
(``torch.cuda.max_memory_allocated``); on CPU it is the model's parameter bytes plus the KV bytes the
cache holds (from its accounting) plus one layer's full-precision prefill states, which is an
estimate and is labelled as such in the output.

    python scripts/bench_throughput.py --model smollm2-135m --contexts 2048 8192 --budget-gb 40
    python scripts/bench_throughput.py --contexts 256 --batches 1 2 --new-tokens 4   # CPU smoke run
    python scripts/bench_throughput.py --contexts 256 --batches 1 3 --new-tokens 4 --ragged
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import torch

from kvbench.builder import LoadedModel, load_for_methods
from kvbench.cache import memory_report
from kvbench.cache.batch import PER_SEQUENCE
from kvbench.methods import build_method
from kvbench.models import model_node

METHODS = {
    "fp16": {"name": "fp16"},
    "kivi-2": {"name": "kivi", "bits": 2},
    "kivi-1": {"name": "kivi", "bits": 1, "zero_point": "specache", "arithmetic": "fp32"},
}


NATIVE = "native"


def param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def peak_bytes(loaded: LoadedModel, kv: int, batch: int, context: int, device: str) -> tuple[int, bool]:
    """(peak bytes, measured?): CUDA's measured peak, or on CPU the estimate of the module docstring
    (parameters + KV bytes held + one layer's full-precision prefill states)."""
    if device == "cuda":
        return torch.cuda.max_memory_allocated(), True
    shape, model = loaded.shape, loaded.model
    one_layer_states = 2 * batch * shape.num_kv_heads * context * shape.head_dim * model.dtype.itemsize
    return param_bytes(model) + kv + one_layer_states, False


def ragged_lengths(batch: int, context: int) -> list[int]:
    """``batch`` prompt lengths from ``context`` down to about ``context / 2``, evenly spaced."""
    return [max(1, context - (i * context) // (2 * batch)) for i in range(batch)]


@torch.no_grad()
def decode_run(
    loaded: LoadedModel,
    node,
    batch: int,
    context: int,
    new_tokens: int,
    device: str,
    backend: str,
    ragged: bool = False,
):
    """Prefill ``batch`` prompts of ``context`` tokens and decode ``new_tokens``; returns
    (tokens/s, peak bytes, measured?, kv bytes, path). The native path times the model's own
    forward, batched, without the runner's per-step hooks; ``ragged`` times the per-sequence path
    (:func:`ragged_decode`)."""
    node = dict(node)
    if node["name"] != "fp16" and backend != "torch":
        node["backend"] = backend
    runner = loaded.runner(build_method(node))
    model = loaded.model
    if ragged:
        if device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        tps, kv = ragged_decode(runner, batch, context, new_tokens, device)
        return (tps, *peak_bytes(loaded, kv, batch, context, device), kv, PER_SEQUENCE)
    cache = runner.new_cache()
    ids = torch.randint(100, 20000, (1, context), device=device).expand(batch, context).contiguous()
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    logits = model(input_ids=ids, **cache.forward_kwargs()).logits[:, -1:]
    token = logits.argmax(-1)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        token = model(input_ids=token, **cache.forward_kwargs()).logits[:, -1:].argmax(-1)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    kv = memory_report(cache.layers).total_bytes
    return (batch * new_tokens / seconds, *peak_bytes(loaded, kv, batch, context, device), kv, NATIVE)


def ragged_decode(runner, batch: int, context: int, new_tokens: int, device: str) -> tuple[float, int]:
    """``batch`` prompts of :func:`ragged_lengths` through the runner's batched forward and decode
    step (every method hook included) over per-sequence caches; greedy, no stop. Returns (generated
    tokens/s over the decode phase, KV bytes held by all sequences)."""
    lengths = ragged_lengths(batch, context)
    prompts = [torch.randint(100, 20000, (1, n)) for n in lengths]
    ids, mask = runner.pad_batch(prompts, pad_token_id=0)
    runner.method.new_request(new_tokens)
    cache = runner.new_batch_cache(batch)
    cache.set_padding(mask)
    token = runner.forward(ids, cache)[:, -1:].argmax(-1)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        token = runner.decode_step(token, cache)[:, -1:].argmax(-1)
    if device == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    kv = sum(memory_report(sub.layers).total_bytes for sub in cache.sequences)
    for sub in cache.sequences:
        runner.method.end_request(sub)
    return batch * new_tokens / seconds, kv


def fits(loaded, node, batch, args, device) -> tuple[bool, tuple | None]:
    try:
        result = decode_run(loaded, node, batch, args.context_for_max, 2, device, args.backend, args.ragged)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return False, None
    return result[1] <= args.budget_gb * 2**30, result


def max_batch(loaded, node, args, device) -> int:
    lo, hi = 0, 1
    while hi <= args.max_batch_cap and fits(loaded, node, hi, args, device)[0]:
        lo, hi = hi, hi * 2
    hi = min(hi, args.max_batch_cap + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(loaded, node, mid, args, device)[0] else (lo, mid)
    return lo


def main(argv=None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="smollm2-135m", help="a conf/model node")
    parser.add_argument("--model-path", default=None, help="a local HF folder (overrides the node's source)")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budget-gb", type=float, default=None, help="find the largest batch under this")
    parser.add_argument("--context-for-max", type=int, default=None)
    parser.add_argument("--max-batch-cap", type=int, default=1024)
    parser.add_argument("--backend", default="torch", choices=["torch", "triton"])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument(
        "--ragged",
        action="store_true",
        help="ragged prompt lengths through the per-sequence batched path (kvbench.cache.batch)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/bench_throughput.csv"))
    args = parser.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    node = model_node(args.model)
    if args.model_path:
        node["path"] = args.model_path
    if args.dtype:
        node["dtype"] = args.dtype
    loaded = load_for_methods(node, device)
    rows = []
    for label in args.methods:
        for context in args.contexts:
            for batch in args.batches:
                path = PER_SEQUENCE if args.ragged else NATIVE
                try:
                    tps, peak, measured, kv, path = decode_run(
                        loaded,
                        METHODS[label],
                        batch,
                        context,
                        args.new_tokens,
                        device,
                        args.backend,
                        args.ragged,
                    )
                except torch.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    tps, peak, measured, kv = float("nan"), float("nan"), True, float("nan")
                rows.append(
                    {
                        "method": label,
                        "path": path,
                        "context": context,
                        "batch": batch,
                        "tokens_per_s": round(tps, 2),
                        "kv_bytes": kv,
                        "peak_bytes": peak,
                        "peak_measured": measured,
                    }
                )
                print(rows[-1], file=sys.stderr, flush=True)
        if args.budget_gb:
            args.context_for_max = args.context_for_max or max(args.contexts)
            best = max_batch(loaded, METHODS[label], args, device)
            path = PER_SEQUENCE if args.ragged else NATIVE
            rows.append({"method": label, "path": path, "context": args.context_for_max, "max_batch": best})
            print(rows[-1], file=sys.stderr, flush=True)

    timed = [r for r in rows if "batch" in r]
    base = {(r["context"], r["batch"]): r["tokens_per_s"] for r in timed if r["method"] == "fp16"}
    for r in rows:
        if "batch" in r and (r["context"], r["batch"]) in base:
            r["speedup_vs_fp16"] = round(r["tokens_per_s"] / base[(r["context"], r["batch"])], 3)
    cols = list(dict.fromkeys(k for r in rows for k in r))
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r.get(c, "")) for c in cols))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=cols)
        writer.writeheader()
        writer.writerows(rows)
    name = torch.cuda.get_device_name() if device == "cuda" else f"cpu x{torch.get_num_threads()}"
    print(f"device: {name}; model {args.model}; written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
