"""Run folders: results written atomically, resume skips finished samples, run ids are stable."""

import json

import pytest

from kvbench import run as run_module
from kvbench.models import model_node
from kvbench.results import RunFolder, run_id
from kvbench.tasks.niah import NIAH


def tiny_config(root, data_root, method=None):
    cfg = {
        "model": model_node("smollm2-135m"),
        "task": {"name": "niah", "context_lengths": [256, 320], "depths": [0, 100], "max_new_tokens": 3},
        "seed": 0,
        "bits": 2,
        "device": "cpu",
        "output": {"root": str(root), "resume": True},
        "data": {"root": str(data_root)},
    }
    if method:
        cfg["method"] = method
    return cfg


def test_killed_run_resumes_without_redoing_finished_samples(tmp_path, data_root, monkeypatch):
    cfg = tiny_config(tmp_path, data_root, {"name": "kivi", "bits": 2, "group_size": 32, "residual": 64})
    calls = []
    original = NIAH.run

    def dying_run(self, sample, runner):
        calls.append(sample["id"])
        if len(calls) == 3:
            raise KeyboardInterrupt  # the job is killed while on its third sample
        return original(self, sample, runner)

    monkeypatch.setattr(NIAH, "run", dying_run)
    with pytest.raises(KeyboardInterrupt):
        run_module.execute(cfg, progress=False)
    folders = list(tmp_path.glob("niah/smollm2-135m/kivi-2b/seed0-*"))
    assert len(folders) == 1
    assert len(RunFolder(folders[0]).rows()) == 2
    assert not (folders[0] / "metrics.json").exists()

    calls.clear()
    monkeypatch.setattr(NIAH, "run", original)
    monkeypatch.setattr(NIAH, "run", lambda self, s, r: (calls.append(s["id"]), original(self, s, r))[1])
    metrics = run_module.execute(cfg, progress=False)
    assert len(calls) == 2  # only the two unfinished samples ran
    rows = RunFolder(folders[0]).rows()
    assert sorted(r["sample_id"] for r in rows) == sorted(["L256_d0", "L256_d100", "L320_d0", "L320_d100"])
    assert metrics["metrics"]["n"] == 4
    assert metrics["timings"]["samples_resumed"] == 2
    written = json.loads((folders[0] / "metrics.json").read_text())
    assert written["run_id"] == metrics["run_id"]
    assert 2.0 < written["memory"]["effective_bits"] < 16.0

    # a resubmitted sweep: the point is complete, so not even the model is loaded
    import kvbench.models

    monkeypatch.setattr(
        kvbench.models, "load_model", lambda *a, **k: pytest.fail("model loaded for a finished run")
    )
    again = run_module.execute(cfg, progress=False)
    assert again["run_id"] == metrics["run_id"] and again["metrics"] == written["metrics"]
    assert len(RunFolder(folders[0]).rows()) == 4


def test_truncated_last_line_is_dropped(tmp_path):
    folder = RunFolder(tmp_path)
    folder.append({"sample_id": "a", "score": 1.0})
    with open(folder.samples_path, "a") as f:
        f.write('{"sample_id": "b", "sco')  # killed mid-write
    assert [r["sample_id"] for r in folder.resume_rows()] == ["a"]
    folder.append({"sample_id": "b", "score": 0.5})
    assert [r["sample_id"] for r in folder.rows()] == ["a", "b"]


def test_run_id_ignores_paths_but_not_knobs():
    base = {
        "model": {"name": "m"},
        "task": {"name": "niah"},
        "bits": 2,
        "method": {"name": "kivi", "bits": 2},
        "output": {"root": "a"},
    }
    assert run_id(base) == run_id({**base, "output": {"root": "b"}, "data": {"root": "/x"}})
    assert run_id(base) != run_id({**base, "bits": 3, "method": {"name": "kivi", "bits": 3}})
    assert run_id(base) != run_id({**base, "task": {"name": "niah", "version": 2}})


def test_run_id_ignores_the_analysis_plan():
    base = {
        "model": {"name": "m"},
        "task": {"name": "niah"},
        "bits": 2,
        "method": {"name": "uniform", "bits": 2},
    }
    plan = {"name": "semkv_cliff", "alpha": 0.05, "margin": 0.05, "n": 3, "seeds": [0, 1, 2]}
    assert run_id(base) == run_id({**base, "analysis": plan})
    assert run_id(base) == run_id({**base, "analysis": {**plan, "alpha": 0.1}})


def test_fp16_gets_one_run_id_whatever_the_top_level_bits():
    fp16 = {"name": "fp16", "fp_dtype": "float16", "sink_tokens": 0}
    base = {"model": {"name": "m"}, "task": {"name": "niah"}, "method": fp16}
    ids = {run_id({**base, "bits": b}) for b in (1, 1.585, 2, 4, None)}
    assert len(ids) == 1
    # no method at all is the FP16 baseline as well
    bare = {"model": {"name": "m"}, "task": {"name": "niah"}}
    assert run_id({**bare, "bits": 1}) == run_id({**bare, "bits": 4})
    # a method that reads bits keeps them in the id
    uniform = {**base, "method": {"name": "uniform", "bits": 2.0}}
    assert run_id({**uniform, "bits": 2}) != run_id(
        {**uniform, "bits": 3, "method": {"name": "uniform", "bits": 3.0}}
    )


def test_run_folder_lock_admits_one_writer_at_a_time(tmp_path, capsys):
    import threading

    folder = RunFolder(tmp_path)
    entered = threading.Event()

    def second_writer():
        with RunFolder(tmp_path).lock():
            entered.set()

    with folder.lock():
        thread = threading.Thread(target=second_writer)
        thread.start()
        assert not entered.wait(0.5)  # blocked while the first holds the folder
    thread.join(timeout=10)
    assert entered.is_set()  # and admitted once it is released
    assert "in use by another process" in capsys.readouterr().err


def test_a_folder_without_results_is_discarded_with_its_empty_parents(tmp_path):
    root = tmp_path / "runs"
    unused = RunFolder(root / "niah" / "m" / "kvquant" / "seed0-a")
    unused.write_config({"seed": 0})
    (unused.path / ".lock").touch()
    kept = RunFolder(root / "niah" / "m" / "kivi" / "seed0-b")
    kept.write_config({"seed": 0})
    kept.append({"sample_id": "s0", "score": 1.0})
    assert unused.discard_if_unused(root)
    assert not (root / "niah" / "m" / "kvquant").exists()  # its empty parent went too
    assert not kept.discard_if_unused(root)  # a sample row is a result: nothing is removed
    assert [r["sample_id"] for r in kept.rows()] == ["s0"] and root.is_dir()
