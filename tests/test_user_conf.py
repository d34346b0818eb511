"""The user's own config nodes: ``./conf`` in the working directory, the checkout's ``conf/`` and the
folders of ``KVBENCH_CONFIG_PATH`` compose as shipped nodes do (kvbench/paths.py, the search path
plugin in hydra_plugins/kvbench_searchpath)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvbench import paths
from kvbench.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
TINY = ["task.context_lengths=[300]", "task.depths=[50]", "task.max_new_tokens=2"]


def run_cli(*args, cwd, env=None):
    # this checkout's kvbench and plugins, whatever the working directory
    base = {k: v for k, v in os.environ.items() if k != paths.CONFIG_PATH_ENV}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "kvbench", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env={**base, **(env or {})},
    )


def test_the_checkout_example_composes():
    """conf/model/my-llama.yaml and conf/experiment/my_llama_kivi.yaml, the README's worked example."""
    proc = run_cli("+experiment=my_llama_kivi", "--cfg", "job", cwd=REPO, env={"MY_LLAMA_PATH": "/m/llama"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    cfg = yaml.safe_load(proc.stdout)
    assert cfg["model"]["name"] == "my-llama" and cfg["task"]["name"] == "niah"
    assert cfg["analysis"]["name"] == "my_llama_kivi"
    # beside the shipped nodes, not instead of them
    proc = run_cli("--help", cwd=REPO)
    model_line = next(line for line in proc.stdout.splitlines() if line.startswith("model: "))
    assert "my-llama" in model_line and "smollm2-135m" in model_line


def test_a_node_in_the_working_directory_composes_and_runs(tmp_path):
    from kvbench.models import ModelConfig, converted_dir, model_node

    folder = converted_dir(
        ModelConfig(**{k: v for k, v in model_node("smollm2-135m").items() if k != "resources"})
    )
    if not (folder / "config.json").is_file():
        pytest.fail(f"the default model is not converted under {folder} (`make assets`)")
    (tmp_path / "conf" / "model").mkdir(parents=True)
    node = {"name": "my-smollm2", "path": str(folder), "dtype": "float32"}
    (tmp_path / "conf" / "model" / "my-smollm2.yaml").write_text("# @package model\n" + yaml.safe_dump(node))
    proc = run_cli("model=my-smollm2", "+method=kivi", "bits=2", *TINY, "output.root=out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list((tmp_path / "out" / "niah" / "my-smollm2" / "kivi-2b").glob("*/metrics.json"))


def test_config_path_folders_are_searched_and_bad_entries_are_one_line(tmp_path, monkeypatch):
    mine = tmp_path / "nodes"
    (mine / "task").mkdir(parents=True)
    (mine / "task" / "short_niah.yaml").write_text(
        "# @package task\ndefaults:\n  - niah\n  - _self_\ncontext_lengths: [300]\n"
    )
    proc = run_cli("task=short_niah", "--cfg", "job", cwd=tmp_path, env={paths.CONFIG_PATH_ENV: str(mine)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert yaml.safe_load(proc.stdout)["task"]["context_lengths"] == [300]
    missing = tmp_path / "nope"
    proc = run_cli(
        "task=short_niah", cwd=tmp_path, env={paths.CONFIG_PATH_ENV: f"{mine}{os.pathsep}{missing}"}
    )
    assert proc.returncode == 2 and proc.stderr.startswith(f"kvbench: error: {paths.CONFIG_PATH_ENV}=")
    assert f"{missing} does not exist" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(paths.CONFIG_PATH_ENV, str(missing))
    with pytest.raises(ConfigError):
        paths.user_config_dirs()
    assert paths.user_config_dirs(strict=False) == [REPO / "conf"]  # the checkout's own


def test_a_node_that_does_not_parse_is_one_line(tmp_path):
    (tmp_path / "conf" / "method").mkdir(parents=True)
    bad = tmp_path / "conf" / "method" / "mine.yaml"
    bad.write_text("name: kivi\nbits: [2\n")
    proc = run_cli("+method=mine", *TINY, cwd=tmp_path)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"kvbench: error: {bad.resolve()}: line 3, column 1: not valid YAML ("), line


def test_a_node_with_a_shipped_name_is_a_warning(tmp_path):
    (tmp_path / "conf" / "method").mkdir(parents=True)
    mine = tmp_path / "conf" / "method" / "kivi.yaml"
    mine.write_text("name: uniform\nbits: 3\n")
    proc = run_cli("+method=kivi", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (warning,) = [line for line in proc.stderr.splitlines() if line.startswith("kvbench: warning:")]
    assert str(mine.resolve()) in warning and "kvbench/conf/method/kivi.yaml" in warning
