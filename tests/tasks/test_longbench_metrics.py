"""LongBench metrics on hand-worked cases (the arithmetic is in the comments)."""

from __future__ import annotations

import pytest

from kvbench.tasks.longbench_metrics import (
    classification,
    code_sim,
    count,
    first_code_line,
    fuzz_ratio,
    lcs_length,
    normalize_answer,
    qa_f1,
    retrieval,
    rouge_l,
    score_sample,
)

# --- QA F1 -----------------------------------------------------------------------------------------


def test_normalization_order_and_rules():
    # lowercase -> "an apple, the pie." ; punctuation -> "an apple the pie" ; articles -> " apple  pie"
    assert normalize_answer("An apple, the PIE.") == "apple pie"
    # punctuation goes first, so "the-end" becomes one word "theend" and is no article
    assert normalize_answer("the-end") == "theend"
    # only whole words are articles: "anthem" and "theory" stay
    assert normalize_answer("A theory, an anthem") == "theory anthem"


def test_qa_f1_hand_worked():
    assert qa_f1("The Eiffel Tower!", "Eiffel tower") == 1.0  # both "eiffel tower"
    # pred "paris france and louvre" (4 tokens), gold "paris" (1): c=1, p=1/4, r=1, F1 = 0.5/1.25 = 0.4
    assert qa_f1("Paris, France and the Louvre", "Paris") == pytest.approx(0.4)
    # multiset overlap: pred x y y, gold y y z -> c = min(2, 2) = 2, p = r = 2/3, F1 = 2/3
    assert qa_f1("x y y", "y y z") == pytest.approx(2 / 3)
    # pred y y y, gold y z: c = min(3, 1) = 1, p = 1/3, r = 1/2, F1 = (1/3)/(5/6) = 0.4
    assert qa_f1("y y y", "y z") == pytest.approx(0.4)
    assert qa_f1("Berlin", "Paris") == 0.0
    assert qa_f1("", "Paris") == 0.0
    assert qa_f1("the", "a") == 0.0  # both normalize to nothing


# --- ROUGE-L ---------------------------------------------------------------------------------------


def test_rouge_l_single_sentence():
    # ref "the cat sat on the mat": m = 5 distinct words; hyp "the cat sat": n = 3.
    # LCS = the cat sat -> |U| = 3; R = 3/5, P = 1; F = 2 * 0.6 / 1.6 = 0.75
    assert rouge_l("the cat sat", "the cat sat on the mat") == pytest.approx(0.75, abs=1e-7)


def test_rouge_l_counts_distinct_words():
    # hyp "the the the" has n = 1 distinct word, ref "the" m = 1; |U| = 1 -> P = R = 1, F = 2/(2+1e-8)
    assert rouge_l("the the the", "the") == pytest.approx(2 / (2 + 1e-8), abs=1e-12)


def test_rouge_l_is_summary_level_over_sentences():
    # hyp sentences "c" and "a b"; ref "a b c" (m = 3, n = 3). LCS with "c" -> {c}, with "a b" -> {a, b}
    # so |U| = 3 and F = 1 (1 - 5e-9). A flat LCS of "c a b" against "a b c" would give only 2/3.
    assert rouge_l("c. a b", "a b c") == pytest.approx(2 / (2 + 1e-8), abs=1e-12)


def test_rouge_l_traceback_prefers_left_on_ties():
    # ref sentences r1 = "a b", r2 = "a"; hyp "b a". m = |{a, b}| = 2, n = 2.
    # LCS(r1, hyp) has length 1 with two candidates; at the last cell (b vs a) the cell above
    # (LCS(a; b a) = 1) is not strictly larger than the one on the left (LCS(a b; b) = 1), so the
    # trace goes left and picks "b". r2 adds "a": |U| = 2 -> F = 1. Had it picked "a", |U| = 1, F = 0.5.
    assert rouge_l("b a", "a b. a") == pytest.approx(2 / (2 + 1e-8), abs=1e-12)


def test_rouge_l_whitespace_piece_is_an_empty_word():
    # hyp "a b. " -> pieces "a b" and " " -> words {a, b, ""}: n = 3; ref m = 2; |U| = 2.
    # R = 1, P = 2/3, F = (4/3)/(5/3) = 0.8
    assert rouge_l("a b. ", "a b") == pytest.approx(0.8, abs=1e-7)


def test_rouge_l_no_sentence_scores_zero():
    assert rouge_l("", "a b") == 0.0
    assert rouge_l("...", "a b") == 0.0
    assert rouge_l("a b", "") == 0.0


# --- classification (trec) ------------------------------------------------------------------------

CLASSES = ["Animal", "Individual", "City"]


def test_classification_hand_worked():
    assert classification("Individual", "Individual", all_classes=CLASSES) == 1.0
    # two classes named, the gold among them: 1/2
    assert classification("Animal or Individual", "Individual", all_classes=CLASSES) == 0.5
    assert classification("City", "Individual", all_classes=CLASSES) == 0.0
    assert classification("no class at all", "Individual", all_classes=CLASSES) == 0.0


def test_classification_drops_classes_inside_the_gold():
    # "Date" is a proper substring of the gold "Date of birth": it is dropped, score 1/1
    classes = ["Date", "Date of birth", "City"]
    assert classification("Date of birth", "Date of birth", all_classes=classes) == 1.0
    # ... but a class inside the gold counts against a prediction naming another class too:
    # matched [Date, Date of birth, City] -> Date dropped -> [Date of birth, City] -> 1/2
    assert classification("Date of birth, City", "Date of birth", all_classes=classes) == 0.5


def test_classification_keeps_the_match_after_a_dropped_one():
    # classes [ab, b, abc], gold abc, prediction abc: all three match. The official loop removes "ab"
    # while walking the list, which steps over "b": [b, abc] remain and the score is 1/2, not 1.
    assert classification("abc", "abc", all_classes=["ab", "b", "abc"]) == 0.5


# --- retrieval and count ---------------------------------------------------------------------------


def test_retrieval_hand_worked():
    assert retrieval("Paragraph 12", "Paragraph 12") == 1.0
    assert retrieval("Paragraph 3 or Paragraph 12", "Paragraph 12") == 0.5  # 1 of 2 numbers
    assert retrieval("Paragraph 120", "Paragraph 12") == 0.0  # whole integers, not prefixes
    assert retrieval("I do not know", "Paragraph 12") == 0.0  # no number at all


def test_count_hand_worked():
    assert count("7", "7") == 1.0
    assert count("There are 7 unique paragraphs out of 10", "7") == 0.5
    assert count("seven", "7") == 0.0


# --- code similarity -------------------------------------------------------------------------------


def test_lcs_length():
    assert lcs_length("abcd", "abce") == 3
    assert lcs_length("abcbdab", "bdcaba") == 4  # the textbook example (CLRS): "bcba"
    assert lcs_length("", "abc") == 0


def test_fuzz_ratio_hand_worked():
    # LCS 3 of 4 + 4 chars: 100 * 6/8 = 75
    assert fuzz_ratio("abcd", "abce") == 75
    # LCS("abcdefgh", "hxxxxxxx") = 1: 100 * 2/16 = 12.5 -> half-to-even -> 12
    assert fuzz_ratio("abcdefgh", "hxxxxxxx") == 12
    # LCS("abcdefgh", "fghxxxxx") = 3: 100 * 6/16 = 37.5 -> half-to-even -> 38
    assert fuzz_ratio("abcdefgh", "fghxxxxx") == 38
    assert fuzz_ratio("same", "same") == 100
    assert fuzz_ratio("", "") == 100  # equal strings come first in fuzzywuzzy's checks
    assert fuzz_ratio("", "x") == 0


def test_first_code_line_skips_comments_and_fences():
    assert first_code_line("\n\n# note\n// more\n```python\n    return x\nfoo()") == "    return x"
    assert first_code_line("# only a comment") == ""


def test_code_sim_hand_worked():
    assert code_sim("```python\nx = 1\n", "x = 1") == 1.0
    # first line "return a" (8 chars) against "return b" (8): LCS 7 -> 100 * 14/16 = 87.5 -> 88
    assert code_sim("return a\nreturn b", "return b") == 0.88
    assert code_sim("# all comments", "x = 1") == 0.0


# --- per-sample score ------------------------------------------------------------------------------


def test_score_sample_first_line_only_for_few_shot_tasks():
    # triviaqa keeps the first line after leading newlines: "Paris" -> F1 1
    assert score_sample("qa_f1", "triviaqa", "\nParis\nQuestion: next one", ["Paris"]) == 1.0
    # hotpotqa scores the whole text: "paris question next one" -> p = 1/4, r = 1, F1 = 0.4
    assert score_sample("qa_f1", "hotpotqa", "\nParis\nQuestion: next one", ["Paris"]) == pytest.approx(0.4)


def test_score_sample_takes_the_best_gold_answer():
    # "55 mph" vs "55": p = 1/2, r = 1, F1 = 2/3; vs "fifty-five" ("fiftyfive"): 0 -> max 2/3
    assert score_sample("qa_f1", "triviaqa", "55 mph", ["fifty-five", "55"]) == pytest.approx(2 / 3)


def test_score_sample_passes_the_classes():
    assert score_sample("classification", "trec", "City\nQuestion: x", ["City"], CLASSES) == 1.0
