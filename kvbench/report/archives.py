"""``--archive`` and ``--compare``: each experiment's per-sample archive written from run folders
(``results/<experiment>/samples.csv.gz``, :mod:`kvbench.analysis.archive`), and run folders checked
against the committed archives, sample by sample."""

from __future__ import annotations

from pathlib import Path

from kvbench.report.output import ReportError


def archive(runs: str, results: Path, say=print, add: bool = False) -> int:
    """Write the archives of the runs under ``runs`` into ``results``; the exit status. ``add``:
    the runs join each archive's stored runs (``kvbench.analysis.archive.add_runs``) instead of
    replacing their models' rows."""
    from kvbench.analysis.archive import write_archives

    if not Path(runs).is_dir():
        raise ReportError(f"--archive={runs}: no such directory")
    written = write_archives(runs, results, add=add)
    if not written:
        raise ReportError(f"--archive={runs}: no runs found")
    for path in written.values():
        say(f"archive: {path} ({path.stat().st_size} bytes)")
    return 0


def compare(runs: str, results: Path, say=print) -> int:
    """Compare the runs under ``runs`` with the archives under ``results``; the exit status: 1 when
    a row is missing from the archives or differs in a measured column."""
    from kvbench.analysis.archive import compare_runs
    from kvbench.results import format_table

    if not Path(runs).is_dir():
        raise ReportError(f"--compare={runs}: no such directory")
    table = compare_runs(runs, results)
    if table.empty:
        raise ReportError(f"--compare={runs}: no runs found")
    say(format_table(table.to_dict("records")))
    bad = table[(table["archived"] < table["rows"]) | (table["identical"] < table["rows"])]
    rows, same = int(table["rows"].sum()), int(table["identical"].sum())
    say(f"compare: {same} of {rows} rows identical to the archives in every measured column")
    return 1 if len(bad) else 0
