"""kvbench: KV-cache quantization methods, reproduced and measured."""

import os

from omegaconf import OmegaConf

from kvbench.version import __version__

# Hydra's run and sweep folders (kvbench/conf/config.yaml) end in ${kvbench.pid:} after a microsecond
# timestamp, so two processes started at the same moment never share one. Registered here because
# every process that resolves a kvbench config imports kvbench first (a submitit job included);
# cached, so every job of a sweep resolves the sweep folder of the process that launched it.
if not OmegaConf.has_resolver("kvbench.pid"):
    OmegaConf.register_new_resolver("kvbench.pid", os.getpid, use_cache=True)

# The Python API (kvbench/api.py), imported on first use so that `import kvbench` stays light.
_API = ("load", "new_cache", "prepare")
__all__ = ["__version__", *_API]


def __getattr__(name: str):
    if name in _API:
        from kvbench import api

        return getattr(api, name)
    raise AttributeError(f"module 'kvbench' has no attribute {name!r}")
