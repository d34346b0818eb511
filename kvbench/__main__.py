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
    main()
