"""LongBench metrics on hand-worked cases (the arithmetic is in the comments). The Chinese cases first
pin jieba's segmentation of each text, then work the metric out from those words."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.tasks import longbench_metrics
from kvbench.tasks.longbench_metrics import (
    ZH_PUNCTUATION,
    classification,
    code_sim,
    count,
    first_code_line,
    fuzz_ratio,
    jieba_words,
    lcs_length,
    normalize_answer,
    normalize_zh_word,
    qa_f1,
    qa_f1_zh,
    retrieval,
    retrieval_zh,
    rouge_l,
    rouge_zh,
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


# --- Chinese QA F1 (multifieldqa_zh) ---------------------------------------------------------------


def test_jieba_segmentation_of_the_cases_below():
    assert jieba_words("会议讨论了预算问题") == ["会议", "讨论", "了", "预算", "问题"]
    assert jieba_words("会议讨论了项目进度。") == ["会议", "讨论", "了", "项目", "进度", "。"]
    words = ["小明", "硕士", "毕业", "于", "中国科学院", "计算所"]
    assert jieba_words("小明硕士毕业于中国科学院计算所") == words
    assert jieba_words("中国科学院计算所") == ["中国科学院", "计算所"]
    assert jieba_words("《红楼梦》") == ["《", "红楼梦", "》"]
    assert jieba_words("Hello World，你好世界！") == ["Hello", " ", "World", "，", "你好", "世界", "！"]
    assert jieba_words("hello world 你好") == ["hello", " ", "world", " ", "你好"]
    assert jieba_words("价格是3.5元") == ["价格", "是", "3.5", "元"]


def test_zh_normalization_of_one_word():
    assert normalize_zh_word("Hello") == "hello"
    assert normalize_zh_word("，") == "" and normalize_zh_word("。") == "" and normalize_zh_word(" ") == ""
    assert normalize_zh_word("a\u3000b") == "ab"  # the ideographic space is whitespace too
    # the scorer's set drops the closing book-title mark but not the opening one, nor the middle dot
    assert "》" in ZH_PUNCTUATION and "《" not in ZH_PUNCTUATION and "·" not in ZH_PUNCTUATION
    assert normalize_zh_word("》") == "" and normalize_zh_word("《") == "《"
    assert "．" not in ZH_PUNCTUATION and "！" in ZH_PUNCTUATION and "." in ZH_PUNCTUATION
    assert len(ZH_PUNCTUATION - set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")) == 74  # plus the 32 ASCII marks


def test_qa_f1_zh_hand_worked():
    # pred words 会议 讨论 了 预算 问题 (5); gold 会议 讨论 了 项目 进度 (5, "。" normalizes away):
    # c = 3, p = r = 3/5, F1 = 0.6. Kept, the "。" would make r = 3/6.
    assert qa_f1_zh("会议讨论了预算问题", "会议讨论了项目进度。") == pytest.approx(0.6)
    # pred 6 words, gold 中国科学院 计算所 (2), both inside: c = 2, p = 1/3, r = 1, F1 = (2/3)/(4/3) = 0.5
    assert qa_f1_zh("小明硕士毕业于中国科学院计算所", "中国科学院计算所") == pytest.approx(0.5)
    # 《 survives normalization as a word of its own: pred [《, 红楼梦], gold [红楼梦]:
    # c = 1, p = 1/2, r = 1, F1 = 2/3
    assert qa_f1_zh("《红楼梦》", "红楼梦") == pytest.approx(2 / 3)
    # lowercased, whitespace and full-width punctuation dropped: pred [hello, world, 你好, 世界],
    # gold [hello, world, 你好]: c = 3, p = 3/4, r = 1, F1 = 1.5/1.75 = 6/7
    assert qa_f1_zh("Hello World，你好世界！", "hello world 你好") == pytest.approx(6 / 7)
    # no article rule: pred [the, answer] against [answer]: p = 1/2, r = 1, F1 = 2/3 (English F1: 1)
    assert qa_f1_zh("the answer", "answer") == pytest.approx(2 / 3) and qa_f1("the answer", "answer") == 1.0
    assert qa_f1_zh("。", "答案") == 0.0 and qa_f1_zh("", "答案") == 0.0


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


# --- Chinese ROUGE-L (dureader, vcsum) ------------------------------------------------------------


def test_rouge_zh_hand_worked():
    # one sentence each (no ASCII period); ref 会议 讨论 了 项目 进度 。 (m = 6: the "。" is a word here),
    # hyp 会议 讨论 了 预算 问题 (n = 5); LCS 会议 讨论 了 -> |U| = 3, R = 1/2, P = 3/5,
    # F = 2 * 0.3 / (1.1 + 1e-8)
    expected = 0.6 / (1.1 + 1e-8)
    assert rouge_zh("会议讨论了预算问题", "会议讨论了项目进度。") == pytest.approx(expected, abs=1e-12)
    # words, not characters, and in order: hyp 预算 问题 讨论 了 会议 against 会议 讨论 了 预算 问题:
    # the LCS is two words (讨论 了 or 预算 问题), R = P = 2/5, F = 2 * 0.16 / (0.8 + 1e-8)
    expected = 0.32 / (0.8 + 1e-8)
    assert rouge_zh("预算问题讨论了会议", "会议讨论了预算问题") == pytest.approx(expected, abs=1e-12)


def test_rouge_zh_splits_sentences_at_the_ascii_period_only():
    # hyp "价格 是 3.5 元" is cut at the "." into [价格, 是, 3] and [5, 元]: n = 5 distinct words; ref
    # [价格, 是, 3, 元], m = 4. LCS with the first piece adds 价格 是 3, with the second 元: |U| = 4,
    # R = 1, P = 4/5, F = 1.6 / (1.8 + 1e-8). Unsplit it would be 0.75.
    assert rouge_zh("价格是3.5元", "价格是3元") == pytest.approx(1.6 / (1.8 + 1e-8), abs=1e-12)
    assert rouge_zh("", "会议") == 0.0  # no sentence: the package raises, LongBench scores 0


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


def test_retrieval_zh_hand_worked():
    assert retrieval_zh("段落12", "段落12") == 1.0
    assert retrieval_zh("答案是：段落3，或者段落12", "段落12") == 0.5  # 1 of the 2 integers
    assert retrieval_zh("段落120", "段落12") == 0.0
    assert retrieval_zh("我不知道", "段落12") == 0.0
    # full-width digits are digits to the pattern, but "１２" is not the text "12"
    assert retrieval_zh("段落１２", "段落12") == 0.0
    # only the gold needs the 段落 pattern; any integer in the prediction counts
    assert retrieval_zh("Paragraph 12", "段落12") == 1.0


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


def test_fuzz_ratio_backends_differ():
    # "aba" against "bca": the LCS is "ba" (2) -> levenshtein 100 * 4/6 = 66.7 -> 67. difflib takes the
    # longest block first; all blocks have length 1 and the earliest in the first string is a[0] = "a"
    # against b[2]; nothing is left on its right in b nor on its left in a: M = 1 -> 100 * 2/6 -> 33
    assert fuzz_ratio("aba", "bca", "levenshtein") == 67
    assert fuzz_ratio("aba", "bca", "difflib") == 33
    # difflib depends on the order: from "bca", "b" (b[1]) comes first and "a" still fits after it
    assert fuzz_ratio("bca", "aba", "difflib") == 67 and fuzz_ratio("bca", "aba", "levenshtein") == 67
    # where the greedy block is the LCS they agree: LCS 3 of "abcd"/"abce" -> 75 both ways
    assert fuzz_ratio("abcd", "abce", "difflib") == 75 == fuzz_ratio("abcd", "abce", "levenshtein")


def test_fuzz_ratio_difflib_autojunk():
    # a second string of 200+ characters keeps every character occurring in it more than
    # 200 // 100 + 1 = 3 times out of difflib's block search: against "a" * 200, "x" + "a" * 199 finds no
    # block (and a block of "a"s could only grow from one found, or from the start of both strings,
    # where "x" and "a" differ): M = 0 -> 0. levenshtein: LCS 199, 100 * 398/400 = 99.5 -> 100 (even)
    assert fuzz_ratio("x" + "a" * 199, "a" * 200, "difflib") == 0
    assert fuzz_ratio("x" + "a" * 199, "a" * 200, "levenshtein") == 100
    # one character shorter, no junk: M = L = 198 -> 100 * 396/398 = 99.497 -> 99 both ways
    assert fuzz_ratio("x" + "a" * 198, "a" * 199, "difflib") == 99
    assert fuzz_ratio("x" + "a" * 198, "a" * 199, "levenshtein") == 99


def test_fuzz_ratio_shared_checks_and_bad_backend():
    for backend in ("levenshtein", "difflib"):
        assert fuzz_ratio("", "", backend) == 100 and fuzz_ratio("x", "", backend) == 0
    with pytest.raises(ValueError, match="levenshtein, difflib"):
        fuzz_ratio("a", "b", "rapidfuzz")


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


def test_lsht_first_line_and_the_substring_rule():
    classes = ["足球", "国际足球", "财经"]
    # first line "国际足球": matched [足球, 国际足球]; 足球 sits inside the gold and is dropped -> 1/1
    assert score_sample("classification", "lsht", "国际足球\n财经", ["国际足球"], classes) == 1.0
    # the whole text also matches 财经: 足球 dropped, 国际足球 stepped over, 财经 kept -> 1/2
    assert classification("国际足球\n财经", "国际足球", all_classes=classes) == 0.5


def test_score_sample_passes_the_code_sim_backend():
    assert score_sample("code_sim", "lcc", "# c\naba", ["bca"]) == 0.67
    assert score_sample("code_sim", "lcc", "# c\naba", ["bca"], code_sim_backend="difflib") == 0.33
    assert score_sample("code_sim", "repobench-p", "bca\n", ["aba"], code_sim_backend="difflib") == 0.67


def test_jieba_loads_lazily_and_quietly(tmp_path):
    # a fresh interpreter: English scoring never imports jieba; the first Chinese score builds its
    # dictionary (no cache in an empty temporary folder) without jieba's "Building prefix dict",
    # "Dumping model" and "Loading model" lines on stderr
    # the module alone (it imports nothing from kvbench), so the interpreter does not load torch
    path = Path(longbench_metrics.__file__)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('metrics', {str(path)!r})\n"
        "m = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "assert m.score_sample('qa_f1', 'hotpotqa', 'Paris', ['Paris']) == 1.0\n"
        "assert 'jieba' not in sys.modules\n"
        "print(m.score_sample('qa_f1_zh', 'multifieldqa_zh', '中国科学院计算所', ['计算所']))\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # jieba keeps its dictionary cache in the temp folder
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(2 * 0.5 / 1.5) and proc.stderr == ""  # p = 1/2, r = 1
    assert (tmp_path / "jieba.cache").is_file()  # the dictionary was built here, not read from a cache
