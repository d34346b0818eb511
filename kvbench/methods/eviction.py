"""What the eviction baselines share: the budget knobs and the matched-memory budget.

``streamingllm``, ``h2o``, ``snapkv`` and ``random_prune`` keep a budget of tokens in ``fp_dtype``
(FP16) and drop the rest (storage and attention in :mod:`kvbench.cache.eviction`). They exist for
SemKV's (arXiv 2608.28911) comparison of token deletion against full-token retention at low
precision at the same memory (contribution 4: "in a matched, in fact less favourable, memory
budget, keeping every token at low precision clearly beats FP16 token pruning").

Knobs common to all four:

- ``budget``: tokens kept per (layer, kv head). An int ``>= 1`` is a token count; a float in
  ``(0, 1]`` is a fraction of the prompt (the first forward), floored, at least 1. ``1`` keeps one
  token; ``1.0`` keeps the whole prompt.
- ``window``: the newest tokens always kept (clipped to the budget).
- ``matched_memory``: ``null``, or a method node such as ``{name: kivi, bits: 2}``. Then ``budget`` is
  ignored and the bytes are matched at the end of the request: the runner says how many tokens a
  request stores after its prompt (:meth:`~kvbench.methods.base.Method.new_request`: a scored
  continuation's length, a generation's ``max_new_tokens - 1``), and at the first forward of a prompt
  of T tokens that method's cache is built for the same shape and fed T tokens, then the N planned
  ones one at a time, as decoding stores them. With ``bytes_l`` what its layer l then holds (read
  from its tensors, not a formula) and ``c_l`` the bytes one kept token costs here (keys, values and
  any per-token score), a policy that evicts while decoding (StreamingLLM, H2O: it holds its budget
  at every step) keeps ``floor(bytes_l / c_l)`` tokens, and a prefill-only policy (SnapKV, random
  pruning: every decoded token is added in FP16) ``floor(bytes_l / c_l) - N``. So when the request
  stores what it planned, the eviction cache ends holding at most the quantized cache's bytes for the
  same tokens and less than one kept token per layer below them: the **tolerance** of the match.
  Matching the prompt alone (the rule before version 2) let a prefill-only policy end a perplexity
  window 8% above KIVI-2's bytes. Each request is checked against that tolerance at its end
  (:meth:`EvictionMethod.end_request`, from the caches' held tensors), and a run whose requests
  missed it (a budget clamped at one token, a generation that stopped early, a prompt shorter than
  the budget) warns with the numbers (:meth:`EvictionMethod.run_warnings`). On the command line:
  ``'method.matched_memory={name:kivi,bits:2}'``.

Sliding-window layers (Gemma-3's local layers) hold their window in full precision as in every
method (:mod:`kvbench.cache.sliding`); the policies evict from the full-attention layers only, and a
matched-memory budget is resolved for those layers alone.

Accounting: bytes come from the kept tensors; ``effective_bits`` and ``compression`` divide by the
*logical* token count, so they compare honestly with the full FP16 cache. Kept tokens per layer and
head: ``bytes_by_component["fp"] / (2 * B * H_kv * D * 2 * num_layers)`` (FP16), or
:func:`kept_tokens` on a cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvbench.cache.accounting import tensor_bytes
from kvbench.cache.eviction import EvictionLayer, budget_tokens
from kvbench.config import build_config, check_choice, is_int, require
from kvbench.methods.base import METHODS, Method, MethodConfig, ModelShape, covers_context

MATCHED_SEED = 0  # keys/values fed to the matched cache: its bytes do not depend on them


@dataclass
class EvictionConfig(MethodConfig):
    budget: Any = 0.25
    window: Any = 32
    matched_memory: dict[str, Any] | None = None

    bits_knob: ClassVar[str | None] = None  # keeps tokens in fp_dtype: the run's bits change nothing
    # 2: a matched-memory budget matches the bytes at the request's end, decoded tokens included
    version: ClassVar[int] = 2

    def __post_init__(self):
        super().__post_init__()
        b = self.budget
        require(
            (is_int(b) and b >= 1) or (isinstance(b, float) and 0 < b <= 1),
            "method.budget",
            b,
            "an int token count >= 1, or a float fraction of the prompt in (0, 1]",
        )
        self.check_window()
        require(
            self.sink_tokens == 0, "method.sink_tokens", self.sink_tokens, "0 (sinks are a policy's own knob)"
        )
        require(
            self.sliding_windows == "full_precision",
            "method.sliding_windows",
            self.sliding_windows,
            "full_precision (kept tokens hold no positions, so no sliding mask applies to them)",
        )
        check_choice("method.backend", self.backend, ("auto", "torch"))
        self.matched_method = None
        if self.matched_memory is not None:
            self.matched_method = build_matched(self.matched_memory)

    def check_window(self) -> None:
        require(is_int(self.window) and self.window >= 0, "method.window", self.window, "an int >= 0")

    def check_model(self, shape: ModelShape) -> None:
        if self.matched_method is not None:
            self.matched_method.config.check_model(shape)

    def context_warnings(self, lengths):
        if self.matched_method is not None:
            return {}  # the budget follows the matched method's bytes, not method.budget
        keep_all = "every token is kept: the cache is the FP16 baseline"
        if isinstance(self.budget, float):
            if self.budget < 1.0:
                return {}
            return {"budget_covers_context": f"method.budget={self.budget:g} is the whole prompt: {keep_all}"}
        return covers_context("budget", self.budget, lengths, keep_all)


def build_matched(node: dict[str, Any]) -> Method:
    """The quantized configuration whose bytes set the budget, validated under
    ``method.matched_memory``."""
    allowed = [n for n in METHODS.names() if not issubclass(METHODS.get(n), EvictionMethod)]
    check_choice("method.matched_memory.name", node.get("name"), allowed)
    cls = METHODS.get(node["name"])
    return cls(build_config(cls.Config, node, "method.matched_memory"))


class EvictionMethod(Method):
    """Builds a policy's layers and resolves their budgets."""

    arm_batch = True

    Config: ClassVar[type[EvictionConfig]] = EvictionConfig
    # the contract reads every token back, so the budget exceeds its 340 tokens (nothing is evicted,
    # FP16 bytes); what the policies keep is tested in tests/methods/test_eviction.py
    contract_node = {"budget": 512}

    def __init__(self, config: EvictionConfig):
        super().__init__(config)
        self.shape: ModelShape | None = None
        self._matched_bytes: dict[tuple, list[int]] = {}
        self.planned = 0  # tokens the current request stores after its prompt
        # per request that missed the tolerance: (held bytes, matched bytes, values) of its layers
        self.misses: list[tuple[int, int, int]] = []
        self.requests = 0

    def new_request(self, new_tokens: int) -> None:
        self.planned = max(0, int(new_tokens))

    def end_request(self, cache) -> None:
        """Check the request's eviction layers against the matched bytes for the tokens they saw."""
        if self.config.matched_method is None:
            return
        layers = [x for x in cache.layers if isinstance(x, EvictionLayer) and x.prompt_len]
        if not layers:
            return
        self.requests += 1
        held = matched = values = 0
        missed = False
        for layer in layers:
            new = layer.num_tokens - layer.prompt_len
            target = self.matched_bytes(layer.prompt_len, layer.batch_size, layer.dtype, layer.device, new)[
                layer.layer_idx
            ]
            mine = sum(tensor_bytes(t) for t in layer.held_tensors().values())
            missed = missed or not 0 <= target - mine < layer.bytes_per_token()
            held, matched = held + mine, matched + target
            values += 2 * layer.batch_size * layer.num_kv_heads * layer.head_dim * layer.num_tokens
        if missed:
            self.misses.append((held, matched, values))

    def run_warnings(self) -> dict[str, str]:
        if not self.misses:
            return {}
        held, matched, values = (sum(m[i] for m in self.misses) for i in range(3))
        other = self.config.matched_method.label()
        return {
            "matched_memory_gap": (
                f"{self.label()}: {len(self.misses)} of {self.requests} requests missed {other}'s bytes "
                f"by more than the tolerance (at most its bytes, less than one kept token per layer "
                f"below): {8 * held / values:.3g} effective bits against {8 * matched / values:.3g} "
                f"({100 * (held / matched - 1):+.1f}% bytes) over those requests"
            )
        }

    def build_layer(self, layer_idx: int, fp_dtype: torch.dtype) -> EvictionLayer:
        raise NotImplementedError

    def make_layer(self, layer_idx, shape, model_dtype):
        self.shape = shape
        return self.build_layer(layer_idx, self.config.torch_fp_dtype(model_dtype))

    def prepare(self, model, tokenizer, shape, data_root) -> None:
        if self.config.matched_method is not None:
            self.config.matched_method.prepare(model, tokenizer, shape, data_root)

    def budget_for(self, layer: EvictionLayer, prompt_len: int) -> int:
        if self.config.matched_method is None:
            return budget_tokens(self.config.budget, prompt_len)
        planned = self.planned
        target = self.matched_bytes(prompt_len, layer.batch_size, layer.dtype, layer.device, planned)
        tokens = target[layer.layer_idx] // layer.bytes_per_token()
        return max(1, tokens if layer.evicts_in_decode else tokens - planned)

    def matched_bytes(
        self, prompt_len: int, batch: int, dtype: torch.dtype, device, new_tokens: int = 0
    ) -> list[int]:
        """Bytes each layer of the matched method's cache holds after a prefill of ``prompt_len``
        tokens and ``new_tokens`` one-token updates, measured on a cache built for this model's
        shape."""
        key = (prompt_len, new_tokens, batch, dtype, str(device))
        if key not in self._matched_bytes:
            s = self.shape
            cache = self.config.matched_method.new_cache(s, dtype)
            gen = torch.Generator().manual_seed(MATCHED_SEED)
            sizes = []
            for layer in cache.layers:
                k, v = torch.randn(
                    2, batch, s.num_kv_heads, prompt_len + new_tokens, s.head_dim, generator=gen
                ).to(device, dtype)
                # no forward follows: the layer's own update, no attention owed to the cache
                layer.update(k[..., :prompt_len, :], v[..., :prompt_len, :])
                for t in range(prompt_len, prompt_len + new_tokens):
                    layer.update(k[..., t : t + 1, :], v[..., t : t + 1, :])
                sizes.append(sum(tensor_bytes(t) for t in layer.held_tensors().values()))
            self._matched_bytes[key] = sizes
        return self._matched_bytes[key]

    def base_label(self) -> str:
        c = self.config
        if c.matched_method is not None:
            return f"{self.registered_name}-mm-{c.matched_method.label()}"
        return f"{self.registered_name}-b{c.budget:g}"


def kept_tokens(cache) -> list[int]:
    """Tokens each layer of an eviction cache holds per kv head (a sliding-window layer: its
    window, which no policy evicts from)."""
    return [
        layer.kept if isinstance(layer, EvictionLayer) else layer.reference_tokens() for layer in cache.layers
    ]
