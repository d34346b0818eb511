"""Ops and host syncs per decode step (DESIGN.md, Kernels: "a fixed number of calls per layer whatever
the context length, with no host sync"), counted by :mod:`kvbench.kernels.counting` on a tiny random
Llama through ``scripts/count_ops.py``'s own fill and step, for every registered method."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from kvbench.kernels.counting import count_ops
from kvbench.methods import METHODS

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "count_ops.py"
CONTEXTS = (320, 1088)

# Methods whose decode step still syncs on the CPU, and where (none: KVQuant's threshold outliers,
# the last, are appended by one compiled call that reads no count back).
SYNCS_LEFT: dict[str, str] = {}


def load_script():
    spec = importlib.util.spec_from_file_location("count_ops_script", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@functools.cache
def script():
    return load_script()


@functools.cache
def tiny_model():
    torch.set_num_threads(min(2, torch.get_num_threads()))
    return script().build_model(script().TINY)


@functools.cache
def step_counts(name: str, context: int):
    s = script()
    prompt = s.random_prompt(tiny_model(), context, s.WARMUP_STEPS + 1)
    if name == s.REFERENCE:
        return s.count_dynamic(tiny_model(), prompt, sites=True).counts
    return s.count_method(tiny_model(), name, prompt, sites=True).counts


def test_counter_counts_ops_and_each_kind_of_sync():
    x = torch.arange(-3.0, 5.0)
    with count_ops(sites=True) as counts:
        y = x * 2 + 1
        total = y.sum().item()
        where = (y > 0).nonzero()
        picked = y[y > 0]
        listed = y.tolist()
    assert (total, where.shape[0], picked.shape[0], len(listed)) == (16.0, 5, 5, 8)
    assert counts.ops["aten::mul"] == 1 and counts.ops["aten::add"] == 1 and counts.ops["aten::sum"] == 1
    assert counts.syncs == {
        "aten::_local_scalar_dense": 1,
        "aten::nonzero": 1,
        "aten::index (boolean mask)": 1,
        "Tensor.tolist": 1,
    }
    assert counts.total_syncs == 4
    # every sync is traced to this file's line that issued it
    assert all(site.startswith("tests/kernels/test_op_counts.py:") for _, site in counts.sites)


def test_counter_sees_no_sync_in_device_only_work():
    x = torch.randn(4, 8)
    with count_ops() as counts:
        idx = x.abs().topk(2, dim=-1).indices
        x.gather(-1, idx).sum(-1).argmax()
        x.repeat_interleave(torch.tensor([2, 1, 1, 3]), dim=0, output_size=7)
    assert counts.total_syncs == 0
    assert counts.total_ops == sum(counts.ops.values()) >= 6
    with count_ops() as counts:
        x.repeat_interleave(torch.tensor([2, 1, 1, 3]), dim=0)  # sized from the repeats' values
        bool(x[0, 0] > 0)
    assert counts.syncs == {
        "aten::repeat_interleave (tensor repeats, no output_size)": 1,
        "aten::_local_scalar_dense": 1,
    }


def _names():
    return [script().REFERENCE, *METHODS.names()]


def _sync_cases():
    return [
        pytest.param(
            name,
            marks=pytest.mark.xfail(reason=SYNCS_LEFT[name], strict=True) if name in SYNCS_LEFT else (),
        )
        for name in _names()
    ]


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("name", _sync_cases())
def test_decode_step_never_waits_for_the_device(name, context):
    counts = step_counts(name, context)
    assert counts.total_ops > 100  # a real forward of the model was counted
    assert counts.total_syncs == 0, counts.describe_syncs()


@pytest.mark.parametrize("name", _names())
def test_decode_step_ops_do_not_grow_with_the_context(name):
    # totals: a slice that spans a whole tensor dispatches as aten::alias, and which slices do
    # depends on where the doubling buffers stand. The contexts avoid the steps at which a buffer
    # doubles or a group is flushed (amortised work, not per-step work).
    short, long = (step_counts(name, n) for n in CONTEXTS)
    assert short.total_ops == long.total_ops, (short.ops, long.ops)


@pytest.mark.parametrize("name", METHODS.names())
def test_decode_step_ops_are_within_three_times_transformers(name):
    reference = step_counts(script().REFERENCE, CONTEXTS[-1]).total_ops
    ops = step_counts(name, CONTEXTS[-1]).total_ops
    assert ops <= 3 * reference, f"{name}: {ops} ops per step against {reference} for DynamicCache"


@functools.cache
def static_row(name: str, context: int):
    s = script()
    prompt = s.random_prompt(tiny_model(), context, s.WARMUP_STEPS + 2)
    return s.count_static(tiny_model(), name, prompt, sites=True, backend="torch")


@pytest.mark.parametrize("name", [n for n in METHODS.names() if METHODS.get(n).Config.static_step])
def test_static_step_is_fixed_sync_free_and_replayable(name):
    """``scripts/count_ops.py --cuda-graph``: the static step's ops do not depend on the context, it
    never waits, and the step after it is the same device work (what a CUDA graph replays)."""
    short, long = (static_row(name, n) for n in CONTEXTS)
    assert short.counts.total_ops == long.counts.total_ops > 100, (short.counts.ops, long.counts.ops)
    assert short.counts.total_syncs == long.counts.total_syncs == 0, long.counts.describe_syncs()
    assert short.replay == long.replay == "ok"
    assert short.label.endswith(" (static)")
