"""LongBench task: config errors, data sources, middle truncation, the chat-template rule, context
checks, aggregation in points, command-line errors and one real sample."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbench.cache import MemoryReport
from kvbench.errors import ConfigError
from kvbench.methods import ModelShape
from kvbench.tasks import build_task
from kvbench.tasks.longbench import (
    ENGLISH_TASKS,
    GROUPS,
    chat_overhead,
    middle_truncate,
    resolve_source,
)
from kvbench.tasks.longbench_metrics import score_sample

SHAPE_4K = ModelShape(num_layers=2, num_heads=2, num_kv_heads=2, head_dim=8, max_context=4096)


def longbench(data_root, **overrides):
    return build_task({"name": "longbench", **overrides}, data_root, seed=0)


class CharTokenizer:
    """One token per character, plus a BOS (id 0) that a plain call adds and decoding can skip."""

    chat_template = None

    def __call__(self, text, add_special_tokens=True, return_tensors=None):
        return SimpleNamespace(input_ids=([0] if add_special_tokens else []) + [ord(c) for c in text])

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<s>" if i == 0 else chr(i) for i in ids if not (skip_special_tokens and i == 0))


# --- config ----------------------------------------------------------------------------------------


def test_unknown_task_lists_the_sixteen(data_root):
    with pytest.raises(ConfigError) as err:
        longbench(data_root, tasks=["hotpotqa", "lsht_en"])
    assert err.value.key == "task.tasks" and err.value.value == ["lsht_en"]
    assert all(t in err.value.allowed for t in ENGLISH_TASKS) and len(ENGLISH_TASKS) == 16


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"tasks": ["trec", "trec"]}, "task.tasks"),
        ({"tasks": []}, "task.tasks"),
        ({"source": "github"}, "task.source"),
        ({"max_prompt_tokens": 1}, "task.max_prompt_tokens"),
        ({"limit_per_task": 0}, "task.limit_per_task"),
        ({"max_new_tokens_cap": True}, "task.max_new_tokens_cap"),
    ],
)
def test_bad_values_name_their_key(data_root, overrides, key):
    with pytest.raises(ConfigError) as err:
        longbench(data_root, **overrides)
    assert err.value.key == key


def test_one_task_as_a_string(data_root):
    assert longbench(data_root, tasks="trec").config.tasks == ["trec"]
    with pytest.raises(ConfigError):
        longbench(data_root, tasks="Trec")


def test_groups_cover_the_sixteen_once():
    flat = [t for tasks in GROUPS.values() for t in tasks]
    assert sorted(flat) == sorted(ENGLISH_TASKS) and len(set(flat)) == 16
    assert GROUPS["few_shot"] == ("trec", "triviaqa", "samsum") and GROUPS["code"] == ("lcc", "repobench-p")


def test_conf_node_is_the_official_protocol(data_root):
    from omegaconf import OmegaConf

    node = OmegaConf.load(Path(__file__).parents[2] / "kvbench" / "conf" / "task" / "longbench.yaml")
    task = build_task(node, data_root, seed=0)
    assert task.config == longbench(data_root).config
    assert task.config.tasks == list(ENGLISH_TASKS)
    assert task.config.max_new_tokens_cap is None and task.config.max_prompt_tokens == 3500


# --- data ------------------------------------------------------------------------------------------


def test_minilongbench_samples(data_root):
    task = longbench(data_root, limit_per_task=2)
    samples = task.samples()
    assert task.subset == "minilongbench"
    # 16 tasks, 2 each
    assert len(samples) == 32 and len({s["id"] for s in samples}) == 32
    assert (
        samples[0]["id"] == "minilongbench/narrativeqa/0"
        and samples[-1]["id"] == "minilongbench/repobench-p/1"
    )
    assert [s["longbench_task"] for s in samples[::2]] == list(ENGLISH_TASKS)
    trec = next(s for s in samples if s["longbench_task"] == "trec")
    assert len(trec["all_classes"]) == 50 and trec["answers"][0] in trec["all_classes"]
    # without a limit, every row of the file (the fixture keeps two per task)
    assert len(longbench(data_root, tasks=["passage_count"]).samples()) == 2


def test_official_generation_lengths_and_cap(data_root):
    task = longbench(data_root)
    assert [task.max_new_tokens(t) for t in ("gov_report", "hotpotqa", "trec", "lcc")] == [512, 32, 64, 64]
    capped = longbench(data_root, max_new_tokens_cap=64)
    assert [capped.max_new_tokens(t) for t in ("gov_report", "qasper", "hotpotqa")] == [64, 64, 32]


def test_auto_source_prefers_the_full_split(tmp_path):
    assert resolve_source("auto", tmp_path, ["trec"]) == "hub"  # nothing local: the Hub
    (tmp_path / "longbench/minilongbench_extracted").mkdir(parents=True)
    (tmp_path / "longbench/minilongbench_extracted/trec.jsonl").write_text("")
    assert resolve_source("auto", tmp_path, ["trec"]) == "minilongbench"
    assert resolve_source("auto", tmp_path, ["trec", "lcc"]) == "hub"  # lcc missing from the subset
    (tmp_path / "longbench/data").mkdir()
    (tmp_path / "longbench/data/trec.jsonl").write_text("")
    assert resolve_source("auto", tmp_path, ["trec"]) == "hub"
    assert resolve_source("minilongbench", tmp_path, ["trec"]) == "minilongbench"


def test_full_split_files_in_the_data_root(tmp_path, data_root):
    shutil.copytree(data_root / "longbench/config", tmp_path / "longbench/config")
    row = {"input": "q?", "context": "ctx", "answers": ["a"], "all_classes": None, "_id": "abc123"}
    (tmp_path / "longbench/data").mkdir()
    (tmp_path / "longbench/data/hotpotqa.jsonl").write_text(json.dumps(row) + "\n")
    task = longbench(tmp_path, tasks=["hotpotqa"])
    (sample,) = task.samples()
    assert task.subset == "longbench" and sample["id"] == "longbench/hotpotqa/abc123"
    assert (sample["context"], sample["input"], sample["answers"]) == ("ctx", "q?", ["a"])


def test_missing_subset_file_names_it(tmp_path, data_root):
    shutil.copytree(data_root / "longbench/config", tmp_path / "longbench/config")
    with pytest.raises(ConfigError, match="minilongbench_extracted/trec.jsonl") as err:
        longbench(tmp_path, tasks=["trec"], source="minilongbench").samples()
    assert err.value.key == "data.root"


def test_missing_templates_name_them(tmp_path):
    with pytest.raises(ConfigError, match="dataset2prompt.json"):
        longbench(tmp_path, source="minilongbench").samples()


# --- truncation, templates, context ---------------------------------------------------------------


def test_middle_truncation_keeps_both_ends():
    tok = CharTokenizer()
    # "abcdefghij" counts 11 tokens with the BOS; budget 10 -> halves of 5: [BOS a b c d] + [f g h i j]
    assert middle_truncate(tok, "abcdefghij", 10) == ("abcdfghij", True)
    # odd budget 7 -> halves of 3: [BOS a b] + [h i j]
    assert middle_truncate(tok, "abcdefghij", 7) == ("abhij", True)
    assert middle_truncate(tok, "abcdefghij", 11) == ("abcdefghij", False)


def test_context_check_counts_prompt_template_and_generation(data_root):
    tok = CharTokenizer()  # no chat template: 0 extra tokens
    # gov_report: 3500 + 512 = 4012 <= 4096 fits; 3600 + 512 = 4112 does not
    longbench(data_root, tasks=["gov_report"], max_prompt_tokens=3500).check_model(SHAPE_4K, tok)
    with pytest.raises(ConfigError, match="max_prompt_tokens <= 3584") as err:
        longbench(data_root, tasks=["gov_report"], max_prompt_tokens=3600).check_model(SHAPE_4K, tok)
    assert err.value.key == "task.max_prompt_tokens"
    # the same budget fits a task with 32 generated tokens (3600 + 32 <= 4096)
    longbench(data_root, tasks=["hotpotqa"], max_prompt_tokens=3600).check_model(SHAPE_4K, tok)


def test_chat_template_rule_with_the_real_tokenizer(data_root, tokenizer):
    task = longbench(data_root, tasks=["hotpotqa", "lcc", "trec"], limit_per_task=1, max_prompt_tokens=400)
    by_task = {s["longbench_task"]: s for s in task.samples()}
    ids, truncated, chat = task.build_input(by_task["hotpotqa"], tokenizer)
    text = tokenizer.decode(ids[0])
    assert chat and truncated and "<|im_start|>user" in text and text.rstrip().endswith("assistant")
    # the question at the end of the prompt survives the middle truncation
    assert by_task["hotpotqa"]["input"] in text and text.count("Answer the question based on") == 2
    # 400 prompt tokens (re-tokenizing at the seam may move one or two) plus the template's own
    assert abs(ids.shape[1] - 400 - chat_overhead(tokenizer, "hotpotqa")) <= 4
    for raw in ("lcc", "trec"):
        ids, truncated, chat = task.build_input(by_task[raw], tokenizer)
        text = tokenizer.decode(ids[0])
        assert not chat and truncated and "<|im_start|>" not in text
        assert abs(ids.shape[1] - 400) <= 4  # re-tokenizing at the seam may move a token or two
    assert tokenizer.decode(task.build_input(by_task["lcc"], tokenizer)[0][0]).endswith(
        "Next line of code:\n"
    )


# --- aggregation -----------------------------------------------------------------------------------


def test_aggregate_is_the_mean_of_task_scores_in_points(data_root):
    rows = [
        {"longbench_task": "hotpotqa", "score": 1.0, "subset": "minilongbench"},
        {"longbench_task": "hotpotqa", "score": 0.5, "subset": "minilongbench"},  # hotpotqa 75
        {"longbench_task": "musique", "score": 0.25, "subset": "minilongbench"},  # musique 25
        {"longbench_task": "lcc", "score": 0.6, "subset": "minilongbench"},  # lcc 60
    ]
    out = longbench(data_root).aggregate(rows)
    assert (
        out["score_hotpotqa"] == 75 and out["score_musique"] == 25 and out["score_lcc"] == pytest.approx(60)
    )
    assert out["group_multi_doc_qa"] == 50  # (75 + 25) / 2
    assert out["group_code"] == pytest.approx(60)
    assert out["score"] == pytest.approx((75 + 25 + 60) / 3)  # mean of tasks, not of the 4 samples
    assert out["n"] == 4 and out["n_hotpotqa"] == 2 and out["tasks_scored"] == 3
    assert out["subset"] == "minilongbench" and "group_summarization" not in out


# --- command line ----------------------------------------------------------------------------------


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "kvbench", "task=longbench", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


def one_error_line(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kvbench: error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


def test_cli_unknown_task(tmp_path):
    line = one_error_line(run_cli("task.tasks=[hotpotqa,nope]", f"output.root={tmp_path}"))
    assert line.startswith("kvbench: error: task.tasks=['nope']: LongBench v1 English tasks are narrativeqa,")
    assert line.endswith("lcc, repobench-p")


def test_cli_missing_data_file(tmp_path, data_root):
    root = tmp_path / "data"
    shutil.copytree(data_root / "longbench/config", root / "longbench/config")
    line = one_error_line(
        run_cli("task.source=minilongbench", f"data.root={root}", f"output.root={tmp_path}/out")
    )
    assert (
        line.startswith("kvbench: error: data.root=") and "minilongbench_extracted/narrativeqa.jsonl" in line
    )


def test_cli_hub_unreachable(tmp_path, data_root):
    root = tmp_path / "data"
    shutil.copytree(data_root / "longbench/config", root / "longbench/config")
    proc = run_cli(
        "task.source=hub", f"data.root={root}", f"output.root={tmp_path}/out", env={"HF_HUB_OFFLINE": "1"}
    )
    assert one_error_line(proc).startswith("kvbench: error: task.source='hub': cannot fetch THUDM/LongBench")


@pytest.mark.slow
def test_cli_prompt_budget_above_the_context(tmp_path, data_root):
    # smollm2-135m: 8192 tokens of context; gov_report generates 512, so 8000 cannot fit
    proc = run_cli(
        "task.max_prompt_tokens=8000",
        "task.limit_per_task=1",
        f"data.root={data_root}",
        f"output.root={tmp_path}",
    )
    line = one_error_line(proc)
    assert line.startswith("kvbench: error: task.max_prompt_tokens=8000: gov_report needs 8000 prompt")
    assert "over the model's context of 8192" in line


# --- one real sample -------------------------------------------------------------------------------


@pytest.mark.slow
def test_end_to_end_fp16(data_root, fp16_runner):
    task = longbench(data_root, tasks=["passage_retrieval_en"], limit_per_task=1, max_prompt_tokens=300)
    task.check_model(fp16_runner.shape, fp16_runner.tokenizer)
    (sample,) = task.samples()
    row = task.run(sample, fp16_runner)
    assert row["longbench_task"] == "passage_retrieval_en" and row["group"] == "synthetic"
    assert row["truncated"] and row["chat_template"] and row["subset"] == "minilongbench"
    assert 300 < row["prompt_tokens"] <= 300 + 60  # the budget plus the chat template
    assert row["answers"] == sample["answers"] and row["max_new_tokens"] == 32
    assert row["score"] == score_sample(
        "retrieval", "passage_retrieval_en", row["prediction"], row["answers"]
    )
    assert 0 < row["generated_tokens"] <= 32 and (row["stopped"] or row["generated_tokens"] == 32)
    assert isinstance(row["memory"], MemoryReport) and row["memory"].tokens >= row["prompt_tokens"]
