"""``python -m kvbench.report DIR``: tables, statistics and figures from the runs stored under DIR.

    python -m kvbench.report results/runs                 # -> results/runs/report/
    python -m kvbench.report results/semkv_cliff --out /tmp/rep --resamples 2000
    python -m kvbench.report --claims [--model NAME]      # claim verdicts -> results/claims/<model>.md
    python -m kvbench.report --archive results/runs       # runs -> results/<experiment>/samples.csv.gz
    python -m kvbench.report --regenerate                 # make results: everything from the archives
    python -m kvbench.report --paper kivi                 # published beside measured -> results/papers/

Every run under DIR (searched recursively) is read into one sample frame
(``kvbench.analysis.frame.load_frame``) and split into analysis units, one per (task, model,
experiment). Each unit follows its experiment's ``analysis`` plan from ``config.json`` (reference,
metric, alpha, margin; defaults: fp16, the task's primary metric, 0.05, no margin) and gets, under
``OUT/<task>_<model>[_<experiment>]/``:

- ``means.md/.csv``: per configuration, mean with bootstrap CI, effective bits, runaway rate;
- ``paired.md/.csv``: each configuration against the reference, paired by (sample_id, seed): mean
  difference with paired-bootstrap CI, sign-flip p, Holm-adjusted p, TOST at the margin, McNemar
  for binary metrics, verdict;
- ``cliff.md/.csv``: the cliff bracket of each method family with a bit grid;
- ``cliff_map.png``, ``memory_quality.png``, and the figures the unit's task declares
  (``Task.figures``: NIAH's heatmap, the PG-19 hit-rate curves; skipped with a note when a
  declared function is not available).

``OUT/report.md`` gathers the plan, every table and the figure list; ``OUT/samples.csv`` is the
whole frame. Bad input (no such DIR, no runs in it) prints one line and exits with status 2.

``--archive RUNS`` stores each experiment's sample frame as ``results/<experiment>/samples.csv.gz``
(``kvbench.analysis.archive``). ``--regenerate`` (``make results``) rewrites, from those archives
and without a model, each experiment's report under ``results/<experiment>/`` and the claim
verdicts ``results/claims/<model>.md``; ``--claims`` computes and prints the verdicts only
(``kvbench.analysis.claims``). Both read run folders instead with ``--runs DIR``: the outputs are the
same bytes either way.

``--results`` defaults to the checkout's ``results/`` when kvbench runs from a source checkout, and
to ``./results`` otherwise (an installed package: point ``--results`` at a checkout's ``results/``
to read its committed archives). The papers, their tables and their claims are the package's
``kvbench/papers/<paper>.yaml`` (``kvbench.analysis.papers``; ``--declarations DIR``: another folder
of paper files). The rule lives in :mod:`kvbench.paths`.

The package, one job per module: :mod:`~kvbench.report.runs` (the report of run folders: each
analysis unit's tables and figures, ``report.md``), :mod:`~kvbench.report.claims` (the claim
verdict pages), :mod:`~kvbench.report.papers` (each paper's page and the README's results section),
:mod:`~kvbench.report.regenerate` (everything under ``results/`` from the frames),
:mod:`~kvbench.report.archives` (``--archive`` and ``--compare``), :mod:`~kvbench.report.cli` (the
command line), :mod:`~kvbench.report.output` (what they share: the error of bad input, file names,
table files). Every name is importable from ``kvbench.report``.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # before anything below imports pyplot

from kvbench.report.claims import (  # noqa: E402
    CONF,
    check_models,
    claims_markdown,
    claims_results,
    models_markdown,
    write_claims,
)
from kvbench.report.cli import DEFAULT_RESULTS, main  # noqa: E402
from kvbench.report.output import ReportError  # noqa: E402
from kvbench.report.papers import (  # noqa: E402
    README_BEGIN,
    README_END,
    paper_markdown,
    readme_block,
    write_papers,
    write_readme_block,
)
from kvbench.report.regenerate import regenerate  # noqa: E402
from kvbench.report.runs import (  # noqa: E402
    build_report,
    modified_checkout_runs,
    report_unit,
    task_figures,
    write_report,
)

__all__ = [
    "CONF",
    "DEFAULT_RESULTS",
    "README_BEGIN",
    "README_END",
    "ReportError",
    "build_report",
    "check_models",
    "claims_markdown",
    "claims_results",
    "main",
    "models_markdown",
    "modified_checkout_runs",
    "paper_markdown",
    "readme_block",
    "regenerate",
    "report_unit",
    "task_figures",
    "write_claims",
    "write_papers",
    "write_readme_block",
    "write_report",
]
