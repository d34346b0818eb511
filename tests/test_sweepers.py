"""Any Hydra sweeper: ``objective=`` makes a run return the float an optimizing sweeper reads, and
the pre-run checks cover every point of a sampling sweeper's search space."""

import importlib.util
import math
import os
import re
import subprocess
import sys

import pytest
import yaml

from kvbench.errors import ConfigError
from kvbench.objective import check_objective, objective_value

TINY = ["task.context_lengths=[300]", "task.depths=[50]", "task.max_new_tokens=2"]
needs_optuna = pytest.mark.skipif(
    importlib.util.find_spec("hydra_plugins.hydra_optuna_sweeper") is None,
    reason="hydra-optuna-sweeper is not installed (the dev extra: pip install -e .[dev])",
)


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "kvbench", *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env={k: v for k, v in os.environ.items() if k != "KVBENCH_CONFIG_PATH"},
    )


METRICS = {
    "primary_metric": "ppl",
    "metrics": {"ppl": 12.5, "n": 4},
    "memory": {"effective_bits": 3.25, "code_bits": 2.0, "compression": 4.9},
    "timings": {"run_s": 7.0},
}


def test_objective_values_come_from_the_metrics():
    assert objective_value(METRICS, "score") == objective_value(METRICS, "ppl") == 12.5
    assert objective_value(METRICS, ["score", "effective_bits"]) == [12.5, 3.25]
    assert objective_value(METRICS, "time_s") == 7.0
    assert math.isnan(objective_value({**METRICS, "memory": {}}, "compression"))


def test_bad_objectives_are_one_line():
    check_objective(["score", "ppl", "effective_bits"], "ppl")
    with pytest.raises(ConfigError, match=r"objective='accuracy': one of score, effective_bits, .*, ppl"):
        check_objective("accuracy", "ppl")
    with pytest.raises(ConfigError, match=r"objective=3: a name or a list of names"):
        check_objective(3, "ppl")


@needs_optuna
def test_optuna_searches_bits_in_three_trials(tmp_path):
    proc = run_cli(
        "-m",
        "hydra/sweeper=optuna",
        "hydra.sweeper.n_trials=3",
        "hydra.sweeper.n_jobs=1",
        "hydra.sweeper.direction=minimize",
        "hydra.sweeper.sampler.seed=0",
        f"hydra.sweep.dir={tmp_path}/sweep",
        "objective=effective_bits",
        "+method=uniform",
        "bits=choice(2,3,4)",
        *TINY,
        f"output.root={tmp_path}/out",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    trials = re.findall(r"^objective: effective_bits = (\S+)$", proc.stdout, re.M)
    assert len(trials) == 3, proc.stdout[-3000:]
    # every trial's value is the stored run's effective bits, and the study's best is their minimum
    folders = re.findall(r"^results: (\S+)$", proc.stdout, re.M)
    stored = [
        __import__("json").loads(open(f"{f}/metrics.json").read())["memory"]["effective_bits"]
        for f in folders
    ]
    assert [float(t) for t in trials] == pytest.approx(stored)
    best = yaml.safe_load(open(tmp_path / "sweep" / "optimization_results.yaml"))
    assert best["best_value"] == pytest.approx(min(stored))
    assert best["best_params"]["bits"] in (2, 3, 4)


@needs_optuna
@pytest.mark.parametrize(
    "space, expected",
    [
        ("bits=choice(2,9)", ["bits=2", "bits=9"]),
        ("bits=range(2,12,4)", ["bits=2", "bits=6", "bits=10"]),
        ("bits=interval(1,9)", ["bits=1", "bits=9"]),  # a continuous space: its two ends
        ("bits=interval(1.5,2.5)", ["bits=1.5", "bits=2.5"]),
    ],
)
def test_a_sampling_sweepers_search_space_is_enumerated(space, expected):
    from hydra import initialize_config_dir

    from kvbench.__main__ import CONF_DIR, sweep_jobs

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        master, jobs = sweep_jobs(["hydra/sweeper=optuna", "+method=uniform", space])
    assert master.hydra.sweeper._target_.endswith("OptunaSweeper")
    assert [label for label, _ in jobs] == expected
    assert all("+method=uniform" in job for _, job in jobs)


@needs_optuna
def test_a_bad_point_of_the_search_space_fails_before_any_trial(tmp_path):
    args = ["-m", "hydra/sweeper=optuna", "objective=score", "+method=uniform", "bits=interval(1,9)"]
    proc = run_cli(*args, f"output.root={tmp_path}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("kvbench: error: bits=9") and "(sweep point bits=9)" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


def test_basic_sweeper_refuses_an_interval(tmp_path):
    proc = run_cli("-m", "+method=uniform", "bits=interval(1,4)", f"output.root={tmp_path}")
    assert proc.returncode == 2
    assert "an interval needs a sweeper that samples" in proc.stderr and "Traceback" not in proc.stderr
