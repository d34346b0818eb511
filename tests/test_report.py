import sys
import types
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import pytest
from synthetic_runs import SAMPLES, SEEDS, score, write_runs

from kvbench import report
from kvbench.tasks import TASKS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_ok(path):
    data = path.read_bytes()
    return data[:8] == PNG_MAGIC and len(data) > 5000


def test_report_writes_tables_and_figures(tmp_path, capsys, monkeypatch):
    # Stand-in NIAH heatmap owner, so the test does not depend on that module's state.
    fake = types.ModuleType("fake_niah")
    calls = []

    def heatmap(frame):
        calls.append(len(frame))
        fig, ax = plt.subplots()
        ax.imshow([[0, 1], [1, 0]])
        return fig

    fake.niah_heatmap = heatmap
    monkeypatch.setitem(sys.modules, "fake_niah", fake)
    monkeypatch.setitem(TASKS.get("niah").figures, "niah_heatmap", "fake_niah:niah_heatmap")

    runs = write_runs(tmp_path / "runs")
    rc = report.main([str(runs), "--out", str(tmp_path / "out"), "--resamples", "300"])
    assert rc == 0
    unit = tmp_path / "out" / "niah_tiny_synthetic_cliff"
    paired = pd.read_csv(unit / "paired.csv").set_index("method")
    hand = [score("uniform", 3, s, seed) - score("fp16", None, s, seed) for s in SAMPLES for seed in SEEDS]
    assert paired.loc["uniform-3b", "mean_diff"] == pytest.approx(sum(hand) / len(hand))
    assert paired.loc["uniform-2b", "verdict"] == "worse"
    assert pd.read_csv(unit / "cliff.csv").loc[0, "interval"] == "(2, 3]"
    means = pd.read_csv(unit / "means.csv").set_index("method")
    assert means.loc["uniform-4b", "mean"] == pytest.approx(22 / 24)
    assert len(pd.read_csv(tmp_path / "out" / "samples.csv")) == 96
    for name in ("cliff_map.png", "memory_quality.png", "niah_heatmap.png"):
        assert _png_ok(unit / name), name
    assert calls == [96]
    text = (tmp_path / "out" / "report.md").read_text()
    assert "TOST margin: 0.1" in text and "(2, 3]" in text and "superseded" not in text
    assert "Runs left out" in text  # the partial uniform-4b run
    assert "| uniform-2b | uniform | 2 |" in (unit / "paired.md").read_text()


def test_missing_figure_owner_is_a_note(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(TASKS.get("niah").figures, "niah_heatmap", "kvbench.analysis.no_such_module:f")
    runs = write_runs(tmp_path / "runs")
    assert report.main([str(runs), "--resamples", "200"]) == 0
    out = capsys.readouterr().out
    assert "note: kvbench.analysis.no_such_module.f is not available; niah_heatmap skipped" in out
    unit = runs / "report" / "niah_tiny_synthetic_cliff"
    assert _png_ok(unit / "cliff_map.png") and not (unit / "niah_heatmap.png").exists()


@pytest.mark.parametrize("kind", ["missing", "empty", "none"])
def test_bad_dir_is_one_line_exit_2(tmp_path, capsys, kind):
    args = {"missing": [str(tmp_path / "nope")], "empty": [str(tmp_path)], "none": []}[kind]
    assert report.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvbench.report: error: DIR=")
    expected = {"missing": "no such directory", "empty": "no runs found", "none": "give a folder of runs"}[
        kind
    ]
    assert expected in err[0]


def test_results_folder_rule(tmp_path, capsys, monkeypatch):
    """From a checkout the committed results/ is the default wherever the command runs; the papers
    and their claims ship inside the package, so they do not follow --results; --declarations
    names another folder of paper files."""
    from kvbench import paths

    repo = Path(__file__).resolve().parent.parent
    assert paths.source_checkout() == repo
    assert report.DEFAULT_RESULTS == repo / "results" and (paths.PAPERS_DIR / "kivi.yaml").is_file()
    monkeypatch.chdir(tmp_path)
    assert paths.default_results() == repo / "results"
    other = tmp_path / "elsewhere"
    other.mkdir()
    assert report.main(["--claims", "--results", str(other), "--declarations", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{other}: declarations='{other}': the folder holds no <paper>.yaml" in err[0]
    assert report.main(["--paper", "gear", "--results", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--paper=gear: no such paper; papers: kivi, intactkv" in err[0]
