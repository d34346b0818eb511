"""A kill at any moment of ``make results`` or ``report --archive`` leaves every file whole.

Each fault run starts from an "old" tree in which every file differs from what a clean run writes,
kills the command with SIGKILL after a seeded random delay within the clean run's duration, and
then requires every file to be byte-identical to its old or to its new version (never empty, never
a mixture), no new visible file, and a clean rerun to end byte-identical to the clean result with
no temporary file left. Damaged archives are one error line naming the file and how to rewrite it.
"""

from __future__ import annotations

import gzip
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvbench.analysis.archive import ARCHIVE, MANIFEST, write_archives

RESULTS = Path(__file__).resolve().parents[1] / "results"
# Two small committed experiments (the claims are the package's paper files): enough for every kind
# of output (reports, tables, figures, claim pages, paper pages, the README block) in seconds.
EXPERIMENTS = ("kivi_group_ablation", "readkv_read_budget")
SEEDS = (0, 1, 2)
README = "# kvbench\n\n<!-- results:begin (written by make results; do not edit) -->\n<!-- results:end -->\n"


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _visible(snapshot: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in snapshot.items() if not any(part.startswith(".") for part in k.split("/"))}


def _report(root: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "kvbench.report", "--results", str(root / "results"), *args]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def _make_old(new: dict[str, bytes], root: Path, keep: tuple[str, ...] = ()) -> dict[str, bytes]:
    """Write a tree where every output differs from the clean run's (``keep``: inputs left as they
    are); returns it."""
    shutil.rmtree(root)
    old = {}
    for name, data in new.items():
        if name in keep:
            changed = data
        elif name == "README.md":  # only the block between the markers is the report's
            changed = data.replace(b"-->\n", b"-->\nstale\n", 1)
        else:
            changed = data + b"\nstale\n"
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(changed)
        old[name] = changed
    return old


def _kill_after(cmd: list[str], delay: float) -> None:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        proc.wait(timeout=delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def _check_whole(root: Path, old: dict[str, bytes], new: dict[str, bytes], what: str) -> None:
    now = _visible(_snapshot(root))
    extra = sorted(set(now) - set(old) - set(new))
    assert not extra, f"{what}: files that are neither old nor new: {extra}"
    for name, data in now.items():
        assert data in (old.get(name), new.get(name)), (
            f"{what}: {name} is neither its old nor its new version ({len(data)} bytes)"
        )


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    """A results tree of the two experiments and the README it belongs to, regenerated once:
    ``(root, the clean snapshot, seconds the clean run took)``."""
    root = tmp_path_factory.mktemp("regen")
    for name in EXPERIMENTS:
        (root / "results" / name).mkdir(parents=True)
        for file in (ARCHIVE, MANIFEST):
            shutil.copy(RESULTS / name / file, root / "results" / name / file)
    (root / "README.md").write_text(README)
    start = time.monotonic()
    proc = _run(_report(root, "--regenerate", "--resamples", "200"))
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    new = _snapshot(root)
    assert any(k.endswith(".png") for k in new) and any(k.startswith("results/claims/") for k in new)
    assert "<!-- results:end -->" in new["README.md"].decode() and len(new["README.md"]) > len(README)
    return root, new, seconds


@pytest.mark.parametrize("seed", SEEDS)
def test_kill_during_regenerate_leaves_every_file_whole(regenerated, seed):
    root, new, seconds = regenerated
    inputs = tuple(k for k in new if k.endswith((ARCHIVE, MANIFEST)))
    old = _make_old(new, root, keep=inputs)
    delay = seconds * random.Random(seed).uniform(0.3, 1.0)
    _kill_after(_report(root, "--regenerate", "--resamples", "200"), delay)
    _check_whole(root, old, new, f"seed {seed}, killed after {delay:.1f} s of {seconds:.1f}")
    proc = _run(_report(root, "--regenerate", "--resamples", "200"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _snapshot(root) == new, "a clean rerun after the kill differs from the clean run"


@pytest.fixture(scope="module")
def archived(tmp_path_factory):
    """Synthetic run folders archived once: ``(root, runs, the clean snapshot, seconds)``."""
    from synthetic_runs import write_runs

    root = tmp_path_factory.mktemp("archive")
    runs = write_runs(root / "runs")
    (root / "results").mkdir()
    start = time.monotonic()
    proc = _run(_report(root, "--archive", str(runs)))
    seconds = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    new = _snapshot(root / "results")
    assert any(k.endswith(ARCHIVE) for k in new)
    return root, runs, new, seconds


@pytest.mark.parametrize("seed", SEEDS)
def test_kill_during_archive_leaves_every_file_whole(archived, seed):
    root, runs, new, seconds = archived
    old = _make_old(new, root / "results")
    delay = seconds * random.Random(100 + seed).uniform(0.3, 1.0)
    _kill_after(_report(root, "--archive", str(runs)), delay)
    _check_whole(root / "results", old, new, f"seed {seed}, killed after {delay:.1f} s of {seconds:.1f}")
    proc = _run(_report(root, "--archive", str(runs)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _snapshot(root / "results") == new


def test_every_write_point_leaves_every_file_whole(tmp_path):
    """The random kills above may miss the moment between two files; here the process dies at each
    rename in turn (``os.replace`` patched to kill it on its n-th call)."""
    from synthetic_runs import write_runs

    runs = write_runs(tmp_path / "runs")
    results = tmp_path / "results"
    write_archives(runs, results)
    new = _snapshot(results)
    driver = (
        "import os, signal, sys\n"
        "from kvbench.report import main\n"
        "n, real = int(sys.argv[1]), os.replace\n"
        "def replace(*a, **k):\n"
        "    global n\n"
        "    n -= 1\n"
        "    if n < 0: os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return real(*a, **k)\n"
        "os.replace = replace\n"
        "sys.exit(main(sys.argv[2:]))\n"
    )
    for n in range(len(new) + 1):
        old = _make_old(new, results)
        proc = subprocess.run(
            [sys.executable, "-c", driver, str(n), "--results", str(results), "--archive", str(runs)],
            capture_output=True,
            timeout=300,
        )
        assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-2000:]
        _check_whole(results, old, new, f"killed at rename {n}")
        if proc.returncode == 0:
            # every file went through its own rename, so each one was a kill point
            assert n >= len(new), f"finished after {n} renames for {len(new)} files"
            break
    else:
        pytest.fail("the archive never finished")


def _archive_tree(tmp_path: Path) -> Path:
    from synthetic_runs import write_runs

    runs = write_runs(tmp_path / "runs")
    write_archives(runs, tmp_path / "results")
    return tmp_path / "results"


@pytest.mark.parametrize(
    "damage",
    ["empty", "truncated", "garbage", "bad_csv", "manifest_garbage", "checksum"],
)
def test_damaged_archive_is_one_line_naming_the_file(tmp_path, damage):
    results = _archive_tree(tmp_path)
    (folder,) = [p.parent for p in results.glob(f"*/{ARCHIVE}")]
    archive, manifest = folder / ARCHIVE, folder / MANIFEST
    data = archive.read_bytes()
    if damage == "empty":
        archive.write_bytes(b"")
    elif damage == "truncated":
        archive.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        archive.write_bytes(b"not gzip at all")
    elif damage == "bad_csv":
        archive.write_bytes(gzip.compress(b"run_id:str,score:float\nr1\n"))
    elif damage == "manifest_garbage":
        manifest.write_text("{not json")
    else:
        archive.write_bytes(gzip.compress(gzip.decompress(data) + b"x"))
    if damage not in ("manifest_garbage", "checksum"):
        manifest.unlink()  # without a checksum to catch it, the reader itself must
    proc = _run([sys.executable, "-m", "kvbench.report", "--results", str(results), "--regenerate"])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    named = manifest if damage == "manifest_garbage" else archive
    assert str(named) in lines[0] and "--archive" in lines[0], lines[0]


def test_write_error_is_one_line_naming_the_file(tmp_path):
    """A file that cannot be replaced (here a folder squats on its name, which stops root too; a
    full disk or a read-only mount reach the same handler) is one line naming it."""
    results = _archive_tree(tmp_path)
    (folder,) = [p.parent for p in results.glob(f"*/{ARCHIVE}")]
    (folder / "report.md").mkdir()
    proc = _run([sys.executable, "-m", "kvbench.report", "--results", str(results), "--regenerate"])
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert len(lines) == 1 and str(folder / "report.md") in lines[0], proc.stderr[-2000:]
    assert not list(folder.glob(".*.tmp")), "the failed write left its temporary file"
