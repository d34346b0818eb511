"""The cache-reach probe (kvbench/cache/reach.py): a transformers that drops ``cache=`` is refused
in one line at model load, and every architecture kvbench runs on passes it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kvbench import builder
from kvbench.cache import reach
from kvbench.cache.reach import CacheNotReachedError, check_cache_reached, probe
from kvbench.errors import ConfigError
from tests.tiny_archs import CONFIGS, tiny_model

ROOT = Path(__file__).resolve().parents[2]


def drop_cache_keyword(model: torch.nn.Module) -> torch.nn.Module:
    """A stand-in for transformers 5.17: its decoder takes ``past_key_values``, so ``cache=`` lands
    in ``**kwargs`` unused and the decoder builds a DynamicCache of its own."""
    inner = model.model
    original = inner.forward

    def forward(*args, cache=None, **kwargs):
        return original(*args, **kwargs)

    inner.forward = forward
    return model


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_every_architecture_reaches_the_cache(arch):
    model, shape = tiny_model(arch)
    stored, attended = probe(model, shape.num_layers)
    assert stored == [reach.PROBE_TOKENS] * shape.num_layers
    assert all(attended), attended
    check_cache_reached(model, shape.num_layers)  # no refusal


def test_a_transformers_that_drops_the_cache_is_refused_in_one_line():
    model, shape = tiny_model("llama")
    drop_cache_keyword(model)
    assert probe(model, shape.num_layers) == ([0] * shape.num_layers, [0] * shape.num_layers)
    with pytest.raises(CacheNotReachedError) as err:
        check_cache_reached(model, shape.num_layers)
    text = str(err.value)
    assert isinstance(err.value, ConfigError) and "\n" not in text
    assert text.startswith(f"transformers={reach.transformers_version()!r}: ")
    assert "LlamaForCausalLM" in text and f"transformers{reach.SUPPORTED_TRANSFORMERS}" in text
    assert "stored 0-0 of them per layer" in text and "in 0 of 2 layers" in text


def test_load_for_methods_refuses_before_any_number(monkeypatch):
    model, _ = tiny_model("llama")
    drop_cache_keyword(model)
    monkeypatch.setattr(builder, "load_model", lambda cfg, attn_implementation, device: (model, None))
    with pytest.raises(CacheNotReachedError, match="kvbench's cache was not reached"):
        builder.load_for_methods("smollm2-135m", device="cpu")


def test_the_supported_range_is_the_pin():
    text = (ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"transformers([^"]*)"', text)
    assert pin is not None and pin.group(1) == reach.SUPPORTED_TRANSFORMERS
