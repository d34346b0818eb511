"""``python -m kvbench``: the Hydra entry.

    python -m kvbench                                  # FP16 baseline, default model and task
    python -m kvbench +method=kivi bits=2              # one method, one bit width
    python -m kvbench -m +method=uniform,kivi bits=2,4 # a sweep (Hydra multirun)

User errors (unknown names, bad values, missing data) print one line naming the key and exit 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from kvbench.errors import ConfigError

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
CHECKED_GROUPS = ("model", "task", "method")


def check_group_choices(argv: list[str]) -> None:
    """Reject an unknown ``model=``/``task=``/``+method=`` choice with one line before Hydra
    composes (Hydra's own message spans a dozen lines)."""
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in CHECKED_GROUPS:
            continue
        folder = Path(CONF_DIR) / key
        known = sorted(p.stem for p in folder.glob("*.yaml"))
        for choice in value.split(","):
            if choice not in known:
                raise ConfigError(key, choice, f"known {key} nodes: {', '.join(known)}")


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from kvbench.run import execute, format_table, summary_line

    try:
        metrics = execute(cfg)
    except ConfigError as err:
        print(f"kvbench: error: {err}", file=sys.stderr)
        sys.exit(2)
    print(format_table([summary_line(metrics)]))
    print(f"results: {metrics['folder']}")


if __name__ == "__main__":
    try:
        check_group_choices(sys.argv[1:])
    except ConfigError as err:
        print(f"kvbench: error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
