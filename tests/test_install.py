"""A non-editable install works from any folder: the Hydra configs ship inside the package
(``kvbench/conf``), so ``python -m kvbench --cfg job`` composes outside the checkout.

kvbench is built from a copy of what the package needs (not the checkout, which stays clean) and
installed with ``--no-deps --no-index --no-build-isolation`` into a temporary venv that sees the
test interpreter's site-packages through a ``.pth`` line: no network, a few seconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SANDBOX = Path(__file__).resolve().parent / "sandbox"


def _copy_sources(dest: Path) -> Path:
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    for name in ("kvbench", "hydra_plugins"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """(the venv's python, an environment in which the checkout is not importable)."""
    base = tmp_path_factory.mktemp("install")
    src = _copy_sources(base / "src")
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # the dependencies (and pip, setuptools) of the interpreter running the tests; a plain path line,
    # so that interpreter's own .pth files (an editable kvbench among them) are not processed
    Path(purelib, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    if SANDBOX.is_dir() and os.environ.get("KVBENCH_TEST_FORBIDDEN"):
        env["PYTHONPATH"] = str(SANDBOX)  # the sandbox hook only; never the checkout
    install = [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--no-build-isolation"]
    proc = subprocess.run([*install, str(src)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return python, env


@pytest.mark.install
def test_installed_package_holds_the_configs(installed, tmp_path):
    python, env = installed
    code = "import kvbench.paths as p; print(p.CONF_DIR); print(p.source_checkout())"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    conf_dir, checkout = proc.stdout.split()
    assert not Path(conf_dir).is_relative_to(REPO)  # the installed copy, not the checkout
    assert (Path(conf_dir) / "config.yaml").is_file()

    def tree(root: Path) -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*.yaml"))

    assert tree(Path(conf_dir)) == tree(REPO / "kvbench" / "conf")  # every node, nested arms included
    assert checkout == "None"  # an installed package reads ./results, or --results


@pytest.mark.install
def test_installed_cli_composes_the_config_outside_the_checkout(installed, tmp_path):
    python, env = installed
    args = [python, "-m", "kvbench", "+method=kivi", "bits=2", "--cfg", "job", "--resolve"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "name: smollm2-135m" in out and "name: niah" in out  # the config.yaml defaults
    assert "name: kivi" in out and "bits: 2" in out  # a group node found through the package
    assert list(tmp_path.iterdir()) == []  # --cfg makes no run folder


@pytest.mark.install
def test_installed_console_script_composes_and_completes(installed, tmp_path):
    """``kvbench`` ([project.scripts]) is on the venv's PATH; its node from ./conf composes, and
    Hydra's tab completion answers it."""
    python, env = installed
    script = python.parent / "kvbench"
    assert script.is_file()
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mine.yaml").write_text("# @package model\nname: mine\npath: /m/mine\n")
    args = [script, "model=mine", "+method=kivi", "bits=2", "--cfg", "job"]
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "name: mine" in proc.stdout and "name: kivi" in proc.stdout
    query = {**env, "COMP_LINE": "kvbench model=min", "COMP_POINT": "17"}
    proc = subprocess.run(
        [script, "-sc", "query=bash"], capture_output=True, text=True, env=query, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0 and proc.stdout.split() == ["model=mine"], proc.stderr[-3000:]
