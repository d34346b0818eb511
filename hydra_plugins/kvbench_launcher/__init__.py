"""kvbench's submitit launchers, where Hydra looks for launcher classes (the logic is in
kvbench/launchers.py). Importing this package, as Hydra's plugin scan does, stores their config
nodes as ``hydra/launcher=kvbench_local`` and ``kvbench_slurm`` (``kvbench.launchers.register``);
the submitit plugin's own ``submitit_local`` and ``submitit_slurm`` are left to the plugin.
The base classes are reached through their module, not imported by name, and these classes are
named apart from the submitit plugin's own: Hydra's plugin list (``--info plugins``) shows each
launcher once."""

from kvbench import launchers as _launchers


class KvbenchLocalLauncher(_launchers.LocalSweepLauncher):
    """``hydra/launcher=kvbench_local``: each point (or group of ``points_per_job``) a local process."""


class KvbenchSlurmLauncher(_launchers.SlurmSweepLauncher):
    """``hydra/launcher=kvbench_slurm``, ``slurm``, ``slurm_cpu``: each point (or group of
    ``points_per_job``) a task of a Slurm job array."""


_launchers.register()
