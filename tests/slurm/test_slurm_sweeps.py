"""Sweeps on a real Slurm scheduler (the one-node cluster of scripts/local_slurm.sh in CI).

Each sweep is the default model on a 300-token NIAH slice with two new tokens, so a point costs
about as much as starting Python; the runs go under the test's own folder (``cwd=tmp_path``, the
default ``output.root`` is relative).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
# The README's worked example, verbatim (test_readme_shows_the_tested_sweep).
SWEEP = (
    "python -m kvbench -m +method=kivi bits=2,4 hydra/launcher=slurm "
    "'task.context_lengths=[300]' 'task.depths=[50]' task.max_new_tokens=2"
)
# one sample at a time, so that a cancel or requeue lands between rows
TINY = ["task.context_lengths=[300]", "task.max_new_tokens=2", "task.batch_size=1"]
# Enough work that a point is still running well after its first sample, when the test cancels or
# requeues it: Slurm's kill comes seconds later (KillWait, and submitit lets SIGTERM pass). A
# 300-token sample takes 0.13 s here since a prefill computes only its last positions' logits, so
# these points take 1200-token prompts (about 0.5 s each), of which some ten finish in that delay;
# the rest is what the second run has to do.
DEPTHS = list(range(0, 101, 3))
MANY = [f"task.depths=[{','.join(map(str, DEPTHS))}]", "task.context_lengths=[1200]"]
TIMING_KEYS = {"seconds", "prefill_s", "decode_s"}


def env() -> dict[str, str]:
    # The jobs inherit this environment (sbatch exports it): the checkout's kvbench and its launcher
    # plugin must be importable from the test's folder even where kvbench is not installed.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "kvbench", *args]


def run(args: list[str], cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run(command(args), cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout)


def start(args: list[str], cwd: Path) -> subprocess.Popen:
    cwd.mkdir(parents=True, exist_ok=True)
    out, err = (cwd / "driver.out").open("w"), (cwd / "driver.err").open("w")
    return subprocess.Popen(command(args), cwd=cwd, env=env(), stdout=out, stderr=err, text=True)


def run_folders(cwd: Path) -> dict[str, Path]:
    """'method/seed-runid' -> run folder, for every run under the default output root."""
    root = cwd / "results" / "runs" / "niah" / "smollm2-135m"
    return {str(p.parent.relative_to(root)): p.parent for p in sorted(root.glob("*/*/config.json"))}


def rows(folder: Path) -> list[str]:
    """The complete lines of samples.jsonl (a line cut by a kill has no newline and does not count)."""
    path = folder / "samples.jsonl"
    if not path.exists():
        return []
    return [line for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]


def without_timings(line: str) -> dict:
    return {k: v for k, v in json.loads(line).items() if k not in TIMING_KEYS}


def array_ids(cwd: Path) -> list[str]:
    """Slurm ids of the job arrays submitted from ``cwd`` (submitit names a folder after each)."""
    scripts = cwd.glob("results/runs/multirun/*/*/.submitit/*/*_submission.sh")
    return sorted({p.parent.name for p in scripts})


def squeue(job: str) -> list[tuple[str, str]]:
    out = subprocess.run(
        ["squeue", "--noheader", "--states=all", "--array", "--format=%i|%T", f"--jobs={job}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [tuple(line.split("|", 1)) for line in out.splitlines()]


def wait_for(predicate, what: str, driver: subprocess.Popen, cwd: Path, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if driver.poll() is not None:
            pytest.fail(f"the sweep ended before {what}: {(cwd / 'driver.err').read_text()[-2000:]}")
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def cancel_all(cwd: Path) -> None:
    for job in array_ids(cwd):
        subprocess.run(["scancel", job], capture_output=True)


def test_readme_shows_the_tested_sweep():
    assert SWEEP in (REPO / "README.md").read_text()


def test_slurm_sweep_writes_the_same_runs_as_the_local_launcher(slurm_cluster, tmp_path):
    args = shlex.split(SWEEP)[3:]  # after `python -m kvbench`
    # The same sweep with Hydra's own launcher, side by side with the Slurm one.
    local = start([a for a in args if not a.startswith("hydra/launcher=")], tmp_path / "local")
    try:
        on_slurm = run(args, tmp_path / "slurm")
        local.wait(timeout=300)
    finally:
        local.kill()
        cancel_all(tmp_path / "slurm")
    assert on_slurm.returncode == 0, on_slurm.stderr[-3000:]
    assert local.returncode == 0, (tmp_path / "local" / "driver.err").read_text()[-3000:]

    slurm_runs, local_runs = run_folders(tmp_path / "slurm"), run_folders(tmp_path / "local")
    # Same run ids (the launcher is no part of what is computed), one folder per point.
    assert sorted(slurm_runs) == sorted(local_runs)
    assert sorted(k.split("/")[0] for k in slurm_runs) == ["kivi-2b", "kivi-4b"]
    for key, folder in slurm_runs.items():
        assert [without_timings(r) for r in rows(folder)] == [
            without_timings(r) for r in rows(local_runs[key])
        ]
        slurm_metrics = json.loads((folder / "metrics.json").read_text())
        local_metrics = json.loads((local_runs[key] / "metrics.json").read_text())
        assert slurm_metrics["metrics"] == local_metrics["metrics"]
        assert slurm_metrics["memory"] == local_metrics["memory"]

    # The sweep's summary is on the terminal: one COMPLETED row per point, with its effective bits.
    table = [line.split() for line in on_slurm.stdout.splitlines() if "COMPLETED" in line]
    assert len(table) == 2
    for method, folder in ((k.split("/")[0], f) for k, f in slurm_runs.items()):
        bits = json.loads((folder / "metrics.json").read_text())["memory"]["effective_bits"]
        assert any(method in row and f"{bits:.4g}" in row for row in table), on_slurm.stdout
    assert "sacct" not in on_slurm.stdout + on_slurm.stderr
    assert "Traceback" not in on_slurm.stderr


@pytest.fixture(scope="module")
def array_sweep(slurm_cluster, tmp_path_factory, haystack_only_root):
    """Three points through an array that runs two at a time; the first fails inside its job.

    The failure is one that only the run itself meets (KVQuant reads its calibration text after the
    model loads); a bad config value would be refused before anything is submitted.
    """
    cwd = tmp_path_factory.mktemp("array")
    args = [
        "-m",
        "+method=kvquant,kivi,uniform",
        "bits=2",
        f"data.root={haystack_only_root}",
        "hydra/launcher=slurm_cpu",
        "hydra.launcher.array_parallelism=2",
    ]
    try:
        proc = run([*args, "task.depths=[50]", *TINY], cwd)
    finally:
        cancel_all(cwd)
    return cwd, proc


def _log_times(log: Path) -> tuple[datetime, datetime]:
    stamps = re.findall(r"^submitit INFO \((\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\)", log.read_text(), re.M)
    assert len(stamps) >= 2, log.read_text()[-2000:]
    parse = [datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f") for s in stamps]
    return parse[0], parse[-1]


def test_array_larger_than_parallelism_runs_every_point_two_at_a_time(array_sweep):
    cwd, proc = array_sweep
    (script,) = cwd.glob("results/runs/multirun/*/*/.submitit/*/*_submission.sh")
    assert re.search(r"^#SBATCH --array=0-2%2$", script.read_text(), re.M), script.read_text()
    # Every task of the array ran, and none started while two others were running.
    logs = sorted(cwd.glob("results/runs/multirun/*/*/.submitit/*_*/*_0_log.out"))
    assert [p.parent.name.split("_")[1] for p in logs] == ["0", "1", "2"]
    spans = [_log_times(p) for p in logs]
    for k, (begin, _) in enumerate(spans):
        running = [j for j, (b, e) in enumerate(spans) if j != k and b <= begin < e]
        assert len(running) <= 1, spans
    assert max(b for b, _ in spans) >= min(e for _, e in spans)  # the third waited for a slot


def test_user_error_in_one_point_is_one_line_and_the_others_finish(array_sweep):
    cwd, proc = array_sweep
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("kvbench:")]
    assert len(errors) == 1, proc.stderr
    assert errors[0].startswith("kvbench: error: point #0 (+method=kvquant): data.root="), errors[0]
    assert "kvquant calibration needs one of wikitext2/" in errors[0]
    assert "Traceback" not in proc.stderr and "UncompletedJobError" not in proc.stderr
    log = Path(re.search(r"\[log: (.+)\]$", errors[0]).group(1))
    assert "kvbench: error: data.root=" in log.read_text()
    # The other two points ran to the end, and the summary names every point's state.
    assert sorted(k.split("/")[0] for k in run_folders(cwd)) == ["kivi-2b", "uniform-2b"]
    assert all((f / "metrics.json").exists() for f in run_folders(cwd).values())
    table = {line.split()[0]: line for line in proc.stdout.splitlines() if line[:1].isdigit()}
    assert sorted(table) == ["0", "1", "2"]
    assert "COMPLETED" in table["1"] and "COMPLETED" in table["2"]
    assert "FAILED" in table["0"] and str(log) in table["0"]


def test_scancel_mid_sweep_then_the_same_command_resumes(slurm_cluster, tmp_path):
    args = ["-m", "+method=kivi", "bits=2,4", "hydra/launcher=slurm", *TINY, *MANY]
    driver = start(args, tmp_path)
    try:
        wait_for(
            lambda: any(rows(f) for f in run_folders(tmp_path).values()), "a first sample", driver, tmp_path
        )
        (job,) = array_ids(tmp_path)
        subprocess.run(["scancel", job], check=True)
        driver.wait(timeout=120)
    finally:
        driver.kill()
        cancel_all(tmp_path)
    err = (tmp_path / "driver.err").read_text()
    assert driver.returncode == 1, err[-3000:]
    cancelled = [line for line in err.splitlines() if line.startswith("kvbench: point #")]
    assert cancelled and all(" CANCELLED: " in line for line in cancelled), err
    # Slurm may still be killing the jobs (KillWait): rows seen now are a lower bound of what the
    # second command finds.
    before = {key: rows(folder) for key, folder in run_folders(tmp_path).items()}
    assert sum(len(r) for r in before.values()) >= 1

    again = run(args, tmp_path)
    cancel_all(tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(k.split("/")[0] for k in run_folders(tmp_path)) == ["kivi-2b", "kivi-4b"]
    recomputed = 0
    for key, folder in run_folders(tmp_path).items():
        after = rows(folder)
        # Every sample finished before the cancel is kept as it was, none is redone or doubled.
        assert after[: len(before.get(key, []))] == before.get(key, [])
        ids = [json.loads(r)["sample_id"] for r in after]
        assert len(ids) == len(set(ids)) == len(DEPTHS)
        timings = json.loads((folder / "metrics.json").read_text())["timings"]
        assert timings["samples_resumed"] >= len(before.get(key, []))
        assert timings["samples_resumed"] + timings["samples_run"] == len(DEPTHS)
        recomputed += timings["samples_run"]
    assert recomputed >= 1  # the cancel came mid-sweep: the second command had work left


def test_requeued_job_resumes_from_its_samples(slurm_cluster, tmp_path):
    args = ["-m", "+method=kivi", "bits=2", "hydra/launcher=slurm", *TINY, *MANY]
    driver = start(args, tmp_path)
    try:
        folder = wait_for(
            lambda: next((f for f in run_folders(tmp_path).values() if rows(f)), None),
            "a first sample",
            driver,
            tmp_path,
        )
        (job,) = array_ids(tmp_path)
        (task,) = dict(squeue(job))  # a one-point sweep is a plain job, not an array
        subprocess.run(["scontrol", "requeue", task], check=True)
        wait_for(
            lambda: dict(squeue(task)).get(task) == "PENDING", "the requeued job to wait", driver, tmp_path
        )
        before = rows(folder)  # a lower bound: the first run may still be dying (KillWait)
        # Slurm holds a requeued job back for a while; release it now rather than wait.
        subprocess.run(["scontrol", "update", f"JobId={task}", "StartTime=now"], check=True)
        driver.wait(timeout=240)
    finally:
        driver.kill()
        cancel_all(tmp_path)
    err = (tmp_path / "driver.err").read_text()
    assert driver.returncode == 0, err[-3000:]
    info = subprocess.run(["scontrol", "show", "job", task], capture_output=True, text=True).stdout
    assert "Restarts=1" in info, info
    after = rows(folder)
    assert len(before) >= 1
    assert after[: len(before)] == before
    ids = [json.loads(r)["sample_id"] for r in after]
    assert len(ids) == len(set(ids)) == len(DEPTHS)
    # The restarted job began from its samples: it kept at least those seen before the requeue
    # and computed only the rest.
    timings = json.loads((folder / "metrics.json").read_text())["timings"]
    assert timings["samples_resumed"] >= len(before)
    assert timings["samples_run"] >= 1
    assert timings["samples_resumed"] + timings["samples_run"] == len(DEPTHS)
    assert "COMPLETED" in (tmp_path / "driver.out").read_text()


def test_points_per_job_runs_a_group_in_one_job_that_loads_the_model_once(
    slurm_cluster, tmp_path, haystack_only_root
):
    """Three points, two per job: an array of two tasks. The first point fails after the model
    loaded; the second, in the same job, still runs and finds the model loaded; the third, alone in
    its job, loads it. Each point has its own row and the failure its own line."""
    args = [
        "-m",
        "+method=kvquant,kivi,uniform",
        "bits=2",
        f"data.root={haystack_only_root}",
        "hydra/launcher=slurm_cpu",
        "hydra.launcher.points_per_job=2",
        "task.depths=[50]",
        *TINY,
    ]
    try:
        proc = run(args, tmp_path)
    finally:
        cancel_all(tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (script,) = tmp_path.glob("results/runs/multirun/*/*/.submitit/*/*_submission.sh")
    assert re.search(r"^#SBATCH --array=0-1%", script.read_text(), re.M), script.read_text()
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kvbench:")]
    assert len(errors) == 1 and errors[0].startswith("kvbench: error: point #0 (+method=kvquant): "), errors
    table = {line.split()[0]: line for line in proc.stdout.splitlines() if line[:1].isdigit()}
    assert sorted(table) == ["0", "1", "2"]
    assert "FAILED" in table["0"] and "COMPLETED" in table["1"] and "COMPLETED" in table["2"]
    reused = {
        key.split("/")[0]: json.loads((folder / "metrics.json").read_text())["timings"]["model_reused"]
        for key, folder in run_folders(tmp_path).items()
    }
    assert reused == {"kivi-2b": True, "uniform-2b": False}
