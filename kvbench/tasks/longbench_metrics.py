"""LongBench v1 per-sample metrics, written from their definitions.

LongBench (Bai et al., "LongBench: A Bilingual, Multitask Benchmark for Long Context
Understanding", ACL 2024) scores each English task with one of six metrics. Every function here takes
one prediction and one gold answer and returns a number in [0, 1]; :func:`score_sample` applies the
task's post-processing and takes the maximum over the gold answers. Scores become points (x100) only
at aggregation, as the papers report them.

- ``qa_f1``: token-level F1 after answer normalization (lowercase; drop ASCII punctuation; replace the
  articles a/an/the by a space; collapse whitespace). With ``c`` the size of the multiset intersection
  of prediction tokens ``P`` and gold tokens ``G``: ``p = c/|P|``, ``r = c/|G|``,
  ``F1 = 2pr/(p+r)``, and 0 when ``c = 0``.
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
  longer than Python's recursion limit (~1000 words without a period) raises there and LongBench
  scores 0; here it is scored normally.
- ``classification``: the classes (``all_classes``) that occur as substrings of the prediction are
  matched; matched classes that are proper substrings of the gold class are dropped (the gold class
  covers them); the score is ``1/len(matched)`` if the gold class is among the matches, else 0.
  LongBench drops them while walking the same list, so the match right after a dropped one is kept
  unexamined; that is reproduced here (it only matters when two consecutive matches both sit inside
  the gold class).
- ``retrieval`` (passage_retrieval_en): the gold is "Paragraph N"; the score is the fraction of the
  integers in the prediction that equal N (0 when it has none).
- ``count`` (passage_count): the fraction of the integers in the prediction equal to the gold count.
- ``code_sim`` (lcc, repobench-p): the prediction's first line (after leading newlines) that holds no
  ``#``, ``//`` or backtick, compared with the gold line by fuzzywuzzy's ``ratio``: equal strings
  score 1, an empty string against a non-empty one 0, otherwise ``round(100 * 2L/(|a|+|b|)) / 100``
  where ``L`` is the longest common character subsequence (``|a|+|b|-2L`` is the insert/delete
  edit distance, so this is python-Levenshtein's ``ratio``) and ``round`` is Python's
  half-to-even rounding, as fuzzywuzzy's ``intr`` does.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_INTEGER = re.compile(r"\d+")
_PARAGRAPH = re.compile(r"Paragraph (\d+)")


def normalize_answer(text: str) -> str:
    """LongBench/SQuAD answer normalization, in its order: lowercase, drop ASCII punctuation, articles
    to spaces, whitespace collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def token_f1(prediction: Sequence[str], gold: Sequence[str]) -> float:
    """F1 of two token lists, counting each token as often as it occurs in both."""
    common = sum((Counter(prediction) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(prediction), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, gold: str, **_) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(gold).split())


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


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy ``fuzz.ratio`` with python-Levenshtein: an integer in 0..100."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * 2 * lcs_length(a, b) / (len(a) + len(b))))


def first_code_line(prediction: str) -> str:
    """The first line (after leading newlines) with no comment marker or backtick, else ''."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim(prediction: str, gold: str, **_) -> float:
    return fuzz_ratio(first_code_line(prediction), gold) / 100


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1,
    "rouge_l": rouge_l,
    "classification": classification,
    "retrieval": retrieval,
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
) -> float:
    """The sample's score in [0, 1]: the task's post-processing, then the best over gold answers."""
    if task in FIRST_LINE_TASKS:
        prediction = first_line(prediction)
    fn = METRICS[metric]
    return max((fn(prediction, gold, all_classes=all_classes or ()) for gold in answers), default=0.0)
