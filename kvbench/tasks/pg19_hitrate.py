"""``pg19_hitrate``: how much attention a sparse key set captures (SpeCache, Sec. 2, Figure 2 left).

SpeCache (Jie et al., ICML 2025, arXiv:2503.16163) motivates prefetching with a hit-rate study on
PG19 windows: the hit rate of a set ``S`` of ``k`` keys for a query is the share of that query's
full attention mass that ``S`` holds,

    p_t = softmax(q_t K_{0..t}^T * scaling)              (full causal attention of query t)
    hit(S) = sum_{j in S} p_t[j],        |S| = k,        sparsity = k / T

reported as a function of the sparsity. The figure compares query-dependent exact top-k attention
with greedy (H2O-like) eviction; this task adds SpeCache's own predictor. Policies, all at the same
``k`` and chosen per query head (the paper's models and ours use GQA; every query head gets its own
set, as a repeat-kv implementation would), with the hit rate averaged over query heads:

- ``exact_topk``: the top-k of ``p_t`` itself (an upper bound no other k-set can beat).
- ``h2o``: the registered ``h2o`` method (H2O, Zhang et al. 2023: accumulated attention, greedy
  eviction, a recent window; :mod:`kvbench.methods.h2o`), driven with the captured queries, keys
  and values of each layer (:func:`kvbench.cache.capture.replay`): the prompt (the window's tokens
  before the decode positions) is attended exactly and compressed, then every decode position is
  stored and attended by its own query, evicting back to the budget. Its cache keeps ``k - 1``
  tokens so that each decode query attends ``k`` entries, itself included (``k = 1``: itself alone);
  ``r = max(1, round(h2o_recent_ratio * k))`` of those ``k`` are the newest tokens (the method's
  ``window`` is ``r - 1``, the current token being the r-th). H2O shares one kept set per KV head
  (its scores sum the attention of the query heads that read it); the hit rate is still measured
  per query head.
- ``specache``: SpeCache's prediction. The speculative token for position ``t`` is the model's
  greedy prediction there (argmax of the logits at ``t-1``), fed at position ``t`` after the true
  tokens ``0..t-1``. Its post-RoPE query scores the keys as SpeCache's low-bit copy holds them: the
  registered ``kivi`` method (``spec_bits``, groups of ``G`` tokens per key channel, residual ``R``,
  SpeCache's 1-bit zero point ``z = (3 min + max) / 4``, ``s = (max - min) / 2`` when asked), fed
  the tokens stored before that forward (``0..t-2``): the keys it has quantized are low-bit, the
  rest of its residual exact, and the token of the same forward (``t-1``) and the speculative
  token's own key are exact. The set is the top-k of those
  scores (SpeCache Algorithm 3, ``ArgTopK(A_{1,:})``); the hit rate is measured on the true query
  ``t``'s full attention (the speculative key at ``t`` stands for the true token's key there).

What is real and what is simulated. Queries and keys are the model's own: one teacher-forced
forward over the window through an exact cache (the registered ``fp16`` method in the model's
dtype), recorded by :func:`kvbench.cache.capture.capture_attention` (queries arrive post-RoPE, like
the keys), then one single-token forward per decode position for the speculative token, over the
same exact prefix. The policies then run on those tensors, layer by layer. The run's method cache
is never read, so the task accepts only the FP16 baseline (the label must not suggest a quantized
run). Simplifications against a full SpeCache pipeline, all recorded here: the
speculative token is the prediction from the exact prefix (in the pipeline it comes from the
previous speculative token, so it can only be worse), its query comes from an exact forward (not
from the low-bit cache), and the 16-bit keys prefetched for the previous step, which SpeCache swaps
into the speculative token's key set, are not modelled (all stored keys outside the residual are
low-bit in the scoring, so the prediction here is, if anything, slightly harder).

Text: the PG-19 book body (strictly between the Gutenberg START and END markers, LF line endings),
tokenized once without special tokens; window ``i`` is tokens ``[i*N, (i+1)*N)``; the decode
positions are its last ``M`` tokens. The budget per sparsity is ``k = max(1, round(s * N))``, so at
the decode positions (``T = N-M+1 .. N`` keys visible) ``k / T`` is ``s`` up to ``N / (N-M+1)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbench.cache.capture import capture_attention, replay
from kvbench.cache.eviction import shared_prefill
from kvbench.config import check_choice, is_int, is_number, require
from kvbench.data import encode_text
from kvbench.errors import ConfigError
from kvbench.methods import ModelShape, build_method
from kvbench.quant.affine import ZERO_POINTS, levels_for_bits
from kvbench.tasks.base import Metric, Task, TaskConfig, Work, limited, register_task
from kvbench.tasks.perplexity import data_file, load_text

POLICIES = ("exact_topk", "h2o", "specache")


def sparsity_key(s: float) -> str:
    """The string a sparsity is stored under (``0.005`` -> ``"0.005"``, ``1`` -> ``"1"``)."""
    return f"{float(s):g}"


def budget(sparsity: float, n: int) -> int:
    """Entries kept at ``sparsity`` of an ``n``-token window: ``max(1, round(s * n))`` (half up)."""
    return max(1, min(n, math.floor(sparsity * n + 0.5)))


def recent_size(k: int, ratio: float) -> int:
    """H2O's recent window inside a budget of ``k``: ``max(1, round(ratio * k))``, at most ``k``; the
    current token is always one of them."""
    return min(k, max(1, math.floor(ratio * k + 0.5)))


# --- hit-rate math -----------------------------------------------------------------------------------


def causal_probs(
    q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Full attention of queries ``q [H, M, D]`` at ``positions [M]`` over ``keys [H_kv, N, D]``.

    Query head ``h`` reads kv head ``h // (H / H_kv)``. Keys after a query's position get
    probability 0. Returns float32 ``[H, M, N]``."""
    kr = keys.float().repeat_interleave(q.shape[0] // keys.shape[0], dim=0)
    logits = (q.float() @ kr.transpose(-1, -2)) * scaling
    future = torch.arange(keys.shape[1], device=q.device)[None, :] > positions.to(q.device)[:, None]  # [M, N]
    return torch.softmax(logits.masked_fill(future, float("-inf")), dim=-1)


def topk_hit_rates(probs: torch.Tensor, scores: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """Mass of ``probs [..., N]`` on the top-``k`` entries of ``scores [..., N]``, for each ``k``.

    Entries a query cannot see must carry probability 0 and score ``-inf`` (they then sort last, so
    ``k`` above the visible count just takes everything). Returns ``[len(ks), ...]``."""
    order = scores.argsort(dim=-1, descending=True, stable=True)
    mass = probs.gather(-1, order).cumsum(dim=-1)
    return torch.stack([mass[..., min(k, mass.shape[-1]) - 1] for k in ks])


def h2o_hit_rates(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float,
    budgets: list[int],
    recents: list[int],
    start: int,
) -> torch.Tensor:
    """Hit rates of the registered ``h2o`` method over one layer's captured tensors.

    Args:
        q: ``[H, N, D]`` the queries of every position (post-RoPE); ``keys``/``values [H_kv, N, D]``.
        budgets, recents: per budget, ``k`` entries attended by each decode query (its own key
            included) and ``r`` of them the newest tokens (``1 <= r <= k``).
        start: the first decode position: positions before it are the prompt.

    Each budget gets its own H2O cache layer (budget ``k - 1``, window ``r - 1``), fed the prompt in
    one forward and then each decode position (module docstring); the attended set of decode query
    ``t`` is what the layer holds when that query attends (``record_positions``). ``k = 1`` is the
    current token alone. The prompt's attention (and H2O's accumulated scores from it) is the same for
    every budget: it is computed once and shared (:func:`kvbench.cache.eviction.shared_prefill`), the
    same arithmetic as computing it per budget.

    Returns float32 ``[len(budgets), N - start, H]``: the full-attention mass of the attended set.
    """
    heads, n, d = q.shape
    groups = heads // keys.shape[0]
    positions = torch.arange(start, n, device=q.device)
    probs = causal_probs(q[:, start:], keys, positions, scaling)  # [H, M, N]
    shape = ModelShape(num_layers=1, num_heads=heads, num_kv_heads=keys.shape[0], head_dim=d)
    out = torch.empty(len(budgets), n - start, heads, device=q.device)
    # Every budget's cache prefills the same prompt from the same tensors: its attention and the
    # accumulated scores are computed once (the first cache's) and copied to the others.
    with shared_prefill():
        for i, (k, r) in enumerate(zip(budgets, recents, strict=True)):
            if k == 1:  # the current token alone: nothing is cached (H2O's smallest cache holds one token)
                out[i] = probs[:, torch.arange(n - start), positions].transpose(0, 1)
                continue
            cache_budget = k - 1
            window = min(r - 1, cache_budget)
            method = build_method(
                {"name": "h2o", "budget": cache_budget, "window": window, "fp_dtype": "auto"}
            )
            layer = method.new_cache(shape, keys.dtype).layers[0]
            layer.record_positions = True

            def measure(t, layer, i=i):
                attended = torch.zeros(keys.shape[0], n, device=q.device)
                attended.scatter_(-1, layer.positions[0].to(q.device), 1.0)  # [H_kv, N]
                mask = attended.repeat_interleave(groups, dim=0)  # [H, N]
                out[i, t - start] = (probs[:, t - start] * mask).sum(-1)

            replay(
                layer, q[None], keys[None], values[None], start, n - start, scaling,
                attend_prefill=True, before_attend=measure,
            )  # fmt: skip
    return out


def kivi_lowbit_keys(
    keys: torch.Tensor, values: torch.Tensor, node: dict[str, Any], start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys ``[H_kv, N, D]`` as the registered ``kivi`` method ``node`` holds them for the
    speculative forwards at positions ``start .. N-1``: a layer fed the tokens ``0..t-2`` before
    position ``t``. Returns float32 ``[H_kv, N, D]`` (the layer's reconstruction of the tokens it
    last held, then the exact keys) and, per decode position, how many of the oldest keys it held
    in low bits (``[N - start]``, int64). Per-channel groups are aligned to position 0, so the
    codes of every shorter prefix are a slice of the last one."""
    n = keys.shape[1]
    method = build_method(node)
    shape = ModelShape(
        num_layers=1, num_heads=keys.shape[0], num_kv_heads=keys.shape[0], head_dim=keys.shape[-1]
    )
    layer = method.new_cache(shape, keys.dtype).layers[0]
    k, v = keys[None], values[None]
    layer.update(k[:, :, : start - 1], v[:, :, : start - 1])
    flushed = [len(layer.kq)]
    for t in range(start + 1, n):
        layer.update(k[:, :, t - 2 : t - 1], v[:, :, t - 2 : t - 1])
        flushed.append(len(layer.kq))
    held, _ = layer.read()
    low = torch.cat([held[0].float(), keys[:, held.shape[-2] :].float()], dim=1)
    return low, torch.tensor(flushed, device=keys.device)


@dataclass
class Captured:
    """One window's tensors for the recorded layers (batch dimension dropped)."""

    queries: dict[int, torch.Tensor]  # layer -> [H, N, D] queries of every position
    keys: dict[int, torch.Tensor]  # layer -> [H_kv, N, D]
    values: dict[int, torch.Tensor]  # layer -> [H_kv, N, D]
    spec_queries: dict[int, torch.Tensor]  # layer -> [H, M, D] speculative queries at the decode positions
    spec_keys: dict[int, torch.Tensor]  # layer -> [H_kv, M, D] the speculative tokens' own keys
    scaling: dict[int, float]
    spec_tokens: list[int]  # greedy predictions at the decode positions
    true_tokens: list[int]


@torch.no_grad()
def capture(
    model,
    ids: list[int],
    decode: int,
    layers: list[int],
    num_layers: int,
    speculative: list[int] | None = None,
) -> Captured:
    """Teacher-forced forward over ``ids`` (N tokens), then one speculative forward per decode
    position ``t`` in ``[N - decode, N)``: the greedy prediction for ``t`` (or ``speculative[j]``
    when given) fed at ``t`` after the exact keys and values of ``0..t-1``. The cache is the
    registered ``fp16`` method in the model's dtype (exact); attention is recorded by
    :func:`~kvbench.cache.capture.capture_attention`."""
    device = next(model.parameters()).device
    config = model.config.get_text_config()
    shape = ModelShape(
        num_layers=num_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
    )
    exact = build_method({"name": "fp16", "fp_dtype": "auto"})
    n = len(ids)
    start = n - decode
    with capture_attention() as first:
        # Only the logits that predict the decode positions are needed (the full [N, vocab] is large).
        out = model(
            input_ids=torch.tensor([ids], device=device),
            **exact.new_cache(shape, model.dtype).forward_kwargs(),
            logits_to_keep=decode + 1,
        )
    spec = out.logits[0, :-1].float().argmax(dim=-1).tolist()  # predictions for start..n-1
    if speculative is not None:
        spec = list(speculative)
    rec = first.records
    spec_q: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    spec_k: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    for j, t in enumerate(range(start, n)):
        cache = exact.new_cache(shape, model.dtype)
        for i, layer in enumerate(cache.layers):  # the exact prefix 0..t-1 of the first forward
            layer.update(rec[i].keys[..., :t, :], rec[i].values[..., :t, :])
        with capture_attention(layers) as step:
            model(
                input_ids=torch.tensor([[spec[j]]], device=device),
                **cache.forward_kwargs(),
                logits_to_keep=1,
            )
        for i in layers:
            spec_q[i].append(step.records[i].query[0, :, -1])
            spec_k[i].append(step.records[i].keys[0, :, -1])
    return Captured(
        queries={i: rec[i].query[0] for i in layers},
        keys={i: rec[i].keys[0] for i in layers},
        values={i: rec[i].values[0] for i in layers},
        spec_queries={i: torch.stack(spec_q[i], dim=1) for i in layers},
        spec_keys={i: torch.stack(spec_k[i], dim=1) for i in layers},
        scaling={i: rec[i].scaling for i in layers},
        spec_tokens=spec,
        true_tokens=ids[start:],
    )


# --- the task --------------------------------------------------------------------------------------


@dataclass
class HitRateConfig(TaskConfig):
    """Lengths in tokens of the model's tokenizer. See the module docstring for every policy."""

    name: str = "pg19_hitrate"
    version: int = 2
    pg19_book: str = "10146"
    context_length: int = 2048
    windows: int = 4
    decode_positions: int = 32
    sparsities: list = field(default_factory=lambda: [0.005, 0.01, 0.02, 0.05, 0.1])
    primary_sparsity: float = 0.01
    layers: list | None = None
    h2o_recent_ratio: float = 0.5
    spec_bits: float = 1
    spec_group_size: int = 32
    spec_residual: int = 64
    spec_zero_point: str = "specache"

    def __post_init__(self):
        super().__post_init__()
        self.pg19_book = str(self.pg19_book)
        require(self.pg19_book.isdigit(), "task.pg19_book", self.pg19_book, "a Project Gutenberg book number")
        for key in ("context_length", "windows", "decode_positions", "spec_group_size", "spec_residual"):
            value = getattr(self, key)
            require(value > 0, f"task.{key}", value, "a positive int")
        require(
            self.decode_positions < self.context_length,
            "task.decode_positions",
            self.decode_positions,
            f"a positive int below context_length={self.context_length}",
        )
        ok = isinstance(self.sparsities, (list, tuple)) and len(self.sparsities) > 0
        require(ok, "task.sparsities", self.sparsities, "a non-empty list of numbers in (0, 1]")
        for s in self.sparsities:
            require(is_number(s) and 0 < s <= 1, "task.sparsities", s, "every sparsity in (0, 1]")
        self.sparsities = [float(s) for s in self.sparsities]
        keys = [sparsity_key(s) for s in self.sparsities]
        require(len(set(keys)) == len(keys), "task.sparsities", self.sparsities, "distinct values")
        require(
            sparsity_key(self.primary_sparsity) in keys,
            "task.primary_sparsity",
            self.primary_sparsity,
            f"one of the sparsities {keys}",
        )
        if self.layers is not None:
            ok = isinstance(self.layers, (list, tuple)) and len(self.layers) > 0
            ok = (
                ok
                and all(is_int(i) and i >= 0 for i in self.layers)
                and len(set(self.layers)) == len(self.layers)
            )
            require(ok, "task.layers", self.layers, "null (every layer) or a list of distinct layer indices")
            self.layers = sorted(self.layers)
        require(
            0 <= self.h2o_recent_ratio <= 1,
            "task.h2o_recent_ratio",
            self.h2o_recent_ratio,
            "a number in [0, 1]",
        )
        levels_for_bits(self.spec_bits, "task.spec_bits")
        check_choice("task.spec_zero_point", self.spec_zero_point, ZERO_POINTS)
        if self.spec_zero_point == "specache":
            require(
                levels_for_bits(self.spec_bits, "task.spec_bits") == 2,
                "task.spec_zero_point",
                self.spec_zero_point,
                f"specache needs spec_bits=1, got {self.spec_bits}; use minmax",
            )
        require(
            self.spec_residual % self.spec_group_size == 0,
            "task.spec_residual",
            self.spec_residual,
            f"a positive multiple of spec_group_size={self.spec_group_size}",
        )

    def budgets(self) -> list[int]:
        return [budget(s, self.context_length) for s in self.sparsities]


def layer_hit_rates(cap: Captured, layer: int, cfg: HitRateConfig) -> dict[str, torch.Tensor]:
    """Per policy, the hit rates ``[len(sparsities), M, H]`` of one layer (decode positions, heads)."""
    q, keys, scaling = cap.queries[layer], cap.keys[layer], cap.scaling[layer]
    n = keys.shape[1]
    m = cfg.decode_positions
    start = n - m
    ks = cfg.budgets()
    positions = torch.arange(start, n, device=q.device)
    probs = causal_probs(q[:, start:], keys, positions, scaling)  # [H, M, N]
    exact = topk_hit_rates(probs, probs, ks)  # [S, H, M]

    # SpeCache: the speculative query at t scores low-bit stored keys, the exact residual (and the
    # token of the same forward, t-1) and its own key. Per-channel groups are aligned to position 0,
    # so quantizing the longest flushed prefix once gives every shorter prefix's codes as a slice.
    heads = q.shape[0]
    groups = heads // keys.shape[0]
    kivi = {
        "name": "kivi",
        "bits": cfg.spec_bits,
        "group_size": cfg.spec_group_size,
        "residual": cfg.spec_residual,
        "zero_point": cfg.spec_zero_point,
        "fp_dtype": "auto",
        "arithmetic": "fp32",  # SpeCache's low-bit copy: kvbench's affine map, as the specache method
    }
    low, flushed = kivi_lowbit_keys(keys, cap.values[layer], kivi, start)  # flushed: [M]
    sq = cap.spec_queries[layer].float()  # [H, M, D]
    s_low = (sq @ low.repeat_interleave(groups, dim=0).transpose(-1, -2)) * scaling  # [H, M, N]
    s_exact = (sq @ keys.float().repeat_interleave(groups, dim=0).transpose(-1, -2)) * scaling
    own = (sq * cap.spec_keys[layer].float().repeat_interleave(groups, dim=0)).sum(-1) * scaling  # [H, M]
    col = torch.arange(n, device=q.device)[None, :]
    spec_scores = torch.where(col < flushed[:, None], s_low, s_exact)
    spec_scores = torch.where(col == positions[:, None], own[:, :, None], spec_scores)
    spec_scores = spec_scores.masked_fill(col > positions[:, None], float("-inf"))
    spec = topk_hit_rates(probs, spec_scores, ks)  # [S, H, M]

    recents = [recent_size(k, cfg.h2o_recent_ratio) for k in ks]
    h2o = h2o_hit_rates(q, keys, cap.values[layer], scaling, ks, recents, start)  # [S, M, H]
    return {"exact_topk": exact.transpose(1, 2), "h2o": h2o, "specache": spec.transpose(1, 2)}


@register_task("pg19_hitrate")
class PG19HitRate(Task):
    Config = HitRateConfig
    primary_metric = "hit_rate"
    metrics = {
        "hit_rate": Metric(True, "share of the exact top-k attention mass the predicted keys hold"),
        "hit_rates": Metric(True, "hit rate per policy and sparsity"),
    }
    figures = {"hitrate_curves": "kvbench.analysis.hitrate:plot_hitrate"}
    row_dtypes = {"context_length": "Int64"}

    @classmethod
    def planned_samples(cls, config: HitRateConfig) -> int:
        return limited(config.windows, config)

    @classmethod
    def sample_work(cls, config: HitRateConfig) -> Work:
        # every policy is simulated at every measured position and layer: one 2048-token window
        # took ~13 min where its prefill and steps alone price ~10 s
        return Work(config.context_length, config.decode_positions, config.context_length, factor=75.0)

    def __init__(self, config: HitRateConfig, data_root: Path, seed: int = 0):
        super().__init__(config, data_root, seed)
        self._ids: tuple[Any, list[int]] | None = None

    def samples(self) -> list[dict[str, Any]]:
        data_file(self.data_root, "pg19", self.config.pg19_book)  # fail before loading a model
        rows = [{"id": f"w{i}", "window": i} for i in range(self.config.windows)]
        return rows[: self.config.limit] if self.config.limit else rows

    def token_ids(self, tokenizer) -> list[int]:
        if self._ids is None or self._ids[0] is not tokenizer:
            text = load_text(self.data_root, "pg19", self.config.pg19_book)
            self._ids = (tokenizer, encode_text(tokenizer, text))
        return self._ids[1]

    def window(self, tokenizer, i: int) -> list[int]:
        n = self.config.context_length
        return self.token_ids(tokenizer)[i * n : (i + 1) * n]

    def check_model(self, shape, tokenizer) -> None:
        c = self.config
        limit = getattr(shape, "max_context", None)
        if limit and c.context_length > limit:
            raise ConfigError(
                "task.context_length", c.context_length, f"at most the model's {limit}-token context"
            )
        if c.layers is not None and c.layers[-1] >= shape.num_layers:
            raise ConfigError("task.layers", c.layers, f"layer indices in 0..{shape.num_layers - 1}")
        total = len(self.token_ids(tokenizer))
        if c.windows * c.context_length > total:
            raise ConfigError(
                "task.windows",
                c.windows,
                f"book {c.pg19_book} has {total} tokens: at most {total // c.context_length} windows "
                f"of {c.context_length}",
            )

    def run(self, sample: dict[str, Any], runner) -> dict[str, Any]:
        c = self.config
        label = runner.method.label()
        if label != build_method(None).label():  # the baseline the registry builds for no method
            raise ConfigError(
                "method",
                label,
                "fp16 only: pg19_hitrate measures the model's exact attention and never reads "
                "the method's cache",
            )
        shape = runner.shape
        layers = c.layers if c.layers is not None else list(range(shape.num_layers))
        ids = self.window(runner.tokenizer, sample["window"])
        cap = capture(runner.model, ids, c.decode_positions, layers, shape.num_layers)
        keys = [sparsity_key(s) for s in c.sparsities]
        by_layer: dict[str, dict[str, list[float]]] = {p: {k: [] for k in keys} for p in POLICIES}
        for layer in layers:
            rates = layer_hit_rates(cap, layer, c)
            for p in POLICIES:
                means = rates[p].mean(dim=(1, 2))  # over query heads and positions
                for k, v in zip(keys, means.tolist(), strict=True):
                    by_layer[p][k].append(v)
            del cap.queries[layer], cap.keys[layer], cap.values[layer]  # free memory as we go
        hit_rates = {p: {k: sum(v) / len(v) for k, v in by_layer[p].items()} for p in POLICIES}
        agree = sum(a == b for a, b in zip(cap.spec_tokens, cap.true_tokens, strict=True))
        return {
            "prompt_tokens": len(ids),
            "prediction": "",
            "window": sample["window"],
            "context_length": len(ids),
            "decode_positions": c.decode_positions,
            "layers": layers,
            "budgets": dict(zip(keys, c.budgets(), strict=True)),
            "hit_rates": hit_rates,
            "hit_rates_by_layer": by_layer,
            "hit_rate": hit_rates["specache"][sparsity_key(c.primary_sparsity)],
            "spec_token_accuracy": agree / len(cap.true_tokens),
        }

    def aggregate(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Mean over windows of each policy's hit rate at each sparsity; ``hit_rate`` is SpeCache's at
        ``primary_sparsity``. Flat ``hit_rate/<policy>/<sparsity>`` keys carry the same means."""
        rows = [r for r in rows if r.get("hit_rates")]
        out: dict[str, Any] = {"n": len(rows)}
        if not rows:
            out["hit_rate"] = float("nan")
            return out
        table = {
            p: {k: sum(r["hit_rates"][p][k] for r in rows) / len(rows) for k in rows[0]["hit_rates"][p]}
            for p in POLICIES
        }
        out["hit_rate"] = table["specache"][sparsity_key(self.config.primary_sparsity)]
        out["hit_rates"] = table
        for p, per in table.items():
            for k, v in per.items():
                out[f"hit_rate/{p}/{k}"] = v
        out["spec_token_accuracy"] = sum(r["spec_token_accuracy"] for r in rows) / len(rows)
        return out
