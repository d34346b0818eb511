"""``objective=``: the number a run hands back to a Hydra sweeper that optimizes (Optuna, Nevergrad,
Ax), which needs one float per trial (or a list, one per objective, for a multi-objective study).

    kvbench -m hydra/sweeper=optuna hydra.sweeper.direction=maximize objective=score 'bits=choice(1,2,3,4)'
    kvbench -m hydra/sweeper=optuna 'hydra.sweeper.direction=[maximize,minimize]' \\
        'objective=[score,effective_bits]' +method=kivi 'bits=interval(1,4)'

Names, read from the run's ``metrics.json``:

- ``score``: the task's primary metric (NIAH and LongBench ``score``, GSM8K accuracy, perplexity
  ``ppl``, ...); its own name (``ppl``) is accepted too. Which way is better is the sweeper's
  ``direction``: perplexity is minimized, a score maximized;
- ``effective_bits``: every byte the cache holds per value (the memory accounting), ``code_bits``:
  the code bits alone, ``compression``: FP16 bytes over bytes held;
- ``time_s``: the run's wall seconds.

Without ``objective`` (null, the default) a run returns its summary row (a dict), what the basic
sweeper and the submitit launchers' tables use. The key is not part of the run id: the same run
serves any objective.
"""

from __future__ import annotations

import math
from typing import Any

from kvbench.errors import ConfigError

# name -> where its value is in metrics.json
OBJECTIVES = {
    "score": ("metrics", None),
    "effective_bits": ("memory", "effective_bits"),
    "code_bits": ("memory", "code_bits"),
    "compression": ("memory", "compression"),
    "time_s": ("timings", "run_s"),
}


def objective_names(objective: Any) -> list[str] | None:
    """``objective`` as a list of names (None when unset); a ConfigError unless it is a name or a
    non-empty list of names."""
    if objective is None:
        return None
    names = [objective] if isinstance(objective, str) else objective
    if not isinstance(names, (list, tuple)) or not names or not all(isinstance(n, str) for n in names):
        raise ConfigError(
            "objective", objective, f"a name or a list of names: {', '.join(OBJECTIVES)} (or null)"
        )
    return list(names)


def check_objective(objective: Any, primary_metric: str) -> None:
    """Every name in ``objective`` is one of :data:`OBJECTIVES` or the task's primary metric."""
    allowed = [*OBJECTIVES, primary_metric] if primary_metric not in OBJECTIVES else list(OBJECTIVES)
    for name in objective_names(objective) or []:
        if name not in allowed:
            raise ConfigError(
                "objective",
                name,
                f"one of {', '.join(allowed)} (score is this task's {primary_metric}), or a list of them",
            )


def objective_value(metrics: dict[str, Any], objective: Any) -> float | list[float]:
    """The value(s) ``objective`` names in a run's metrics (NaN where the run has none): a float
    for one name, a list for several."""
    names = objective_names(objective) or []
    values = []
    for name in names:
        section, key = OBJECTIVES.get(name, ("metrics", name))
        if section == "metrics":
            key = key or metrics["primary_metric"]
        value = (metrics.get(section) or {}).get(key)
        values.append(float(value) if isinstance(value, (int, float)) else math.nan)
    return values[0] if isinstance(objective, str) else values
