"""Paired statistics: method vs FP16 reference on the same samples and seeds, and bit-grid cliffs."""

from kvbench.stats.cliff import (
    Cliff,
    is_degenerate,
    is_runaway,
    locate_cliff,
    repeated_coverage,
    runaway_rate,
)
from kvbench.stats.paired import (
    PAIR_KEYS,
    VERDICTS,
    aligned_pairs,
    bootstrap_ci,
    cohens_dz,
    compare,
    holm,
    mcnemar_test,
    paired_differences,
    sign_flip_test,
    tost_bootstrap,
    tost_equivalence,
    verdict,
    win_rate,
)

__all__ = [
    "PAIR_KEYS",
    "VERDICTS",
    "Cliff",
    "aligned_pairs",
    "bootstrap_ci",
    "cohens_dz",
    "compare",
    "holm",
    "is_degenerate",
    "is_runaway",
    "locate_cliff",
    "mcnemar_test",
    "paired_differences",
    "repeated_coverage",
    "runaway_rate",
    "sign_flip_test",
    "tost_bootstrap",
    "tost_equivalence",
    "verdict",
    "win_rate",
]
