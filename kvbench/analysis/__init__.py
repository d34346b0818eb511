"""Stored runs into pandas tables and figures.

``load.load_results`` (every stored sample, from the committed archives or run folders alike, one
typed DataFrame), ``frame.load_frame`` (one row per sample per run folder), ``tables`` (means,
paired comparisons, cliffs), ``figures`` (cliff map, memory against quality), ``units`` (one
task/model/experiment with its plan), ``claims`` (the paper-claims register), ``papers`` (the
paper files' loader and each paper's own tables, published beside measured); ``niah`` and
``hitrate`` hold the NIAH and hit-rate tables and figures.
"""

from kvbench.analysis.frame import load_frame
from kvbench.analysis.load import NoResultsWarning, load_experiments, load_results
from kvbench.analysis.runs import load_runs, load_samples

__all__ = ["NoResultsWarning", "load_experiments", "load_frame", "load_results", "load_runs", "load_samples"]
