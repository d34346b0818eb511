"""Paired statistics: the tests (``paired``), a method vs the FP16 reference over a results table
(``comparison``), bit-grid cliffs (``cliff``), runaway generations (``runaway``) and the sample sizes a
comparison needs (``power``)."""

from kvbench.stats.cliff import Cliff, locate_cliff
from kvbench.stats.comparison import VERDICTS, compare, verdict
from kvbench.stats.paired import (
    PAIR_KEYS,
    aligned_pairs,
    bootstrap_ci,
    cohens_dz,
    holm,
    mcnemar_test,
    paired_differences,
    sign_flip_test,
    tost_bootstrap,
    tost_equivalence,
    win_rate,
)
from kvbench.stats.power import (
    min_n_sign_flip,
    min_p_sign_flip,
    min_pairs_sign_flip,
    n_for_difference,
    n_for_equivalence,
    n_for_noninferiority,
    n_from_pilot,
    n_normal,
    power_difference,
    power_equivalence,
)
from kvbench.stats.runaway import degenerate_rate, is_degenerate, is_runaway, repeated_coverage, runaway_rate

__all__ = [
    "PAIR_KEYS",
    "VERDICTS",
    "Cliff",
    "aligned_pairs",
    "bootstrap_ci",
    "cohens_dz",
    "compare",
    "degenerate_rate",
    "holm",
    "is_degenerate",
    "is_runaway",
    "locate_cliff",
    "mcnemar_test",
    "n_for_difference",
    "n_for_equivalence",
    "n_for_noninferiority",
    "min_n_sign_flip",
    "min_p_sign_flip",
    "min_pairs_sign_flip",
    "n_from_pilot",
    "n_normal",
    "paired_differences",
    "power_difference",
    "power_equivalence",
    "repeated_coverage",
    "runaway_rate",
    "sign_flip_test",
    "tost_bootstrap",
    "tost_equivalence",
    "verdict",
    "win_rate",
]
