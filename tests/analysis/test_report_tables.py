import math

import numpy as np
import pandas as pd
import pytest
from synthetic_runs import CONFIGS, SAMPLES, SEEDS, label, score, write_runs

from kvbench.analysis.frame import groups, higher_is_better, load_frame, plan_of
from kvbench.analysis.tables import (
    cliff_table,
    config_means,
    is_binary,
    method_family,
    paired_table,
    to_markdown,
)


@pytest.fixture(scope="module")
def frame(tmp_path_factory):
    return load_frame(write_runs(tmp_path_factory.mktemp("runs")))


def _hand_mean_diff(bits):
    diffs = [
        score("uniform", bits, s, seed) - score("fp16", None, s, seed) for s in SAMPLES for seed in SEEDS
    ]
    return sum(diffs) / len(diffs)


def test_frame_has_one_row_per_sample_and_run(frame):
    assert len(frame) == len(CONFIGS) * len(SEEDS) * len(SAMPLES) == 96
    assert sorted(frame["method"].unique()) == ["fp16", "uniform-2b", "uniform-3b", "uniform-4b"]
    # The 3-row run of an older uniform-4b config is left out in favour of the full one.
    assert len(frame.attrs["superseded"]) == 1 and "uniform-4b" in frame.attrs["superseded"][0]
    assert not frame.duplicated(["method", "sample_id", "seed"]).any()
    row = frame[
        (frame["method"] == "uniform-3b") & (frame["sample_id"] == "s01") & (frame["seed"] == 0)
    ].iloc[0]
    assert row["score"] == 0.0 and row["bits"] == 3.0 and row["effective_bits"] == 4.0
    assert row["task"] == "niah" and row["model"] == "tiny" and row["experiment"] == "synthetic_cliff"
    assert frame.loc[frame["method"] == "fp16", "bits"].isna().all()
    assert frame["finished"].all()


def test_plan_is_read_from_config(frame):
    plan = plan_of(frame)
    assert plan["reference"] == "fp16" and plan["metric"] == "score"
    assert plan["margin"] == 0.1 and list(plan["grid"]) == [4, 3, 2]
    [(key, sub)] = groups(frame)
    assert key == ("niah", "tiny", "synthetic_cliff") and len(sub) == 96


def test_config_means(frame):
    means = config_means(frame, "score", n_resamples=500).set_index("method")
    assert means.loc["fp16", "mean"] == pytest.approx(22 / 24)
    assert means.loc["uniform-3b", "mean"] == pytest.approx(20 / 24)
    assert means.loc["uniform-2b", "mean"] == 0.0
    assert means.loc["uniform-3b", "n"] == 24 and means.loc["uniform-3b", "seeds"] == 2
    assert means.loc["uniform-3b", "effective_bits"] == 4.0 and means.loc["fp16", "effective_bits"] == 16.0
    assert means.loc["uniform-2b", "runaway_rate"] == 1.0 and means.loc["uniform-4b", "runaway_rate"] == 0.0
    # relative to the reference: fp16 against itself is 0; no synthetic answer loops
    assert means.loc["fp16", "runaway_rate"] == 0.0 and (means["degenerate_rate"] == 0.0).all()
    lo, hi = means.loc["uniform-3b", ["ci_low", "ci_high"]]
    assert lo < 20 / 24 < hi and 0 <= lo and hi <= 1
    assert means.loc["uniform-3b", "family"] == "uniform"


def test_paired_table_matches_hand_computed_differences(frame):
    paired = paired_table(frame, plan_of(frame), n_resamples=500).set_index("method")
    for bits in (4, 3, 2):
        assert paired.loc[label("uniform", bits), "mean_diff"] == pytest.approx(_hand_mean_diff(bits))
        assert paired.loc[label("uniform", bits), "n"] == 24
        assert paired.loc[label("uniform", bits), "n_missing"] == 0
    assert _hand_mean_diff(2) == pytest.approx(-22 / 24)
    # McNemar, 2b: 22 pairs where only the reference is right, none the other way.
    assert paired.loc["uniform-2b", "p_mcnemar"] == pytest.approx(2 * 0.5**22)
    assert paired.loc["uniform-3b", "p_mcnemar"] == pytest.approx(0.5)  # b=2, c=0
    assert paired.loc["uniform-4b", "p_mcnemar"] == 1.0
    # Holm over the three McNemar p-values: smallest x3, next x2 (clipped at 1).
    assert paired.loc["uniform-2b", "p_mcnemar_holm"] == pytest.approx(3 * 2 * 0.5**22)
    assert paired.loc["uniform-3b", "p_mcnemar_holm"] == 1.0
    assert paired.loc["uniform-2b", "verdict"] == "worse"
    # uniform-4b ties fp16 on every pair: no spread, so the paired-t TOST computes nothing (no p = 0
    # from a zero spread) and the tie is not called equivalent
    assert (
        paired.loc["uniform-4b", "verdict"] == "inconclusive" and not paired.loc["uniform-4b", "equivalent"]
    )
    assert paired.loc["uniform-2b", "ci_high"] < 0
    assert paired.loc["uniform-4b", "margin"] == 0.1


def test_cliff_table_brackets_the_grid(frame):
    paired = paired_table(frame, plan_of(frame), n_resamples=500)
    cliff = cliff_table(paired).set_index("family")
    assert cliff.loc["uniform", "interval"] == "(2, 3]"
    assert cliff.loc["uniform", "last_ok"] == 3.0 and cliff.loc["uniform", "first_bad"] == 2.0
    assert cliff.loc["uniform", "grid"] == "4 3 2"


def test_lower_is_better_metric_flips_the_difference():
    rows = []
    for sid in range(6):
        rows.append({"method": "fp16", "bits": math.nan, "sample_id": str(sid), "seed": 0, "ppl": 10.0 + sid})
        rows.append({"method": "kivi-2b", "bits": 2.0, "sample_id": str(sid), "seed": 0, "ppl": 12.0 + sid})
    frame = pd.DataFrame(rows)
    plan = {"reference": "fp16", "metric": "ppl", "alpha": 0.05, "margin": None}
    paired = paired_table(frame, plan, n_resamples=200)
    # reference - method: the method's perplexity is 2 higher, so it is 2 worse.
    assert paired.iloc[0]["mean_diff"] == pytest.approx(-2.0)
    assert paired.iloc[0]["equivalent"] is None and np.isnan(paired.iloc[0]["tost_p"])
    assert np.isnan(paired.iloc[0]["p_mcnemar"])  # not a binary metric
    assert not higher_is_better("ppl") and higher_is_better("score")
    # the attention probe's errors, and a path into its per-layer column, are lower-is-better
    assert not higher_is_better("rel_err") and not higher_is_better("rel_err_pooled")
    assert not higher_is_better("rel_err_by_layer.4") and higher_is_better("hit_rates.exact_topk.0.005")


def test_helpers():
    assert method_family("kivi-2b", 2.0) == "kivi"
    assert method_family("kivi-1b-specache0", 1.0) == "kivi-specache0"
    assert method_family("uniform-2.322b", 2.322) == "uniform"
    assert method_family("fp16", math.nan) == "fp16"
    assert is_binary([0, 1, 1.0]) and not is_binary([0, 0.5, 1])
    table = pd.DataFrame({"name": ["a|b"], "p": [1.5e-7], "x": [0.123456], "ok": [True], "m": [math.nan]})
    md = to_markdown(table).splitlines()
    assert md[0] == "| name | p | x | ok | m |"
    assert md[2] == "| a\\|b | 1.50e-07 | 0.1235 | yes | - |"


def test_arms_sharing_a_label_stay_apart_and_grid_key_follows_the_plan(tmp_path):
    from kvbench.results import RunFolder, run_id

    plan = {"name": "arms", "reference": "fp16", "metric": "score", "grid_key": "method.topk", "margin": 0.1}
    arms = [  # (method node, per-sample score); the two uniform arms share the label uniform-2b
        (None, 1.0),
        ({"name": "uniform", "bits": 2, "key_axis": "token"}, 0.0),
        ({"name": "uniform", "bits": 2, "key_axis": "channel"}, 1.0),
        ({"name": "specache", "bits": 1, "topk": 16}, 1.0),
        ({"name": "specache", "bits": 1, "topk": 0}, 0.0),
    ]
    for node, value in arms:
        config = {
            "task": {"name": "niah"},
            "model": {"name": "m"},
            "method": node,
            "seed": 0,
            "analysis": plan,
        }
        name = "fp16" if node is None else node["name"]
        lab = (
            name
            if node is None
            else f"{name}-{node['bits']}b" + (f"-k{node['topk']}" if "topk" in node else "")
        )
        folder = RunFolder(tmp_path / lab / run_id(config))
        folder.write_config({**config, "run_id": run_id(config)})
        for i in range(10):  # 10 pairs: exact sign-flip p = 2/1024, below 0.05 after Holm over 4
            folder.append({"sample_id": f"x{i}", "seed": 0, "method": lab, "score": value, "task": "niah"})
    frame = load_frame(tmp_path)
    assert sorted(frame["method"].unique()) == [
        "fp16",
        "specache-1b-k0",
        "specache-1b-k16",
        "uniform-2b[key_axis=channel]",
        "uniform-2b[key_axis=token]",
    ]
    assert frame.attrs["superseded"] == []
    paired = paired_table(frame, plan_of(frame), n_resamples=200).set_index("method")
    assert paired.loc["uniform-2b[key_axis=token]", "mean_diff"] == -1.0
    assert paired.loc["uniform-2b[key_axis=channel]", "mean_diff"] == 0.0
    assert paired.loc["specache-1b-k16", "family"] == "specache-1b"
    assert paired.loc["specache-1b-k16", "grid_value"] == 16.0
    cliff = cliff_table(paired, "grid_value").set_index("family")
    assert cliff.loc["specache-1b", "grid"] == "16 0" and cliff.loc["specache-1b", "first_bad"] == 0.0


def test_repeated_sample_rows_keep_the_first(tmp_path):
    from kvbench.results import RunFolder

    folder = RunFolder(tmp_path / "run")
    folder.write_config({"task": {"name": "niah"}, "model": {"name": "m"}, "seed": 0, "run_id": "r"})
    for sid, value in [("a", 1.0), ("b", 0.0), ("b", 1.0)]:
        folder.append({"sample_id": sid, "seed": 0, "method": "fp16", "score": value})
    frame = load_frame(tmp_path)
    assert list(frame["sample_id"]) == ["a", "b"] and list(frame["score"]) == [1.0, 0.0]
    assert frame.attrs["duplicate_rows"] == {str(folder.path): 1}


def test_task_variants_are_separate_units(tmp_path):
    from kvbench.results import RunFolder

    for lengths, extra in (([512], {}), ([1024], {}), ([1024], {"new_knob": 1})):
        config = {
            "task": {"name": "niah", "context_lengths": lengths, **extra},
            "model": {"name": "m"},
            "seed": 0,
        }
        folder = RunFolder(tmp_path / f"{lengths[0]}-{len(extra)}")
        folder.write_config({**config, "run_id": f"{lengths[0]}-{len(extra)}"})
        folder.append({"sample_id": f"L{lengths[0]}", "seed": 0, "method": "fp16", "score": 1.0})
    frame = load_frame(tmp_path)
    keys = [key for key, _ in groups(frame)]
    # The run that only adds a knob is the same configuration as the other 1024 run (superseded).
    assert keys == [("niah", "m", "[context_lengths=[1024]]"), ("niah", "m", "[context_lengths=[512]]")]
    assert len(frame.attrs["superseded"]) == 1 and len(frame) == 2
