"""Kernel tests run on CUDA when present, else under Triton's CPU interpreter.

``@triton.jit`` picks the interpreter when a kernel module is imported, so the variable is set here,
before any test module in this folder imports ``kvbench.kernels``. An explicit ``TRITON_INTERPRET``
in the environment wins.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
