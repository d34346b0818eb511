"""LongBench v1 per-sample metrics, written from their definitions.

LongBench (Bai et al., "LongBench: A Bilingual, Multitask Benchmark for Long Context
Understanding", ACL 2024) scores each of its 21 tasks with one of nine metrics (``METRIC_OF`` in
:mod:`kvbench.tasks.longbench` routes them, as the official ``eval.py`` does). Every function here
takes one prediction and one gold answer and returns a number in [0, 1]; :func:`score_sample` applies
the task's post-processing and takes the maximum over the gold answers. Scores become points (x100)
only at aggregation, as the papers report them.

- ``qa_f1``: token-level F1 after answer normalization (lowercase; drop ASCII punctuation; replace the
  articles a/an/the by a space; collapse whitespace). With ``c`` the size of the multiset intersection
  of prediction tokens ``P`` and gold tokens ``G``: ``p = c/|P|``, ``r = c/|G|``,
  ``F1 = 2pr/(p+r)``, and 0 when ``c = 0``.
- ``qa_f1_zh`` (multifieldqa_zh): the same F1, on words from jieba instead of whitespace. Each text is
  segmented by jieba in accurate mode (``cut_all=False``, HMM on: LongBench's call); every word is
  then lowercased and loses each whitespace character and each character of the Chinese scorer's
  punctuation set (``ZH_PUNCTUATION``: ASCII punctuation plus the CJK, full-width and typographic marks
  listed there); words left empty are dropped. No article rule. The set has gaps that are reproduced
  on purpose: the opening book-title mark ``《`` (its closing ``》`` is in), ``〈 〉``, the full-width
  full stop ``．`` and the middle dot ``·`` stay, so ``《红楼梦》`` leaves the word ``《`` behind.
- ``rouge_l``: ROUGE-L F at summary level (Lin 2004, section 3.2), computed the way the ``rouge``
  package (1.0.1) that LongBench calls computes it, so the numbers match the papers':

  * the text is cut into sentences at every ``.``; empty pieces are dropped, each piece's whitespace
    is collapsed to single spaces, and words are the pieces split on a single space (so a piece that
    is only whitespace contributes one empty word);
  * counts are of *distinct* words: ``m`` = distinct reference words, ``n`` = distinct prediction
    words;
  * for each reference sentence ``r_i`` in order, an LCS with every prediction sentence is traced back
    (diagonal on a match, else up when the cell above is strictly larger, else left) and the words on
    those LCS paths are added to a running set ``U``; the union-LCS count is ``|U|`` after the last
    reference sentence;
  * ``R = |U|/m``, ``P = |U|/n``, ``F = 2PR/(P+R+1e-8)``;
  * a prediction or reference with no sentence at all (empty, or only dots) scores 0 (the package
    raises and LongBench catches it).

  One divergence: the package traces the LCS back recursively, so a sentence pair whose path is
  longer than Python's recursion limit (about 1000 words between periods) raises there and LongBench
  scores 0; here it is scored normally.
- ``rouge_zh`` (dureader, vcsum): ``rouge_l`` on the jieba words of each text (accurate mode, as
  above) joined by single spaces; nothing is normalized. Chinese sentences end in ``。``, not ``.``,
  so a Chinese answer is usually one "sentence" to the package and the LCS runs over the whole word
  sequence: the recursion divergence above is reachable on vcsum, where a 512-token summary against a
  long reference can pass 1000 words (the official scorer would give such a pair 0).
- ``classification`` (trec, lsht): the classes (``all_classes``) that occur as substrings of the
  prediction are matched; matched classes that are proper substrings of the gold class are dropped
  (the gold class covers them); the score is ``1/len(matched)`` if the gold class is among the
  matches, else 0. LongBench drops them while walking the same list, so the match right after a
  dropped one is kept unexamined; that is reproduced here (it only matters when two consecutive
  matches both sit inside the gold class).
- ``retrieval`` (passage_retrieval_en): the gold is "Paragraph N"; the score is the fraction of the
  integers in the prediction that equal N (0 when it has none).
- ``retrieval_zh`` (passage_retrieval_zh): the same with the gold "段落N". Integers are runs of
  Unicode digits compared as text, so a full-width "１２" is an integer that never equals "12".
- ``count`` (passage_count): the fraction of the integers in the prediction equal to the gold count.
- ``code_sim`` (lcc, repobench-p): the prediction's first line (after leading newlines) that holds no
  ``#``, ``//`` or backtick, compared with the gold line by fuzzywuzzy's ``fuzz.ratio(prediction,
  gold)``: equal strings score 1, an empty string against a non-empty one 0, otherwise
  ``round(100 * s) / 100`` with Python's half-to-even ``round`` (fuzzywuzzy's ``intr``) and ``s`` the
  similarity of the string matcher fuzzywuzzy finds installed. The official scorer therefore gives
  different numbers on different machines; ``backend`` (``task.code_sim_backend``) names which one:

  * ``levenshtein`` (the default; what fuzzywuzzy computes when python-Levenshtein is installed):
    ``s = 2L/(|a|+|b|)`` with ``L`` the longest common character subsequence (``|a|+|b|-2L`` is the
    insert/delete edit distance, so this is python-Levenshtein's ``ratio``). ``100 * s`` is computed
    as ``200L/(|a|+|b|)`` before rounding. It is the default because it is a property of the two
    strings alone (symmetric, no heuristics), fuzzywuzzy recommends that install, and kvbench's
    LongBench scores have always used it. One known difference: when ``100 * s`` is exactly a half
    (``|a|+|b| = 80`` and ``L = 23``: 57.5), recent python-Levenshtein releases compute
    ``s = 1 - d/(|a|+|b|)`` in floating point, which lands a hair off the half and rounds either way
    (57 there, 58 here); such pairs are rare and move one sample by 0.01.
  * ``difflib`` (what fuzzywuzzy computes without python-Levenshtein, as in an environment built
    from ``pip install fuzzywuzzy rouge jieba`` alone): ``s`` is ``difflib.SequenceMatcher(None,
    prediction, gold).ratio()``, ``2M/(|a|+|b|)`` with ``M`` the characters in Ratcliff-Obershelp
    matching blocks: the longest common block first, then recursively left and right of it. ``M``
    never exceeds ``L`` and falls short of it when the longest block crosses a better alignment
    ("aba" against "bca": M = 1, L = 2); it depends on the argument order; and for a gold line of
    200 characters or more, difflib's autojunk rule keeps every character that occurs in it more
    than ``len(gold) // 100 + 1`` times (spaces in indented code, for one) out of the block search:
    such characters join a block only by extending one found from other characters, which can drop
    the score to 0 ("x" + 199 "a" against 200 "a": 0, where the LCS ratio gives 100). KIVI's
    published environment file lists fuzzywuzzy 0.18.0 and no python-Levenshtein, so its lcc and
    repobench-p numbers are this backend's.
"""

from __future__ import annotations

import difflib
import functools
import logging
import re
import string
import warnings
from collections import Counter
from collections.abc import Callable, Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_INTEGER = re.compile(r"\d+")
_PARAGRAPH = re.compile(r"Paragraph (\d+)")
_PARAGRAPH_ZH = re.compile(r"段落(\d+)")


def _chars(*spans: tuple[int, int]) -> str:
    return "".join(chr(c) for lo, hi in spans for c in range(lo, hi + 1))


# The Chinese scorer's punctuation: ASCII punctuation and these marks (inclusive code-point spans).
ZH_PUNCTUATION = frozenset(
    string.punctuation
    + _chars(
        (0x2013, 0x2014),  # en and em dash
        (0x2018, 0x2019),  # single quotation marks
        (0x201B, 0x201F),  # reversed single, double and low quotation marks
        (0x2026, 0x2027),  # ellipsis, hyphenation point
        (0x3001, 0x3003),  # ideographic comma and full stop, ditto mark
        (0x300B, 0x3011),  # closing book-title mark (not the opening one), corner, lenticular brackets
        (0x3014, 0x301F),  # tortoise-shell and white brackets, wave dash, double prime quotation marks
        (0x3030, 0x3030),  # wavy dash
        (0x303E, 0x303F),  # ideographic variation indicator, half-fill space
        (0xFE4F, 0xFE4F),  # wavy low line
        (0xFF01, 0xFF0D),  # full-width ! " # $ % & ' ( ) * + , -  (not the full stop U+FF0E)
        (0xFF0F, 0xFF0F),  # full-width /
        (0xFF1A, 0xFF20),  # full-width : ; < = > ? @
        (0xFF3B, 0xFF40),  # full-width [ \ ] ^ _ `
        (0xFF5B, 0xFF64),  # full-width { | } ~, white parentheses, half-width CJK marks
    )
)


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD answer normalization, in its order: lowercase, drop ASCII punctuation, articles
    to spaces, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def normalize_zh_word(word: str) -> str:
    """The Chinese scorer's normalization of one word: lowercase, then drop ``ZH_PUNCTUATION`` and
    every whitespace character."""
    return "".join(ch for ch in word.lower() if ch not in ZH_PUNCTUATION and not ch.isspace())


@functools.cache
def _jieba():
    """jieba, imported and quietened on first use: English-only runs never load its dictionary."""
    with warnings.catch_warnings():
        # jieba 0.42.1 tries pkg_resources first, which older setuptools releases flag as deprecated
        warnings.filterwarnings("ignore", message=".*pkg_resources")
        import jieba

    jieba.setLogLevel(logging.WARNING)  # its "Building prefix dict" lines would land in every run's log
    jieba.initialize()
    return jieba


def jieba_words(text: str) -> list[str]:
    """jieba's accurate-mode segmentation (``cut_all=False``, HMM on), whitespace words included."""
    return list(_jieba().cut(text, cut_all=False))


def token_f1(prediction: Sequence[str], gold: Sequence[str]) -> float:
    """F1 of two token lists, counting each token as often as it occurs in both."""
    common = sum((Counter(prediction) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, gold: str, **_) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(gold).split())


def qa_f1_zh(prediction: str, gold: str, **_) -> float:
    """multifieldqa_zh: F1 over normalized jieba words, empty words dropped."""

    def words(text: str) -> list[str]:
        return [w for w in map(normalize_zh_word, jieba_words(text)) if w]

    return token_f1(words(prediction), words(gold))


def _sentences(text: str) -> list[list[str]]:
    """Sentences at every '.', as word lists (whitespace collapsed, then split on one space)."""
    return [" ".join(piece.split()).split(" ") for piece in text.split(".") if piece]


def _lcs_words(ref: list[str], hyp: list[str]) -> set[str]:
    """The words on one LCS path of ``ref`` and ``hyp``, traced back from the end: diagonal on a
    match, up (shorter ``ref``) when that cell is strictly larger, else left (shorter ``hyp``)."""
    rows, cols = len(ref), len(hyp)
    table = [[0] * (cols + 1) for _ in range(rows + 1)]
    for i in range(1, rows + 1):
        above, here = table[i - 1], table[i]
        for j in range(1, cols + 1):
            here[j] = above[j - 1] + 1 if ref[i - 1] == hyp[j - 1] else max(above[j], here[j - 1])
    words: set[str] = set()
    i, j = rows, cols
    while i > 0 and j > 0:
        if ref[i - 1] == hyp[j - 1]:
            words.add(ref[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def rouge_l(prediction: str, gold: str, **_) -> float:
    """Summary-level ROUGE-L F over distinct words (see the module docstring)."""
    hyp, ref = _sentences(prediction), _sentences(gold)
    if not hyp or not ref:
        return 0.0
    m = len({w for s in ref for w in s})
    n = len({w for s in hyp for w in s})
    union: set[str] = set()
    for r in ref:
        for h in hyp:
            union |= _lcs_words(r, h)
    recall, precision = len(union) / m, len(union) / n
    return 2.0 * precision * recall / (precision + recall + 1e-8)


def rouge_zh(prediction: str, gold: str, **_) -> float:
    """dureader, vcsum: :func:`rouge_l` over jieba words joined by spaces."""
    return rouge_l(" ".join(jieba_words(prediction)), " ".join(jieba_words(gold)))


def classification(prediction: str, gold: str, all_classes: Sequence[str] = (), **_) -> float:
    """TREC class score with LongBench's substring rule (see the module docstring)."""
    matched = [c for c in all_classes if c in prediction]
    kept: list[str] = []
    skip_next = False
    for c in matched:
        if skip_next:  # the official loop removes from the list it walks and so steps over this one
            kept.append(c)
            skip_next = False
        elif c in gold and c != gold:
            skip_next = True
        else:
            kept.append(c)
    return 1.0 / len(kept) if gold in kept else 0.0


def _fraction_equal(prediction: str, target: str) -> float:
    numbers = _INTEGER.findall(prediction)
    return sum(n == target for n in numbers) / len(numbers) if numbers else 0.0


def retrieval(prediction: str, gold: str, **_) -> float:
    """passage_retrieval_en: fraction of the prediction's integers naming the gold paragraph."""
    return _fraction_equal(prediction, _PARAGRAPH.findall(gold)[0])


def retrieval_zh(prediction: str, gold: str, **_) -> float:
    """passage_retrieval_zh: fraction of the prediction's integers naming the gold paragraph ("段落N")."""
    return _fraction_equal(prediction, _PARAGRAPH_ZH.findall(gold)[0])


def count(prediction: str, gold: str, **_) -> float:
    """passage_count: fraction of the prediction's integers equal to the gold count."""
    return _fraction_equal(prediction, str(gold))


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common (not necessarily contiguous) subsequence of two strings."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for ch in a:
        cur = [0]
        for j, other in enumerate(b, start=1):
            cur.append(prev[j - 1] + 1 if ch == other else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


CODE_SIM_BACKENDS = ("levenshtein", "difflib")


def fuzz_ratio(a: str, b: str, backend: str = "levenshtein") -> int:
    """fuzzywuzzy ``fuzz.ratio(a, b)``, an integer in 0..100, with python-Levenshtein installed
    (``levenshtein``) or without it (``difflib``); see the module docstring."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    if backend == "levenshtein":
        return int(round(100 * 2 * lcs_length(a, b) / (len(a) + len(b))))
    if backend == "difflib":
        return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))
    raise ValueError(f"code_sim backend {backend!r}: allowed {', '.join(CODE_SIM_BACKENDS)}")


def first_code_line(prediction: str) -> str:
    """The first line (after leading newlines) with no comment marker or backtick, else ''."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim(prediction: str, gold: str, code_sim_backend: str = "levenshtein", **_) -> float:
    return fuzz_ratio(first_code_line(prediction), gold, code_sim_backend) / 100


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1,
    "qa_f1_zh": qa_f1_zh,
    "rouge_l": rouge_l,
    "rouge_zh": rouge_zh,
    "classification": classification,
    "retrieval": retrieval,
    "retrieval_zh": retrieval_zh,
    "count": count,
    "code_sim": code_sim,
}

# Tasks whose prediction is cut to its first line before scoring (few-shot tasks, where a model
# tends to continue with the next example).
FIRST_LINE_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht"})


def first_line(prediction: str) -> str:
    return prediction.lstrip("\n").split("\n")[0]


def score_sample(
    metric: str,
    task: str,
    prediction: str,
    answers: Sequence[str],
    all_classes: Sequence[str] | None = None,
    code_sim_backend: str = "levenshtein",
) -> float:
    """The sample's score in [0, 1]: the task's post-processing, then the best over gold answers."""
    if task in FIRST_LINE_TASKS:
        prediction = first_line(prediction)
    fn = METRICS[metric]
    options = {"all_classes": all_classes or (), "code_sim_backend": code_sim_backend}
    return max((fn(prediction, gold, **options) for gold in answers), default=0.0)
