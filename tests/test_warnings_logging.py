"""kvbench's warnings go through ``logging`` (the ``kvbench`` logger tree), so a caller can catch,
filter or silence them; on a bare console they still read ``kvbench: warning: ...`` on stderr."""

from __future__ import annotations

import io
import json
import logging

import pytest

from kvbench.env import LOGGER, configure_logging, get_logger


@pytest.fixture
def kvlog(caplog):
    """caplog on the kvbench tree (records reach the root logger, where caplog listens)."""
    root = configure_logging()
    assert root.propagate
    caplog.set_level(logging.INFO, logger=LOGGER)
    return caplog


def records(caplog, name: str, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == name and r.levelno == level]


def test_module_loggers_sit_under_the_kvbench_logger():
    assert get_logger("kvbench.run").parent is logging.getLogger(LOGGER)
    assert get_logger("elsewhere").name == "kvbench.elsewhere"
    configure_logging()
    configure_logging()
    fallbacks = [h for h in logging.getLogger(LOGGER).handlers if type(h).__name__ == "_ConsoleFallback"]
    assert len(fallbacks) == 1  # configured once however often it is asked


def test_bare_console_gets_the_kvbench_line(monkeypatch, capsys):
    log = get_logger("kvbench.test")
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # no application logging at all
    log.warning("something odd")
    log.info("a note")
    assert capsys.readouterr().err == "kvbench: warning: something odd\nkvbench: a note\n"


def test_an_application_console_handler_shows_it_once(monkeypatch, capsys):
    # Hydra's job logging (or logging.basicConfig) writes to the terminal: the record goes there, in
    # the application's format, and kvbench's own line is not printed beside it.
    import sys

    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("[%(name)s][%(levelname)s] - %(message)s"))
    monkeypatch.setattr(logging.getLogger(), "handlers", [console])
    get_logger("kvbench.test").warning("shown once")
    assert capsys.readouterr().err == "[kvbench.test][WARNING] - shown once\n"


def test_silenced_by_level():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    root = configure_logging()
    root.addHandler(handler)
    old = root.level
    try:
        root.setLevel(logging.ERROR)
        get_logger("kvbench.test").warning("not wanted")
    finally:
        root.setLevel(old)
        root.removeHandler(handler)
    assert stream.getvalue() == ""


def test_run_warning_is_a_record(kvlog):
    from kvbench.run import warn

    warn("method.topk=9 covers the whole prompt")
    assert records(kvlog, "kvbench.run") == ["method.topk=9 covers the whole prompt"]


def test_rows_set_aside_is_a_record(tmp_path, kvlog):
    from kvbench.results import RunFolder

    folder = RunFolder(tmp_path)
    folder.samples_path.write_text('{"sample_id": "a", "score": 1}\ngarbage\n')
    assert [r["sample_id"] for r in folder.resume_rows()] == ["a"]
    (message,) = records(kvlog, "kvbench.results")
    assert "1 malformed line(s) moved to samples.rejected.jsonl" in message
    folder.set_aside_rows("resume=false")
    assert "1 earlier row(s) moved to samples.rejected.jsonl" in records(kvlog, "kvbench.results")[-1]


def test_lock_wait_is_an_info_record(tmp_path, kvlog):
    import threading

    from kvbench.results import RunFolder

    done = threading.Event()

    def second():
        with RunFolder(tmp_path).lock():
            done.set()

    with RunFolder(tmp_path).lock():
        thread = threading.Thread(target=second)
        thread.start()
        assert not done.wait(0.3)
    thread.join(timeout=10)
    (message,) = records(kvlog, "kvbench.results", logging.INFO)
    assert "is in use by another process" in message


def test_unreadable_sweep_record_is_a_record(tmp_path, kvlog):
    from kvbench.sweep import RECORD, read_records

    (tmp_path / "0").mkdir()
    (tmp_path / "0" / RECORD).write_text("{not json")
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / RECORD).write_text(json.dumps({"folder": ".", "finished": False, "row": None}))
    assert [r["job"] for r in read_records(tmp_path)] == ["1"]
    (message,) = records(kvlog, "kvbench.sweep")
    assert "unreadable sweep record" in message and message.startswith(str(tmp_path / "0" / RECORD))


def test_wandb_logger_warning_is_a_record(kvlog, monkeypatch):
    import builtins

    from kvbench import logger as kvlogger
    from kvbench.config import LoggerConfig

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("no module named wandb (simulated)")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    run = kvlogger.WandbLogger(LoggerConfig(name="wandb", mode="offline"))
    run.start({"seed": 0})
    assert not run.active
    (message,) = records(kvlog, "kvbench.logger")
    assert message.startswith("wandb is not installed")


def test_launcher_result_not_saved_early_is_a_record(kvlog, monkeypatch):
    from hydra.core.utils import JobReturn, JobStatus

    import kvbench.launchers as launchers

    def nowhere():
        raise RuntimeError("not in a submitit job")

    monkeypatch.setattr(launchers, "_job_result_pickle", nowhere)
    launchers.PointGroup._save(JobReturn(status=JobStatus.COMPLETED), 3)
    (message,) = records(kvlog, "kvbench.launchers")
    assert message == "point #3: its result could not be saved early (not in a submitit job)"
