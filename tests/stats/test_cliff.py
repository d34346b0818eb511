import math

import pandas as pd
import pytest

from kvbench.stats import is_degenerate, locate_cliff, repeated_coverage, runaway_rate

GRID = [4.0, 3.0, 2.585, 2.322, 2.0, 1.585, 1.0]


def _table(verdicts, shuffle=True):
    frame = pd.DataFrame({"bits": GRID, "verdict": verdicts})
    # Order in the table must not matter: the walk sorts by bits.
    return frame.sample(frac=1.0, random_state=0) if shuffle else frame


def test_locate_cliff_on_a_hand_grid():
    verdicts = ["equivalent", "equivalent", "inconclusive", "equivalent", "worse", "worse", "worse"]
    cliff = locate_cliff(_table(verdicts))
    assert cliff.last_ok_bits == 2.322 and cliff.first_bad_bits == 2.0
    assert cliff.interval == "(2, 2.322]" and cliff.found and not cliff.non_monotone


def test_locate_cliff_stops_at_the_first_bad_point():
    # 2.585 is worse, 2.322 recovers by chance: the bracket stays at the first break.
    verdicts = ["equivalent", "better", "worse", "equivalent", "worse", "worse", "worse"]
    cliff = locate_cliff(_table(verdicts).to_dict("records"))
    assert (cliff.last_ok_bits, cliff.first_bad_bits) == (3.0, 2.585)
    assert cliff.interval == "(2.585, 3]" and cliff.non_monotone


def test_locate_cliff_no_cliff_in_grid():
    cliff = locate_cliff(_table(["equivalent"] * 6 + ["inconclusive"]))
    assert cliff.first_bad_bits is None and cliff.interval is None and not cliff.found
    assert cliff.last_ok_bits == 1.0


def test_locate_cliff_above_the_grid():
    cliff = locate_cliff(_table(["worse"] * 7))
    assert cliff.last_ok_bits is None and cliff.first_bad_bits == 4.0 and cliff.interval is None


def test_locate_cliff_rejects_bad_tables():
    with pytest.raises(ValueError, match="repeated bit widths"):
        locate_cliff([{"bits": 2, "verdict": "worse"}, {"bits": 2, "verdict": "equivalent"}])
    with pytest.raises(ValueError, match="unknown verdicts"):
        locate_cliff([{"bits": 2, "verdict": "Worse"}])


# ------------------------------------------------------------------------------------- runaway

LOOP = "the answer is 42 . " * 5  # 25 tokens, every one inside a 4-gram seen 5 times
HALF_LOOP = "Paris is the capital of France and has many museums . " + "yes yes yes yes yes yes yes yes"


def test_repeated_coverage_hand_values():
    assert repeated_coverage(LOOP) == 1.0
    # 11 distinct tokens, then 8 "yes": the 4-gram (yes x4) occurs 5 times and covers those 8.
    assert repeated_coverage(HALF_LOOP) == pytest.approx(8 / 19)
    assert repeated_coverage("one two three") == 0.0
    # A phrase repeated only twice never counts.
    assert repeated_coverage("see the big red dog and see the big red dog") == 0.0


def test_is_degenerate_threshold():
    assert is_degenerate(LOOP)
    assert not is_degenerate(HALF_LOOP)  # 8/19 < 0.5
    assert is_degenerate(HALF_LOOP, min_coverage=0.4)


def test_runaway_rate_on_hand_rows():
    rows = [
        {"prediction": "The needle is 7421.", "stopped": True, "generated_tokens": 9},  # fine
        {"prediction": "The needle is 7421 and", "stopped": False, "generated_tokens": 64},  # hit limit
        {"prediction": LOOP, "stopped": True, "generated_tokens": 30},  # stopped, but a loop
        {"prediction": HALF_LOOP, "stopped": True, "generated_tokens": 40},  # fine
        {"prediction": "short", "stopped": False, "generated_tokens": 12},  # cut below the limit
    ]
    assert runaway_rate(rows, max_new_tokens=64) == pytest.approx(2 / 5)
    assert runaway_rate(rows, max_new_tokens=12) == pytest.approx(3 / 5)
    assert runaway_rate(rows, max_new_tokens=64, min_coverage=0.4) == pytest.approx(3 / 5)
    assert math.isnan(runaway_rate([], max_new_tokens=64))
