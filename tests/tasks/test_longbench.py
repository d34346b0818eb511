"""LongBench task: config errors, data sources, middle truncation, the chat-template rule, context
checks, aggregation in points, command-line errors and one real sample; the Chinese tasks on
hand-made rows in a temporary data root (local files and the Hub's archive)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvbench.cache import MemoryReport
from kvbench.errors import ConfigError
from kvbench.methods import ModelShape
from kvbench.tasks import build_task
from kvbench.tasks.longbench import (
    ALL_TASKS,
    CHINESE_TASKS,
    ENGLISH_TASKS,
    GROUPS,
    METRIC_OF,
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


def test_unknown_task_lists_the_twenty_one(data_root):
    with pytest.raises(ConfigError) as err:
        longbench(data_root, tasks=["hotpotqa", "lsht_en"])
    assert err.value.key == "task.tasks" and err.value.value == ["lsht_en"]
    assert all(t in err.value.allowed for t in ALL_TASKS) and len(ALL_TASKS) == 21
    assert "zh (the 5 Chinese tasks)" in err.value.allowed


def test_task_sets_by_name(data_root):
    assert longbench(data_root, tasks="zh").config.tasks == list(CHINESE_TASKS)
    assert longbench(data_root, tasks="en").config.tasks == list(ENGLISH_TASKS)
    assert longbench(data_root, tasks="all").config.tasks == list(ALL_TASKS)
    assert CHINESE_TASKS == ("multifieldqa_zh", "dureader", "vcsum", "lsht", "passage_retrieval_zh")
    # the official scorer's routing of the five
    assert [METRIC_OF[t] for t in CHINESE_TASKS] == [
        "qa_f1_zh",
        "rouge_zh",
        "rouge_zh",
        "classification",
        "retrieval_zh",
    ]


def test_chinese_tasks_need_jieba(data_root, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "jieba" else find_spec(n, *a))
    with pytest.raises(ConfigError, match="pip install jieba") as err:
        longbench(data_root, tasks=["trec", "lsht", "vcsum"])
    assert err.value.key == "task.tasks" and err.value.value == ["lsht", "vcsum"]
    longbench(data_root, tasks=["trec"])  # English tasks do not need it


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({"tasks": ["trec", "trec"]}, "task.tasks"),
        ({"tasks": []}, "task.tasks"),
        ({"source": "github"}, "task.source"),
        ({"max_prompt_tokens": 1}, "task.max_prompt_tokens"),
        ({"limit_per_task": 0}, "task.limit_per_task"),
        ({"max_new_tokens_cap": True}, "task.max_new_tokens_cap"),
        ({"code_sim_backend": "rapidfuzz"}, "task.code_sim_backend"),
        ({"tasks": ["lsht", "lsht"]}, "task.tasks"),
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


def test_groups_cover_the_twenty_one_once():
    flat = [t for tasks in GROUPS.values() for t in tasks]
    assert sorted(flat) == sorted(ALL_TASKS) and len(set(flat)) == 21
    assert GROUPS["few_shot"] == ("trec", "triviaqa", "samsum") and GROUPS["code"] == ("lcc", "repobench-p")
    assert GROUPS["zh_few_shot"] == ("lsht",) and GROUPS["zh_multi_doc_qa"] == ("dureader",)
    assert len(ENGLISH_TASKS) == 16 and not set(ENGLISH_TASKS) & set(CHINESE_TASKS)


def test_conf_node_is_the_official_protocol(data_root):
    from omegaconf import OmegaConf

    node = OmegaConf.load(Path(__file__).parents[2] / "kvbench" / "conf" / "task" / "longbench.yaml")
    task = build_task(node, data_root, seed=0)
    assert task.config == longbench(data_root).config
    assert task.config.tasks == list(ENGLISH_TASKS)
    assert task.config.max_new_tokens_cap is None and task.config.max_prompt_tokens == 3500
    assert task.config.code_sim_backend == "levenshtein"  # the scores kvbench has always reported


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


# --- the Chinese tasks on hand-made rows ------------------------------------------------------------

# One row per task in LongBench's row format, written for these tests (not LongBench data).
ZH_ROWS = {
    "multifieldqa_zh": {
        "input": "曹雪芹写了哪部小说？",
        "context": "《红楼梦》是清代作家曹雪芹创作的章回体长篇小说。",
        "answers": ["《红楼梦》"],
        "all_classes": None,
        "_id": "zh-mf-1",
    },
    "lsht": {
        "input": "新闻：国足今晚在主场迎战日本队。\n类别：",
        "context": "新闻：央行宣布下调存款准备金率。\n类别：财经\n新闻：皇马客场战胜巴萨。\n类别：国际足球",
        "answers": ["国际足球"],
        "all_classes": ["财经", "国际足球", "足球"],
        "_id": "zh-lsht-1",
    },
    "passage_retrieval_zh": {
        "input": "一座城市修建了新的图书馆。",
        "context": "段落1：今年夏天雨水很多。\n\n段落2：市政府宣布新图书馆正式开放。",
        "answers": ["段落2"],
        "all_classes": None,
        "_id": "zh-pr-1",
    },
}


def zh_root(tmp_path, data_root, tasks=tuple(ZH_ROWS)):
    """A data root holding the official config files and the hand-made rows as the full split."""
    root = tmp_path / "zh"
    shutil.copytree(data_root / "longbench/config", root / "longbench/config")
    (root / "longbench/data").mkdir(parents=True)
    for task in tasks:
        line = json.dumps(ZH_ROWS[task], ensure_ascii=False) + "\n"
        (root / f"longbench/data/{task}.jsonl").write_text(line, encoding="utf-8")
    return root


def test_chinese_prompts_and_lengths_are_the_official_ones(data_root):
    task = longbench(data_root, tasks="zh")
    assert [task.max_new_tokens(t) for t in CHINESE_TASKS] == [64, 128, 512, 64, 32]
    templates = task.protocol()[0]
    assert templates["multifieldqa_zh"].startswith("阅读以下文字并用中文简短回答：\n\n{context}")
    assert templates["lsht"] == "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}"
    assert '答案格式必须是"段落1"' in templates["passage_retrieval_zh"]
    assert templates["vcsum"].endswith("会议记录：\n{context}\n\n会议总结：")


def test_chinese_rows_from_the_data_root(tmp_path, data_root):
    task = longbench(zh_root(tmp_path, data_root), tasks=list(ZH_ROWS))
    samples = task.samples()
    assert task.subset == "longbench"
    assert [s["id"] for s in samples] == [
        "longbench/multifieldqa_zh/zh-mf-1",
        "longbench/lsht/zh-lsht-1",
        "longbench/passage_retrieval_zh/zh-pr-1",
    ]
    mf, lsht, pr = samples
    assert lsht["all_classes"] == ["财经", "国际足球", "足球"] and pr["answers"] == ["段落2"]
    # the filled template, raw (CharTokenizer has no chat template; lsht is raw for every model)
    tok = CharTokenizer()
    ids, truncated, chat = task.build_input(lsht, tok)
    expected = "请判断给定新闻的类别，下面是一些例子。\n\n" + lsht["context"] + "\n" + lsht["input"]
    assert tok.decode(ids, skip_special_tokens=True) == expected and not truncated and not chat
    # middle truncation cuts Chinese text like any other: budget 20 keeps [BOS + 9] and the last 10
    ids, truncated, _ = longbench(task.data_root, tasks=["lsht"], max_prompt_tokens=20).build_input(lsht, tok)
    text = tok.decode(ids, skip_special_tokens=True)
    assert truncated and text.startswith(expected[:9]) and text.endswith(expected[-10:]) and len(text) == 19


def test_chinese_rows_are_scored_with_their_metrics(tmp_path, data_root):
    task = longbench(zh_root(tmp_path, data_root), tasks=list(ZH_ROWS))
    mf, lsht, pr = task.samples()
    # multifieldqa_zh: pred [红楼梦], gold [《, 红楼梦] ("《" is no punctuation to the scorer):
    # p = 1, r = 1/2, F1 = 2/3
    assert task.score(mf, "红楼梦") == pytest.approx(2 / 3)
    # lsht: first line only; matched [国际足球, 足球], 足球 dropped inside the gold -> 1
    assert task.score(lsht, "国际足球\n新闻：下一条") == 1.0
    assert task.score(lsht, "财经") == 0.0
    # passage_retrieval_zh: integers 1 and 2, one of them right -> 1/2
    assert task.score(pr, "段落2") == 1.0 and task.score(pr, "段落1或段落2") == 0.5


def test_code_sim_backend_reaches_the_score(data_root):
    # "aba" against the gold "bca": LCS 2 of 6 characters -> 0.67; difflib's greedy block 1 -> 0.33
    sample = {"longbench_task": "lcc", "answers": ["bca"], "all_classes": None}
    assert longbench(data_root, tasks=["lcc"]).score(sample, "aba") == 0.67
    assert longbench(data_root, tasks=["lcc"], code_sim_backend="difflib").score(sample, "aba") == 0.33


def test_chinese_rows_from_the_hub_archive(tmp_path, data_root, monkeypatch):
    root = zh_root(tmp_path, data_root, tasks=())  # the config files only: auto goes to the Hub
    archive = tmp_path / "data.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("data/lsht.jsonl", json.dumps(ZH_ROWS["lsht"], ensure_ascii=False) + "\n")
    import huggingface_hub

    asked = []

    def download(repo, filename, repo_type=None):
        asked.append((repo, filename, repo_type))
        return str(archive)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    task = longbench(root, tasks=["lsht"])
    (sample,) = task.samples()
    assert asked == [("THUDM/LongBench", "data.zip", "dataset")] and task.source == "hub"
    assert sample["id"] == "longbench/lsht/zh-lsht-1" and sample["input"] == ZH_ROWS["lsht"]["input"]
    with pytest.raises(ConfigError, match="no data/vcsum.jsonl in THUDM/LongBench/data.zip"):
        longbench(root, tasks=["vcsum"]).samples()


def test_auto_source_with_chinese_tasks_and_an_english_subset(data_root):
    # the committed MiniLongBench excerpt has no Chinese rows: a run naming lsht goes to the full split
    assert resolve_source("auto", data_root, ["trec"]) == "minilongbench"
    assert resolve_source("auto", data_root, ["trec", "lsht"]) == "hub"


def test_templates_without_the_chinese_tasks_name_them(tmp_path, data_root):
    root = zh_root(tmp_path, data_root, tasks=["lsht"])
    prompts = root / "longbench/config/dataset2prompt.json"
    table = json.loads(prompts.read_text(encoding="utf-8"))
    prompts.write_text(json.dumps({k: v for k, v in table.items() if k not in CHINESE_TASKS}))
    with pytest.raises(ConfigError, match="dataset2prompt.json has no entry") as err:
        longbench(root, tasks=["trec", "lsht", "vcsum"]).samples()
    assert err.value.key == "task.tasks" and err.value.value == ["lsht", "vcsum"]
    longbench(root, tasks=["trec"]).protocol()  # the English tasks alone still run


def test_context_check_covers_the_chinese_lengths(data_root):
    tok = CharTokenizer()
    # vcsum generates 512: 3500 + 512 fits 4096, 3600 + 512 does not
    longbench(data_root, tasks="zh", max_prompt_tokens=3500).check_model(SHAPE_4K, tok)
    with pytest.raises(ConfigError, match="vcsum needs 3600 prompt"):
        longbench(data_root, tasks="zh", max_prompt_tokens=3600).check_model(SHAPE_4K, tok)


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
    assert "score_en" not in out and "jieba_version" not in out  # no language split without Chinese tasks
    assert out["code_sim_backend"] == "levenshtein"


def test_aggregate_with_chinese_tasks(data_root):
    rows = [
        {"longbench_task": "hotpotqa", "score": 1.0},  # 100
        {"longbench_task": "lcc", "score": 0.5},  # 50
        {"longbench_task": "lsht", "score": 1.0},
        {"longbench_task": "lsht", "score": 0.0},  # 50
        {"longbench_task": "vcsum", "score": 0.2},  # 20
    ]
    out = longbench(data_root, tasks="all", code_sim_backend="difflib").aggregate(rows)
    assert out["score"] == pytest.approx((100 + 50 + 50 + 20) / 4)  # every task scored
    assert out["score_en"] == pytest.approx(75) and out["score_zh"] == pytest.approx(35)
    assert out["group_zh_few_shot"] == 50 and out["group_zh_summarization"] == pytest.approx(20)
    assert out["group_multi_doc_qa"] == 100 and out["group_code"] == 50  # English groups: English tasks only
    assert out["n_lsht"] == 2 and out["tasks_scored"] == 4 and out["code_sim_backend"] == "difflib"
    assert out["jieba_version"] == importlib.metadata.version("jieba")


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
    assert line.startswith("kvbench: error: task.tasks=['nope']: LongBench v1 tasks are narrativeqa,")
    assert "passage_retrieval_zh, lcc, repobench-p; or one of en (" in line and line.endswith("all")


def test_cli_unknown_code_sim_backend(tmp_path):
    line = one_error_line(run_cli("task.code_sim_backend=fuzzy", f"output.root={tmp_path}"))
    assert line == "kvbench: error: task.code_sim_backend='fuzzy': allowed: levenshtein, difflib"


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


@pytest.mark.slow
def test_end_to_end_fp16_chinese_row(tmp_path, data_root, fp16_runner):
    # 8 new tokens (recorded as the cap) keep it short; the official length for the task is 32
    task = longbench(zh_root(tmp_path, data_root), tasks=["passage_retrieval_zh"], max_new_tokens_cap=8)
    task.check_model(fp16_runner.shape, fp16_runner.tokenizer)
    (sample,) = task.samples()
    row = task.run(sample, fp16_runner)
    assert row["longbench_task"] == "passage_retrieval_zh" and row["group"] == "zh_synthetic"
    assert row["metric"] == "retrieval_zh" and row["chat_template"] and not row["truncated"]
    assert row["subset"] == "longbench" and row["max_new_tokens"] == 8 and row["answers"] == ["段落2"]
    assert row["score"] == score_sample("retrieval_zh", "passage_retrieval_zh", row["prediction"], ["段落2"])
    assert 0 < row["generated_tokens"] <= 8
