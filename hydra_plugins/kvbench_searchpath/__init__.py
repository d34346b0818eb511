"""Hydra's search path plugin for the user's own config nodes (``./conf``, the checkout's ``conf/``,
``$KVBENCH_CONFIG_PATH``; see ``kvbench.paths.user_config_dirs``), searched after the shipped
``kvbench/conf``: ``conf/model/my-llama.yaml`` composes as ``model=my-llama``."""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin


class KvbenchSearchPath(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        from kvbench.paths import user_config_dirs

        # Only kvbench's own composition gets the folders: another Hydra app in this environment
        # keeps its search path.
        if not any(e.path and e.path.rstrip("/").endswith("kvbench/conf") for e in search_path.get_path()):
            return
        for folder in user_config_dirs(strict=False):  # a bad entry is reported by the CLI, in one line
            search_path.append(provider="kvbench-user", path=f"file://{folder}")
