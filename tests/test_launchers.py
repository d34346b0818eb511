"""kvbench's submitit launchers and Slurm profiles, without a scheduler (tests/slurm/ has the real one)."""

from __future__ import annotations

import pickle
import stat
import sys
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.utils import JobReturn, JobStatus

from kvbench.__main__ import CONF_DIR
from kvbench.errors import ConfigError
from kvbench.launchers import (
    LocalSweepLauncher,
    PointError,
    SlurmSweepLauncher,
    _point_labels,
    _SweepLauncher,
    _user_error_in,
    job_name,
    register,
)
from kvbench.models import ModelConfig, model_node
from kvbench.results import run_id


def launcher_node(*overrides: str):
    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=list(overrides), return_hydra_config=True)
    return cfg.hydra.launcher


@pytest.mark.parametrize(
    "model, launcher, expected",
    [
        # The default model asks for CPUs only; the papers' models for a GPU and its memory.
        ("smollm2-135m", "slurm", (0, 1, 4)),
        ("llama3.1-8b-instruct", "slurm", (1, 8, 64)),
        ("mistral-7b-instruct-v0.2", "slurm", (1, 8, 64)),
        ("llama3.1-8b-instruct", "slurm_cpu", (0, 8, 64)),
        ("smollm2-135m", "slurm_cpu", (0, 1, 4)),
    ],
)
def test_slurm_profiles_follow_the_model_node(model, launcher, expected):
    node = launcher_node(f"model={model}", f"hydra/launcher={launcher}")
    assert (node.gpus_per_node, node.cpus_per_task, node.mem_gb) == expected
    resources = model_node(model)["resources"]
    if launcher == "slurm":
        assert expected == (resources["gpus"], resources["cpus"], resources["mem_gb"])
    assert node._target_ == "hydra_plugins.kvbench_launcher.KvbenchSlurmLauncher"


def test_profiles_fall_back_where_the_model_names_no_resources():
    node = launcher_node("hydra/launcher=slurm", "~model.resources")
    assert (node.gpus_per_node, node.cpus_per_task, node.mem_gb) == (1, 8, 64)
    node = launcher_node("hydra/launcher=slurm_cpu", "~model.resources")
    assert (node.gpus_per_node, node.cpus_per_task, node.mem_gb) == (0, 2, 8)


def test_submitit_local_is_kvbench_launcher_and_overrides_still_apply():
    node = launcher_node("hydra/launcher=submitit_local", "hydra.launcher.timeout_min=7")
    assert node._target_ == "hydra_plugins.kvbench_launcher.KvbenchLocalLauncher"
    assert node.timeout_min == 7
    node = launcher_node("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.mem_gb=128")
    assert (node.partition, node.mem_gb) == ("gpu", 128)


def test_resources_are_not_part_of_the_run_id():
    node = model_node("smollm2-135m")
    config = {"model": node, "task": {"name": "niah"}, "seed": 0}
    without = {**config, "model": {k: v for k, v in node.items() if k != "resources"}}
    bigger = {**config, "model": {**node, "resources": {"gpus": 4, "cpus": 64, "mem_gb": 512}}}
    assert run_id(config) == run_id(without) == run_id(bigger)
    assert run_id(config) != run_id({**config, "model": {**node, "dtype": "float16"}})


@pytest.mark.parametrize(
    "resources, key",
    [
        ({"gpu": 1}, "model.resources.gpu"),
        ({"mem_gb": -1}, "model.resources.mem_gb"),
        ({"cpus": 1.5}, "model.resources.cpus"),
    ],
)
def test_bad_resources_name_the_key(resources, key):
    node = {**model_node("smollm2-135m"), "resources": resources}
    with pytest.raises(ConfigError) as err:
        ModelConfig(**node)
    assert str(err.value).startswith(f"{key}=")


def test_points_are_labelled_by_what_tells_them_apart():
    points = [
        ["+method=kivi", "bits=2", "task.depths=[50]"],
        ["+method=kivi", "bits=4", "task.depths=[50]"],
        ["+method=uniform", "bits=4", "task.depths=[50]"],
    ]
    assert _point_labels(points) == ["+method=kivi bits=2", "+method=kivi bits=4", "+method=uniform bits=4"]
    assert _point_labels([["+method=kivi", "bits=2"]]) == ["+method=kivi bits=2"]


def test_point_error_survives_the_trip_from_the_job():
    error = pickle.loads(pickle.dumps(PointError("bits=9.0: allowed ...", user_error=True)))
    assert (str(error), error.user_error) == ("bits=9.0: allowed ...", True)


def test_slurm_states_come_from_squeue(tmp_path, monkeypatch):
    # A stand-in squeue: 7_0 still running, 7_1 requeued, 7_2 cancelled, 7_3 no longer listed.
    squeue = tmp_path / "squeue"
    squeue.write_text("#!/bin/sh\nprintf '7_0|RUNNING\\n7_1|REQUEUED\\n7_2|CANCELLED by 0\\n'\n")
    squeue.chmod(squeue.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    launcher = SlurmSweepLauncher()
    jobs = [SimpleNamespace(job_id=f"7_{i}") for i in range(4)]
    states = launcher._states(jobs)
    assert states["7_0"] is None and states["7_1"] is None
    assert states["7_2"] == "CANCELLED"
    assert states["7_3"].startswith("ENDED")
    # No squeue at all: nothing is declared ended, the launcher keeps waiting for results.
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert SlurmSweepLauncher()._states(jobs) == {}


# The plugin's launcher that kvbench's extends (Hydra's plugin scan re-executes the plugin's module,
# so the module's name may point at a newer copy of the class).
PLUGIN_LAUNCHER = _SweepLauncher.__bases__[0]


def exits_on_a_user_error(self, *args):
    # What kvbench's entry does with a ConfigError: print it, exit 2 from inside the handler.
    try:
        raise ConfigError("bits", 9.0, "allowed values are ...")
    except ConfigError as err:
        print(f"kvbench: error: {err}", file=sys.stderr)
        sys.exit(2)


def test_a_point_that_exits_on_a_user_error_comes_back_as_its_line(monkeypatch):
    monkeypatch.setattr(PLUGIN_LAUNCHER, "__call__", exits_on_a_user_error)
    ret = LocalSweepLauncher()(["bits=9"], "hydra.sweep.dir", 0, "job_id_for_0", {})
    assert ret.status == JobStatus.FAILED
    error = pickle.loads(pickle.dumps(ret._return_value))
    assert (str(error), error.user_error) == ("bits=9.0: allowed values are ...", True)


def test_a_point_that_crashes_comes_back_as_its_last_line_with_the_traceback_in_the_log(monkeypatch, capsys):
    def crashes(self, *args):
        try:
            raise RuntimeError("out of memory")
        except RuntimeError as err:
            return JobReturn(overrides=["bits=2"], status=JobStatus.FAILED, _return_value=err)

    monkeypatch.setattr(PLUGIN_LAUNCHER, "__call__", crashes)
    ret = LocalSweepLauncher()(["bits=2"], "hydra.sweep.dir", 0, "job_id_for_0", {})
    error = pickle.loads(pickle.dumps(ret._return_value))
    assert (str(error), error.user_error) == ("RuntimeError: out of memory", False)
    assert "Traceback" in capsys.readouterr().err


def test_a_user_error_without_its_exception_is_read_from_the_log(tmp_path):
    log = tmp_path / "1_0_log.err"
    log.write_text("Loading weights\nkvbench: error: seed=-1: a non-negative integer\n")
    assert _user_error_in(log) == "seed=-1: a non-negative integer"
    assert _user_error_in(tmp_path / "missing.err").startswith("exited with status 2")


def test_slurm_jobs_are_named_after_task_and_method():
    from omegaconf import OmegaConf

    config = OmegaConf.create({"task": {"name": "niah"}, "hydra": {"job": {"name": "kvbench"}}})
    sweep = [["+method=kivi", "bits=2"], ["+method=kivi", "bits=4"], ["+method=uniform", "bits=2"]]
    assert job_name(config, sweep) == "kvbench-niah-kivi+uniform"
    assert job_name(config, [["task=perplexity", "bits=2"]]) == "kvbench-perplexity-fp16"  # no method
    arms = [["+experiment/arms/specache_niah@method=kivi_1b"], ["+experiment/arms/specache_niah@method=fp16"]]
    assert job_name(config, arms) == "kvbench-niah-kivi_1b+fp16"
    many = [[f"+method=m{i:03d}"] for i in range(100)]
    assert len(job_name(config, many)) == 96 and job_name(config, many).endswith("...")


def test_the_launcher_passes_the_name_to_the_scheduler(tmp_path, monkeypatch):
    from omegaconf import OmegaConf

    captured = {}

    class Executor:
        def __init__(self, **init):
            pass

        def update_parameters(self, **params):
            captured.update(params)

        def map_array(self, *args):
            raise RuntimeError("stop after the submission parameters")

    import submitit

    monkeypatch.setattr(submitit, "AutoExecutor", lambda **kw: Executor(**kw))
    launcher = SlurmSweepLauncher(submitit_folder=str(tmp_path), name="kvbench", timeout_min=5)
    launcher.config = OmegaConf.create(
        {"task": {"name": "niah"}, "hydra": {"job": {"name": "kvbench"}, "sweep": {"dir": str(tmp_path)}}}
    )
    with pytest.raises(RuntimeError, match="stop after"):
        launcher.launch([["+method=kivi", "bits=2"], ["+method=kivi", "bits=4"]], 0)
    assert captured["name"] == "kvbench-niah-kivi"
    # a name the user gave stays
    launcher = SlurmSweepLauncher(submitit_folder=str(tmp_path), name="mine", timeout_min=5)
    launcher.config = OmegaConf.create(
        {"task": {"name": "niah"}, "hydra": {"job": {"name": "kvbench"}, "sweep": {"dir": str(tmp_path)}}}
    )
    with pytest.raises(RuntimeError, match="stop after"):
        launcher.launch([["+method=kivi", "bits=2"]], 0)
    assert captured["name"] == "mine"
