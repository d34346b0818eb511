"""Runaway and degenerate generations on hand-made outputs."""

import math

import pytest

from kvbench.stats import degenerate_rate, is_degenerate, is_runaway, repeated_coverage, runaway_rate

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


# A healthy NIAH answer as the default model writes it: 23 tokens, cut off by a 24-token limit.
NIAH_ANSWER = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny"
LIMIT = 24


def _row(sample, prediction, stopped, tokens, seed=0, limit=LIMIT):
    return {
        "sample_id": sample,
        "seed": seed,
        "prediction": prediction,
        "stopped": stopped,
        "generated_tokens": tokens,
        "max_new_tokens": limit,
    }


def test_reference_cut_off_at_the_limit_is_not_a_runaway():
    """The old definition counted every limit hit, so FP16 on NIAH scored 0.67-0.78."""
    fp16 = [_row(f"s{i}", NIAH_ANSWER, False, LIMIT) for i in range(9)]
    assert not any(is_degenerate(r["prediction"]) for r in fp16)
    assert runaway_rate(fp16, fp16) == 0.0
    assert degenerate_rate(fp16) == 0.0
    # A method that writes the same healthy answer and is cut off the same way: no runaway.
    method = [_row(f"s{i}", NIAH_ANSWER.replace("sandwich", "burrito"), False, LIMIT) for i in range(9)]
    assert runaway_rate(method, fp16) == 0.0


def test_runaway_on_hand_made_degenerate_and_healthy_outputs():
    reference = [
        _row("a", "The needle is 7421.", True, 6, limit=64),
        _row("b", "The needle is 7421.", True, 6, limit=64),
        _row("c", "The needle is 7421.", True, 6, limit=64),
        _row("d", "The needle is 7421 and more text follows here", True, 40, limit=64),
        _row("e", LOOP, True, 25, limit=64),  # the reference itself loops on this sample
        _row("f", "The needle is 7421.", True, 6, limit=64),
    ]
    method = [
        _row("a", "The needle is 7421.", True, 6, limit=64),  # healthy
        _row("b", LOOP, True, 25, limit=64),  # loops where the reference did not
        _row("c", "The needle is 7421, a number that many", False, 64, limit=64),  # overruns 6 -> 64
        _row("d", "The needle is 7421 and more text follows here and", False, 64, limit=64),  # 40: no room
        _row("e", LOOP, True, 25, limit=64),  # loops as the reference does: not the method's doing
        _row("g", LOOP, True, 25, limit=64),  # no reference partner: left out
    ]
    assert [is_runaway(m, r) for m, r in zip(method[:5], reference[:5], strict=True)] == [
        False,
        True,
        True,
        False,
        False,
    ]
    assert runaway_rate(method, reference) == pytest.approx(2 / 5)
    assert degenerate_rate(method) == pytest.approx(3 / 6)
    assert degenerate_rate(reference) == pytest.approx(1 / 6)
    # a stricter overrun rule (room for 10x the reference's answer) drops sample c: 6 * 10 <= 64
    assert runaway_rate(method, reference, overrun_factor=11) == pytest.approx(1 / 5)
    # the coverage threshold goes through to is_degenerate
    half = [_row("a", HALF_LOOP, True, 19, limit=64)]
    assert runaway_rate(half, reference) == 0.0
    assert runaway_rate(half, reference, min_coverage=0.4) == 1.0
    assert math.isnan(runaway_rate(method, []))
    assert math.isnan(degenerate_rate([]))
