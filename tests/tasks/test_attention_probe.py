"""attention_probe: exact attention and the error on hand cases, windows, config errors, and on the
real model: the FP16 cache's error, a 2-bit uniform cache against a hand computation from the
captured tensors, the per-layer values, and a run through the runner into the report's tables."""

from __future__ import annotations

import json

import pytest
import torch

from kvbench.analysis.frame import groups, load_frame
from kvbench.analysis.units import analyze
from kvbench.errors import ConfigError
from kvbench.generate import ModelRunner
from kvbench.methods import ModelShape, build_method
from kvbench.models import model_node
from kvbench.quant.affine import fake_quantize_grouped
from kvbench.tasks import build_task
from kvbench.tasks.attention_probe import capture_window, exact_attention, step_errors

SHAPE = ModelShape(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_context=8192)


def probe(data_root, **overrides):
    return build_task({"name": "attention_probe", **overrides}, data_root, seed=0)


# --- the math ----------------------------------------------------------------------------------------


def test_exact_attention_hand_case_and_query_head_groups():
    """Two KV heads, four query heads: heads 0-1 read KV head 0, heads 2-3 KV head 1. A zero query
    weighs every key alike (the mean of the values); a query that scores key 1 at log 3 above key
    0 weighs them 1/4 and 3/4."""
    keys = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[1.0, 0.0], [0.0, 1.0]]])[None]  # [1, 2, 2, 2]
    values = torch.tensor([[[2.0, 0.0], [0.0, 4.0]], [[8.0, 8.0], [0.0, 0.0]]])[None]
    log3 = torch.log(torch.tensor(3.0)).item()
    query = torch.tensor([[0.0, 0.0], [0.0, log3], [0.0, 0.0], [0.0, log3]])[None, :, None]  # [1, 4, 1, 2]
    out = exact_attention(query, keys, values, scaling=1.0)[0, :, 0]
    torch.testing.assert_close(out, torch.tensor([[1.0, 2.0], [0.5, 3.0], [4.0, 4.0], [2.0, 2.0]]))


def test_step_errors_per_head_and_pooled():
    want = torch.tensor([[3.0, 4.0], [0.0, 1.0]])[None, :, None]  # [1, 2, 1, 2]: norms 5 and 1
    got = want + torch.tensor([[0.0, 1.0], [1.0, 0.0]])[None, :, None]  # error norm 1 per head
    per_head, pooled = step_errors(got, want)
    assert per_head.tolist() == pytest.approx([0.2, 1.0])  # the small head weighs as much as the large
    assert pooled == pytest.approx((2**0.5) / (26**0.5))  # pooled: one norm over both heads


# --- windows and config --------------------------------------------------------------------------------


def test_windows_are_bos_then_consecutive_text(data_root, tokenizer):
    task = probe(data_root, context_length=64, steps=4, windows=3)
    ids = task.token_ids(tokenizer)
    m = 64 + 4 - 1  # text tokens per window: the BOS is the window's first token
    assert tokenizer.bos_token_id is not None
    for i in range(3):
        window = task.window(tokenizer, i)
        assert len(window) == 68
        assert window == [tokenizer.bos_token_id, *ids[i * m : (i + 1) * m]]
    assert [s["id"] for s in task.samples()] == ["w0", "w1", "w2"]
    assert set(ids).isdisjoint(tokenizer.all_special_ids)
    assert not tokenizer.decode(ids[:50]).lstrip().startswith("The Project Gutenberg")  # the body only
    wiki = probe(data_root, dataset="wikitext2", context_length=64, steps=4)
    assert wiki.window(tokenizer, 0)[1:] == wiki.token_ids(tokenizer)[:67] != ids[:67]


def test_default_layers_are_every_fourth(data_root):
    assert probe(data_root).layers(SHAPE) == [0, 4, 8, 12, 16, 20, 24, 28]
    assert probe(data_root, layers=[29, 3]).layers(SHAPE) == [3, 29]


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"dataset": "c4"}, "task.dataset"),
        ({"pg19_book": "war-and-peace"}, "task.pg19_book"),
        ({"context_length": 0}, "task.context_length"),
        ({"context_length": 1}, "task.context_length"),
        ({"steps": 0}, "task.steps"),
        ({"steps": "8"}, "task.steps"),
        ({"windows": -1}, "task.windows"),
        ({"layers": [3, 3]}, "task.layers"),
        ({"layers": []}, "task.layers"),
        ({"layers": [-1]}, "task.layers"),
        ({"stpes": 8}, "task.stpes"),
    ],
)
def test_bad_config_names_the_key_and_value(data_root, overrides, key):
    with pytest.raises(ConfigError) as err:
        probe(data_root, **overrides)
    assert err.value.key == key
    value = next(iter(overrides.values()))
    assert str(value) in str(err.value) and "\n" not in str(err.value)


def test_bad_config_says_what_is_allowed(data_root):
    with pytest.raises(ConfigError, match=r"task\.dataset.*c4.*allowed: pg19, wikitext2"):
        probe(data_root, dataset="c4")
    with pytest.raises(ConfigError, match=r"task\.steps.*0.*a positive int"):
        probe(data_root, steps=0)


def test_checks_against_the_model(data_root, tokenizer):
    with pytest.raises(ConfigError, match=r"task\.context_length=8190.*8192"):
        probe(data_root, context_length=8190, steps=8).check_model(SHAPE, tokenizer)
    with pytest.raises(ConfigError, match=r"task\.layers.*0\.\.29"):
        probe(data_root, layers=[0, 30]).check_model(SHAPE, tokenizer)
    with pytest.raises(ConfigError, match=r"task\.windows=1000.*book 10146 has \d+ tokens"):
        probe(data_root, windows=1000).check_model(SHAPE, tokenizer)
    probe(data_root, context_length=128, steps=8, windows=2).check_model(SHAPE, tokenizer)


def test_missing_text_is_a_config_error_before_any_model_work(tmp_path):
    with pytest.raises(ConfigError, match=r"pg19/10146\.txt"):
        probe(tmp_path).samples()


def test_aggregate_means_over_windows(data_root):
    rows = [
        {"rel_err": 0.2, "rel_err_pooled": 0.1, "rel_err_by_layer": {"0": 0.1, "4": 0.3}},
        {"rel_err": 0.4, "rel_err_pooled": 0.3, "rel_err_by_layer": {"0": 0.2, "4": 0.6}},
    ]
    agg = probe(data_root).aggregate(rows)
    assert agg["n"] == 2
    assert agg["rel_err"] == pytest.approx(0.3) and agg["rel_err_pooled"] == pytest.approx(0.2)
    assert agg["rel_err_by_layer"] == pytest.approx({"0": 0.15, "4": 0.45})


# --- the real model ----------------------------------------------------------------------------------


def runner_for(default_model, node):
    model, tok, shape = default_model
    return ModelRunner(model, tok, build_method(node), shape)


@pytest.mark.slow
def test_fp16_cache_error_is_its_storage_rounding(default_model, data_root):
    """The FP16 baseline stores the float32 model's keys and values in float16 (its node's
    fp_dtype): its error is that rounding, about 3e-4 here, not 0. Stored in the model's dtype
    (fp_dtype auto) the cache reads back what the model computed, and the error is float32
    rounding of the blockwise attention: below 1e-6."""
    task = probe(data_root, context_length=128, steps=4, layers=[0, 4, 29])
    sample = task.samples()[0]
    exact = task.run(sample, runner_for(default_model, {"name": "fp16", "fp_dtype": "auto"}))
    assert 0 <= exact["rel_err"] <= 1e-6
    assert all(0 <= v <= 1e-6 for v in exact["rel_err_by_layer"].values())
    assert exact["memory"].effective_bits == 32.0  # float32 keys and values, nothing else
    half = task.run(sample, runner_for(default_model, {"name": "fp16"}))
    assert 1e-5 < half["rel_err"] < 1e-3  # float16 keeps 11 significant bits: relative 2^-12 per value
    assert half["memory"].effective_bits == 16.0 and half["memory"].compression == 1.0


@pytest.mark.slow
def test_uniform_2bit_matches_a_hand_computation(default_model, data_root):
    """2-bit uniform (4 levels, per-token groups of 32 channels, min/max zero point): at step t the
    cache holds tokens 0..t-1 quantized and attends the step's own token exactly. Quantizing the
    captured keys and values with kvbench.quant.affine and attending by hand gives the row's error
    per layer to 1e-5."""
    model, tok, shape = default_model
    task = probe(data_root, context_length=128, steps=4, layers=[4, 20])
    sample = task.samples()[1]
    row = task.run(sample, runner_for(default_model, {"name": "uniform", "bits": 2}))
    json.dumps({k: v for k, v in row.items() if k != "memory"})  # what samples.jsonl stores
    records = capture_window(model, task.window(tok, sample["window"]), [4, 20])
    hand = {}
    for layer, rec in records.items():
        q, k, v, scaling = rec.query, rec.keys, rec.values, rec.scaling
        errors = []
        for t in range(128, 132):
            kq = torch.cat(
                [fake_quantize_grouped(k[:, :, :t].float(), 4, "token", 32), k[:, :, t : t + 1]], 2
            )
            vq = torch.cat(
                [fake_quantize_grouped(v[:, :, :t].float(), 4, "token", 32), v[:, :, t : t + 1]], 2
            )
            got = exact_attention(q[:, :, t : t + 1], kq, vq, scaling)[0, :, 0]
            want = exact_attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], scaling)[0, :, 0]
            errors.append((got - want).norm(dim=-1) / want.norm(dim=-1))  # [H]
        hand[str(layer)] = torch.stack(errors).mean().item()
    assert row["layers"] == [4, 20] and row["steps"] == 4 and row["prompt_tokens"] == 128
    assert row["rel_err_by_layer"] == pytest.approx(hand, abs=1e-5)
    assert row["rel_err"] == pytest.approx(sum(hand.values()) / 2, abs=1e-5)
    assert row["rel_err"] > 0.1  # 4 levels are far from exact
    assert 0 < row["rel_err_pooled"] < 1
    # 2-bit codes plus a float16 scale and zero per 32 values: 2 + 32 / 32 bits, over both layers only
    memory = row["memory"]
    assert memory.effective_bits == pytest.approx(3.0) and memory.tokens == 132


@pytest.mark.slow
def test_attention_probe_runs_and_reports_lower_as_better(tmp_path, data_root):
    """Two arms through the runner (run folders, rows, metrics) into the report's paired table:
    rel_err is lower-is-better, so the 2-bit cache's larger error is a negative difference."""
    from kvbench import run as run_module

    plan = {
        "name": "attention_probe",
        "reference": "fp16",
        "metric": "rel_err",
        "alpha": 0.05,
        "margin": 0.05,
    }
    metrics = {}
    for method in (None, {"name": "uniform", "bits": 2}):
        cfg = {
            "model": model_node("smollm2-135m"),
            "task": {
                "name": "attention_probe",
                "context_length": 64,
                "steps": 2,
                "layers": [0, 8],
                "windows": 2,
            },
            "seed": 0,
            "device": "cpu",
            "output": {"root": str(tmp_path), "resume": True},
            "data": {"root": str(data_root)},
            "analysis": {**plan, "n": 2, "seeds": [0]},
            **({"method": method} if method else {}),
        }
        out = run_module.execute(cfg, progress=False)
        metrics[out["method"]] = out
    assert set(metrics) == {"fp16", "uniform-2b"}
    uniform = metrics["uniform-2b"]
    assert uniform["primary_metric"] == "rel_err" and uniform["metrics"]["n"] == 2
    assert set(uniform["metrics"]["rel_err_by_layer"]) == {"0", "8"}
    assert uniform["memory"]["effective_bits"] == pytest.approx(3.0)
    assert uniform["memory"]["compression"] == pytest.approx(16 / 3)
    (unit_key, frame), *others = groups(load_frame(tmp_path))
    assert not others and unit_key == ("attention_probe", "smollm2-135m", "attention_probe")
    unit = analyze((unit_key, frame), n_resamples=200)
    paired = unit.paired.set_index("method")
    assert paired.attrs["higher_is_better"] is False
    means = {m: metrics[m]["metrics"]["rel_err"] for m in metrics}
    assert paired.loc["uniform-2b", "mean_diff"] == pytest.approx(means["fp16"] - means["uniform-2b"])
    assert paired.loc["uniform-2b", "mean_diff"] < 0
