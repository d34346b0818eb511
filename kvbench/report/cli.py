"""``python -m kvbench.report``: the command line (the package docstring shows its forms). Bad input
is one line and exit status 2; a failed write names the file, exit status 1."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvbench import atomic
from kvbench.analysis import tables
from kvbench.paths import PAPERS_DIR, default_results
from kvbench.report.archives import archive, compare
from kvbench.report.claims import CONF, check_models, claims_results, write_claims
from kvbench.report.output import ReportError
from kvbench.report.papers import write_papers
from kvbench.report.regenerate import experiment_frames, regenerate
from kvbench.report.runs import build_report

# The checkout's results/ when run from a checkout, else ./results (the rule: kvbench.paths).
DEFAULT_RESULTS = default_results()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvbench.report", description="Tables, statistics and figures from stored runs."
    )
    parser.add_argument(
        "dir", nargs="?", metavar="DIR", help="folder holding run folders (searched recursively)"
    )
    parser.add_argument("--out", help="output folder (default: DIR/report)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the bootstrap and permutation resamples")
    parser.add_argument("--resamples", type=int, default=10_000, help="bootstrap resamples per interval")
    parser.add_argument(
        "--claims",
        action="store_true",
        help="compute every claim's verdict, print the table and write RESULTS/claims/<model>.md",
    )
    parser.add_argument(
        "--model", action="append", help="with --claims / --paper: only this model (repeatable)"
    )
    parser.add_argument(
        "--paper", action="append", help="write RESULTS/papers/<paper>_<model>.md: published beside measured"
    )
    parser.add_argument(
        "--declarations",
        metavar="DIR",
        default=str(PAPERS_DIR),
        help="folder of paper files, <paper>.yaml: identity, tables, claims (default: %(default)s)",
    )
    parser.add_argument(
        "--archive",
        metavar="RUNS",
        help="write RESULTS/<experiment>/samples.csv.gz, each experiment's per-sample archive, from RUNS",
    )
    parser.add_argument(
        "--add",
        action="store_true",
        help="with --archive: add the runs to each archive's runs (new arms of a node whose other runs "
        "are stored only in the archive) instead of replacing their models' rows",
    )
    parser.add_argument(
        "--compare",
        metavar="RUNS",
        help="check the runs under RUNS against the committed archives, sample by sample (exit 1 if any "
        "row is missing from them or differs in a measured column)",
    )
    parser.add_argument(
        "--regenerate",
        action="store_true",
        help="rewrite every table, figure and claim verdict under RESULTS from the archives (make results)",
    )
    parser.add_argument(
        "--runs",
        help="with --claims or --regenerate: read the run folders under RUNS instead of the archives",
    )
    parser.add_argument(
        "--results", default=str(DEFAULT_RESULTS), help="results folder (default: %(default)s)"
    )
    parser.add_argument(
        "--wandb", action="store_true", help="also log the figures and tables to Weights & Biases"
    )
    args = parser.parse_args(argv)
    results = Path(args.results)
    try:
        if args.resamples < 1:
            raise ReportError(f"--resamples={args.resamples}: must be a positive integer")
        if args.add and args.archive is None:
            raise ReportError("--add: only with --archive RUNS")
        if args.archive is not None:
            return archive(args.archive, results, add=args.add)
        if args.compare is not None:
            return compare(args.compare, results)
        if args.regenerate:
            frames = experiment_frames(args.runs, results)
            check_models(frames, args.model)
            paths = regenerate(frames, results, args.declarations, args.model, args.seed, args.resamples)
            for path in paths:
                print(f"wrote: {path}")
            return 0
        if args.paper:
            from kvbench.analysis.papers import load_papers

            papers = load_papers(args.declarations, CONF)
            known = {p.id: p for p in papers}
            for name in args.paper:
                if name not in known:
                    raise ReportError(f"--paper={name}: no such paper; papers: {', '.join(known)}")
            frames = experiment_frames(args.runs, results)
            check_models(frames, args.model)
            by_model = claims_results(frames, papers, args.model, args.seed, args.resamples)
            chosen = [known[name] for name in args.paper]
            for path in write_papers(by_model, frames, results / "papers", args.seed, args.resamples, chosen):
                print(path.read_text())
                print(f"wrote: {path}")
            return 0
        if args.claims:
            from kvbench.analysis.claims import claims_table, verdict_counts

            frames = experiment_frames(args.runs, results)
            check_models(frames, args.model)
            by_model = claims_results(frames, args.declarations, args.model, args.seed, args.resamples)
            for model, claim_results in by_model.items():
                print(f"## {model}\n")
                print(tables.to_markdown(claims_table(claim_results)), end="")
                print("\n" + verdict_counts(claim_results) + "\n")
            for path in write_claims(by_model, results / "claims", frames):
                print(f"wrote: {path}")
            return 0
        if args.dir is None:
            raise ReportError("DIR=(missing): give a folder of runs, or --claims / --regenerate / --archive")
        result = build_report(args.dir, args.out, args.seed, args.resamples)
    except ReportError as err:
        print(f"kvbench.report: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:  # claims schema errors name the claim and field; damaged archives
        print(f"kvbench.report: error: {err}", file=sys.stderr)
        return 2
    except atomic.WriteError as err:  # a full disk, a read-only folder: the file and the reason
        print(f"kvbench.report: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "kvbench.report: interrupted; each file is either as it was or completely rewritten; "
            "the same command finishes the job",
            file=sys.stderr,
        )
        return 130
    if args.wandb:
        from kvbench.logger import log_report

        log_report(result)
    print(f"report: {result['out'] / 'report.md'}")
    return 0
