"""Report figures (matplotlib): cliff map and memory against quality; the NIAH
heatmap and the hit-rate curves come from ``kvbench.analysis.niah`` and ``kvbench.analysis.hitrate``.

Every function returns a ``matplotlib.figure.Figure`` and never calls ``plt.show``, so notebooks
display it and the report saves it. The module leaves the backend alone (notebooks use their
inline one); ``python -m kvbench.report`` selects Agg before importing it.
"""

from __future__ import annotations

import importlib
import io
import math
from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from kvbench import atomic
from kvbench.analysis.tables import cliff_table


def _errorbar(ax, x, mean, low, high, **kwargs):
    """Error bars from an interval (matplotlib wants distances from the mean, never negative)."""
    mean, low, high = (np.asarray(v, dtype=float) for v in (mean, low, high))
    yerr = np.vstack([np.clip(mean - low, 0, None), np.clip(high - mean, 0, None)])
    yerr = np.nan_to_num(yerr)
    return ax.errorbar(x, mean, yerr=yerr, capsize=3, **kwargs)


def cliff_map(
    means: pd.DataFrame,
    paired: pd.DataFrame,
    reference: str = "fp16",
    metric: str = "score",
    title: str | None = None,
    grid_key: str = "bits",
) -> Figure:
    """Score against code bits (or the plan's other grid key) for every method family with a grid,
    with ``1 - alpha`` bootstrap intervals; the reference's mean and interval as a horizontal band;
    each family's cliff bracket (``locate_cliff`` on the paired verdicts) shaded between the first bad and the
    last ok bit width; the runaway rate against the reference's generations on a second y axis
    (dashed). One legend names every series of both axes and each family's cliff interval.

    ``means`` is ``config_means`` output, ``paired`` is ``paired_table`` output for the same frame.
    """
    fig, ax = plt.subplots(figsize=(7, 4.5))
    twin = ax.twinx()
    x = "bits" if grid_key == "bits" else "grid_value"
    grid = means.dropna(subset=[x])
    cliffs = cliff_table(paired, x).set_index("family") if not paired.empty else pd.DataFrame()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (family, group) in enumerate(grid.groupby("family", sort=True)):
        group = group.sort_values(x)
        color = colors[i % len(colors)]
        _errorbar(
            ax,
            group[x],
            group["mean"],
            group["ci_low"],
            group["ci_high"],
            marker="o",
            color=color,
            label=family,
        )
        if group["runaway_rate"].notna().any():
            twin.plot(
                group[x],
                group["runaway_rate"],
                ls="--",
                marker="x",
                color=color,
                alpha=0.7,
                label=f"{family}: runaway rate (right axis)",
            )
        if family in cliffs.index and cliffs.loc[family, "interval"] is not None:
            lo, hi = cliffs.loc[family, "first_bad"], cliffs.loc[family, "last_ok"]
            # Named in the legend: a label on the plot would cross the reference line at the top or
            # the runaway rate and a collapsed grid's scores at the bottom.
            ax.axvspan(
                lo, hi, color=color, alpha=0.12, label=f"{family}: cliff {cliffs.loc[family, 'interval']}"
            )
    ref = means[means["method"] == reference]
    if not ref.empty:
        r = ref.iloc[0]
        ax.axhline(r["mean"], color="black", lw=1, label=f"{reference} (reference)")
        if not (math.isnan(r["ci_low"]) or math.isnan(r["ci_high"])):
            ax.axhspan(r["ci_low"], r["ci_high"], color="black", alpha=0.08)
    ax.set_xlabel("code bits per value" if grid_key == "bits" else grid_key)
    ax.set_ylabel(f"{metric} (mean, bootstrap CI)")
    twin.set_ylabel("runaway rate vs reference (dashed)")
    twin.set_ylim(-0.02, 1.02)
    # One legend for both axes; upper left is where a cliff map is empty (low bits score low).
    handles, labels = ax.get_legend_handles_labels()
    twin_handles, twin_labels = twin.get_legend_handles_labels()
    ax.legend(handles + twin_handles, labels + twin_labels, loc="upper left", fontsize=8)
    ax.set_title(title or f"Quality against bits: {metric}")
    fig.tight_layout()
    return fig


def memory_quality(
    means: pd.DataFrame, reference: str = "fp16", metric: str = "score", title: str | None = None
) -> Figure:
    """Mean score (with its interval) against effective bits per value (everything held, from the
    per-sample accounting), one point per configuration; the reference as a line. The bits axis is
    logarithmic (base 2), so that 2-, 3- and 4-bit points spread out beside FP16's 16 instead of
    crowding a linear 2-16 axis. The legend names each family; a point is labelled with its grid
    value only (``2b``), where its family has several, so labels stay short and apart."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    pts = means.dropna(subset=["effective_bits"])
    stacked: dict[tuple[float, float], int] = {}
    for family, group in pts.groupby("family", sort=True):
        group = group.sort_values("effective_bits")
        # A family of one configuration is named as its point is (``kivi-1b-specache0``, not the
        # family ``kivi-specache0``); a family of several names the grid values it spans.
        if len(group) == 1:
            name = str(group["method"].iloc[0])
        elif group["bits"].notna().all():
            name = f"{family} ({', '.join(f'{b:g}' for b in sorted(group['bits'].unique()))} bits)"
        else:
            name = str(family)
        _errorbar(
            ax,
            group["effective_bits"],
            group["mean"],
            group["ci_low"],
            group["ci_high"],
            marker="o",
            ls="-" if len(group) > 1 else "none",
            label=name,
        )
        if len(group) == 1 or not group["bits"].notna().all():
            continue  # the legend names the point
        for row in group.itertuples():
            # Points that coincide (two arms at one memory and score) get their labels stacked.
            spot = (round(float(row.effective_bits), 1), round(float(row.mean), 2))
            stacked[spot] = stacked.get(spot, -1) + 1
            ax.annotate(
                f"{row.bits:g}b",
                (row.effective_bits, row.mean),
                fontsize=7,
                xytext=(3, 3 - 9 * stacked[spot]),
                textcoords="offset points",
            )
    ref = means[means["method"] == reference]
    if not ref.empty:
        ax.axhline(ref.iloc[0]["mean"], color="black", lw=1, ls=":", label=f"{reference} mean")
    if not pts.empty:
        ax.set_xscale("log", base=2)
        low, high = float(pts["effective_bits"].min()), float(pts["effective_bits"].max())
        ticks = [t for t in (0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32) if low / 1.2 <= t <= high * 1.2]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.minorticks_off()
    ax.set_xlabel("effective bits per value (all bytes held / values; log scale)")
    ax.set_ylabel(f"{metric} (mean, bootstrap CI)")
    ax.legend(fontsize=8)
    ax.set_title(title or "Memory against quality")
    fig.tight_layout()
    return fig


def optional_figure(spec: str) -> Callable[[pd.DataFrame], Figure] | None:
    """The figure function ``spec`` (``"module:function"``, as a task's ``figures`` declare it), or
    None when that module or function does not exist in this checkout."""
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name != module_name:
            raise
        return None
    func = getattr(module, func_name, None)
    return func if callable(func) else None


def save(fig: Figure, path: str | Path, dpi: int = 120) -> Path:
    """Write ``fig`` as PNG and close it (figures stay open in pyplot's registry otherwise)."""
    path = Path(path)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    return atomic.write_bytes(path, buffer.getvalue())


def show(fig: Figure, dpi: int = 120) -> None:
    """Display ``fig`` once in a notebook, as a PNG image, and close it. Rendering the PNG here works
    whatever backend is active (a module that forces Agg disables the inline backend's display),
    and closing the figure keeps the inline backend from showing it a second time."""
    from IPython.display import Image, display

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    display(Image(data=buffer.getvalue(), format="png"))
