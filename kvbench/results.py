"""Run folders: resolved config, samples.jsonl, metrics.json.

Writes never leave a half file behind: JSON files are written to a temporary file and renamed;
each sample row is one ``write`` of a complete line followed by ``fsync``, so a killed run keeps
every finished row. Reading for a resume never drops a line silently: a line that is not a complete
row (a partial last line from a kill mid-write, or a line damaged by hand) moves to
``samples.rejected.jsonl`` with a warning, every valid row around it is kept, and its sample runs
again. Temporary files of a write that was killed are removed by the next run of the folder.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from kvbench import atomic
from kvbench.config import build_config, inert_defaults, require, run_id_excluded
from kvbench.env import get_logger
from kvbench.errors import ConfigError

log = get_logger(__name__)

# Keys that say where things are, not what is computed: left out of the run id.
PATH_KEYS = {"output", "data", "hydra", "logger"}
# The experiment's pre-declared analysis plan and the number handed to an optimizing sweeper: stored
# in config.json, but they change no sample, so one run serves every plan and every objective.
NON_RUN_KEYS = PATH_KEYS | {"analysis", "objective"}


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def _same(value: Any, default: Any) -> bool:
    return type(value) is type(default) and value == default


def canonical_config(config: dict[str, Any], method_config: Any = None) -> dict[str, Any]:
    """What the run id hashes: the resolved config minus paths, loggers, the analysis plan and the
    model's scheduler ``resources``. ``method_config``: the method's validated config where the
    caller holds it already (a run's :class:`kvbench.spec.RunSpec`), else it is built from the node.

    The top-level ``bits`` reaches a method only through its node: the run writes it into the
    node's bits knob (``bits``, or a knob such as ReadKV's ``read_bits``) before hashing
    (:func:`kvbench.spec.run_config`), so every effect of ``bits`` is already in the method node. A
    node without a ``bits`` key (the FP16 baseline and the eviction policies, which have no bits
    knob; no ``method`` at all is the FP16 baseline too) therefore drops the top-level value:
    ``fp16`` inside a bit-width sweep is one run, not one per bit width.
    """
    core = {k: v for k, v in config.items() if k not in NON_RUN_KEYS}
    for part in ("model", "method", "task"):
        cls = _declaring_config(part, core.get(part))
        if cls is None:
            continue
        # what changes no sample (a scheduler's resources, the cost estimate's shape), and keys added
        # after runs were stored, at the default that computes what those runs computed: both left
        # out, so those runs keep their id (any other value of an inert key is a different run)
        dropped, defaults = run_id_excluded(cls), inert_defaults(cls)
        core[part] = {
            k: v
            for k, v in core[part].items()
            if k not in dropped and not (k in defaults and _same(v, defaults[k]))
        }
    method = core.get("method") or {"name": "fp16"}
    if isinstance(method, dict) and method.get("backend") == "auto":
        # auto stores the bytes torch stores and reads them up to float reassociation: the runs
        # made before it existed (backend=torch) keep their id
        method = core["method"] = {**method, "backend": "torch"}
    if "bits" not in method:
        core.pop("bits", None)
    version = _method_version(method.get("name"))
    if version != 1:  # version 1 is every run made before versions existed: their ids stay
        core["method_version"] = version
    if _packs_base_l(method, method_config):
        # base-L packing changed its bytes at version 2; bit-packed configs keep their ids
        from kvbench.quant.packing import PACKING_VERSION

        core["packing_version"] = PACKING_VERSION
    return core


def _declaring_config(part: str, node: Any) -> type | None:
    """The dataclass whose fields declare what node ``part`` of a config holds (the model node's, or
    the registered method's or task's config), or None for a node that names nothing registered."""
    if not isinstance(node, dict):
        return None
    if part == "model":
        from kvbench.models.config import ModelConfig

        return ModelConfig
    if part == "method":
        from kvbench.methods import METHODS as registry
    else:
        from kvbench.tasks import TASKS as registry
    name = node.get("name")
    return registry.get(name).Config if isinstance(name, str) and name in registry else None


def _packs_base_l(node: Any, config: Any = None) -> bool:
    """Whether a method node packs a level count that is not a power of two (base-L words).
    ``config``: the node's validated config, when the caller built it already (the node here has
    lost its inert defaults and reads ``backend=torch`` for ``auto``, neither of which changes the
    levels a valid config stores)."""
    from kvbench.methods import METHODS
    from kvbench.quant.packing import is_bit_packed

    name = node.get("name") if isinstance(node, dict) else None
    if not isinstance(name, str) or name not in METHODS:
        return False
    if config is None:
        try:
            config = build_config(METHODS.get(name).Config, node, "method")
        except ConfigError:
            return False  # the run itself reports the bad node
    return any(not is_bit_packed(levels) for levels in config.stored_levels())


def _method_version(name: Any) -> int:
    from kvbench.methods import METHODS

    return METHODS.get(name).Config.version if isinstance(name, str) and name in METHODS else 1


def run_id(config: dict[str, Any], method_config: Any = None) -> str:
    """Hash of :func:`canonical_config` (``method_config``: see there): the same computation gets
    the same folder."""
    return hashlib.sha256(canonical_json(canonical_config(config, method_config)).encode()).hexdigest()[:12]


def _clean(obj: Any) -> Any:
    """JSON-safe: NaN/inf become null (strict JSON readers reject them)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return obj


def write_json_atomic(path: Path, obj: Any) -> None:
    atomic.write_text(path, json.dumps(_clean(obj), indent=2, sort_keys=True, default=str) + "\n")


REQUIRED_ROW_KEYS = ("sample_id",)


def _parse_row(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """``(row, None)`` for one line of samples.jsonl that is a row, else ``(None, why it is not)``."""
    if not raw.endswith(b"\n"):
        return None, "no newline at the end (a write cut short)"
    try:
        row = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        return None, f"not JSON ({err.__class__.__name__})"
    if not isinstance(row, dict):
        return None, f"a JSON {type(row).__name__}, not an object"
    missing = [k for k in REQUIRED_ROW_KEYS if not isinstance(row.get(k), str)]
    return (None, f"no {', '.join(missing)}") if missing else (row, None)


def _counted(rejected: list[dict[str, Any]]) -> str:
    """``"2 malformed line(s), 1 duplicate row(s)"``: what was set aside, by kind."""
    dup = sum(r["reason"].startswith("a second row") for r in rejected)
    unknown = sum("is not a sample of this task" in r["reason"] for r in rejected)
    malformed = len(rejected) - dup - unknown
    parts = [
        (malformed, "malformed line(s)"),
        (dup, "duplicate row(s)"),
        (unknown, "row(s) of unknown samples"),
    ]
    return ", ".join(f"{n} {what}" for n, what in parts if n)


class RunFolder:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.samples_path = self.path / "samples.jsonl"
        self.rejected_path = self.path / "samples.rejected.jsonl"
        self.path.mkdir(parents=True, exist_ok=True)

    @contextlib.contextmanager
    def lock(self):
        """Exclusive use of this folder by one process (an advisory ``flock`` on ``.lock``, freed by
        the kernel if the process dies; ``filelock``). A second process with the same config blocks until the
        first is done, so two writers never append the same sample twice. Whoever holds the lock
        removes the temporary files of writes that a killed process left behind."""
        lock = FileLock(self.path / ".lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log.info(f"{self.path} is in use by another process; waiting for it")
            lock.acquire()
        try:
            self.remove_orphans()
            yield self
        finally:
            lock.release()

    def discard_if_unused(self, stop_at: Path) -> bool:
        """Remove this folder when it holds no result (no sample row, no metrics), then its parents
        that became empty, up to ``stop_at``. For a run that failed before its first sample: a folder
        with only ``config.json`` and ``.lock`` would look like a run that never finished."""
        has_rows = self.samples_path.exists() and self.samples_path.stat().st_size > 0
        if has_rows or (self.path / "metrics.json").exists() or self.rejected_path.exists():
            return False
        for name in ("config.json", ".lock"):
            (self.path / name).unlink(missing_ok=True)
        self.samples_path.unlink(missing_ok=True)
        stop = Path(stop_at).resolve()
        folder = self.path.resolve()
        while folder != stop and stop in folder.parents:
            try:
                folder.rmdir()  # only an empty folder goes; anything else stays
            except OSError:
                break
            folder = folder.parent
        return True

    def remove_orphans(self) -> None:
        """Temporary files from :func:`write_json_atomic`; only safe while holding the lock."""
        for tmp in self.path.glob(".*.tmp"):
            tmp.unlink(missing_ok=True)

    def write_config(self, config: dict[str, Any]) -> None:
        write_json_atomic(self.path / "config.json", config)

    def write_metrics(self, metrics: dict[str, Any]) -> None:
        write_json_atomic(self.path / "metrics.json", metrics)

    def _scan(self) -> tuple[list[dict[str, Any]], list[bytes], list[dict[str, Any]]]:
        """(rows, their raw lines, the lines that are not rows as rejection records). Each row's
        line number is in ``self._lines`` (same order as the rows)."""
        rows, kept, rejected = [], [], []
        self._lines: list[int] = []
        if not self.samples_path.exists():
            return rows, kept, rejected
        with open(self.samples_path, "rb") as f:
            for number, raw in enumerate(f, 1):
                row, problem = _parse_row(raw)
                if problem is None:
                    rows.append(row)
                    kept.append(raw)
                    self._lines.append(number)
                else:
                    text = raw.decode("utf-8", "backslashreplace").rstrip("\n")
                    rejected.append({"line": number, "reason": problem, "text": text})
        return rows, kept, rejected

    def scan(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """``(rows, the lines that are not rows as rejection records)``, the file left as it is."""
        rows, _, rejected = self._scan()
        return rows, rejected

    def rows(self) -> list[dict[str, Any]]:
        """Finished rows, in file order; lines that are not rows are skipped, and the file is left
        as it is (a reader may look at a folder while its run is still appending)."""
        return self._scan()[0]

    def resume_rows(self, sample_ids: set[str] | None = None) -> list[dict[str, Any]]:
        """:meth:`rows`, for the process that holds the lock and is about to append: lines that are
        not rows move to samples.rejected.jsonl (one JSON record each: line number, reason, text),
        samples.jsonl is rewritten without them, and one warning counts them. With ``sample_ids``
        (the task's samples), a second row of a sample (the first one stays, as the report keeps
        it) and a row of a sample the task does not have are set aside the same way."""
        rows, kept, rejected = self._scan()
        if sample_ids is not None:
            seen: dict[str, int] = {}
            keep_rows, keep_raw = [], []
            for row, raw, number in zip(rows, kept, self._lines, strict=True):
                sid = row["sample_id"]
                text = raw.decode("utf-8", "backslashreplace").rstrip("\n")
                if sid not in sample_ids:
                    why = f"sample_id {sid!r} is not a sample of this task"
                    rejected.append({"line": number, "reason": why, "text": text})
                elif sid in seen:
                    why = f"a second row of sample {sid!r} (line {seen[sid]} kept)"
                    rejected.append({"line": number, "reason": why, "text": text})
                else:
                    seen[sid] = number
                    keep_rows.append(row)
                    keep_raw.append(raw)
            rows, kept = keep_rows, keep_raw
        if rejected:
            rejected.sort(key=lambda r: r["line"])
            self._set_aside(rejected, b"".join(kept))
        return rows

    def set_aside_rows(self, reason: str) -> int:
        """Move every row to samples.rejected.jsonl (a rerun from scratch must not leave the old rows
        beside the new ones); returns how many."""
        rows, kept, rejected = self._scan()
        if not kept and not rejected:
            return 0
        lines = [
            {"line": n, "reason": reason, "text": raw.decode("utf-8", "backslashreplace").rstrip("\n")}
            for n, raw in zip(self._lines, kept, strict=True)
        ]
        self._set_aside(sorted(lines + rejected, key=lambda r: r["line"]), b"", quiet=True)
        log.warning(
            f"{self.samples_path}: {len(lines)} earlier row(s) moved to {self.rejected_path.name} ({reason})"
        )
        return len(lines)

    # -- provenance: which code wrote the rows --------------------------------------------------
    @property
    def provenance_path(self) -> Path:
        return self.path / "provenance.json"

    def sessions(self) -> list[dict[str, Any]]:
        """Every process that ran in this folder, oldest first (see :meth:`record_session`)."""
        try:
            data = json.loads(self.provenance_path.read_text())
        except (OSError, ValueError):
            return []
        return data.get("sessions", []) if isinstance(data, dict) else []

    def record_session(self, session: dict[str, Any]) -> None:
        """Append one session (code version, commit, dirty tree, rows already there, how a resume
        across versions was accepted) to ``provenance.json``."""
        write_json_atomic(self.provenance_path, {"sessions": [*self.sessions(), session]})

    def _set_aside(self, rejected: list[dict[str, Any]], kept: bytes, quiet: bool = False) -> None:
        # the rejected lines are saved (and synced) before samples.jsonl loses them
        with open(self.rejected_path, "a") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in rejected)
            f.flush()
            os.fsync(f.fileno())
        atomic.write_bytes(self.samples_path, kept)
        if quiet:
            return
        where = "; ".join(f"line {r['line']}: {r['reason']}" for r in rejected[:3])
        more = f"; and {len(rejected) - 3} more" if len(rejected) > 3 else ""
        log.warning(
            f"{self.samples_path}: {_counted(rejected)} moved to "
            f"{self.rejected_path.name}, their samples run again unless another row holds them "
            f"({where}{more})"
        )

    def append(self, row: dict[str, Any]) -> None:
        line = json.dumps(_clean(row), sort_keys=True, default=str) + "\n"
        try:
            with open(self.samples_path, "a") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        except OSError as err:  # a full disk, a lost mount: the next run sets the cut line aside
            raise atomic.WriteError(
                f"cannot write {self.samples_path}: {err.strerror or err}; the rows before it are kept "
                "and the same command resumes once there is room"
            ) from None


@dataclass
class AnalysisPlan:
    """An experiment's pre-declared analysis (the ``analysis:`` block of ``kvbench/conf/experiment/*.yaml``).

    ``reference`` is the method label of the reference runs; ``metric`` the per-sample column the
    comparison reads; ``alpha`` the significance level of every test; ``margin`` the TOST equivalence
    margin in metric units; ``n`` the samples per seed; ``seeds`` the run seeds; ``grid`` the ordered
    values of ``grid_key`` (e.g. bits) along which a cliff is located, when the experiment has one.
    """

    name: str = ""
    reference: str = "fp16"
    metric: str = "score"
    alpha: float = 0.05
    margin: float = 0.1
    n: int = 1
    seeds: list[int] = field(default_factory=lambda: [0])
    grid: list[float] | None = None
    grid_key: str | None = None
    notes: str | None = None

    def __post_init__(self):
        for key in ("name", "reference", "metric"):
            value = getattr(self, key)
            require(isinstance(value, str) and value != "", f"analysis.{key}", value, "a non-empty string")
        require(0 < self.alpha < 1, "analysis.alpha", self.alpha, "a number in (0, 1)")
        require(
            math.isfinite(self.margin) and self.margin > 0,
            "analysis.margin",
            self.margin,
            "a positive number, in units of the metric",
        )
        require(self.n > 0, "analysis.n", self.n, "a positive int (samples per seed)")
        seeds = list(self.seeds) if isinstance(self.seeds, (list, tuple)) else None
        require(
            bool(seeds) and len(set(seeds)) == len(seeds),
            "analysis.seeds",
            self.seeds,
            "a non-empty list of distinct ints",
        )
        self.seeds = seeds
        if self.grid is not None:
            grid = list(self.grid) if isinstance(self.grid, (list, tuple)) else None
            require(
                bool(grid) and all(a < b for a, b in zip(grid, grid[1:], strict=False)),
                "analysis.grid",
                self.grid,
                "a non-empty, strictly increasing list of numbers",
            )
            require(
                isinstance(self.grid_key, str) and self.grid_key != "",
                "analysis.grid_key",
                self.grid_key,
                "the config key the grid sweeps (e.g. bits)",
            )
            self.grid = grid


def analysis_plan(node: Any) -> AnalysisPlan:
    """Validated :class:`AnalysisPlan` from an ``analysis`` node (a dict or an OmegaConf node)."""
    return build_config(AnalysisPlan, node, "analysis")


def format_table(lines: list[dict[str, Any]]) -> str:
    if not lines:
        return ""
    cols = list(dict.fromkeys(k for line in lines for k in line))

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    cells = [[fmt(line.get(c)) for c in cols] for line in lines]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    out = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(out)
