"""kvbench's submitit launchers and Slurm profiles, without a scheduler (tests/slurm/ has the real one)."""

from __future__ import annotations

import pickle
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.utils import JobReturn, JobStatus

from kvbench.__main__ import CONF_DIR
from kvbench.errors import ConfigError
from kvbench.launchers import (
    LocalSweepLauncher,
    PointError,
    PointGroup,
    SlurmSweepLauncher,
    _point_labels,
    _returned,
    _SweepLauncher,
    _user_error_in,
    group_points,
    job_name,
    point_result_path,
    points_per_job,
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


def test_kvbench_local_is_kvbench_launcher_and_overrides_still_apply():
    node = launcher_node("hydra/launcher=kvbench_local", "hydra.launcher.timeout_min=7")
    assert node._target_ == "hydra_plugins.kvbench_launcher.KvbenchLocalLauncher"
    assert node.timeout_min == 7
    node = launcher_node("hydra/launcher=slurm", "hydra.launcher.partition=gpu", "hydra.launcher.mem_gb=128")
    assert (node.partition, node.mem_gb) == ("gpu", 128)


@pytest.mark.parametrize(
    "name, cls",
    [("submitit_local", "LocalLauncher"), ("submitit_slurm", "SlurmLauncher")],
)
def test_stock_launcher_names_reach_the_stock_plugin(name, cls):
    # kvbench's launchers have names of their own; the plugin's names are not shadowed, even after
    # register() (which the CLI calls before composing) and Hydra's plugin scan have both run.
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher

    Plugins.instance()
    register()
    node = launcher_node(f"hydra/launcher={name}")
    assert node._target_ == f"hydra_plugins.hydra_submitit_launcher.submitit_launcher.{cls}"
    assert hasattr(submitit_launcher, cls) and "points_per_job" not in node
    stored = ConfigStore.instance().repo["hydra"]["launcher"]
    assert stored[f"{name}.yaml"].provider == "submitit_launcher"
    assert stored[f"kvbench_{name.removeprefix('submitit_')}.yaml"].provider == "kvbench"


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


# -- points_per_job: a job holding a group of points -------------------------------------------------


def test_points_per_job_is_checked_with_one_line_naming_the_knob():
    assert points_per_job(1) == 1 and points_per_job(3) == 3 and points_per_job("auto") == "auto"
    assert points_per_job("2") == 2
    for bad in (0, -1, 2.5, True, "all", None):
        with pytest.raises(ConfigError) as err:
            points_per_job(bad)
        message = str(err.value)
        assert message.startswith(f"hydra.launcher.points_per_job={bad!r}: ")
        assert "at least 1" in message and "auto" in message and "\n" not in message


def test_the_knob_is_in_every_launcher_node_and_defaults_to_a_job_per_point():
    assert launcher_node("hydra/launcher=slurm").points_per_job == 1
    assert (
        launcher_node("hydra/launcher=slurm_cpu", "hydra.launcher.points_per_job=auto").points_per_job
        == "auto"
    )
    assert (
        launcher_node("hydra/launcher=kvbench_local", "hydra.launcher.points_per_job=4").points_per_job == 4
    )
    # kvbench's knob, not submitit's: the executor never sees it
    assert "points_per_job" not in LocalSweepLauncher(points_per_job=2, timeout_min=5).params


def test_points_are_grouped_by_model_and_task_in_sweep_order():
    keys = ["a", "a", "b", "a", "b", "a"]
    assert group_points(keys, 1) == [[0], [1], [2], [3], [4], [5]]
    assert group_points(keys, 2) == [[0, 1], [2, 4], [3, 5]]
    assert group_points(keys, 3) == [[0, 1, 3], [2, 4], [5]]
    assert group_points(keys, "auto") == [[0, 1, 3, 5], [2, 4]]
    assert point_result_path(Path("/f/7_1_0_result.pkl"), 4) == Path("/f/7_1_0_point4_result.pkl")


class FakeExecutor:
    """submitit's executor run in this process: each task of the array runs at once, writing its
    result where submitit does (and its point results where the job's environment says)."""

    def __init__(self, folder: Path, calls: list):
        self.folder, self.calls = folder, calls

    def update_parameters(self, **params):
        assert not any(key.endswith("points_per_job") for key in params)

    def map_array(self, fn, *iterables):
        import cloudpickle

        jobs = []
        for task, args in enumerate(zip(*iterables, strict=True)):
            job_id = f"9_{task}"
            paths = SimpleNamespace(
                result_pickle=self.folder / f"{job_id}_0_result.pkl",
                stderr=self.folder / f"{job_id}_0_log.err",
            )
            self.calls.append((fn, args))
            CURRENT["result"] = paths.result_pickle
            try:
                result = ("success", fn(*args))
            except Exception as err:
                result = ("error", f"Traceback ...\n{type(err).__name__}: {err}")
            with paths.result_pickle.open("wb") as out:
                cloudpickle.dump(result, out)
            jobs.append(SimpleNamespace(job_id=job_id, paths=paths, done=lambda: True, state="COMPLETED"))
        return jobs


CURRENT: dict = {}


def fake_point(self, sweep_overrides, *args):
    """A point's run as Hydra's run_job returns it: bits=9 is a user error, bits=8 crashes."""
    values = dict(o.lstrip("+").split("=", 1) for o in sweep_overrides)
    CURRENT.setdefault("ran", []).append(values)
    if values.get("bits") == "9":
        return JobReturn(
            sweep_overrides, status=JobStatus.FAILED, _return_value=ConfigError("bits", 9, "1 to 8")
        )
    if values.get("bits") == "8":
        return JobReturn(
            sweep_overrides, status=JobStatus.FAILED, _return_value=RuntimeError("out of memory")
        )
    return JobReturn(
        sweep_overrides, status=JobStatus.COMPLETED, _return_value={"score": int(values["bits"])}
    )


def sweep_launcher(tmp_path, monkeypatch, **params):
    """A local launcher whose jobs run in this process, and the list of tasks it submits."""
    import submitit
    from omegaconf import OmegaConf

    import kvbench.launchers as launchers

    calls: list = []
    CURRENT.clear()
    monkeypatch.setattr(submitit, "AutoExecutor", lambda **kw: FakeExecutor(tmp_path, calls))
    monkeypatch.setattr(launchers, "_job_result_pickle", lambda: CURRENT["result"])
    monkeypatch.setattr(PLUGIN_LAUNCHER, "__call__", fake_point)
    launcher = LocalSweepLauncher(submitit_folder=str(tmp_path), name="mine", timeout_min=5, **params)
    launcher.config = OmegaConf.create(
        {
            "task": {"name": "niah"},
            "hydra": {"job": {"name": "kvbench"}, "sweep": {"dir": str(tmp_path / "s")}},
        }
    )

    def load_sweep_config(config, overrides):
        # model and task as composed for the point: task=... changes the task, bits=... only the method
        values = dict(o.lstrip("+").split("=", 1) for o in overrides)
        if values.get("task") == "broken":
            raise ValueError("no such task")
        return OmegaConf.create({"model": {"name": "m"}, "task": {"name": values.get("task", "niah")}})

    launcher.hydra_context = SimpleNamespace(
        config_loader=SimpleNamespace(load_sweep_config=load_sweep_config)
    )
    return launcher, calls


def test_two_points_per_job_submit_three_points_as_two_tasks_and_report_each(
    tmp_path, monkeypatch, capsys, caplog
):
    caplog.set_level("INFO", logger="kvbench.launchers")
    launcher, calls = sweep_launcher(tmp_path, monkeypatch, points_per_job=2)
    returns = launcher.launch([["bits=2"], ["bits=3"], ["bits=4"]], 0)
    assert len(calls) == 2  # two array tasks: points #0 and #1 in one, #2 alone
    assert [[args[2] for args in call[1][0]] for call in calls] == [[0, 1], [2]]
    assert [r.return_value for r in returns] == [{"score": 2}, {"score": 3}, {"score": 4}]
    out = capsys.readouterr()
    rows = [line.split() for line in out.out.splitlines()[1:]]
    assert [row[:3] for row in rows] == [["0", "bits=2", "2"], ["1", "bits=3", "3"], ["2", "bits=4", "4"]]
    assert "3 points submitted in 2 jobs" in caplog.text
    # each point's result was saved as it ended, beside its job's
    assert sorted(p.name for p in tmp_path.glob("*_point*")) == [
        "9_0_0_point0_result.pkl",
        "9_0_0_point1_result.pkl",
        "9_1_0_point2_result.pkl",
    ]


def test_a_failing_point_does_not_stop_its_group_and_is_its_own_line(tmp_path, monkeypatch, capsys):
    launcher, calls = sweep_launcher(tmp_path, monkeypatch, points_per_job=2)
    with pytest.raises(SystemExit) as stop:
        launcher.launch([["bits=9"], ["bits=3"], ["bits=4"]], 0)
    assert stop.value.code == 2  # every failure a user error
    assert [values["bits"] for values in CURRENT["ran"]] == ["9", "3", "4"]  # #1 ran after #0 failed
    out = capsys.readouterr()
    failures = [line for line in out.err.splitlines() if line.startswith("kvbench: error: point")]
    assert failures == [
        f"kvbench: error: point #0 (bits=9): bits=9: 1 to 8 [log: {tmp_path / '9_0_0_log.err'}]"
    ]
    rows = {line.split()[1]: line.split() for line in out.out.splitlines()[1:]}
    assert "FAILED" in rows["bits=9"] and str(tmp_path / "9_0_0_log.err") in rows["bits=9"]
    assert "COMPLETED" in rows["bits=3"] and "COMPLETED" in rows["bits=4"]
    assert len(out.out.splitlines()) == 4  # header and a row per point


def test_a_crash_in_a_group_exits_1_and_the_other_points_still_report(tmp_path, monkeypatch, capsys):
    launcher, calls = sweep_launcher(tmp_path, monkeypatch, points_per_job="auto")
    with pytest.raises(SystemExit) as stop:
        launcher.launch([["bits=2"], ["bits=8"], ["bits=9"], ["bits=4"]], 5)
    assert stop.value.code == 1  # not every failure was a user error
    assert len(calls) == 1  # auto: every point shares model and task, one job
    err = capsys.readouterr().err
    assert "point #6 (bits=8) FAILED: RuntimeError: out of memory" in err
    assert "kvbench: error: point #7 (bits=9): bits=9: 1 to 8" in err
    assert [values["bits"] for values in CURRENT["ran"]] == ["2", "8", "9", "4"]


def test_points_of_other_tasks_go_to_other_jobs(tmp_path, monkeypatch, capsys):
    launcher, calls = sweep_launcher(tmp_path, monkeypatch, points_per_job="auto")
    sweep = [["task=niah", "bits=2"], ["task=ppl", "bits=2"], ["task=niah", "bits=4"], ["task=ppl", "bits=4"]]
    launcher.launch(sweep, 0)
    assert [[args[2] for args in call[1][0]] for call in calls] == [[0, 2], [1, 3]]
    # a point whose config does not compose here runs alone
    launcher, calls = sweep_launcher(tmp_path / "x", monkeypatch, points_per_job=2)
    (tmp_path / "x").mkdir()
    launcher.launch([["bits=2"], ["task=broken", "bits=3"], ["bits=4"]], 0)
    assert [[args[2] for args in call[1][0]] for call in calls] == [[0, 2], [1]]


def test_one_point_per_job_submits_the_launcher_itself_as_before(tmp_path, monkeypatch, capsys, caplog):
    caplog.set_level("INFO", logger="kvbench.launchers")
    launcher, calls = sweep_launcher(tmp_path, monkeypatch)
    launcher.launch([["bits=2"], ["bits=3"]], 0)
    assert [call[0] for call in calls] == [launcher, launcher]
    assert not list(tmp_path.glob("*_point*"))
    assert "2 points submitted (local" in caplog.text


def test_a_bad_points_per_job_stops_the_sweep_before_submitting(tmp_path, monkeypatch, capsys):
    launcher, calls = sweep_launcher(tmp_path, monkeypatch, points_per_job=0)
    with pytest.raises(SystemExit) as stop:
        launcher.launch([["bits=2"]], 0)
    assert stop.value.code == 2 and calls == []
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvbench: error: hydra.launcher.points_per_job=0: {err[0].split(': ', 3)[-1]}"]
    assert "auto" in err[0]


def test_a_point_results_arrive_before_its_job_ends_and_survive_a_killed_job(tmp_path):
    # The job (2 points) was ended by the scheduler after its first point: #3 is reported, #4 is not.
    import cloudpickle

    done = JobReturn(["bits=2"], status=JobStatus.COMPLETED, _return_value={"score": 2})
    result = tmp_path / "9_0_0_result.pkl"
    job = SimpleNamespace(job_id="9_0", paths=SimpleNamespace(result_pickle=result, stderr=tmp_path / "e"))
    assert _returned(job, 3) is None
    point_result_path(result, 3).write_bytes(cloudpickle.dumps(done))
    assert _returned(job, 3).state == "COMPLETED" and _returned(job, 4) is None
    # the job ended on its own: a point missing from its results is a failure of that point only
    result.write_bytes(cloudpickle.dumps(("success", {3: done})))
    assert _returned(job, 3).state == "COMPLETED"
    assert "without running it" in str(_returned(job, 4).error)


def test_a_requeued_group_runs_only_the_points_it_had_not_finished(tmp_path, monkeypatch):
    import kvbench.launchers as launchers

    monkeypatch.setattr(launchers, "_job_result_pickle", lambda: tmp_path / "9_0_0_result.pkl")
    monkeypatch.setattr(PLUGIN_LAUNCHER, "__call__", fake_point)
    group = PointGroup(LocalSweepLauncher())
    points = [
        (["bits=2"], "hydra.sweep.dir", 0, "job_id_for_0", {}),
        (["bits=3"], "hydra.sweep.dir", 1, "", {}),
    ]
    group(points[:1])  # the timeout comes while point #1 runs
    delayed = group.checkpoint(points)
    assert [args[2] for args in delayed.args[0]] == [1]
    assert isinstance(delayed.function, PointGroup)


def test_a_point_that_raises_outside_its_task_fails_alone(tmp_path, monkeypatch, capsys):
    import kvbench.launchers as launchers

    def raises(self, sweep_overrides, *args):
        if sweep_overrides == ["bits=2"]:
            raise KeyError("composing the point's config")
        return fake_point(self, sweep_overrides, *args)

    monkeypatch.setattr(launchers, "_job_result_pickle", lambda: tmp_path / "9_0_0_result.pkl")
    monkeypatch.setattr(PLUGIN_LAUNCHER, "__call__", raises)
    returns = PointGroup(LocalSweepLauncher())([(["bits=2"], "d", 0, "", {}), (["bits=3"], "d", 1, "", {})])
    assert returns[0].status == JobStatus.FAILED and "KeyError" in str(returns[0]._return_value)
    assert returns[1].return_value == {"score": 3}
    assert "Traceback" in capsys.readouterr().err


APP = """
import os

import hydra

from kvbench.errors import ConfigError
from kvbench.launchers import register


@hydra.main(config_path=None, config_name=None, version_base="1.3")
def main(cfg):
    if cfg.x == 1:
        raise ConfigError("x", cfg.x, "not one")
    return {"x": cfg.x, "pid": os.getpid()}


if __name__ == "__main__":
    register()
    main()
"""


def test_kvbench_local_runs_a_group_in_one_process(tmp_path):
    """The real submitit: 3 points, 2 per job; the first point fails, the second still runs in
    the same process; every point has its row, the failure its one line."""
    import subprocess

    (tmp_path / "app.py").write_text(APP)
    sweep = tmp_path / "sweep"
    argv = ["-m", "+x=1,2,3", "hydra/launcher=kvbench_local", "hydra.launcher.points_per_job=2"]
    done = subprocess.run(
        [sys.executable, "app.py", *argv, f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    jobs = sorted(p for p in (sweep / ".submitit").iterdir() if p.name != "%j")
    assert len(jobs) == 2  # two array tasks
    assert "3 points submitted in 2 jobs" in done.stdout
    table = done.stdout[done.stdout.index("#  point") :].splitlines()
    rows = {line.split()[1]: line.split() for line in table[1:]}
    assert sorted(rows) == ["+x=1", "+x=2", "+x=3"]
    assert rows["+x=1"][2] == "FAILED" and rows["+x=2"][2] == rows["+x=3"][2] == "COMPLETED"
    pids = {point: rows[point][-1] for point in ("+x=2", "+x=3")}
    assert pids["+x=2"] != pids["+x=3"]
    failures = [line for line in done.stderr.splitlines() if line.startswith("kvbench: ")]
    assert len(failures) == 1 and failures[0].startswith(
        "kvbench: error: point #0 (+x=1): x=1: not one [log: "
    )
    log = failures[0].rsplit("[log: ", 1)[1].rstrip("]")
    assert "point #1 (2 of 2 in this job)" in Path(log).read_text()  # #1 ran after #0, in its job


def test_points_share_a_job_when_their_composed_model_and_task_agree():
    # Hydra's own loader on kvbench's configs: bits and the method arm leave model and task as they
    # are; another task, another model, or a point that does not compose, each a job of its own.
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.utils import create_config_search_path
    from hydra.types import RunMode

    register()
    loader = ConfigLoaderImpl(config_search_path=create_config_search_path(CONF_DIR))
    launcher = LocalSweepLauncher()
    launcher.config = loader.load_configuration(
        "config", overrides=["hydra/launcher=kvbench_local"], run_mode=RunMode.MULTIRUN
    )
    launcher.hydra_context = SimpleNamespace(config_loader=loader)
    sweep = [
        ["+method=kivi", "bits=2"],
        ["+method=kivi", "task=perplexity"],
        ["+method=kivi", "bits=4"],
        ["+method=uniform", "bits=2"],
        ["+method=kivi", "model=llama3.1-8b-instruct"],
        ["+method=no_such_method"],
    ]
    keys = launcher._share_keys(sweep)
    assert group_points(keys, "auto") == [[0, 2, 3], [1], [4], [5]]
    assert group_points(keys, 2) == [[0, 2], [1], [3], [4], [5]]


def test_a_job_being_ended_stops_its_group_and_keeps_the_rest_for_the_requeue(tmp_path, monkeypatch):
    # SIGTERM (143) or submitit's requeue (-1) inside a point ends the job, not just the point.
    import kvbench.launchers as launchers

    def ended(self, sweep_overrides, *args):
        if sweep_overrides == ["bits=3"]:
            sys.exit(143)
        return fake_point(self, sweep_overrides, *args)

    CURRENT.clear()
    monkeypatch.setattr(launchers, "_job_result_pickle", lambda: tmp_path / "9_0_0_result.pkl")
    monkeypatch.setattr(PLUGIN_LAUNCHER, "__call__", ended)
    group = PointGroup(LocalSweepLauncher())
    points = [(["bits=2"], "d", 0, "", {}), (["bits=3"], "d", 1, "", {}), (["bits=4"], "d", 2, "", {})]
    with pytest.raises(SystemExit) as stop:
        group(points)
    assert stop.value.code == 143
    assert [values["bits"] for values in CURRENT["ran"]] == ["2"]  # bits=4 never started
    assert [p.name for p in tmp_path.glob("*_point*")] == ["9_0_0_point0_result.pkl"]
    assert [args[2] for args in group.checkpoint(points).args[0]] == [1, 2]
