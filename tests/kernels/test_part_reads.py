"""The registry of part reads (kvbench/kernels/part_reads.py): every stored part of kvbench.cache
that a backend reads is found by its type, a part with no reads runs its torch reference (refused
by the strict Triton reader). A format added with one registration: test_int8_rows_reads.py."""

from __future__ import annotations

import pytest
import torch

from kvbench.cache.affine_source import PerChannelAffineSource, PerTokenAffineSource
from kvbench.cache.bitplanes import PlaneSource
from kvbench.cache.codebook_source import CodebookSource
from kvbench.cache.fp import FullPrecisionSource
from kvbench.cache.rotated import ChannelSplitSource
from kvbench.cache.source import ConcatSource, RoPESource
from kvbench.kernels.part_reads import BACKENDS, PartReads, reads_for, register_reads

KERNEL_READ = [FullPrecisionSource, PerTokenAffineSource, PerChannelAffineSource, CodebookSource, RoPESource]
# the channel split (TurboQuant's outlier channels) has Triton reads only: on the CPU its torch
# reference reads it
REGISTERED = {"compiled": KERNEL_READ, "triton": [*KERNEL_READ, ChannelSplitSource]}


class _Probe:
    """A part no backend reads."""


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_kernel_read_part_is_registered(backend):
    for part_type in REGISTERED[backend]:
        part = part_type.__new__(part_type)  # the lookup reads the type only
        assert reads_for(part, backend) is not None, f"{part_type.__name__} has no {backend} reads"
    for part_type in (PlaneSource, ConcatSource):  # bit planes: readkv's own reads; concat: flattened
        assert reads_for(part_type.__new__(part_type), backend) is None


def test_registering_other_reads_twice_is_an_error():
    reads = PartReads(scores=lambda reader, part, query: None)
    register_reads(_Probe, "compiled", reads)
    register_reads(_Probe, "compiled", reads)  # the same reads again (a module reloaded): fine
    with pytest.raises(ValueError, match="already has compiled reads"):
        register_reads(_Probe, "compiled", PartReads())
    with pytest.raises(ValueError, match="backend must be"):
        register_reads(_Probe, "cuda", reads)


def test_a_part_without_reads_runs_its_reference_or_is_refused_on_triton(compiled_kernels):
    from kvbench.kernels.cpu.parts import CompiledReader
    from kvbench.kernels.triton_parts import TritonReader, covers

    part, query = _Probe(), torch.zeros(1, 1, 1, 4)
    assert CompiledReader(compiled_kernels).scores(part, query) is None
    assert not covers(part)
    with pytest.raises(NotImplementedError, match="refused on triton"):
        TritonReader(strict=True).mix(part, query)
    assert TritonReader(strict=False).scores(part, query) is None
