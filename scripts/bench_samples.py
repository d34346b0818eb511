"""Samples per CPU-hour of experiment nodes, with and without the work shared across a node's arms.

For each node asked for, every job of its multirun (its arms, as ``python -m kvbench -m
+experiment=NODE`` would launch them, with ``--override``s that shrink its samples) runs in this
process through :func:`kvbench.run.execute`, twice per repetition, into fresh output folders:

- ``separate``: each arm on its own, as before the sharing: the model loaded again for every job,
  every prompt prefilled by every arm with the logits of every position, KVQuant calibrated by every
  arm (:data:`kvbench.cache.prefill.SHARED_PREFILLS` off, ``PREFILL_LOGIT_ROWS`` 0, the kept model
  and the calibration memo dropped before each job);
- ``shared``: the defaults: one model load per node, one prefill (or attention capture) per prompt
  handed to every declaring arm, the last prompt positions' logits only, one calibration per
  configuration.

The two modes alternate (which goes first alternates by repetition), so a slow spell of the machine
falls on both. Samples per CPU-hour are ``samples x 3600 / (wall seconds x threads)``. Then every
row of the two modes is compared, every column but timings: the sharing must change no result.

    python scripts/bench_samples.py --node attention_probe --override task.windows=2
    python scripts/bench_samples.py --node kivi_axis_ablation --override task.windows=3 --reps 2
    python scripts/bench_samples.py --suite benchmarks/throughput.csv      # the committed table
    python scripts/bench_samples.py --node kivi_axis_ablation --override task.windows=2 --flops

``--flops`` times nothing: it runs each mode once under torch's ``FlopCounterMode`` and prints the
floating-point operations of the aten matrix products (the model's linear layers, its attention
products, the probe's exact attention; the compiled kernels' reads of stored codes are not
counted), per sample, and their ratio: the speedup the sharing could reach if every operation ran
at the same rate, the ceiling the timed ratio is read against.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

# A suite per task type: each node with the overrides that make a run of minutes on two cores, and
# at most ``jobs`` of its jobs (the first ones, in the multirun's order).
SUITE = [
    ("niah", "ott_vs_kivi", ["task.context_lengths=[1000,2000]", "task.depths=[0,50,100]"], None),
    ("perplexity", "kivi_axis_ablation", ["task.windows=16"], None),
    ("perplexity", "kvquant_ablation", ["task.windows=4"], 12),
    ("gsm8k", "kivi_gsm8k", ["task.limit=2"], None),
    ("attention_probe", "attention_probe", ["task.windows=2"], None),
]
TIMING_KEYS = {"seconds", "prefill_s", "decode_s", "time_s", "sample_s"}


def compose_jobs(node: str, overrides: list[str], jobs: int | None, root: Path) -> list[dict]:
    """The job configs of ``node``'s multirun, each writing under ``root``."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from kvbench.__main__ import CONF_DIR, job_config, sweep_jobs

    argv = [f"+experiment={node}", *overrides, f"output.root={root}"]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name="kvbench"):
        loader = GlobalHydra.instance().config_loader()
        master, listed = sweep_jobs(argv)
        configs = [job_config(loader.load_sweep_config(master, o)) for _, o in listed]
    return configs[:jobs] if jobs else configs


def set_mode(mode: str) -> None:
    """Switch this process between the two modes of the module docstring."""
    from kvbench import builder, generate
    from kvbench.cache.prefill import SHARED_PREFILLS, default_budget
    from kvbench.methods import kvquant_calibration

    shared = mode == "shared"
    SHARED_PREFILLS.budget = default_budget() if shared else 0
    generate.PREFILL_LOGIT_ROWS = 16 if shared else 0
    builder._KEPT.clear()
    kvquant_calibration._MEMO.model = None


def run_node(configs: list[dict], mode: str) -> tuple[float, float, int, list[dict]]:
    """(wall seconds, CPU seconds, samples, rows) of every job of a node in ``mode`` (``separate``:
    one sample at a time, ``task.batch_size=1``). The CPU seconds are this process's user + system
    time over all its threads: on a machine shared with other work they count what the node itself
    spent, where wall time also counts the waits for a core."""
    from kvbench.run import execute

    if mode == "separate":
        configs = [
            {**c, "task": {**c["task"], "batch_size": 1}} if "batch_size" in c["task"] else c for c in configs
        ]
    set_mode(mode)
    rows, samples = [], 0
    t0, c0 = time.perf_counter(), time.process_time()
    for job, config in enumerate(configs):
        if mode == "separate":
            set_mode(mode)  # every job loads and calibrates as if alone
        metrics = execute(config, progress=False)
        folder = Path(metrics["folder"])
        for line in (folder / "samples.jsonl").read_text().splitlines():
            # the job tells the arms apart: labels alone do not (uniform-2b at every axis layout)
            rows.append({**json.loads(line), "job": job})
        samples += metrics["timings"]["samples_run"]
    return time.perf_counter() - t0, time.process_time() - c0, samples, rows


def count_flops(node: str, overrides: list[str], jobs: int | None) -> dict:
    """FLOPs of the aten matrix products of every job of ``node`` in each mode (one run each, not
    timed), per sample, and the separate/shared ratio."""
    from torch.utils.flop_counter import FlopCounterMode

    out: dict = {"node": node, "overrides": " ".join(overrides)}
    for mode in ("separate", "shared"):
        root = Path(tempfile.mkdtemp(prefix=f"flops-{node}-{mode}-"))
        try:
            configs = compose_jobs(node, overrides, jobs, root)
            with FlopCounterMode(display=False) as counter:
                _, _, samples, _ = run_node(configs, mode)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        out["arms"], out["samples"] = len(configs), samples
        out[f"{mode}_gflop"] = round(counter.get_total_flops() / 1e9, 1)
        out[f"{mode}_gflop_per_sample"] = round(counter.get_total_flops() / 1e9 / samples, 2)
    out["flop_ratio"] = round(out["separate_gflop"] / out["shared_gflop"], 2)
    return out


def _strip(row: dict) -> dict:
    drop = TIMING_KEYS | {"batch_size"}
    return {k: v for k, v in row.items() if k not in drop and not k.endswith("_s")}


def _floats(row: dict, prefix: str = "") -> dict[str, float]:
    out = {}
    for k, v in row.items():
        if isinstance(v, dict):
            out.update(_floats(v, f"{prefix}{k}."))
        elif isinstance(v, float):
            out[prefix + k] = v
    return out


def compare(a: list[dict], b: list[dict]) -> dict:
    """Rows of the two modes, matched by (job, sample): how many are identical in every column but
    timings and the batch size, how many have the same prediction (generated text), and the largest
    difference of any float column."""
    key = lambda r: (r["job"], str(r["sample_id"]))  # noqa: E731
    left, right = {key(r): _strip(r) for r in a}, {key(r): _strip(r) for r in b}
    keys = sorted(set(left) | set(right))
    diff = 0.0
    for k in keys:
        x, y = _floats(left.get(k, {})), _floats(right.get(k, {}))
        diff = max([diff, *(abs(x[c] - y[c]) for c in set(x) & set(y))])
    return {
        "rows_identical": sum(left.get(k) == right.get(k) for k in keys),
        "same_prediction": sum(
            k in left and k in right and left[k].get("prediction") == right[k].get("prediction") for k in keys
        ),
        "max_abs_diff": float(f"{diff:.3g}"),
    }


def bench(task: str, node: str, overrides: list[str], jobs: int | None, reps: int, threads: int) -> dict:
    out = {"task": task, "node": node, "overrides": " ".join(overrides), "threads": threads}
    walls: dict[str, list[float]] = {"separate": [], "shared": []}
    cpus: dict[str, list[float]] = {"separate": [], "shared": []}
    rows: dict[str, list[dict]] = {}
    for rep in range(reps):
        order = ("separate", "shared") if rep % 2 == 0 else ("shared", "separate")
        for mode in order:
            root = Path(tempfile.mkdtemp(prefix=f"bench-{node}-{mode}-"))
            try:
                configs = compose_jobs(node, overrides, jobs, root)
                wall, cpu, samples, got = run_node(configs, mode)
            finally:
                shutil.rmtree(root, ignore_errors=True)
            walls[mode].append(wall)
            cpus[mode].append(cpu)
            rows.setdefault(mode, got)
            out["arms"], out["samples"] = len(configs), samples
            print(
                f"{node} rep {rep} {mode}: {samples} samples in {wall:.1f} s ({cpu:.1f} CPU s)",
                file=sys.stderr,
                flush=True,
            )
    for mode, values in walls.items():
        wall = min(values)
        out[f"{mode}_s"] = round(wall, 1)
        out[f"{mode}_per_cpu_h"] = round(out["samples"] * 3600 / (wall * threads), 1)
        out[f"{mode}_cpu_s"] = round(min(cpus[mode]), 1)
    out["speedup"] = round(out["shared_per_cpu_h"] / out["separate_per_cpu_h"], 2)
    # the same ratio in CPU time, which other work on the machine inflates far less than wall time
    out["cpu_speedup"] = round(out["separate_cpu_s"] / out["shared_cpu_s"], 2)
    out.update(compare(rows["separate"], rows["shared"]))
    return out


def markdown(results: list[dict]) -> str:
    """The suite's table in markdown, with the total over all nodes (samples per CPU-hour of all the
    suite's samples in the wall time of all its nodes, each mode)."""
    cols = ["task", "node", "arms", "samples", "separate_s", "shared_s", "separate_per_cpu_h",
            "shared_per_cpu_h", "speedup", "separate_cpu_s", "shared_cpu_s", "cpu_speedup",
            "rows_identical", "same_prediction", "max_abs_diff"]  # fmt: skip
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        lines.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    samples = sum(int(r["samples"]) for r in results)
    threads = int(results[0]["threads"])
    sep, shared = (sum(float(r[f"{m}_s"]) for r in results) for m in ("separate", "shared"))
    per_h = {m: samples * 3600 / (w * threads) for m, w in (("separate", sep), ("shared", shared))}
    lines.append(
        f"| all | {len(results)} nodes | | {samples} | {sep:.1f} | {shared:.1f} | {per_h['separate']:.1f} | "
        f"{per_h['shared']:.1f} | {sep / shared:.2f} | | | | | | |"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--node", help="one experiment node (else --suite)")
    p.add_argument("--override", action="append", default=[], help="a Hydra override for every job")
    p.add_argument("--jobs", type=int, default=None, help="the first N jobs of the node only")
    p.add_argument("--suite", type=Path, help="run the suite of the module and write its CSV here")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--table", type=Path, help="print the markdown table of a suite CSV written before")
    p.add_argument("--flops", action="store_true", help="count each mode's FLOPs once instead of timing")
    args = p.parse_args(argv)
    if args.table is not None:
        with args.table.open() as f:
            print(markdown(list(csv.DictReader(f))), end="")
        return 0
    torch.set_num_threads(args.threads)
    if args.suite is None and args.node is None:
        p.error("--node NAME or --suite CSV")
    plan = SUITE if args.suite is not None else [("-", args.node, args.override, args.jobs)]
    if args.flops:
        rows = [{"task": t, **count_flops(n, o, j)} for t, n, o, j in plan]
        writer = csv.DictWriter(sys.stdout, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        return 0
    results = [bench(t, n, o, j, args.reps, args.threads) for t, n, o, j in plan]
    fields = list(results[0])
    writer = csv.DictWriter(sys.stdout, fields)
    writer.writeheader()
    writer.writerows(results)
    if args.suite is not None:
        with args.suite.open("w", newline="") as f:
            w = csv.DictWriter(f, fields)
            w.writeheader()
            w.writerows(results)
        print(markdown(results), end="")
    total = {m: sum(r["samples"] * 3600 / r[f"{m}_s"] for r in results) for m in ("separate", "shared")}
    print(f"all nodes: {sum(r['samples'] for r in results)} samples per mode", file=sys.stderr)
    time_sep = sum(r["separate_s"] for r in results)
    time_sh = sum(r["shared_s"] for r in results)
    print(
        f"all nodes: separate {time_sep:.0f} s, shared {time_sh:.0f} s: {time_sep / time_sh:.2f}x",
        file=sys.stderr,
    )
    del total
    return 0


if __name__ == "__main__":
    sys.exit(main())
