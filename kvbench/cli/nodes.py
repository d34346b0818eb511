"""The config nodes a command line chooses, checked before Hydra composes them.

Config nodes come from the package (``kvbench/conf``) and then from the user's own folders
(``./conf``, the checkout's ``conf/``, ``$KVBENCH_CONFIG_PATH``; :func:`kvbench.paths.user_config_dirs`):
every check here looks in all of them, as Hydra does. An unknown ``model=``/``task=``/``+method=``
choice, and an experiment whose methods or tasks are not available yet (no config node, or not
registered), are one :class:`~kvbench.errors.ConfigError` line each.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from kvbench import paths
from kvbench.errors import ConfigError

CONF_DIR = str(paths.CONF_DIR)
CHECKED_GROUPS = ("model", "task", "method", "experiment")
# Groups whose choices must also be registered in code (a node alone does not make a method run).
REGISTERED_GROUPS = ("task", "method")


def search_dirs(conf_dir: str | Path = CONF_DIR) -> list[Path]:
    """The folders config nodes are looked up in: the shipped ones and the user's
    (:func:`kvbench.paths.config_dirs`) for the default ``conf_dir``, else that folder alone."""
    return paths.config_dirs() if str(conf_dir) == CONF_DIR else [Path(conf_dir)]


def find_node(relative: str, conf_dir: str | Path = CONF_DIR) -> Path | None:
    """The first ``<dir>/<relative>`` file of :func:`search_dirs`, as Hydra would compose it."""
    return next((d / relative for d in search_dirs(conf_dir) if (d / relative).is_file()), None)


def group_options(group: str, conf_dir: str | Path = CONF_DIR) -> list[str]:
    """Every node name of ``group`` across :func:`search_dirs`, sorted."""
    return sorted({p.stem for d in search_dirs(conf_dir) for p in (d / group).glob("*.yaml")})


def check_group_choices(argv: list[str]) -> None:
    """Reject an unknown ``model=``/``task=``/``+method=`` choice with one line before Hydra
    composes (Hydra's own message spans a dozen lines)."""
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if not sep or key not in CHECKED_GROUPS:
            continue
        known = experiment_choices() if key == "experiment" else group_options(key)
        for choice in value.split(","):
            if choice not in known:
                raise ConfigError(key, choice, f"known {key} nodes: {', '.join(known)}")


def experiment_choices(conf_dir: str = CONF_DIR) -> list[str]:
    """Every ``+experiment=`` choice: the nodes ``NAME`` and their profile variants ``PROFILE/NAME``
    (``conf/experiment/paper/NAME.yaml``, see :mod:`kvbench.reproduce`); the arms under ``arms/``
    are method nodes, chosen through ``+experiment/arms/NAME@method``, not experiments."""
    found = {
        p.relative_to(d / "experiment").with_suffix("")
        for d in search_dirs(conf_dir)
        for p in (d / "experiment").rglob("*.yaml")
    }
    return sorted(p.as_posix() for p in found if p.parts[0] != "arms")


def load_experiment(name: str, conf_dir: str = CONF_DIR) -> dict:
    """The node ``conf/experiment/NAME.yaml`` as a plain dict. A profile variant that includes its
    node (``defaults: [/experiment/NODE, ...]``) comes back merged over that node, as Hydra composes
    it: the node's keys, the variant's on top, both defaults lists (the variant's after the node's)."""
    path = find_node(f"experiment/{name}.yaml", conf_dir) or Path(conf_dir) / "experiment" / f"{name}.yaml"
    node = OmegaConf.to_container(OmegaConf.load(path))
    merged: dict = {}
    defaults: list = []
    for entry in node.get("defaults") or []:
        base = entry.strip("/").partition("@")[0] if isinstance(entry, str) else ""
        if base.startswith("experiment/"):
            parent = load_experiment(base.partition("/")[2], conf_dir)
            defaults += parent.pop("defaults", None) or []
            merged = OmegaConf.to_container(OmegaConf.merge(merged, parent))
        else:
            defaults.append(entry)
    own = {k: v for k, v in node.items() if k != "defaults"}
    merged = OmegaConf.to_container(OmegaConf.merge(merged, own))
    return {"defaults": defaults, **merged} if defaults else merged


def _group_choice(key: str) -> str | None:
    """``'override /task'`` / ``'+method'`` / ``'method'`` -> the group name, if it is one we check."""
    key = key.replace("override", "").strip().lstrip("+~/").strip()
    return key if key in REGISTERED_GROUPS else None


def _method_names_in(node) -> set[str]:
    """Every ``name`` of a method node and of the method nodes nested in it (``base``,
    ``matched_memory``, ...)."""
    names = set()
    if isinstance(node, dict):
        if isinstance(node.get("name"), str):
            names.add(node["name"])
        for value in node.values():
            names |= _method_names_in(value)
    return names


def _defaults_choices(node: dict, needs: dict[str, set[str]]) -> None:
    """Add the task/method choices of a defaults list: ``{'override /task': 'niah'}`` entries and
    ``'/method/kivi@_here_'`` strings (how an arm inherits a method node)."""
    for entry in node.get("defaults") or []:
        if isinstance(entry, dict):
            for key, value in entry.items():
                group = _group_choice(str(key))
                if group and isinstance(value, str):
                    needs[group].add(value)
        elif isinstance(entry, str) and "/" in entry.strip("/"):
            group, _, choice = entry.strip("/").partition("@")[0].partition("/")
            if group in REGISTERED_GROUPS:
                needs[group].add(choice)


def experiment_requirements(node: dict, conf_dir: str = CONF_DIR) -> dict[str, set[str]]:
    """The task and method names an experiment node uses: its defaults list, the ``method`` node
    it sets, and the values of its sweep (``+method: a,b``, ``task: x``, ``method.base.name: y``,
    and arms ``+experiment/arms/NAME@method: a,b``: method nodes under conf/experiment/arms/NAME/,
    read for the method they inherit and the method nodes inside them such as ``matched_memory``).
    An arm file that does not exist is reported under the group ``arm``."""
    needs: dict[str, set[str]] = {g: set() for g in (*REGISTERED_GROUPS, "arm")}
    _defaults_choices(node, needs)
    needs["method"] |= _method_names_in(node.get("method"))
    params = ((node.get("hydra") or {}).get("sweeper") or {}).get("params") or {}
    for key, value in params.items():
        key = str(key).lstrip("+~")
        values = {v.strip() for v in str(value).split(",") if v.strip()}
        if key in REGISTERED_GROUPS:
            needs[key] |= values
        elif key.startswith("method.") and key.endswith(".name"):
            needs["method"] |= values
        elif key.endswith("@method"):
            folder = key.partition("@")[0]
            for arm in sorted(values):
                path = find_node(f"{folder}/{arm}.yaml", conf_dir)
                if path is None:
                    needs["arm"].add(f"{folder}/{arm}.yaml")
                    continue
                arm_node = OmegaConf.to_container(OmegaConf.load(path))
                _defaults_choices(arm_node, needs)
                needs["method"] |= _method_names_in(arm_node)
    return needs


def check_experiment(name: str, conf_dir: str = CONF_DIR) -> None:
    """Fail with one line when experiment ``name`` uses a task or method that has no config node or is
    not registered, or when its analysis plan is malformed."""
    from kvbench.methods import METHODS
    from kvbench.results import analysis_plan
    from kvbench.tasks import TASKS

    node = load_experiment(name, conf_dir)
    registered = {"task": set(TASKS.names()), "method": set(METHODS.names())}
    needs = experiment_requirements(node, conf_dir)
    missing = [f"arm conf/{arm} (no such file)" for arm in sorted(needs.pop("arm"))]
    for group, names in needs.items():
        for choice in sorted(names):
            why = []
            if find_node(f"{group}/{choice}.yaml", conf_dir) is None:
                why.append(f"no conf/{group}/{choice}.yaml")
            if choice not in registered[group]:
                why.append("not registered")
            if why:
                missing.append(f"{group} {choice!r} ({', '.join(why)})")
    if missing:
        raise ConfigError("experiment", name, f"needs what does not exist yet: {'; '.join(missing)}")
    if "analysis" not in node:
        raise ConfigError("experiment", name, "the node has no analysis: block (the pre-declared plan)")
    analysis_plan(node["analysis"])


def check_argv(argv: list[str]) -> None:
    check_group_choices(argv)
    for arg in argv:
        key, sep, value = arg.lstrip("+~").partition("=")
        if sep and key == "experiment":
            for choice in value.split(","):
                check_experiment(choice)
