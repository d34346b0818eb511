import pandas as pd
import pytest

from kvbench.stats import locate_cliff

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
