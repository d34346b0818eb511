"""NIAH heatmap and tables (kvbench/analysis/niah.py) on hand-made rows with hand-computed means."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from kvbench.analysis.niah import niah_frame, niah_heatmap, niah_summary, niah_table


def row(method, length, depth, score, seed=0):
    return {
        "task": "niah",
        "method": method,
        "context_length": length,
        "depth": depth,
        "score": score,
        "seed": seed,
    }


ROWS = [
    # fp16: two seeds per cell
    row("fp16", 1024, 0, 1.0, 0),
    row("fp16", 1024, 0, 2 / 3, 1),
    row("fp16", 1024, 100, 1.0, 0),
    row("fp16", 1024, 100, 1.0, 1),
    row("fp16", 2048, 0, 1 / 3, 0),
    row("fp16", 2048, 0, 0.0, 1),
    row("fp16", 2048, 100, 1.0, 0),
    row("fp16", 2048, 100, 2 / 3, 1),
    # kivi-1b: one seed, one cell missing
    row("kivi-1b", 1024, 0, 0.0),
    row("kivi-1b", 1024, 100, 1.0),
    row("kivi-1b", 2048, 100, 1 / 3),
    # another task's row is ignored
    {"task": "perplexity", "method": "fp16", "ppl": 12.0},
]


def test_pivot_cells_are_the_hand_computed_means():
    table = niah_table(ROWS, "fp16")
    assert list(table.index) == [0.0, 100.0] and list(table.columns) == [1024, 2048]
    expected = [[(1 + 2 / 3) / 2, (1 / 3 + 0) / 2], [1.0, (1 + 2 / 3) / 2]]
    np.testing.assert_allclose(table.to_numpy(), expected)
    counts = niah_table(ROWS, "fp16", stat="count")
    assert counts.to_numpy().tolist() == [[2, 2], [2, 2]]


def test_missing_cell_stays_empty():
    table = niah_table(ROWS, "kivi-1b")
    assert table.loc[0.0, 1024] == 0.0 and table.loc[100.0, 2048] == pytest.approx(1 / 3)
    assert math.isnan(table.loc[0.0, 2048])


def test_summary_means_counts_and_per_length():
    summary = niah_summary(pd.DataFrame(ROWS))
    assert list(summary.index) == ["fp16", "kivi-1b"]
    fp16 = summary.loc["fp16"]
    assert fp16["score"] == pytest.approx((1 + 2 / 3 + 1 + 1 + 1 / 3 + 0 + 1 + 2 / 3) / 8)
    assert (fp16["n"], fp16["seeds"]) == (8, 2)
    assert fp16["L1024"] == pytest.approx((1 + 2 / 3 + 1 + 1) / 4)
    assert summary.loc["kivi-1b", "L2048"] == pytest.approx(1 / 3)


def test_heatmap_draws_each_methods_pivot():
    fig = niah_heatmap(ROWS)
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert [ax.get_title().split("\n")[0] for ax in panels] == ["fp16", "kivi-1b"]
    for ax, method in zip(panels, ["fp16", "kivi-1b"], strict=True):
        shown = np.ma.filled(ax.get_images()[0].get_array(), np.nan)
        np.testing.assert_allclose(shown, niah_table(ROWS, method).to_numpy())
        assert ax.get_images()[0].get_clim() == (0.0, 1.0)
        # colour-blind safe: lightness rises monotonically from missed to found (no red-green map)
        cmap = ax.get_images()[0].get_cmap()
        grey = [0.299 * r + 0.587 * g + 0.114 * b for r, g, b, _ in cmap(np.linspace(0, 1, 32))]
        assert cmap.name == "cividis" and all(b > a for a, b in zip(grey[:-1], grey[1:], strict=True))
    assert panels[1].get_title().endswith(f"mean {(0 + 1 + 1 / 3) / 3:.2f}")


def test_rows_without_the_grid_columns_are_an_error():
    with pytest.raises(ValueError, match="depth"):
        niah_frame([{"method": "fp16", "context_length": 1024, "score": 1.0}])
    with pytest.raises(ValueError, match="no NIAH rows for method 'h2o'"):
        niah_table(ROWS, "h2o")
