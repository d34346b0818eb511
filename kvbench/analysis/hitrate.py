"""Hit-rate curves of the ``pg19_hitrate`` task (SpeCache, Figure 2 left): table and figure.

Input: the task's per-sample rows, as dicts (``samples.jsonl`` lines) or as a pandas DataFrame (from
:func:`kvbench.analysis.load_samples`, where ``hit_rates`` is either a column of dicts or flattened
by ``json_normalize`` into ``hit_rates.<policy>.<sparsity>`` columns). Sparsity keys are strings
such as ``"0.005"``; a flattened column name splits on the first dot only, so ``"0.005"`` survives.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from kvbench import atomic  # noqa: E402

POLICY_ORDER = ("exact_topk", "specache", "h2o")
POLICY_LABELS = {
    "exact_topk": "query-dependent top-k (exact)",
    "specache": "SpeCache prediction (speculative token, low-bit keys)",
    "h2o": "greedy eviction (H2O)",
}
GROUP_KEYS = ("model", "method")


def _records(rows: pd.DataFrame | Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row as ``{"hit_rates": {policy: {sparsity: value}}, model, method}``."""
    if isinstance(rows, pd.DataFrame):
        out = []
        flat = [c for c in rows.columns if c.startswith("hit_rates.")]
        for _, r in rows.iterrows():
            rates: dict[str, dict[str, float]] = {}
            if "hit_rates" in rows.columns and isinstance(r["hit_rates"], dict):
                rates = r["hit_rates"]
            for col in flat:
                policy, sparsity = col[len("hit_rates.") :].split(".", 1)
                value = r[col]
                if value is not None and not (isinstance(value, float) and math.isnan(value)):
                    rates.setdefault(policy, {})[sparsity] = float(value)
            out.append({"hit_rates": rates, **{k: r[k] for k in GROUP_KEYS if k in rows.columns}})
        return out
    return [dict(r) for r in rows]


def hitrate_table(rows: pd.DataFrame | Iterable[dict[str, Any]]) -> pd.DataFrame:
    """Long table: one line per (model, method, policy, sparsity) with the mean hit rate over rows,
    its standard error (``sem``, NaN for a single row) and the row count ``n``; sorted by sparsity."""
    lines = []
    for r in _records(rows):
        for policy, per in (r.get("hit_rates") or {}).items():
            for sparsity, value in per.items():
                lines.append(
                    {
                        "model": r.get("model", ""),
                        "method": r.get("method", ""),
                        "policy": policy,
                        "sparsity": float(sparsity),
                        "hit_rate": float(value),
                    }
                )
    if not lines:
        raise ValueError("no hit_rates in the rows (are these pg19_hitrate samples?)")
    frame = pd.DataFrame(lines)
    grouped = frame.groupby(["model", "method", "policy", "sparsity"], sort=True)["hit_rate"]
    table = grouped.agg(hit_rate="mean", sem="sem", n="count").reset_index()
    return table.sort_values(["model", "method", "sparsity", "policy"], ignore_index=True)


def hitrate_markdown(rows: pd.DataFrame | Iterable[dict[str, Any]]) -> str:
    """Markdown table: sparsities down, policies across (mean hit rate, 3 decimals)."""
    table = hitrate_table(rows)
    wide = table.pivot_table(index="sparsity", columns="policy", values="hit_rate", aggfunc="mean")
    policies = [p for p in POLICY_ORDER if p in wide.columns] + [
        p for p in wide.columns if p not in POLICY_ORDER
    ]
    head = "| sparsity k/T | " + " | ".join(policies) + " |"
    rule = "|---:|" + "---:|" * len(policies)
    body = [
        f"| {s * 100:g}% | " + " | ".join(f"{wide.loc[s, p]:.3f}" for p in policies) + " |"
        for s in wide.index
    ]
    return "\n".join([head, rule, *body])


def plot_hitrate(
    rows: pd.DataFrame | Iterable[dict[str, Any]],
    path: str | Path | None = None,
    title: str | None = None,
):
    """Hit rate against sparsity (log x axis, percent), one line per policy with +-1 standard error
    bands across rows; one line style per (model, method) when the rows mix several. Saves to
    ``path`` when given; returns the matplotlib Figure."""
    table = hitrate_table(rows)
    fig, ax = plt.subplots(figsize=(5.2, 3.8))
    setups = list(dict.fromkeys(zip(table["model"], table["method"], strict=True)))
    styles = ["-", "--", ":", "-."]
    colors = {p: f"C{i}" for i, p in enumerate(POLICY_ORDER)}
    for j, (model, method) in enumerate(setups):
        part = table[(table["model"] == model) & (table["method"] == method)]
        for policy in [p for p in POLICY_ORDER if p in set(part["policy"])] + sorted(
            set(part["policy"]) - set(POLICY_ORDER)
        ):
            line = part[part["policy"] == policy].sort_values("sparsity")
            x = line["sparsity"] * 100
            label = POLICY_LABELS.get(policy, policy) + (f" [{model}]" if len(setups) > 1 else "")
            color = colors.get(policy)
            ax.plot(x, line["hit_rate"], styles[j % len(styles)], marker="o", ms=3, color=color, label=label)
            sem = line["sem"].fillna(0)
            ax.fill_between(x, line["hit_rate"] - sem, line["hit_rate"] + sem, color=color, alpha=0.15, lw=0)
    ax.set_xscale("log")
    ticks = sorted(set(table["sparsity"] * 100))
    ax.set_xticks(ticks, [f"{t:g}%" for t in ticks])
    ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax.set_xlabel("sparsity k / T (%)")
    ax.set_ylabel("hit rate (share of attention)")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    if path is not None:
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=150)
        atomic.write_bytes(path, buffer.getvalue())
    return fig
