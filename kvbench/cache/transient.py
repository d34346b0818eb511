"""Peak transient memory of a piece of work: what a decode step allocates beyond what it reads.

:class:`PeakTransient` is a ``TorchDispatchMode``: every aten op inside it reports its outputs, and
a storage is counted when an op first returns it and released when the tensor that brought it is
garbage collected. An output that shares an input's storage (a view, an in-place op) adds nothing,
so weights and the cache a step reads are not counted; a new copy of them is. It works on any
device, which the CUDA allocator's statistics do not.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakTransient(TorchDispatchMode):
    """``with PeakTransient() as t: step()`` leaves in ``t.peak`` the most bytes held at once by
    storages allocated inside the block."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._counted: set[int] = set()

    def _free(self, ptr: int, nbytes: int) -> None:
        self._counted.discard(ptr)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        known = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if type(t) is torch.Tensor and t.device.type != "meta":
                storage = t.untyped_storage()
                ptr, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and ptr not in known and ptr not in self._counted:
                    self._counted.add(ptr)
                    self.live += nbytes
                    weakref.finalize(t, self._free, ptr, nbytes)
        self.peak = max(self.peak, self.live)
        return out
