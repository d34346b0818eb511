"""Attention-output error and effective bits of every quantizer on real keys, values and queries.

The default model reads a long text (a PG19 book from the data root) once, inside
:func:`kvbench.cache.capture.capture_attention`, which records each layer's post-RoPE queries, keys
and values. Then, for every method configuration, each layer's cache is filled with the first
``T0`` tokens (its prefill) and ``--steps`` decode steps are replayed through the method's own
``update``/``attend`` (:func:`kvbench.cache.capture.replay`: pools, sinks and query-adaptive reads
are exercised); each step's attention output is compared with exact attention over the
unquantized keys and values:

    rel_err = ||O_method - O_exact|| / ||O_exact||   (mean over layers, heads and steps)

Effective bits come from the tensors each cache holds after the last step.

    python scripts/compare_methods.py                       # 2048 tokens, 8 decode steps, every 4th layer
    python scripts/compare_methods.py --tokens 1024 --layers 0 7 15 29
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvbench.cache import ATTN_IMPLEMENTATION, memory_report
from kvbench.cache.capture import AttentionRecord, capture_attention, replay
from kvbench.config import build_config
from kvbench.data import resolve_data_root
from kvbench.errors import ConfigError
from kvbench.methods import METHODS, build_method
from kvbench.models import ModelConfig, load_model, model_node, model_shape
from kvbench.tasks.perplexity import load_text


def configurations() -> list[tuple[str, dict]]:
    """(label, node) pairs: each quantizer at 3, 2 and (where defined) 1 bit."""
    rows = []
    for bits in (3, 2, 1):
        rows.append((f"uniform-{bits}", {"name": "uniform", "bits": bits}))
        rows.append((f"kivi-{bits}", {"name": "kivi", "bits": bits}))
        if bits == 1:
            rows.append(
                (
                    "kivi-1-specache_zp",
                    {"name": "kivi", "bits": 1, "zero_point": "specache", "arithmetic": "fp32"},
                )
            )
        rows.append((f"intactkv1-kivi-{bits}", {"name": "intactkv", "bits": bits, "tokens": 1}))
        rows.append((f"ott-{bits}", {"name": "ott", "bits": bits}))
        rows.append((f"turboquant-{bits}", {"name": "turboquant", "bits": bits}))
        if bits > 1:
            rows.append((f"kvquant-{bits}", {"name": "kvquant", "bits": bits}))
    # ablations the papers' orderings need
    rows.append(("uniform-4", {"name": "uniform", "bits": 4}))
    rows.append(("kivi-4", {"name": "kivi", "bits": 4}))
    rows.append(("kvquant-2-post_rope", {"name": "kvquant", "bits": 2, "pre_rope": False}))
    rows.append(("kvquant-2-no_outliers", {"name": "kvquant", "bits": 2, "outlier_fraction": 0.0}))
    rows.append(("kvquant-2-no_sink", {"name": "kvquant", "bits": 2, "sink": False}))
    rows.append(
        (
            "kvquant-2-no_outliers_no_sink",
            {"name": "kvquant", "bits": 2, "outlier_fraction": 0.0, "sink": False},
        )
    )
    rows.append(("semkv-2.39-key_norm", {"name": "semkv", "target_bits": 2.39, "metric": "key_norm"}))
    rows.append(
        ("uniform-2.322 (5 levels, per-token G=64)", {"name": "uniform", "bits": 2.322, "group_size": 64})
    )
    rows.append(
        ("uniform-2.585 (6 levels, per-token G=64)", {"name": "uniform", "bits": 2.585, "group_size": 64})
    )
    rows.append(("readkv-8store-4read", {"name": "readkv", "bits": 8, "read_bits": 4}))
    rows.append(("readkv-8store-2read", {"name": "readkv", "bits": 8, "read_bits": 2}))
    return [(label, node) for label, node in rows if node["name"] in METHODS]


def exact_attention(q, k, v, groups, scaling):
    """``q [1, H, 1, D]`` over all of ``k, v [1, H_kv, N, D]`` in float32."""
    k = k.repeat_interleave(groups, dim=1).float()
    v = v.repeat_interleave(groups, dim=1).float()
    return torch.softmax((q.float() @ k.transpose(-1, -2)) * scaling, dim=-1) @ v


def evaluate(
    method, model, shape, captured: dict[int, AttentionRecord], layers, t0: int, steps: int
) -> tuple[float, float]:
    groups = shape.num_heads // shape.num_kv_heads
    scaling = shape.head_dim**-0.5
    cache = method.new_cache(shape, model.dtype)
    errors = []
    for idx in layers:
        rec = captured[idx]
        q, k, v = rec.query, rec.keys, rec.values
        outs = replay(cache.layers[idx], q, k, v, t0, steps, scaling)
        for t, out in zip(range(t0, t0 + steps), outs, strict=True):
            got = out.transpose(1, 2).float()  # [1, H, 1, D]
            want = exact_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], groups, scaling)
            errors.append(((got - want).norm() / want.norm()).item())
    report = memory_report([cache.layers[i] for i in layers])
    return sum(errors) / len(errors), report.effective_bits


def main(argv=None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--tokens", type=int, default=2048, help="prefill length T0")
    parser.add_argument("--steps", type=int, default=8, help="decode steps replayed per layer")
    parser.add_argument("--layers", type=int, nargs="*", default=None, help="default: every 4th layer")
    parser.add_argument("--book", default="10146", help="PG19 book id in the data root")
    parser.add_argument("--out", type=Path, default=Path("results/compare_methods.md"))
    args = parser.parse_args(argv)

    node = model_node("smollm2-135m")
    model, tokenizer = load_model(build_config(ModelConfig, node, "model"), ATTN_IMPLEMENTATION)
    shape = model_shape(model, node.get("max_context"))
    text = load_text(resolve_data_root(None), "pg19", args.book)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    ids = torch.cat(
        [torch.tensor([[tokenizer.bos_token_id or 1]]), ids[:, : args.tokens + args.steps - 1]], dim=1
    )
    with torch.no_grad(), capture_attention() as capture:
        model(input_ids=ids, use_cache=False)
    layers = args.layers if args.layers else list(range(0, shape.num_layers, 4))

    lines = [
        f"Default model, PG19 book {args.book}: prefill {args.tokens} tokens, {args.steps} decode steps, "
        f"layers {layers}.",
        "",
        "| method | rel. attention-output error | effective bits |",
        "|:--|--:|--:|",
    ]
    print("\n".join(lines[2:]), flush=True)
    for label, node in configurations():
        try:
            method = build_method(node)
            method.config.check_model(shape)
            method.prepare(model, tokenizer, shape, resolve_data_root(None))
        except (ConfigError, NotImplementedError) as err:
            print(f"| {label} | skipped: {err} | - |", flush=True)
            continue
        err, bits = evaluate(method, model, shape, capture.records, layers, args.tokens, args.steps)
        lines.append(f"| {label} | {err:.4f} | {bits:.3f} |")
        print(lines[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
