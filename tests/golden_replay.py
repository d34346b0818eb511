"""Every method's stored bytes and attention output on fixed keys and values: the golden record
that holds on any CPU.

The default model's post-RoPE queries, keys and values of two layers over one 264-token window
(BOS + the PG-19 fixture's first 263 tokens) were captured once and are committed as float16
(``tests/fixtures/golden/kv_capture.safetensors``, beside the model's ``config.json``). Each
registered method's cache is built for that model's shape and fed them through its own layer code
(:func:`kvbench.cache.capture.replay`: a 256-token prefill, attended exactly as the model's prefill
is, then 8 decode steps, each attended by its own query), so no model matmul runs: what differs
between CPUs can only come from the method's own arithmetic.

What is pinned per method (``tests/fixtures/golden/replay.json``):

- ``bytes``: bytes held by accounting component (exact);
- ``digests``: sha256 of every held tensor (dtype, shape and bytes), exact, except float32
  accumulators (H2O's attention-mass scores), which are sums in an order the vector unit chooses;
  their size is pinned through ``bytes``;
- ``rel_err``: each layer's mean relative attention-output error against exact float32 attention,
  compared to ``REL_TOL`` relative plus ``ABS_TOL`` absolute.

Why exact digests survive another CPU: the inputs are bit-exact (float16 upcast), and the codes
come from elementwise IEEE operations (subtract, divide, round: correctly rounded at any vector
width), from min/max (exact in any order), or from selections (top-k, outlier ranks, rotated
Lloyd-Max cells) whose margins are far above float32 rounding on these inputs. Measured on an AMD
EPYC (AVX2) with 1 and 2 threads, ``ATEN_CPU_CAPABILITY=default`` and ``avx2``, and MKL/oneDNN
limited to SSE4.2 (``MKL_ENABLE_INSTRUCTIONS=SSE4_2 ONEDNN_MAX_CPU_ISA=SSE41``) or in
``MKL_CBWR=COMPATIBLE`` mode: every digest identical, every ``rel_err`` within 5e-8 relative,
except FP16's, whose error is float32 rounding itself (3e-7) and moves by 4% of that (hence
``ABS_TOL``). ``tests/test_golden_outputs.py`` reruns this module under every capability the
machine's CPU offers and requires the same record from each.

    python tests/golden_replay.py OUT.json            # the record of the current code
    python tests/golden_replay.py --capture           # re-capture the K/V fixture (loads the model)
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

GOLDEN = Path(__file__).resolve().parent / "fixtures" / "golden"
CAPTURE = GOLDEN / "kv_capture.safetensors"
MODEL_CONFIG = GOLDEN / "model_config.json"
RECORD = GOLDEN / "replay.json"

LAYERS = (0, 15)
PREFILL, STEPS = 256, 8
REL_TOL, ABS_TOL = 1e-4, 1e-6
# Method nodes where the default needs the model itself: KVQuant calibrates on a model forward
# (its per-channel ranges would inherit the matmuls' rounding), so here it takes its statistics
# from the replayed prefill, as `method.calibrate=false` does in a run.
NODES = {"kvquant": {"calibrate": False}}
# Methods whose own default width is the point (SemKV mixes two level counts around it).
OWN_BITS = ("semkv",)
RUN_BITS = 2


def capture() -> None:
    """Record the fixture from the default model (needs `make assets`)."""
    from safetensors.torch import save_file

    from kvbench.cache import register_attention
    from kvbench.models import ModelConfig, load_model, model_node
    from kvbench.tasks.attention_probe import capture_window
    from kvbench.tasks.perplexity import load_text

    model, tok = load_model(
        ModelConfig(**model_node("smollm2-135m")), attn_implementation=register_attention()
    )
    text = load_text(Path(__file__).resolve().parent / "fixtures" / "data", "pg19", "10146")
    ids = [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)[: PREFILL + STEPS - 1]
    records = capture_window(model, ids, list(LAYERS))
    tensors = {
        f"layer{i}.{name}": getattr(r, name).half().contiguous()
        for i, r in records.items()
        for name in ("query", "keys", "values")
    }
    save_file(tensors, str(CAPTURE), metadata={"scaling": repr(records[LAYERS[0]].scaling)})
    MODEL_CONFIG.write_text(model.config.to_json_string())


def load_capture() -> tuple[dict[str, torch.Tensor], float]:
    from safetensors import safe_open

    with safe_open(str(CAPTURE), "pt") as f:
        scaling = float(f.metadata()["scaling"])
        return {k: f.get_tensor(k).float() for k in f.keys()}, scaling


def model_shape():
    from transformers import AutoConfig

    from kvbench.models.shape import shape_of_config

    config = json.loads(MODEL_CONFIG.read_text())
    return shape_of_config(AutoConfig.for_model(config.pop("model_type"), **config))


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().contiguous().cpu()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


@torch.no_grad()
def replay_method(name: str, kv: dict[str, torch.Tensor], scaling: float, shape) -> dict:
    from kvbench.cache import memory_report
    from kvbench.cache.capture import replay
    from kvbench.methods.base import build_method
    from kvbench.tasks.attention_probe import exact_attention, step_errors

    method = build_method({"name": name, **NODES.get(name, {})}, None if name in OWN_BITS else RUN_BITS)
    method.config.check_model(shape)
    cache = method.new_cache(shape, torch.float32)
    rel_err, digests, fed = {}, {}, []
    for idx in LAYERS:
        q, k, v = (kv[f"layer{idx}.{n}"] for n in ("query", "keys", "values"))
        layer = cache.layers[idx]
        outs = replay(layer, q, k, v, PREFILL, STEPS, scaling, attend_prefill=True)
        errs = []
        for t, out in zip(range(PREFILL, PREFILL + STEPS), outs, strict=True):
            want = exact_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], scaling)
            errs.append(step_errors(out.transpose(1, 2), want)[1])
        rel_err[str(idx)] = sum(errs) / len(errs)
        for component, held in sorted(layer.held_tensors().items()):
            held = [t for t in (held if isinstance(held, (list, tuple)) else [held]) if t is not None]
            if any(t.dtype == torch.float32 for t in held):
                continue  # accumulated statistics: their order of summation is the CPU's
            digests[f"{idx}.{component}"] = digest(held)
        fed.append(layer)
    return {
        "label": method.label(),
        "bytes": dict(sorted(memory_report(fed).bytes_by_component.items())),
        "digests": digests,
        "rel_err": rel_err,
    }


def record(names: list[str] | None = None) -> dict[str, dict]:
    """The record of every registered method (or of ``names``), one thread (see the module doc)."""
    from kvbench.methods import METHODS

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kv, scaling = load_capture()
        shape = model_shape()
        return {n: replay_method(n, kv, scaling, shape) for n in (names or METHODS.names())}
    finally:
        torch.set_num_threads(threads)


def mismatches(want: dict, got: dict) -> list[str]:
    """What differs between two records of one method, one line each."""
    out = []
    for key in ("label", "bytes", "digests"):
        if want[key] != got[key]:
            out.append(f"{key}: want {want[key]}, got {got[key]}")
    for layer, w in want["rel_err"].items():
        g = got["rel_err"].get(layer)
        if g is None or abs(g - w) > REL_TOL * abs(w) + ABS_TOL:
            out.append(f"rel_err layer {layer}: want {w:.9g}, got {g}")
    return out


if __name__ == "__main__":
    if sys.argv[1:] == ["--capture"]:
        capture()
    else:
        Path(sys.argv[1]).write_text(
            json.dumps(record(sys.argv[2:] or None), indent=1, sort_keys=True) + "\n"
        )
