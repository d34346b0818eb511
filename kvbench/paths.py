"""Where kvbench finds the files it reads, and the rules for the folders it writes.

- :data:`CONF_DIR`: the Hydra config tree (model, task, method, experiment, logger and launcher
  nodes) ships inside the package as ``kvbench/conf``, so an installed kvbench (``pip install .``,
  editable or not) composes the same configs as a checkout, from any working directory.
- :data:`PAPERS_DIR`: the seed papers, one ``<paper>.yaml`` each (identity, tables, claims;
  ``kvbench.analysis.papers``), also inside the package: they are declarations, like the nodes,
  and an installed kvbench renders the same pages from them.
- :func:`default_results`: the results folder that holds what is committed (the per-experiment
  archives ``<experiment>/samples.csv.gz``) and where ``kvbench.report`` writes its tables. The
  rule: when kvbench is imported from a source checkout (the package folder sits next to a
  ``pyproject.toml`` and a ``results/`` folder), the checkout's ``results/``, wherever the command
  runs; otherwise ``results/`` under the current directory, which for an installed package is the
  user's own folder: give ``--results DIR`` (a checkout's ``results/``) to read the committed
  archives from elsewhere. What runs write (``output.root``, default ``results/runs``) is
  relative to the current directory either way.
- :func:`safe_component`, :func:`check_inside`, :func:`check_writable_folder`: the checks every
  folder kvbench writes passes (a name that becomes a folder is one safe name; a write lands inside
  the output root, the cache or the folder the user named).
- :func:`cache_dir`: kvbench's cache (``$KVBENCH_CACHE_DIR``, else ``~/.cache/kvbench``).
- :func:`user_config_dirs`: the user's own config nodes, searched after :data:`CONF_DIR`:
  ``./conf`` in the working directory, ``conf/`` beside the checkout kvbench is imported from, and
  each folder of ``$KVBENCH_CONFIG_PATH`` (``os.pathsep``-separated). ``conf/model/my-llama.yaml``
  there is ``model=my-llama``, as a shipped node would be; a shipped node of the same name wins.
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path
from typing import Any

from kvbench.errors import ConfigError

PACKAGE_DIR = Path(__file__).resolve().parent
CONF_DIR = PACKAGE_DIR / "conf"
PAPERS_DIR = PACKAGE_DIR / "papers"


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


# --- names that become folders, and the folders kvbench writes -------------------------------------
#
# Every value that becomes a path component (the model's name, the task's and method's labels, the
# run id, the folder a GGUF converts into) is one safe folder name: a name with a separator, ``..``
# or an absolute path would put the folder somewhere else, and the conversion cache would then
# replace whatever sits there. A leading dot is refused as well: kvbench keeps its own locks,
# temporary and stale folders under dotted names beside the folders it files results under.

SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
SAFE_NAME_MAX = 128  # well under the 255 bytes a file system allows for one name, prefixes included
SAFE_NAME_RULE = (
    f"one folder name of at most {SAFE_NAME_MAX} letters, digits, '.', '_' or '-', not starting with '.' "
    "(no '/', no '..', not empty): it becomes a folder name"
)


def safe_component(key: str, value: Any) -> str:
    """``value`` when it is a safe single folder name (:data:`SAFE_NAME_RULE`), else a ConfigError
    naming ``key``."""
    if not isinstance(value, str) or len(value) > SAFE_NAME_MAX or not SAFE_NAME.fullmatch(value):
        raise ConfigError(key, value, SAFE_NAME_RULE)
    return value


def check_inside(path: str | os.PathLike[str], root: str | os.PathLike[str], key: str, value: Any) -> Path:
    """``path`` when it resolves inside ``root`` (or is ``root``), else a ConfigError naming ``key``.

    Both are resolved, symbolic links included: a link inside the root that points elsewhere would
    let a write land outside it as surely as a ``..`` would."""
    resolved, base = Path(path).expanduser().resolve(), Path(root).expanduser().resolve()
    if resolved != base and base not in resolved.parents:
        raise ConfigError(
            key, value, f"{path} resolves to {resolved}, outside {base}; kvbench writes only inside it"
        )
    return Path(path)


def check_writable_folder(
    key: str, value: Any, folder: str | os.PathLike[str], what: str = "a folder kvbench can create and write"
) -> None:
    """``folder`` exists as a folder kvbench can write, or can be created. Probed by making and
    removing a temporary folder in its nearest existing ancestor: permission bits say yes to root on
    read-only mounts (/sys)."""
    path = Path(folder).expanduser()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(key, value, f"{what}; {existing} is a file")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".kvbench-probe-", dir=existing))
    except OSError as err:
        raise ConfigError(key, value, f"{what}; {existing}: {err.strerror}") from None


# --- kvbench's cache --------------------------------------------------------------------------------

CACHE_ENV = "KVBENCH_CACHE_DIR"


def cache_dir() -> Path:
    """kvbench's cache root: ``$KVBENCH_CACHE_DIR`` (empty counts as unset), else ``~/.cache/kvbench``.
    A ConfigError naming the variable when it names a file."""
    raw = os.environ.get(CACHE_ENV)
    if not raw:
        return Path.home() / ".cache" / "kvbench"
    path = Path(raw).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(
            CACHE_ENV, raw, "a folder for kvbench's cache (converted models, data); this is a file"
        )
    return path


def check_cache_writable() -> None:
    """The cache can be written (a conversion is about to happen there): one line naming
    ``KVBENCH_CACHE_DIR`` otherwise."""
    root = cache_dir()
    what = "a folder kvbench can create and write its cache in (a model is converted into it)"
    check_writable_folder(CACHE_ENV, os.environ.get(CACHE_ENV) or str(root), root, what)


# --- the user's own config nodes ------------------------------------------------------------------

CONFIG_PATH_ENV = "KVBENCH_CONFIG_PATH"


def user_config_dirs(strict: bool = True) -> list[Path]:
    """The folders of the user's own config nodes, in search order, each once: ``./conf``, the
    checkout's ``conf/`` (when they are folders), then every entry of ``$KVBENCH_CONFIG_PATH``.
    ``strict``: an entry of the variable that is not a folder is a ConfigError naming the variable
    (else it is skipped: Hydra's search path plugin must not fail where the CLI reports it)."""
    found: list[Path] = []
    candidates = [Path.cwd() / "conf"]
    checkout = source_checkout()
    if checkout is not None:
        candidates.append(checkout / "conf")
    candidates = [c for c in candidates if c.is_dir()]
    raw = os.environ.get(CONFIG_PATH_ENV) or ""
    for entry in filter(None, raw.split(os.pathsep)):
        path = Path(entry).expanduser()
        if not path.is_dir():
            if strict:
                why = "is a file" if path.exists() else "does not exist"
                raise ConfigError(
                    CONFIG_PATH_ENV, raw, f"folders of config nodes, joined by {os.pathsep!r}; {entry} {why}"
                )
            continue
        candidates.append(path)
    for path in candidates:
        resolved = path.resolve()
        if resolved != CONF_DIR.resolve() and resolved not in found:
            found.append(resolved)
    return found


def shadowed_nodes(strict: bool = True) -> list[tuple[Path, Path]]:
    """``(node, its path under CONF_DIR)`` for each of the user's config nodes that has the group
    and name of a shipped node: Hydra finds the shipped one first (:data:`CONF_DIR` leads the search
    path), so the user's is never read."""
    shadowed = []
    for folder in user_config_dirs(strict):
        for node in sorted(folder.rglob("*.yaml")):
            name = node.relative_to(folder)
            if (CONF_DIR / name).is_file():
                shadowed.append((node, name))
    return shadowed


def config_dirs(strict: bool = True) -> list[Path]:
    """Every folder Hydra composes from: the shipped :data:`CONF_DIR` first, then
    :func:`user_config_dirs`."""
    return [CONF_DIR, *user_config_dirs(strict)]
