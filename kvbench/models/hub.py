"""Whether the Hugging Face Hub can be reached now, asked without waiting on huggingface_hub's retries."""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlparse

from kvbench.env import env_flag

# How long to wait for a TCP connection to the Hub before treating it as unreachable. Without this probe
# huggingface_hub retries five times with back-off (~25 s) before giving up on each file.
HUB_PROBE_TIMEOUT_S = 3.0


OFFLINE_ENV = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def hub_offline() -> bool:
    """Read the offline switches now: huggingface_hub reads them only once, at import time. A value
    that is neither yes nor no is a ConfigError naming the variable (huggingface_hub would read it
    as no, and go online)."""
    return any([env_flag(name) for name in OFFLINE_ENV])  # a list: every variable is checked


def hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hub endpoint opens within ``timeout`` seconds.

    Runs in a daemon thread because name resolution ignores socket timeouts and can stall.
    """
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((url.hostname, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return bool(result and result[0])
