"""GSM8K through lm-eval: answer extraction and exact match on hand-worked outputs, prompts equal to
lm-eval's own, resume-safe few-shot contexts, config and data errors.

The extraction tests run the whole per-sample path (lm-eval's task, the kvbench adapter, lm-eval's
filters and metric) with a scripted runner that returns fixed text instead of decoding, so they need
no model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvbench.cache import memory_report
from kvbench.errors import ConfigError
from kvbench.generate import Generation
from kvbench.methods import ModelShape
from kvbench.tasks import build_task
from kvbench.tasks.gsm8k import gold_answer, lm_eval_gsm8k_dir
from kvbench.tasks.lmeval_task import column, load_lm_eval_task, task_manager


class CharTokenizer:
    """One token per character (id = code point + 1; 0 is end of text)."""

    eos_token_id = 0
    name_or_path = "chars"

    def encode(self, text, add_special_tokens=False):
        return [ord(c) + 1 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i - 1) for i in ids if i)


@dataclass
class ScriptedRunner:
    """Stands in for ModelRunner.generate: returns ``outputs`` in turn, records prompts and kwargs."""

    outputs: list[str]
    tokenizer: CharTokenizer = field(default_factory=CharTokenizer)
    shape: ModelShape = field(default_factory=lambda: ModelShape(30, 9, 3, 64, max_context=8192))
    device: str = "cpu"
    calls: list[tuple[str, int, tuple[str, ...]]] = field(default_factory=list)

    def generate(self, input_ids, max_new_tokens, stop_strings=()):
        prompt = self.tokenizer.decode(input_ids[0].tolist())
        self.calls.append((prompt, max_new_tokens, tuple(stop_strings)))
        text = self.outputs[len(self.calls) - 1]
        return Generation(text, [1] * len(text), input_ids.shape[1], True, memory_report([]), 0.0, 0.0)


@pytest.fixture(scope="module")
def gsm8k(data_root):
    task = build_task({"name": "gsm8k", "limit": 4}, data_root, seed=0)
    task.samples()
    return task


def run_doc(task, doc_id: int, output: str):
    runner = ScriptedRunner([output])
    return task.run({"id": f"gsm8k/{doc_id}", "lm_eval_task": "gsm8k", "doc_id": doc_id}, runner), runner


# --- answer extraction: lm-eval's strict-match ("#### N") and flexible-extract (last number) -------


def test_gold_answer_is_the_number_after_the_marker():
    assert gold_answer("She makes 9 * 2 = $<<9*2=18>>18 a day.\n#### 18") == "18"
    assert gold_answer("... so 1,000 in all.\n#### 1,000") == "1,000"
    assert gold_answer("#### -5") == "-5"


def test_marker_answer_matches_under_both_filters(gsm8k):
    # doc 0: Janet's ducks, gold 18
    row, _ = run_doc(gsm8k, 0, " 16 - 3 - 4 = 9 eggs. 9 * 2 = 18.\n#### 18")
    assert row["answer"] == "18"
    assert row["extracted"] == {"strict-match": "18", "flexible-extract": "18"}
    assert row["exact_match_strict_match"] == 1.0
    assert row["exact_match_flexible_extract"] == 1.0
    assert row["score"] == 1.0


def test_no_marker_strict_invalid_flexible_takes_last_number(gsm8k):
    row, _ = run_doc(gsm8k, 0, " She has 16 - 3 - 4 = 9 eggs and earns 9 * 2 = 18")
    assert row["extracted"] == {"strict-match": "[invalid]", "flexible-extract": "18"}
    assert (row["exact_match_strict_match"], row["exact_match_flexible_extract"]) == (0.0, 1.0)
    assert row["score"] == 0.0  # the score is the strict match


def test_strict_takes_first_marker_flexible_the_last_number(gsm8k):
    row, _ = run_doc(gsm8k, 0, " 9 * 2 = 18\n#### 18\nThen she buys 12 more")
    assert row["extracted"] == {"strict-match": "18", "flexible-extract": "12"}
    assert (row["exact_match_strict_match"], row["exact_match_flexible_extract"]) == (1.0, 0.0)


def test_commas_dollar_and_final_period_are_ignored(gsm8k):
    # doc 1: robe, 2 + 1 = 3 bolts; a wrong number stays wrong after normalisation
    row, _ = run_doc(gsm8k, 1, " It takes 2/2=1 bolt of white fiber.\n#### 3.")
    assert row["answer"] == "3"
    assert row["extracted"]["strict-match"] == "3."
    assert row["exact_match_strict_match"] == 1.0
    row, _ = run_doc(gsm8k, 1, " Total $3,0.\n#### 3,0")  # "3,0" -> "30" after dropping the comma
    assert row["extracted"]["strict-match"] == "3,0"
    assert row["exact_match_strict_match"] == 0.0


def test_negative_number_and_flexible_dollar_amount(gsm8k):
    # doc 2: house flip, gold 70000
    row, _ = run_doc(gsm8k, 2, " The profit is $70,000.")
    assert row["answer"] == "70000"
    assert row["extracted"] == {"strict-match": "[invalid]", "flexible-extract": "$70,000."}
    assert row["exact_match_flexible_extract"] == 1.0
    row, _ = run_doc(gsm8k, 2, " loss\n#### -70000")
    assert row["extracted"]["strict-match"] == "-70000"
    assert row["exact_match_strict_match"] == 0.0


# --- protocol: lm-eval's own prompt, stop strings and generation length ---------------------------


def test_request_is_lm_evals_prompt_stops_and_length(gsm8k):
    _, runner = run_doc(gsm8k, 0, "#### 18")
    prompt, max_new, stops = runner.calls[0]
    assert prompt.count("Question:") == 6  # 5 exemplars + the problem
    assert prompt.endswith("How much in dollars does she make every day at the farmers' market?\nAnswer:")
    assert max_new == 256
    assert {"Question:", "</s>", "<|im_end|>"} <= set(stops)


def test_contexts_equal_lm_evals_own_requests_and_do_not_depend_on_run_order(data_root):
    manager = task_manager(str(lm_eval_gsm8k_dir()), False)
    # lm-eval's evaluator path: seed the sampler, build every request of the first 3 docs in order
    local = build_task({"name": "gsm8k"}, data_root, 0).overrides("gsm8k")
    fresh = load_lm_eval_task(manager, "gsm8k", local)
    fresh.set_config("num_fewshot", 5)
    fresh.set_fewshot_seed(1234)
    fresh.build_all_requests(limit=3)
    expected = [inst.args[0] for inst in sorted(fresh.instances, key=lambda i: i.doc_id)]
    assert len(set(expected)) == 3
    # a resumed run that only does doc 2 gets the same prompt as one that did 0 and 1 first
    task = build_task({"name": "gsm8k"}, data_root, 0)
    assert task.context("gsm8k", 2) == expected[2]
    assert [task.context("gsm8k", k) for k in range(3)] == expected


def test_sample_ids_and_limit(gsm8k):
    assert [s["id"] for s in gsm8k.samples()] == ["gsm8k/0", "gsm8k/1", "gsm8k/2", "gsm8k/3"]


def test_aggregate_uses_lm_evals_mean_per_filter(gsm8k):
    rows = [run_doc(gsm8k, 0, out)[0] for out in ("#### 18", "18", "#### 7")]
    agg = gsm8k.aggregate(rows)
    assert agg["gsm8k/exact_match,strict-match"] == pytest.approx(1 / 3)
    assert agg["gsm8k/exact_match,flexible-extract"] == pytest.approx(2 / 3)
    assert agg["score"] == pytest.approx(1 / 3)
    assert agg["n"] == 3


def test_column_names():
    assert column("exact_match", "strict-match") == "exact_match_strict_match"
    assert column("acc_norm", "none") == "acc_norm_none"


# --- bad input: one ConfigError line --------------------------------------------------------------


def test_missing_data_file(tmp_path):
    task = build_task({"name": "gsm8k", "source": "local"}, tmp_path, 0)
    with pytest.raises(ConfigError, match=r"gsm8k/test\.jsonl") as err:
        task.samples()
    assert err.value.key == "data.root"
    assert "\n" not in str(err.value)


def test_missing_train_file(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    with pytest.raises(ConfigError, match=r"gsm8k/train\.jsonl"):
        build_task({"name": "gsm8k", "source": "local"}, tmp_path, 0).samples()


@pytest.mark.parametrize(
    ("node", "key"),
    [
        ({"variant": "gsm8k_cot_self_consistency"}, "task.variant"),
        ({"source": "web"}, "task.source"),
        ({"num_fewshot": -1}, "task.num_fewshot"),
        ({"max_gen_toks": 0}, "task.max_gen_toks"),
        ({"chunk": 0}, "task.chunk"),
        ({"shots": 5}, "task.shots"),
    ],
)
def test_bad_config(data_root, node, key):
    with pytest.raises(ConfigError) as err:
        build_task({"name": "gsm8k", **node}, data_root, 0)
    assert err.value.key == key


def test_unknown_lm_eval_task_name_suggests_close_matches():
    manager = task_manager(str(lm_eval_gsm8k_dir()), False)
    with pytest.raises(ConfigError, match=r"not an lm-eval task.*close matches: gsm8k") as err:
        load_lm_eval_task(manager, "gsm8kk")
    assert err.value.key == "task.tasks"
    assert "\n" not in str(err.value)
