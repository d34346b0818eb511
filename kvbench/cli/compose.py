"""Composing a command line with Hydra, as Hydra will when it runs it: each job's config
(:func:`job_config`), the jobs of a sweep (:func:`sweep_jobs`, :func:`sweep_points`), Hydra's
composition errors as one :class:`~kvbench.errors.ConfigError` line (:func:`hydra_error`), and
Hydra's output folder checked before Hydra makes it (:func:`check_hydra_dir`)."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterator
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from kvbench import paths
from kvbench.cli.nodes import search_dirs
from kvbench.config import unknown_key
from kvbench.env import get_logger
from kvbench.errors import ConfigError


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
            get_logger(__name__).warning(
                f"{key}={value} already holds {entries} entries that Hydra did not write; Hydra adds "
                ".hydra/ and its log beside them (an empty or new folder keeps them apart)"
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
