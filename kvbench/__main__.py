"""``python -m kvbench``: the Hydra entry.

    python -m kvbench                                  # FP16 baseline, default model and task
    python -m kvbench +method=kivi bits=2              # one method, one bit width
    python -m kvbench -m +method=uniform,kivi bits=2,4 # a sweep (Hydra multirun)

    python -m kvbench -m +experiment=semkv_cliff      # an experiment node: its sweep and analysis plan

User errors (unknown names, bad values, missing data) print one line naming the key and exit 2. An
experiment whose methods or tasks are not available yet (no config node, or not registered) fails
before anything runs, with one line naming what is missing.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from kvbench.errors import ConfigError

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
CHECKED_GROUPS = ("model", "task", "method", "experiment")
# Groups whose choices must also be registered in code (a node alone does not make a method run).
REGISTERED_GROUPS = ("task", "method")


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
            folder = Path(conf_dir) / key.partition("@")[0]
            for arm in sorted(values):
                path = folder / f"{arm}.yaml"
                if not path.is_file():
                    needs["arm"].add(str(path.relative_to(conf_dir)))
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

    node = OmegaConf.to_container(OmegaConf.load(Path(conf_dir) / "experiment" / f"{name}.yaml"))
    registered = {"task": set(TASKS.names()), "method": set(METHODS.names())}
    needs = experiment_requirements(node, conf_dir)
    missing = [f"arm conf/{arm} (no such file)" for arm in sorted(needs.pop("arm"))]
    for group, names in needs.items():
        for choice in sorted(names):
            why = []
            if not (Path(conf_dir) / group / f"{choice}.yaml").is_file():
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


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    from kvbench.run import execute, format_table, summary_line

    try:
        metrics = execute(cfg)
    except ConfigError as err:
        print(f"kvbench: error: {err}", file=sys.stderr)
        sys.exit(2)
    row = summary_line(metrics)
    print(format_table([row]))
    print(f"results: {metrics['folder']}")
    return {**row, "folder": metrics["folder"]}  # a submitit launcher's sweep summary is made of these


if __name__ == "__main__":
    try:
        check_argv(sys.argv[1:])
    except ConfigError as err:
        print(f"kvbench: error: {err}", file=sys.stderr)
        sys.exit(2)
    from kvbench.launchers import register

    register()  # hydra/launcher=submitit_* report a sweep on this terminal (kvbench/launchers.py)
    main()
