"""The lm-eval adapter on the real default model: every request type goes through the method's cache
(a 1-bit cache changes log-likelihoods, rolling log-likelihoods and generations), an exact cache
gives plain transformers' numbers, each request has its own cache, and ``task=lmeval`` runs an
lm-eval multiple-choice task from a local file."""

from __future__ import annotations

import json
from pathlib import Path

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


# --- lm-eval as a client: kvbench-lm-eval, strict model_args, what the results JSON carries ------

TINY_TASKS = Path(__file__).resolve().parent / "fixtures" / "lmeval"
PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"


@pytest.mark.parametrize(
    ("model_args", "key", "says"),
    [
        ("method=kivi,residual=32", "residual", "did you mean method.residual?"),
        (
            "method=kivi,pretrained=/nonexistent",
            "pretrained",
            "or a Hugging Face Hub id (owner/name); no such folder",
        ),
        ("method=kivi,dtype=float64", "model.dtype", "one of float32, float16, bfloat16"),
        ("method=fp16,method.residual=32", "method.residual", "allowed: backend, bits, cuda_graph, fp_dtype"),
        ("method=kivi,method.residul=32", "method.residul", "did you mean residual?"),
        ("model.dtype=float64", "model.dtype", "one of float32, float16, bfloat16"),
        ("model.colour=red", "model.colour", "allowed:"),
        ("method=kivi,batch_size=0", "batch_size", "a positive int, auto or auto:N"),
        ("chunk=0", "chunk", "auto (one forward per request"),
        ("method=nosuch", "method.name", "registered methods are"),
        ("model=nosuch", "model", "known model nodes: "),
        ("bits=-1", "bits", "a positive number"),
        ("device=tpu", "device", "auto, cpu, cuda or cuda:N"),
    ],
)
def test_model_args_are_read_strictly(model_args, key, says):
    """Every key is kvbench's (the run's command-line keys) or one line naming it and the allowed
    ones; each fails before the model loads."""
    with pytest.raises(ConfigError) as err:
        KVBenchLM.create_from_arg_string(model_args)
    assert err.value.key.startswith(key), str(err.value)
    assert says in str(err.value) and "\n" not in str(err.value)
    if key == "residual":
        allowed = str(err.value).split("allowed: ")[1].split(", ")
        expected = {
            "model",
            "method",
            "bits",
            "model.path",
            "pretrained",
            "tokenizer",
            "dtype",
            "method.residual",
        }
        assert expected <= set(allowed)


def test_model_args_set_the_nodes_as_the_run_command_line_does():
    from kvbench.lmeval import arm_id, parse_model_args
    from kvbench.models import model_node

    args = parse_model_args(
        {"method": "kivi", "bits": 2, "method.residual": 32, "model.dtype": "bfloat16", "batch_size": 1}
    )
    method, model = args.method_node(), args.model_node()
    assert (method["name"], method["bits"], method["residual"], method["group_size"]) == ("kivi", 2.0, 32, 32)
    assert model == model_node("smollm2-135m", {"dtype": "bfloat16"}) and model["dtype"] == "bfloat16"
    # the id changes with every knob, and only with them
    same = arm_id(model, method, 2.0)
    assert same == arm_id(model_node("smollm2-135m", {"dtype": "bfloat16"}), dict(method), 2.0)
    assert same != arm_id(model, {**method, "residual": 128}, 2.0)
    assert same != arm_id(model_node("smollm2-135m"), method, 2.0)


def test_kvbench_lm_eval_runs_a_local_task_and_reports_the_effective_bits(
    tmp_path, local_tasks_only, capsys, monkeypatch
):
    """The acceptance command: lm-eval's own CLI, ``--model kvbench``, the KIVI-2 knobs as
    ``model_args``, a local task; its results JSON carries the method, its config, its run id and
    the effective bits, and KIVI's residual covering the short prompts is said."""
    from kvbench.lmeval import arm_id, main, parse_model_args

    monkeypatch.setattr(KVBenchLM, "latest", None)
    args = "method=kivi,bits=2,method.residual=32"
    main(
        ["--model", "kvbench", "--model_args", args, "--tasks", "kvbench_tiny_mc"]
        + ["--include_path", str(TINY_TASKS), "--output_path", str(tmp_path), "--device", "cpu"]
    )
    err = capsys.readouterr().err
    [path] = list(tmp_path.rglob("results_*.json"))
    assert path.parent.name == "kvbench__smollm2-135m__kivi-2b"  # filed under the arm, not a random id
    results = json.loads(path.read_text())
    assert results["model_name"] == "kvbench/smollm2-135m/kivi-2b"
    info = results["config"]["kvbench"]
    assert info["method"] == "kivi-2b" and info["bits"] == 2.0
    assert (info["method_config"]["residual"], info["method_config"]["key_bits"]) == (32, 2.0)
    parsed = parse_model_args({"method": "kivi", "bits": 2, "method.residual": 32})
    assert info["run_id"] == arm_id(parsed.model_node(), parsed.method_node(), 2.0)
    assert info["requests"] == {"loglikelihood": 13}
    # 2 of the 5 documents (4 of the 13 choice requests) fit in the 32-token residual: 16 bits each;
    # the other 9 store 2-bit codes plus scales, so the mean lies strictly between
    assert 2.0 < info["effective_bits"] < 16.0 and info["code_bits"] == 2.0
    [warning] = info["warnings"].values()
    assert warning.startswith("loglikelihood: 4 of 13 lm-eval requests") and "method.residual=32" in warning
    assert "kvbench: warning: loglikelihood: 4 of 13" in err
    assert "kvbench loglikelihood (kivi-2b)" in err  # the progress bar
    assert results["results"]["kvbench_tiny_mc"]["acc,none"] >= 0.6


def test_kvbench_lm_eval_says_a_bad_model_arg_in_one_line(local_tasks_only, capsys):
    from kvbench.lmeval import main

    with pytest.raises(SystemExit) as exit_:
        main(
            ["--model_args", "method=kivi,residual=32", "--tasks", "kvbench_tiny_mc"]
            + ["--include_path", str(TINY_TASKS), "--device", "cpu"]
        )
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("kvbench-lm-eval: error: model_args: residual=32: unknown key; did you mean")


def test_rolling_loglikelihood_matches_lm_evals_hf_model(local_tasks_only, default_model):
    """Word perplexity of the same model through ``--model hf`` and through an exact kvbench cache
    agree: both condition the first rolling window on the tokenizer's BOS. Conditioning on the
    end-of-text token instead (lm-eval's TemplateLM default) moves it, so the test can tell."""
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    model, tok, _ = default_model
    assert tok.bos_token_id != tok.eos_token_id  # SmolLM2: <|im_start|> and <|im_end|>
    manager = local_tasks_only(include_path=str(TINY_TASKS))

    def word_ppl(lm):
        out = simple_evaluate(model=lm, tasks=["kvbench_tiny_ppl"], task_manager=manager, bootstrap_iters=0)
        return out["results"]["kvbench_tiny_ppl"]["word_perplexity,none"]

    hf = HFLM(pretrained=model.config._name_or_path, dtype="float32", device="cpu", batch_size=1)
    exact = KVBenchLM.create_from_arg_string("method=fp16,method.fp_dtype=auto,chunk=64,device=cpu")
    assert exact.prefix_token_id == hf.prefix_token_id == tok.bos_token_id
    reference, ours = word_ppl(hf), word_ppl(exact)
    assert ours == pytest.approx(reference, rel=1e-4)
    eot = KVBenchLM(exact.runner, chunk=64, prefix_token_id=tok.eos_token_id)
    assert abs(word_ppl(eot) / reference - 1) > 0.01


def test_the_package_declares_the_script_and_lm_evals_plugin_entry_point():
    """``kvbench-lm-eval`` and the ``lm_eval.models`` entry point name real objects, and lm-eval's
    model registry loads the entry point as a lazy placeholder (as its plugin discovery registers
    one) into the kvbench model."""
    import tomllib
    from importlib.metadata import EntryPoint

    from lm_eval.api.registry import Registry

    from kvbench import lmeval

    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert project["scripts"]["kvbench-lm-eval"] == "kvbench.lmeval:main"
    [(name, target)] = project["entry-points"]["lm_eval.models"].items()
    assert name == "kvbench"
    registry = Registry("model")
    registry.register(name, target=EntryPoint(name=name, value=target, group="lm_eval.models"))
    assert registry.get("kvbench") is KVBenchLM
    assert EntryPoint(name="main", value="kvbench.lmeval:main", group="console_scripts").load() is lmeval.main
