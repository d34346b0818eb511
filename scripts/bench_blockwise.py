"""Microbenchmark: one decode step's attention of one layer over a cache held in each storage.

Shape of the default model's layers (SmolLM2-135M): B = 1, H_kv = 3, H_q = 9, D = 64, one float32
query (q = 1), stored contexts of 1K, 4K and 8K tokens, on ``--threads`` threads (2). Contenders:

- ``sdpa fp32``: SDPA (through transformers' ``sdpa_attention_forward``) over float32 K/V already
  concatenated: the attention a ``DynamicCache`` step runs;
- ``DynamicCache``: the same with the concatenation of the new token to the float32 cache that
  ``DynamicLayer.update`` performs every step;
- ``rebuild ...``: kvbench's current path (``KVLayer.update``): reconstruct every stored token
  (``QuantizedTokens.dequantize()``: ``unpack`` + ``dequantize_grouped``; ``RotatedCodes.dequantize()``
  for the codebook), ``cat_tokens`` with the residual, concatenate the new token, SDPA;
- ``blockwise ...``: :func:`kvbench.cache.blockwise.blockwise_attention` over the stored sources plus
  the new token attended exactly, for fp16 storage, KIVI 2-bit (per-channel keys + per-token values
  with their scales folded into the attention weights, G = 32, fp16 residual: values 128 tokens,
  keys a partly full window of 64; variants fold the key scales into the query as well, or fold
  nothing, or change the block size), and TurboQuant 2-bit codes (a Lloyd-Max codebook on randomly
  rotated coordinates, attended in the rotated space).

Every repetition runs all contenders once, in a fresh random order (so load from other processes
spreads over all of them), and the table reports medians, the ratio to ``sdpa fp32`` and to
``DynamicCache``, and the peak bytes held at once by tensors created during one call (a
``TorchDispatchMode`` that follows every aten output's storage until it is freed). A second table
times one single-token append: ``torch.cat`` onto the store (kvbench's stores today, and
``DynamicCache``) against :class:`kvbench.cache.growable.GrowableTokens`.

    PYTHONPATH=. python scripts/bench_blockwise.py [--threads 2] [--reps 21] [--lengths 1024 4096 8192]
    PYTHONPATH=. python scripts/bench_blockwise.py --threads 1 --clock thread   # steadier on a busy machine

The measured tables, with a reading of them and a profile, are in ``benchmarks/bench_blockwise.md``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbench.cache.affine_source import PerChannelAffineSource, PerTokenAffineSource
from kvbench.cache.blockwise import blockwise_attention
from kvbench.cache.codebook_source import CodebookSource
from kvbench.cache.fp import FullPrecisionSource, FullPrecisionTokens
from kvbench.cache.growable import GrowableTokens
from kvbench.cache.layer import cat_tokens
from kvbench.cache.quantized import QuantizedTokens
from kvbench.cache.source import ConcatSource
from kvbench.cache.transient import PeakTransient
from kvbench.quant.lloyd_max import lloyd_max_codebook, quantize_scalar, random_rotation
from kvbench.quant.packing import pack, unpack

H_KV, N_REP, D, G = 3, 3, 64, 32
VALUE_RESIDUAL, KEY_RESIDUAL = 128, 64


class _Attn(torch.nn.Module):
    """What ``sdpa_attention_forward`` reads from a Llama attention module."""

    is_causal = True
    num_key_value_groups = N_REP

    def __init__(self):
        super().__init__()
        self.scaling = D**-0.5


def _sdpa(module, query, keys, values):
    return sdpa_attention_forward(module, query, keys, values, None, scaling=module.scaling)[0]


def _turbo_store(x: torch.Tensor, rot: torch.Tensor, centroids: torch.Tensor, levels: int):
    norm = x.norm(dim=-1, keepdim=True)
    y = torch.einsum("bhtd,hed->bhte", x / norm, rot)
    return pack(quantize_scalar(y, centroids), levels), norm.half()


def contenders(n: int, block_size: int) -> dict[str, callable]:
    """label -> a function running one decode step's attention over ``n`` stored tokens."""
    g = torch.Generator().manual_seed(n)
    k = torch.randn(1, H_KV, n, D, generator=g) * 2
    v = torch.randn(1, H_KV, n, D, generator=g)
    query = torch.randn(1, H_KV * N_REP, 1, D, generator=g)
    k_new, v_new = torch.randn(1, H_KV, 1, D, generator=g), torch.randn(1, H_KV, 1, D, generator=g)
    module = _Attn()
    scaling = module.scaling

    k32, v32 = k.clone(), v.clone()
    k32_all, v32_all = torch.cat([k, k_new], -2), torch.cat([v, v_new], -2)
    k16, v16 = k.half(), v.half()

    # KIVI 2-bit: keys quantized up to a multiple of R = 128 with a partly full key residual,
    # values quantized up to the newest 128
    kb = (n - KEY_RESIDUAL) // VALUE_RESIDUAL * VALUE_RESIDUAL
    vb = n - VALUE_RESIDUAL
    kq, vq = QuantizedTokens(4, "channel", G), QuantizedTokens(4, "token", G)
    kq.append(k[..., :kb, :])
    vq.append(v[..., :vb, :])
    k_res, v_res = FullPrecisionTokens(torch.float16), FullPrecisionTokens(torch.float16)
    k_res.append(k[..., kb:, :])
    v_res.append(v[..., vb:, :])

    # TurboQuant 2-bit, no residual
    levels = 4
    rot = torch.stack([random_rotation(D, 7 + h) for h in range(H_KV)])
    centroids = torch.tensor(lloyd_max_codebook(levels, D)[0], dtype=torch.float32)
    tk_codes, tk_norm = _turbo_store(k, rot, centroids, levels)
    tv_codes, tv_norm = _turbo_store(v, rot, centroids, levels)

    def turbo_dequantize(codes, norm):
        c = centroids[unpack(codes, levels, D).long()]
        return torch.einsum("bhte,hed->bhtd", c, rot) * norm.float()

    def kivi_sources(fold_keys: bool, fold_values: bool):
        keys = ConcatSource(
            [PerChannelAffineSource.from_store(kq, fold=fold_keys), FullPrecisionSource(k_res.data)]
        )
        values = ConcatSource(
            [PerTokenAffineSource.from_store(vq, fold=fold_values), FullPrecisionSource(v_res.data)]
        )
        return keys, values

    def blockwise(keys, values, bs=block_size):
        return blockwise_attention(query, keys, values, scaling, bs, k_new, v_new)

    def rebuild_kivi():
        keys = cat_tokens(kq.dequantize(), k_res.data)
        values = cat_tokens(vq.dequantize(), v_res.data)
        keys = torch.cat([keys.to(k_new.dtype), k_new], -2)
        values = torch.cat([values.to(v_new.dtype), v_new], -2)
        return _sdpa(module, query, keys, values)

    def rebuild_fp16():
        keys = torch.cat([k16.to(k_new.dtype), k_new], -2)
        values = torch.cat([v16.to(v_new.dtype), v_new], -2)
        return _sdpa(module, query, keys, values)

    def rebuild_turbo():
        keys = torch.cat([turbo_dequantize(tk_codes, tk_norm), k_new], -2)
        values = torch.cat([turbo_dequantize(tv_codes, tv_norm), v_new], -2)
        return _sdpa(module, query, keys, values)

    return {
        "sdpa fp32": lambda: _sdpa(module, query, k32_all, v32_all),
        "DynamicCache": lambda: _sdpa(
            module, query, torch.cat([k32, k_new], -2), torch.cat([v32, v_new], -2)
        ),
        "blockwise fp32": lambda: blockwise(FullPrecisionSource(k32), FullPrecisionSource(v32)),
        "rebuild fp16": rebuild_fp16,
        "blockwise fp16": lambda: blockwise(FullPrecisionSource(k16), FullPrecisionSource(v16)),
        "rebuild kivi-2": rebuild_kivi,
        "blockwise kivi-2": lambda: blockwise(*kivi_sources(False, True)),
        "blockwise kivi-2 fold keys too": lambda: blockwise(*kivi_sources(True, True)),
        "blockwise kivi-2 fold neither": lambda: blockwise(*kivi_sources(False, False)),
        "blockwise kivi-2 bs=256": lambda: blockwise(*kivi_sources(False, True), bs=256),
        "blockwise kivi-2 bs=4096": lambda: blockwise(*kivi_sources(False, True), bs=4096),
        "rebuild turbo-2": rebuild_turbo,
        "blockwise turbo-2": lambda: blockwise(
            CodebookSource(tk_codes, levels, D, centroids, scale=tk_norm, rotation=rot),
            CodebookSource(tv_codes, levels, D, centroids, scale=tv_norm, rotation=rot),
        ),
    }


def bench_attention(lengths, reps: int, block_size: int, clock) -> list[dict]:
    rows = []
    for n in lengths:
        fns = contenders(n, block_size)
        times: dict[str, list[float]] = {label: [] for label in fns}
        for fn in fns.values():  # warm-up
            fn()
        for _ in range(reps):
            order = list(fns)
            random.shuffle(order)
            for label in order:
                t0 = clock()
                fns[label]()
                times[label].append(clock() - t0)
        peaks = {}
        for label, fn in fns.items():
            with PeakTransient() as tracker:
                fn()
            peaks[label] = tracker.peak
        med = {label: statistics.median(ts) for label, ts in times.items()}
        for label in fns:
            rows.append(
                {
                    "tokens": n,
                    "contender": label,
                    "ms": 1e3 * med[label],
                    "vs_sdpa": med[label] / med["sdpa fp32"],
                    "vs_dyn": med[label] / med["DynamicCache"],
                    "peak_kib": peaks[label] / 1024,
                }
            )
    return rows


def bench_append(lengths, reps: int) -> list[dict]:
    rows = []
    for n in lengths:
        x = torch.randn(1, H_KV, n, D).half()
        token = torch.randn(1, H_KV, 1, D).half()
        cat_store = FullPrecisionTokens(torch.float16)
        cat_store.append(x)
        grow = GrowableTokens(torch.float16)
        grow.append(x)
        times = {"torch.cat append": [], "GrowableTokens append": []}
        for _ in range(reps):
            for label in random.sample(list(times), 2):
                t0 = time.perf_counter()
                (cat_store if label.startswith("torch") else grow).append(token)
                times[label].append(time.perf_counter() - t0)
        for label, ts in times.items():
            rows.append({"tokens": n, "store": label, "us": 1e6 * statistics.median(ts)})
    return rows


def _key_block_scores(query, codes, scale, zero):
    """One KIVI 2-bit key block fused by hand: shift the four codes out of each byte, apply the
    per-channel affine map of each group of G tokens, and take the logits."""
    b, h, n, _ = codes.shape
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=codes.device)
    c = ((codes[..., None] >> shifts) & 3).reshape(b, h, n // G, G, D).float()
    k = (c * scale.float()[:, :, :, None, :] + zero.float()[:, :, :, None, :]).reshape(b, h, n, D)
    return query @ k.transpose(-1, -2)


def compile_probe(block: int, reps: int, clock) -> None:
    """Eager against ``torch.compile`` (inductor, static shapes) for one key block."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (1, H_KV, block, D // 4), dtype=torch.uint8, generator=g)
    scale = torch.rand(1, H_KV, block // G, D, generator=g).half()
    zero = torch.rand(1, H_KV, block // G, D, generator=g).half()
    query = torch.randn(1, H_KV, N_REP, D, generator=g)
    t0 = time.perf_counter()
    compiled = torch.compile(_key_block_scores, dynamic=False)
    compiled(query, codes, scale, zero)
    compile_s = time.perf_counter() - t0
    eager = _key_block_scores(query, codes, scale, zero)
    torch.testing.assert_close(compiled(query, codes, scale, zero), eager)
    times = {"eager": [], "compiled": []}
    for _ in range(reps):
        for label in random.sample(list(times), 2):
            fn = compiled if label == "compiled" else _key_block_scores
            t0 = clock()
            fn(query, codes, scale, zero)
            times[label].append(clock() - t0)
    med = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    print(
        f"torch.compile probe, {block}-token key block: compile {compile_s:.0f} s, "
        f"eager {med['eager']:.3f} ms, compiled {med['compiled']:.3f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=21)
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--clock",
        choices=("wall", "thread"),
        default="wall",
        help="wall: time.perf_counter; thread: CPU time of the calling thread (time.thread_time), which "
        "ignores time spent descheduled on a loaded machine but counts only one thread's work, so use "
        "it with --threads 1",
    )
    parser.add_argument(
        "--compile-probe", action="store_true", help="only time torch.compile on one key block, then exit"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.clock} clock, "
        f"block_size {args.block_size}, reps {args.reps}"
    )
    if args.compile_probe:
        compile_probe(args.block_size, max(args.reps, 50), clock)
        return
    print()
    print("| tokens | contender | median ms | vs sdpa fp32 | vs DynamicCache | peak transient KiB |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in bench_attention(args.lengths, args.reps, args.block_size, clock):
        print(
            f"| {r['tokens']} | {r['contender']} | {r['ms']:.2f} | {r['vs_sdpa']:.2f} | {r['vs_dyn']:.2f} "
            f"| {r['peak_kib']:.0f} |"
        )
    print()
    print("| tokens | store | median us per single-token append |")
    print("|---:|---|---:|")
    for r in bench_append(args.lengths, max(args.reps, 50)):
        print(f"| {r['tokens']} | {r['store']} | {r['us']:.1f} |")


if __name__ == "__main__":
    main()
