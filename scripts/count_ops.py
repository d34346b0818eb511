"""Aten operations and host syncs of one decode step, for every registered method and for
transformers' own DynamicCache (SDPA), at long contexts (:mod:`kvbench.kernels.counting`).

DESIGN.md asks for a decode step that is a fixed number of calls per layer whatever the context,
with no host sync. Counting is machine-independent, so it runs anywhere; the model is a randomly
initialised Llama-3.1-8B shape cut to 2 layers (hidden 4096, 32 query / 8 KV heads, head_dim 128,
intermediate 14336; the vocabulary shrunk to 1024, which changes no per-step op count), fixed seed.

Per method and context N: the cache of the method (the registry node at 2 bits where the method
takes that width, as ``scripts/bench_cache.py`` runs it; a calibrating config is set to
``calibrate=false``, there is nothing to calibrate a random model on) is filled with N random
post-RoPE keys and values per layer through each layer's own ``update`` and ``attend``, the prefill's
attention done by the last :data:`PREFILL_QUERIES` prompt positions only (a full N-query prefill of an
8B-wide layer at 32K is hours on a CPU; those rows are enough for the observation windows of the
eviction policies), and the method's ``after_forward`` is shown the prompt. Then
:data:`WARMUP_STEPS` decode steps run through the method's own decode step (SpeCache's pre-decoding
happens there), and the next one is counted: one real forward of the model, or the method's own
sequence of forwards. DynamicCache is filled the same way and stepped with SDPA.

    python scripts/count_ops.py                       # 8K and 32K; writes benchmarks/count_ops.{md,csv}
    python scripts/count_ops.py --quick               # 1K and 4K
    python scripts/count_ops.py --contexts 2048 --only kivi DynamicCache --sites
    python scripts/count_ops.py --backend triton --threads 2 --sites   # benchmarks/count_ops_triton.{md,csv}
    python scripts/count_ops.py --backend triton --cuda-graph          # benchmarks/count_ops_triton_graph.*

``--cuda-graph`` counts the static decode step (``method.cuda_graph=true``, kvbench/cache/static.py)
of every method that has one: the device work a CUDA graph would capture (the forward on the step's
buffers), and whether the step after it is the same work on the same tensors with no sync
(``replay``: ``ok``, or the first reason it is not; :mod:`kvbench.kernels.replay`), which is what
makes a graph captured once compute every later step.

``--backend triton`` counts every method that allows that backend (the others are listed as
refused, with their one line); Triton launches dispatch no aten op, so they are counted as
operations by kernel name (``triton::NAME``). Without CUDA the kernels run under Triton's CPU
interpreter (``TRITON_INTERPRET=1`` is set here before anything imports triton), which counts the same
launches as a GPU would and is slow.
"""

from __future__ import annotations

import os
import sys


def _asks_triton(argv: list[str]) -> bool:
    return any(a == "--backend=triton" for a in argv) or any(
        a == "--backend" and nxt == "triton" for a, nxt in zip(argv, argv[1:], strict=False)
    )


# The interpreter is chosen when a kernel is decorated: decide before anything imports triton.
if _asks_triton(sys.argv[1:]):
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import csv  # noqa: E402
import gc  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig  # noqa: E402

from kvbench.builder import LoadedModel  # noqa: E402
from kvbench.cache import ATTN_IMPLEMENTATION, use_kvbench_attention  # noqa: E402
from kvbench.cache.capture import AttentionModule  # noqa: E402
from kvbench.cache.static import StaticStep  # noqa: E402
from kvbench.errors import ConfigError  # noqa: E402
from kvbench.generate import ModelRunner  # noqa: E402
from kvbench.kernels import cpu  # noqa: E402
from kvbench.kernels.counting import OpCounts, count_ops  # noqa: E402
from kvbench.kernels.replay import replay_problems, trace_step  # noqa: E402
from kvbench.methods import METHODS, build_method  # noqa: E402
from kvbench.models.shape import shape_of_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH_BITS = 2
PREFILL_QUERIES = 64
WARMUP_STEPS = 1
SEED = 0
REFERENCE = "DynamicCache"

# Llama-3.1-8B's attention and MLP widths, 2 layers, a small vocabulary
LLAMA_8B_2L = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
    num_hidden_layers=2,
    vocab_size=1024,
    rope_theta=500000.0,
    max_position_embeddings=131072,
)
# what the tests count on: the same geometry rules, small enough for a few seconds per method
TINY = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
    num_hidden_layers=2,
    vocab_size=128,
    rope_theta=10000.0,
    max_position_embeddings=8192,
)


class StubTokenizer:
    """What a runner asks of a tokenizer when it is handed ids."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(str(i) for i in ids)


def build_model(
    geometry: dict, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> LoadedModel:
    """A randomly initialised Llama of ``geometry`` (seeded), on kvbench's attention; built on
    ``device`` where given (``scripts/gpu_check.py``), else on the CPU."""
    torch.manual_seed(SEED)
    config = LlamaConfig(**geometry, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    if device is not None:
        model = model.to(device)
    use_kvbench_attention(model)
    model.generation_config.eos_token_id = None
    return LoadedModel(
        config=None, model=model, tokenizer=StubTokenizer(), shape=shape_of_config(config), load_s=0.0
    )


def method_node(name: str, backend: str | None = None, cuda_graph: bool = False) -> dict:
    """The registry's node for ``name`` at :data:`BENCH_BITS` where the method accepts that width,
    else its defaults; offline calibration off where the config has it; ``backend`` where given;
    ``cuda_graph``: the static decode step."""
    node = {"name": name} if backend is None else {"name": name, "backend": backend}
    if cuda_graph:
        node["cuda_graph"] = True
    if "calibrate" in METHODS.get(name).Config.__dataclass_fields__:
        node["calibrate"] = False
    try:
        build_method({**node, "bits": BENCH_BITS})
        node["bits"] = BENCH_BITS
    except (ConfigError, TypeError):
        pass
    return node


@dataclass
class Prompt:
    """Random post-RoPE keys and values ``[1, H_kv, N, D]`` per layer, the last prompt queries
    ``[1, H, PREFILL_QUERIES, D]`` per layer, the prompt ids and logits."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    queries: list[torch.Tensor]
    ids: torch.Tensor
    logits: torch.Tensor
    tokens: list[int] = field(default_factory=list)  # the tokens fed by the decode steps


def random_prompt(loaded: LoadedModel, n: int, steps: int, device: torch.device | None = None) -> Prompt:
    """A prompt of ``n`` tokens and ``steps`` decode tokens, drawn (seeded by ``n``) on ``device``
    where given, else on the CPU."""
    shape, dtype = loaded.shape, loaded.model.dtype
    vocab = loaded.model.config.vocab_size
    gen = (torch.Generator() if device is None else torch.Generator(device=device)).manual_seed(SEED + n)
    kv = (1, shape.num_kv_heads, n, shape.head_dim)
    q = (1, shape.num_heads, min(n, PREFILL_QUERIES), shape.head_dim)
    layers = range(shape.num_layers)

    def draw(size):
        return torch.randn(size, generator=gen, device=device).to(dtype)

    return Prompt(
        keys=[draw(kv) for _ in layers],
        values=[draw(kv) for _ in layers],
        queries=[draw(q) for _ in layers],
        ids=torch.randint(vocab, (1, n), generator=gen, device=device),
        logits=torch.randn(1, n, vocab, generator=gen, device=device),
        tokens=torch.randint(vocab, (steps,), generator=gen, device=device).tolist(),
    )


@torch.no_grad()
def fill(runner: ModelRunner, cache, prompt: Prompt) -> None:
    """The prompt stored as a prefill forward would store it (see the module docstring)."""
    shape = runner.shape
    scaling = shape.head_dim**-0.5
    for i in range(shape.num_layers):
        keys, values = cache.update(prompt.keys[i], prompt.values[i], i)
        module = AttentionModule(i, shape.num_heads // shape.num_kv_heads, scaling)
        # what the model's attention function does, without the model
        layer = cache.layer_to_attend(i, keys)
        layer.attend(module, prompt.queries[i], keys, values, None, scaling=scaling)
    runner.method.after_forward(cache, prompt.ids, prompt.logits)


@dataclass
class Row:
    label: str
    context: int
    counts: OpCounts
    seconds: float  # of the counted step, counting overhead included (not a timing)
    read_by: str = ""  # the backends that read the stored tokens in the counted step
    replay: str = ""  # static steps: whether the next step replays the counted one ("ok" or why not)


def count_static(loaded: LoadedModel, name: str, prompt: Prompt, sites: bool, backend: str | None) -> Row:
    """The static step of ``name``: warm-up steps, one traced step, then the counted step, traced
    too; ``replay`` compares the two traces."""
    method = build_method(method_node(name, backend, cuda_graph=True))
    runner = loaded.runner(method)
    n = prompt.ids.shape[1]
    cache = runner.new_cache()
    cache.reserve(n + len(prompt.tokens) + 1)
    fill(runner, cache, prompt)
    cache.advance(n)
    step = StaticStep(runner._static_forward(cache), cache, n, torch.device("cpu"), capture=False)
    *warmup, traced, counted = prompt.tokens
    for t in warmup:
        step(t)
    step.input_ids.fill_(traced)
    kind = cache.step_kind()
    with trace_step() as before:
        step.body()
    cache.advance(1)
    step.input_ids.fill_(counted)
    same_kind = cache.step_kind() == kind
    t0 = time.perf_counter()
    cpu.forget_backends_seen()
    with count_ops(sites=sites) as counts, trace_step() as after:
        step.body()
    cache.advance(1)
    problems = replay_problems(before, after) if same_kind else ["the two steps are of different kinds"]
    replay = "ok" if not problems else problems[0]
    label = f"{method.label()} (static)"
    return Row(label, n, counts, time.perf_counter() - t0, cpu.backend_in_use(), replay)


def count_method(
    loaded: LoadedModel, name: str, prompt: Prompt, sites: bool, backend: str | None = None
) -> Row:
    method = build_method(method_node(name, backend))
    runner = loaded.runner(method)
    cache = runner.new_cache()
    fill(runner, cache, prompt)
    *warmup, counted = prompt.tokens
    for t in warmup:
        runner.decode_step(torch.tensor([[t]]), cache)
    t0 = time.perf_counter()
    cpu.forget_backends_seen()
    with count_ops(sites=sites) as counts:
        runner.decode_step(torch.tensor([[counted]]), cache)
    return Row(method.label(), prompt.ids.shape[1], counts, time.perf_counter() - t0, cpu.backend_in_use())


def refusals(backend: str | None, cuda_graph: bool = False) -> dict[str, str]:
    """Methods that refuse ``backend`` (or the static step): name -> their one-line error."""
    out = {}
    for name in METHODS.names():
        try:
            build_method(method_node(name, backend, cuda_graph))
        except ConfigError as e:
            out[name] = str(e)
    return out


@torch.no_grad()
def count_dynamic(loaded: LoadedModel, prompt: Prompt, sites: bool) -> Row:
    model = loaded.model
    cache = DynamicCache(config=model.config)
    for i in range(loaded.shape.num_layers):
        cache.update(prompt.keys[i], prompt.values[i], i)
    model.set_attn_implementation("sdpa")
    try:
        *warmup, counted = prompt.tokens
        for t in warmup:
            model(input_ids=torch.tensor([[t]]), cache=cache, use_cache=True)
        t0 = time.perf_counter()
        with count_ops(sites=sites) as counts:
            model(input_ids=torch.tensor([[counted]]), cache=cache, use_cache=True).logits.float()
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return Row(REFERENCE, prompt.ids.shape[1], counts, time.perf_counter() - t0)


def count_all(
    loaded: LoadedModel,
    contexts: list[int],
    only: list[str] | None = None,
    sites: bool = False,
    log=None,
    backend: str | None = None,
    cuda_graph: bool = False,
) -> list[Row]:
    rows = []
    refused = refusals(backend, cuda_graph) if backend or cuda_graph else {}
    names = [n for n in (REFERENCE, *METHODS.names()) if (not only or n in only) and n not in refused]
    for n in contexts:
        prompt = random_prompt(loaded, n, WARMUP_STEPS + 1 + cuda_graph)
        for name in names:
            if name == REFERENCE:
                row = count_dynamic(loaded, prompt, sites)
            elif cuda_graph:
                row = count_static(loaded, name, prompt, sites, backend)
            else:
                row = count_method(loaded, name, prompt, sites, backend)
            rows.append(row)
            if log is not None:
                print(
                    f"{row.label:40s} {n:6d} ops {row.counts.total_ops:7d} syncs {row.counts.total_syncs:5d}",
                    file=log,
                    flush=True,
                )
            gc.collect()
        del prompt
        gc.collect()
    return rows


def ratios(rows: list[Row]) -> dict[tuple[str, int], float]:
    ref = {r.context: r.counts.total_ops for r in rows if r.label == REFERENCE}
    return {(r.label, r.context): r.counts.total_ops / ref[r.context] for r in rows if r.context in ref}


def sync_summary(counts: OpCounts) -> str:
    return "; ".join(f"{k} x{v}" for k, v in counts.syncs.most_common())


def table(rows: list[Row]) -> str:
    ratio = ratios(rows)
    replay = any(r.replay for r in rows)
    lines = [
        "| method | context | ops/step | syncs/step | ops vs DynamicCache | syncs by kind | read by |"
        + (" replay |" if replay else ""),
        "|:--|--:|--:|--:|--:|:--|:--|" + (":--|" if replay else ""),
    ]
    for r in rows:
        x = ratio.get((r.label, r.context))
        lines.append(
            f"| {r.label} | {r.context} | {r.counts.total_ops} | {r.counts.total_syncs} | "
            f"{'' if x is None else f'{x:.2f}'} | {sync_summary(r.counts)} | {r.read_by} |"
            + (f" {r.replay} |" if replay else "")
        )
    return "\n".join(lines)


def sites_section(rows: list[Row]) -> str:
    out = []
    for r in rows:
        if r.counts.sites:
            out.append(f"- {r.label} at {r.context}:")
            out.extend(f"  - {line}" for line in r.counts.describe_syncs().splitlines())
    return "\n".join(out)


def write(
    rows: list[Row], out: Path, argv: list[str], geometry: str, refused: dict[str, str] | None = None
) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    ratio = ratios(rows)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "method",
                "context",
                "ops_per_step",
                "syncs_per_step",
                "ops_ratio_dynamic",
                "syncs_by_kind",
                "read_by",
                "replay",
            ]
        )
        for r in rows:
            x = ratio.get((r.label, r.context))
            w.writerow(
                [
                    r.label,
                    r.context,
                    r.counts.total_ops,
                    r.counts.total_syncs,
                    "" if x is None else f"{x:.3f}",
                    sync_summary(r.counts),
                    r.read_by,
                    r.replay,
                ]
            )
    sites = sites_section(rows)
    text = [
        "# Aten ops and host syncs per decode step",
        "",
        f"`python scripts/count_ops.py {' '.join(argv)}`".replace(" `", "`"),
        "",
        f"Model: {geometry}, random weights (seed {SEED}), torch {torch.__version__}, {platform.machine()}. "
        f"Each method at {BENCH_BITS} bits where it takes that width; the cache filled with random post-RoPE "
        f"keys and values, {WARMUP_STEPS} decode step run, the next one counted (the method's own decode "
        "step: SpeCache's is two tokens per forward). A sync is an op that would make the host wait for the "
        "device (`kvbench/kernels/counting.py`); on a CPU a device-to-host copy dispatches nothing and is "
        "not seen, the value reads are.",
        "",
        table(rows),
    ]
    if refused:
        text += ["", "Methods refused here (their one-line error):", ""]
        text += [f"- {name}: {line}" for name, line in sorted(refused.items())]
    if sites:
        text += ["", "Where the syncs are issued (innermost frame outside torch):", "", sites]
    out.with_suffix(".md").write_text("\n".join(text) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768])
    p.add_argument("--quick", action="store_true", help="contexts 1K and 4K")
    p.add_argument("--tiny", action="store_true", help="the tests' small model instead of the 8B shape")
    p.add_argument("--only", nargs="+", help="method names (and/or DynamicCache)")
    p.add_argument("--sites", action="store_true", help="record where every sync is issued")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--backend", choices=["auto", "torch", "triton"], default=None, help="every method's backend"
    )
    p.add_argument("--cuda-graph", action="store_true", help="the static step of the methods that have one")
    p.add_argument(
        "--out", type=Path, default=None, help="default: benchmarks/count_ops[_BACKEND][_graph].md"
    )
    args = p.parse_args(argv)
    suffix = ("" if args.backend in (None, "auto") else "_" + args.backend) + (
        "_graph" if args.cuda_graph else ""
    )
    out = args.out or ROOT / "benchmarks" / f"count_ops{suffix}.md"
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = [1024, 4096] if args.quick else args.contexts
    geometry = TINY if args.tiny else LLAMA_8B_2L
    described = (
        "tiny Llama (2 layers, hidden 256, 4 / 2 heads, head_dim 64)"
        if args.tiny
        else "Llama-3.1-8B shape cut to 2 layers (hidden 4096, 32 / 8 heads, head_dim 128, "
        "intermediate 14336, vocab 1024)"
    )
    loaded = build_model(geometry, getattr(torch, args.dtype))
    rows = count_all(
        loaded,
        contexts,
        args.only,
        args.sites,
        log=sys.stderr,
        backend=args.backend,
        cuda_graph=args.cuda_graph,
    )
    print(table(rows))
    refused = refusals(args.backend, args.cuda_graph) if args.backend or args.cuda_graph else {}
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0") and args.backend == "triton":
        described += "; Triton kernels under the CPU interpreter (TRITON_INTERPRET=1)"
    write(rows, out, argv, f"{described}, {args.dtype} weights", refused)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
