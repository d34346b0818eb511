"""Batched decoding (:meth:`ModelRunner.generate_batch`, :mod:`kvbench.cache.batch`): every registered
method's output for sequence i of a batch equals its output run alone (batch 1), ragged lengths
included: the same greedy tokens, the same stop, the same memory report (so no pad token entered
its storage), and the logits that chose each token equal up to float rounding.

The model is the tiny random Llama of tests/tiny_archs.py. Each method runs with settings small
enough that it quantizes, evicts, allocates or prefetches at these lengths (prompts of 23-41
tokens, 8 new tokens): KIVI/OTT/SpeCache windows of 4-8 tokens and token groups of 8, SemKV
chunks of 4, eviction budgets of 16 tokens, so group boundaries, eviction rounds and allocation
units fall at different places in the sequences of one batch.

Logit tolerance: a batched decode step's projections may differ from batch 1's in the last bit
(another summation order), which can push a value across a quantization boundary and flip one
code; here that moves logits by ~1e-4 at most. Positions shifted by the pad count (no
``cumsum(mask) - 1``) move a quantizing method's logits by ~0.3, and its stored keys by ~5 (checked
by breaking the runner on purpose), so ``atol=1e-3`` separates the two. SemKV is the exception
(:data:`LOGIT_ATOL`): it gives a chunk's tokens the higher or the lower precision by ranking their
scores, and a last-bit difference can swap two tied tokens of a ranking; under
``ATEN_CPU_CAPABILITY=default`` its ragged batch moves logits by ~3e-2 that way (the same tokens,
the same bytes), still an order below what a shifted position does. FP16 alone would not see
that shift: RoPE attention depends on relative positions only, hence :func:`test_no_pad_enters_storage`
compares the stored keys themselves.
"""

from __future__ import annotations

import pytest
import torch
from tiny_archs import VOCAB, kvbench_logits, loaded, tiny_model

from kvbench.cache.batch import PER_SEQUENCE, SequenceBatchCache
from kvbench.generate import score_arms
from kvbench.methods import METHODS, build_method

STEPS = 8
RAGGED = (41, 23, 34)  # the longest first, the shortest in the middle: pads on rows 1 and 2
EQUAL = (30, 30, 30)

# Per registered method, the node that makes it compress at these lengths (a method missing here
# fails test_every_method_has_a_node: a new method must say how it is tested batched).
NODES: dict[str, dict] = {
    "fp16": {},
    "uniform": {"bits": 2},
    "kivi": {"bits": 2, "residual": 8, "group_size": 8},
    "ott": {"bits": 2, "residual": 4, "group_size": 8, "pool_size": 2, "skip_layers": 1,
            "extra_pool_size": 2},
    "specache": {"bits": 2, "residual": 8, "group_size": 8, "topk": 4},
    "kvquant": {"bits": 2, "calibrate": False, "pre_rope": False, "datatype": "uniform"},
    "intactkv": {"tokens": 2, "base": {"name": "kivi", "bits": 2, "residual": 8, "group_size": 8}},
    "turboquant": {"bits": 2},
    "semkv": {"chunk": 4},
    "readkv": {"bits": 6, "read_bits": 3},
    "streamingllm": {"budget": 16, "sinks": 4},
    "h2o": {"budget": 16},
    "snapkv": {"budget": 16, "window": 4},
    "random_prune": {"budget": 16, "window": 4},
}  # fmt: skip
# Method hooks that keep per-forward or per-request state outside the layers: SemKV's logit and
# hidden-state metrics (after_forward) and its attention metric (scored in attend), SpeCache without
# speculation (exact fetch); KVQuant's pre-RoPE keys (stored un-rotated, so each sequence's own
# positions must be the alone run's).
EXTRA = {
    "semkv-surprisal": {"name": "semkv", "chunk": 4, "metric": "surprisal"},
    "semkv-hidden_change": {"name": "semkv", "chunk": 4, "metric": "hidden_change"},
    "semkv-attn_sum": {"name": "semkv", "chunk": 4, "metric": "attn_sum"},
    "kvquant-pre_rope": {"name": "kvquant", "bits": 2, "calibrate": False, "pre_rope": True,
                         "datatype": "uniform"},
    "specache-exact": {"name": "specache", "bits": 2, "residual": 8, "group_size": 8, "topk": 4,
                       "speculative": False},
}  # fmt: skip


# Methods whose logits may move past 1e-3 through a swapped near-tie of a ranking (docstring).
LOGIT_ATOL = {"semkv": 5e-2}


def node_for(case: str) -> dict:
    return dict(EXTRA[case]) if case in EXTRA else {"name": case, **NODES[case]}


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def prompts_of(lengths: tuple[int, ...]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (1, n), generator=gen) for n in lengths]


def runner_for(llama, node):
    model, shape = llama
    return loaded(model, shape).runner(build_method(node))


def assert_batch_equals_alone(runner, prompts, prefill="alone", **kw):
    """Each sequence of ``generate_batch`` against ``generate`` and the batch-1 logits; returns the
    alone generations. Prefilled alone, the first token's logits are the alone run's bit for bit."""
    alone = [runner.generate(p, STEPS, **kw) for p in prompts]
    batch = runner.generate_batch(prompts, STEPS, keep_logits=True, prefill=prefill, **kw)
    assert len(batch) == len(prompts)
    for i, (p, a, b) in enumerate(zip(prompts, alone, batch, strict=True)):
        assert b.token_ids == a.token_ids, f"sequence {i}"
        assert b.stopped == a.stopped and b.prompt_tokens == a.prompt_tokens == p.shape[1]
        # the whole report: tokens, bytes of every component, read and prefetch statistics
        assert b.memory == a.memory, f"sequence {i}: storage differs from the alone run"
        assert b.extra["batch_path"] == PER_SEQUENCE and b.extra["batch_size"] == len(prompts)
        # the alone logits that chose each token (the stop token's too, when it stopped)
        fed = a.token_ids + ([] if not a.stopped else [int(b.extra["logits"][-1].argmax())])
        want, _ = kvbench_logits(runner, p, fed) if fed else (torch.empty(0), None)
        assert b.extra["logits"].shape == want.shape
        atol = LOGIT_ATOL.get(runner.method.config.name, 1e-3)
        torch.testing.assert_close(b.extra["logits"], want, rtol=1e-4, atol=atol)
        if prefill == "alone" and len(want):
            assert torch.equal(b.extra["logits"][0], want[0]), f"sequence {i}: prefill logits differ"
    return alone


def test_every_method_has_a_node():
    assert sorted(NODES) == sorted(METHODS.names())


# every registered method ragged and at equal lengths; the extra hook cases ragged only
CASES = [
    *(pytest.param(m, lengths, id=f"{m}-{kind}") for m in METHODS.names() for kind, lengths in
      (("ragged", RAGGED), ("equal", EQUAL))),
    *(pytest.param(m, RAGGED, id=f"{m}-ragged") for m in EXTRA),
]  # fmt: skip


# each prompt prefilled alone (what the tasks run) for every case; the padded batched prefill for
# every registered method at ragged lengths
PREFILLS = [
    *(pytest.param(*p.values, "alone", id=f"{p.id}-alone") for p in CASES),
    *(pytest.param(m, RAGGED, "batch", id=f"{m}-ragged-batch") for m in METHODS.names()),
]


@pytest.mark.parametrize(("case", "lengths", "prefill"), PREFILLS)
def test_batch_equals_alone(llama, case, lengths, prefill):
    runner = runner_for(llama, node_for(case))
    alone = assert_batch_equals_alone(runner, prompts_of(lengths), prefill=prefill)
    memory = alone[0].memory
    # every sequence stored its prompt and every decoded token but the last
    assert [g.memory.tokens for g in alone] == [n + STEPS - 1 for n in lengths]
    if runner.method.config.bits is not None or case in ("streamingllm", "h2o", "snapkv", "random_prune"):
        assert memory.total_bytes < memory.fp16_bytes, f"{case} does not compress at these lengths"


@pytest.mark.parametrize("case", ["fp16", "kivi", "specache", "semkv-surprisal", "h2o"])
def test_per_sequence_stop(llama, case):
    """A sequence that stops leaves the batch: its tokens, stop flag and storage are its alone
    run's, while the others go on to ``max_new_tokens``."""
    runner = runner_for(llama, node_for(case))
    prompts = prompts_of(RAGGED)
    free = runner.generate(prompts[1], STEPS).token_ids
    stop = free[2]
    alone = assert_batch_equals_alone(runner, prompts, stop_token_ids=(stop,))
    assert alone[1].stopped and len(alone[1].token_ids) <= 2
    assert any(not g.stopped and len(g.token_ids) == STEPS for g in alone), "no sequence ran on"


def test_min_new_tokens_per_sequence(llama):
    """Stops are barred from each sequence's first ``min_new_tokens`` positions, as alone: the
    sequence whose first greedy token is the stop token takes the runner-up there."""
    runner = runner_for(llama, node_for("kivi"))
    prompts = prompts_of(RAGGED)
    stop = runner.generate(prompts[2], 1).token_ids[0]
    alone = assert_batch_equals_alone(runner, prompts, stop_token_ids=(stop,), min_new_tokens=1)
    assert alone[2].token_ids and alone[2].token_ids[0] != stop


def test_no_pad_enters_storage(llama):
    """After a ragged prefill each sequence's layers hold exactly its real tokens, and what they
    hold reads back as the alone cache's (pads would add tokens and shift KIVI's groups)."""
    runner = runner_for(llama, node_for("kivi"))
    prompts = prompts_of(RAGGED)
    cache = runner.new_batch_cache(len(prompts))
    ids, mask = runner.pad_batch(prompts, pad_token_id=VOCAB - 1)
    assert mask.sum(1).tolist() == list(RAGGED) and bool((ids[mask == 0] == VOCAB - 1).all())
    cache.set_padding(mask)
    runner.forward(ids, cache)
    assert cache.get_seq_length() == max(RAGGED)
    for p, sub in zip(prompts, cache.sequences, strict=True):
        alone = runner.new_cache()
        runner.forward(p, alone)
        for mine, theirs in zip(sub.layers, alone.layers, strict=True):
            assert mine.num_tokens == theirs.num_tokens == p.shape[1]
            assert mine.batch_size == 1
            for x, y in zip(mine.read(), theirs.read(), strict=True):
                torch.testing.assert_close(x.float(), y.float(), rtol=1e-3, atol=1e-3)


def test_refusals(llama):
    runner = runner_for(llama, node_for("fp16"))
    cache = runner.new_batch_cache(2)
    with pytest.raises(ValueError, match="left-padded"):
        cache.set_padding(torch.tensor([[1, 1, 0], [1, 1, 1]]))  # right padding
    with pytest.raises(ValueError, match="left-padded"):
        cache.set_padding(torch.tensor([[0, 0, 0], [1, 1, 1]]))  # an empty prompt
    with pytest.raises(RuntimeError, match="set_padding"):
        runner.forward(torch.zeros(2, 3, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="at least one token"):
        runner.generate_batch([torch.zeros(1, 0, dtype=torch.long)], 2)
    gemma = tiny_model("gemma3")
    with pytest.raises(NotImplementedError, match="sliding-window"):
        runner_for(gemma, node_for("fp16")).generate_batch(prompts_of((5, 3)), 2)
    assert not isinstance(runner.new_cache(), SequenceBatchCache)


# the methods whose scoring takes a path of its own: plain storage, a residual window, a
# speculative step, a metric fed by logits, an eviction
SCORED = ["fp16", "kivi", "specache", "semkv-surprisal", "snapkv", "kvquant-pre_rope"]


@pytest.mark.parametrize(("first", "chunk"), [("prefill", 1), ("cache", 1), ("prefill", 3)])
@pytest.mark.parametrize("case", SCORED)
def test_score_batch_equals_alone(llama, case, first, chunk):
    """Each pair of ``score_batch`` scores as ``score`` alone: the same greedy flag and storage, its
    negative log-likelihoods up to the rounding of a batched step (the first one bit for bit under
    ``first="prefill"``: it is the prefill's)."""
    runner = runner_for(llama, node_for(case))
    contexts = prompts_of(RAGGED)
    conts = [c[:, :STEPS] for c in prompts_of((20, 20, 20))]
    alone = [runner.score(c, n, chunk=chunk, first=first) for c, n in zip(contexts, conts, strict=True)]
    batch = runner.score_batch(list(zip(contexts, conts, strict=True)), chunk=chunk, first=first)
    for a, b in zip(alone, batch, strict=True):
        assert len(b.nll) == len(a.nll) == STEPS
        assert b.memory == a.memory and b.greedy == a.greedy
        atol = LOGIT_ATOL.get(runner.method.config.name, 1e-3)
        torch.testing.assert_close(torch.tensor(b.nll), torch.tensor(a.nll), rtol=1e-4, atol=atol)
        if first == "prefill":
            assert b.nll[0] == a.nll[0]
    with pytest.raises(ValueError, match="one length"):
        runner.score_batch([(contexts[0], conts[0]), (contexts[1], conts[1][:, :3])])


# every case whose method declares it may share a batch with other methods' rows
ARM_CASES = [c for c in [*NODES, *EXTRA] if build_method(node_for(c)).arm_batch]


@pytest.mark.parametrize("chunk", [1, 3])
def test_score_arms_equals_each_arms_own_batch(llama, chunk):
    """All declaring methods' rows in one batched forward (:func:`score_arms`): each arm scores as its
    own :meth:`score_batch` does, the same storage, greedy flags and first token bit for bit, the
    later ones within the rounding of a batched step (module docstring)."""
    assert {"fp16", "kivi", "kvquant", "uniform", "intactkv", "h2o"} <= set(ARM_CASES)
    assert not {"semkv", "specache"} & set(ARM_CASES)
    runners = [runner_for(llama, node_for(c)) for c in ARM_CASES]
    contexts = prompts_of(RAGGED)
    conts = [c[:, :STEPS] for c in prompts_of((20, 20, 20))]
    pairs = list(zip(contexts, conts, strict=True))
    together = score_arms(runners, pairs, chunk=chunk)
    assert len(together) == len(runners)
    for case, runner, scored in zip(ARM_CASES, runners, together, strict=True):
        own = runner.score_batch(pairs, chunk=chunk)
        for a, b in zip(own, scored, strict=True):
            assert b.memory == a.memory and b.greedy == a.greedy, case
            assert b.nll[0] == a.nll[0], case
            torch.testing.assert_close(torch.tensor(b.nll), torch.tensor(a.nll), rtol=1e-4, atol=1e-3)


def test_score_arms_refuses_what_cannot_share(llama):
    pairs = [(prompts_of((12,))[0], prompts_of((20,))[0][:, :4])]
    fp16 = runner_for(llama, node_for("fp16"))
    for case in ("specache", "semkv"):
        with pytest.raises(ValueError, match="cannot share a batched forward"):
            score_arms([fp16, runner_for(llama, node_for(case))], pairs)
    other = runner_for(tiny_model("llama"), node_for("fp16"))
    with pytest.raises(ValueError, match="same model object"):
        score_arms([fp16, other], pairs)


@pytest.mark.parametrize("case", [*NODES, *EXTRA])
def test_equal_windows_score_as_one_cache_of_b_rows(llama, case, monkeypatch):
    """Contexts of one length (a perplexity task's windows) are scored in one cache of B rows where
    the method's storage stacks (kvbench.cache.stack): each window's scores and bytes as through the
    per-sequence path, and as alone."""
    runner = runner_for(llama, node_for(case))
    pairs = list(zip(prompts_of(EQUAL), [c[:, :STEPS] for c in prompts_of((20, 20, 20))], strict=True))
    seen = []
    stacked = runner.stacked

    def spy(cache):
        out = stacked(cache)
        seen.append(out is not None)
        return out

    monkeypatch.setattr(runner, "stacked", spy)
    batch = runner.score_batch(pairs, chunk=3)
    monkeypatch.setattr(runner, "stacked", lambda cache: None)
    per_sequence = runner.score_batch(pairs, chunk=3)
    alone = [runner.score(c, n, chunk=3) for c, n in pairs]
    stacks = runner.method.config.name in {"fp16", "uniform", "kivi", "intactkv"}
    assert seen == [stacks], (case, seen)
    for a, p, b in zip(alone, per_sequence, batch, strict=True):
        assert b.memory == p.memory == a.memory and b.greedy == a.greedy
        torch.testing.assert_close(torch.tensor(b.nll), torch.tensor(p.nll), rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(torch.tensor(b.nll), torch.tensor(a.nll), rtol=1e-4, atol=1e-3)
