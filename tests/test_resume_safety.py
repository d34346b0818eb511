"""A run folder trusts its samples: resume refuses rows other code wrote, metrics.json is checked
against the rows, duplicate and unknown rows are set aside, and SIGINT/SIGTERM end a run with one
line that says how far it got."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_run import tiny_config

from kvbench import run as run_module
from kvbench.errors import ConfigError, Interrupted
from kvbench.results import RunFolder
from kvbench.tasks.niah import NIAH

KIVI = {"name": "kivi", "bits": 2, "group_size": 32, "residual": 64}


def _interrupted_run(cfg, monkeypatch, after: int = 2) -> RunFolder:
    """Run ``cfg`` until ``after`` samples are stored, then Ctrl-C; returns its folder."""
    original, calls = NIAH.run, []

    def dying(self, sample, runner):
        calls.append(sample["id"])
        if len(calls) > after:
            raise KeyboardInterrupt
        return original(self, sample, runner)

    monkeypatch.setattr(NIAH, "run", dying)
    with pytest.raises(Interrupted, match=f"interrupted after {after} of 4 samples"):
        run_module.execute(cfg, progress=False)
    monkeypatch.setattr(NIAH, "run", original)
    (folder,) = {p.parent for p in Path(cfg["output"]["root"]).rglob("config.json")}
    return RunFolder(folder)


def test_resume_refuses_rows_written_by_other_code(tmp_path, data_root, monkeypatch):
    cfg = tiny_config(tmp_path, data_root, KIVI)
    folder = _interrupted_run(cfg, monkeypatch)
    (first,) = folder.sessions()
    assert first["code"]["git_commit"] == run_module._git_commit() and first["rows_before"] == 0

    real = run_module.code_identity
    monkeypatch.setattr(run_module, "code_identity", lambda m, t: {**real(m, t), "git_commit": "0" * 40})
    with pytest.raises(ConfigError) as err:
        run_module.execute(cfg, progress=False)
    message = str(err.value)
    assert message.startswith("output.resume=True: ") and "holds 2 rows written by commit" in message
    assert "commit 0000000000" in message and "output.resume=force" in message
    assert len(folder.rows()) == 2 and not (folder.path / "metrics.json").exists()

    forced = {**cfg, "output": {**cfg["output"], "resume": "force"}}
    metrics = run_module.execute(forced, progress=False)
    assert metrics["metrics"]["n"] == 4 and metrics["timings"]["samples_resumed"] == 2
    last = folder.sessions()[-1]
    assert last["resume"] == "force" and last["rows_before"] == 2 and last["code"]["git_commit"] == "0" * 40


def test_a_method_version_bump_is_a_new_run_id(monkeypatch):
    from kvbench.methods import METHODS
    from kvbench.results import run_id

    config = {"method": {"name": "kivi", "bits": 2.0}, "seed": 0}
    before = run_id(config)
    monkeypatch.setattr(METHODS.get("kivi").Config, "version", 2)
    assert run_id(config) != before
    monkeypatch.setattr(METHODS.get("kivi").Config, "version", 1)
    assert run_id(config) == before  # version 1 (every stored run) keeps its id


def test_metrics_json_is_checked_against_its_rows(tmp_path, data_root, monkeypatch, capsys):
    cfg = tiny_config(tmp_path, data_root, KIVI)
    metrics = run_module.execute(cfg, progress=False)
    (path,) = list(tmp_path.rglob("metrics.json"))
    edited = json.loads(path.read_text())
    true_score = edited["metrics"]["score"]
    edited["metrics"]["score"] = 0.123
    path.write_text(json.dumps(edited))
    capsys.readouterr()

    import kvbench.builder

    monkeypatch.setattr(kvbench.builder, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    again = run_module.execute(cfg, progress=False)
    err = capsys.readouterr().err
    assert "disagrees with its 4 sample rows" in err and "score: 0.123 in the file" in err
    assert f"{true_score!r} from the samples" in err
    assert again["metrics"]["score"] == true_score == metrics["metrics"]["score"]
    assert json.loads(path.read_text())["metrics"]["score"] == true_score


def test_duplicate_and_unknown_rows_are_set_aside(tmp_path, data_root, capsys):
    cfg = tiny_config(tmp_path, data_root, KIVI)
    run_module.execute(cfg, progress=False)
    (folder,) = {RunFolder(p.parent) for p in tmp_path.rglob("metrics.json")}
    lines = folder.samples_path.read_text().splitlines()
    stranger = {**json.loads(lines[0]), "sample_id": "L999_d7"}
    second = {**json.loads(lines[1]), "score": -1.0}
    with open(folder.samples_path, "a") as f:
        f.write(json.dumps(second) + "\n" + json.dumps(stranger) + "\n")
    capsys.readouterr()
    run_module.execute(cfg, progress=False)
    err = capsys.readouterr().err
    assert "1 duplicate row(s), 1 row(s) of unknown samples moved to samples.rejected.jsonl" in err
    assert folder.samples_path.read_text().splitlines() == lines  # the first row of each sample stays
    rejected = [json.loads(x) for x in folder.rejected_path.read_text().splitlines()]
    assert [r["line"] for r in rejected] == [5, 6]
    assert "a second row of sample" in rejected[0]["reason"] and "(line 2 kept)" in rejected[0]["reason"]
    assert "'L999_d7' is not a sample of this task" in rejected[1]["reason"]


def test_resume_false_moves_the_old_rows_aside(tmp_path, data_root, monkeypatch, capsys):
    cfg = tiny_config(tmp_path, data_root, KIVI)
    folder = _interrupted_run(cfg, monkeypatch)
    capsys.readouterr()
    fresh = {**cfg, "output": {**cfg["output"], "resume": False}}
    metrics = run_module.execute(fresh, progress=False)
    assert "2 earlier row(s) moved to samples.rejected.jsonl" in capsys.readouterr().err
    assert metrics["timings"]["samples_run"] == 4 and len(folder.rows()) == 4


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_ends_a_run_with_one_line(tmp_path, data_root, signum, code):
    args = [
        sys.executable,
        "-m",
        "kvbench",
        "task=niah",
        "task.context_lengths=[256,320,384,448]",
        "task.depths=[0,50,100]",
        "task.max_new_tokens=4",
        f"output.root={tmp_path / 'runs'}",
        f"data.root={data_root}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        samples = list((tmp_path / "runs").rglob("samples.jsonl"))
        if samples and samples[0].read_text().count("\n") >= 1:
            break
        if proc.poll() is not None:
            pytest.fail(f"the run ended before it was signalled: {proc.stderr.read()[-2000:]}")
        time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("no sample within 300 s")
    os.kill(proc.pid, signum)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    n = len(RunFolder(samples[0].parent).rows())
    assert last == f"kvbench: interrupted after {n} of 12 samples; the same command resumes", last
    assert 1 <= n < 12 and not (samples[0].parent / "metrics.json").exists()
