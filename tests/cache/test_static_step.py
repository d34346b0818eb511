"""The static decode step (``method.cuda_graph``, kvbench/cache/static.py): the same tokens, logits
and held bytes as the growing cache, and two consecutive steps that are the same device work on the
same tensors with no host sync, which is what a CUDA graph captured over one step needs to compute
the next (kvbench/kernels/replay.py). The capture itself needs CUDA: scripts/gpu_check.py runs it
there."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_archs import VOCAB, loaded, tiny_model

from kvbench.cache import memory_report
from kvbench.cache.growable import GrowableTokens
from kvbench.cache.static import StaticStep
from kvbench.errors import ConfigError
from kvbench.kernels.replay import first_difference, replay_problems, trace_step
from kvbench.methods import build_method

PROMPT = 37
STEPS = 12
NODES = {
    "fp16": {"name": "fp16"},
    "uniform-2": {"name": "uniform", "bits": 2},
    "uniform-2.585": {"name": "uniform", "bits": 2.585, "group_size": 16},
    "uniform-1-specache": {"name": "uniform", "bits": 1, "zero_point": "specache"},
    "turboquant-2": {"name": "turboquant", "bits": 2},
    "turboquant-split": {"name": "turboquant", "bits": 2, "outlier_channels": 4},
    # the prompt leaves 5 keys in the ring, so a flush comes at the third step
    "kivi-r8": {"name": "kivi", "bits": 2, "residual": 8, "group_size": 4},
    # the value window fills (37 + 3 = 40) during the run: values start being quantized
    "kivi-r40": {"name": "kivi", "bits": 2, "residual": 40, "group_size": 8},
    "kivi-fp32": {"name": "kivi", "bits": 3, "residual": 8, "group_size": 8, "arithmetic": "fp32"},
}


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def prompt() -> torch.Tensor:
    return torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))


def runner(llama, node):
    model, shape = llama
    return loaded(model, shape).runner(build_method(node))


def static_after_prefill(llama, node, capacity=PROMPT + STEPS + 2):
    r = runner(llama, {**node, "cuda_graph": True})
    cache = r.new_cache()
    cache.reserve(capacity)
    logits = r.forward(prompt(), cache)
    return r, cache, logits, StaticStep(r._static_forward(cache), cache, PROMPT, r.device, capture=False)


def without_reserve(memory):
    return dataclasses.replace(memory, reserved_bytes=0)


@pytest.mark.parametrize("backend", ["torch", "auto"])
@pytest.mark.parametrize("case", sorted(NODES))
def test_static_step_equals_the_growing_cache(llama, case, backend):
    node = {**NODES[case], "backend": backend}
    dynamic = runner(llama, node)
    d_cache = dynamic.new_cache()
    d_logits = dynamic.forward(prompt(), d_cache)
    _, s_cache, s_logits, step = static_after_prefill(llama, node)
    torch.testing.assert_close(s_logits, d_logits, rtol=0, atol=0)  # the prefill reads no store
    for i in range(STEPS):
        token = int(d_logits[0, -1].argmax())
        assert int(s_logits[0, -1].argmax()) == token, f"step {i}"
        d_logits = dynamic.forward(torch.tensor([[token]]), d_cache)
        s_logits = step(token)
        torch.testing.assert_close(s_logits, d_logits, rtol=1e-5, atol=5e-5)
    # same tokens held, same bytes; only the reservation differs (the capacity, not doubling)
    d_layer, s_layer = d_cache.layers[0], s_cache.layers[0]
    assert s_layer.num_tokens == d_layer.num_tokens == PROMPT + STEPS
    d_mem, s_mem = memory_report(d_cache.layers), memory_report(s_cache.layers)
    assert without_reserve(s_mem) == without_reserve(d_mem)
    # reserved: the capacity of every store (turboquant also holds a seed and channel sets)
    held = sum(
        t.numel() * t.element_size() for x in s_cache.layers for ts in x.held_tensors().values() for t in ts
    )
    if case.startswith(("fp16", "uniform")):
        assert s_mem.reserved_bytes * (PROMPT + STEPS) == held * (PROMPT + STEPS + 2)
    else:
        assert s_mem.reserved_bytes > held * (PROMPT + STEPS) / (PROMPT + STEPS + 2)


@pytest.mark.parametrize("case", sorted(NODES))
def test_generate_with_cuda_graph_flag(llama, case):
    """``method.cuda_graph=true`` through the runner's own loop (the CPU runs the static step
    eagerly and says so): the tokens of the growing cache."""
    want = runner(llama, NODES[case]).generate(prompt(), STEPS)
    got = runner(llama, {**NODES[case], "cuda_graph": True}).generate(prompt(), STEPS)
    assert got.token_ids == want.token_ids
    assert without_reserve(got.memory) == without_reserve(want.memory)
    assert got.extra == {"decode_step": "static"} and want.extra == {}


def traced_steps(step, cache, steps=STEPS - 2):
    """Trace the device work of every step after one untraced one: ``{kind: [traces]}``."""
    step(5)
    traces: dict[tuple, list] = {}
    for i in range(steps):
        step.input_ids.fill_((7 + 11 * i) % VOCAB)  # outside the graph: the step's input
        kind = cache.step_kind()
        with trace_step() as trace:
            step.body()
        cache.advance(1)
        traces.setdefault(kind, []).append(trace)
    return traces


@pytest.mark.parametrize("case", sorted(NODES))
def test_a_captured_step_would_replay_the_next_of_its_kind(llama, case):
    _, cache, _, step = static_after_prefill(llama, {**NODES[case], "backend": "torch"})
    traces = traced_steps(step, cache)
    compared = 0
    for kind, (first, second, *_) in ((k, t) for k, t in traces.items() if len(t) > 1):
        assert replay_problems(first, second) == [], kind
        assert not first.syncs and not first.uploads
        assert len(first.entries) > 100  # the whole forward was seen
        compared += 1
    # KIVI's steps with a key flush replay each other, and those without
    assert compared == (2 if case == "kivi-r8" or case == "kivi-fp32" else 1)


def test_the_growing_cache_would_not_replay(llama):
    """The instrument's negative control: the ordinary step reads views sliced by a host count."""
    r = runner(llama, {"name": "fp16", "backend": "torch"})
    cache = r.new_cache()
    r.forward(prompt(), cache)
    traces = []
    for token in (5, 11):
        ids = torch.tensor([[token]])
        with trace_step() as trace:
            r.forward(ids, cache)
        traces.append(trace)
    i = first_difference(*traces)
    assert i is not None
    problems = replay_problems(*traces)
    assert any(p.startswith("steps differ") for p in problems)


def test_the_instrument_sees_a_host_sync_and_an_upload():
    x = torch.arange(4.0)
    with trace_step() as trace:
        y = x * 2
        float(y.sum())
        torch.tensor([1, 2]) + y[:2]
    assert trace.syncs and trace.uploads
    problems = replay_problems(trace, trace)
    assert any("host sync" in p for p in problems) and any("host data" in p for p in problems)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU model under the interpreter")
@pytest.mark.parametrize("case", ["uniform-2.585", "turboquant-split", "kivi-r8"])
def test_triton_static_step_replays_and_matches_torch(llama, case):
    """Under the interpreter: the Triton reader over the whole capacity, launches with the same grid
    every step, and the torch reference's logits."""
    node = NODES[case]
    _, t_cache, _, t_step = static_after_prefill(llama, {**node, "backend": "triton"})
    _, r_cache, _, r_step = static_after_prefill(llama, {**node, "backend": "torch"})
    (first, second, *_), *_ = traced_steps(t_step, t_cache, steps=3).values()
    assert replay_problems(first, second) == []
    assert any(e[0].startswith("triton::") for e in first.entries)
    traced_steps(r_step, r_cache, steps=3)
    for token in (3, 17):
        torch.testing.assert_close(t_step(token), r_step(token), rtol=1e-4, atol=1e-4)


def test_refusals_name_the_key_and_the_covered_methods(llama):
    with pytest.raises(ConfigError) as err:
        build_method({"name": "ott", "cuda_graph": True})
    assert "method.cuda_graph" in str(err.value) and "fp16" in str(err.value) and "uniform" in str(err.value)
    with pytest.raises(ConfigError, match="channel axis"):
        build_method({"name": "uniform", "key_axis": "channel", "cuda_graph": True})
    with pytest.raises(ConfigError, match="rolling full-precision window"):
        build_method({"name": "turboquant", "residual": 4, "cuda_graph": True})
    with pytest.raises(ConfigError, match="sink_tokens"):
        build_method({"name": "fp16", "sink_tokens": 2, "cuda_graph": True})
    with pytest.raises(ConfigError, match="method.cuda_graph"):
        build_method({"name": "fp16", "cuda_graph": "yes"})
    _, gemma = tiny_model("gemma3")
    with pytest.raises(ConfigError, match="sliding-window"):
        build_method({"name": "fp16", "cuda_graph": True}).config.check_static_model(gemma)
    with pytest.raises(ValueError, match="CUDA device"):
        StaticStep(lambda *a: None, None, 0, torch.device("cpu"), capture=True)


def test_static_buffer_writes_at_its_device_length():
    buf = GrowableTokens(torch.float16)
    buf.reserve(8)
    buf.append(torch.ones(1, 2, 3, 4))
    assert buf.length.tolist() == [3] and len(buf) == 0  # written on the device, not yet counted
    buf.advance(3)
    buf.append(torch.full((1, 2, 1, 4), 2.0))
    buf.advance(1)
    full = buf.full_view()
    assert full.shape == (1, 2, 8, 4) and buf.reallocations == 1
    assert full[..., :3, :].eq(1).all() and full[..., 3, :].eq(2).all() and full[..., 4:, :].eq(0).all()
    assert buf.view().shape == (1, 2, 4, 4)
    with pytest.raises(ValueError, match="cannot take 5 more after 4"):
        buf.advance(5)
    with pytest.raises(ValueError, match="never pops"):
        buf.pop_front(1)
    with pytest.raises(ValueError, match="before the first append"):
        buf.reserve(16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA device")
@pytest.mark.parametrize("case", ["fp16", "uniform-2.585", "turboquant-split", "kivi-r8"])
def test_captured_graph_generates_the_eager_tokens_on_cuda(case):
    """On a device: the request's step captured at its second call and replayed from then on
    gives the growing cache's tokens and, step by step, its logits."""
    model, shape = tiny_model("llama")
    model = model.cuda()
    node = {**NODES[case], "backend": "triton"}
    eager = loaded(model, shape).runner(build_method(node))
    graph = loaded(model, shape).runner(build_method({**node, "cuda_graph": True}))
    p = prompt().cuda()
    want, got = eager.generate(p, 24), graph.generate(p, 24)
    assert got.extra == {"decode_step": "graph"}
    assert got.token_ids == want.token_ids
    assert without_reserve(got.memory) == without_reserve(want.memory)
