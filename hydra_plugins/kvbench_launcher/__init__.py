"""kvbench's submitit launchers, where Hydra looks for launcher classes (the logic is in
kvbench/launchers.py; ``kvbench.launchers.register`` points ``hydra/launcher=submitit_*`` here).
The base classes are reached through their module, not imported by name, and these classes are
named apart from the submitit plugin's own: Hydra's plugin list (``--info plugins``) shows each
launcher once."""

from kvbench import launchers as _launchers


class KvbenchLocalLauncher(_launchers.LocalSweepLauncher):
    """``hydra/launcher=submitit_local``: each point (or group of ``points_per_job``) a local process."""


class KvbenchSlurmLauncher(_launchers.SlurmSweepLauncher):
    """``hydra/launcher=submitit_slurm``, ``slurm``, ``slurm_cpu``: each point (or group of
    ``points_per_job``) a task of a Slurm job array."""
