"""Name -> class registries for methods and tasks.

Each method or task module registers itself with a decorator; the runner looks names up here and
never branches on them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from kvbench.errors import ConfigError
from kvbench.paths import safe_component

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        # a registered name is a folder of every run's path (kvbench.spec.run_folder)
        safe_component(f"{self.kind} name", name)

        def decorator(obj: T) -> T:
            if name in self._items:
                raise RuntimeError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = obj
            obj.registered_name = name  # type: ignore[attr-defined]
            return obj

        return decorator

    def get(self, name: str) -> T:
        if name not in self._items:
            raise ConfigError(
                f"{self.kind}.name", name, f"registered {self.kind}s are {', '.join(self.names())}"
            )
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: str) -> bool:
        return name in self._items
