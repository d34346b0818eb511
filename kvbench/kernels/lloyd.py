"""KVQuant's codebook fit (:func:`kvbench.quant.nuq.kmeans_1d`) on the compiled CPU kernel
(``kvbench/kernels/cpu/lloyd.cpp``) where it is built, else on the plain-torch reference. The two
give the same bits (``tests/kernels/test_lloyd.py``): the kernel repeats the reference's float32
steps in its order, in one pass per iteration instead of three."""

from __future__ import annotations

import torch

from kvbench.kernels.cpu import cpu_kernels
from kvbench.quant.nuq import kmeans_1d as kmeans_1d_reference
from kvbench.quant.nuq import kmeans_start


def kmeans_1d(values: torch.Tensor, levels: int, iters: int = 100) -> torch.Tensor:
    """Sorted float32 ``[levels]`` signposts of ``values`` (any shape, flattened), as
    :func:`kvbench.quant.nuq.kmeans_1d` computes them."""
    kernels = cpu_kernels()
    v = values.flatten().float().contiguous()
    if (
        kernels is None
        or v.device.type != "cpu"
        or levels < 1
        or v.numel() == 0
        or not torch.isfinite(v).all()
    ):
        return kmeans_1d_reference(values, levels, iters)
    return kernels.lloyd_1d(v, kmeans_start(v, levels).contiguous(), iters)
