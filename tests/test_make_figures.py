"""scripts/make_figures.py runs the notebooks headless on a small stored result set."""

import subprocess
import sys
from pathlib import Path

from synthetic_runs import write_runs

from kvbench.analysis.papers import load_claims
from kvbench.results import RunFolder

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _hitrate_run(root: Path) -> None:
    folder = RunFolder(root / "pg19_hitrate" / "tiny" / "fp16" / "seed0-abc")
    folder.write_config(
        {"task": {"name": "pg19_hitrate"}, "model": {"name": "tiny"}, "seed": 0, "run_id": "abc"}
    )
    for i, (top, spec, h2o) in enumerate([(0.9, 0.8, 0.5), (0.8, 0.7, 0.4)]):
        folder.append(
            {
                "sample_id": f"w{i}",
                "seed": 0,
                "task": "pg19_hitrate",
                "model": "tiny",
                "method": "fp16",
                "hit_rate": spec,
                "hit_rates": {
                    "exact_topk": {"0.01": top, "0.05": min(1.0, top + 0.05)},
                    "specache": {"0.01": spec, "0.05": spec + 0.05},
                    "h2o": {"0.01": h2o, "0.05": h2o + 0.05},
                },
            }
        )


def _table_rows(path: Path) -> list[list[str]]:
    lines = [line for line in path.read_text().splitlines() if line.startswith("| ")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[1:]]


def test_make_figures_runs_the_notebooks(tmp_path):
    runs = write_runs(tmp_path / "runs")
    _hitrate_run(runs)
    out = tmp_path / "figs"
    names = ["cliff_map", "memory_quality", "hitrate_curves", "claims_table"]
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_figures.py"), "--results", str(runs), "--out", str(out)]
        + ["--notebooks", *names],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("cliff_map", "memory_quality", "hitrate_curves"):
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 5000, name
        assert not (out / f"{name}_2.png").exists()  # each figure shown once
    # The cliff notebook's table: uniform holds at 3 bits and breaks at 2.
    [cliff] = _table_rows(out / "cliff_map.md")
    assert cliff[0] == "uniform" and cliff[5] == "(2, 3]"
    # The memory notebook's table: one row per configuration, the hand-computable means.
    means = {row[0]: row for row in _table_rows(out / "memory_quality.md")}
    assert sorted(means) == ["fp16", "uniform-2b", "uniform-3b", "uniform-4b"]
    assert means["uniform-3b"][3] == "0.8333" and means["uniform-3b"][6] == "4"  # 20/24; 3 + 1 bits
    assert means["fp16"][2] == "24"
    # The claims notebook's table has every claim of the paper files, in register order.
    claims = _table_rows(out / "claims_table.md")
    assert [row[0] for row in claims] == [c.id for c in load_claims()]


def test_make_figures_rejects_bad_input(tmp_path):
    script = str(REPO / "scripts" / "make_figures.py")
    proc = subprocess.run(
        [sys.executable, script, "--results", str(tmp_path / "none")], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "no such directory" in proc.stderr
    proc = subprocess.run(
        [sys.executable, script, "--results", str(tmp_path), "--notebooks", "nope"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "--notebooks=nope: known notebooks: " in proc.stderr
