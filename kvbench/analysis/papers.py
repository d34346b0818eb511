"""Each seed paper's headline tables in the paper's own layout, measured beside published.

A layout (``Layout``) is data: the paper's rows and columns (``Entry``), the experiment node its
cells come from, and the paper's published value for the cells where the paper gives one, with the
table or figure it comes from and the model it was measured on. ``render`` turns a layout and the
experiments' sample frames into a markdown table whose cells are per-configuration means with
their bootstrap interval, e.g. ``5.71 [5.60, 5.83]``, each followed, where the paper gives one, by
the published value in the column beside it. ``python -m kvbench.report --paper NAME`` puts them
under the paper's claims (``kvbench.report.paper_markdown``).

How a cell finds its runs: exactly one of its row and column carries an arm selector in the form
of ``results/claims.yaml`` (``method``/``label``, ``bits``, ``config``: a subset of the run's
method node), resolved against the frame by :func:`kvbench.analysis.claims.select`, never by
folder name. The other axis (and the selector's own axis) may carry ``vars``: a selector value
written ``"$name"`` takes the value of ``name`` (typed, so ``bits: "$bits"`` compares as a number),
and ``$name`` inside a longer string is substituted as text (the metric
``"hit_rates.$policy.$sparsity"``). A selector without a placeholder gives the same configuration
in every cell of its row (FP16 in a bit-width table). The metric is the column's, else the row's,
else the layout's, else the node's declared ``analysis.metric``; a dotted path reaches into a dict
column as in the claims. The node of a cell is the column's, else the row's, else the layout's.

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
from kvbench.analysis.claims import metric_values, select, several_configurations
from kvbench.analysis.frame import plan_of
from kvbench.paths import CONF_DIR
from kvbench.stats import bootstrap_ci


class LayoutError(ValueError):
    """A layout that cannot resolve a cell (no selector, two selectors, an unknown variable)."""


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


# --------------------------------------------------------------------------------- the layouts


def arm(key: str, label: str, selector: Mapping[str, Any], **kw: Any) -> Entry:
    """An entry that selects the arm (see the module docstring)."""
    return Entry(key, label, select=selector, **kw)


def axis(key: str, label: str, **variables: Any) -> Entry:
    """An entry that only sets variables (a bit width, a top-k, a policy)."""
    return Entry(key, label, vars=variables)


FP16 = arm("fp16", "FP16", {"method": "fp16"})


def _bits_columns(bits: Sequence[float], suffix: str = "-bit") -> tuple[Entry, ...]:
    return tuple(axis(f"{b:g}", f"{b:g}{suffix}", bits=b) for b in bits)


_KVQ_FULL = {"pre_rope": True, "datatype": "nuq", "outlier_fraction": 0.01, "sink": True}


def _kvquant(key: str, label: str, **changes: Any) -> Entry:
    return arm(key, label, {"method": "kvquant", "bits": "$bits", "config": {**_KVQ_FULL, **changes}})


def _kvquant_columns() -> tuple[Entry, ...]:
    out: list[Entry] = []
    for b in (4, 3, 2):
        out.append(axis(f"{b}", f"{b}-bit ppl", bits=b))
        out.append(
            Entry(
                f"{b}eff",
                f"{b}-bit eff. bits",
                vars={"bits": b},
                metric="effective_bits",
                digits=2,
                interval=False,
            )
        )
    return tuple(out)


_AXES = (("token", "token"), ("channel", "token"), ("token", "channel"), ("channel", "channel"))
_SEMKV_GRID = (1, 1.585, 2, 2.322, 2.585, 3, 4)
_SEMKV_MODEL = "Llama-3.1-8B-Instruct, LongBench (n=900, three seeds)"
_ACCOUNTING = (
    Entry("code", "code bits", metric="code_bits", digits=3, interval=False),
    Entry("eff", "effective bits", metric="effective_bits", digits=3, interval=False),
)

LAYOUTS: dict[str, tuple[Layout, ...]] = {
    "kivi": (
        Layout(
            paper="kivi",
            node="kivi_gsm8k",
            title="KIVI: GSM8K accuracy, FP16 against KIVI-4 and KIVI-2",
            where="KIVI Sec. 4, the LM-Eval table (CoQA / TruthfulQA / GSM8K)",
            published_on="Llama-2-7B and the other Llama and Mistral models",
            note="The source document gives KIVI-2's bound against FP16, not the table's cells.",
            corner="cache",
            rows=(
                FP16,
                arm("kivi4", "KIVI-4 (G=32, R=128)", {"method": "kivi", "bits": 4}),
                arm("kivi2", "KIVI-2 (G=32, R=128)", {"method": "kivi", "bits": 2}),
            ),
            columns=(axis("acc", "GSM8K accuracy"),),
            published={("kivi2", "acc"): "at most about 2 points below FP16"},
        ),
        Layout(
            paper="kivi",
            node="kivi_group_ablation",
            title="KIVI: group size G of KIVI-2 (R=128), GSM8K accuracy",
            where="KIVI Sec. 4 ablation on GSM8K",
            published_on="a Llama model the source document does not name",
            corner="cache",
            rows=(
                FP16,
                *(
                    arm(
                        f"g{g}",
                        f"KIVI-2, G={g}",
                        {"method": "kivi", "bits": 2, "config": {"group_size": g, "residual": 128}},
                    )
                    for g in (32, 64, 128)
                ),
            ),
            columns=(axis("acc", "GSM8K accuracy"),),
            published={
                ("g32", "acc"): "similar to G=64",
                ("g64", "acc"): "similar to G=32",
                ("g128", "acc"): "markedly lower",
            },
            note="G=128 needs head_dim >= 128: on the default model (head_dim 64) its arm cannot run.",
        ),
        Layout(
            paper="kivi",
            node="kivi_axis_ablation",
            title="KIVI: quantization axis of keys and values, WikiText-2 perplexity",
            where="KIVI Sec. 3 observations / Table 1",
            published_on="the paper's Llama models",
            note=(
                "The paper scores LM-Eval accuracy, not perplexity, and the source document states the "
                "direction only; it states the V per-channel finding without a bit width (shown at 2)."
            ),
            corner="keys / values (uniform, G=32, no window)",
            rows=(
                FP16,
                *(
                    arm(
                        f"k{k}_v{v}",
                        f"K per-{k}, V per-{v}",
                        {"method": "uniform", "bits": "$bits", "config": {"key_axis": k, "value_axis": v}},
                    )
                    for k, v in _AXES
                ),
            ),
            columns=_bits_columns((2, 4)),
            published={
                ("ktoken_vtoken", "4"): "accuracy kept",
                ("ktoken_vtoken", "2"): "large drop",
                ("kchannel_vtoken", "2"): "the most accurate 2-bit layout",
                ("ktoken_vchannel", "2"): "large drop (V per-channel)",
                ("kchannel_vchannel", "2"): "large drop (V per-channel)",
            },
            digits=2,
        ),
    ),
    "intactkv": (
        Layout(
            paper="intactkv",
            node="intactkv_ppl",
            title="IntactKV: KV-cache quantization with and without the lossless pivot token, perplexity",
            where="IntactKV Fig. 4",
            published_on="the paper's LLaMA models (not named in the source document)",
            note=(
                "The paper quantizes the KV cache of an AWQ weight-only model; the source document gives "
                "the direction (better at every bit width, most at the fewest bits), not the numbers."
            ),
            corner="cache",
            rows=(
                arm("kivi", "KIVI (G=32, R=128)", {"method": "kivi", "bits": "$bits"}),
                arm(
                    "intact_kivi",
                    "IntactKV + KIVI",
                    {"method": "intactkv", "bits": "$bits", "config": {"base": {"name": "kivi"}}},
                ),
                arm("uniform", "uniform per-token (G=32)", {"method": "uniform", "bits": "$bits"}),
                arm(
                    "intact_uniform",
                    "IntactKV + uniform",
                    {"method": "intactkv", "bits": "$bits", "config": {"base": {"name": "uniform"}}},
                ),
                FP16,
            ),
            columns=_bits_columns((2, 3)),
            published={
                ("intact_kivi", "2"): "better than its base; larger gain",
                ("intact_kivi", "3"): "better than its base",
                ("intact_uniform", "2"): "better than its base; larger gain",
                ("intact_uniform", "3"): "better than its base",
            },
            digits=2,
        ),
    ),
    "kvquant": (
        Layout(
            paper="kvquant",
            node="kvquant_ablation",
            title="KVQuant: the components one at a time (Table 2 style), WikiText-2 perplexity",
            where="KVQuant Table 1 / Fig. 1 and Sec. 4 (memory savings)",
            published_on="LLaMA-7B, Wikitext-2 (the memory savings: across the paper's models)",
            note=(
                "The source document gives the full method's degradation against FP16 and its memory "
                "savings, not Table 2's per-component perplexities, so the other rows have no published "
                "value. The node removes one component at a time from the full method."
            ),
            corner="keys",
            rows=(
                arm(
                    "int_channel",
                    "int, per-channel keys (uniform, G=32, post-RoPE)",
                    {
                        "method": "uniform",
                        "bits": "$bits",
                        "config": {"key_axis": "channel", "value_axis": "token"},
                    },
                ),
                _kvquant("full", "KVQuant: pre-RoPE, nuq, 1% outliers, FP16 sink"),
                _kvquant("no_pre_rope", "- pre-RoPE (post-RoPE keys)", pre_rope=False),
                _kvquant("no_nuq", "- nuq (uniform datatype)", datatype="uniform"),
                _kvquant("no_outliers", "- outliers", outlier_fraction=0.0),
                _kvquant("no_sink", "- sink", sink=False),
                _kvquant("no_outliers_no_sink", "- outliers, - sink", outlier_fraction=0.0, sink=False),
                FP16,
            ),
            columns=_kvquant_columns(),
            published={
                ("full", "4"): "FP16 + < 0.02",
                ("full", "3"): "FP16 + < 0.1",
                ("full", "2"): "FP16 + < 0.5",
                ("full", "4eff"): "3.7x smaller than FP16",
                ("full", "3eff"): "4.8x smaller than FP16",
                ("full", "2eff"): "6.9x smaller than FP16",
            },
            digits=2,
        ),
    ),
    "ott": (
        Layout(
            paper="ott",
            node="ott_vs_kivi",
            title="OTT: Needle-in-a-Haystack, KIVI-2 against OTT-2",
            where="OTT Appendix G, Figs. 9-10",
            published_on=(
                "LLaMA-2-7B-chat (4K) and LLaMA-3-8B-Instruct (8K); the source document does not say "
                "which model the two averages come from"
            ),
            corner="cache",
            rows=(
                FP16,
                arm("kivi2", "KIVI-2 (G=32, R=128)", {"method": "kivi", "bits": 2}),
                arm("ott2", "OTT-2 (G=128, R=32, pool 3)", {"method": "ott", "bits": 2}),
            ),
            columns=(axis("score", "NIAH score"),),
            published={("kivi2", "score"): "93.1 %", ("ott2", "score"): "99.2 %"},
            note="The paper's NIAH accuracy and kvbench's key-phrase recall are different scores.",
        ),
        Layout(
            paper="ott",
            node="attention_probe",
            title="OTT: attention-output error of the quantized cache",
            where="OTT Fig. 1(c)",
            published_on="LLaMA-2-7B-chat",
            note=(
                "The paper plots the attention-output L1 loss by which tokens stay in full precision "
                "(lowest when the smallest-key tokens do); the source document gives no numbers."
            ),
            corner="cache",
            metric="rel_err",
            rows=(
                FP16,
                arm("kivi2", "KIVI-2", {"method": "kivi", "bits": 2}),
                arm("ott2", "OTT-2", {"method": "ott", "bits": 2}),
            ),
            columns=(axis("err", "relative attention-output error"),),
            digits=4,
        ),
    ),
    "specache": (
        Layout(
            paper="specache",
            node="specache_niah",
            title="SpeCache: Needle-in-a-Haystack at 1 bit",
            where="SpeCache Fig. 4 (g=32)",
            published_on=(
                "Mistral-7B-Instruct-v0.2 (32K) and LLaMA-3-8B-Instruct (8K), GPT-4-graded responses"
            ),
            corner="cache",
            rows=(
                FP16,
                arm("kivi1", "KIVI-1 (g=32, R=128)", {"method": "kivi", "bits": 1}),
                arm("specache1", "SpeCache-1 (g=32, R=64, top-64)", {"method": "specache", "bits": 1}),
            ),
            columns=(axis("score", "NIAH score"),),
            published={
                ("kivi1", "score"): "retrieval severely damaged",
                ("specache1", "score"): "back to the 16-bit level",
            },
        ),
        Layout(
            paper="specache",
            node="specache_k_ablation",
            title="SpeCache: prefetched FP16 pairs k, 1-bit (g=32), NIAH score",
            where="SpeCache Fig. 5",
            published_on="a model the source document does not name",
            corner="cache",
            rows=(
                FP16,
                arm(
                    "specache1",
                    "SpeCache-1 (g=32)",
                    {"method": "specache", "bits": 1, "config": {"topk": "$k"}},
                ),
            ),
            columns=tuple(axis(f"{k}", f"k={k}", k=k) for k in (0, 16, 64, 128)),
            published={
                ("specache1", "0"): "KIVI-1 baseline",
                ("specache1", "16"): "markedly above k=0; rises with k",
            },
        ),
        Layout(
            paper="specache",
            node="specache_1bit_zero_point",
            title="SpeCache: the 1-bit zero point, with and without prefetching, NIAH score",
            where="SpeCache Table 5",
            published_on="the paper's LongBench setting (the source document does not name the model)",
            note="The source document states the direction only.",
            corner="cache",
            rows=(
                arm(
                    "kivi",
                    "KIVI-1 (no prefetch)",
                    {"method": "kivi", "bits": 1, "config": {"zero_point": "$zp"}},
                ),
                arm(
                    "specache",
                    "SpeCache-1 (top-k prefetch)",
                    {"method": "specache", "bits": 1, "config": {"zero_point": "$zp"}},
                ),
                FP16,
            ),
            columns=(
                axis("minmax", "min/max zero point (KIVI)", zp="minmax"),
                axis("specache", "SpeCache zero point", zp="specache"),
            ),
            published={
                ("kivi", "minmax"): "very poor",
                ("specache", "minmax"): "very poor even with SpeCache",
                ("specache", "specache"): "much better",
            },
        ),
        Layout(
            paper="specache",
            node="specache_hitrate",
            title="SpeCache: attention hit rate by sparsity k/T, per policy (FP16 attention)",
            where="SpeCache Fig. 2 left",
            published_on="LLaMA-3-8B, PG19 truncated to 8K tokens",
            corner="policy",
            metric="hit_rates.$policy.$sparsity",
            rows=tuple(
                Entry(p, label, select={"method": "fp16"}, vars={"policy": p})
                for p, label in (
                    ("exact_topk", "query-dependent top-k (exact)"),
                    ("specache", "SpeCache speculative top-k"),
                    ("h2o", "greedy eviction (H2O)"),
                )
            ),
            columns=tuple(
                axis(s, f"{100 * float(s):g} %", sparsity=s) for s in ("0.005", "0.01", "0.02", "0.05", "0.1")
            ),
            published={
                ("exact_topk", "0.005"): "about 0.90",
                ("h2o", "0.005"): "far below top-k",
            },
        ),
    ),
    "semkv": (
        Layout(
            paper="semkv",
            node="semkv_cliff",
            title="SemKV: the quality cliff, mean score by bits (affine and TurboQuant-MSE base)",
            where="SemKV Sec. 4.1 / Fig. 1 (affine) and Sec. 4.9 (TurboQuant-MSE)",
            note=(
                "Published: where the score stays statistically indistinguishable from FP16 (~ FP16) and "
                "where it has collapsed; the source document stops before the per-point scores. "
                "TurboQuant's generation-side cliff lies lower, in (1.0, 1.585]."
            ),
            published_on=_SEMKV_MODEL,
            corner="bits",
            rows=tuple(axis(f"{b:g}", f"{b:g}", bits=b) for b in _SEMKV_GRID),
            columns=(
                arm("uniform", "uniform (affine)", {"method": "uniform", "bits": "$bits"}),
                arm(
                    "turboquant",
                    "TurboQuant-MSE",
                    {"method": "turboquant", "bits": "$bits"},
                    node="semkv_turboquant_cliff",
                ),
                arm("fp16", "FP16", {"method": "fp16"}),
            ),
            published={
                **{(f"{b:g}", "uniform"): "~ FP16" for b in (2.322, 2.585, 3)},
                ("2", "uniform"): "collapsed",
                ("2", "turboquant"): "~ FP16",
                ("1.585", "turboquant"): "collapsed (prefill, multi-turn)",
            },
        ),
        Layout(
            paper="semkv",
            node="semkv_interpolation",
            title="SemKV: two-level interpolation between 2.322 and 2.585 bits",
            where="SemKV Abstract / Sec. 4.2",
            note="Table 2's per-row scores are not in the source document.",
            published_on=_SEMKV_MODEL,
            corner="cache (per-token affine over the head)",
            rows=(
                arm("u2322", "uniform, 5 levels (2.322)", {"method": "uniform", "bits": 2.322}),
                *(
                    arm(
                        f"s{b}",
                        f"SemKV {b} (key-norm ranking)",
                        {"method": "semkv", "bits": b, "config": {"metric": "key_norm"}},
                    )
                    for b in (2.39, 2.45, 2.52)
                ),
                arm("u2585", "uniform, 6 levels (2.585)", {"method": "uniform", "bits": 2.585}),
                arm(
                    "r2.39",
                    "SemKV 2.39 (random ranking)",
                    {"method": "semkv", "bits": 2.39, "config": {"metric": "random"}},
                ),
                FP16,
            ),
            columns=(*_ACCOUNTING, axis("score", "score")),
            published={
                ("u2322", "score"): "~ FP16",
                ("s2.39", "code"): "2.39",
                ("s2.39", "eff"): "2.65 (6.0x below FP16)",
                ("s2.39", "score"): "~ FP16",
                ("u2585", "score"): "~ FP16",
            },
        ),
        Layout(
            paper="semkv",
            node="semkv_interpolation_above_cliff",
            title="SemKV's recipe above the default model's own cliff (3 / 3.322 bits)",
            where="none: SemKV's recipe (Sec. 3) applied to this model's measured cliff",
            published_on="",
            corner="cache (per-token affine over the head)",
            rows=(
                arm("u3", "uniform, 8 levels (3)", {"method": "uniform", "bits": 3}),
                *(
                    arm(
                        f"s{b}",
                        f"SemKV {b} (key-norm ranking)",
                        {"method": "semkv", "bits": b, "config": {"metric": "key_norm"}},
                    )
                    for b in (3.1, 3.2)
                ),
                arm("u3322", "uniform, 10 levels (3.322)", {"method": "uniform", "bits": 3.322}),
                arm(
                    "r3.1",
                    "SemKV 3.1 (random ranking)",
                    {"method": "semkv", "bits": 3.1, "config": {"metric": "random"}},
                ),
                FP16,
            ),
            columns=(*_ACCOUNTING, axis("score", "score")),
        ),
        Layout(
            paper="semkv",
            node="semkv_prune_vs_lowprec",
            title="SemKV: FP16 token pruning against 2.39-bit retention at matched memory",
            where="SemKV Sec. 4.5 (contribution 4)",
            published_on="Llama-3.1-8B-Instruct (the paper's main model; its LongBench protocol)",
            corner="cache",
            rows=(
                arm("fp16", "FP16 (full cache)", {"method": "fp16"}),
                arm("semkv", "SemKV 2.39", {"method": "semkv", "bits": 2.39}),
                arm("streamingllm", "StreamingLLM", {"method": "streamingllm"}),
                arm("h2o", "H2O", {"method": "h2o"}),
                arm("snapkv", "SnapKV", {"method": "snapkv"}),
                arm("random", "random pruning", {"method": "random_prune"}),
            ),
            columns=(_ACCOUNTING[1], axis("score", "score")),
            published={
                ("fp16", "score"): "0.438",
                ("semkv", "score"): "~ full cache (0.438)",
                ("streamingllm", "score"): "0.065-0.149 (pruning range)",
                ("h2o", "score"): "0.065-0.149 (pruning range)",
                ("snapkv", "score"): "0.065-0.149 (pruning range)",
                ("random", "score"): "~ metric-based pruning",
            },
            note="The pruning arms keep FP16 tokens up to the bytes SemKV-2.39 holds (matched memory).",
        ),
    ),
    "readkv": (
        Layout(
            paper="readkv",
            node="readkv_read_budget",
            title="ReadKV: perplexity against the read budget, read (8-bit store) against store",
            where="ReadKV abstract (C4 perplexity)",
            note="The node scores WikiText-2 (task.dataset=c4 for the paper's data).",
            published_on="six base models the abstract does not name",
            corner="cache",
            rows=(
                arm(
                    "read",
                    "ReadKV: read b bits of an 8-bit store",
                    {"method": "readkv", "config": {"bits": 8, "read_bits": "$bits"}},
                ),
                arm(
                    "store",
                    "TurboQuant-MSE: store and read b bits",
                    {"method": "turboquant", "bits": "$bits"},
                ),
                FP16,
            ),
            columns=_bits_columns((1, 2, 3, 4), " bit read"),
            published={("read", "4"): "<= FP16 + 0.66 %; below store-4"},
            digits=2,
        ),
    ),
}

# One-line notes for tables of a paper that no node reproduces on the default model.
NOTES: dict[str, tuple[str, ...]] = {
    "kivi": (
        "LongBench (KIVI's long-context table) has no node on the default model (a 135M model with a "
        "short context); on a GPU: `python -m kvbench -m task=longbench model=llama2-7b "
        "+method=fp16,kivi bits=2,4`.",
    ),
}


def layouts(paper: str) -> tuple[Layout, ...]:
    """The layouts of ``paper`` (none for a paper without one)."""
    return LAYOUTS.get(paper, ())


def all_layouts() -> list[Layout]:
    return [layout for group in LAYOUTS.values() for layout in group]


def covered_nodes(paper: str) -> set[str]:
    """Every experiment node the paper's layouts read."""
    return {n for layout in layouts(paper) for n in layout.nodes}
