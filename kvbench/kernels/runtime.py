"""Whether the Triton kernels under :mod:`kvbench.kernels` can run here.

They run on a CUDA device, or on the CPU under Triton's interpreter. The interpreter is chosen when a
kernel is *decorated* (``@triton.jit`` reads ``TRITON_INTERPRET`` then), so the variable must be set
before the kernel modules are first imported; set it before triton itself is imported to be safe.

Nothing here imports triton at module level: kvbench's torch path may import this module freely.
"""

from __future__ import annotations

import importlib.util

import torch

from kvbench.env import env_flag
from kvbench.errors import ConfigError

INTERPRET_ENV = "TRITON_INTERPRET"


def interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (the spellings triton's own
    parsing takes as yes); a value that is neither yes nor no is a ConfigError naming it."""
    return env_flag(INTERPRET_ENV)


def triton_available() -> bool:
    """True when triton is importable and either a CUDA device is present or the interpreter is on."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or interpreting()


def require_triton(key: str = "method.backend") -> None:
    """Raise :class:`ConfigError` naming ``key`` unless :func:`triton_available`."""
    if not triton_available():
        raise ConfigError(
            key,
            "triton",
            "needs a CUDA device, or TRITON_INTERPRET=1 set before triton is imported "
            "(CPU interpreter, slow)",
        )
