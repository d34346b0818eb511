"""A node's arms scored one after another against all of them as rows of one batch.

The arms of ``kivi_axis_ablation`` (uniform 2 and 4 bits, keys and values per token or per channel)
score the same perplexity windows (random tokens, ``--context`` + ``--continuation``, fed in chunks
of ``--chunk``) on the default model, in one process, interleaved:

- ``one by one, per sequence``: each arm's :meth:`~kvbench.generate.ModelRunner.score_batch` over
  all windows, its windows as rows of one batch each in its own cache (the path before
  :mod:`kvbench.cache.stack`);
- ``one by one``: the same, the windows (all of one length) in one cache of B rows where the
  method stacks (what a run does now);
- ``arms together``: :func:`kvbench.generate.score_arms`, every arm's windows in one batch
  (``arms x windows`` rows, each through its own method's cache), the weights read once per chunk
  for all arms.

The FP16 arm runs first and records every window's prefill, so both modes replay it
(:data:`kvbench.cache.prefill.SHARED_PREFILLS`) and differ only in how the arms' forwards are
batched. Then the share of one arm's time in the linear layers (the weights), attention over the
stored parts and the cache's appends, from a profile, says where the rest goes.

    OMP_NUM_THREADS=1 python scripts/bench_arms.py --windows 16 --reps 2
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

from kvbench.builder import load_kept
from kvbench.generate import score_arms
from kvbench.methods import build_method

AXES = [("token", "token"), ("channel", "token"), ("token", "channel"), ("channel", "channel")]


def arms() -> list[dict]:
    return [
        {"name": "uniform", "bits": b, "key_axis": k, "value_axis": v, "group_size": 32}
        for b in (2, 4)
        for k, v in AXES
    ]


def profile_shares(runner, pairs, chunk: int) -> dict[str, float]:
    """Seconds of one arm's score_batch and the shares of its linear layers, attention and appends."""
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    runner.score_batch(pairs, chunk=chunk)
    prof.disable()
    total = time.perf_counter() - t0
    stats = pstats.Stats(prof).stats
    cum = {}
    for (file, _, name), (_, _, _, ct, _) in stats.items():
        for key, (f, n) in {
            "linear": ("torch/nn/modules/linear.py", "forward"),
            "attention": ("kvbench/cache/attention.py", "kvbench_attention"),
            "appends": ("kvbench/cache/batch.py", "update"),
        }.items():
            if file.endswith(f) and name == n:
                cum[key] = cum.get(key, 0.0) + ct
    return {"seconds": total, **{k: v / total for k, v in cum.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--continuation", type=int, default=64)
    p.add_argument("--chunk", type=int, default=8)
    p.add_argument("--reps", type=int, default=2)
    args = p.parse_args()
    loaded, _ = load_kept("smollm2-135m", "cpu")
    fp16 = loaded.runner(build_method({"name": "fp16"}))
    runners = [loaded.runner(build_method(node)) for node in arms()]
    gen = torch.Generator().manual_seed(0)
    vocab = loaded.model.config.vocab_size
    pairs = [
        (
            torch.randint(0, vocab, (1, args.context), generator=gen),
            torch.randint(0, vocab, (1, args.continuation), generator=gen),
        )
        for _ in range(args.windows)
    ]
    fp16.score_batch(pairs, chunk=args.chunk)  # records every window's prefill for both modes

    def one_by_one():
        for r in runners:
            r.score_batch(pairs, chunk=args.chunk)

    def per_sequence():
        for r in runners:
            r.stacked = lambda cache: None  # the per-sequence path
            try:
                r.score_batch(pairs, chunk=args.chunk)
            finally:
                del r.stacked

    def together():
        score_arms(runners, pairs, chunk=args.chunk)

    times = {"one by one, per sequence": [], "one by one": [], "arms together": []}
    for rep in range(args.reps):
        order = [
            ("one by one, per sequence", per_sequence),
            ("one by one", one_by_one),
            ("arms together", together),
        ]
        for label, fn in order if rep % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - t0)
    print(
        f"{len(runners)} arms x {args.windows} windows of {args.context}+{args.continuation} tokens, "
        f"chunk {args.chunk}, "
        f"{torch.get_num_threads()} thread(s), {args.reps} interleaved repetitions\n"
    )
    print("| mode | seconds (each repetition) | best | windows per CPU-hour |")
    print("|---|---|---|---|")
    for label, ts in times.items():
        rate = len(runners) * args.windows * 3600 / (min(ts) * torch.get_num_threads())
        print(f"| {label} | {', '.join(f'{t:.1f}' for t in ts)} | {min(ts):.1f} | {rate:.0f} |")
    base = min(times["one by one, per sequence"])
    print()
    for label in ("one by one", "arms together"):
        print(
            f"{label} against one by one, per sequence: {base / min(times[label]):.2f}x faster (best of each)"
        )
    shares = profile_shares(runners[1], pairs, args.chunk)
    print(
        f"\none arm alone ({runners[1].method.label()}), profiled: {shares['seconds']:.1f} s; linear layers "
        f"{shares.get('linear', 0):.0%}, attention {shares.get('attention', 0):.0%}, cache appends "
        f"{shares.get('appends', 0):.0%}"
    )


if __name__ == "__main__":
    main()
