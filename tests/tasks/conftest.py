"""Task-test fixtures built on the session's default model (tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(default_model):
    return default_model[1]


@pytest.fixture(scope="session")
def fp16_runner(default_model):
    """A :class:`ModelRunner` over the default model with the FP16 baseline method."""
    from kvbench.generate import ModelRunner
    from kvbench.methods import build_method

    model, tok, shape = default_model
    return ModelRunner(model, tok, build_method({"name": "fp16"}), shape)
