"""``attention_probe``: attention-output error of the method's cache on the model's own queries,
keys and values.

For each text window the default model reads the window once with no cache
(:func:`kvbench.cache.capture.capture_attention` records each selected layer's post-RoPE
``query [1, H, N, D]`` and ``keys``/``values [1, H_kv, N, D]``, ``N = context_length + steps``).
Then, per selected layer, a fresh cache of the run's method (:meth:`ModelRunner.new_cache`) is fed
the first ``context_length`` tokens in one update (its prefill) and ``steps`` decode steps are
replayed through the layer's own ``update``/``attend`` (:func:`kvbench.cache.capture.replay`: pools,
sinks, residual windows and query-adaptive reads run as in a real decode). Each step's output is
compared with exact attention of the same query over the unquantized keys and values of positions
``0..t`` (float32; on a sliding-window layer only the newest ``sliding_window`` of them, which is
all the model attends there):

    rel_err = || O_method - O_exact || / || O_exact ||

per query head (norms over the head dimension ``D``), averaged over heads, steps and layers;
``rel_err_by_layer`` holds each layer's mean. ``rel_err_pooled`` takes the norms over all heads of
a step at once, so a head with a small output weighs less there. Lower is better.

Why not the model's end-to-end output: every layer here sees the exact model's queries and the
exact keys and values of its own inputs, so the number isolates the cache's error at a layer from
its propagation through later layers (that is what perplexity and the generation tasks measure).
For the same reason the task drives the cache layers itself instead of the runner's generation or
scoring loop: a method's :meth:`~kvbench.methods.Method.after_forward` and
:meth:`~kvbench.methods.Method.decode_step` never run, so a method whose behaviour lives there
(SpeCache's speculative step; SemKV's hidden-state and logit metrics, whose tokens would stay
unscored) is not measured by this probe. Methods whose layers act in ``update``/``attend`` alone
(every quantizer, SemKV's key/value-norm and random metrics, the eviction policies) are.

Memory: the run's ``memory`` is the accounting of the tensors the selected layers hold after the
last step (:func:`kvbench.cache.memory_report` over the cache; the other layers were never fed and
are not counted), so effective bits and the ratio to FP16 come out as in every other task.

The FP16 reference: the ``fp16`` method with ``fp_dtype: float16`` (its config node) on a float32
model stores keys and values rounded to float16, so its error is the float16 rounding (about 3e-4
on the default model), not 0; with ``fp_dtype: auto`` (the model's dtype) it reads back exactly
what the model computed and its error is at float32 rounding (below 1e-6).

Text (``dataset``): a PG-19 book body (``pg19``, ``pg19_book``; the default) or the WikiText-2
test split (``wikitext2``), read as :mod:`kvbench.tasks.perplexity` reads them (LF line endings,
tokenized once without special tokens). Window ``i`` is the tokenizer's BOS (when it has one: the
model's usual first token, the pivot token IntactKV and KVQuant's sink keep lossless) followed by
text tokens ``[i*M, (i+1)*M)``, ``M = context_length + steps - 1`` (``M = context_length + steps``
without a BOS): consecutive, non-overlapping windows from the start of the text,
``context_length`` tokens prefilled (BOS included) and ``steps`` decoded.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.cache import memory_report
from kvbench.cache.capture import AttentionRecord, capture_attention, replay
from kvbench.cache.prefill import SHARED_PREFILLS, token_digest
from kvbench.config import check_choice, is_int, require
from kvbench.data import encode_text
from kvbench.errors import ConfigError
from kvbench.tasks.base import Metric, Task, TaskConfig, Work, limited, register_task
from kvbench.tasks.perplexity import data_file, load_text

DATASETS = ("pg19", "wikitext2")
LAYER_STRIDE = 4  # layers: null selects every 4th layer, from layer 0


def exact_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of ``query [B, H, q, D]`` over every one of ``keys``/``values [B, H_kv, n, D]``
    (query head ``h`` reads KV head ``h // (H / H_kv)``), no mask, in float32. Returns
    ``[B, H, q, D]``."""
    b, heads, q, d = query.shape
    kv_heads = keys.shape[1]
    # the query heads of one KV head side by side, [B, H_kv, (H / H_kv) * q, D]: no repeated keys
    grouped = query.float().reshape(b, kv_heads, heads // kv_heads * q, d)
    probs = torch.softmax((grouped @ keys.float().transpose(-1, -2)) * scaling, dim=-1)
    return (probs @ values.float()).reshape(b, heads, q, d)


def step_errors(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Relative errors of one step's output ``got`` against ``want`` (both ``[B, H, 1, D]``): per
    query head ``||got_h - want_h|| / ||want_h||`` (``[H]``, batch 1) and pooled over the heads."""
    diff = (got.float() - want.float())[0, :, 0]  # [H, D]
    ref = want.float()[0, :, 0]
    per_head = diff.norm(dim=-1) / ref.norm(dim=-1)
    return per_head, (diff.norm() / ref.norm()).item()


def layer_errors(
    layer, record: AttentionRecord, prefill: int, steps: int, window: int | None = None
) -> tuple[torch.Tensor, list[float]]:
    """Replay one layer's captured tensors through the cache layer ``layer`` (``prefill`` tokens,
    then ``steps`` decode steps) and compare every step's output with exact attention.

    ``record`` holds ``query [1, H, N, D]`` and ``keys``/``values [1, H_kv, N, D]`` with ``N >=
    prefill + steps``; ``window`` is the layer's sliding window (None: full attention). Returns the
    per-head errors ``[steps, H]`` and the pooled error of each step."""
    q, k, v, scaling = record.query, record.keys, record.values, record.scaling
    outs = replay(layer, q, k, v, prefill, steps, scaling)
    per_head, pooled = [], []
    for t, out in zip(range(prefill, prefill + steps), outs, strict=True):
        lo = 0 if window is None else max(0, t + 1 - window)
        want = exact_attention(q[:, :, t : t + 1], k[:, :, lo : t + 1], v[:, :, lo : t + 1], scaling)
        heads, whole = step_errors(out.transpose(1, 2), want)  # [B, 1, H, D] -> [B, H, 1, D]
        per_head.append(heads)
        pooled.append(whole)
    return torch.stack(per_head), pooled


class _Captured(dict):
    """A window's records, as kept in the process's store (``nbytes`` for its budget)."""

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for r in self.values() for t in (r.query, r.keys, r.values))


@torch.no_grad()
def capture_window(model, ids: list[int], layers: list[int]) -> dict[int, AttentionRecord]:
    """One cache-less forward of the model over ``ids`` with each layer in ``layers`` recorded:
    ``query [1, H, N, D]``, ``keys``/``values [1, H_kv, N, D]`` as the model computes them.

    The forward does not depend on the method probed, so the arms of a node share it: the records
    are kept in the process's store (:data:`kvbench.cache.prefill.SHARED_PREFILLS`) and the next arm
    probing the same window gets the same tensors (a new dict each time: the caller pops from it)."""
    key = ("attention_probe", token_digest(ids), tuple(layers))
    kept = SHARED_PREFILLS.get(model, key) if SHARED_PREFILLS.enabled else None
    if kept is not None:
        return dict(kept)
    device = next(model.parameters()).device
    with capture_attention(layers) as cap:
        # only the last position's logits: the full [N, vocab] is large and unused
        model(input_ids=torch.tensor([ids], device=device), use_cache=False, logits_to_keep=1)
    if SHARED_PREFILLS.enabled:
        SHARED_PREFILLS.put(model, key, _Captured(cap.records))
    return dict(cap.records)


@dataclass
class AttentionProbeConfig(TaskConfig):
    """Lengths in tokens of the model's tokenizer; ``context_length`` includes the BOS. ``layers``:
    a list of layer indices, or null for every 4th layer (0, 4, 8, ...). See the module docstring."""

    name: str = "attention_probe"
    version: int = 1
    dataset: str = "pg19"
    pg19_book: str = "10146"
    context_length: int = 1024
    steps: int = 8
    layers: list | None = None
    windows: int = 8

    def __post_init__(self):
        super().__post_init__()
        check_choice("task.dataset", self.dataset, DATASETS)
        self.pg19_book = str(self.pg19_book)  # Hydra reads a bare 10146 as an int
        require(self.pg19_book.isdigit(), "task.pg19_book", self.pg19_book, "a Project Gutenberg book number")
        for key in ("context_length", "steps", "windows"):
            value = getattr(self, key)
            require(is_int(value) and value > 0, f"task.{key}", value, "a positive int")
        require(
            self.context_length >= 2,
            "task.context_length",
            self.context_length,
            "an int >= 2 (the BOS and at least one text token)",
        )
        if self.layers is not None:
            layers = list(self.layers) if isinstance(self.layers, (list, tuple)) else None
            ok = (
                bool(layers) and all(is_int(i) and i >= 0 for i in layers) and len(set(layers)) == len(layers)
            )
            require(
                ok, "task.layers", self.layers, "null (every 4th layer) or a list of distinct layer indices"
            )
            self.layers = sorted(layers)


@register_task("attention_probe")
class AttentionProbe(Task):
    Config = AttentionProbeConfig
    primary_metric = "rel_err"
    metrics = {
        "rel_err": Metric(False, "relative L2 error of the attention output, mean over heads"),
        "rel_err_pooled": Metric(False, "relative L2 error of the attention output, pooled over heads"),
        "rel_err_by_layer": Metric(False, "relative L2 error of the attention output per layer"),
    }

    @classmethod
    def planned_samples(cls, config: AttentionProbeConfig) -> int:
        return limited(config.windows, config)

    @classmethod
    def sample_work(cls, config: AttentionProbeConfig) -> Work:
        return Work(config.context_length, config.steps, config.context_length)

    def __init__(self, config: AttentionProbeConfig, data_root: Path, seed: int = 0):
        super().__init__(config, data_root, seed)
        self._ids: tuple[Any, list[int]] | None = None  # (tokenizer, the text's token ids)

    def samples(self) -> list[dict[str, Any]]:
        data_file(self.data_root, self.config.dataset, self.config.pg19_book)  # fail before any model work
        rows = [{"id": f"w{i}", "window": i} for i in range(self.config.windows)]
        return rows[: self.config.limit] if self.config.limit else rows

    def prompt_lengths(self) -> list[int]:
        return [self.config.context_length]

    def token_ids(self, tokenizer) -> list[int]:
        """The text tokenized once per tokenizer, without special tokens."""
        if self._ids is None or self._ids[0] is not tokenizer:
            text = load_text(self.data_root, self.config.dataset, self.config.pg19_book)
            self._ids = (tokenizer, encode_text(tokenizer, text))
        return self._ids[1]

    @staticmethod
    def prefix(tokenizer) -> list[int]:
        bos = getattr(tokenizer, "bos_token_id", None)
        return [] if bos is None else [bos]

    def text_tokens(self, tokenizer) -> int:
        """Text tokens per window: ``context_length + steps`` less the BOS."""
        return self.config.context_length + self.config.steps - len(self.prefix(tokenizer))

    def window(self, tokenizer, i: int) -> list[int]:
        """Window ``i``: BOS (if the tokenizer has one), then text tokens ``[i*M, (i+1)*M)``."""
        m = self.text_tokens(tokenizer)
        return self.prefix(tokenizer) + self.token_ids(tokenizer)[i * m : (i + 1) * m]

    def layers(self, shape) -> list[int]:
        return (
            self.config.layers
            if self.config.layers is not None
            else list(range(0, shape.num_layers, LAYER_STRIDE))
        )

    def check_model(self, shape, tokenizer) -> None:
        c = self.config
        need = c.context_length + c.steps
        limit = getattr(shape, "max_context", None)
        if limit and need > limit:
            raise ConfigError(
                "task.context_length",
                c.context_length,
                f"context_length + steps = {need} exceeds the model's {limit}-token context",
            )
        if c.layers is not None and c.layers[-1] >= shape.num_layers:
            raise ConfigError("task.layers", c.layers, f"layer indices in 0..{shape.num_layers - 1}")
        total = len(self.token_ids(tokenizer))
        m = self.text_tokens(tokenizer)
        if c.windows * m > total:
            source = f"book {c.pg19_book}" if c.dataset == "pg19" else c.dataset
            raise ConfigError(
                "task.windows", c.windows, f"{source} has {total} tokens: at most {total // m} windows of {m}"
            )

    def run(self, sample: dict[str, Any], runner) -> dict[str, Any]:
        c = self.config
        shape = runner.shape
        layers = self.layers(shape)
        ids = self.window(runner.tokenizer, sample["window"])
        records = capture_window(runner.model, ids, layers)
        sliding = set(shape.sliding_layers())
        cache = runner.new_cache()  # one cache per window; only the selected layers are fed
        per_head, pooled, by_layer = [], [], {}
        for idx in layers:
            window = shape.sliding_window if idx in sliding else None
            heads, whole = layer_errors(
                cache.layers[idx], records.pop(idx), c.context_length, c.steps, window
            )
            per_head.append(heads)  # [steps, H]
            pooled += whole
            by_layer[str(idx)] = heads.mean().item()
        return {
            "prompt_tokens": c.context_length,
            "prediction": "",
            "window": sample["window"],
            "layers": layers,
            "steps": c.steps,
            "rel_err": torch.stack(per_head).mean().item(),
            "rel_err_pooled": sum(pooled) / len(pooled),
            "rel_err_by_layer": by_layer,
            "memory": memory_report(cache.layers),
        }

    def aggregate(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Means over windows of ``rel_err``, ``rel_err_pooled`` and each layer's ``rel_err``."""
        rows = [r for r in rows if r.get("rel_err") is not None]
        out: dict[str, Any] = {"n": len(rows)}
        if not rows:
            out["rel_err"] = float("nan")
            return out
        out["rel_err"] = sum(r["rel_err"] for r in rows) / len(rows)
        out["rel_err_pooled"] = sum(r["rel_err_pooled"] for r in rows) / len(rows)
        out["rel_err_by_layer"] = {
            k: sum(r["rel_err_by_layer"][k] for r in rows) / len(rows) for k in rows[0]["rel_err_by_layer"]
        }
        return out
