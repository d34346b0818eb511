"""Tasks. Every module in this package registers itself on import."""

import importlib
import pkgutil

from kvbench.tasks.base import (
    TASKS,
    Metric,
    Task,
    TaskConfig,
    Work,
    build_task,
    declared_metric,
    declared_row_dtypes,
    register_task,
)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "TASKS",
    "Metric",
    "Task",
    "TaskConfig",
    "Work",
    "build_task",
    "declared_metric",
    "declared_row_dtypes",
    "register_task",
]
