"""The ``model`` config node: which model to load and how, and the committed nodes under
``kvbench/conf/model``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbench import paths
from kvbench.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass
class ModelConfig:
    """Which model to load and how (the Hydra ``model`` node).

    Exactly one weights source: ``path`` (a local Hugging Face folder), ``gguf_package`` + ``gguf_file``
    (a GGUF inside an installed Python package), or ``hub_id``. ``path`` wins over the others when set,
    so ``model.path=/local/copy`` works on top of any node. ``reference_hub_id`` is documentation only:
    where the original (unquantized) weights live. ``resources`` (``gpus``, ``cpus``, ``mem_gb``) is what
    one run asks a Slurm launcher for; it changes no result, so the run id leaves it out.
    """

    name: str
    hub_id: str | None = None
    path: str | None = None
    gguf_package: str | None = None
    gguf_file: str | None = None
    dtype: str = "float32"
    max_context: int | None = None
    weights_note: str = ""
    revision: str | None = None
    reference_hub_id: str | None = None
    resources: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("model.name", self.name, "a non-empty model name")
        if self.dtype not in DTYPES:
            raise ConfigError("model.dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        if self.max_context is not None and (
            isinstance(self.max_context, bool)
            or not isinstance(self.max_context, int)
            or self.max_context <= 0
        ):
            raise ConfigError(
                "model.max_context", self.max_context, "a positive integer, or null for the model's own"
            )
        self._check_resources()
        self._check_source()

    def _check_resources(self) -> None:
        allowed = ("gpus", "cpus", "mem_gb")
        for key, value in (self.resources or {}).items():
            if key not in allowed:
                raise ConfigError(
                    f"model.resources.{key}", value, f"unknown key; allowed: {', '.join(allowed)}"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"model.resources.{key}", value, "a non-negative integer")

    def _check_source(self) -> None:
        """Exactly one weights source, unless ``path`` overrides whatever the node names."""
        if self.path is not None and not str(self.path).strip():
            # `model.path=$MODEL_DIR` with the variable unset: falling back to the node's own source
            # would run a different model than the one asked for
            raise ConfigError(
                "model.path", self.path, "a local model folder, or null for the node's own source"
            )
        if self.path:
            return
        if self.gguf_package and self.hub_id:
            raise ConfigError(
                "model.hub_id",
                self.hub_id,
                f"give either model.gguf_package or model.hub_id, not both ({self.name})",
            )
        if self.gguf_package and not self.gguf_file:
            raise ConfigError(
                "model.gguf_file", self.gguf_file, "the GGUF file name inside model.gguf_package"
            )
        if not (self.gguf_package or self.hub_id):
            raise ConfigError(
                "model.path", self.path, "set one of model.path, model.gguf_package or model.hub_id"
            )

    @property
    def source(self) -> str:
        """The source actually used: ``"path"``, ``"gguf"`` or ``"hub"``."""
        if self.path:
            return "path"
        return "gguf" if self.gguf_package else "hub"


CONF_DIR = paths.CONF_DIR


def model_node(name: str = "smollm2-135m") -> dict[str, Any]:
    """The ``kvbench/conf/model/<name>.yaml`` node as a dict (scripts and tests use the node the
    CLI uses)."""
    import yaml

    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
        raise ConfigError("model", name, f"known model nodes: {known}")
    return yaml.safe_load(path.read_text())
