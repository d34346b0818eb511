"""NIAH: recall scoring, haystack construction with the real tokenizer, config errors, one real run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvbench.cache import MemoryReport
from kvbench.errors import ConfigError
from kvbench.methods import ModelShape
from kvbench.tasks import build_task
from kvbench.tasks.niah import (
    NEEDLE,
    build_context,
    essay_order,
    insert_needle,
    kamradt_grid,
    load_haystack,
    needle_recall,
    period_ids,
)

NEEDLE_SENTENCE = NEEDLE.strip()
SHAPE = ModelShape(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_context=8192)


def niah(data_root, **overrides):
    return build_task({"name": "niah", **overrides}, data_root, seed=0)


# --- scoring ---------------------------------------------------------------------------------------


def test_recall_all_three_phrases():
    answer = "Eat a sandwich and sit in Dolores Park on a sunny day."
    assert needle_recall(answer) == 1.0


def test_recall_one_phrase():
    assert needle_recall("Go to Dolores Park.") == pytest.approx(1 / 3)


def test_recall_wrong_answer():
    assert needle_recall("Visit the Golden Gate Bridge.") == 0.0
    assert needle_recall("") == 0.0


def test_recall_ignores_case_and_spacing():
    assert needle_recall("EAT A SANDWICH in dolores park on a SUNNY\n DAY") == 1.0


# --- haystack construction -------------------------------------------------------------------------


def test_insert_needle_moves_back_to_a_sentence_end():
    periods = {0}
    haystack = [5, 6, 0, 7, 8, 9, 0, 3]  # sentence ends after index 2 and 6
    needle = [42]
    assert insert_needle(haystack, needle, 50, periods) == [5, 6, 0, 42, 7, 8, 9, 0, 3]
    assert insert_needle(haystack, needle, 0, periods) == [42, *haystack]
    assert insert_needle(haystack, needle, 100, periods) == [*haystack[:7], 42, 3]
    assert insert_needle([1, 2, 3], needle, 90, periods) == [42, 1, 2, 3]  # no sentence end: start


def test_build_context_ends_on_a_sentence_and_fits_the_budget():
    periods = {0}
    haystack = [5, 0, 6, 7, 0, 8, 9, 9, 9]
    ids = build_context(haystack, [42, 43], length=8, depth=100, periods=periods)
    # 6 haystack tokens fit beside the 2-token needle; the trailing "8" is a partial sentence
    assert ids == [5, 0, 6, 7, 0, 42, 43]


def prompt_parts(task, tokenizer, length, depth):
    prompt = task.build_prompt(tokenizer, length, depth)
    start = prompt.index("<|im_start|>user\n") + len("<|im_start|>user\n")
    document = prompt[start : prompt.index("\n\nWhat is the best thing")]
    return prompt, document


@pytest.mark.parametrize("length", [1024, 2048])
def test_prompt_length_and_single_needle(data_root, tokenizer, length):
    task = niah(data_root)
    for depth in (0, 50, 100):
        prompt, _ = prompt_parts(task, tokenizer, length, depth)
        n = len(tokenizer.encode(prompt, add_special_tokens=False))
        assert length - task.config.buffer - 40 <= n <= length, (depth, n)
        assert prompt.count(NEEDLE_SENTENCE) == 1
        assert prompt.startswith("<|im_start|>system\n")
        assert prompt.endswith(
            "What is the best thing to do in San Francisco?<|im_end|>\n<|im_start|>assistant\n"
        )


def test_needle_sits_at_sentence_boundaries_in_depth_order(data_root, tokenizer):
    task = niah(data_root)
    positions = []
    for depth in (0, 25, 50, 75, 100):
        _, document = prompt_parts(task, tokenizer, 2048, depth)
        before, after = document.split(NEEDLE_SENTENCE)
        assert before.rstrip("\n") == "" or before.rstrip("\n").endswith("."), (depth, before[-40:])
        if depth == 0:
            assert before.strip() == ""
        if depth == 100:
            assert after.strip() == ""
        positions.append(len(before))
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    assert positions[0] == 1  # just the needle's own leading newline before it


def test_haystack_is_repeated_for_long_contexts(data_root, tokenizer):
    task = niah(data_root)
    single = len(task.haystack_ids(tokenizer, 0))
    longer = task.haystack_ids(tokenizer, single + 10)
    assert len(longer) >= single + 10
    assert longer[:1000] == task.haystack_ids(tokenizer, 0)[:1000]


# --- config ----------------------------------------------------------------------------------------


def test_samples_ids_and_defaults(data_root):
    task = niah(data_root)
    ids = [s["id"] for s in task.samples()]
    assert ids == [f"L{n}_d{d}" for n in (1024, 2048, 3072) for d in (0, 50, 100)]
    assert niah(data_root, limit=2).samples()[-1]["id"] == "L1024_d50"


def test_depth_out_of_range(data_root):
    with pytest.raises(ConfigError, match=r"task\.depths"):
        niah(data_root, depths=[0, 120])


def test_context_length_at_most_buffer(data_root):
    with pytest.raises(ConfigError, match=r"task\.context_lengths"):
        niah(data_root, context_lengths=[150])


def test_context_length_above_max_context(data_root, tokenizer):
    task = niah(data_root, context_lengths=[2048, 16384])
    with pytest.raises(ConfigError, match=r"task\.context_lengths.*8192"):
        task.check_model(SHAPE, tokenizer)
    niah(data_root, context_lengths=[8192]).check_model(SHAPE, tokenizer)  # the limit itself is fine


def test_missing_data_root(tmp_path):
    task = niah(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"data\.root.*PaulGrahamEssays.*make assets"):
        task.samples()


def test_unknown_key_names_it(data_root):
    with pytest.raises(ConfigError, match=r"task\.depth\b"):
        niah(data_root, depth=[50])


def test_aggregate_per_length(data_root):
    rows = [
        {"score": 1.0, "context_length": 1024},
        {"score": 0.0, "context_length": 1024},
        {"score": 1 / 3, "context_length": 2048},
    ]
    agg = niah(data_root).aggregate(rows)
    assert agg["n"] == 3
    assert agg["score"] == pytest.approx((1 + 0 + 1 / 3) / 3)
    assert agg["score_L1024"] == pytest.approx(0.5)
    assert agg["score_L2048"] == pytest.approx(1 / 3)


# --- end to end ------------------------------------------------------------------------------------


def test_end_to_end_fp16(data_root: Path, fp16_runner):
    task = niah(data_root, context_lengths=[512], depths=[50])
    task.check_model(fp16_runner.shape, fp16_runner.tokenizer)
    (sample,) = task.samples()
    row = task.run(sample, fp16_runner)
    assert sample["id"] == "L512_d50"
    assert 512 - 200 - 40 <= row["prompt_tokens"] <= 512
    assert row["score"] == row["needle_recall"] == needle_recall(row["prediction"])
    assert row["score"] in (0.0, 1 / 3, 2 / 3, 1.0)
    assert (row["context_length"], row["depth"]) == (512, 50)
    assert 0 < row["generated_tokens"] <= 32
    assert isinstance(row["stopped"], bool)
    assert row["stopped"] or row["generated_tokens"] == 32
    assert isinstance(row["memory"], MemoryReport)
    assert row["memory"].tokens >= row["prompt_tokens"]
    assert row["prefill_s"] > 0 and math.isfinite(row["decode_s"])


def test_conf_node_builds_the_defaults(data_root):
    from omegaconf import OmegaConf

    node = OmegaConf.load(Path(__file__).parents[2] / "kvbench" / "conf" / "task" / "niah.yaml")
    task = build_task(node, data_root, seed=0)  # a DictConfig, as Hydra passes it
    assert task.config == niah(data_root).config
    assert task.config.context_lengths == [1024, 2048, 3072] and task.config.depths == [0, 50, 100]


# --- placement on hand-made text, grids, seeded haystacks ------------------------------------------


class WordTokenizer:
    """Words and punctuation marks as tokens (ids by first appearance), enough for placement tests."""

    def __init__(self):
        self.vocab: dict[str, int] = {}

    def encode(self, text, add_special_tokens=False):
        import re

        return [self.vocab.setdefault(t, len(self.vocab)) for t in re.findall(r"\w+|[^\w\s]", text)]

    def decode(self, ids):
        words = {i: t for t, i in self.vocab.items()}
        return " ".join(words[i] for i in ids)


HAND_TEXT = "One two three. Four five six seven. Eight nine. Ten eleven twelve thirteen fourteen. Fifteen"


# HAND_TEXT's tokens: sentences start at 0, 4, 9 and 12; the trailing "Fifteen" (token 18) is a partial
# sentence and is dropped, leaving 18 tokens. Depth d targets int(18 d / 100); the needle goes to the
# nearest sentence start at or before it.
@pytest.mark.parametrize(("depth", "at"), [(0, 0), (10, 0), (30, 4), (50, 9), (70, 12), (90, 12), (100, 18)])
def test_needle_lands_on_the_nearest_sentence_end_at_or_before_the_depth(depth, at):
    tok = WordTokenizer()
    haystack = tok.encode(HAND_TEXT)
    needle = tok.encode("NEEDLE sentence here .")
    ids = build_context(haystack, needle, len(haystack) + len(needle), depth, period_ids(tok))
    assert len(ids) == 18 + 4
    assert ids.index(needle[0]) == at
    assert ids[at : at + 4] == needle
    assert at == 0 or tok.decode(ids[:at]).endswith(".")
    assert (
        tok.decode(ids[:at] + ids[at + 4 :])
        == HAND_TEXT.replace(".", " .").replace("  ", " ").rsplit(" Fifteen", 1)[0]
    )


def test_depth_0_and_100_put_the_needle_first_and_last():
    tok = WordTokenizer()
    haystack = tok.encode(HAND_TEXT)
    needle = tok.encode("NEEDLE .")
    periods = period_ids(tok)
    first = build_context(haystack, needle, len(haystack) + 2, 0, periods)
    last = build_context(haystack, needle, len(haystack) + 2, 100, periods)
    assert first[:2] == needle and first.count(needle[0]) == 1
    assert last[-2:] == needle and tok.decode(last[:-2]).endswith("fourteen .")
    assert sorted(first) == sorted(last)  # the same document, the needle moved


def test_kamradt_grid_is_evenly_spaced_and_ends_at_the_limits(data_root):
    task = niah(data_root, grid="kamradt", min_length=1000, max_length=8000, num_lengths=8, num_depths=5)
    assert task.config.context_lengths == [1000, 2000, 3000, 4000, 5000, 6000, 7000, 8000]
    assert task.config.depths == [0, 25, 50, 75, 100]
    assert kamradt_grid(1024, 4096, 4, 7) == ([1024, 2048, 3072, 4096], [0, 17, 33, 50, 67, 83, 100])
    ids = [s["id"] for s in task.samples()]
    assert len(ids) == 40 and ids[0] == "L1000_d0" and ids[-1] == "L8000_d100"


def test_kamradt_grid_above_the_model_context_is_rejected(data_root, tokenizer):
    task = niah(data_root, grid="kamradt", min_length=1024, max_length=16384, num_lengths=4, num_depths=3)
    with pytest.raises(ConfigError, match=r"task\.context_lengths.*8192"):
        task.check_model(SHAPE, tokenizer)
    with pytest.raises(ConfigError, match=r"task\.max_length"):
        niah(data_root, grid="kamradt", min_length=4096, max_length=2048)
    with pytest.raises(ConfigError, match=r"task\.grid"):
        niah(data_root, grid="sigmoid")


def test_seeds_reorder_the_essays_and_a_seed_is_deterministic(data_root):
    texts = {seed: load_haystack(data_root, seed) for seed in (0, 1, 2)}
    assert load_haystack(data_root, 1) == texts[1]  # the same seed, the same haystack
    assert len({t[:2000] for t in texts.values()}) == 3  # each seed opens with different text
    essays = sorted((data_root / "niah" / "PaulGrahamEssays").glob("*.txt"))
    assert all(len(t) == len(texts[0]) for t in texts.values())  # the same essays, reordered
    assert load_haystack(data_root).startswith(essays[0].read_text(encoding="utf-8"))  # None: by name
    names = [p.name for p in essays]
    assert sorted(essay_order(names, 5)) == sorted(names) and essay_order(names, 5) == essay_order(names, 5)
    assert essay_order(names, 5) != essay_order(names, 6)


def test_task_haystack_follows_the_run_seed(data_root, tokenizer):
    a = niah(data_root).haystack_ids(tokenizer, 0)
    b = build_task({"name": "niah"}, data_root, seed=1).haystack_ids(tokenizer, 0)
    sorted_0 = build_task({"name": "niah", "haystack_order": "sorted"}, data_root, seed=0)
    sorted_1 = build_task({"name": "niah", "haystack_order": "sorted"}, data_root, seed=1)
    assert a[:500] != b[:500]
    assert abs(len(a) - len(b)) <= 10  # the same essays (BPE merges at the joins may differ)
    assert sorted_0.haystack_ids(tokenizer, 0) == sorted_1.haystack_ids(tokenizer, 0)
