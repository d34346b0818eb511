"""Counting the aten operations and host synchronisations of a block of code.

DESIGN.md asks that a decode step be a fixed number of calls per layer whatever the context length,
with no host sync; this is the instrument that checks it, machine-independently. Inside
``with count_ops() as counts:`` every aten operation that reaches the dispatcher is counted by its
schema name (``aten::mm``, ``aten::copy_``, ...), and those that make the host wait for a value
computed on the device are counted again as syncs:

- reading a value: ``_local_scalar_dense`` (``.item()``, ``bool(t)``, ``int(t)``, ``float(t)``),
  ``equal``, ``is_nonzero``, ``item``;
- an output whose size depends on values: ``nonzero``, ``masked_select``, ``unique`` and its
  variants, indexing or ``index_put_`` with a boolean mask, ``repeat_interleave`` with tensor
  repeats and no ``output_size``;
- a blocking device-to-host copy: ``_to_copy``/``copy_`` onto the CPU from another device (not a
  ``non_blocking`` one into pinned memory);
- ``Tensor.tolist()``/``Tensor.numpy()``: on the CPU these read memory without dispatching any aten
  operation, so they are caught one level up (a ``TorchFunctionMode``); whatever they dispatch is
  still counted as operations but not counted twice as syncs.

On the CPU nothing is really waited for, but every one of the above would stall the host on an
accelerator, which is the point of counting them here. A copy to the host of a CPU tensor is free
and dispatches nothing (``.to("cpu")`` returns the tensor itself), so a sync of that kind shows only
on a machine with a device; the value-reading kinds show everywhere.

Only what reaches the dispatcher is counted: work inside one aten kernel is one operation, and an
operation a composite decomposes into is counted in its parts.

Triton launches reach no dispatcher, so a launch inside the block is counted as one operation named
``triton::KERNEL`` (by patching the launch entry of triton's JIT and interpreter functions for the
block's duration, where triton is already imported). Under the CPU interpreter a launch runs its
program instances in Python on the host; what the interpreter dispatches or reads on the way is
its own emulation of the device, not the step's, and is not counted.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# Operations whose result the host reads, or whose output size is data dependent.
VALUE_READS = frozenset(
    {
        "aten::_local_scalar_dense",
        "aten::item",
        "aten::equal",
        "aten::is_nonzero",
        "aten::nonzero",
        "aten::masked_select",
        "aten::unique",
        "aten::_unique",
        "aten::_unique2",
        "aten::unique_dim",
        "aten::unique_consecutive",
        "aten::unique_dim_consecutive",
    }
)
# Tensor methods that read values on the host without reaching the dispatcher on the CPU.
HOST_READS = ("tolist", "numpy", "__array__")

_TORCH_ROOT = str(Path(torch.__file__).resolve().parent)
_HERE = str(Path(__file__).resolve())


@dataclass
class OpCounts:
    """What a :func:`count_ops` block dispatched: ``ops`` and ``syncs`` by name (a sync is counted
    in both), and, with ``sites``, where each sync was issued (the innermost frame outside torch)."""

    ops: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    sites: Counter = field(default_factory=Counter)

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    @property
    def total_syncs(self) -> int:
        return sum(self.syncs.values())

    def describe_syncs(self) -> str:
        """One line per (sync, site), most frequent first; empty when there were none."""
        return "\n".join(f"{n} x {name} at {site}" for (name, site), n in self.sites.most_common())


def _is_cpu(device) -> bool:
    return device is not None and torch.device(device).type == "cpu"


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def sync_kind(func, args: tuple, kwargs: dict) -> str | None:
    """Why the aten operation ``func`` applied to ``args``/``kwargs`` makes the host wait, or None."""
    name = func._schema.name
    if name in VALUE_READS:
        return name
    if name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
        if _bool_index(args[1] if len(args) > 1 else kwargs.get("indices")):
            return f"{name} (boolean mask)"
    if name == "aten::repeat_interleave" and func._overloadname == "Tensor":
        # the overload that sizes its output from the repeats (the others decompose into it)
        output_size = args[1] if len(args) > 1 else kwargs.get("output_size")
        if output_size is None:
            return f"{name} (tensor repeats, no output_size)"
    # a non-blocking copy to the host does not wait: _to_copy pins its output for it, and copy_ is
    # asynchronous only into pinned memory
    if name == "aten::_to_copy":
        src = args[0]
        off_device = isinstance(src, torch.Tensor) and src.device.type != "cpu"
        if _is_cpu(kwargs.get("device")) and off_device and not kwargs.get("non_blocking", False):
            return f"{name} (device to host)"
    if name == "aten::copy_":
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        if isinstance(src, torch.Tensor) and dst.device.type == "cpu" and src.device.type != "cpu":
            if not (non_blocking and dst.is_pinned()):
                return f"{name} (device to host)"
    return None


def _site() -> str:
    """The innermost caller outside torch and this module, as ``path:line (function)``."""
    for frame in reversed(traceback.extract_stack()):
        path = str(Path(frame.filename).resolve())
        if path == _HERE or path.startswith(_TORCH_ROOT):
            continue
        return f"{_short(path)}:{frame.lineno} ({frame.name})"
    return "?"


def _short(path: str) -> str:
    """``path`` from its innermost known folder on: a checkout may itself be named ``kvbench``
    (``/src/kvbench/tests/x.py`` is ``tests/x.py``, ``/src/kvbench/kvbench/y.py`` is ``kvbench/y.py``)."""
    parts = Path(path).parts
    anchors = [i for i, part in enumerate(parts) if part in ("kvbench", "transformers", "scripts", "tests")]
    return "/".join(parts[anchors[-1] :]) if anchors else path


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counts: OpCounts, sites: bool):
        super().__init__()
        self.counts, self.sites = counts, sites
        self.host_read_depth = 0  # inside a tolist()/numpy() already counted as one sync
        self.launch_depth = 0  # inside a Triton launch, counted as one operation

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.launch_depth:
            return func(*args, **kwargs)
        name = func._schema.name
        self.counts.ops[name] += 1
        if not self.host_read_depth:
            kind = sync_kind(func, args, kwargs)
            if kind is not None:
                self.counts.syncs[kind] += 1
                if self.sites:
                    self.counts.sites[(kind, _site())] += 1
        return func(*args, **kwargs)


class _HostReadCounter(TorchFunctionMode):
    def __init__(self, counts: OpCounts, dispatch: _DispatchCounter, sites: bool):
        super().__init__()
        self.counts, self.dispatch, self.sites = counts, dispatch, sites

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (
            self.dispatch.launch_depth
            or name not in HOST_READS
            or not args
            or not isinstance(args[0], torch.Tensor)
        ):
            return func(*args, **kwargs)
        kind = f"Tensor.{name}"
        self.counts.syncs[kind] += 1
        if self.sites:
            self.counts.sites[(kind, _site())] += 1
        self.dispatch.host_read_depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.dispatch.host_read_depth -= 1


@contextmanager
def count_ops(sites: bool = False) -> Iterator[OpCounts]:
    """Count the aten operations and host syncs of the block (see the module docstring). ``sites``:
    also record where every sync was issued (a stack walk per sync; for diagnosis)."""
    counts = OpCounts()
    dispatch = _DispatchCounter(counts, sites)
    with _counting_launches(counts, dispatch), _HostReadCounter(counts, dispatch, sites), dispatch:
        yield counts


def _launch_classes() -> list[type]:
    """The classes whose ``run`` launches a Triton kernel, where triton is already imported (a block
    that imports it for the first time cannot have been launching before)."""
    import sys

    classes = []
    jit = sys.modules.get("triton.runtime.jit")
    if jit is not None:
        classes.append(jit.JITFunction)
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if interpreter is not None:
        classes.append(interpreter.InterpretedFunction)
    return classes


@contextmanager
def launch_hook(on_launch, holder) -> Iterator[None]:
    """For the block, every top-level Triton launch (not a warm-up, not one inside another) first
    calls ``on_launch(kernel_name, grid, args, kwargs)``, then runs with ``holder.launch_depth``
    raised, so that a dispatch mode reading it can leave alone what the launch dispatches (the
    interpreter's emulation of the device)."""
    patched = [(cls, cls.__dict__["run"]) for cls in _launch_classes() if "run" in cls.__dict__]

    def wrap(run):
        def hooked(self, *args, grid, warmup, **kwargs):
            if warmup or holder.launch_depth:
                return run(self, *args, grid=grid, warmup=warmup, **kwargs)
            on_launch(getattr(self, "__name__", "?"), grid, args, kwargs)
            holder.launch_depth += 1
            try:
                return run(self, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                holder.launch_depth -= 1

        return hooked

    for cls, run in patched:
        cls.run = wrap(run)
    try:
        yield
    finally:
        for cls, run in patched:
            cls.run = run


def _counting_launches(counts: OpCounts, dispatch: _DispatchCounter):
    def count(name, grid, args, kwargs):
        counts.ops[f"triton::{name}"] += 1

    return launch_hook(count, dispatch)
