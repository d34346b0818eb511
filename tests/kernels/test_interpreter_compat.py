"""kvbench.kernels.runtime.interpreter_numpy_compat: Triton < 3.7's interpreter under numpy >= 2.4.

Those interpreters index with ``int(data)`` on a one-element array of shape ``(1,)``, which numpy 2.4
refuses; every kernel looping over ``range(<int argument>)`` then fails (the lent GPU machine's image
has triton 3.6 and numpy 2.5, so its dry check did). The patch makes it ``int(data.squeeze())``.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvbench.kernels import decode_attention  # noqa: F401 - imports install the patch
from kvbench.kernels.runtime import interpreting


@pytest.mark.skipif(not interpreting(), reason="the patch applies under TRITON_INTERPRET=1 only")
def test_scalar_tensors_index_from_one_element_arrays():
    from triton.runtime import interpreter

    assert getattr(interpreter._patch_lang_tensor, "kvbench_numpy_compat", False)

    class Handle:
        data = np.array([7], dtype=np.int32)

    class Tensor:
        handle = Handle()

    scope = interpreter._LangPatchScope()
    interpreter._patch_lang_tensor(Tensor, scope)
    try:
        assert list(range(Tensor())) == list(range(7))  # __index__ on a shape-(1,) array
    finally:
        scope.restore()
    assert not hasattr(Tensor, "__index__")  # restored: nothing leaks past the kernel's run
