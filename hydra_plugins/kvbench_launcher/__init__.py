"""kvbench's submitit launchers, where Hydra looks for launcher classes (the logic is in
kvbench/launchers.py; ``kvbench.launchers.register`` points ``hydra/launcher=submitit_*`` here)."""

from kvbench.launchers import LocalSweepLauncher, SlurmSweepLauncher


class LocalLauncher(LocalSweepLauncher):
    """``hydra/launcher=submitit_local``: each point a local process."""


class SlurmLauncher(SlurmSweepLauncher):
    """``hydra/launcher=submitit_slurm``, ``slurm``, ``slurm_cpu``: each point a task of a Slurm job array."""
