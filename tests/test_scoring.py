"""The one scoring loop and the one generation loop (kvbench/generate.py) on the real default model:
the perplexity task and the lm-eval adapter score through the same loop, so a method with its own
decode step (SpeCache) gets the same per-token numbers from both, and both loops call every hook."""

from __future__ import annotations

import pytest
import torch

from kvbench.generate import ModelRunner
from kvbench.lmeval import KVBenchLM
from kvbench.methods import build_method
from kvbench.tasks import build_task


def perplexity_task(data_root, **knobs):
    node = {"name": "perplexity", "context_length": 160, "continuation_length": 12, "windows": 1, **knobs}
    return build_task(node, data_root, 0)


@pytest.mark.parametrize("speculative", [True, False])
def test_specache_perplexity_equals_its_lmeval_loglikelihood(default_model, data_root, speculative):
    """task=perplexity scores token 0 of a window from the prefill (which reads no stored token) and
    every later token from a decode step of the token before it; lm-eval's loglikelihood of the tail
    after the context and that first token makes the same prefill and the same decode steps."""
    model, tokenizer, shape = default_model
    node = {"name": "specache", "bits": 2, "speculative": speculative}
    task = perplexity_task(data_root)
    (sample,) = task.samples()
    context, continuation = task.window_pairs(tokenizer)[0]

    runner = ModelRunner(model, tokenizer, build_method(node), shape)
    row = task.run(sample, runner)
    scored = task.score(0, runner)
    assert len(scored.nll) == row["tokens"] == 12
    assert row["nll_mean"] == sum(scored.nll) / len(scored.nll)  # the row is this scoring, and it repeats

    lm = KVBenchLM(ModelRunner(model, tokenizer, build_method(node), shape))
    [(logprob, _)] = lm._loglikelihood_tokens([(None, context + continuation[:1], continuation[1:])])
    assert lm.records[0].nll == scored.nll[1:]  # bit for bit
    assert logprob == pytest.approx(-sum(scored.nll[1:]), abs=1e-9)

    # token 0: the prefill's own logits, as the plain model computes them without a cache
    with torch.no_grad():
        plain = model(input_ids=torch.tensor([context]), use_cache=False).logits.float()[0, -1]
    assert scored.nll[0] == pytest.approx(float(-torch.log_softmax(plain, -1)[continuation[0]]), abs=1e-4)


def test_specache_is_scored_through_its_decode_step(default_model, data_root):
    """Scoring that skipped SpeCache's decode step would give the numbers of its plain forward, the
    same cache read without the prefetched pairs; the loop's numbers are the decode step's."""
    model, tokenizer, shape = default_model
    task = perplexity_task(data_root)
    method = build_method({"name": "specache", "bits": 2})
    runner = ModelRunner(model, tokenizer, method, shape)
    with_step = task.score(0, runner).nll
    method.decode_step = lambda runner, cache, ids: runner.forward(ids, cache)
    without_step = task.score(0, runner).nll
    assert with_step[0] == without_step[0]  # the prefill's prediction reads no stored token
    assert with_step[1:] != without_step[1:]


class Recorder:
    """Wraps a method's two per-forward hooks on the instance and records each call's token count."""

    def __init__(self, method):
        self.calls: list[tuple[str, int]] = []
        step, after = method.decode_step, method.after_forward

        def decode_step(runner, cache, ids):
            self.calls.append(("step", ids.shape[1]))
            return step(runner, cache, ids)

        def after_forward(cache, ids, logits):
            self.calls.append(("after", ids.shape[1]))
            after(cache, ids, logits)

        method.decode_step, method.after_forward = decode_step, after_forward


@pytest.mark.parametrize(
    "first, chunk, expected",
    [
        # the context (8) prefilled, then each continuation token (3) fed as a decode step
        ("prefill", 1, [("after", 8)] + [("step", 1), ("after", 1)] * 3),
        # the context less its last token prefilled, then that token and two continuation tokens
        ("cache", 1, [("after", 7)] + [("step", 1), ("after", 1)] * 3),
        # a two-token chunk is a plain forward; the one-token rest a decode step
        ("prefill", 2, [("after", 8), ("after", 2), ("step", 1), ("after", 1)]),
    ],
)
def test_the_scoring_loop_calls_every_hook(default_model, first, chunk, expected):
    model, tokenizer, shape = default_model
    method = build_method({"name": "fp16"})
    recorder = Recorder(method)
    runner = ModelRunner(model, tokenizer, method, shape)
    ids = tokenizer.encode("One, two, three, four, five, six, seven, eight", add_special_tokens=False)
    scored = runner.score(torch.tensor([ids[:8]]), torch.tensor([ids[8:11]]), chunk=chunk, first=first)
    assert len(scored.nll) == 3
    assert recorder.calls == expected


def test_the_generation_loop_calls_every_hook(default_model):
    model, tokenizer, shape = default_model
    method = build_method({"name": "fp16"})
    recorder = Recorder(method)
    runner = ModelRunner(model, tokenizer, method, shape)
    ids = tokenizer.encode("One, two, three, four, five,", add_special_tokens=False)
    gen = runner.generate(torch.tensor([ids]), 4)
    assert gen.new_tokens == 4
    # the first token comes from the prefill; each later one from a decode step of the one before
    assert recorder.calls == [("after", len(ids))] + [("step", 1), ("after", 1)] * 3


def test_scoring_refuses_an_unknown_protocol_and_an_empty_context(default_model):
    model, tokenizer, shape = default_model
    runner = ModelRunner(model, tokenizer, build_method({"name": "fp16"}), shape)
    with pytest.raises(ValueError, match="first='last'"):
        runner.score(torch.tensor([[1, 2]]), torch.tensor([[3]]), first="last")
    with pytest.raises(ValueError, match="at least one context token"):
        runner.score(torch.zeros((1, 0), dtype=torch.long), torch.tensor([[3]]))
