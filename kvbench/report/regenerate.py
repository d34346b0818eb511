"""``--regenerate`` (``make results``): every output under ``results/`` from the experiments' sample
frames, read from the committed archives or from run folders (the same frames give the same bytes)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from kvbench import atomic
from kvbench.paths import PAPERS_DIR
from kvbench.report.claims import CONF, claims_results, models_markdown, write_claims
from kvbench.report.output import ReportError
from kvbench.report.papers import readme_block, write_papers, write_readme_block
from kvbench.report.runs import write_report


def regenerate(
    frames: dict[str, pd.DataFrame],
    results: str | Path,
    declarations: str | Path = PAPERS_DIR,
    models: list[str] | None = None,
    seed: int = 0,
    n_resamples: int = 10_000,
    say=print,
    conf_dir: Path | None = CONF,
) -> list[Path]:
    """Every output under ``results`` from the frames of each experiment: ``<experiment>/report.md``
    with its unit folders (tables, figures), and ``claims/<model>.md`` / ``.csv``. The same frames
    give the same bytes, whether they come from the archives or straight from the run folders.
    ``declarations``: the folder of paper files (identity, tables, claims)."""
    from kvbench.analysis.papers import load_papers

    papers = load_papers(declarations, conf_dir)
    results = Path(results)
    if results.is_dir():
        atomic.remove_stale_temporaries(results)  # what an interrupted run left
    written = []
    for name, frame in sorted(frames.items()):
        try:
            report = write_report(
                frame, results / name, f"`{name}`", seed, n_resamples, say, write_samples=False
            )
        except ReportError as err:
            say(f"note: {err}")
            continue
        written.append(report["out"] / "report.md")
    by_model = claims_results(frames, papers, models, seed, n_resamples, conf_dir)
    written += write_claims(by_model, results / "claims", frames)
    atomic.write_text(results / "claims" / "by_model.md", models_markdown(by_model))
    written.append(results / "claims" / "by_model.md")
    written += write_papers(by_model, frames, results / "papers", seed, n_resamples, papers)
    # the checkout's README shows the claims table and each paper's headline table
    readme = results.parent / "README.md"
    block = readme_block(by_model, frames, seed=seed, n_resamples=n_resamples, papers=papers)
    if write_readme_block(readme, block):
        written.append(readme)
    return written


def experiment_frames(runs: str | None, results: Path) -> dict[str, pd.DataFrame]:
    """The experiments' frames: from the run folders under ``runs`` when given, else from the
    archives under ``results``."""
    from kvbench.analysis.archive import frames_from_runs, load_archives

    if runs is not None:
        if not Path(runs).is_dir():
            raise ReportError(f"--runs={runs}: no such directory")
        return frames_from_runs(runs)
    return load_archives(results)
