"""The lm-eval adapter on the real default model: every request type goes through the method's cache
(a 1-bit cache changes log-likelihoods, rolling log-likelihoods and generations), an exact cache
gives plain transformers' numbers, each request has its own cache, and ``task=lmeval`` runs an
lm-eval multiple-choice task from a local file."""

from __future__ import annotations

import json

import pytest
import torch
from lm_eval.api.instance import Instance

from kvbench.errors import ConfigError
from kvbench.generate import ModelRunner
from kvbench.lmeval import KVBenchLM
from kvbench.methods import build_method
from kvbench.tasks import build_task

pytestmark = pytest.mark.slow

CTX = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"
CONT = " Rome, and the capital of Spain is Madrid."
CTX_B = "One, two, three, four,"
CONT_B = " five, six."


def ll_request(context, continuation, idx=0):
    return Instance("loglikelihood", {}, (context, continuation), idx)


@pytest.fixture(scope="module")
def lms(default_model):
    model, tok, shape = default_model

    def make(node):
        return KVBenchLM(ModelRunner(model, tok, build_method(node), shape))

    return {
        "exact": make({"name": "fp16", "fp_dtype": "auto"}),  # stores the model's own fp32 values
        "fp16": make({"name": "fp16"}),
        "uniform1": make({"name": "uniform", "bits": 1}),
    }


def plain_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log P(ids[i] | ids[:i]) for i >= 1 from one cache-free transformers forward: ``[len(ids)-1]``."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:-1]]), use_cache=False).logits.float()
    logp = torch.log_softmax(logits[0], dim=-1)
    return logp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0], logp.argmax(-1)


def test_exact_cache_equals_plain_transformers_loglikelihood(lms, default_model):
    model, tok, _ = default_model
    lm = lms["exact"]
    ctx_ids = tok.encode(CTX, add_special_tokens=False)
    cont_ids = tok.encode(CTX + CONT, add_special_tokens=False)[len(ctx_ids) :]
    logp, argmax = plain_logprobs(model, ctx_ids + cont_ids)
    expected = float(logp[-len(cont_ids) :].sum())
    greedy = bool((argmax[-len(cont_ids) :] == torch.tensor(cont_ids)).all())
    [(ll, is_greedy)] = lm.loglikelihood([ll_request(CTX, CONT)])
    assert ll == pytest.approx(expected, abs=1e-3)
    assert is_greedy == greedy
    # the papers' fp16 cache: rounding of stored keys/values only
    [(ll16, _)] = lms["fp16"].loglikelihood([ll_request(CTX, CONT)])
    assert ll16 == pytest.approx(expected, abs=0.05)


def test_exact_cache_equals_plain_transformers_rolling(lms, default_model):
    model, _, _ = default_model
    lm = lms["exact"]
    text = CTX_B + CONT_B
    ids = [lm.prefix_token_id, *lm.tok_encode(text)]
    expected = float(plain_logprobs(model, ids)[0].sum())
    [ll] = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert ll == pytest.approx(expected, abs=1e-3)
    assert len(lm.records[0].nll) == len(ids) - 1  # every token scored once


def test_one_bit_cache_changes_every_request_type(lms):
    exact, broken = lms["exact"], lms["uniform1"]
    # log-likelihood, several tokens and a single one: the first continuation token reads the cache too
    for cont in (CONT, " Rome"):
        [(a, _)] = exact.loglikelihood([ll_request(CTX, cont)])
        [(b, _)] = broken.loglikelihood([ll_request(CTX, cont)])
        assert abs(a - b) > 0.5, cont
    assert broken.records[0].memory.quantized_values > 0
    assert exact.records[0].memory.quantized_values == 0
    # rolling log-likelihood
    req = [Instance("loglikelihood_rolling", {}, (CTX,), 0)]
    assert abs(exact.loglikelihood_rolling(req)[0] - broken.loglikelihood_rolling(req)[0]) > 0.5
    # generation
    gen = [Instance("generate_until", {}, (CTX, {"until": ["\n"], "max_gen_toks": 8}), 0)]
    a, b = exact.generate_until(gen)[0], broken.generate_until(gen)[0]
    assert a.strip() and a != b
    assert exact.records[0].new_tokens <= 8


def test_each_request_gets_a_fresh_cache(lms):
    lm = lms["uniform1"]  # a destructive cache makes any leaked state visible
    a, b = ll_request(CTX, CONT), ll_request(CTX_B, CONT_B)
    alone = [lm.loglikelihood([a])[0], lm.loglikelihood([b])[0]]
    assert lm.loglikelihood([a, b]) == alone
    assert lm.loglikelihood([b, a]) == alone[::-1]
    ga = Instance("generate_until", {}, (CTX, {"until": ["\n"], "max_gen_toks": 5}), 0)
    gb = Instance("generate_until", {}, (CTX_B, {"until": ["\n"], "max_gen_toks": 5}), 1)
    assert lm.generate_until([ga, gb]) == lm.generate_until([gb, ga])[::-1]


def test_sampling_is_refused(lms):
    req = Instance("generate_until", {}, (CTX, {"until": ["\n"], "do_sample": True}), 0)
    with pytest.raises(ConfigError, match="greedily"):
        lms["exact"].generate_until([req])


def test_lmeval_task_runs_a_local_multiple_choice_task(tmp_path, data_root, lms):
    docs = [
        {"question": "The capital of France is", "choices": ["Paris", "a banana"], "label": 0},
        {"question": "Two plus two equals", "choices": ["purple", "four"], "label": 1},
    ]
    data = tmp_path / "tiny.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "tiny.yaml").write_text(
        "task: kvbench_tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        "    test: /nonexistent/replaced-by-overrides.jsonl\noutput_type: multiple_choice\n"
        "test_split: test\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{label}}'\n"
        "doc_to_choice: '{{choices}}'\nmetric_list:\n  - metric: acc\n"
        "    aggregation: mean\n    higher_is_better: true\n"
    )
    node = {
        "name": "lmeval",
        "tasks": ["kvbench_tiny_mc"],
        "include_path": str(tasks),
        "overrides": {"kvbench_tiny_mc": {"dataset_kwargs": {"data_files": {"test": str(data)}}}},
    }
    task = build_task(node, data_root, 0)
    assert [s["id"] for s in task.samples()] == ["kvbench_tiny_mc/0", "kvbench_tiny_mc/1"]
    lm = lms["exact"]
    for sample, doc in zip(task.samples(), docs, strict=True):
        row = task.run(sample, lm.runner)
        lls = [lm.loglikelihood([ll_request(doc["question"], " " + c)])[0][0] for c in doc["choices"]]
        best = max(range(2), key=lls.__getitem__)
        assert row["prediction"] == doc["choices"][best]
        assert row["acc_none"] == row["score"] == float(best == doc["label"])
        assert row["requests"] == 2
    # an unknown name is one ConfigError line with lm-eval's close matches
    with pytest.raises(ConfigError, match="not an lm-eval task.*kvbench_tiny_mc") as err:
        build_task({**node, "tasks": ["kvbench_tiny_mcq"], "overrides": {}}, data_root, 0).samples()
    assert err.value.key == "task.tasks" and "\n" not in str(err.value)


def test_lm_eval_model_args_build_through_the_run_builder(data_root, monkeypatch):
    """``--model kvbench --model_args model=...,method=...,bits=...``: the runner comes from the run
    builder, so the method gets the run's bits through its bits knob and is prepared as in a run."""
    from kvbench.methods import Method

    prepared = []

    def record(self, model, tokenizer, shape, root):
        prepared.append((self, root))

    monkeypatch.setattr(Method, "prepare", record)
    monkeypatch.setenv("KVBENCH_DATA_DIR", str(data_root))
    lm = KVBenchLM.create_from_arg_string("model=smollm2-135m,method=kivi,bits=3")
    method = lm.runner.method
    assert (method.registered_name, method.config.bits, method.label()) == ("kivi", 3.0, "kivi-3b")
    assert prepared == [(method, data_root)]
    assert lm.runner.shape.num_kv_heads == 3 and lm.max_length == lm.runner.shape.max_context
    # a method without a bits knob ignores them, as a run does
    assert KVBenchLM.create_from_arg_string("method=fp16,bits=3").runner.method.label() == "fp16"
