"""Tiny random-weight models of several architectures, built from configs (no download, no
tokenizer), and what plain transformers does with them: the references of
tests/test_any_architecture.py and tests/cache/test_sliding.py.

Every model has hidden size 64, a small vocabulary and 2-4 layers, loads with kvbench's attention
implementation, and has no EOS token, so greedy decoding runs for as many steps as asked. Weights
are drawn wider than the usual 0.02 so that greedy choices are not near-ties.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

from kvbench.builder import LoadedModel
from kvbench.cache import use_kvbench_attention
from kvbench.methods import build_method
from kvbench.models import ModelShape
from kvbench.models.shape import shape_of_config

VOCAB = 96
SLIDING_WINDOW = 8
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    max_position_embeddings=1024,
    initializer_range=0.1,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)


def _llama():
    return LlamaConfig(
        **COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64
    )


def _mistral():
    # v0.2/v0.3: no sliding window (v0.1's 4096-token window would make every layer a window layer)
    return MistralConfig(
        **COMMON,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=None,
    )


def _qwen2():
    # four query heads share one KV head; Qwen2 has q/k/v biases
    return Qwen2Config(
        **COMMON, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=64
    )


def _gemma3():
    # local (sliding) and global layers, each type with its own RoPE (Gemma3TextConfig's defaults:
    # theta 10k local, 1M global)
    return Gemma3TextConfig(
        **COMMON,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )


def _head_dim_128():
    return LlamaConfig(
        **COMMON, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=128
    )


CONFIGS = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "gemma3": _gemma3,
    "llama-hd128": _head_dim_128,
}


def _head_dim_256():
    return LlamaConfig(
        **COMMON, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=256
    )


# Shapes that showed a method detail on an unseen model, for the tests of that detail only (every
# method on every architecture runs on CONFIGS alone, to keep the suite fast).
DETAIL_CONFIGS = {"llama-hd256": _head_dim_256, "qwen2-key-outliers": _qwen2}
# Qwen2 with key bias whose first layer's keys are large in a few channels: as on the Qwen2 model
# where TurboQuant-MSE collapsed (key norms ~277 in the first layers, ~17 later). The bias sits in
# the lowest-frequency RoPE pairs, where post-RoPE keys stay nearly constant across a short prompt.
KEY_OUTLIER_CHANNELS = (30, 31, 62, 63)
KEY_OUTLIER_BIAS = (60.0, -45.0, 50.0, -55.0)  # layer-0 key norms ~106 against ~6.4 in layer 1


def _with_key_outliers(model: torch.nn.Module) -> None:
    bias = model.model.layers[0].self_attn.k_proj.bias
    with torch.no_grad():
        bias[list(KEY_OUTLIER_CHANNELS)] = torch.tensor(KEY_OUTLIER_BIAS)


class StubTokenizer:
    """What :class:`kvbench.generate.ModelRunner` asks of a tokenizer when it is handed ids."""

    eos_token_id = None

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(str(i) for i in ids)


def tiny_model(arch: str) -> tuple[torch.nn.Module, ModelShape]:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config({**CONFIGS, **DETAIL_CONFIGS}[arch]()).eval()
    if arch == "qwen2-key-outliers":
        _with_key_outliers(model)
    use_kvbench_attention(model)
    model.generation_config.eos_token_id = None
    return model, shape_of_config(model.config)


def loaded(model: torch.nn.Module, shape: ModelShape) -> LoadedModel:
    """The builder's loaded model for an in-memory model (``LoadedModel.runner`` checks and prepares
    a method on it, as every run does)."""
    return LoadedModel(config=None, model=model, tokenizer=StubTokenizer(), shape=shape, load_s=0.0)


def random_prompt(length: int, seed: int = 1) -> torch.Tensor:
    """``[1, length]`` token ids drawn from the tiny models' vocabulary."""
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def prefilled(model: torch.nn.Module, shape: ModelShape, method_node: dict, ids: torch.Tensor):
    """``(runner, cache, logits)`` after the method of ``method_node`` prefills ``ids`` on ``model``."""
    runner = loaded(model, shape).runner(build_method(method_node))
    cache = runner.new_cache()
    return runner, cache, runner.prefill(ids, cache)


@torch.no_grad()
def plain_kv(model: torch.nn.Module, ids: torch.Tensor) -> DynamicCache:
    """Plain transformers' cache after a forward of ``model`` over ``ids``."""
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, cache=cache, use_cache=True)
    return cache


def cache_bytes(cache: DynamicCache) -> tuple[int, int]:
    """(elements, bytes) of the keys and values a transformers cache holds."""
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    return sum(t.numel() for t in tensors), sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class Reference:
    """Plain transformers (``DynamicCache(config=...)``, SDPA) on one prompt: the greedy tokens,
    the logits that chose each (``[steps, vocab]``: the prefill's last, then each decode step's), and
    the (elements, bytes) its cache held after the prompt plus ``i`` decoded tokens, by ``i``."""

    tokens: list[int]
    logits: torch.Tensor
    held: dict[int, tuple[int, int]]

    def nll(self) -> list[float]:
        """Negative log-likelihoods of the greedy tokens under the logits that chose them."""
        logp = torch.log_softmax(self.logits.float(), dim=-1)
        return [-float(logp[i, t]) for i, t in enumerate(self.tokens)]


@torch.no_grad()
def reference(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> Reference:
    """Greedy decoding of ``steps`` tokens after ``prompt [1, T]``, every chosen token fed back (so
    the cache holds the prompt plus ``steps`` tokens at the end)."""
    cache = DynamicCache(config=model.config)
    # kvbench's attention hands a forward over a non-kvbench cache to SDPA: plain transformers
    logits = model(input_ids=prompt, cache=cache, use_cache=True).logits[0, -1].float()
    held = {0: cache_bytes(cache)}
    tokens, all_logits = [], []
    for i in range(steps):
        all_logits.append(logits)
        tokens.append(int(logits.argmax()))
        logits = (
            model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True).logits[0, -1].float()
        )
        held[i + 1] = cache_bytes(cache)
    return Reference(tokens, torch.stack(all_logits), held)


@torch.no_grad()
def kvbench_logits(runner, prompt: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, object]:
    """The logits a runner's cache gives when ``prompt`` is prefilled and ``tokens`` are fed one by
    one through the method's decode step (``[len(tokens), vocab]``, the prefill's last first), and
    the cache."""
    cache = runner.new_cache()
    out = [runner.forward(prompt, cache)[0, -1]]
    for t in tokens[:-1]:
        out.append(runner.decode_step(torch.tensor([[t]]), cache)[0, -1])
    return torch.stack(out), cache
