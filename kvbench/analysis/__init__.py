"""Stored runs into pandas tables and figures.

``frame.load_frame`` (one row per sample per run), ``tables`` (means, paired comparisons, cliffs),
``figures`` (cliff map, memory against quality), ``units`` (one task/model/experiment with its
plan), ``claims`` (the paper-claims register), ``papers`` (each paper's own tables, published beside
measured); ``niah`` and ``hitrate`` hold the NIAH and hit-rate tables and figures.
"""

from kvbench.analysis.frame import load_frame
from kvbench.analysis.runs import load_runs, load_samples

__all__ = ["load_frame", "load_runs", "load_samples"]
