"""The seed papers as data: one YAML file per paper, read by :func:`load_papers`, and each paper's
tables rendered in the paper's own layout, measured beside published.

A paper is ``kvbench/papers/<paper>.yaml`` (:data:`kvbench.paths.PAPERS_DIR`); adding a paper is
adding that file: ``python -m kvbench.report`` then writes its page
(``results/papers/<paper>_<model>.md``), puts its first table in the README's results section and
its claims in the claims register (``results/claims/<model>.md``). The file's keys:

- ``paper``: its name, the file's stem (lower-case letters, digits, ``_``);
- ``title``: the page heading (``KIVI (ICML 2024)``); ``source``: the source document under
  ``../shared/papers`` that its claims quote (``scripts/check_claim_sources.py`` looks there);
- ``order``: a whole number, the paper's place among the papers (pages, the README's tables);
  ``claims_order`` (optional, default ``order``): its place in the claims register;
- ``notes`` (optional): one-line notes for tables of the paper that no node reproduces;
- ``tables`` (optional): the paper's tables, each a layout (below);
- ``accounting`` (optional): how the paper counts storage (bits per value, what enters, the
  reference), as data: :mod:`kvbench.analysis.accounting`; the claims' ``accounted`` rules test
  storage claims under it, with kvbench's own bytes beside;
- ``claims`` (optional): the paper's claims, each a mapping in the schema of
  :mod:`kvbench.analysis.claims` (without ``paper``: the file says it). Their provenance: ``quote``
  is the source document's own words (mostly Chinese summaries), ``where`` names only the
  sections, tables and figures the document names (else ``summary``), ``published`` gives its
  numbers as it gives them; ``scripts/check_claim_sources.py`` checks all three against the
  ``source`` document and records what it matched in ``tests/fixtures/claim_sources.json``, which
  a test holds the files to. Margins are in the metric's units.

A table (``Layout``) is the paper's rows and columns (``Entry``), the experiment node its cells come
from, and the paper's published value for the cells where the paper gives one, with the table or
figure it comes from and the model it was measured on. Its keys: ``node``, ``title``, ``where``,
``rows``, ``columns`` (required); ``published_on`` (the model and data of the published values),
``note`` (follows the caption), ``corner`` (heads the row labels), ``metric``, ``digits``
(decimals, default 3) and ``published`` (``{row key: {column key: value}}``). A row or column:
``key`` (text; what ``published`` refers to), ``label`` (what the table shows) and optionally
``select`` (an arm selector), ``vars`` (``{name: value}`` for the placeholders), ``metric``,
``node``, ``digits`` and ``interval`` (false: the mean alone, for accounting columns such as
effective bits). A file that breaks the schema is refused with one line naming the file, the key,
the bad value and what is allowed (:class:`PaperError`; a claim's: ``ClaimsError``).

``render`` turns a layout and the experiments' sample frames into a markdown table whose cells are
per-configuration means with their bootstrap interval, e.g. ``5.71 [5.60, 5.83]``, each followed,
where the paper gives one, by the published value in the column beside it. ``python -m
kvbench.report --paper NAME`` puts them under the paper's claims (``kvbench.report.paper_markdown``).

How a cell finds its runs: exactly one of its row and column carries an arm selector in the form
of the claims' (``method``/``label``, ``bits``, ``config``: a subset of the run's method node),
resolved against the frame by :func:`kvbench.analysis.claims.select`, never by folder name. The
other axis (and the selector's own axis) may carry ``vars``: a selector value written ``"$name"``
takes the value of ``name`` (typed, so ``bits: "$bits"`` compares as a number), and ``$name``
inside a longer string is substituted as text (the metric ``"hit_rates.$policy.$sparsity"``). A
selector without a placeholder gives the same configuration in every cell of its row (FP16 in a
bit-width table). The metric is the column's, else the row's, else the layout's, else the node's
declared ``analysis.metric``; a dotted path reaches into a dict column as in the claims. The node
of a cell is the column's, else the row's, else the layout's.

A cell whose selector matches no run shows ``-``; one that matches several configurations shows
them (the selector needs narrowing). The mean is over every sample and seed of the configuration,
the interval the percentile bootstrap at the node's ``1 - alpha`` (``kvbench.stats.bootstrap_ci``),
seeded per cell. Configurations of the node that no cell shows are listed under the table.

Published values are carried over from the source documents in ``shared/papers`` (summaries of the
papers): a number where the document gives one, a short statement of the reported direction where
it gives only that, nothing where it gives neither. Which model the paper measured on is in each
layout's ``published_on``; kvbench's model is in the page title.
"""

from __future__ import annotations

import math
import re
import string
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from kvbench.analysis import tables
from kvbench.analysis.accounting import Accounting, AccountingError, parse_accounting
from kvbench.analysis.claims import (
    Claim,
    ClaimsError,
    check_claims,
    metric_values,
    select,
    several_configurations,
    validate,
)
from kvbench.analysis.frame import plan_of
from kvbench.errors import ConfigError
from kvbench.paths import CONF_DIR, PAPERS_DIR
from kvbench.stats import bootstrap_ci


class LayoutError(ValueError):
    """A layout that cannot resolve a cell (no selector, two selectors, an unknown variable)."""


class PaperError(ConfigError):
    """A paper file that breaks the schema: ``FILE: KEY=VALUE: what is allowed``."""

    def __init__(self, file: str | Path, key: str, value: object, allowed: str):
        self.file = str(file)
        super().__init__(f"{file}: {key}", value, allowed)


@dataclass(frozen=True)
class Entry:
    """One row or column: ``key`` (what ``Layout.published`` refers to), ``label`` (what the
    table shows), and optionally an arm selector template ``select``, ``vars`` for the
    placeholders, a ``metric`` (template), a ``node`` and the number format (``digits`` decimals;
    ``interval`` False: the mean alone, for accounting columns such as effective bits)."""

    key: str
    label: str
    select: Mapping[str, Any] | None = None
    vars: Mapping[str, Any] = field(default_factory=dict)
    metric: str | None = None
    node: str | None = None
    digits: int | None = None
    interval: bool = True


@dataclass(frozen=True)
class Layout:
    """One of a paper's tables. ``published`` maps ``(row key, column key)`` to the paper's value;
    ``where`` names the paper's table or figure, ``published_on`` the model (and data) the
    published values were measured on; ``corner`` heads the row labels; ``note`` follows the
    caption."""

    paper: str
    node: str
    title: str
    where: str
    published_on: str
    rows: tuple[Entry, ...]
    columns: tuple[Entry, ...]
    published: Mapping[tuple[str, str], Any] = field(default_factory=dict)
    metric: str | None = None
    digits: int = 3
    corner: str = ""
    note: str | None = None

    @property
    def nodes(self) -> list[str]:
        """Every experiment node the layout reads, its own first."""
        others = {e.node for e in (*self.rows, *self.columns) if e.node and e.node != self.node}
        return [self.node, *sorted(others)]


@dataclass(frozen=True)
class Paper:
    """One paper file: who the paper is (``id``, ``title``, ``source``), where it sits (``order``
    among the papers, ``claims_order`` in the claims register), its ``tables``, ``claims`` and
    ``notes``, and the ``file`` it was read from."""

    id: str
    title: str
    source: str
    order: int
    file: Path
    claims_order: int | None = None
    notes: tuple[str, ...] = ()
    tables: tuple[Layout, ...] = ()
    claims: tuple[Claim, ...] = ()
    accounting: Accounting | None = None

    @property
    def covered_nodes(self) -> set[str]:
        """Every experiment node the paper's tables read."""
        return {n for layout in self.tables for n in layout.nodes}


@dataclass(frozen=True)
class Cell:
    """What one cell reads: the node, the filled-in selector and metric (None: the node's)."""

    node: str
    selector: Mapping[str, Any]
    metric: str | None
    digits: int
    interval: bool


# ------------------------------------------------------------------------------------ resolving

_PLACEHOLDER = re.compile(r"^\$(\w+)$")


def fill(template: Any, variables: Mapping[str, Any]) -> Any:
    """``template`` with its placeholders replaced: a value ``"$name"`` by ``variables[name]``
    (typed), ``$name`` inside a longer string as text; mappings and lists recursively. LayoutError
    naming the variable when one is missing."""
    if isinstance(template, Mapping):
        return {k: fill(v, variables) for k, v in template.items()}
    if isinstance(template, (list, tuple)):
        return [fill(v, variables) for v in template]
    if isinstance(template, str) and "$" in template:
        whole = _PLACEHOLDER.match(template)
        try:
            if whole:
                return variables[whole.group(1)]
            return string.Template(template).substitute({k: str(v) for k, v in variables.items()})
        except KeyError as err:
            raise LayoutError(f"{template!r}: no variable {err.args[0]!r} in the row or column") from None
    return template


def cell(layout: Layout, row: Entry, column: Entry) -> Cell:
    """The node, selector and metric of the cell at ``row`` x ``column``."""
    selectors = [e.select for e in (row, column) if e.select is not None]
    where = f"{layout.paper}/{layout.node}: cell ({row.key}, {column.key})"
    if len(selectors) != 1:
        raise LayoutError(f"{where}: exactly one of the row and the column selects the arm")
    variables = {**row.vars, **column.vars}
    try:
        selector = fill(selectors[0], variables)
        template = column.metric or row.metric or layout.metric
        metric = fill(template, variables) if template else None
    except LayoutError as err:
        raise LayoutError(f"{where}: {err}") from None
    if "label" not in selector and "method" not in selector:
        raise LayoutError(f"{where}: the selector needs 'method' or 'label'")
    digits = column.digits if column.digits is not None else row.digits
    return Cell(
        node=column.node or row.node or layout.node,
        selector=selector,
        metric=metric,
        digits=layout.digits if digits is None else digits,
        interval=row.interval and column.interval,
    )


def check(layout: Layout) -> None:
    """Every cell resolves and every published value names a row and a column (LayoutError)."""
    for row in layout.rows:
        for column in layout.columns:
            cell(layout, row, column)
    rows, columns = {r.key for r in layout.rows}, {c.key for c in layout.columns}
    for key in layout.published:
        if key[0] not in rows or key[1] not in columns:
            raise LayoutError(f"{layout.paper}/{layout.node}: published value at {key}: no such cell")
    for axis in (layout.rows, layout.columns):
        keys = [e.key for e in axis]
        if len(set(keys)) != len(keys):
            raise LayoutError(f"{layout.paper}/{layout.node}: repeated key in {keys}")


# ------------------------------------------------------------------------------------ measuring


@dataclass
class Measured:
    """The runs a cell matched: ``labels`` (more than one: the selector is ambiguous), ``n``
    values, their mean and interval; ``problem`` says why there is no number."""

    labels: list[str]
    n: int = 0
    mean: float = math.nan
    ci: tuple[float, float] = (math.nan, math.nan)
    problem: str = ""


def measure(
    frame: pd.DataFrame | None,
    spec: Cell,
    metric: str,
    alpha: float = 0.05,
    n_resamples: int = 10_000,
    rng: np.random.Generator | None = None,
) -> Measured:
    """Mean of ``metric`` over the rows of the one configuration ``spec.selector`` picks from
    ``frame``, with its percentile bootstrap ``1 - alpha`` interval."""
    if frame is None or frame.empty:
        return Measured([], problem="no runs")
    rows = select(frame, spec.selector)
    labels = sorted(str(m) for m in rows["method"].unique())
    if not labels:
        return Measured([], problem="no matching run")
    if several_configurations(rows):
        return Measured(labels, problem=f"{len(labels)} configurations: " + ", ".join(labels))
    try:
        values = metric_values(rows, metric).to_numpy(dtype=float)
    except KeyError:
        return Measured(labels, problem=f"no per-sample {metric!r}")
    values = values[np.isfinite(values)]
    if values.size == 0:
        return Measured(labels, problem=f"no finite {metric!r}")
    ci = bootstrap_ci(values, level=1 - alpha, n_resamples=n_resamples, rng=rng)
    return Measured(labels, int(values.size), float(values.mean()), ci)


def cell_text(measured: Measured, digits: int, interval: bool = True) -> str:
    """``mean [low, high]`` to ``digits`` decimals (the mean alone without an interval), or why
    there is no number: ``-`` when nothing ran, the configurations when several match."""
    if measured.problem:
        return "-" if measured.problem in ("no runs", "no matching run") else measured.problem
    text = f"{measured.mean:.{digits}f}"
    if interval and all(math.isfinite(v) for v in measured.ci):
        text += f" [{measured.ci[0]:.{digits}f}, {measured.ci[1]:.{digits}f}]"
    return text


def _model_frame(frames: Mapping[str, pd.DataFrame], node: str, model: str) -> pd.DataFrame | None:
    frame = frames.get(node)
    if frame is None or frame.empty:
        return None
    sub = frame[frame["model"] == model]
    return None if sub.empty else sub


def declared_plan(node: str, conf_dir: Path = CONF_DIR) -> dict[str, Any]:
    """The ``analysis`` block of ``conf/experiment/<node>.yaml`` ({} when the node does not exist):
    the metric and alpha of a node with no runs yet."""
    path = Path(conf_dir) / "experiment" / f"{node}.yaml"
    if not path.is_file():
        return {}
    return dict((yaml.safe_load(path.read_text()) or {}).get("analysis") or {})


def run_line(node: str, model: str) -> str:
    return f"No runs on {model} yet: `python -m kvbench -m +experiment={node}`."


def _variants(frame: pd.DataFrame | None) -> list[str]:
    """The task variants in a node's frame ("" for the only one or an unnamed one)."""
    if frame is None or "variant" not in frame:
        return [""]
    return sorted({v if isinstance(v, str) else "" for v in frame["variant"]})


def _of_variant(frame: pd.DataFrame | None, variant: str) -> pd.DataFrame | None:
    if frame is None or "variant" not in frame or len(_variants(frame)) < 2:
        return frame
    keep = frame["variant"].map(lambda v: (v if isinstance(v, str) else "") == variant)
    return frame[keep] if keep.any() else frame


def table(
    layout: Layout,
    node_frames: Mapping[str, pd.DataFrame | None],
    plans: Mapping[str, Mapping[str, Any]],
    seed: int = 0,
    n_resamples: int = 10_000,
) -> tuple[pd.DataFrame, dict[str, set[str]], list[int], set[str]]:
    """The layout's table from each node's frame (None: no runs): the table, the configuration
    labels it shows per node, the n of each measured cell and the metrics read."""
    published_cols = {c for _, c in layout.published}
    header = [layout.corner or " "]
    for column in layout.columns:
        header.append(column.label)
        if column.key in published_cols:
            header.append(f"{column.label} (paper)")
    body, shown, ns, metrics = [], {n: set() for n in layout.nodes}, [], set()
    for row in layout.rows:
        line = [row.label]
        for column in layout.columns:
            spec = cell(layout, row, column)
            plan = plans.get(spec.node, {})
            metric = spec.metric or plan.get("metric") or ""
            template = column.metric or row.metric or layout.metric or ""
            metrics.add(re.sub(r"\$(\w+)", r"<\1>", template) if "$" in template else metric)
            rng = np.random.default_rng([seed, zlib.crc32(f"{spec.node}|{row.key}|{column.key}".encode())])
            alpha = float(plan.get("alpha") or 0.05)
            measured = measure(node_frames.get(spec.node), spec, metric, alpha, n_resamples, rng)
            if len(measured.labels) == 1:
                shown[spec.node].add(measured.labels[0])
            if measured.n:
                ns.append(measured.n)
            line.append(cell_text(measured, spec.digits, spec.interval))
            if column.key in published_cols:
                value = layout.published.get((row.key, column.key))
                line.append("" if value is None else str(value))
        body.append(line)
    return pd.DataFrame(body, columns=header, dtype=object), shown, ns, metrics


def render(
    layout: Layout,
    frames: Mapping[str, pd.DataFrame],
    model: str,
    seed: int = 0,
    n_resamples: int = 10_000,
) -> list[str]:
    """The markdown lines of one layout on ``model``: title, caption, note, the table, and the
    configurations of its nodes that the table does not show. A node with no runs on ``model``
    gives the run command instead of numbers; the table is still shown when the layout has
    published values. Runs of several task variants of the layout's node (other context lengths,
    say) give one table per variant."""
    check(layout)
    node_frames = {n: _model_frame(frames, n, model) for n in layout.nodes}
    plans = {n: plan_of(f) if f is not None else declared_plan(n) for n, f in node_frames.items()}
    missing = [n for n, f in node_frames.items() if f is None]
    variants = _variants(node_frames[layout.node])
    parts, ns, metrics = [], [], set()
    for variant in variants:
        frames_v = {n: _of_variant(f, variant) for n, f in node_frames.items()}
        built, shown, ns_v, metrics_v = table(layout, frames_v, plans, seed, n_resamples)
        ns += ns_v
        metrics |= metrics_v
        part = [f"### task variant `{variant or '(default)'}`", ""] if len(variants) > 1 else []
        if len(missing) < len(layout.nodes) or layout.published:
            part += [tables.to_markdown(built).rstrip()]
        for node, frame in frames_v.items():
            rest = sorted(set(frame["method"].astype(str)) - shown[node]) if frame is not None else []
            if rest:
                part += ["", f"Also in the runs of `{node}`, not in this table: " + ", ".join(rest) + "."]
        parts.append(part)

    alphas = {float(p.get("alpha") or 0.05) for p in plans.values()} or {0.05}
    level = ", ".join(f"{100 * (1 - a):g} %" for a in sorted(alphas))
    named = sorted(m for m in metrics if m)
    metric_text = ("metrics " if len(named) > 1 else "metric ") + ", ".join(f"`{m}`" for m in named)
    paper = f"Paper: {layout.where}" + (f", on {layout.published_on}" if layout.published_on else "")
    caption = (
        f"{paper}. Measured on {model}: "
        + ", ".join(f"`{n}`" for n in layout.nodes)
        + f", {metric_text}; each cell the mean over samples and seeds [{level} bootstrap interval]"
    )
    if ns:
        caption += f", n = {min(ns)}" + (f"-{max(ns)}" if max(ns) != min(ns) else "") + " per cell"
    lines = [f"## {layout.title}", "", caption + "."]
    if layout.note:
        lines += ["", layout.note]
    if missing:
        lines += [""] + [run_line(n, model) for n in missing]
    for part in parts:
        if part:
            lines += [""] + part
    return lines


def arm(key: str, label: str, selector: Mapping[str, Any], **kw: Any) -> Entry:
    """An entry that selects the arm (see the module docstring)."""
    return Entry(key, label, select=selector, **kw)


def axis(key: str, label: str, **variables: Any) -> Entry:
    """An entry that only sets variables (a bit width, a top-k, a policy)."""
    return Entry(key, label, vars=variables)


# ------------------------------------------------------------------------------------ the files

PAPER_KEYS = ("paper", "title", "source", "order", "claims_order", "notes", "tables", "claims", "accounting")
PAPER_REQUIRED = ("paper", "title", "source", "order")
TABLE_KEYS = (
    "node",
    "title",
    "where",
    "rows",
    "columns",
    "published_on",
    "note",
    "corner",
    "metric",
    "digits",
    "published",
)
TABLE_REQUIRED = ("node", "title", "where", "rows", "columns")
ENTRY_KEYS = ("key", "label", "select", "vars", "metric", "node", "digits", "interval")
ENTRY_SELECTOR_KEYS = ("label", "method", "bits", "config")
_NAME = re.compile(r"^[a-z0-9_]+$")
_MAX_DIGITS = 10


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _Reader:
    """Checks one paper file's values, each error naming the file and the key's path in it."""

    def __init__(self, file: Path):
        self.file = file

    def fail(self, key: str, value: Any, allowed: str) -> None:
        raise PaperError(self.file, key, value, allowed)

    def mapping(self, key: str, value: Any, allowed: Sequence[str], required: Sequence[str] = ()) -> dict:
        if not isinstance(value, dict):
            self.fail(key or "(file)", value, f"must be a mapping with the keys {', '.join(allowed)}")
        for name in value:
            if name not in allowed:
                self.fail(
                    f"{key}.{name}" if key else str(name),
                    value[name],
                    f"unknown key; allowed: {', '.join(allowed)}",
                )
        for name in required:
            if name not in value:
                self.fail(f"{key}.{name}" if key else name, None, "missing (required)")
        return value

    def text(self, key: str, value: Any, empty: bool = False) -> str:
        if not isinstance(value, str) or (not empty and not value.strip()):
            self.fail(key, value, "must be text" + ("" if empty else " (not empty)"))
        return value

    def whole(self, key: str, value: Any, low: int | None = None, high: int | None = None) -> int:
        if not isinstance(value, int) or isinstance(value, bool):
            self.fail(key, value, "must be a whole number")
        if (low is not None and value < low) or (high is not None and value > high):
            self.fail(key, value, f"must lie in [{low}, {high}]")
        return value

    def items(self, key: str, value: Any) -> list:
        if not isinstance(value, list) or not value:
            self.fail(key, value, "must be a non-empty list")
        return value

    def selector(self, key: str, value: Any) -> dict[str, Any]:
        sel = self.mapping(key, value, ENTRY_SELECTOR_KEYS)
        if "label" not in sel and "method" not in sel:
            self.fail(key, value, "needs 'method' or 'label' (arms are chosen by what ran, not by folder)")
        for name in ("label", "method"):
            if name in sel:
                self.text(f"{key}.{name}", sel[name])
        bits = sel.get("bits")
        if "bits" in sel and not (_is_number(bits) or (isinstance(bits, str) and _PLACEHOLDER.match(bits))):
            self.fail(f"{key}.bits", bits, "must be a number or a placeholder such as '$bits'")
        if "config" in sel and not isinstance(sel["config"], dict):
            self.fail(f"{key}.config", sel["config"], "must be a mapping (a subset of the method node)")
        return dict(sel)

    def entry(self, key: str, value: Any) -> Entry:
        e = self.mapping(key, value, ENTRY_KEYS, ("key", "label"))
        if not isinstance(e["key"], str) or not e["key"].strip():
            self.fail(f"{key}.key", e["key"], "must be text (quote a number: '4')")
        self.text(f"{key}.label", e["label"])
        variables = e.get("vars") or {}
        if not isinstance(variables, dict) or not all(
            isinstance(k, str) and k.isidentifier() for k in variables
        ):
            self.fail(f"{key}.vars", e.get("vars"), "must be a mapping {name: value} with identifier names")
        for name in ("metric", "node"):
            if e.get(name) is not None:
                self.text(f"{key}.{name}", e[name])
        if e.get("digits") is not None:
            self.whole(f"{key}.digits", e["digits"], 0, _MAX_DIGITS)
        if not isinstance(e.get("interval", True), bool):
            self.fail(f"{key}.interval", e["interval"], "must be true or false")
        return Entry(
            key=e["key"],
            label=e["label"],
            select=None if e.get("select") is None else self.selector(f"{key}.select", e["select"]),
            vars=dict(variables),
            metric=e.get("metric"),
            node=e.get("node"),
            digits=e.get("digits"),
            interval=e.get("interval", True),
        )

    def published(self, key: str, value: Any) -> dict[tuple[str, str], Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.fail(key, value, "must be a mapping {row key: {column key: value}}")
        out = {}
        for row, cells in value.items():
            if not isinstance(row, str):
                self.fail(f"{key}.{row}", row, "a row key must be text (quote a number: '4')")
            if not isinstance(cells, dict):
                self.fail(f"{key}.{row}", cells, "must be a mapping {column key: value}")
            for column, published in cells.items():
                if not isinstance(column, str):
                    self.fail(
                        f"{key}.{row}.{column}", column, "a column key must be text (quote a number: '4')"
                    )
                if not (_is_number(published) or (isinstance(published, str) and published.strip())):
                    self.fail(f"{key}.{row}.{column}", published, "the paper's value: a number or text")
                out[(row, column)] = published
        return out

    def layout(self, key: str, paper: str, value: Any) -> Layout:
        t = self.mapping(key, value, TABLE_KEYS, TABLE_REQUIRED)
        for name in ("node", "title", "where"):
            self.text(f"{key}.{name}", t[name])
        for name in ("published_on", "corner"):
            if t.get(name) is not None:
                self.text(f"{key}.{name}", t[name], empty=True)
        for name in ("note", "metric"):
            if t.get(name) is not None:
                self.text(f"{key}.{name}", t[name])
        axes = {}
        for name in ("rows", "columns"):
            items = self.items(f"{key}.{name}", t[name])
            axes[name] = tuple(self.entry(f"{key}.{name}[{i}]", e) for i, e in enumerate(items))
        layout = Layout(
            paper=paper,
            node=t["node"],
            title=t["title"],
            where=t["where"],
            published_on=t.get("published_on") or "",
            rows=axes["rows"],
            columns=axes["columns"],
            published=self.published(f"{key}.published", t.get("published")),
            metric=t.get("metric"),
            digits=3 if t.get("digits") is None else self.whole(f"{key}.digits", t["digits"], 0, _MAX_DIGITS),
            corner=t.get("corner") or "",
            note=t.get("note"),
        )
        try:
            check(layout)
        except LayoutError as err:
            self.fail(key, layout.node, str(err))
        return layout


def read_paper(file: str | Path, conf_dir: str | Path | None = None) -> Paper:
    """One paper file checked against the schema (see the module docstring); with ``conf_dir``
    (the ``conf`` folder) every node its tables and claims name must exist there."""
    file = Path(file)
    reader = _Reader(file)
    try:
        doc = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        raise PaperError(file, "(file)", file.name, f"not YAML: {str(err).splitlines()[0]}") from None
    doc = reader.mapping("", doc, PAPER_KEYS, PAPER_REQUIRED)
    name = reader.text("paper", doc["paper"])
    if not _NAME.match(name) or name != file.stem:
        reader.fail("paper", name, f"must be the file's stem {file.stem!r} (lower-case letters, digits, _)")
    for key in ("title", "source"):
        reader.text(key, doc[key])
    notes = doc.get("notes") or []
    if not isinstance(notes, list) or not all(isinstance(n, str) and n.strip() for n in notes):
        reader.fail("notes", doc.get("notes"), "must be a list of one-line texts")
    tables = doc.get("tables") or []
    if not isinstance(tables, list):
        reader.fail("tables", tables, "must be a list of tables (see kvbench/analysis/papers.py)")
    layouts = tuple(reader.layout(f"tables[{i}]", name, t) for i, t in enumerate(tables))
    if conf_dir is not None:
        for i, layout in enumerate(layouts):
            for node in layout.nodes:
                if not (Path(conf_dir) / "experiment" / f"{node}.yaml").is_file():
                    reader.fail(f"tables[{i}].node", node, "no such node under conf/experiment")
    accounting = None
    if doc.get("accounting") is not None:
        try:
            accounting = parse_accounting(doc["accounting"])
        except AccountingError as err:
            reader.fail(f"accounting.{err.key}".rstrip("."), doc["accounting"], err.problem)
    entries = doc.get("claims") or []
    if not isinstance(entries, list):
        reader.fail("claims", entries, "must be a list of claims (see kvbench/analysis/claims/schema.py)")
    try:
        claims = tuple(
            validate(e, i, Path(conf_dir) if conf_dir else None, paper=name, accounting=accounting)
            for i, e in enumerate(entries)
        )
    except ClaimsError as err:
        raise err.located(file) from None
    return Paper(
        id=name,
        title=doc["title"],
        source=doc["source"],
        order=reader.whole("order", doc["order"]),
        file=file,
        claims_order=None
        if doc.get("claims_order") is None
        else reader.whole("claims_order", doc["claims_order"]),
        notes=tuple(notes),
        tables=layouts,
        claims=claims,
        accounting=accounting,
    )


def load_papers(source: str | Path = PAPERS_DIR, conf_dir: str | Path | None = None) -> list[Paper]:
    """Every paper file of the folder ``source`` (``*.yaml``; or the one file ``source``), checked
    file by file and then across files (claim ids unique, task-level claims declared, every rule
    able to reach its alpha at its node's size with ``conf_dir``), in ``order``."""
    source = Path(source)
    if source.is_dir():
        files = sorted(source.glob("*.yaml"))
        if not files:
            raise PaperError(source, "declarations", str(source), "the folder holds no <paper>.yaml")
    elif source.is_file():
        files = [source]
    else:
        raise PaperError(source, "declarations", str(source), "does not exist: give a folder of <paper>.yaml")
    papers = sorted((read_paper(f, conf_dir) for f in files), key=lambda p: (p.order, p.id))
    files_of = {c.id: p.file for p in papers for c in p.claims}
    try:
        check_claims(claims_of(papers), Path(conf_dir) if conf_dir else None)
    except ClaimsError as err:
        raise err.located(files_of.get(err.claim, source)) from None
    return papers


def claims_of(papers: Sequence[Paper]) -> list[Claim]:
    """The papers' claims in the register's order (each paper's ``claims_order``, else ``order``)."""
    ranked = sorted(papers, key=lambda p: (p.order if p.claims_order is None else p.claims_order, p.id))
    return [c for p in ranked for c in p.claims]


def load_claims(source: str | Path = PAPERS_DIR, conf_dir: str | Path | None = None) -> list[Claim]:
    """Every claim of the paper files under ``source`` (see :func:`load_papers`), in register order."""
    return claims_of(load_papers(source, conf_dir))
