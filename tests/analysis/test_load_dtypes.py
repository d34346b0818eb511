"""``load_results`` gives a task's whole-number and flag row fields the same nullable dtypes
(``Int64``, ``boolean``) whether it reads an archive or the run folders it was written from."""

from __future__ import annotations

import pandas as pd
import pytest

from kvbench.analysis import load_results
from kvbench.analysis.archive import write_archives
from kvbench.results import RunFolder, run_id

DECLARED = {"context_length": "Int64", "depth": "Int64", "generated_tokens": "Int64", "stopped": "boolean"}


def _run(root, task: str, rows: list[dict], experiment: str = "tiny_mix", seed: int = 0) -> None:
    config = {
        "task": {"name": task},
        "model": {"name": "tiny"},
        "method": None,
        "bits": None,
        "seed": seed,
        "analysis": {"name": experiment, "reference": "fp16", "metric": "score"},
    }
    rid = run_id(config)
    folder = RunFolder(root / task / "tiny" / "fp16" / f"seed{seed}-{rid}")
    folder.write_config({**config, "run_id": rid})
    for row in rows:
        folder.append({"seed": seed, "task": task, "model": "tiny", "method": "fp16", "bits": None, **row})


@pytest.fixture
def tiny_runs(tmp_path):
    """One experiment of two tasks: NIAH rows carry the four declared fields (one row of a
    generation that hit its limit, one stopped), perplexity rows none of them, so in the experiment's
    frame (and its archive) each of those columns has gaps."""
    root = tmp_path / "runs"
    _run(
        root,
        "niah",
        [
            {"sample_id": "L256_d0", "context_length": 256, "depth": 0, "score": 1.0, "prediction": "x",
             "generated_tokens": 3, "stopped": True},
            {"sample_id": "L512_d50", "context_length": 512, "depth": 50, "score": 0.5, "prediction": "y",
             "generated_tokens": 8, "stopped": False},
        ],
    )  # fmt: skip
    _run(root, "perplexity", [{"sample_id": "w0", "ppl": 12.5, "nll": 2.52, "prediction": ""}])
    return root


def test_archive_and_run_folders_give_the_declared_dtypes(tiny_runs, tmp_path):
    written = write_archives(tiny_runs, tmp_path / "results")
    assert list(written) == ["tiny_mix"]
    archived = load_results(tmp_path / "results")
    from_runs = load_results(tiny_runs)
    niah_only = load_results(tiny_runs / "niah")  # one task: no gaps in any of the four columns
    for frame in (archived, from_runs, niah_only):
        assert {c: str(frame[c].dtype) for c in DECLARED} == DECLARED
    # the values themselves, missing where perplexity has none
    by_id = archived.set_index("sample_id")
    assert by_id.loc["L512_d50", "context_length"] == 512 and by_id.loc["L512_d50", "depth"] == 50
    assert not by_id.loc["L512_d50", "stopped"] and by_id.loc["L256_d0", "stopped"]
    assert pd.isna(by_id.loc["w0", "generated_tokens"]) and pd.isna(by_id.loc["w0", "stopped"])
    shared = [c for c in archived.columns if c != "folder"]
    pd.testing.assert_frame_equal(
        archived[shared].sort_values("sample_id", ignore_index=True),
        from_runs[shared].sort_values("sample_id", ignore_index=True),
    )


def test_the_archive_itself_stores_gappy_columns_as_before(tiny_runs, tmp_path):
    # The dtypes are given on reading: the archive's bytes (the committed results) do not change.
    import gzip

    write_archives(tiny_runs, tmp_path / "results")
    header = gzip.decompress((tmp_path / "results" / "tiny_mix" / "samples.csv.gz").read_bytes())
    header = header.decode().splitlines()[0].split(",")
    assert {"context_length:float", "depth:float", "generated_tokens:float", "stopped:json"} <= set(header)


def test_a_value_that_does_not_fit_leaves_the_column_as_it_is(tmp_path):
    _run(tmp_path, "niah", [{"sample_id": "a", "context_length": 256.5, "depth": 0, "score": 1.0}])
    frame = load_results(tmp_path)
    assert frame["context_length"].dtype == "float64" and str(frame["depth"].dtype) == "Int64"
