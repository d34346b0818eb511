"""``kvbench.analysis.load_results``: archives and run folders into one typed DataFrame."""

import json
import warnings

import pandas as pd
import pytest
from synthetic_runs import write_runs

from kvbench.analysis import NoResultsWarning, load_experiments, load_frame, load_results
from kvbench.analysis.archive import read_archive, write_archives
from kvbench.paths import source_checkout
from kvbench.tasks import declared_row_dtypes

RESULTS = source_checkout() / "results"


def test_committed_archives_load_as_one_typed_frame():
    frame = load_results(RESULTS)
    manifests = {p.parent.name: json.loads(p.read_text()) for p in RESULTS.glob("*/archive.json")}
    assert len(frame) == sum(m["rows"] for m in manifests.values())
    # one run (an fp16 reference) can serve several experiments: counted per experiment
    runs = frame.groupby(frame["experiment"].fillna(""))["run_id"].nunique()
    assert runs.sum() == sum(m["runs"] for m in manifests.values())
    assert not [c for c in frame.columns if ":" in c]  # plain names, not the archive's NAME:TYPE headers
    assert frame["bits"].dtype == "float64" and frame["seed"].dtype == "int64"
    assert frame["finished"].dtype == bool
    assert all(isinstance(c, dict) for c in frame["method_config"])
    # a column only some experiments fill is missing elsewhere, and keeps its integer type
    partial_int = [c for c in frame.columns if str(frame[c].dtype) == "Int64"]
    for column in partial_int:
        assert frame[column].isna().any() and frame[column].notna().any()


def test_one_experiment_equals_its_archive():
    frame = load_results(RESULTS, experiment="semkv_cliff")
    # the archive's own dtypes, except the row fields the task declares (Int64 / boolean)
    declared = declared_row_dtypes()
    stored = read_archive(RESULTS / "semkv_cliff").astype({c: declared[c] for c in frame if c in declared})
    pd.testing.assert_frame_equal(frame, stored)
    assert set(frame["experiment"]) == {"semkv_cliff"}
    # the archive file itself and its folder read the same
    pd.testing.assert_frame_equal(load_results(RESULTS / "semkv_cliff" / "samples.csv.gz"), frame)


def test_run_folders_and_their_archives_give_the_same_frame(tmp_path):
    runs = write_runs(tmp_path / "runs")
    direct = load_results(runs)
    declared = declared_row_dtypes()
    frame = load_frame(runs)
    pd.testing.assert_frame_equal(direct, frame.astype({c: declared[c] for c in frame if c in declared}))
    write_archives(runs, tmp_path / "results")
    archived = load_results(tmp_path / "results")
    # the archive leaves out the columns no run filled; every other column and value comes back
    assert set(archived.columns) <= set(direct.columns)
    empty = set(direct.columns) - set(archived.columns)
    assert all(direct[c].isna().all() for c in empty)
    shared = [c for c in archived.columns if c != "folder"]
    pd.testing.assert_frame_equal(archived[shared], direct[shared], check_dtype=False)
    assert (
        load_experiments(runs).keys() == load_experiments(tmp_path / "results").keys() == {"synthetic_cliff"}
    )
    assert load_results(runs, experiment="synthetic_cliff").shape == direct.shape


def test_nothing_found_warns_and_keeps_the_identity_columns(tmp_path):
    with pytest.warns(NoResultsWarning, match=f"no results under {tmp_path}: no samples.csv.gz archive"):
        frame = load_results(tmp_path)
    assert frame.empty and "experiment" in frame.columns and "run_id" in frame.columns
    with pytest.warns(NoResultsWarning, match="no archive of nope .archived experiments: attention_probe"):
        assert load_results(RESULTS, experiment="nope").empty
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        load_results(tmp_path / "missing")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # archives found: no warning
        load_results(RESULTS, experiment="specache_niah")
