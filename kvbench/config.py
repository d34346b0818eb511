"""Building validated config dataclasses from Hydra nodes.

Every config node (model, task, method) is a dataclass whose ``__post_init__`` validates it. Hydra
composes plain mappings; :func:`build_config` turns one into its dataclass, rejecting unknown keys
with an error that names the key and lists the allowed ones.
"""

from __future__ import annotations

import dataclasses
import difflib
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
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        raise ConfigError(key, data[unknown[0]], unknown_key(unknown[0], names))
    return cls(**data)


def unknown_key(name: str, known) -> str:
    """The ``allowed`` text for a key that does not exist: the closest known key first, since a
    typo (``grop_size``, ``bit``) is the usual cause."""
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"unknown key; {hint}allowed: {', '.join(known)}"


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
