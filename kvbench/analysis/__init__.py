"""Stored runs into pandas tables and figures."""

from kvbench.analysis.runs import load_runs, load_samples

__all__ = ["load_runs", "load_samples"]
