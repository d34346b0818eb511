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


def test_an_interrupt_right_after_an_append_counts_that_row(tmp_path, data_root, monkeypatch):
    """The signal can land after a row is on disk and before the run loop records it: the message
    counts what the folder holds, so the row is neither lost nor miscounted."""
    cfg = tiny_config(tmp_path, data_root, KIVI)
    original, appended = RunFolder.append, []

    def append_then_die(self, row):
        original(self, row)
        appended.append(row["sample_id"])
        if len(appended) == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(RunFolder, "append", append_then_die)
    with pytest.raises(Interrupted, match="interrupted after 2 of 4 samples"):
        run_module.execute(cfg, progress=False)
    monkeypatch.setattr(RunFolder, "append", original)
    (folder,) = {p.parent for p in Path(cfg["output"]["root"]).rglob("config.json")}
    assert [r["sample_id"] for r in RunFolder(folder).rows()] == appended
    metrics = run_module.execute(cfg, progress=False)
    assert metrics["metrics"]["n"] == 4 and metrics["timings"]["samples_resumed"] == 2


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


@pytest.mark.parametrize(
    ("node", "repacked"),
    [
        ({"name": "uniform", "bits": 2.322}, True),  # 5 levels: base-L words
        ({"name": "uniform", "bits": 2.0}, False),  # bit packing never changed
        ({"name": "kivi", "bits": 2.0, "key_bits": 1.585}, True),
        ({"name": "kivi", "bits": 2.0}, False),
        ({"name": "semkv", "bits": 2.39}, True),
        ({"name": "turboquant", "bits": 3.0}, False),
        ({"name": "intactkv", "bits": 2.585, "base": {"name": "uniform"}}, True),
        ({"name": "fp16"}, False),
    ],
)
def test_base_l_configs_carry_the_packing_version(node, repacked):
    """Configs that pack a level count other than a power of two changed bytes with the packing's
    version 2: their run id carries it, and every bit-packed config keeps its stored id."""
    from kvbench.quant.packing import PACKING_VERSION
    from kvbench.results import canonical_config

    core = canonical_config({"method": node, "seed": 0})
    assert core.get("packing_version") == (PACKING_VERSION if repacked else None), node


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


def _cli_args(tmp_path, data_root) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvbench",
        "task=niah",
        "task.context_lengths=[256,320,384,448]",
        "task.depths=[0,50,100]",
        "task.max_new_tokens=4",
        "task.batch_size=1",  # one sample at a time: the signal lands between rows
        f"output.root={tmp_path / 'runs'}",
        f"data.root={data_root}",
    ]


def _signalled(args: list[str], runs: Path, signum: int) -> tuple[subprocess.Popen, str, Path]:
    """Start ``args``, send ``signum`` once a sample row is stored; (process, stderr, run folder)."""
    # SIGINT at its default in the child, as from a terminal: a pytest-xdist worker ignores it,
    # and a Python started with SIGINT ignored never raises KeyboardInterrupt
    proc = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        samples = list(runs.rglob("samples.jsonl"))
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
    return proc, err, samples[0].parent


@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_ends_a_run_with_one_line(tmp_path, data_root, signum, code):
    args = [*_cli_args(tmp_path, data_root), f"hydra.run.dir={tmp_path / 'hydra'}"]
    proc, err, folder = _signalled(args, tmp_path / "runs", signum)
    assert proc.returncode == code, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    last = [line for line in err.splitlines() if line.strip()][-1]
    n = len(RunFolder(folder).rows())
    assert last == f"kvbench: interrupted after {n} of 12 samples; the same command resumes", last
    assert 1 <= n < 12 and not (folder / "metrics.json").exists()


def test_refused_resume_on_the_cli_is_one_line_and_leaves_no_hydra_folder(tmp_path, data_root):
    args = _cli_args(tmp_path, data_root)
    proc, err, folder = _signalled(
        [*args, f"hydra.run.dir={tmp_path / 'hydra'}"], tmp_path / "runs", signal.SIGINT
    )
    assert proc.returncode == 130, err[-2000:]
    provenance = json.loads((folder / "provenance.json").read_text())
    provenance["sessions"][-1]["code"]["git_commit"] = "f" * 40
    (folder / "provenance.json").write_text(json.dumps(provenance))
    rows = folder.joinpath("samples.jsonl").read_bytes()
    again = subprocess.run(args, capture_output=True, text=True, timeout=600)  # Hydra's default folder
    lines = [line for line in again.stderr.splitlines() if line.strip()]
    assert again.returncode == 2 and len(lines) == 1, again.stderr[-2000:]
    assert lines[0].startswith("kvbench: error: output.resume=True: ") and "commit ffffffffff" in lines[0]
    assert folder.joinpath("samples.jsonl").read_bytes() == rows
    assert not (tmp_path / "runs" / ".hydra").exists(), list((tmp_path / "runs" / ".hydra").rglob("*"))


def test_full_disk_while_appending_or_writing_metrics_is_one_line(tmp_path, data_root, monkeypatch):
    """ENOSPC anywhere in a run: one line naming the file; every finished row kept; the same
    command then finishes the run."""
    import errno

    from kvbench import atomic

    cfg = tiny_config(tmp_path, data_root, KIVI)
    real_fsync, calls = os.fsync, []

    def full_after(n):
        def fsync(fd):
            calls.append(fd)
            if len(calls) > n:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_fsync(fd)

        return fsync

    # config.json and provenance.json (2 fsyncs each: file, folder is suppressed) then rows
    monkeypatch.setattr(os, "fsync", full_after(4))
    with pytest.raises(atomic.WriteError) as err:
        run_module.execute(cfg, progress=False)
    assert "samples.jsonl: No space left on device" in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setattr(os, "fsync", real_fsync)
    (folder,) = {RunFolder(p.parent) for p in tmp_path.rglob("config.json")}
    kept = len(folder.rows())

    calls.clear()
    original = atomic.write_bytes

    def metrics_disk_full(path, data):
        if path.name == "metrics.json":
            monkeypatch.setattr(os, "fsync", full_after(0))
        return original(path, data)

    monkeypatch.setattr(atomic, "write_bytes", metrics_disk_full)
    with pytest.raises(atomic.WriteError, match=r"cannot write .*metrics\.json: No space left on device"):
        run_module.execute(cfg, progress=False)
    monkeypatch.setattr(os, "fsync", real_fsync)
    monkeypatch.setattr(atomic, "write_bytes", original)
    assert not (folder.path / "metrics.json").exists() and not list(folder.path.glob(".*.tmp"))
    assert len(folder.rows()) == 4 >= kept
    metrics = run_module.execute(cfg, progress=False)
    assert metrics["metrics"]["n"] == 4 and metrics["timings"]["samples_run"] == 0


def test_report_warns_about_lines_that_are_not_rows(tmp_path, capsys):
    from synthetic_runs import write_runs

    from kvbench.analysis.frame import load_frame

    runs = write_runs(tmp_path / "runs")
    path = sorted(runs.rglob("samples.jsonl"))[-1]
    before = len(load_frame(runs))
    with open(path, "a") as f:
        f.write("garbage\n{}\n")
    capsys.readouterr()
    assert len(load_frame(runs)) == before
    err = capsys.readouterr().err
    assert f"{path}: 2 line(s) that are not sample rows left out" in err


def test_a_long_value_is_shortened_in_the_error_line():
    from kvbench.errors import ConfigError

    message = str(ConfigError("model.name", "x" * 100_000, "a short name"))
    assert len(message) < 200 and "(100002 characters)" in message and message.endswith(": a short name")


def test_report_names_runs_made_from_a_modified_checkout(tmp_path):
    from synthetic_runs import write_runs

    from kvbench.report import build_report

    runs = write_runs(tmp_path / "runs")
    folders = sorted(p.parent for p in runs.rglob("samples.jsonl"))
    code = {"git_commit": "a" * 40, "git_dirty": True, "kvbench": "x", "method_version": 1, "task_version": 1}
    RunFolder(folders[0]).record_session({"code": code, "rows_before": 0, "resume": True})
    clean = {**code, "git_dirty": False}
    RunFolder(folders[1]).record_session({"code": clean, "rows_before": 0, "resume": True})
    result = build_report(runs, tmp_path / "report", seed=0, n_resamples=50)
    text = (result["out"] / "report.md").read_text()
    assert "uncommitted changes" in text and f"`{folders[0]}`: aaaaaaaaaa" in text
    assert f"`{folders[1]}`" not in text.split("uncommitted changes")[1].split("##")[0]
