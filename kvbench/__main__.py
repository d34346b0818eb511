"""``kvbench`` (the console script) and ``python -m kvbench``: the Hydra entry.

    kvbench                                            # FP16 baseline, default model and task
    kvbench +method=kivi bits=2                        # one method, one bit width
    kvbench -m +method=uniform,kivi bits=2,4           # a sweep (Hydra multirun)
    kvbench -m +experiment=semkv_cliff                 # an experiment node: its sweep and analysis plan
    kvbench -m hydra/sweeper=optuna objective=score 'bits=choice(1,2,3,4)'   # any Hydra sweeper
    eval "$(kvbench -sc install=bash)"                 # Hydra's tab completion, for the console script

Config nodes come from the package (``kvbench/conf``) and then from the user's own folders
(``./conf``, the checkout's ``conf/``, ``$KVBENCH_CONFIG_PATH``; :func:`kvbench.paths.user_config_dirs`):
every check looks in all of them, as Hydra does. This module is the entry (:func:`cli`, the Hydra
job :func:`main`, :func:`preflight`); the checks of the chosen nodes and experiments are
:mod:`kvbench.cli.nodes`, the composition with Hydra :mod:`kvbench.cli.compose`.

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

import os
import signal
import sys
import traceback
from pathlib import Path

import hydra
import yaml
from omegaconf import DictConfig, OmegaConf

from kvbench import paths
from kvbench.atomic import WriteError

# What this entry calls, in kvbench.cli; importable from here as before.
from kvbench.cli.compose import (  # noqa: F401
    HYDRA_TRACES,
    MAX_SEARCH_POINTS,
    check_hydra_dir,
    hydra_error,
    job_config,
    sweep_jobs,
    sweep_points,
)
from kvbench.cli.nodes import (  # noqa: F401
    CHECKED_GROUPS,
    CONF_DIR,
    REGISTERED_GROUPS,
    check_argv,
    check_experiment,
    check_group_choices,
    experiment_choices,
    experiment_requirements,
    find_node,
    group_options,
    load_experiment,
    search_dirs,
)
from kvbench.env import get_logger
from kvbench.errors import ConfigError, Interrupted, Terminated

# Method nodes that experiments choose through ``+experiment/arms/NAME@method``: not for the command
# line, so --help and the choice lists leave them out.
INTERNAL_GROUPS = ("experiment/arms",)

# Hydra flags after which no run happens: nothing to check.
NO_RUN_FLAGS = ("help", "hydra_help", "cfg", "info", "shell_completion", "experimental_rerun")


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
            get_logger(__name__).warning(
                f"{node} has the name of a shipped node (kvbench/conf/{shipped}), which Hydra reads "
                "instead; rename yours to use it"
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
