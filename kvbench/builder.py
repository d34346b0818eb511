"""The run builder: a model config and a method become a :class:`kvbench.generate.ModelRunner`
(model, tokenizer, method, and the method's cache factory, ``ModelRunner.new_cache``).

Every path that loads a model to run a method goes through here (the CLI run in :mod:`kvbench.run`,
the lm-eval adapter when lm-eval builds it from ``model_args``, the scripts), so each gets the same
model on the same attention implementation and the same method checks and preparation. Two steps, so
that a script comparing methods on one model loads it once:

1. :func:`load_for_methods`: the model and tokenizer, loaded with kvbench's attention implementation
   (registered here, :func:`kvbench.cache.register_attention`; methods read their storage through it) in the
   model config's dtype on a device, and the model's shape (the config's ``max_context`` wins).
2. :meth:`LoadedModel.runner`: the method's checks against that shape (and a task's, when given),
   then the method's one-time :meth:`~kvbench.methods.Method.prepare` (offline calibration, forward
   hooks) with the data root, then the runner.

:func:`build_runner` does both from names and nodes, with the run's top-level ``bits`` passed to the
method (:func:`kvbench.methods.base.with_run_bits`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvbench.cache import register_attention
from kvbench.cache.reach import check_cache_reached
from kvbench.config import build_config
from kvbench.data import resolve_data_root
from kvbench.generate import ModelRunner
from kvbench.methods import Method, ModelShape, build_method
from kvbench.models import ModelConfig, load_model, model_node, model_shape


def resolve_device(device: str) -> str:
    """``auto`` is CUDA where a device is visible, else the CPU; any other name is kept."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def model_config(model: ModelConfig | dict[str, Any] | str) -> ModelConfig:
    """A validated :class:`ModelConfig` from itself, a ``model`` node, or a ``conf/model`` name."""
    if isinstance(model, ModelConfig):
        return model
    node = model_node(model) if isinstance(model, str) else model
    return build_config(ModelConfig, node, "model")


@dataclass
class LoadedModel:
    """A model ready for any method: weights on their device, tokenizer, shape, load time (s)."""

    config: ModelConfig
    model: torch.nn.Module
    tokenizer: Any
    shape: ModelShape
    load_s: float

    def runner(self, method: Method, data_root: Path | str | None = None, task: Any = None) -> ModelRunner:
        """``method`` checked against the model (``task`` too, when given: a
        :class:`kvbench.tasks.Task` whose checks have not run on the model's files yet) and prepared;
        ``data_root`` is where a calibrating method reads its data (None: ``KVBENCH_DATA_DIR`` or the
        default, as :func:`kvbench.data.resolve_data_root` says)."""
        method.config.check_model(self.shape)
        method.config.check_static_model(self.shape)
        if task is not None:
            task.check_model(self.shape, self.tokenizer)
        method.prepare(self.model, self.tokenizer, self.shape, resolve_data_root(data_root))
        return ModelRunner(self.model, self.tokenizer, method, self.shape)


def load_for_methods(model: ModelConfig | dict[str, Any] | str, device: str = "auto") -> LoadedModel:
    """Load ``model`` (a config, a node or a ``conf/model`` name) on ``device`` (``auto``, ``cpu``,
    ``cuda``) with kvbench's attention implementation; a model whose forward does not reach
    kvbench's cache (another transformers release) is refused
    (:func:`kvbench.cache.reach.check_cache_reached`)."""
    cfg = model_config(model)
    t0 = time.perf_counter()
    loaded, tokenizer = load_model(
        cfg, attn_implementation=register_attention(), device=resolve_device(device)
    )
    load_s = time.perf_counter() - t0
    shape = model_shape(loaded, cfg.max_context)
    # refuse, in one line, a transformers that does not hand kvbench's cache to the layers
    check_cache_reached(loaded, shape.num_layers)
    return LoadedModel(cfg, loaded, tokenizer, shape, load_s)


# The model the last run of this process loaded, for the next run of the same model (see load_kept).
_KEPT: dict[str, LoadedModel] = {}


def load_kept(model: ModelConfig | dict[str, Any] | str, device: str = "auto") -> tuple[LoadedModel, bool]:
    """:func:`load_for_methods`, keeping the model for the next call with the same model: the runs
    of a sweep in one process (a Hydra multirun on the basic launcher, a node of
    ``kvbench.reproduce``) load the model once. Returns ``(loaded, reused)``.

    One model is kept at a time (a sweep over models holds one in memory, not all). The key is
    everything that decides the weights: the model config, the device and kvbench's cache folder
    (where a GGUF is converted). Reuse changes nothing a run computes: the model is in eval mode and
    its weights are never written; what a method attaches to it (forward hooks) it detaches at the
    end of its run (:meth:`kvbench.methods.Method.release`)."""
    from dataclasses import asdict

    from kvbench import paths
    from kvbench.results import canonical_json

    cfg = model_config(model)
    key = canonical_json([asdict(cfg), resolve_device(device), str(paths.cache_dir())])
    if key in _KEPT:
        return _KEPT[key], True
    _KEPT.clear()  # the previous model goes before the next one loads
    loaded = load_for_methods(cfg, device)
    _KEPT[key] = loaded
    return loaded, False


def build_runner(
    model: ModelConfig | dict[str, Any] | str,
    method: Method | dict[str, Any] | None = None,
    bits: float | None = None,
    device: str = "auto",
    data_root: Path | str | None = None,
) -> ModelRunner:
    """One step: load ``model``, build ``method`` (an object, a ``method`` node, or None for the
    FP16 baseline; a node gets the run's ``bits`` where its bits knob is unset) and prepare it."""
    if not isinstance(method, Method):
        method = build_method(method, bits=bits)
    return load_for_methods(model, device).runner(method, data_root)
