"""Execute the notebooks headless and write what they show: each PNG figure output as
``OUT/<notebook>.png`` (``_2``, ``_3``... for further figures) and each markdown output (tables) as
``OUT/<notebook>.md``.

    python scripts/make_figures.py                         # the committed archives -> results/figures
    python scripts/make_figures.py --results results/runs --out /tmp/figs        # run folders instead
    python scripts/make_figures.py --notebooks cliff_map claims_table

The notebooks read the committed archives (``../results``) or ``KVBENCH_RESULTS`` (set from
``--results``: archives or run folders alike, through ``kvbench.analysis.load_results``) and run
with ``notebooks/`` as their working directory, as in Jupyter. A notebook that fails is reported
in one line and the others still run; the exit status is 1 when any failed.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"


def outputs_of(nb) -> tuple[list[bytes], list[str], list[str]]:
    """The PNG images, markdown texts and printed lines a notebook produced, in cell order."""
    pngs, texts, printed = [], [], []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stdout":
                printed += [line for line in out.get("text", "").splitlines() if line.strip()]
            data = out.get("data", {})
            if "image/png" in data:
                pngs.append(base64.b64decode(data["image/png"]))
            if "text/markdown" in data:
                texts.append(data["text/markdown"])
    return pngs, texts, printed


def run_notebook(path: Path, out: Path, timeout: int) -> tuple[list[Path], list[str]]:
    """Execute one notebook; write its figures and tables under ``out``; return the paths written
    and the lines it printed."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    pngs, texts, printed = outputs_of(nb)
    written = []
    for i, png in enumerate(pngs):
        target = out / (f"{path.stem}.png" if i == 0 else f"{path.stem}_{i + 1}.png")
        target.write_bytes(png)
        written.append(target)
    if texts:
        target = out / f"{path.stem}.md"
        target.write_text("\n\n".join(t.rstrip() for t in texts) + "\n")
        written.append(target)
    return written, printed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--results",
        help="a results/ folder of archives or a folder of runs (default: the notebooks' own, ../results)",
    )
    parser.add_argument(
        "--out", default=str(REPO / "results" / "figures"), help="where the PNGs and tables go"
    )
    parser.add_argument(
        "--notebooks", nargs="*", help="notebook names (default: every notebook in notebooks/)"
    )
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args(argv)

    results = Path(args.results).resolve() if args.results else None
    if results is not None and not results.is_dir():
        print(f"make_figures: error: --results={args.results}: no such directory", file=sys.stderr)
        return 2
    names = args.notebooks or sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    unknown = [n for n in names if not (NOTEBOOKS / f"{n}.ipynb").is_file()]
    if unknown:
        known = ", ".join(sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb")))
        print(
            f"make_figures: error: --notebooks={','.join(unknown)}: known notebooks: {known}", file=sys.stderr
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # The kernel inherits this process's environment, and imports this checkout's kvbench (the one
    # the notebooks sit in) even where another is installed.
    if results is not None:
        os.environ["KVBENCH_RESULTS"] = str(results)
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    failed = 0
    for name in names:
        try:
            written, printed = run_notebook(NOTEBOOKS / f"{name}.ipynb", out, args.timeout)
        except CellExecutionError as err:
            failed += 1
            last = [line for line in str(err).strip().splitlines() if line.strip()][-1]
            print(f"{name}: failed: {last}")
            continue
        shown = (
            ", ".join(str(p) for p in written)
            if written
            else f"nothing to show ({printed[-1] if printed else ''})"
        )
        print(f"{name}: {shown}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
