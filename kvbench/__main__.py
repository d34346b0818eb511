"""``kvbench`` (the console script) and ``python -m kvbench``: the Hydra entry.

    kvbench                                            # FP16 baseline, default model and task
    kvbench +method=kivi bits=2                        # one method, one bit width
    kvbench -m +method=uniform,kivi bits=2,4           # a sweep (Hydra multirun)
    kvbench -m +experiment=semkv_cliff                 # an experiment node: its sweep and analysis plan
    kvbench -m hydra/sweeper=optuna objective=score 'bits=choice(1,2,3,4)'   # any Hydra sweeper
    eval "$(kvbench -sc install=bash)"                 # Hydra's tab completion, for the console script

Config nodes come from the package (``kvbench/conf``) and then from the user's own folders
(``./conf``, the checkout's ``conf/``, ``$KVBENCH_CONFIG_PATH``; :func:`kvbench.paths.user_config_dirs`):
every check here looks in all of them, as Hydra does.

User errors (unknown names, bad values, missing data) print one line naming the key and exit 2. An
experiment whose methods or tasks are not available yet (no config node, or not registered) fails
before anything runs, with one line naming what is missing.

Before Hydra starts, :func:`preflight` composes every configuration the command asks for (each point
of a sweep) and checks it with :func:`kvbench.run.plan_run`, so a bad value anywhere fails in
seconds, before a model loads or a folder (Hydra's own included) is made. Hydra's composition errors
(an unknown key, an unknown group option, a group given twice) become one line too; ``--verbose`` or
``HYDRA_FULL_ERROR=1`` prints the full detail above it.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import signal
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

import hydra
import yaml
from omegaconf import DictConfig, OmegaConf

from kvbench import paths
from kvbench.atomic import WriteError
from kvbench.config import unknown_key
from kvbench.errors import ConfigError, Interrupted, Terminated

CONF_DIR = str(paths.CONF_DIR)
# Method nodes that experiments choose through ``+experiment/arms/NAME@method``: not for the command
# line, so --help and the choice lists leave them out.
INTERNAL_GROUPS = ("experiment/arms",)
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


# Hydra flags after which no run happens: nothing to check.
NO_RUN_FLAGS = ("help", "hydra_help", "cfg", "info", "shell_completion", "experimental_rerun")


def _override_parts(override: str) -> tuple[str, object]:
    """``(key, value)`` of a command-line override, the value typed as Hydra reads it (``2`` an int)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    key, _, text = override.partition("=")
    try:
        value = OverridesParser.create().parse_override(override).value()
    except Exception:  # not valid syntax: show the text as typed
        value = text
    return key.lstrip("+~"), value


def _known_keys(loader, config_name: str, overrides: list[str], bad_key: str, parent: str) -> list[str]:
    """Keys under ``parent`` in the config composed without the override that failed."""
    from hydra.types import RunMode

    rest = [o for o in overrides if o.partition("=")[0].lstrip("+~") != bad_key]
    try:  # MULTIRUN: a sweep among the other overrides is skipped, not an error
        base = loader.load_configuration(config_name, rest, RunMode.MULTIRUN)
    except Exception:  # the other overrides fail too: no list, the one line still names the key
        return []
    node = OmegaConf.select(base, parent) if parent else base
    return [str(k) for k in node.keys() if k != "hydra"] if OmegaConf.is_dict(node) else []


def hydra_error(err: Exception, loader, config_name: str, overrides: list[str]) -> ConfigError:
    """One ConfigError line for an error Hydra raised while composing."""
    from hydra.errors import MissingConfigException, OverrideParseException

    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, MissingConfigException) and err.options is not None and err.missing_cfg_file:
        group, _, choice = str(err.missing_cfg_file).rpartition("/")
        close = difflib.get_close_matches(choice, list(err.options), n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        return ConfigError(group, choice, f"{hint}known {group} nodes: {', '.join(err.options)}")
    override = re.match(r"Could not override '([^']+)'", first)
    if override:
        key = override.group(1)
        missing = getattr(err.__cause__, "full_key", None) or key
        parent, _, leaf = str(missing).rpartition(".")
        typed = next((o for o in overrides if o.partition("=")[0].lstrip("+~") == key), f"{key}=")
        value = _override_parts(typed)[1]
        if missing == key.split(".")[0] != key and any((d / missing).is_dir() for d in search_dirs()):
            # a key inside a group node that is not there when plain keys are applied
            chosen = next((o for o in overrides if o.partition("=")[0].lstrip("+~") == missing), None)
            if chosen:
                why = f"{missing} comes from the sweep {chosen}, applied after plain keys; write ++{typed}"
            else:
                why = f"there is no {missing} node; choose one first with +{missing}=NAME"
            return ConfigError(key, value, why)
        known = _known_keys(loader, config_name, overrides, key, parent)
        return ConfigError(key, value, unknown_key(leaf, known) if known else "unknown key")
    twice = re.match(r"(\S+) appears more than once in the final defaults list", first)
    if twice:
        group = twice.group(1)
        given = [o for o in overrides if o.partition("=")[0].lstrip("+~") == group]
        return ConfigError(
            group, " ".join(given), f"given more than once; give it once (a sweep: -m {given[0]},...)"
        )
    if isinstance(err, OverrideParseException):
        bad = next((o for o in overrides if not _parses(o)), " ".join(overrides))
        at = overrides.index(bad) if bad in overrides else -1
        if "=" not in bad and at > 0 and "=" in overrides[at - 1]:
            # the shell split an unquoted value with a space into two arguments
            hint = f"; a value with spaces goes in quotes: '{overrides[at - 1]} {bad}'"
        else:
            hint = "; quote a value holding spaces or any of ()[]{},=:'\" (KEY='VALUE')"
        return ConfigError(
            _override_parts(bad)[0], _override_parts(bad)[1], f"not valid override syntax: {first}{hint}"
        )
    key = getattr(err, "full_key", None) or "config"
    return ConfigError(str(key), " ".join(overrides), first)


def _parses(override: str) -> bool:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        OverridesParser.create().parse_override(override)
    except Exception:  # any failure is the answer
        return False
    return True


def _compose(loader, config_name: str, overrides: list[str], build) -> DictConfig:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return build()
    except (HydraException, OmegaConfBaseException) as err:
        raise hydra_error(err, loader, config_name, overrides) from err


def job_config(cfg: DictConfig) -> dict:
    """The resolved config a job receives, without the ``hydra`` node (what
    :func:`kvbench.spec.run_config` then completes into the config a run stores and hashes)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf.errors import OmegaConfBaseException

    HydraConfig.instance().set_config(cfg)  # ${hydra:...} interpolations resolve as in the job
    try:
        return {
            k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v
            for k, v in cfg.items()
            if k != "hydra"
        }
    except OmegaConfBaseException as err:
        first = str(err).strip().splitlines()[0]
        raise ConfigError(str(err.full_key or "config"), None, first) from err


# What Hydra leaves in a folder it ran in: a folder holding it is Hydra's own, rerun into.
HYDRA_TRACES = {"hydra.run.dir": ".hydra/config.yaml", "hydra.sweep.dir": "multirun.yaml"}


def check_hydra_dir(master: DictConfig, multirun: bool) -> None:
    """Hydra's output folder (``hydra.run.dir``, or ``hydra.sweep.dir`` for a multirun) must be one
    it can create and write: one line otherwise, before Hydra fails on it with a traceback. One that
    already holds files neither Hydra nor kvbench wrote (a folder of the user's) gets a warning:
    Hydra adds its ``.hydra/`` config and a log there, beside them. The default folders, under
    ``output.root/.hydra/`` (a run) and ``output.root/multirun/<date>/`` (a sweep) and unique per
    process, never exist beforehand."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf.errors import OmegaConfBaseException

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    HydraConfig.instance().set_config(master)
    try:
        value = OmegaConf.select(master, key)
    except OmegaConfBaseException as err:
        raise ConfigError(key, None, str(err).strip().splitlines()[0]) from err
    if value is None:
        return
    folder = Path(str(value)).expanduser()
    paths.check_writable_folder(
        key, value, folder, "a folder Hydra can create and write (its .hydra/ config and log go there)"
    )
    if folder.is_dir() and not (folder / HYDRA_TRACES[key]).exists():
        entries = sum(1 for _ in folder.iterdir())
        if entries:
            print(
                f"kvbench: warning: {key}={value} already holds {entries} entries that Hydra did not write; "
                "Hydra adds .hydra/ and its log beside them (an empty or new folder keeps them apart)",
                file=sys.stderr,
            )


def sweep_points(
    argv_overrides: list[str], config_name: str, multirun: bool, masters: list | None = None
) -> Iterator[tuple[str, dict]]:
    """``(label, config)`` for every job the command would launch: the label names the swept values
    of a sweep point (empty for a single run). Expands a sweep the way Hydra's basic sweeper does,
    the node's own ``hydra.sweeper.params`` first, then the command line. The composed master
    config (with its ``hydra`` node) is appended to ``masters`` when given."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    loader = GlobalHydra.instance().config_loader()
    if not multirun:
        master = _compose(
            loader,
            config_name,
            argv_overrides,
            lambda: loader.load_configuration(config_name, argv_overrides, RunMode.RUN),
        )
        if masters is not None:
            masters.append(master)
        yield "", job_config(master)
        return
    sweep = sweep_jobs(argv_overrides, config_name)
    if sweep is None:
        return  # a sweeper with no search space here (its own plugin logic); each job checks itself
    master, jobs = sweep
    if masters is not None:
        masters.append(master)
    for label, job in jobs:
        cfg = _compose(loader, config_name, job, lambda job=job: loader.load_sweep_config(master, job))
        yield label, job_config(cfg)


# A sampling sweeper's search space up to this many points is checked point by point; a larger one
# value by value (each value of each parameter once), which finds every bad value in seconds.
MAX_SEARCH_POINTS = 256


def _sweep_values(override) -> list[str]:
    """The values a sweep override can take, as override text: every value of a choice or range
    (what any sweeper draws from); an interval's two ends (a continuous search space cannot be
    listed, and its ends are where a bad value such as ``bits=9`` sits)."""
    from hydra.core.override_parser.types import IntervalSweep

    sweep = override.value()
    if not isinstance(sweep, IntervalSweep):
        return list(override.sweep_string_iterator())
    ints = "int" in (sweep.tags or set()) or all(float(v).is_integer() for v in (sweep.start, sweep.end))
    return [str(int(v)) if ints else repr(float(v)) for v in (sweep.start, sweep.end)]


def sweep_jobs(argv_overrides: list[str], config_name: str = "config"):
    """``(master, [(label, overrides), ...])``: the multirun's composed master config and the
    override list of every job it could launch, without composing the jobs. ``label`` names the
    swept values of the job. For Hydra's basic sweeper these are its jobs in its order (the node's
    own ``hydra.sweeper.params`` first, then the command line); for any other sweeper (Optuna,
    Nevergrad, Ax) every point of its search space, the product of each parameter's choices (an
    interval by its two ends): whatever it draws, each value it can draw was checked. None when a
    sweeper names no ``params`` and the command line sweeps nothing (nothing to enumerate). Needs an
    initialized Hydra (``initialize_config_dir``)."""
    import itertools

    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    loader = GlobalHydra.instance().config_loader()
    master = _compose(
        loader,
        config_name,
        argv_overrides,
        lambda: loader.load_configuration(config_name, argv_overrides, RunMode.MULTIRUN),
    )
    sweeper = master.hydra.sweeper
    raw_params = sweeper.get("params") if "params" in sweeper else None
    params = [f"{k}={v}" for k, v in (raw_params or {}).items()]
    parsed = _compose(
        loader,
        config_name,
        argv_overrides,
        lambda: OverridesParser.create(config_loader=loader).parse_overrides(params + argv_overrides),
    )
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    basic = str(sweeper.get("_target_", "")).endswith("BasicSweeper")
    if not basic and not swept and not params:
        return None
    axes: dict[str, list[str]] = {}
    for override in parsed:  # later overrides of a key replace earlier ones, as in Hydra
        key = override.get_key_element()
        if override.is_sweep_override():
            if basic and not override.is_discrete_sweep():
                raise ConfigError(
                    key,
                    (override.input_line or "").partition("=")[2],
                    "Hydra's basic sweeper runs lists and ranges; an interval needs a sweeper that samples "
                    "(hydra/sweeper=optuna, with objective=...)",
                )
            axes[key] = [f"{key}={v}" for v in _sweep_values(override)]
        else:
            axes[key] = [f"{key}={override.get_value_element_as_str()}"]
    if basic or math.prod(len(v) for v in axes.values()) <= MAX_SEARCH_POINTS:
        jobs = [list(job) for job in itertools.product(*axes.values())]
    else:
        # A large search space: each value of each parameter once, the others at their first value.
        base = [values[0] for values in axes.values()]
        jobs = [base] + [
            [value if k == i else base[k] for k in range(len(base))]
            for i, values in enumerate(axes.values())
            for value in values[1:]
        ]
    return master, [(" ".join(o for o in job if o.partition("=")[0] in swept), job) for job in jobs]


def preflight(argv: list[str]) -> None:
    """Compose and check every configuration the command line asks for; raise ConfigError."""
    from hydra import initialize_config_dir
    from hydra._internal.utils import get_args_parser

    args = get_args_parser().parse_args(argv)
    if any(getattr(args, flag, None) for flag in NO_RUN_FLAGS) or args.config_path or args.config_dir:
        return
    checked_tasks: dict[str, list] = {}
    masters: list = []
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3", job_name="kvbench"):
        points = sweep_points(args.overrides, args.config_name or "config", args.multirun, masters)
        for label, config in points:
            # imported here: composition errors are reported before torch is imported (seconds)
            from kvbench.run import plan_run

            try:
                plan_run(config, checked_tasks)
            except ConfigError as err:
                if not label:
                    raise
                raise ConfigError(err.key, err.value, f"{err.allowed} (sweep point {label})") from err
        # after the runs' own checks: the default folder lives under output.root, checked there first
        for master in masters:
            check_hydra_dir(master, args.multirun)


def cli(argv: list[str]) -> None:
    """``python -m kvbench ARGS``: check everything, then hand the command line to Hydra."""
    verbose = "--verbose" in argv or os.environ.get("HYDRA_FULL_ERROR") == "1"
    argv = [a for a in argv if a != "--verbose"]
    if ("--help" in argv or "-h" in argv) and "--resolve" not in argv:
        # the config --help prints, with kvbench's interpolations (a model node's own values, the
        # task's length from the model) resolved: the values a run would take, not ${...} text
        argv = [*argv, "--resolve"]
    from kvbench.launchers import register

    # hydra/launcher=submitit_* report a sweep on this terminal and take kvbench's knobs
    # (points_per_job): registered before the checks compose the launcher node
    register()
    try:
        check_argv(argv)
        for node, shipped in paths.shadowed_nodes():
            print(
                f"kvbench: warning: {node} has the name of a shipped node (kvbench/conf/{shipped}), which "
                "Hydra reads instead; rename yours to use it",
                file=sys.stderr,
            )
        preflight(argv)
    except ConfigError as err:
        if verbose:
            traceback.print_exc()
        print(f"kvbench: error: {err}", file=sys.stderr)
        sys.exit(2)
    except yaml.YAMLError as err:  # a config node of the user's that does not parse
        if verbose:
            traceback.print_exc()
        mark = getattr(err, "problem_mark", None)
        where = f"{mark.name}: line {mark.line + 1}, column {mark.column + 1}" if mark else "a config node"
        print(
            f"kvbench: error: {where}: not valid YAML ({getattr(err, 'problem', None) or err})",
            file=sys.stderr,
        )
        sys.exit(2)
    sys.argv = [sys.argv[0], *argv]
    main()


def _discard_hydra_dir(cfg: DictConfig) -> None:
    """Remove the folder Hydra made for a single run that failed before it produced anything, when
    it is kvbench's default one (``output.root/.hydra/<time>-<pid>``): a failed check must leave
    nothing behind. A folder the user named, and a sweep's shared folder, stay."""
    import shutil

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        hc = HydraConfig.get()
        if hc.mode != RunMode.RUN:
            return
        out = Path(hc.runtime.output_dir).resolve()
        default_parent = (Path(str(cfg.output.root)).expanduser() / ".hydra").resolve()
    except Exception:  # no Hydra context (a direct call): nothing of Hydra's to remove
        return
    if out.parent != default_parent or not out.is_dir():
        return
    shutil.rmtree(out, ignore_errors=True)
    try:
        default_parent.rmdir()  # only when no other run's folder is in it
    except OSError:
        pass


def _raise_terminated(signum, frame):
    raise Terminated()


def _terminate_as_interrupt():
    """SIGTERM ends a run the way Ctrl-C does (one line, exit 143, every finished row kept) where
    nothing else handles it; a launcher's own handler (submitit's requeue on preemption) stays.
    Returns the handler to restore, or None when it was left alone."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    try:
        return signal.signal(signal.SIGTERM, _raise_terminated)
    except ValueError:  # not the main thread
        return None


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    from kvbench.run import execute, format_table, summary_line
    from kvbench.spec import RunSpec
    from kvbench.sweep import record_point

    previous = _terminate_as_interrupt()
    try:
        # the job's config, resolved and validated once: everything below reads these objects
        spec = RunSpec.from_config(cfg)
        record_point(spec.folder)  # a sweep's point names its run folder before it starts
        metrics = execute(spec)
    except ConfigError as err:
        print(f"kvbench: error: {err}", file=sys.stderr)
        _discard_hydra_dir(cfg)
        sys.exit(2)
    except WriteError as err:  # a full disk, a read-only mount: the file and what to do
        print(f"kvbench: error: {err}", file=sys.stderr)
        sys.exit(1)
    except Interrupted as err:
        print(f"kvbench: {err}", file=sys.stderr)
        sys.exit(err.exit_code)
    except KeyboardInterrupt as err:  # before the first sample (model load, checks)
        print("kvbench: interrupted before any sample ran; the same command starts again", file=sys.stderr)
        _discard_hydra_dir(cfg)
        sys.exit(143 if isinstance(err, Terminated) else 130)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    row = summary_line(metrics)
    record_point(spec.folder, row)
    print(format_table([row]))
    print(f"results: {metrics['folder']}")
    objective = spec.run.objective
    if objective is not None:
        from kvbench.objective import objective_value

        # an optimizing sweeper (Optuna, Nevergrad, Ax) reads one float per trial, or one per objective
        value = objective_value(metrics, objective)
        print(f"objective: {objective} = {value}")
        return value
    return {**row, "folder": metrics["folder"]}  # a submitit launcher's sweep summary is made of these


def help_groups() -> str:
    """The config groups ``--help`` lists: every group of the search path (the user's ``conf/``
    folders included) but Hydra's own and :data:`INTERNAL_GROUPS`, one line each."""
    from hydra.core.global_hydra import GlobalHydra

    hydra_app = GlobalHydra.instance().hydra
    if hydra_app is None:
        return ""
    return hydra_app.format_config_groups(
        lambda g: not g.startswith("hydra") and not any(g.startswith(i) for i in INTERNAL_GROUPS)
    ).rstrip()


if not OmegaConf.has_resolver("kvbench.help_groups"):
    OmegaConf.register_new_resolver("kvbench.help_groups", help_groups)


def entry() -> None:
    """The ``kvbench`` console script (pyproject ``[project.scripts]``): ``kvbench ARGS`` is
    ``python -m kvbench ARGS``, and Hydra's shell completion (``eval "$(kvbench -sc install=bash)"``)
    completes it, which it cannot do for ``python -m``."""
    cli(sys.argv[1:])


if __name__ == "__main__":
    cli(sys.argv[1:])
