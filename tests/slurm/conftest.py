"""A Slurm cluster for the ``slurm`` tests: whatever answers ``sinfo`` on this machine.

CI starts a one-node cluster with ``scripts/local_slurm.sh start`` (and stops it after); by hand, run
that first, then ``pytest -m slurm``. Where no cluster answers, every ``slurm`` test is skipped and
the reason is printed at the end of the session, so a skip cannot pass unnoticed.
"""

from __future__ import annotations

import shutil
import subprocess
import time

import pytest

SKIPPED: list[str] = []
# Node states that take jobs (a node still cleaning up after a cancelled job is `completing`).
USABLE = {"idle", "mixed", "allocated", "completing"}
NOT_READY = "no usable node in the default partition"


def _cluster() -> tuple[str | None, str]:
    """(default partition, '') when a node of it is usable, else (None, why not)."""
    if shutil.which("sinfo") is None:
        return None, "no `sinfo` on PATH (start one with scripts/local_slurm.sh start)"
    try:
        out = subprocess.run(
            ["sinfo", "--noheader", "--format=%P|%T"], capture_output=True, text=True, timeout=20
        )
    except (OSError, subprocess.SubprocessError) as err:
        return None, f"`sinfo` failed: {err}"
    if out.returncode != 0:
        lines = (out.stderr or out.stdout).strip().splitlines()
        return (
            None,
            f"`sinfo` failed: {lines[-1] if lines else out.returncode} (scripts/local_slurm.sh start)",
        )
    for line in out.stdout.splitlines():
        partition, _, state = line.partition("|")
        if partition.endswith("*") and state.rstrip("*~#!%$@^-") in USABLE:
            return partition.rstrip("*"), ""
    return None, f"{NOT_READY}: `sinfo` says {out.stdout.strip()!r}"


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """The default partition's name; skips the test where no Slurm cluster answers."""
    partition, why = _cluster()
    for _ in range(10):  # a node finishing a job of the previous test is back within seconds
        if partition is not None or not why.startswith(NOT_READY):
            break
        time.sleep(1)
        partition, why = _cluster()
    if partition is None:
        SKIPPED.append(why)
        pytest.skip(f"no Slurm cluster: {why}")
    return partition


def pytest_terminal_summary(terminalreporter) -> None:
    if SKIPPED:
        terminalreporter.write_line(f"slurm tests skipped: {SKIPPED[0]}")
