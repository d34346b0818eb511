"""Building validated config dataclasses from Hydra nodes.

Every config node (model, task, method) is a dataclass whose ``__post_init__`` validates it. Hydra
composes plain mappings; :func:`build_config` turns one into its dataclass, rejecting unknown keys
with an error that names the key and lists the allowed ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

from kvbench.errors import ConfigError

C = TypeVar("C")

DTYPES = ("float16", "bfloat16", "float32")


def to_plain(node: Any) -> Any:
    """OmegaConf node -> plain Python containers (identity for plain data)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(node, (DictConfig, ListConfig)):
            return OmegaConf.to_container(node, resolve=True)
    except ImportError:  # pragma: no cover - omegaconf ships with hydra
        pass
    return node


def build_config(cls: type[C], node: Mapping[str, Any] | None, prefix: str) -> C:
    """``cls(**node)`` with unknown keys reported as ``prefix.key``."""
    data = dict(to_plain(node) or {})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(
            f"{prefix}.{unknown[0]}", data[unknown[0]], f"unknown key; allowed: {', '.join(sorted(names))}"
        )
    return cls(**data)


def is_int(x: Any) -> bool:
    """An integer that is not a bool (YAML ``true`` must not pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def require(condition: bool, key: str, value: Any, allowed: str) -> None:
    """Validation one-liner for ``__post_init__``."""
    if not condition:
        raise ConfigError(key, value, allowed)


def check_choice(key: str, value: Any, choices) -> None:
    require(value in choices, key, value, f"allowed: {', '.join(map(str, choices))}")
