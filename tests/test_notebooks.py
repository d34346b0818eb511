"""Every notebook executes headless on a fresh clone: from the committed archives under results/
(no run folders, no ../shared), each redraws its figure and its tables agree with what
``kvbench.report`` committed from the same archives."""

import csv
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _table_rows(path: Path) -> list[list[str]]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]


def test_notebooks_redraw_their_figures_from_the_committed_archives(tmp_path):
    out = tmp_path / "figs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVBENCH_RESULTS")}
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_figures.py"), "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("cliff_map", "memory_quality", "niah_heatmap", "hitrate_curves"):
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name
        assert not (out / f"{name}_2.png").exists()  # each figure shown once
    # The cliff notebook's bracket is the one the report wrote from the semkv_cliff archive.
    committed = REPO / "results" / "semkv_cliff" / "niah_smollm2-135m_semkv_cliff" / "cliff.md"
    assert _table_rows(out / "cliff_map.md") == _table_rows(committed)
    # The memory notebook shows the semkv_interpolation arms, fp16 at 16 effective bits among them.
    means = {row[0]: row for row in _table_rows(out / "memory_quality.md")}
    assert "fp16" in means and float(means["fp16"][6]) == 16.0
    assert any(m.startswith("semkv-2.39b") for m in means), sorted(means)
    # Every claim with the verdict the committed register holds (none "not run").
    with open(REPO / "results" / "claims" / "smollm2-135m.csv", newline="") as handle:
        register = {row["id"]: row["verdict"] for row in csv.DictReader(handle)}
    shown = {row[0]: row[6] for row in _table_rows(out / "claims_table.md")}
    assert shown == register
    # read from the archives, not from an empty folder (where every claim would be "not run")
    assert "reproduced" in shown.values() and list(shown.values()).count("not run") < len(shown) / 4
