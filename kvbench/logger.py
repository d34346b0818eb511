"""Experiment loggers: ``logger=none`` (default) and ``logger=wandb`` (Weights & Biases).

The wandb logger records a run's resolved config, its metrics (task aggregates, memory summary,
timings; flattened with ``/``) and, from ``python -m kvbench.report DIR --wandb``, the report's
figures and tables. It must never cost a run: results are written to the run folder first, and

- the mode is decided before ``wandb.init`` is called: ``WANDB_MODE`` when set; else
  ``logger.mode`` (``online``/``offline``); else (``auto``) online only when an API key is found
  (``WANDB_API_KEY`` or a netrc entry for the server) *and* the server answers a TCP connection
  within ``logger.probe_timeout`` seconds; otherwise offline, with a one-line note. Offline runs
  land under ``logger.dir`` (or ``WANDB_DIR``) and can be uploaded later with ``wandb sync``;
- ``wandb.init`` gets ``logger.init_timeout`` seconds; an online start that fails is retried once
  offline, and a failure there disables the logger;
- every other call is guarded: a wandb exception logs one warning (the ``kvbench.logger`` logger)
  and the run continues.
"""

from __future__ import annotations

import hashlib
import json
import math
import netrc
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from kvbench.config import LoggerConfig, build_config
from kvbench.env import get_logger

if TYPE_CHECKING:
    from kvbench.spec import RunSpec

DEFAULT_SERVER = "https://api.wandb.ai"


log = get_logger(__name__)


def _warn(message: str) -> None:
    log.warning(message)


# -- panel keys ------------------------------------------------------------------------------------
# wandb names a panel by its key and groups panels into sections by the key's first segment; a long
# key is cut in the panel's title and makes a section name nobody reads. Keys are kept to
# PANEL_KEY_MAX characters: known long segments get short names, a report's units are named by the
# fewest of experiment, task and model that tell them apart, and anything still too long is cut,
# with a short hash of the whole key so that two cut keys never meet.

PANEL_KEY_MAX = 48
SHORT_SEGMENTS = {"last_sample_bytes_by_component": "bytes_by_component"}


def short_key(key: str, limit: int = PANEL_KEY_MAX) -> str:
    """``key`` with its long segments renamed and, past ``limit`` characters, cut to ``limit`` with
    ``~`` and six hex digits of the full key's hash at the end."""
    out = "/".join(SHORT_SEGMENTS.get(part, part) for part in key.split("/"))
    if len(out) <= limit:
        return out
    digest = hashlib.sha1(key.encode()).hexdigest()[:6]
    return f"{out[: limit - len(digest) - 1]}~{digest}"


def short_keys(values: Mapping[str, Any], limit: int = PANEL_KEY_MAX) -> dict[str, Any]:
    """``values`` under :func:`short_key` names; a name two keys would share keeps the hashed form
    for each of them, so no value is lost."""
    names = {key: short_key(key, limit) for key in values}
    taken: dict[str, int] = {}
    for name in names.values():
        taken[name] = taken.get(name, 0) + 1
    out = {}
    for key, value in values.items():
        name = names[key]
        if taken[name] > 1:
            digest = hashlib.sha1(key.encode()).hexdigest()[:6]
            name = f"{name[: limit - len(digest) - 1]}~{digest}"
        out[name] = value
    return out


def unit_labels(keys: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], str]:
    """A short section name for each report unit ``(task, model, experiment)``: its experiment
    (else its task), with the task and then the model added only where that alone would name two
    units the same; joined by ``_``."""

    def label(key: tuple[Any, ...], fields: tuple[str, ...]) -> str:
        task, model, experiment = (list(key) + [None, None, None])[:3]
        parts = {"first": experiment or task, "task": task, "model": model}
        values = [str(parts[f]) for f in fields if parts[f]]
        return "_".join(dict.fromkeys(values))  # the task once where it is also the first part

    for fields in (("first",), ("first", "task"), ("first", "model"), ("first", "task", "model")):
        labels = {key: label(key, fields) for key in keys}
        if len(set(labels.values())) == len(labels):
            return labels
    return {key: "_".join(str(p) for p in key if p) for key in keys}


def flatten(obj: dict[str, Any], prefix: str = "") -> dict[str, float | int]:
    """Numeric leaves of a nested dict as ``{"a/b": value}`` (strings, lists and None dropped)."""
    out: dict[str, float | int] = {}
    for key, value in obj.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if not (isinstance(value, float) and not math.isfinite(value)):
                out[name] = value
    return out


class NullLogger:
    """``logger=none``: every call does nothing."""

    active = False

    def start(self, config: dict[str, Any], name: str | None = None, **kwargs: Any) -> None:
        pass

    def log_run(self, metrics: dict[str, Any]) -> None:
        pass

    def log_report(self, report: dict[str, Any]) -> None:
        pass

    def finish(self) -> None:
        pass


# ------------------------------------------------------------------------------- mode decision


def server_url() -> str:
    return os.environ.get("WANDB_BASE_URL") or DEFAULT_SERVER


def has_api_key(url: str | None = None) -> bool:
    """True when ``WANDB_API_KEY`` is set or the netrc file (``NETRC`` or ~/.netrc) has a password
    for the server's host. Reads files only; never contacts the server."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(url or server_url()).hostname
    path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        auth = netrc.netrc(path).authenticators(host) if host and Path(path).exists() else None
    except (OSError, netrc.NetrcParseError):
        return False
    return bool(auth and auth[2])


def server_reachable(url: str | None = None, timeout: float = 2.0) -> bool:
    """True when a TCP connection to the server opens within ``timeout`` seconds."""
    parsed = urlparse(url or server_url())
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False


def resolve_mode(cfg: LoggerConfig) -> tuple[str, str]:
    """``(mode, reason)``: the wandb mode to start in and why (see the module docstring)."""
    env = os.environ.get("WANDB_MODE")
    if env:
        return ("offline" if env == "dryrun" else env), f"WANDB_MODE={env}"
    if cfg.mode != "auto":
        return cfg.mode, f"logger.mode={cfg.mode}"
    if not has_api_key():
        return "offline", "no wandb API key (WANDB_API_KEY or netrc)"
    if not server_reachable(timeout=cfg.probe_timeout):
        return "offline", f"{server_url()} not reachable within {cfg.probe_timeout:g} s"
    return "online", "API key found and server reachable"


# -------------------------------------------------------------------------------------- wandb


class WandbLogger:
    """``logger=wandb``: see the module docstring for the never-block rules."""

    def __init__(self, cfg: LoggerConfig):
        self.cfg = cfg
        self.run = None
        self.mode: str | None = None

    @property
    def active(self) -> bool:
        return self.run is not None

    def _init(self, wandb, mode: str, config: dict[str, Any], name: str | None, job_type: str, **run: Any):
        directory = self.cfg.dir or os.environ.get("WANDB_DIR")
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
        group = self.cfg.group or run.pop("group", None)
        return wandb.init(
            project=self.cfg.project,
            entity=self.cfg.entity,
            group=group,
            tags=list(self.cfg.tags) or None,
            name=name,
            job_type=job_type,
            config=config,
            mode=mode,
            dir=directory,
            settings=wandb.Settings(init_timeout=float(self.cfg.init_timeout), silent=True, console="off"),
            **run,
        )

    def start(
        self,
        config: dict[str, Any],
        name: str | None = None,
        job_type: str = "run",
        group: str | None = None,
        run_id: str | None = None,
    ) -> None:
        """Open a wandb run holding ``config``; on any failure, warn and stay inactive. ``group``:
        the wandb group where ``logger.group`` names none; ``run_id``: the wandb run's id, resumed
        when it exists (``resume="allow"``), so logging one configuration twice makes one run."""
        run = {"group": group, **({"id": run_id, "resume": "allow"} if run_id else {})}
        try:
            import wandb
        except ImportError as err:
            _warn(f"wandb is not installed ({err}); continuing without it")
            return
        mode, reason = resolve_mode(self.cfg)
        if mode == "offline" and self.cfg.mode == "auto" and "WANDB_MODE" not in os.environ:
            log.info(f"wandb offline: {reason}")
        try:
            self.run = self._init(wandb, mode, config, name, job_type, **run)
            self.mode = mode
        except Exception as err:
            if mode != "online":
                _warn(f"wandb init failed ({type(err).__name__}: {err}); continuing without wandb")
                return
            _warn(f"wandb online init failed ({type(err).__name__}: {err}); retrying offline")
            try:
                self.run = self._init(wandb, "offline", config, name, job_type, **run)
                self.mode = "offline"
            except Exception as err2:
                _warn(f"wandb offline init failed ({type(err2).__name__}: {err2}); continuing without wandb")

    def _guard(self, what: str, fn, *args) -> None:
        if self.run is None:
            return
        try:
            fn(*args)
        except Exception as err:
            _warn(f"wandb {what} failed ({type(err).__name__}: {err}); continuing without wandb")
            self.run = None

    def log_run(self, metrics: dict[str, Any]) -> None:
        """A run's ``metrics.json`` content: numeric leaves logged once and set as the summary; and
        its samples (the run folder's ``samples.jsonl``) as one table, ``samples``."""
        flat = short_keys(flatten({k: metrics.get(k) or {} for k in ("metrics", "memory", "timings")}))

        def _log():
            table = sample_table(metrics.get("folder"))
            self.run.log({**flat, **({"samples": table} if table is not None else {})})
            self.run.summary.update({**flat, "primary_metric": metrics.get("primary_metric")})

        self._guard("log", _log)

    def log_report(self, report: dict[str, Any]) -> None:
        """A report (``kvbench.report.build_report``'s result): each unit's figures as images and
        its tables as wandb tables, under one section per unit named by :func:`unit_labels` (the
        experiment, with task or model only where needed); keys as :func:`short_keys` makes them."""
        import wandb

        def _log():
            payload = {}
            units = report["units"]
            labels = unit_labels([tuple(unit["key"]) for unit in units])
            for unit in units:
                prefix = labels[tuple(unit["key"])]
                for path in unit["figures"]:
                    payload[f"{prefix}/{Path(path).stem}"] = wandb.Image(str(path))
                for key in ("means", "paired", "cliff"):
                    table = unit[key]
                    if not table.empty:
                        payload[f"{prefix}/{key}"] = wandb.Table(dataframe=table.astype(str))
            self.run.log(short_keys(payload))

        self._guard("report log", _log)

    def finish(self) -> None:
        """Finish the run and wait until wandb has written all of it.

        ``run.finish()`` returns while wandb's service process may still be writing the run's record
        log; under load a reader (``wandb sync`` right after the run) then finds the summary
        missing. ``wandb.teardown()`` waits for the service to flush and exit. It costs a service
        start (about a second) at the next run, which kvbench starts once per finished run.
        """
        if self.run is not None:
            self._guard("finish", self.run.finish)
            if self.run is not None:
                import wandb

                self._guard("teardown", wandb.teardown)
            self.run = None


# Per-sample columns the table keeps besides the row's scalars: its memory report's headline.
SAMPLE_MEMORY_KEYS = ("effective_bits", "code_bits", "compression", "total_bytes")


def sample_table(folder: str | Path | None):
    """A ``wandb.Table`` of the run folder's rows: every scalar column (ids, scores, prediction,
    seconds), the memory report's headline figures as ``memory/<key>``; None without rows."""
    import wandb

    path = Path(folder) / "samples.jsonl" if folder else None
    if path is None or not path.is_file():
        return None
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        flat = {k: v for k, v in row.items() if isinstance(v, (str, int, float, bool)) or v is None}
        memory = row.get("memory") or {}
        flat.update({f"memory/{k}": memory.get(k) for k in SAMPLE_MEMORY_KEYS if k in memory})
        rows.append(flat)
    if not rows:
        return None
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return wandb.Table(columns=columns, data=[[row.get(c) for c in columns] for row in rows])


def build_logger(node: dict[str, Any] | None) -> NullLogger | WandbLogger:
    """The logger for a ``logger`` config node (None or ``name: none``: the null logger)."""
    cfg = build_config(LoggerConfig, dict(node or {}), "logger")
    return WandbLogger(cfg) if cfg.name == "wandb" else NullLogger()


def log_run(run: RunSpec | Mapping[str, Any], metrics: dict[str, Any]) -> None:
    """Log a finished run (its resolved config and ``metrics.json`` content) to the logger its
    config names; called by ``kvbench.run.execute`` with the run's :class:`kvbench.spec.RunSpec`
    after the run folder is written, so a logger failure can never lose a result. A spec gives its
    typed logger config, its group and the config its logger run holds (``RunSpec.record.logged``),
    and nothing is read out of its plain config. A plain config (a script's, outside a run) is this
    function's own entry: its ``logger`` node is validated and its group named here."""
    if isinstance(run, Mapping):
        cfg = build_config(LoggerConfig, dict(run.get("logger") or {}), "logger")
        logged = {k: v for k, v in run.items() if k != "logger"}
        _log(cfg, logged, experiment_group(run, metrics.get("task")), metrics)
    else:
        _log(run.logger, run.record.logged, run.experiment_group, metrics)


def _log(cfg: LoggerConfig, logged: dict[str, Any], group: str, metrics: dict[str, Any]) -> None:
    """:func:`log_run`, given the logger's config, the config its run holds and its group."""
    if cfg.name != "wandb":
        return
    logger = WandbLogger(cfg)
    name = "/".join(str(metrics.get(k)) for k in ("task", "model", "method")) + f"/seed{metrics.get('seed')}"
    logger.start(logged, name=name, group=group, run_id=metrics.get("run_id"))
    logger.log_run(metrics)
    logger.finish()


def experiment_group(config: dict[str, Any], task: Any = None) -> str:
    """The wandb group of a run: its experiment (``analysis.name``), else ``adhoc-<task>``, the
    names the archives use, so an experiment's runs and its report sit in one group."""
    name = (config.get("analysis") or {}).get("name")
    return str(name) if name else f"adhoc-{task or (config.get('task') or {}).get('name')}"


def log_report(result: dict[str, Any], node: dict[str, Any] | None = None) -> None:
    """Log a finished report to wandb as its own run (job type ``report``), in the group of the
    experiment it reports on (one experiment; several: no group), its config naming the runs it
    read (their wandb ids are their run ids)."""
    logger = build_logger({"name": "wandb", **(node or {})})
    frame = result.get("frame")
    runs = sorted(map(str, frame["run_id"].unique())) if frame is not None and "run_id" in frame else []
    groups = set()
    if frame is not None and not frame.empty:
        groups = {
            str(e) if isinstance(e, str) and e else f"adhoc-{t}"
            for e, t in zip(frame["experiment"], frame["task"], strict=True)
        }
    config = {"report_dir": str(result["out"]), "runs": runs, "experiments": sorted(groups)}
    group = next(iter(groups)) if len(groups) == 1 else None
    logger.start(config, name=f"report/{result['out']}", job_type="report", group=group)
    logger.log_report(result)
    logger.finish()
