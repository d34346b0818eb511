"""A sweep's own folder: which run folders one Hydra multirun made, and its table at the end.

A multirun writes into ``output.root/multirun/<date>/<time>-<pid>/`` (``hydra.sweep.dir``), one
subfolder per point (``hydra.sweep.subdir``: the job's number) holding Hydra's ``.hydra/`` config and
kvbench's :data:`RECORD`: the point's run folder (relative to the record, so a results tree that moves
as a whole keeps its links) and, once the run finished, its summary row. The run folders themselves
stay where every run's folder is (``output.root/<task>/<model>/<method>/seed<s>-<id>``): a point
that another sweep already ran resumes that folder instead of copying it. At the end of the sweep
:class:`SweepSummary` (a Hydra callback, ``hydra.callbacks`` in ``conf/config.yaml``) writes
:data:`INDEX`, the list of the sweep's run folders, and prints the table of every point on the basic
launcher (kvbench's submitit launchers print their own, with each job's state).

``python -m kvbench.report <sweep folder>`` reads exactly the run folders the records name
(:func:`sweep_run_folders`, through :func:`kvbench.analysis.frame.run_folders`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kvbench import atomic
from kvbench.env import get_logger
from kvbench.results import format_table

log = get_logger(__name__)

RECORD = "kvbench-run.json"  # in each point's subfolder
INDEX = "sweep.json"  # in the sweep's folder, written at its end


def job_folder() -> Path | None:
    """The running point's subfolder of a Hydra multirun, or None outside one (a single run, a
    direct call)."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            return None
        return Path(hc.runtime.output_dir)
    except Exception:  # no Hydra context
        return None


def record_point(run_folder: Path, row: dict[str, Any] | None = None) -> Path | None:
    """Write the running point's :data:`RECORD` naming ``run_folder`` (and its summary ``row`` once
    the run finished); nothing outside a multirun. Returns the record's path."""
    job = job_folder()
    if job is None:
        return None
    link = os.path.relpath(Path(run_folder).resolve(), job.resolve())
    record = {"folder": link, "finished": row is not None, "row": row}
    return atomic.write_text(job / RECORD, json.dumps(record, indent=1, default=str) + "\n")


def read_records(sweep: str | Path) -> list[dict[str, Any]]:
    """The records under ``sweep``, by job number, each with ``folder`` resolved to a path and
    ``job`` (the subfolder's name). A record that cannot be read is skipped with a warning."""
    out = []
    for path in Path(sweep).rglob(RECORD):
        try:
            record = json.loads(path.read_text())
            record["folder"] = (path.parent / record["folder"]).resolve()
        except (OSError, ValueError, KeyError, TypeError) as err:
            log.warning(f"{path}: unreadable sweep record ({err}); skipped")
            continue
        record["job"] = path.parent.name
        out.append(record)
    return sorted(out, key=lambda r: (len(r["job"]), r["job"]))


def sweep_run_folders(sweep: str | Path) -> list[Path]:
    """The run folders the sweep's records name and that exist, sorted, each once (two points may
    share a folder: fp16 ignores ``bits``)."""
    return sorted({r["folder"] for r in read_records(sweep) if r["folder"].is_dir()})


def write_index(sweep: str | Path, records: list[dict[str, Any]] | None = None) -> Path | None:
    """:data:`INDEX` of ``sweep``: ``{"runs": [{"job", "folder", "finished"}, ...]}`` with folders
    relative to the sweep's folder, from ``records`` (default: :func:`read_records`); None when the
    sweep holds no record."""
    sweep = Path(sweep)
    records = read_records(sweep) if records is None else records
    if not records:
        return None
    runs = [
        {
            "job": r["job"],
            "folder": os.path.relpath(r["folder"], sweep.resolve()),
            "finished": bool(r.get("finished")),
        }
        for r in records
    ]
    return atomic.write_text(sweep / INDEX, json.dumps({"runs": runs}, indent=1) + "\n")


try:
    from hydra.experimental.callback import Callback
except ImportError:  # hydra is a dependency; this keeps the module importable without it
    Callback = object  # type: ignore[assignment,misc]


class SweepSummary(Callback):
    """At the end of a multirun: :func:`write_index`, and on Hydra's basic launcher the table of
    every point (the submitit launchers print their own)."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep = Path(str(config.hydra.sweep.dir))
        if not sweep.is_dir():
            return
        records = read_records(sweep)
        index = write_index(sweep, records)
        target = str(config.hydra.launcher.get("_target_", ""))
        if index is None or not target.endswith("BasicLauncher"):
            return
        rows = [{"job": r["job"], **r["row"]} for r in records if r.get("row")]
        unfinished = [r["job"] for r in records if not r.get("row")]
        if rows:
            print(f"\nsweep of {len(records)} points: {sweep}", flush=True)
            print(format_table(rows), flush=True)
        if unfinished:
            print(f"not finished: points {', '.join(unfinished)}", flush=True)
        print(f"report: python -m kvbench.report {sweep}", flush=True)
