"""Where kvbench finds the files it reads.

- :data:`CONF_DIR`: the Hydra config tree (model, task, method, experiment, logger and launcher
  nodes) ships inside the package as ``kvbench/conf``, so an installed kvbench (``pip install .``,
  editable or not) composes the same configs as a checkout, from any working directory.
- :func:`default_results`: the results folder that holds what is committed (``claims.yaml``, the
  per-experiment archives ``<experiment>/samples.csv.gz``) and where ``kvbench.report`` writes its
  tables. The rule: when kvbench is imported from a source checkout (the package folder sits next
  to a ``pyproject.toml`` and a ``results/`` folder), the checkout's ``results/``, wherever the
  command runs; otherwise ``results/`` under the current directory, which for an installed package
  is the user's own folder: give ``--results DIR`` (a checkout's ``results/``) to read the
  committed claims and archives from elsewhere. What runs write (``output.root``, default
  ``results/runs``) is relative to the current directory either way.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CONF_DIR = PACKAGE_DIR / "conf"


def source_checkout() -> Path | None:
    """The checkout kvbench is imported from, or None for an installed package."""
    root = PACKAGE_DIR.parent
    if (root / "pyproject.toml").is_file() and (root / "results").is_dir():
        return root
    return None


def default_results() -> Path:
    """The results folder: the checkout's ``results/`` when run from a checkout, else ``./results``."""
    checkout = source_checkout()
    return checkout / "results" if checkout is not None else Path("results")


def cache_dir() -> Path:
    """kvbench's cache root: ``$KVBENCH_CACHE_DIR``, else ``~/.cache/kvbench`` (converted models,
    fetched data, compiled kernels)."""
    root = os.environ.get("KVBENCH_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvbench"
