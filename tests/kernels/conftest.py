"""Kernel tests run on CUDA when present, else under Triton's CPU interpreter.

``@triton.jit`` picks the interpreter when a kernel module is imported, so the variable is set here,
before any test module in this folder imports ``kvbench.kernels``. An explicit ``TRITON_INTERPRET``
in the environment wins.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def compiled_kernels():
    """The compiled CPU kernel module, or a skip naming why it did not build."""
    from kvbench.kernels import cpu

    module = cpu.cpu_kernels()
    if module is None:
        pytest.skip(f"the compiled CPU kernels did not build here: {cpu._state['error']}")
    return module
