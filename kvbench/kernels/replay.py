"""Whether a CUDA graph captured over one decode step would compute the next: checked on any machine.

A captured graph replays exactly the device work of the step it recorded: the same operations, on
the same memory, with every host value (a slice bound, a scalar, a kernel's grid) frozen at its
capture-time value. So a step is replayable when the next step, run eagerly, is the same sequence
of operations with the same host values on the same persistent tensors, and makes no host sync (a
sync cannot be captured at all). :func:`trace_step` records, for every aten operation and Triton
launch of a block, its name, its non-tensor arguments, and for every tensor argument its shape,
strides, dtype, device and origin: ``("step", k)`` for memory the block's k-th operation produced
(a graph allocates it from its own pool, at the same place on every replay), ``("held",
data_ptr)`` for memory that existed before the block (weights, cache buffers, the step's input
buffers: replays read and write them in place). Two consecutive steps whose traces are equal
(:func:`first_difference` is None) replay; the usual ways to fail show as a difference: a view
sliced by a host count that grows every step, a buffer reallocated as the cache grows, a grid
sized by the token count, a tensor made from host data inside the step
(``aten::lift_fresh``, an upload a graph would freeze).

The instrument sees what reaches the dispatcher (and Triton's launch entry): a compiled CPU kernel
called through pybind is invisible to it, so a step is traced on the torch or Triton backend.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kvbench.kernels.counting import launch_hook, sync_kind

# Operations that make a tensor from host data inside the step: a graph would replay the upload
# of the capture's values.
HOST_DATA = frozenset({"aten::lift_fresh", "aten::lift_fresh_copy", "aten::lift"})


@dataclass
class StepTrace:
    """What a :func:`trace_step` block did: ``entries`` (one per operation or launch, comparable
    with ``==``), the host syncs and host-data uploads by name."""

    entries: list[tuple] = field(default_factory=list)
    syncs: list[str] = field(default_factory=list)
    uploads: list[str] = field(default_factory=list)
    _made: dict[int, int] = field(default_factory=dict)  # data_ptr -> the operation that made it

    def describe(self, i: int) -> str:
        return repr(self.entries[i]) if 0 <= i < len(self.entries) else "(nothing)"

    # -- recording ------------------------------------------------------------------------------
    def _tensor(self, t: torch.Tensor) -> tuple:
        ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
        origin = ("step", self._made[ptr]) if ptr in self._made else ("held", ptr)
        return (
            "T",
            tuple(t.shape),
            tuple(t.stride()),
            t.storage_offset(),
            str(t.dtype),
            str(t.device),
            origin,
        )

    def _value(self, x):
        if isinstance(x, torch.Tensor):
            return self._tensor(x)
        if isinstance(x, (list, tuple)):
            return tuple(self._value(y) for y in x)
        if isinstance(x, dict):
            return tuple(sorted((k, self._value(v)) for k, v in x.items()))
        if isinstance(x, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout)):
            return x
        if isinstance(x, torch.memory_format):
            return str(x)
        return type(x).__name__

    def _made_by(self, outputs) -> None:
        """Outputs of the latest entry: their memory is the step's from now on, named by that entry
        (the latest one to return it: an address the host allocator hands out again belongs to
        whoever got it last, so the numbering does not depend on which addresses are reused)."""
        k = len(self.entries) - 1
        for t in tree_flatten(outputs)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                ptr = t.untyped_storage().data_ptr()
                if ptr:
                    self._made[ptr] = k

    def launch(self, name: str, grid, args, kwargs) -> None:
        if callable(grid):
            grid = grid(kwargs)
        self.entries.append(
            (f"triton::{name}", self._value(tuple(grid)), self._value(args), self._value(kwargs))
        )


class _Tracer(TorchDispatchMode):
    def __init__(self, trace: StepTrace):
        super().__init__()
        self.trace = trace
        self.launch_depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.launch_depth:
            return func(*args, **kwargs)
        name = func._schema.name
        kind = sync_kind(func, args, kwargs)
        if kind is not None:
            self.trace.syncs.append(kind)
        if name in HOST_DATA:
            self.trace.uploads.append(name)
        # arguments are described before the call: an in-place op's input is what it was handed
        described = (self.trace._value(args), self.trace._value(kwargs))
        out = func(*args, **kwargs)
        self.trace.entries.append((f"{name}.{func._overloadname}", *described))
        self.trace._made_by(out)
        return out


@contextmanager
def trace_step() -> Iterator[StepTrace]:
    """Record the block's operations and launches (see the module docstring)."""
    trace = StepTrace()
    tracer = _Tracer(trace)
    with launch_hook(trace.launch, tracer), tracer:
        yield trace


def first_difference(a: StepTrace, b: StepTrace) -> int | None:
    """The index of the first entry where two traces differ (the shorter one's length when one is
    a prefix of the other), None when they are equal."""
    for i, (x, y) in enumerate(zip(a.entries, b.entries, strict=False)):
        if x != y:
            return i
    return None if len(a.entries) == len(b.entries) else min(len(a.entries), len(b.entries))


def replay_problems(a: StepTrace, b: StepTrace) -> list[str]:
    """Why a graph captured over step ``a`` would not compute step ``b``: one line each (empty when
    it would)."""
    problems = [f"host sync in the step: {s}" for s in dict.fromkeys(a.syncs + b.syncs)]
    problems += [f"tensor made from host data in the step: {u}" for u in dict.fromkeys(a.uploads + b.uploads)]
    i = first_difference(a, b)
    if i is not None:
        problems.append(f"steps differ at operation {i}: {a.describe(i)} then {b.describe(i)}")
    return problems
