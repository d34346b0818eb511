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
- ``h2o``: greedy eviction by accumulated attention (H2O, Zhang et al. 2023, Algorithm 1 plus its
  recent window). The cache is simulated from the window's first token with budget ``k``: each
  query attends the kept entries plus itself, its softmax over that set is added to every kept
  entry's accumulated score, then the lowest-scored entry outside the recent window is evicted for
  good. ``r = max(1, round(h2o_recent_ratio * k))`` of the ``k`` entries are the newest tokens (the
  current one included); the rest are the heavy hitters.
- ``specache``: SpeCache's prediction. The speculative token for position ``t`` is the model's
  greedy prediction there (argmax of the logits at ``t-1``), fed at position ``t`` after the true
  tokens ``0..t-1``. Its post-RoPE query scores the keys, of which the stored part is low-bit: keys
  are quantized per channel in groups of ``G`` tokens (KIVI), with SpeCache's 1-bit zero point
  ``z = (3 min + max) / 4``, ``s = (max - min) / 2`` when asked; as in KIVI the newest tokens sit in
  a full-precision residual, so ``R * floor((t-1) / R)`` keys are low-bit and the token of the same
  forward (``t-1``) and the speculative token's own key are exact. The set is the top-k of those
  scores (SpeCache Algorithm 3, ``ArgTopK(A_{1,:})``); the hit rate is measured on the true query
  ``t``'s full attention (the speculative key at ``t`` stands for the true token's key there).

What is real and what is simulated. Queries and keys are the model's own: one teacher-forced
forward over the window through a capturing kvbench cache (queries arrive post-RoPE, like the
keys), then one single-token forward per decode position for the speculative token, over the same
exact prefix. The policies are then simulated on those tensors, layer by layer. The run's method
cache is never read, so the task accepts only the ``fp16`` method (the label must not suggest a
quantized run). Simplifications against a full SpeCache pipeline, all recorded here: the
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
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvbench.cache import KVBenchCache, KVLayer
from kvbench.config import check_choice, is_int, is_number, require
from kvbench.errors import ConfigError
from kvbench.quant.affine import ZERO_POINTS, dequantize_grouped, levels_for_bits, quantize_grouped
from kvbench.tasks.base import Task, TaskConfig, register_task
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
    scaling: float,
    budgets: list[int],
    recents: list[int],
    start: int,
    block: int = 128,
) -> torch.Tensor:
    """Greedy accumulated-attention eviction (H2O) over a whole window, one query head at a time.

    Args:
        q: ``[H, N, D]`` the queries of every position (post-RoPE).
        keys: ``[H_kv, N, D]``.
        budgets, recents: per budget, ``k`` entries attended by each query (its own key included)
            and ``r`` of them reserved for the newest tokens (``1 <= r <= k``).
        start: first position whose hit rate is returned.

    At position ``t`` the query attends ``kept U {t}`` (``min(t+1, k)`` entries); its softmax over
    that set is added to the accumulated score of each entry; then, while more than ``k - 1``
    entries are kept, the lowest-scored one older than the next step's recent window
    (position ``<= t + 1 - r``) is dropped and never comes back.

    Returns float32 ``[len(budgets), N - start, H]``: the full-attention mass of the attended set.
    """
    heads, n, _ = q.shape
    kr = keys.float().repeat_interleave(heads // keys.shape[0], dim=0)  # [H, N, D]
    nb = len(budgets)
    dev = q.device
    k_cap = torch.tensor(budgets, device=dev)[:, None]  # [S, 1]
    r_lim = torch.tensor(recents, device=dev)[:, None, None]  # [S, 1, 1]
    score = torch.zeros(nb, heads, n, device=dev)
    kept = torch.zeros(nb, heads, n, dtype=torch.bool, device=dev)
    pos = torch.arange(n, device=dev)
    out = torch.empty(nb, n - start, heads, device=dev)
    for b0 in range(0, n, block):
        b1 = min(n, b0 + block)
        logits = (q[:, b0:b1].float() @ kr.transpose(-1, -2)) * scaling  # [H, B, N]
        for t in range(b0, b1):
            row = logits[:, t - b0, : t + 1]  # [H, t+1]
            kept[:, :, t] = True  # the current token is always attended
            mask = kept[:, :, : t + 1]
            attn = torch.softmax(row.masked_fill(~mask, float("-inf")), dim=-1)  # [S, H, t+1]
            score[:, :, : t + 1] += attn
            if t >= start:
                full = torch.softmax(row, dim=-1)
                out[:, t - start] = (full * mask).sum(-1)
            # The cache holds min(t+1, k) entries now; after this step it may keep k - 1, so that
            # the next token brings it back to k.
            evict = (t + 1) > (k_cap[:, 0] - 1)  # [S]
            if t + 2 > min(budgets):  # any budget full (no device sync)
                cand = mask & (pos[: t + 1] <= t + 1 - r_lim)
                victim = score[:, :, : t + 1].masked_fill(~cand, float("inf")).argmin(dim=-1, keepdim=True)
                still = kept.gather(-1, victim) & ~evict[:, None, None]
                kept.scatter_(-1, victim, still)
    return out


def lowbit_keys(
    keys: torch.Tensor, bits: float, group_size: int, zero_point: str, residual: int, stored: int
) -> torch.Tensor:
    """The keys ``[H_kv, N, D]`` as the speculative query sees them when ``stored`` tokens are in the
    cache: the oldest ``R * floor(stored / R)`` (KIVI's flushed part) are quantized per channel in
    groups of ``group_size`` tokens and dequantized; the rest are exact. float32 ``[H_kv, N, D]``."""
    n_q = residual * (stored // residual)
    out = keys.float().clone()
    if n_q:
        levels = levels_for_bits(bits, "task.spec_bits")
        codes, scale, zero = quantize_grouped(keys[:, :n_q], levels, "channel", group_size, zero_point)
        out[:, :n_q] = dequantize_grouped(codes, scale, zero, "channel", group_size)
    return out


# --- capture ----------------------------------------------------------------------------------------


class CaptureLayer(KVLayer):
    """Exact storage (the model's dtype) that records the queries and keys its attention sees, and
    can rewind to any prefix of the tokens it stored in the first forward (so single-token
    speculative forwards can be fed one after another over the same exact prefix)."""

    def __init__(self, layer_idx: int, record: bool):
        super().__init__(layer_idx)
        self.record = record
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.first: tuple[torch.Tensor, torch.Tensor] | None = None
        self.query: torch.Tensor | None = None  # [B, H, q, D] of the last forward
        self.keys: torch.Tensor | None = None  # [B, H_kv, T, D] of the last forward
        self.scaling: float | None = None

    def append(self, keys, values):
        self.k = keys if self.k is None else torch.cat([self.k, keys], dim=-2)
        self.v = values if self.v is None else torch.cat([self.v, values], dim=-2)
        if self.first is None:
            self.first = (self.k, self.v)

    def read(self):
        return self.k, self.v

    def held_tensors(self):
        return {"fp": [t for t in (self.k, self.v) if t is not None]}

    def rewind(self, n: int) -> None:
        """Keep the first ``n`` tokens of the first forward."""
        k, v = self.first
        self.k, self.v, self.num_tokens = k[..., :n, :], v[..., :n, :], n

    def attend(self, module, query, keys, values, attention_mask, **kwargs):
        if self.record:
            self.query, self.keys = query.detach(), keys.detach()
            self.scaling = float(kwargs.get("scaling") or module.scaling)
        return sdpa_attention_forward(module, query, keys, values, attention_mask, **kwargs)


@dataclass
class Captured:
    """One window's tensors for the recorded layers (batch dimension dropped)."""

    queries: dict[int, torch.Tensor]  # layer -> [H, N, D] queries of every position
    keys: dict[int, torch.Tensor]  # layer -> [H_kv, N, D]
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
    when given) fed at ``t`` after the exact keys and values of ``0..t-1``."""
    device = next(model.parameters()).device
    record = set(layers)
    cache = KVBenchCache([CaptureLayer(i, i in record) for i in range(num_layers)])
    n = len(ids)
    start = n - decode
    # Only the logits that predict the decode positions are needed (the full [N, vocab] is large).
    out = model(
        input_ids=torch.tensor([ids], device=device), cache=cache, use_cache=True, logits_to_keep=decode + 1
    )
    spec = out.logits[0, :-1].float().argmax(dim=-1).tolist()  # predictions for start..n-1
    if speculative is not None:
        spec = list(speculative)
    queries = {i: cache.layers[i].query[0] for i in layers}
    keys = {i: cache.layers[i].keys[0] for i in layers}
    scaling = {i: cache.layers[i].scaling for i in layers}
    spec_q: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    spec_k: dict[int, list[torch.Tensor]] = {i: [] for i in layers}
    for j, t in enumerate(range(start, n)):
        for layer in cache.layers:
            layer.rewind(t)
        model(
            input_ids=torch.tensor([[spec[j]]], device=device), cache=cache, use_cache=True, logits_to_keep=1
        )
        for i in layers:
            spec_q[i].append(cache.layers[i].query[0, :, -1])
            spec_k[i].append(cache.layers[i].keys[0, :, -1])
    return Captured(
        queries=queries,
        keys=keys,
        spec_queries={i: torch.stack(spec_q[i], dim=1) for i in layers},
        spec_keys={i: torch.stack(spec_k[i], dim=1) for i in layers},
        scaling=scaling,
        spec_tokens=spec,
        true_tokens=ids[start:],
    )


# --- the task --------------------------------------------------------------------------------------


@dataclass
class HitRateConfig(TaskConfig):
    """Lengths in tokens of the model's tokenizer. See the module docstring for every policy."""

    name: str = "pg19_hitrate"
    version: int = 1
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
            require(is_int(value) and value > 0, f"task.{key}", value, "a positive int")
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
            is_number(self.primary_sparsity) and sparsity_key(self.primary_sparsity) in keys,
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
            is_number(self.h2o_recent_ratio) and 0 <= self.h2o_recent_ratio <= 1,
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
    low = lowbit_keys(keys, cfg.spec_bits, cfg.spec_group_size, cfg.spec_zero_point, cfg.spec_residual, n - 1)
    sq = cap.spec_queries[layer].float()  # [H, M, D]
    s_low = (sq @ low.repeat_interleave(groups, dim=0).transpose(-1, -2)) * scaling  # [H, M, N]
    s_exact = (sq @ keys.float().repeat_interleave(groups, dim=0).transpose(-1, -2)) * scaling
    own = (sq * cap.spec_keys[layer].float().repeat_interleave(groups, dim=0)).sum(-1) * scaling  # [H, M]
    flushed = cfg.spec_residual * ((positions - 1) // cfg.spec_residual)  # [M] low-bit keys at each t
    col = torch.arange(n, device=q.device)[None, :]
    spec_scores = torch.where(col < flushed[:, None], s_low, s_exact)
    spec_scores = torch.where(col == positions[:, None], own[:, :, None], spec_scores)
    spec_scores = spec_scores.masked_fill(col > positions[:, None], float("-inf"))
    spec = topk_hit_rates(probs, spec_scores, ks)  # [S, H, M]

    recents = [recent_size(k, cfg.h2o_recent_ratio) for k in ks]
    h2o = h2o_hit_rates(q, keys, scaling, ks, recents, start)  # [S, M, H]
    return {"exact_topk": exact.transpose(1, 2), "h2o": h2o, "specache": spec.transpose(1, 2)}


@register_task("pg19_hitrate")
class PG19HitRate(Task):
    Config = HitRateConfig
    primary_metric = "hit_rate"

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
            self._ids = (tokenizer, tokenizer.encode(text, add_special_tokens=False))
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
        name = getattr(runner.method, "registered_name", None)
        if name != "fp16" or runner.method.config.sink_tokens:
            raise ConfigError(
                "method",
                name,
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
            del cap.queries[layer], cap.keys[layer]  # free memory as we go
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
