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
