import socket
from pathlib import Path

import pytest

from kvbench import logger as kvlog
from kvbench.config import LoggerConfig
from kvbench.errors import ConfigError

METRICS = {
    "task": "niah",
    "model": "smollm2-135m",
    "method": "kivi-2b",
    "seed": 3,
    "primary_metric": "score",
    "metrics": {"score": 0.5185, "n": 9, "score_L1024": 0.5556},
    "memory": {"effective_bits": 4.029, "code_bits": 2.0, "last_sample_bytes_by_component": {"codes": 8}},
    "timings": {"run_s": 138.6},
}
CONFIG = {
    "task": {"name": "niah"},
    "method": {"name": "kivi", "bits": 2},
    "seed": 3,
    "logger": {"name": "wandb"},
}


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """wandb confined to tmp_path, with no key and no server reachable unless a test says so."""
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    probes = []

    def refuse(address, timeout=None, *args, **kwargs):
        probes.append((address, timeout))
        raise TimeoutError("simulated: no network")

    monkeypatch.setattr(socket, "create_connection", refuse)
    return tmp_path, probes


def _offline_runs(root: Path):
    """The offline run folders wandb wrote, each checked to hold its record log."""
    runs = sorted((root / "wandb").glob("offline-run-*"))
    for run_dir in runs:
        [log] = run_dir.glob("run-*.wandb")
        assert log.stat().st_size > 0
    return runs


def _flat(summary, prefix: str = "") -> dict:
    """A wandb summary as a flat dict (nested keys joined by ``/``), read through its public
    mapping interface."""
    out = {}
    for key in summary.keys():
        value = summary[key]
        if hasattr(value, "keys"):
            out.update(_flat(value, f"{prefix}{key}/"))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.fixture
def stored(monkeypatch):
    """What reached wandb's public ``Run``: every ``log`` payload, and the config and summary as the
    run holds them just before kvbench finishes it. wandb has no public reader of an offline run's
    record log (and writes neither ``files/wandb-summary.json`` nor ``files/config.yaml`` offline),
    so the tests read the run through its own API before it closes, and check that the run folder
    holds a record log (:func:`_offline_runs`)."""
    import wandb

    seen: dict = {"history": [], "config": None, "summary": None}
    original_log = wandb.Run.log

    def log(self, data, *args, **kwargs):
        seen["history"].append(dict(data))
        return original_log(self, data, *args, **kwargs)

    original_finish = kvlog.WandbLogger.finish

    def finish(self):
        if self.run is not None:
            seen["config"] = dict(self.run.config)
            seen["summary"] = _flat(self.run.summary)
        original_finish(self)

    monkeypatch.setattr(wandb.Run, "log", log)
    monkeypatch.setattr(kvlog.WandbLogger, "finish", finish)
    return seen


def test_offline_mode_writes_run_with_metrics(wandb_env, monkeypatch, stored):
    root, probes = wandb_env
    monkeypatch.setenv("WANDB_MODE", "offline")
    kvlog.log_run(CONFIG, METRICS)
    [_] = _offline_runs(root)
    assert stored["summary"]["metrics/score"] == pytest.approx(0.5185)
    assert stored["summary"]["memory/effective_bits"] == pytest.approx(4.029)
    assert stored["summary"]["primary_metric"] == "score"
    assert stored["history"][0]["timings/run_s"] == pytest.approx(138.6)
    assert stored["history"][0]["memory/bytes_by_component/codes"] == 8  # a shorter panel key
    assert stored["config"]["method"] == {"name": "kivi", "bits": 2}
    assert "logger" not in stored["config"]
    assert probes == []  # WANDB_MODE=offline: the server is never probed


def test_auto_mode_without_api_key_goes_offline_without_probing(wandb_env):
    _, probes = wandb_env
    mode, reason = kvlog.resolve_mode(LoggerConfig(name="wandb"))
    assert mode == "offline" and "API key" in reason
    assert probes == []


def test_auto_mode_with_key_but_no_network_goes_offline(wandb_env, monkeypatch, capsys, stored):
    root, probes = wandb_env
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    cfg = LoggerConfig(name="wandb", probe_timeout=1.5)
    mode, reason = kvlog.resolve_mode(cfg)
    assert mode == "offline" and "not reachable within 1.5 s" in reason
    # One probe, of the default server, bounded by the configured timeout.
    assert probes == [(("api.wandb.ai", 443), 1.5)]
    logger = kvlog.WandbLogger(cfg)
    logger.start({"seed": 0}, name="t")
    assert logger.active and logger.mode == "offline"
    logger.log_run(METRICS)
    logger.finish()
    assert "wandb offline: " in capsys.readouterr().err
    [_] = _offline_runs(root)
    assert stored["summary"]["metrics/n"] == 9


def test_netrc_entry_counts_as_key(wandb_env, monkeypatch):
    root, _ = wandb_env
    netrc_file = root / "netrc"
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password " + "p" * 40 + "\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert kvlog.has_api_key()
    netrc_file.write_text("machine example.org\n  login user\n  password x\n")
    assert not kvlog.has_api_key()


def test_wandb_failures_warn_and_the_run_continues(wandb_env, monkeypatch, capsys):
    import wandb

    modes = []

    def broken_init(*args, mode=None, **kwargs):
        modes.append(mode)
        raise RuntimeError("simulated init timeout")

    monkeypatch.setattr(wandb, "init", broken_init)
    logger = kvlog.WandbLogger(LoggerConfig(name="wandb", mode="online"))
    logger.start({"seed": 0})
    assert modes == ["online", "offline"]  # online failed, retried once offline, then gave up
    assert not logger.active
    logger.log_run(METRICS)  # no-ops, no exception
    logger.finish()
    err = capsys.readouterr().err
    assert "retrying offline" in err and "continuing without wandb" in err


def test_log_failure_disables_logger(wandb_env, capsys):
    class FailingRun:
        summary: dict = {}

        def log(self, data):
            raise OSError("disk full")

        def finish(self):
            raise AssertionError("finish must not be called on a disabled logger")

    logger = kvlog.WandbLogger(LoggerConfig(name="wandb"))
    logger.run = FailingRun()
    logger.log_run(METRICS)
    assert not logger.active
    logger.finish()
    assert "wandb log failed (OSError: disk full)" in capsys.readouterr().err


def test_logger_config_and_null_logger():
    assert isinstance(kvlog.build_logger(None), kvlog.NullLogger)
    assert isinstance(kvlog.build_logger({"name": "none"}), kvlog.NullLogger)
    assert isinstance(kvlog.build_logger({"name": "wandb"}), kvlog.WandbLogger)
    with pytest.raises(ConfigError, match="logger.mode"):
        kvlog.build_logger({"name": "wandb", "mode": "sometimes"})
    with pytest.raises(ConfigError, match="logger.name"):
        kvlog.build_logger({"name": "tensorboard"})
    with pytest.raises(ConfigError, match="logger.init_timeout"):
        kvlog.build_logger({"name": "wandb", "init_timeout": 0})
    flat = kvlog.flatten({"a": {"b": 1, "c": "x", "d": float("nan")}, "e": 2.5, "f": True})
    assert flat == {"a/b": 1, "e": 2.5}


def test_hydra_logger_group_composes():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from kvbench.__main__ import CONF_DIR
    from kvbench.results import run_id

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        default = compose(config_name="config")
        wandb_cfg = compose(config_name="config", overrides=["logger=wandb", "logger.mode=offline"])
    assert default.logger.name == "none"
    assert wandb_cfg.logger.name == "wandb" and wandb_cfg.logger.mode == "offline"
    assert wandb_cfg.logger.probe_timeout == 2
    # The logger never changes the run id (the same experiment keeps its folder).
    plain = OmegaConf.to_container(default, resolve=True)
    logged = OmegaConf.to_container(wandb_cfg, resolve=True)
    assert plain["logger"] != logged["logger"] and run_id(plain) == run_id(logged)


def test_report_figures_logged_offline(wandb_env, monkeypatch, stored):
    from synthetic_runs import write_runs

    from kvbench.report import build_report

    root, _ = wandb_env
    monkeypatch.setenv("WANDB_MODE", "offline")
    result = build_report(write_runs(root / "runs"), root / "out", n_resamples=200, say=lambda _: None)
    kvlog.log_report(result)
    [_] = _offline_runs(root)
    summary = stored["summary"]
    unit = "synthetic_cliff"  # the one unit's section: its experiment (folder niah_tiny_synthetic_cliff)
    assert summary[f"{unit}/cliff_map/_type"] == "image-file"
    assert summary[f"{unit}/memory_quality/_type"] == "image-file"
    png = root / "out" / "niah_tiny_synthetic_cliff" / "cliff_map.png"
    assert summary[f"{unit}/cliff_map/size"] == png.stat().st_size
    assert summary[f"{unit}/paired/_type"] == "table-file"
    assert summary[f"{unit}/paired/nrows"] == 3  # uniform at 4, 3 and 2 bits against fp16


def test_finish_waits_for_wandb_to_write_the_run(wandb_env, monkeypatch):
    """run.finish() may return while wandb's service still writes the record log (a reader right
    after it then misses the summary under load); the logger's finish also waits for the flush."""
    import wandb

    calls = []

    class Run:
        summary: dict = {}

        def finish(self):
            calls.append("finish")

    monkeypatch.setattr(wandb, "teardown", lambda *a, **k: calls.append("teardown"))
    logger = kvlog.WandbLogger(LoggerConfig(name="wandb"))
    logger.run = Run()
    logger.finish()
    assert calls == ["finish", "teardown"] and not logger.active
    logger.finish()  # a second finish is a no-op
    assert calls == ["finish", "teardown"]


def test_runs_and_their_report_share_the_experiments_group(wandb_env, monkeypatch):
    """A run's wandb id is its run id (logged twice: one wandb run) and its group its experiment;
    the report joins that group as job type ``report`` and names the runs it read."""
    import wandb
    from synthetic_runs import write_runs

    from kvbench.report import build_report

    calls = []

    class Run:
        summary: dict = {}

        def log(self, payload):
            pass

        def finish(self):
            pass

    def init(**kwargs):
        calls.append(kwargs)
        return Run()

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(wandb, "teardown", lambda: None)
    config = {**CONFIG, "analysis": {"name": "synthetic_cliff"}}
    kvlog.log_run(config, {**METRICS, "run_id": "abc123"})
    kvlog.log_run(config, {**METRICS, "run_id": "abc123"})
    assert [(c["id"], c["resume"], c["group"], c["job_type"]) for c in calls] == [
        ("abc123", "allow", "synthetic_cliff", "run")
    ] * 2
    kvlog.log_run(CONFIG, {**METRICS, "run_id": "def456"})
    assert calls[-1]["group"] == "adhoc-niah"  # outside an experiment: the archive's name
    root, _ = wandb_env
    runs = write_runs(root / "runs")
    result = build_report(runs, root / "out", n_resamples=200, say=lambda _: None)
    kvlog.log_report(result)
    report = calls[-1]
    assert (report["job_type"], report["group"]) == ("report", "synthetic_cliff")
    assert report["config"]["runs"] == sorted(result["frame"]["run_id"].unique())
    assert "id" not in report


def test_a_runs_samples_are_one_table(wandb_env, monkeypatch, stored, tmp_path):
    import json

    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    rows = [
        {"sample_id": "a", "score": 1.0, "prediction": "42", "memory": {"effective_bits": 3.8, "x": {}}},
        {"sample_id": "b", "score": 0.0, "prediction": "7", "memory": {"effective_bits": 4.1}},
    ]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    kvlog.log_run(CONFIG, {**METRICS, "folder": str(tmp_path)})
    table = stored["history"][0]["samples"]
    assert isinstance(table, wandb.Table)
    assert table.columns == ["sample_id", "score", "prediction", "memory/effective_bits"]
    assert table.data == [["a", 1.0, "42", 3.8], ["b", 0.0, "7", 4.1]]
    # a run folder without rows (or none named) logs no table
    kvlog.log_run(CONFIG, {**METRICS, "folder": str(tmp_path / "missing")})
    assert "samples" not in stored["history"][-1]


# -- panel keys: short, readable and distinct ---------------------------------------------------------


class _KeyRun:
    """A stand-in for a wandb run: records the keys it is given (no wandb process, no network)."""

    def __init__(self):
        self.keys: list[str] = []
        self.summary = self

    def log(self, payload):
        self.keys += list(payload)

    def update(self, payload):
        self.keys += [k for k in payload if k not in self.keys]


LONG_METRICS = {
    **METRICS,
    "metrics": {
        "score": 0.5,
        "by_task": {
            **{
                f"passage_retrieval_zh_and_some_more_{i}": {"score_at_context_length_8192": i}
                for i in range(3)
            },
            "passage_retrieval_zh_and_some_more": {"score_at_context_length_8192_tokens_x": 1.0},
        },
    },
    "memory": {"last_sample_bytes_by_component": {"residual": 1, "codes": 2, "scales": 3}},
}


def test_run_panel_keys_are_short_and_distinct():
    logger = kvlog.WandbLogger(LoggerConfig(name="wandb"))
    logger.run = run = _KeyRun()
    logger.log_run(LONG_METRICS)
    logged = [k for k in run.keys if k != "primary_metric"]
    flat = kvlog.flatten({k: LONG_METRICS[k] for k in ("metrics", "memory", "timings")})
    assert len(logged) == len(set(logged)) == len(flat)  # every value under a key of its own
    assert max(map(len, logged)) <= kvlog.PANEL_KEY_MAX
    assert "memory/bytes_by_component/residual" in logged and "metrics/score" in logged
    # a cut key ends in a hash of the full key, so two keys that agree up to the cut stay apart
    cut = [k for k in logged if "~" in k]
    assert cut and len(cut) == len(set(cut)) == 4


def _unit(task, model, experiment, tmp_path):
    import pandas as pd

    png = tmp_path / f"{task}_{model}_{experiment}_memory_quality_against_the_declared_reference.png"
    png.write_bytes(b"")
    table = pd.DataFrame({"a": [1]})
    return {
        "key": (task, model, experiment),
        "folder": tmp_path,
        "figures": [png],
        "means": table,
        "paired": table,
        "cliff": table.iloc[:0],
    }


def test_report_panel_keys_are_short_and_distinct(tmp_path, monkeypatch):
    import wandb

    monkeypatch.setattr(wandb, "Image", lambda path: ("image", path))
    monkeypatch.setattr(wandb, "Table", lambda dataframe: ("table", len(dataframe)))
    units = [
        _unit("perplexity", "qwen2.5-coder-1.5b-instruct", "semkv_turboquant_interpolation", tmp_path),
        _unit("niah", "qwen2.5-coder-1.5b-instruct", "semkv_turboquant_interpolation", tmp_path),
        _unit("perplexity", "smollm2-135m", "semkv_turboquant_interpolation", tmp_path),
        _unit("longbench", "llama3.1-8b-instruct", None, tmp_path),
    ]
    logger = kvlog.WandbLogger(LoggerConfig(name="wandb"))
    logger.run = run = _KeyRun()
    logger.log_report({"units": units})
    assert len(run.keys) == len(set(run.keys)) == 4 * 3  # a figure and two non-empty tables each
    assert max(map(len, run.keys)) <= kvlog.PANEL_KEY_MAX
    # sections: the fewest names that tell the units apart, readable
    sections = sorted({k.split("/")[0] for k in run.keys})
    assert "longbench_llama3.1-8b-instruct" in sections
    assert "longbench_llama3.1-8b-instruct/means" in run.keys


def test_unit_labels_add_task_or_model_only_when_needed():
    one = ("niah", "smollm2-135m", "specache_niah")
    assert kvlog.unit_labels([one]) == {one: "specache_niah"}
    two_tasks = [one, ("perplexity", "smollm2-135m", "specache_niah")]
    assert sorted(kvlog.unit_labels(two_tasks).values()) == ["specache_niah_niah", "specache_niah_perplexity"]
    two_models = [one, ("niah", "llama3-8b-instruct", "specache_niah")]
    assert sorted(kvlog.unit_labels(two_models).values()) == [
        "specache_niah_llama3-8b-instruct",
        "specache_niah_smollm2-135m",
    ]
    adhoc = [("niah", "smollm2-135m", None), ("niah", "llama3-8b-instruct", None)]
    assert sorted(kvlog.unit_labels(adhoc).values()) == ["niah_llama3-8b-instruct", "niah_smollm2-135m"]


def test_short_key_keeps_short_keys_and_cuts_long_ones():
    assert kvlog.short_key("metrics/score") == "metrics/score"
    long = "x" * 100
    cut = kvlog.short_key(long)
    assert len(cut) == kvlog.PANEL_KEY_MAX and cut.startswith("x" * 20) and "~" in cut
    assert kvlog.short_key(long + "y") != cut
