"""Whether the Triton kernels under :mod:`kvbench.kernels` can run here.

They run on a CUDA device, or on the CPU under Triton's interpreter. The interpreter is chosen when a
kernel is *decorated* (``@triton.jit`` reads ``TRITON_INTERPRET`` then), so the variable must be set
before the kernel modules are first imported; set it before triton itself is imported to be safe.

Nothing here imports triton at module level: kvbench's torch path may import this module freely.
"""

from __future__ import annotations

import contextlib
import functools
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
    return torch.cuda.is_available() or interpreting() or planning_cuda()


def require_triton(key: str = "method.backend") -> None:
    """Raise :class:`ConfigError` naming ``key`` unless :func:`triton_available`."""
    if not triton_available():
        raise ConfigError(
            key,
            "triton",
            "needs a CUDA device, or TRITON_INTERPRET=1 set before triton is imported "
            "(CPU interpreter, slow)",
        )


# -- the CUDA launch plan away from a GPU ---------------------------------------------------------
# The kernels' host code picks block sizes and split counts for a CUDA device ("the launch plan")
# and small, few programs for the interpreter. kvbench.kernels.compile_check traces the launches of
# the CUDA plan on a machine without a GPU, to compile exactly those specializations for sm_90 and
# sm_80; inside :func:`cuda_launch_plan` the host code plans as on a device with that many SMs.
_PLANNED_SMS: list[int] = []


@contextlib.contextmanager
def cuda_launch_plan(sm_count: int = 132):
    """Within the block, :func:`plans_for_cuda` is true and :func:`sm_count` is ``sm_count`` (an
    H100/H200 has 132), whatever the tensors' device."""
    if sm_count < 1:
        raise ValueError(f"sm_count must be >= 1, got {sm_count}")
    _PLANNED_SMS.append(sm_count)
    try:
        yield
    finally:
        _PLANNED_SMS.pop()


def planning_cuda() -> bool:
    """Whether a :func:`cuda_launch_plan` block is open (kernel wrappers then accept CPU tensors:
    their launches are traced, not run)."""
    return bool(_PLANNED_SMS)


def plans_for_cuda(device: torch.device) -> bool:
    """Whether launches on ``device`` take the CUDA plan: a CUDA device outside the interpreter, or
    anything inside :func:`cuda_launch_plan`."""
    return bool(_PLANNED_SMS) or (device.type == "cuda" and not interpreting())


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (or of :func:`cuda_launch_plan`'s device)."""
    if _PLANNED_SMS:
        return _PLANNED_SMS[-1]
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)


# Level counts whose packed reads gave wrong numbers on a GPU: 5-, 6- and 7-bit codes of the
# LSB-first bit stream (a code may straddle two bytes). On the lent H200 (triton 3.6, sm_90), the
# part reader and the fused decode kernel read them wrongly in some launch shapes (relative errors
# 0.3-1.2 against the torch reference: per-channel parts at head_dim 128 with token blocks of 64,
# the fused kernel at head_dim 64), while the interpreter reads them exactly, so the CPU tests could
# not see it. 3-bit codes (L=8) failed the same way until the second byte was read from an address
# chosen per lane instead of through a mask (decode_attention._unpack_tile); that read was checked
# on the device. These three are not: on a CUDA device the Triton readers refuse them (backend=auto
# reads them with torch) until a device run shows them exact.
GPU_UNCHECKED_LEVELS = frozenset({32, 64, 128})


def gpu_reads_levels(levels: int, device: torch.device) -> bool:
    """Whether the Triton readers read ``levels``-level packed codes on ``device``: everywhere but
    :data:`GPU_UNCHECKED_LEVELS` under the CUDA plan (a device, or :func:`cuda_launch_plan`)."""
    return not (levels in GPU_UNCHECKED_LEVELS and plans_for_cuda(device))


def refuse_unchecked_levels(levels: int, device: torch.device, where: str) -> None:
    """NotImplementedError naming ``where`` and ``levels`` unless :func:`gpu_reads_levels`."""
    if not gpu_reads_levels(levels, device):
        bits = levels.bit_length() - 1
        raise NotImplementedError(
            f"{where}: {bits}-bit codes (levels={levels}) are not read by Triton on CUDA (wrong on "
            f"the H200 check, see kvbench.kernels.runtime.GPU_UNCHECKED_LEVELS); use backend=auto or "
            f"torch, or levels outside {sorted(GPU_UNCHECKED_LEVELS)}"
        )


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def interpreter_numpy_compat() -> None:
    """Let Triton's interpreter of triton < 3.7 run under numpy >= 2.4 (called at import by every
    kernel module; does nothing outside the interpreter, and once).

    Those interpreters turn a scalar tensor into a Python int with ``int(data)`` where ``data`` is a
    one-element numpy array of shape ``(1,)``; numpy 2.4 made that a TypeError ("only 0-dimensional
    arrays can be converted to Python scalars"), so every kernel that loops over ``range(<int
    argument>)`` failed. Later interpreters take ``int(data.squeeze())``, which this installs.
    """
    if not interpreting():
        return
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "kvbench_numpy_compat", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        # the scope restores attributes in reverse order, so this one goes first on restore
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.kvbench_numpy_compat = True
    interpreter._patch_lang_tensor = patched
