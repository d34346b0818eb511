"""What the report's page writers share: the error of bad input, a file name made of parts, and a
table written as ``.csv`` and ``.md``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd

from kvbench import atomic
from kvbench.analysis import tables


class ReportError(Exception):
    """Bad input to the report: printed as one line, exit status 2."""


def slug(*parts: Any) -> str:
    return "_".join(re.sub(r"[^\w.-]+", "-", str(p)) for p in parts if p)


def write_table(table: pd.DataFrame, path_stem: Path) -> None:
    atomic.write_text(path_stem.with_suffix(".csv"), table.to_csv(index=False))
    atomic.write_text(path_stem.with_suffix(".md"), tables.to_markdown(table))
