import gzip
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from matplotlib import image
from synthetic_claims import shipped_tables, write_claim_runs, write_paper
from synthetic_runs import write_runs

from kvbench import report
from kvbench.analysis.archive import (
    ARCHIVE,
    MANIFEST,
    frames_from_runs,
    from_csv_bytes,
    load_archives,
    read_archive,
    to_csv_bytes,
    write_archive,
    write_archives,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    write_runs(root / "cliff")  # experiment synthetic_cliff, with a superseded partial run
    write_claim_runs(root / "claims")  # experiment semkv_cliff, with dict columns (hit_rates)
    return root


def test_typed_csv_round_trips_awkward_values():
    frame = pd.DataFrame(
        {
            "f": [0.1 + 0.2, math.nan, 1e-300, -0.0],
            "i": [1, 2, 3, -4],
            "b": [True, False, True, True],
            "s": ["a,b", 'quote "x"', "line\nbreak", "ünï"],
            "maybe": ["x", None, "", "NA"],
            "j": [{"k": [1, 2]}, None, [0.5], {"0.005": 0.9}],
            "flag": [True, None, False, True],
        }
    )
    back = from_csv_bytes(to_csv_bytes(frame))
    pd.testing.assert_frame_equal(back, frame)
    assert back.loc[0, "f"] == 0.1 + 0.2  # bit for bit, not to 15 digits
    header = to_csv_bytes(frame).decode().splitlines()[0]
    assert header == "f:float,i:int,b:bool,s:str,maybe:strna,j:json,flag:json"
    with pytest.raises(ValueError, match="NAME:TYPE"):
        from_csv_bytes(b"f,i\n1,2\n")


def test_archive_reads_back_the_frame_it_was_written_from(runs, tmp_path):
    direct = frames_from_runs(runs)
    assert sorted(direct) == ["semkv_cliff", "synthetic_cliff"]
    paths = write_archives(runs, tmp_path)
    loaded = load_archives(tmp_path)
    assert sorted(loaded) == sorted(direct)
    for name, frame in direct.items():
        pd.testing.assert_frame_equal(loaded[name], frame)
        assert loaded[name].attrs == frame.attrs
        # folders are stored relative to the runs root
        assert not any(str(f).startswith("/") for f in frame["folder"])
    assert len(direct["synthetic_cliff"].attrs["superseded"]) == 1
    assert direct["semkv_cliff"].attrs["superseded"] == []
    hit = loaded["semkv_cliff"].dropna(subset=["hit_rates"])["hit_rates"].iloc[0]
    assert set(hit) == {"exact_topk", "h2o"}
    # the same frame writes the same bytes (no gzip timestamp), and the manifest says what it holds
    before = paths["semkv_cliff"].read_bytes()
    write_archives(runs, tmp_path)
    assert paths["semkv_cliff"].read_bytes() == before
    manifest = yaml.safe_load((tmp_path / "semkv_cliff" / MANIFEST).read_text())
    assert manifest["rows"] == len(direct["semkv_cliff"]) and manifest["models"] == ["tiny"]
    assert manifest["bytes"] == len(before) < 20_000
    assert gzip.decompress(before).startswith(b"run_id:str,")


def test_a_tampered_archive_is_refused(runs, tmp_path):
    write_archives(runs, tmp_path)
    path = tmp_path / "synthetic_cliff" / ARCHIVE
    path.write_bytes(gzip.compress(gzip.decompress(path.read_bytes()).replace(b"uniform-3b", b"uniform-9b")))
    with pytest.raises(ValueError, match="checksum"):
        read_archive(path.parent)


def _paper_files(tmp_path):
    arms = {
        "chan": {"method": "kivi", "bits": 2, "config": {"key_axis": "channel"}},
        "fp16": {"method": "fp16"},
    }
    uniform = {"uniform": {"method": "uniform"}, "fp16": {"method": "fp16"}}
    base = {"where": "Table 1", "statement": "s", "published": "p"}
    claims = [
        {
            **base,
            "id": "c-better",
            "experiment": "semkv_cliff",
            "arms": arms,
            # chan ties fp16 on all 24 pairs: the exact test shows it at 0.2 (0.8 ** 24), not at 0.1
            "rule": "not_worse(chan, fp16, margin=0.2)",
        },
        {
            **base,
            "id": "c-cliff",
            "experiment": "synthetic_cliff",
            "arms": uniform,
            # uniform-3b loses 2 of 24 pairs: exactly equivalent at a 0.3 margin (P(X <= 2) = 0.012
            # for X ~ Bin(24, 0.3)), not at 0.2 (0.11) nor at the plan's 0.1
            "rule": 'cliff_within(uniform, fp16, "(2, 3]", margin=0.3)',
        },
        {**base, "id": "c-missing", "experiment": "kivi_gsm8k", "arms": arms, "rule": "better(chan, fp16)"},
    ]
    # the shipped SemKV tables with these claims: the page shows both
    return write_paper(tmp_path / "papers", claims, paper="semkv", tables=shipped_tables("semkv"))


def _outputs(folder):
    return {
        p.relative_to(folder): p
        for p in folder.rglob("*")
        if p.is_file() and p.name not in (ARCHIVE, MANIFEST)
    }


def test_results_from_the_archive_match_results_from_the_runs(runs, tmp_path):
    """What `make results` rebuilds from the archives is what the run folders give directly:
    markdown and CSV byte for byte, figures pixel for pixel."""
    claims = _paper_files(tmp_path)
    kwargs = {"declarations": claims, "n_resamples": 200, "conf_dir": None, "say": lambda *_: None}
    direct = tmp_path / "direct"
    report.regenerate(frames_from_runs(runs), direct, **kwargs)
    archived = tmp_path / "archived"
    write_archives(runs, archived)
    report.regenerate(load_archives(archived), archived, **kwargs)

    a, b = _outputs(direct), _outputs(archived)
    assert sorted(a) == sorted(b)
    texts = [k for k in a if k.suffix in (".md", ".csv")]
    pngs = [k for k in a if k.suffix == ".png"]
    assert len(texts) >= 10 and len(pngs) >= 4
    for key in texts:
        assert a[key].read_bytes() == b[key].read_bytes(), key
    for key in pngs:
        pa, pb = image.imread(a[key]), image.imread(b[key])
        assert pa.shape == pb.shape and np.abs(pa - pb).max() <= 1 / 255, key
    verdicts = pd.read_csv(direct / "claims" / "tiny.csv").set_index("id")["verdict"]
    assert verdicts.to_dict() == {"c-better": "reproduced", "c-cliff": "reproduced", "c-missing": "not run"}
    # the default model has a table too, every claim "not run" there
    default = pd.read_csv(direct / "claims" / "smollm2-135m.csv")
    assert set(default["verdict"]) == {"not run"}
    assert (direct / "synthetic_cliff" / "report.md").read_text().startswith("# Report: `synthetic_cliff`")
    # the paper page puts each claim's published value beside the measured one, then the paper's own
    # table (the cliff: bits down, uniform / TurboQuant / FP16 across), what it leaves out, and the
    # generic rows of a claim's node that no table reads
    page = (direct / "papers" / "semkv_tiny.md").read_text()
    assert "| c-better | Table 1 | p | chan - fp16 = " in page and "| reproduced |" in page
    assert "## SemKV: the quality cliff" in page and "| 2 | 0.000 [0.000, 0.000] | collapsed | - |" in page
    assert "not in this table: kivi-2b[key_axis=channel], kivi-2b[key_axis=token], ott-2b." in page
    assert "## synthetic_cliff" in page
    assert "No runs on tiny yet: `python -m kvbench -m +experiment=kivi_gsm8k`" in page


def test_cli_archive_then_regenerate(runs, tmp_path, capsys):
    results = tmp_path / "results"
    assert report.main(["--archive", str(runs), "--results", str(results)]) == 0
    assert "samples.csv.gz" in capsys.readouterr().out
    claims = _paper_files(tmp_path)
    # claims on synthetic experiments: the node check would refuse synthetic_cliff, so the
    # regenerate path is driven through the function with conf_dir=None in the test above; here the
    # command must fail with one line naming the missing node.
    code = report.main(
        ["--regenerate", "--results", str(results), "--declarations", str(claims), "--resamples", "50"]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no node conf/experiment/synthetic_cliff.yaml" in err[0]
    assert report.main(["--archive", str(tmp_path / "nope")]) == 2


def test_compare_finds_the_one_changed_value_and_the_runs_the_archive_lacks(runs, tmp_path, capsys):
    """A rerun is checked against the archive sample by sample: identical runs pass, one changed
    score or generated text is named with its count, and a run the archive lacks is unmatched."""
    results = tmp_path / "results"
    write_archives(runs, results)
    assert report.main(["--compare", str(runs), "--results", str(results)]) == 0
    out = capsys.readouterr().out
    total = sum(len(f) for f in frames_from_runs(runs).values())
    assert f"compare: {total} of {total} rows identical" in out

    folder = results / "semkv_cliff"
    frame = read_archive(folder)
    first = frame.index[(frame["method"] == "ott-2b")][0]
    frame.loc[first, "score"] += 0.5
    frame.loc[frame.index[frame["method"] == "fp16"][0], "prediction"] = "another answer"
    frame = frame[frame["method"] != "uniform-4b"]  # a configuration the archive never held
    write_archive(frame, folder)
    assert report.main(["--compare", str(runs), "--results", str(results)]) == 1
    rows = {line.split()[2]: line for line in capsys.readouterr().out.splitlines() if "semkv_cliff" in line}
    fields = rows["ott-2b"].split()
    n = int(fields[3])  # rows, archived, identical, max_abs_diff
    assert fields[4:7] == [str(n), str(n - 1), "0.5"]
    assert "score (1)" in rows["ott-2b"] and "prediction (1)" in rows["fp16"]
    assert rows["uniform-4b"].split()[4:6] == ["0", "0"]
    assert report.main(["--compare", str(tmp_path / "nope")]) == 2


def test_committed_results_regenerate_from_the_committed_archives(tmp_path):
    """`make results` on a fresh checkout rewrites the committed outputs byte for byte (figures:
    pixel for pixel): each experiment with an archive, and the claim verdicts."""
    repo_results = Path(__file__).resolve().parents[2] / "results"
    frames = load_archives(repo_results)
    out = tmp_path / "results"
    written = report.regenerate(frames, out, say=lambda *_: None)
    assert any(p.parent.name == "claims" for p in written)
    regenerated = _outputs(out)
    assert regenerated
    for key, path in regenerated.items():
        committed = repo_results / key
        assert committed.exists(), f"results/{key} is not committed; run make results"
        if key.suffix == ".png":
            assert image.imread(committed).shape == image.imread(path).shape, key
            assert np.abs(image.imread(committed) - image.imread(path)).max() <= 1 / 255, key
        else:
            assert committed.read_bytes() == path.read_bytes(), f"results/{key} differs; run make results"
    # and nothing else sits there: every committed file under results/ is an output of `make results`
    # (the declarations, archives and manifests are its inputs; run folders are git-ignored)
    committed = {key for key in _outputs(repo_results) if key.parts[0] != "runs" and key.suffix != ".gz"}
    assert committed <= set(regenerated), (
        f"not written by make results: {sorted(committed - set(regenerated))}"
    )
    # the README's results section is the same generated block
    readme = (repo_results.parent / "README.md").read_text()
    begin, end = readme.index(report.README_BEGIN), readme.index(report.README_END)
    by_model = report.claims_results(frames)
    block = report.readme_block(by_model, frames)
    assert readme[begin : end + len(report.README_END)] + "\n" == block, (
        "README results differ; run make results"
    )


def test_archiving_one_model_keeps_the_other_models_rows(tmp_path):
    """An experiment's archive is replaced model by model: archiving a second model's runs keeps the
    first model's rows, and archiving the first model again (a clean clone rerunning the default
    model's nodes) keeps the second's. Either order gives the bytes of one runs root holding both."""
    import shutil

    first, second, both = tmp_path / "first", tmp_path / "second", tmp_path / "both"
    write_runs(first, model="tiny")
    write_runs(second, model="other")
    shutil.copytree(first, both)
    shutil.copytree(second, both, dirs_exist_ok=True)
    write_archives(both, tmp_path / "joint")
    joint = (tmp_path / "joint" / "synthetic_cliff" / ARCHIVE).read_bytes()
    assert set(read_archive(tmp_path / "joint" / "synthetic_cliff")["model"]) == {"tiny", "other"}

    for order in ((first, second), (second, first), (first, second, first)):
        results = tmp_path / f"merged-{len(order)}-{order[0].name}"
        for runs in order:
            write_archives(runs, results)
        frame = read_archive(results / "synthetic_cliff")
        assert (results / "synthetic_cliff" / ARCHIVE).read_bytes() == joint, [r.name for r in order]
        assert frame.groupby("model").size().to_dict() == {"other": 96, "tiny": 96}
        # each model's superseded partial run stays listed
        assert sorted(Path(f).parts[1] for f in frame.attrs["superseded"]) == ["other", "tiny"]


def test_archiving_a_model_again_replaces_its_rows(tmp_path):
    """The runs of a model that the archive holds replace that model's rows: nothing of its old rows
    is kept beside them."""
    runs = write_runs(tmp_path / "runs")
    results = tmp_path / "results"
    write_archives(runs, results)
    before = read_archive(results / "synthetic_cliff")
    sub = tmp_path / "fewer"
    kept = [p for p in (runs / "niah" / "tiny").iterdir() if p.name.startswith("fp16")]
    for path in kept:
        import shutil

        shutil.copytree(path, sub / "niah" / "tiny" / path.name)
    write_archives(sub, results)
    after = read_archive(results / "synthetic_cliff")
    assert set(after["method"]) == {"fp16"} < set(before["method"])


def test_adding_runs_to_an_archive_gives_the_archive_of_all_runs(tmp_path):
    """New arms of a node whose other runs live only in the archive: archiving them with ``add``
    keeps every stored run and labels the union as one runs root holding all of them would, down to
    the bytes (here the new arm shares its label with a stored one and differs in a knob, so both
    get a suffix they did not have); without ``add`` the new runs replace their model's rows."""
    import json
    import shutil

    both = write_runs(tmp_path / "both")
    for folder in sorted((both / "niah" / "tiny" / "uniform-3b").iterdir()):
        twin = folder.with_name(folder.name + "g64")
        shutil.copytree(folder, twin)
        for path, group in ((folder, 32), (twin, 64)):
            config = json.loads((path / "config.json").read_text())
            config["method"]["group_size"] = group
            (path / "config.json").write_text(json.dumps(config))
    write_archives(both, tmp_path / "joint")
    joint = (tmp_path / "joint" / "synthetic_cliff" / ARCHIVE).read_bytes()
    assert {"uniform-3b[group_size=32]", "uniform-3b[group_size=64]"} <= set(
        read_archive(tmp_path / "joint" / "synthetic_cliff")["method"]
    )

    stored, added = tmp_path / "stored", tmp_path / "added"
    for folder in sorted((both / "niah" / "tiny").glob("*/*")):
        target = added if folder.name.endswith("g64") or folder.parent.name == "uniform-2b" else stored
        shutil.copytree(folder, target / folder.relative_to(both))
    results = tmp_path / "results"
    write_archives(stored, results)
    assert "uniform-3b" in set(read_archive(results / "synthetic_cliff")["method"])
    assert report.main(["--archive", str(added), "--add", "--results", str(results)]) == 0
    assert (results / "synthetic_cliff" / ARCHIVE).read_bytes() == joint
    assert report.main(["--add", "--results", str(results)]) == 2  # --add means nothing alone

    # a rerun of a stored configuration and seed into another folder supersedes the stored run
    fp16 = sorted((stored / "niah" / "tiny" / "fp16").iterdir())[0]
    rerun = tmp_path / "rerun" / "niah" / "tiny" / "fp16" / (fp16.name + "again")
    shutil.copytree(fp16, rerun)
    before = read_archive(results / "synthetic_cliff")
    write_archives(tmp_path / "rerun", results, add=True)
    after = read_archive(results / "synthetic_cliff")
    assert len(after) == len(before)
    assert set(after["folder"]) == set(before["folder"]) - {str(fp16.relative_to(stored))} | {
        str(rerun.relative_to(tmp_path / "rerun"))
    }
    assert str(fp16.relative_to(stored)) in after.attrs["superseded"]

    replaced = tmp_path / "replaced"
    write_archives(stored, replaced)
    write_archives(added, replaced)
    methods = set(read_archive(replaced / "synthetic_cliff")["method"])
    assert not any(m.startswith(("fp16", "uniform-4b")) for m in methods)
