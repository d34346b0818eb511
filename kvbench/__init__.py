"""kvbench: KV-cache quantization methods, reproduced and measured."""

import os

from omegaconf import OmegaConf

__version__ = "0.1.0"

# Hydra's run and sweep folders (kvbench/conf/config.yaml) end in ${kvbench.pid:} after a microsecond
# timestamp, so two processes started at the same moment never share one. Registered here because
# every process that resolves a kvbench config imports kvbench first (a submitit job included);
# cached, so every job of a sweep resolves the sweep folder of the process that launched it.
if not OmegaConf.has_resolver("kvbench.pid"):
    OmegaConf.register_new_resolver("kvbench.pid", os.getpid, use_cache=True)
