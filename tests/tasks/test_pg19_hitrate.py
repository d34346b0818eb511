"""pg19_hitrate: hit-rate math per policy on hand-worked cases, properties, the low-bit keys, config
errors, the capture, one short real-model run, and the analysis table/figure."""

from __future__ import annotations

import contextlib
import json
import math

import pandas as pd
import pytest
import torch

import kvbench.tasks.pg19_hitrate as task_module
from kvbench.errors import ConfigError
from kvbench.methods import ModelShape, build_method
from kvbench.quant.affine import fake_quantize_grouped
from kvbench.tasks import build_task
from kvbench.tasks.pg19_hitrate import (
    POLICIES,
    budget,
    capture,
    causal_probs,
    h2o_hit_rates,
    kivi_lowbit_keys,
    recent_size,
    topk_hit_rates,
)

SHAPE = ModelShape(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_context=8192)


def hitrate(data_root, **overrides):
    return build_task({"name": "pg19_hitrate", **overrides}, data_root, seed=0)


def log_weights(rows: list[list[float]]) -> torch.Tensor:
    """Queries ``[1, N, N]`` whose logits against identity keys are ``log w`` (row t: weights of keys
    0..t), so that softmax over any key subset is the weights renormalised on that subset."""
    n = len(rows)
    q = torch.zeros(1, n, n)
    for t, w in enumerate(rows):
        q[0, t, : len(w)] = torch.log(torch.tensor(w, dtype=torch.float32))
    return q


# --- hand-worked cases -----------------------------------------------------------------------------


def test_topk_hit_rates_exact_and_by_other_scores():
    probs = torch.tensor([0.5, 0.3, 0.2])
    # exact top-k: 0.5, 0.5 + 0.3, everything
    assert topk_hit_rates(probs, probs, [1, 2, 3]).tolist() == pytest.approx([0.5, 0.8, 1.0])
    # a predictor ranking key 2 first, then 0, then 1 captures 0.2, 0.7, 1.0
    scores = torch.tensor([1.0, 0.0, 2.0])
    assert topk_hit_rates(probs, scores, [1, 2, 3]).tolist() == pytest.approx([0.2, 0.7, 1.0])


def test_topk_ignores_invisible_keys():
    # key 2 is in the future of this query: probability 0 and score -inf; k above the visible count
    probs = torch.tensor([0.25, 0.75, 0.0])
    scores = torch.tensor([5.0, 1.0, float("-inf")])
    assert topk_hit_rates(probs, scores, [1, 3]).tolist() == pytest.approx([0.25, 1.0])


# Row t: attention weights of query t over keys 0..t.
H2O_CASE = [[1], [3, 1], [1, 1, 2], [4, 2, 1, 1]]


def h2o(q, keys, scaling, budgets, recents, start):
    """The task's H2O hit rates with values that do not matter to them."""
    return h2o_hit_rates(q, keys, torch.randn(keys.shape), scaling, budgets, recents, start)


def test_h2o_greedy_eviction_hand_case():
    """The registered h2o method, k=2 attended entries (a cache budget of 1), r=1 (window 0),
    scaling 1, identity keys; positions 0, 1 are the prompt.

    Prefill: row 0 attends {0}: F = [1]; row 1 attends [3/4, 1/4]: F = [1.75, .25]; keep {0}.
    t=2: attends {0, 2}: hit = (1 + 2)/4 = 0.75; softmax over the set [1/3, 2/3]: F(0) = 2.083,
    F(2) = .667; keep {0}. t=3: {0, 3}: hit = (4 + 1)/8 = 0.625, while the exact top-2 {0, 1} would
    hold (4 + 2)/8 = 0.75.
    """
    q = log_weights(H2O_CASE)
    out = h2o(q, torch.eye(4)[None], 1.0, budgets=[2], recents=[1], start=2)
    assert out.shape == (1, 2, 1)
    assert out[0, :, 0].tolist() == pytest.approx([0.75, 0.625])
    exact = topk_hit_rates(*(causal_probs(q[:, 2:], torch.eye(4)[None], torch.tensor([2, 3]), 1.0),) * 2, [2])
    assert exact[0, 0].tolist() == pytest.approx([0.75, 0.75])


def test_h2o_recent_window_only_is_sliding_window():
    """k=2, r=2: the attended set is always {t-1, t}: t=2 -> (1+2)/4, t=3 -> (1+1)/8."""
    q = log_weights(H2O_CASE)
    out = h2o(q, torch.eye(4)[None], 1.0, budgets=[2], recents=[2], start=2)
    assert out[0, :, 0].tolist() == pytest.approx([0.75, 0.25])


def test_h2o_several_budgets_at_once_match_one_by_one():
    torch.manual_seed(1)
    q, k, v = torch.randn(4, 40, 8), torch.randn(2, 40, 8), torch.randn(2, 40, 8)
    together = h2o_hit_rates(q, k, v, 0.5, budgets=[3, 10], recents=[1, 5], start=30)
    a = h2o_hit_rates(q, k, v, 0.5, budgets=[3], recents=[1], start=30)
    b = h2o_hit_rates(q, k, v, 0.5, budgets=[10], recents=[5], start=30)
    assert torch.equal(together, torch.cat([a, b]))


def test_h2o_prompt_attention_once_per_layer_same_bits(monkeypatch, h2o_prompt_queries):
    """The prompt's attention is computed once for every budget of a layer and gives the very bits of
    computing it per budget (several query chunks, k = 1 among the budgets)."""
    torch.manual_seed(4)
    q, k, v = torch.randn(6, 300, 8) * 2, torch.randn(2, 300, 8), torch.randn(2, 300, 8)
    args = (q, k, v, 0.5, [1, 3, 15, 60, 300], [1, 2, 8, 30, 150], 292)
    prompts = h2o_prompt_queries
    shared = h2o_hit_rates(*args)
    assert prompts == [292]
    prompts.clear()
    monkeypatch.setattr(task_module, "shared_prefill", contextlib.nullcontext)
    alone = h2o_hit_rates(*args)
    assert prompts == [292] * 4
    assert torch.equal(shared, alone)


def test_h2o_kept_set_is_shared_by_the_query_heads_of_a_kv_head():
    """H2O keeps one set per KV head, ranked by the attention its query heads give together."""
    torch.manual_seed(2)
    q, k = torch.randn(4, 24, 8) * 3, torch.randn(2, 24, 8)
    out = h2o(q, k, 0.5, budgets=[4], recents=[1], start=20)  # [1, M, H]
    probs = causal_probs(q[:, 20:], k, torch.arange(20, 24), 0.5)  # [H, M, N]
    for t in range(4):
        per_head = topk_hit_rates(probs[:, t], probs[:, t], [4])[0]  # each query head's own best 4
        assert (out[0, t] <= per_head + 1e-6).all()


def test_budget_and_recent_sizes():
    assert budget(0.005, 2048) == 10  # 10.24
    assert budget(0.01, 2048) == 20  # 20.48
    assert budget(0.0001, 2048) == 1  # never below one entry
    assert budget(1.0, 2048) == 2048
    assert recent_size(10, 0.5) == 5
    assert recent_size(1, 0.5) == 1
    assert recent_size(7, 0.0) == 1  # the current token is always attended
    assert recent_size(4, 1.0) == 4


# --- properties on random data ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exact_topk_dominates_every_policy(seed):
    torch.manual_seed(seed)
    heads, kv, n, d, m = 6, 2, 64, 16, 8
    q, k = torch.randn(heads, n, d) * 2, torch.randn(kv, n, d)
    positions = torch.arange(n - m, n)
    probs = causal_probs(q[:, n - m :], k, positions, d**-0.5)
    ks = [1, 3, 8, 20]
    exact = topk_hit_rates(probs, probs, ks)  # [S, H, M]
    random_scores = torch.randn(heads, m, n).masked_fill(
        torch.arange(n)[None] > positions[:, None], -math.inf
    )
    other = topk_hit_rates(probs, random_scores, ks)
    h2o_rates = h2o(q, k, d**-0.5, ks, [recent_size(x, 0.5) for x in ks], n - m).transpose(1, 2)
    assert (exact >= other - 1e-6).all() and (exact >= h2o_rates - 1e-6).all()
    assert (exact[:, :, :] <= 1 + 1e-6).all()
    # monotone in k for every policy
    for rates in (exact, other, h2o_rates):
        assert (rates[1:] >= rates[:-1] - 1e-6).all()
    # a real gap somewhere: the random ranking is not the exact one
    assert (exact - other).max() > 0.05


def test_hit_rate_is_one_at_k_equal_T():
    torch.manual_seed(3)
    heads, n, d = 3, 30, 8
    q, k = torch.randn(heads, n, d), torch.randn(1, n, d)
    positions = torch.arange(20, n)
    probs = causal_probs(q[:, 20:], k, positions, 1.0)
    scores = torch.randn(heads, 10, n).masked_fill(torch.arange(n)[None] > positions[:, None], -math.inf)
    assert torch.allclose(topk_hit_rates(probs, probs, [n]), torch.ones(1, heads, 10))
    assert torch.allclose(topk_hit_rates(probs, scores, [n]), torch.ones(1, heads, 10))
    assert torch.allclose(h2o(q, k, 1.0, [n], [recent_size(n, 0.5)], 20), torch.ones(1, 10, heads))


# --- the low-bit keys --------------------------------------------------------------------------------


def kivi(bits, zero_point, group=2, residual=2):
    # SpeCache's low-bit copy, as the task builds it: kvbench's fp32 affine map (its zero point)
    return {"name": "kivi", "bits": bits, "group_size": group, "residual": residual,
            "zero_point": zero_point, "fp_dtype": "auto", "arithmetic": "fp32"}  # fmt: skip


def test_lowbit_keys_specache_one_bit_hand_case():
    """Channel 0 holds [0, 4 | 10, 20 | 7, 9], groups of 2 tokens, residual 2, SpeCache's 1-bit zero
    point z = (3 min + max) / 4, s = (max - min) / 2: group [0, 4] -> z=1, s=2 -> [1, 3];
    group [10, 20] -> z=12.5, s=5 -> [12.5, 17.5]. Before position t the registered kivi layer holds
    tokens 0..t-2: at t=4 (3 held) one group is low-bit, at t=5 (4 held) two."""
    keys = torch.zeros(1, 6, 2)
    keys[0, :, 0] = torch.tensor([0.0, 4.0, 10.0, 20.0, 7.0, 9.0])
    values = torch.randn(1, 6, 2)
    low, flushed = kivi_lowbit_keys(keys, values, kivi(1, "specache"), start=4)
    assert flushed.tolist() == [2, 4]
    assert low[0, :, 0].tolist() == pytest.approx([1.0, 3.0, 12.5, 17.5, 7.0, 9.0])
    # KIVI's min-max at 1 bit would reconstruct only the extremes
    low, _ = kivi_lowbit_keys(keys, values, kivi(1, "minmax"), start=4)
    assert low[0, :, 0].tolist() == pytest.approx([0.0, 4.0, 10.0, 20.0, 7.0, 9.0])


def test_lowbit_keys_match_affine_module():
    torch.manual_seed(0)
    keys, values = torch.randn(3, 200, 64), torch.randn(3, 200, 64)
    low, flushed = kivi_lowbit_keys(keys, values, kivi(2, "minmax", 32, 64), start=190)
    # position t sees the t-1 tokens before the forward: 64 * floor((t-1) / 64) are low-bit
    assert flushed.tolist() == [128] * 3 + [192] * 7
    want = fake_quantize_grouped(keys[:, :192], 4, "channel", 32, "minmax")
    assert torch.equal(low[:, :192], want)
    assert torch.equal(low[:, 192:], keys[:, 192:])
    assert not torch.allclose(low[:, :192], keys[:, :192], atol=1e-2)


# --- config errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"sparsities": [0.0, 0.1]}, "task.sparsities"),
        ({"sparsities": [0.01, 1.5]}, "task.sparsities"),
        ({"sparsities": []}, "task.sparsities"),
        ({"sparsities": [0.01, 0.02], "primary_sparsity": 0.05}, "task.primary_sparsity"),
        ({"decode_positions": 2048}, "task.decode_positions"),
        ({"spec_bits": 2}, "task.spec_zero_point"),  # SpeCache's zero point is 1-bit only
        ({"spec_bits": 1.3}, "task.spec_bits"),
        ({"spec_residual": 48}, "task.spec_residual"),
        ({"h2o_recent_ratio": 1.5}, "task.h2o_recent_ratio"),
        ({"layers": [3, 3]}, "task.layers"),
    ],
)
def test_bad_config(data_root, overrides, key):
    with pytest.raises(ConfigError) as err:
        hitrate(data_root, **overrides)
    assert err.value.key == key


def test_context_above_model_limit(data_root, tokenizer):
    task = hitrate(data_root, context_length=8193)
    with pytest.raises(ConfigError, match=r"task\.context_length=8193.*8192"):
        task.check_model(SHAPE, tokenizer)
    with pytest.raises(ConfigError, match=r"task\.layers"):
        hitrate(data_root, layers=[0, 30]).check_model(SHAPE, tokenizer)
    with pytest.raises(ConfigError, match=r"task\.windows"):
        hitrate(data_root, windows=1000).check_model(SHAPE, tokenizer)


@pytest.mark.parametrize("node", [{"name": "kivi", "bits": 2}, {"name": "fp16", "sink_tokens": 1}])
def test_only_the_fp16_method(data_root, node):
    class Runner:
        method = build_method(node)

    with pytest.raises(ConfigError, match="fp16 only"):
        hitrate(data_root).run({"id": "w0", "window": 0}, Runner())


def test_windows_from_the_book_body(data_root, tokenizer):
    task = hitrate(data_root, context_length=100, windows=2)
    ids = task.token_ids(tokenizer)
    assert task.window(tokenizer, 1) == ids[100:200]
    assert [s["id"] for s in task.samples()] == ["w0", "w1"]
    assert not tokenizer.decode(ids[:50]).lstrip().startswith("The Project Gutenberg")


# --- the real model ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_capture_speculative_forward_sees_the_exact_prefix(default_model, data_root):
    """Feeding the true tokens as the speculative ones must reproduce the window's own queries at
    those positions (same prefix, same position); a different token must give another query."""
    model, tok, shape = default_model
    ids = hitrate(data_root).token_ids(tok)[:48]
    cap = capture(model, ids, 3, [0, 29], shape.num_layers, speculative=ids[45:])
    for layer in (0, 29):
        assert cap.queries[layer].shape == (shape.num_heads, 48, shape.head_dim)
        assert torch.allclose(cap.spec_queries[layer], cap.queries[layer][:, 45:], atol=1e-4)
        assert torch.allclose(cap.spec_keys[layer], cap.keys[layer][:, 45:], atol=1e-4)
    other = capture(model, ids, 3, [29], shape.num_layers, speculative=[ids[10]] * 3)
    assert not torch.allclose(other.spec_queries[29], cap.queries[29][:, 45:], atol=1e-2)


@pytest.mark.slow
def test_real_run_rows(fp16_runner, data_root):
    task = hitrate(
        data_root, context_length=96, decode_positions=4, layers=[0, 29], sparsities=[0.05, 0.5, 1.0],
        primary_sparsity=0.05, spec_residual=32,
    )  # fmt: skip
    task.check_model(fp16_runner.shape, fp16_runner.tokenizer)
    row = task.run(task.samples()[0], fp16_runner)
    json.dumps(row)  # the row is what samples.jsonl stores
    assert row["layers"] == [0, 29] and row["context_length"] == 96
    assert row["budgets"] == {"0.05": 5, "0.5": 48, "1": 96}
    assert set(row["hit_rates"]) == set(POLICIES) == set(row["hit_rates_by_layer"])
    for policy in POLICIES:
        per = row["hit_rates"][policy]
        assert list(per) == ["0.05", "0.5", "1"]
        assert per["1"] == pytest.approx(1.0, abs=1e-5)
        assert 0 < per["0.05"] <= per["0.5"] <= per["1"] + 1e-6
        for s, values in row["hit_rates_by_layer"][policy].items():
            assert len(values) == 2
            assert per[s] == pytest.approx(sum(values) / 2)
            exact = row["hit_rates_by_layer"]["exact_topk"][s]
            assert all(e >= v - 1e-6 for e, v in zip(exact, values, strict=True))
    assert row["hit_rate"] == row["hit_rates"]["specache"]["0.05"]
    assert 0 <= row["spec_token_accuracy"] <= 1
    agg = task.aggregate([row, row])
    assert agg["n"] == 2 and agg["hit_rate/h2o/0.5"] == pytest.approx(row["hit_rates"]["h2o"]["0.5"])


@pytest.mark.slow
def test_real_run_row_shares_the_prompt_attention_bit_for_bit(
    fp16_runner, data_root, monkeypatch, h2o_prompt_queries
):
    """The task's row with the prompt attention computed once per layer equals, to the last bit, the
    row with it computed once per budget."""
    task = hitrate(
        data_root, context_length=96, decode_positions=4, layers=[0, 29], sparsities=[0.01, 0.05, 0.5, 1.0],
        primary_sparsity=0.05, spec_residual=32,
    )  # fmt: skip
    prompts = h2o_prompt_queries
    shared = task.run(task.samples()[0], fp16_runner)
    assert prompts == [92, 92]  # once per layer (budgets 1, 5, 48, 96: three caches each)
    prompts.clear()
    monkeypatch.setattr(task_module, "shared_prefill", contextlib.nullcontext)
    alone = task.run(task.samples()[0], fp16_runner)
    assert prompts == [92] * 6
    assert shared["hit_rates"] == alone["hit_rates"]
    assert shared["hit_rates_by_layer"] == alone["hit_rates_by_layer"]
    assert shared == alone


# --- analysis ----------------------------------------------------------------------------------------


def _rows():
    return [
        {"model": "m", "method": "fp16", "hit_rates": {"exact_topk": {"0.005": 0.8, "0.1": 1.0},
                                                        "h2o": {"0.005": 0.2, "0.1": 0.6}}},
        {"model": "m", "method": "fp16", "hit_rates": {"exact_topk": {"0.005": 0.6, "0.1": 0.9},
                                                        "h2o": {"0.005": 0.4, "0.1": 0.5}}},
    ]  # fmt: skip


def test_hitrate_table_and_figure(tmp_path):
    from kvbench.analysis.hitrate import hitrate_markdown, hitrate_table, plot_hitrate

    table = hitrate_table(_rows())
    first = table[(table.policy == "exact_topk") & (table.sparsity == 0.005)].iloc[0]
    assert first.hit_rate == pytest.approx(0.7) and first.n == 2
    assert first["sem"] == pytest.approx(0.1)  # std 0.1414 / sqrt(2)
    # the same numbers through a json_normalize'd frame (what load_samples gives)
    flat = hitrate_table(pd.json_normalize(_rows()))
    assert flat.hit_rate.tolist() == pytest.approx(table.hit_rate.tolist())
    md = hitrate_markdown(_rows())
    assert "| 0.5% | 0.700 | 0.300 |" in md
    fig = plot_hitrate(_rows(), tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 0
    lines = fig.axes[0].get_lines()
    assert len(lines) == 2 and list(lines[1].get_ydata()) == pytest.approx([0.3, 0.55])
