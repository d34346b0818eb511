"""The experiment nodes ``python -m kvbench.reproduce`` runs, and each profile's variant of a node
(``conf/experiment/<profile>/NAME.yaml``; the package docstring says what the profiles are)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvbench.paths import CONF_DIR

PROFILES = ("cpu", "strong", "paper")
# The folder under conf/experiment holding each profile's variants; None: the node itself.
VARIANT_FOLDER = {"cpu": None, "strong": "strong", "paper": "paper"}
# Profiles whose variants exist for some nodes only: the others are left out, not failed.
PARTIAL_PROFILES = ("strong",)


class ReproduceError(Exception):
    """Bad arguments: printed as one line, exit status 2."""


# ------------------------------------------------------------------------------------------ nodes


def discover(conf_dir: str | Path = CONF_DIR) -> list[str]:
    """Every experiment node: ``conf/experiment/*.yaml`` (not the sub-folders: arms, variants)."""
    return sorted(p.stem for p in (Path(conf_dir) / "experiment").glob("*.yaml"))


def select(nodes: Sequence[str], only: Sequence[str] | None, skip: Sequence[str] | None) -> list[str]:
    """``nodes`` restricted to ``only`` (in the conf folder's order) and without ``skip``; an unknown
    name in either is a ReproduceError listing the known nodes."""
    for flag, names in (("--only", only), ("--skip", skip)):
        unknown = [n for n in names or [] if n not in nodes]
        if unknown:
            raise ReproduceError(
                f"{flag}: unknown node {', '.join(unknown)}; known nodes: {', '.join(nodes)}"
            )
    chosen = [n for n in nodes if not only or n in only]
    return [n for n in chosen if n not in (skip or [])]


def profile_nodes(
    nodes: Sequence[str], profile: str, only: Sequence[str] | None, conf_dir: str | Path = CONF_DIR
) -> list[str]:
    """``nodes`` that ``profile`` runs: all of them, except under a profile whose variants exist for
    some nodes only (``strong``), where a node without one is left out unless ``--only`` names it
    (then it fails with the file to add)."""
    folder = VARIANT_FOLDER[profile]
    if profile not in PARTIAL_PROFILES or folder is None:
        return list(nodes)
    return [
        n
        for n in nodes
        if (only and n in only) or (Path(conf_dir) / "experiment" / folder / f"{n}.yaml").is_file()
    ]


def config_name(node: str, profile: str, conf_dir: str | Path = CONF_DIR) -> str:
    """The ``+experiment=`` choice of ``node`` under ``profile``: ``NAME`` or ``paper/NAME``.
    ValueError (one line) when the profile's variant does not exist."""
    folder = VARIANT_FOLDER[profile]
    if folder is None:
        return node
    path = Path(conf_dir) / "experiment" / folder / f"{node}.yaml"
    if not path.is_file():
        raise ValueError(f"no {profile} setting: add conf/experiment/{folder}/{node}.yaml")
    return f"{folder}/{node}"
