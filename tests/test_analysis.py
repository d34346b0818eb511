import json

from kvbench.analysis import load_runs, load_samples
from kvbench.results import RunFolder


def test_load_runs_and_samples(tmp_path):
    for method, score, bits in [("fp16", 1.0, 16.0), ("kivi-2b", 0.5, 3.2)]:
        folder = RunFolder(tmp_path / method)
        folder.append({"sample_id": "a", "score": score, "memory": {"effective_bits": bits}})
        metrics = {
            "task": "niah",
            "model": "m",
            "method": method,
            "seed": 0,
            "primary_metric": "score",
            "metrics": {"score": score, "n": 1},
            "memory": {"effective_bits": bits, "code_bits": 2.0, "compression": 16 / bits},
            "timings": {"run_s": 1.0},
        }
        (folder.path / "metrics.json").write_text(json.dumps(metrics))
    runs = load_runs(tmp_path).set_index("method")
    assert runs.loc["kivi-2b", "score"] == 0.5 and runs.loc["fp16", "effective_bits"] == 16.0
    samples = load_samples(tmp_path)
    assert sorted(samples["memory.effective_bits"]) == [3.2, 16.0]


def test_memory_quality_spreads_the_bits_and_keeps_labels_short():
    import pandas as pd

    from kvbench.analysis.figures import memory_quality

    means = pd.DataFrame(
        [
            ("fp16", "fp16", None, 16.0, 1.0),
            ("uniform[key_axis=channel]", "uniform-2b[key_axis=channel]", 2.0, 3.0, 0.2),
            ("uniform[key_axis=channel]", "uniform-4b[key_axis=channel]", 4.0, 5.0, 0.9),
            ("uniform[key_axis=token]", "uniform-2b[key_axis=token]", 2.0, 3.0, 0.1),
        ],
        columns=["family", "method", "bits", "effective_bits", "mean"],
    ).assign(ci_low=lambda f: f["mean"] - 0.05, ci_high=lambda f: f["mean"] + 0.05)
    ax = memory_quality(means).axes[0]
    assert ax.get_xscale() == "log"  # 3 and 5 bits apart from 16, not crowded at one end
    assert [t.get_text() for t in ax.get_xticklabels()] == ["3", "4", "6", "8", "12", "16"]
    # the legend names the families; a point says its grid value only; a lone point is unlabelled
    assert sorted(t.get_text() for t in ax.texts) == ["2b", "4b"]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert {"uniform[key_axis=channel] (2, 4 bits)", "uniform-2b[key_axis=token]"} <= set(legend)
