"""``kvbench-lm-eval`` as lm-eval's users type it (issue 44 item 3): the ``run`` subcommand,
``--batch_size`` through kvbench's batched paths, log-likelihoods in one forward per request where
the method stores every token in full precision, ``pretrained=``/``tokenizer=``, lm-eval's
``model_*`` fields and the true device in the results, the fp dtype in the run's label, and bad
``--tasks``/``--limit``/``--batch_size`` in one line before the model loads.

The acceptance run: ``kvbench-lm-eval run --model kvbench --model_args
pretrained=<folder>,method=kivi,bits=2 --tasks kvbench_tiny_ppl --batch_size 4`` finishes, and the
FP16 word perplexity of the same folder equals ``--model hf``'s within 1e-4."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lm_eval.api.instance import Instance

from kvbench.errors import ConfigError
from kvbench.generate import ModelRunner
from kvbench.lmeval import (
    KVBenchLM,
    check_limit,
    checked_batch_size,
    main,
    parse_model_args,
    with_default_model,
)
from kvbench.methods import build_method

TINY_TASKS = Path(__file__).resolve().parent / "fixtures" / "lmeval"
CTX = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is"


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model load fails the test: bad input must be refused before one."""
    import kvbench.builder

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvbench.builder, "load_for_methods", refuse)


# --- the command's forms and its door (no model) ------------------------------------------------


def test_the_run_subcommand_and_the_flag_form_get_the_kvbench_model():
    tasks = ["--tasks", "arc_easy"]
    assert with_default_model(["run", *tasks]) == ["run", "--model", "kvbench", *tasks]
    assert with_default_model(tasks) == ["--model", "kvbench", *tasks]  # lm-eval inserts `run`
    for given in (["run", "--model", "hf", *tasks], ["-M", "hf", *tasks], ["--model=hf", *tasks]):
        assert with_default_model(given) == given
    for untouched in (["ls", "tasks"], ["validate", *tasks], ["--help"], ["run"], []):
        assert with_default_model(untouched) == untouched


def test_batch_size_and_limit_take_lm_evals_forms():
    assert [checked_batch_size(v) for v in (None, 1, "4", "auto", "auto:3")] == [1, 1, 4, "auto", "auto"]
    for bad in (0, -2, "four", "auto:x", 2.5, True):
        with pytest.raises(ConfigError, match="a positive int, auto or auto:N"):
            checked_batch_size(bad)
    for good in (None, 1, 5.0, 0.5):
        check_limit(good)
    for bad in (-1.0, 0.0, 2.5, float("nan")):
        with pytest.raises(ConfigError, match=r"an integer >= 1\) or a fraction of them in \(0, 1\)"):
            check_limit(bad)


def test_pretrained_tokenizer_and_hf_names_set_the_model_node(tmp_path):
    """``pretrained=`` is the model's weights (a folder, a .gguf file or a Hub id), hf's ``dtype``,
    ``revision`` and ``max_length`` the node's keys; each is checked before anything loads."""
    folder = tmp_path / "My-Model"
    folder.mkdir()
    node = parse_model_args({"pretrained": str(folder), "dtype": "bfloat16"}).model_node()
    assert (node["path"], node["name"], node["dtype"]) == (str(folder), "my-model", "bfloat16")
    assert node["max_context"] is None  # the default node's own limit describes its own weights only
    # a Hub id of a committed node takes that node; any other replaces the default node's GGUF
    assert parse_model_args({"pretrained": "meta-llama/Llama-2-7b-hf"}).model_node()["name"] == "llama2-7b"
    hub = parse_model_args({"pretrained": "HuggingFaceTB/SmolLM2-360M", "max_length": 2048}).model_node()
    assert (hub["hub_id"], hub["name"], hub["gguf_package"], hub["max_context"]) == (
        "HuggingFaceTB/SmolLM2-360M",
        "smollm2-360m",
        None,
        2048,
    )
    assert parse_model_args({"tokenizer": str(folder)}).tokenizer == str(folder)
    bad = [
        ({"pretrained": "/nonexistent/folder"}, "pretrained", "no such folder"),
        ({"pretrained": str(folder), "model.path": str(folder)}, "pretrained", "give the weights once"),
        ({"dtype": "float16", "model.dtype": "float32"}, "dtype", "give it once"),
        ({"tokenizer": "./nope"}, "tokenizer", "no such folder"),
        ({"batch_size": 0}, "batch_size", "a positive int, auto"),
        ({"chunk": "all"}, "chunk", "auto (one forward per request"),
    ]
    for args, key, says in bad:
        with pytest.raises(ConfigError) as err:
            parse_model_args(args).model_node()
        assert err.value.key == key and says in str(err.value), str(err.value)


def test_the_fp_dtype_is_in_the_label():
    """An FP16 run with ``method.fp_dtype=auto`` is another run than the default FP16 one: its name,
    and so its results folder, says so."""

    def lm(node):
        return KVBenchLM(SimpleNamespace(tokenizer=None, method=build_method(node)))

    default, auto = lm({"name": "fp16"}), lm({"name": "fp16", "fp_dtype": "auto"})
    assert (default.label(), auto.label()) == ("fp16", "fp16-fp_auto")
    assert default.display_name() != auto.display_name()
    assert lm({"name": "kivi", "bits": 2, "fp_dtype": "bfloat16"}).label() == "kivi-2b-fp_bfloat16"


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["run", "--tasks", "kvbench_tiny_mcq"],
            "kvbench-lm-eval: error: --tasks='kvbench_tiny_mcq': not an lm-eval task, group or tag",
        ),
        (["--tasks", "kvbench_tiny_mc", "--limit", "-1"], "kvbench-lm-eval: error: --limit=-1: a number"),
        (
            ["run", "--tasks", "kvbench_tiny_mc", "--limit", "0"],
            "kvbench-lm-eval: error: --limit=0: a number",
        ),
        (
            ["run", "--tasks", "kvbench_tiny_mc", "--batch_size", "four"],
            "error: batch_size='four': a positive",
        ),
        (["run", "--tasks", "kvbench_tiny_mc", "--log_samples"], "error: Specify --output_path if providing"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_the_model_loads(
    argv, line, local_tasks_only, no_model_loads, capsys
):
    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--include_path", str(TINY_TASKS), "--model_args", "method=kivi,bits=2"])
    assert exit_.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert line in last, last
    if "--tasks=" in line:
        assert (
            last.endswith("--include_path adds a folder of task YAMLs")
            and "close matches: kvbench_tiny_mc" in last
        )


# --- through the model ----------------------------------------------------------------------------


def word_perplexity(folder: Path) -> float:
    [path] = list(folder.rglob("results_*.json"))
    return json.loads(path.read_text())["results"]["kvbench_tiny_ppl"]["word_perplexity,none"]


@pytest.mark.slow
def test_run_form_with_pretrained_and_batch_size_and_fp16_equals_hf(
    tmp_path, local_tasks_only, default_model, monkeypatch
):
    """The acceptance command on the default model's folder, then FP16 (flag form) and lm-eval's
    ``--model hf`` on the same folder: FP16 scores each rolling window in one forward, as hf does."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = default_model[0].config._name_or_path
    common = ["--tasks", "kvbench_tiny_ppl", "--include_path", str(TINY_TASKS), "--batch_size", "4"]

    def run(name, argv):
        main([*argv, *common, "--output_path", str(tmp_path / name)])
        [path] = list((tmp_path / name).rglob("results_*.json"))
        return path, json.loads(path.read_text())

    path, kivi = run(
        "kivi", ["run", "--model", "kvbench", "--model_args", f"pretrained={folder},method=kivi,bits=2"]
    )
    assert (
        path.parent.name == "kvbench__smollm2-135m__kivi-2b"
        and kivi["model_name"] == "kvbench/smollm2-135m/kivi-2b"
    )
    config = kivi["config"]
    assert config["device"] == "cpu"  # lm-eval's would be its --device default, cuda:0
    assert config["model_dtype"] == "torch.float32" and config["model_sha"] == ""  # not a Hub snapshot
    assert config["model_num_parameters"] == sum(p.numel() for p in default_model[0].parameters())
    info = config["kvbench"]
    assert (info["loglikelihood_scoring"], info["cache_chunk"], info["batch_size"]) == ("cache", 1, 4)
    assert info["model"]["path"] == folder and info["requests"] == {"loglikelihood_rolling": 5}

    _, fp16 = run("fp16", ["--model_args", f"pretrained={folder},method=fp16"])
    assert fp16["config"]["kvbench"]["loglikelihood_scoring"] == "one_forward"
    _, hf = run("hf", ["run", "--model", "hf", "--model_args", f"pretrained={folder},dtype=float32"])
    assert hf["config"]["model_num_parameters"] == config["model_num_parameters"]
    ours, reference = (r["results"]["kvbench_tiny_ppl"]["word_perplexity,none"] for r in (fp16, hf))
    assert abs(ours - reference) < 1e-4, (ours, reference)
    # KIVI-2's default residual (128) holds these short texts whole: only its FP16 storage rounding,
    # read token by token, moves it
    kivi_ppl = kivi["results"]["kvbench_tiny_ppl"]["word_perplexity,none"]
    assert 0 < abs(kivi_ppl - reference) < 0.1 * reference


class Forwards:
    """Counts the model's forwards."""

    def __init__(self, model):
        self.n = 0
        self.handle = model.register_forward_hook(self.hook)

    def hook(self, *args):
        self.n += 1


@pytest.mark.slow
def test_batches_go_through_kvbenchs_batched_paths_and_equal_batch_one(default_model):
    """Loglikelihoods of one continuation length go through ``score_batch``, generations through
    ``generate_batch``, FP16 log-likelihoods are one forward per request (one per batch), and every
    batched number is batch 1's."""
    model, tok, shape = default_model
    kivi = {"name": "kivi", "bits": 2, "residual": 8, "group_size": 8}  # short prompts still quantize
    conts = [" Rome", " Paris", " Milan", " Berlin"]  # one token each: one score_batch of 4
    ll = [Instance("loglikelihood", {}, (CTX, c), i) for i, c in enumerate(conts)]
    gen = [
        Instance("generate_until", {}, (c, {"until": ["\n"], "max_gen_toks": 6}), i)
        for i, c in enumerate([CTX, "One, two, three,", "Water freezes at zero degrees"])
    ]

    def lm(node, **kwargs):
        return KVBenchLM(ModelRunner(model, tok, build_method(node), shape), **kwargs)

    counter = Forwards(model)
    try:
        alone, batched = lm(kivi), lm(kivi, batch_size=4)
        calls = []
        score_batch = batched.runner.score_batch
        batched.runner.score_batch = lambda pairs, *a, **k: (
            calls.append(len(pairs)) or score_batch(pairs, *a, **k)
        )
        for (a, greedy_a), (b, greedy_b) in zip(
            alone.loglikelihood(ll), batched.loglikelihood(ll), strict=True
        ):
            assert b == pytest.approx(a, abs=1e-3) and greedy_a == greedy_b
        assert calls == [4] and batched.records[0].memory.quantized_values > 0
        assert lm(kivi, batch_size=4).generate_until(gen) == alone.generate_until(gen)

        exact = lm({"name": "fp16"})
        counter.n = 0
        one = exact.loglikelihood(ll)
        assert counter.n == len(ll)  # one forward per request
        counter.n = 0
        four = lm({"name": "fp16"}, batch_size=4).loglikelihood(ll)
        assert counter.n == 1  # one forward for the batch
        for (a, _), (b, _) in zip(one, four, strict=True):
            assert b == pytest.approx(a, abs=1e-4)
        # auto: lm-eval's --max_batch_size first, halved where a batch runs out of device memory
        auto = lm({"name": "fp16"}, batch_size="auto", max_batch_size=4)
        forward = auto.runner.forward

        def small_memory(ids, *args, **kwargs):
            if ids.shape[0] > 2:
                raise torch.OutOfMemoryError("4 rows do not fit")
            return forward(ids, *args, **kwargs)

        auto.runner.forward = small_memory
        for (a, _), (b, _) in zip(one, auto.loglikelihood(ll), strict=True):
            assert b == pytest.approx(a, abs=1e-4)
        assert auto.batch_sizes == {"auto": 2} and auto.get_model_info()["kvbench"]["batch_size"] == 2
        # the plain model's numbers, as lm-eval's hf computes them
        ids = tok.encode(CTX + conts[0], add_special_tokens=False)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids[:-1]]), use_cache=False).logits.float()
        assert one[0][0] == pytest.approx(float(torch.log_softmax(logits[0, -1], -1)[ids[-1]]), abs=1e-4)
    finally:
        counter.handle.remove()
