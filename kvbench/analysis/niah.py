"""Needle-in-a-Haystack results as the papers show them: a depth x context-length heatmap per method
(Kamradt's figure; SpeCache Fig. 4, OTT Figs. 9-10) and the same numbers as tables.

Input is NIAH sample rows (``samples.jsonl`` rows, or :func:`kvbench.analysis.load_samples`'s
frame): each has ``method``, ``context_length``, ``depth`` and ``score`` (in [0, 1]), and usually
``seed``. A cell is the mean score over every row in it (all seeds pooled), so with S seeds a cell
holds S samples; ``n`` tables count them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import pandas as pd

COLUMNS = ("method", "context_length", "depth")


def niah_frame(rows: pd.DataFrame | Iterable[dict[str, Any]], metric: str = "score") -> pd.DataFrame:
    """The NIAH rows as a frame with ``method``, ``context_length`` (int), ``depth`` (float) and
    ``metric``; rows of other tasks (no context length or depth) and rows without the metric are left out."""
    frame = rows.copy() if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    missing = [c for c in (*COLUMNS, metric) if c not in frame.columns]
    if missing:
        raise ValueError(f"NIAH rows need the columns {', '.join(missing)}")
    if "task" in frame.columns:
        frame = frame[frame["task"].isna() | (frame["task"] == "niah")]
    frame = frame.dropna(subset=[*COLUMNS, metric]).copy()
    frame["context_length"] = frame["context_length"].astype(int)
    frame["depth"] = frame["depth"].astype(float)
    frame[metric] = frame[metric].astype(float)
    return frame


def niah_table(
    rows: pd.DataFrame | Iterable[dict[str, Any]], method: str, metric: str = "score", stat: str = "mean"
) -> pd.DataFrame:
    """One method's grid: rows are depths (ascending, 0 = document start), columns context lengths
    (ascending), cells the ``stat`` (``mean`` or ``count``) of ``metric`` over the rows in the cell."""
    frame = niah_frame(rows, metric)
    frame = frame[frame["method"] == method]
    if frame.empty:
        raise ValueError(f"no NIAH rows for method {method!r}")
    table = frame.pivot_table(index="depth", columns="context_length", values=metric, aggfunc=stat)
    return table.sort_index().sort_index(axis=1)


def niah_summary(rows: pd.DataFrame | Iterable[dict[str, Any]], metric: str = "score") -> pd.DataFrame:
    """One row per method: the mean over the whole grid, the sample count, the number of seeds and
    the mean per context length (``L<n>`` columns), in the methods' order of appearance."""
    frame = niah_frame(rows, metric)
    out = []
    for method, group in frame.groupby("method", sort=False):
        line = {"method": method, metric: group[metric].mean(), "n": len(group)}
        if "seed" in group.columns:
            line["seeds"] = group["seed"].nunique()
        for length, cell in sorted(group.groupby("context_length")):
            line[f"L{length}"] = cell[metric].mean()
        out.append(line)
    return pd.DataFrame(out).set_index("method")


# Perceptually uniform and readable with the common colour-vision deficiencies (and in greyscale).
HEATMAP_CMAP = "cividis"


def niah_heatmap(
    rows: pd.DataFrame | Iterable[dict[str, Any]],
    methods: Sequence[str] | None = None,
    metric: str = "score",
    annotate: bool = True,
):
    """A matplotlib Figure with one depth x length heatmap per method (same colour scale, 0..1,
    dark = needle missed, light = found: cividis, which reads the same to colour-blind eyes and in
    greyscale, where a red-green map does not), each titled with the method and its grid mean."""
    import matplotlib.pyplot as plt  # the caller's backend: a report saves, a notebook shows

    frame = niah_frame(rows, metric)
    methods = list(methods) if methods is not None else list(dict.fromkeys(frame["method"]))
    if not methods:
        raise ValueError("no NIAH rows to plot")
    fig, axes = plt.subplots(
        1, len(methods), figsize=(3.2 * len(methods) + 1.2, 3.4), squeeze=False, constrained_layout=True
    )
    image = None
    for ax, method in zip(axes[0], methods, strict=True):
        table = niah_table(frame, method, metric)
        image = ax.imshow(table.to_numpy(), cmap=HEATMAP_CMAP, vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(table.shape[1]), [str(c) for c in table.columns], rotation=45)
        ax.set_yticks(range(table.shape[0]), [f"{d:g}" for d in table.index])
        ax.set_xlabel("context length (tokens)")
        ax.set_title(f"{method}\nmean {frame.loc[frame['method'] == method, metric].mean():.2f}")
        if annotate and table.size <= 400:
            for i in range(table.shape[0]):
                for j in range(table.shape[1]):
                    value = table.iat[i, j]
                    if pd.notna(value):  # light text on the dark end of the map
                        colour = "white" if value < 0.5 else "black"
                        ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=7, color=colour)
    axes[0][0].set_ylabel("needle depth (%)")
    fig.colorbar(image, ax=axes[0].tolist(), label=metric)
    return fig
