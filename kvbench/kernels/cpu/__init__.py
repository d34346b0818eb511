"""The compiled CPU backend: C++/OpenMP kernels (``attention.cpp``) that read kvbench's stored
formats in one call per stored part, built on first use and cached.

The extension (``attention.cpp``, ``planes.cpp`` for ReadKV's bit planes, ``sparse.cpp`` for
KVQuant's sparse outliers and ``lloyd.cpp`` for its codebook fit) is compiled with
``torch.utils.cpp_extension.load`` (a C++ compiler and ninja are needed) into
``<cache_dir>/kernels/cpu-<hash>/``, where ``cache_dir`` is kvbench's cache root
(``$KVBENCH_CACHE_DIR``, else ``~/.cache/kvbench``) and the hash covers the sources, the torch and
Python versions and the instruction-set flags, so a changed source or another machine's CPU builds
afresh and a cached build is loaded in well under a second. While it builds, one line says so.

Where the build fails (no compiler, no ninja, a compile error) :func:`cpu_kernels` prints one warning
line, without a traceback, and returns None from then on: callers run the plain-torch reference,
and :func:`backend_in_use` says which one ran, for the run's metrics. ``KVBENCH_CPU_KERNELS=0``
turns the compiled backend off without trying to build it.
"""

from __future__ import annotations

import hashlib
import os
import platform
import time
from pathlib import Path
from types import ModuleType

import torch

from kvbench import atomic
from kvbench.env import get_logger
from kvbench.paths import cache_dir

SOURCES = tuple(
    Path(__file__).with_name(name) for name in ("attention.cpp", "planes.cpp", "sparse.cpp", "lloyd.cpp")
)

_state: dict = {"module": None, "tried": False, "error": None, "used": set()}


def isa_flags() -> list[str]:
    """Compiler flags for the vector units this CPU reports (AVX2, FMA and F16C on x86); the kernels
    have a plain C++ path for anything else."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = set()
    for line in info.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return ["-mavx2", "-mfma", "-mf16c"] if {"avx2", "fma", "f16c"} <= flags else []


def build_dir() -> Path:
    """Where this source, toolchain and CPU's build lives."""
    flags = isa_flags()
    key = "\n".join([*(s.read_text() for s in SOURCES), torch.__version__, platform.python_version(), *flags])
    return cache_dir() / "kernels" / f"cpu-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _build() -> ModuleType:
    from torch.utils.cpp_extension import load

    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    name = "kvbench_cpu_attention"
    if not (where / f"{name}.so").exists():
        get_logger(__name__).info(f"building the CPU attention kernels (once, cached in {where})")
    # Compiled from a copy inside the build folder: the folder is keyed by the source's content,
    # and two checkouts with the same source would otherwise rebuild each other's build (ninja
    # records the source's path).
    copies = []
    for original in SOURCES:
        copy = where / original.name
        if not copy.is_file() or copy.read_bytes() != original.read_bytes():
            atomic.write_bytes(copy, original.read_bytes())  # several processes may start at once
        copies.append(str(copy))
    _clear_stale_lock(where)
    return load(
        name=name,
        sources=copies,
        build_directory=str(where),
        extra_cflags=["-O3", "-fopenmp", *isa_flags()],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


STALE_LOCK_S = 600


def _clear_stale_lock(where: Path) -> None:
    """Remove the build lock a killed build left behind: torch waits on it for ever. A build takes
    about a minute here, so a lock older than :data:`STALE_LOCK_S` has no live owner."""
    lock = where / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        get_logger(__name__).info(f"removing a stale kernel build lock ({lock}, {age:.0f} s old)")
        lock.unlink(missing_ok=True)


def cpu_kernels() -> ModuleType | None:
    """The compiled kernels, built on the first call; None when disabled or when the build failed
    (then one warning line is printed, once)."""
    if _state["tried"]:
        return _state["module"]
    _state["tried"] = True
    if os.environ.get("KVBENCH_CPU_KERNELS", "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    try:
        _state["module"] = _build()
    except Exception as exc:  # noqa: BLE001 - any build failure means: run the reference
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        _state["error"] = first
        get_logger(__name__).warning(
            f"the compiled CPU kernels are unavailable ({first[:200]}); attention runs on the torch reference"
        )
    return _state["module"]


def note_backend(name: str) -> None:
    """Record that a decode read ran on ``name`` (``compiled``, ``torch`` or ``triton``)."""
    _state["used"].add(name)


def backend_in_use() -> str:
    """Which backends read the stored tokens so far in this process, ``+``-joined (``compiled``,
    ``torch``, ``compiled+torch`` when some parts had no kernel), or ``none``."""
    used = _state["used"]
    return "+".join(sorted(used)) if used else "none"


def forget_backends_seen() -> None:
    """Start a fresh record of the backends that read (a script measuring one step of one cache)."""
    _state["used"] = set()


def reset_for_tests() -> None:
    """Forget the build attempt and the backends seen (tests that monkeypatch the build)."""
    _state.update(module=None, tried=False, error=None, used=set())
