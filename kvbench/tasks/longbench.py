"""``longbench``: LongBench v1, all 21 tasks, under the benchmark's own prediction protocol.

Bai et al., "LongBench: A Bilingual, Multitask Benchmark for Long Context Understanding" (ACL 2024).
KIVI, SpeCache and most KV-cache quantization papers report LongBench with the official scripts
(``pred.py`` for generation, ``eval.py``/``metrics.py`` for scoring); this task follows them so a
kvbench number means the same thing. The default is the 16 tasks those papers report (14 English and
the 2 code tasks); the 5 Chinese tasks (multifieldqa_zh, dureader, vcsum, lsht, passage_retrieval_zh)
run when named (``task.tasks=zh`` for the five, ``task.tasks=all`` for all 21) and go through the same
protocol:

1. **Prompt.** The task's official template (``<data_root>/longbench/config/dataset2prompt.json``,
   read at run time) filled with the sample's ``context`` and ``input``.
2. **Middle truncation.** The filled prompt is tokenized as the official script does (with the
   tokenizer's special tokens). If it has more than ``max_prompt_tokens`` tokens, it becomes the text
   of its first ``max_prompt_tokens // 2`` tokens followed by the text of its last
   ``max_prompt_tokens // 2`` tokens (special tokens skipped), so the instructions at both ends
   survive and the middle of the context is dropped.
3. **Chat template** (``chat_template``). Every task except the few-shot and code tasks (trec,
   triviaqa, samsum, lsht, lcc, repobench-p) puts the truncated prompt in the model's chat template
   as one user turn, with the generation prompt appended; those six stay raw text whatever the
   setting, as in the official script. ``auto`` (default): the template where the tokenizer has one,
   else every prompt raw; ``on``: the same, but a tokenizer without a template is an error before the
   weights load (when any chosen task would use it); ``off``: every prompt raw. Rows record
   ``prompt_format`` (``chat``/``raw``) and ``chat_template`` (a bool); the metrics' ``prompt_format``
   is ``chat`` when any prompt went through the template, else ``raw``.
4. **Greedy decoding** of at most the task's official generation length
   (``<data_root>/longbench/config/dataset2maxlen.json``), stopping at EOS. samsum, as in the
   official script, also stops at the newline token and may not stop on the first token.
   ``max_new_tokens_cap`` (default off) lowers the lengths for slow hardware; it is recorded in every
   row and in the metrics.
5. **Scoring** (:mod:`kvbench.tasks.longbench_metrics`, routed by ``METRIC_OF`` as the official
   ``dataset2metric``): trec/triviaqa/samsum/lsht keep only the first line of the prediction; the
   task's metric is taken against every gold answer and the best kept. The Chinese metrics segment
   text with jieba, whose dictionary loads only when a Chinese task is scored. ``code_sim_backend``
   picks the string matcher behind lcc and repobench-p (the official scorer's result depends on
   whether python-Levenshtein is installed): ``levenshtein`` (default) or ``difflib``.

Per-sample ``score`` is in [0, 1]. The task score is the mean over its samples in points (x100), a
group score the mean of its task scores, and ``score`` in the metrics the mean of all task scores, as
the papers' "Average" column. The Chinese tasks form their own groups (``zh_single_doc_qa``, ...; one
task each, as in LongBench's Chinese table), so the English group scores keep their meaning; a run
with Chinese tasks also reports ``score_en`` (the mean over the 16 default tasks it scored),
``score_zh`` (over the Chinese ones) and the ``jieba_version`` that segmented them.

Data (``source``), the same for every task:

- ``minilongbench``: the MiniLongBench subset (arXiv 2505.19959; 237 samples over the 21 tasks, 187
  of them in the 16 default tasks) in ``<data_root>/longbench/minilongbench_extracted/<task>.jsonl``.
  Its repobench-p rows hold the whole ``{context}{input}`` text in ``context`` with an empty
  ``input``; the template concatenates the two with nothing between, so the prompt is the official
  one.
- ``hub``: the full LongBench test split: ``<data_root>/longbench/data/<task>.jsonl`` (the Hub's
  ``data.zip`` unpacked into the data root; it holds all 21 tasks) when present, else ``data.zip``
  from the ``THUDM/LongBench`` dataset repository on the Hugging Face Hub (cached by
  ``huggingface_hub``).
- ``auto``: the full split in the data root, else the MiniLongBench subset in the data root, else the
  Hub.

Rows and metrics name the subset (``longbench`` or ``minilongbench``), and sample ids start with it,
so results from the two never mix.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvbench.config import check_choice, inert, require
from kvbench.data import parse_json_lines, read_json, read_json_lines, require_file
from kvbench.errors import ConfigError
from kvbench.tasks.base import GENERATION_ROW_DTYPES, Metric, Task, TaskConfig, Work, register_task
from kvbench.tasks.longbench_metrics import CODE_SIM_BACKENDS, score_sample
from kvbench.tasks.niah import CHAT_TEMPLATE_MODES, prompt_format

# The papers' grouping of the 16 English and code tasks, in LongBench's table order.
ENGLISH_GROUPS: dict[str, tuple[str, ...]] = {
    "single_doc_qa": ("narrativeqa", "qasper", "multifieldqa_en"),
    "multi_doc_qa": ("hotpotqa", "2wikimqa", "musique"),
    "summarization": ("gov_report", "qmsum", "multi_news"),
    "few_shot": ("trec", "triviaqa", "samsum"),
    "synthetic": ("passage_count", "passage_retrieval_en"),
    "code": ("lcc", "repobench-p"),
}
# The Chinese tasks, one per category of LongBench's Chinese table (whose code column is the same
# two code tasks).
CHINESE_GROUPS: dict[str, tuple[str, ...]] = {
    "zh_single_doc_qa": ("multifieldqa_zh",),
    "zh_multi_doc_qa": ("dureader",),
    "zh_summarization": ("vcsum",),
    "zh_few_shot": ("lsht",),
    "zh_synthetic": ("passage_retrieval_zh",),
}
GROUPS: dict[str, tuple[str, ...]] = {**ENGLISH_GROUPS, **CHINESE_GROUPS}
ENGLISH_TASKS: tuple[str, ...] = tuple(t for tasks in ENGLISH_GROUPS.values() for t in tasks)
CHINESE_TASKS: tuple[str, ...] = tuple(t for tasks in CHINESE_GROUPS.values() for t in tasks)
# All 21, in the official scripts' order.
ALL_TASKS: tuple[str, ...] = (
    *("narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh"),
    *("hotpotqa", "2wikimqa", "musique", "dureader"),
    *("gov_report", "qmsum", "multi_news", "vcsum"),
    *("trec", "triviaqa", "samsum", "lsht"),
    *("passage_count", "passage_retrieval_en", "passage_retrieval_zh"),
    *("lcc", "repobench-p"),
)
# ``task.tasks=<name>`` for a whole language.
TASK_SETS: dict[str, tuple[str, ...]] = {"en": ENGLISH_TASKS, "zh": CHINESE_TASKS, "all": ALL_TASKS}
GROUP_OF: dict[str, str] = {t: g for g, tasks in GROUPS.items() for t in tasks}

METRIC_OF: dict[str, str] = {
    **dict.fromkeys(("narrativeqa", "qasper", "multifieldqa_en"), "qa_f1"),
    **dict.fromkeys(("hotpotqa", "2wikimqa", "musique", "triviaqa"), "qa_f1"),
    **dict.fromkeys(("gov_report", "qmsum", "multi_news", "samsum"), "rouge_l"),
    "trec": "classification",
    "passage_count": "count",
    "passage_retrieval_en": "retrieval",
    **dict.fromkeys(("lcc", "repobench-p"), "code_sim"),
    "multifieldqa_zh": "qa_f1_zh",
    **dict.fromkeys(("dureader", "vcsum"), "rouge_zh"),
    "lsht": "classification",
    "passage_retrieval_zh": "retrieval_zh",
}

# Few-shot and code prompts go to the model as raw text: the official script skips the chat
# template for them.
NO_CHAT_TASKS = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})

SOURCES = ("auto", "hub", "minilongbench")
CONFIG_DIR = "longbench/config"
MINI_DIR = "longbench/minilongbench_extracted"
FULL_DIR = "longbench/data"
HUB_REPO = "THUDM/LongBench"
HUB_ARCHIVE = "data.zip"


@dataclass
class LongBenchConfig(TaskConfig):
    """``tasks`` lists LongBench task names, or names a set (``en``: the 16 default tasks, ``zh``: the
    5 Chinese ones, ``all``: all 21); ``max_prompt_tokens`` is the official truncation budget (3500 for
    4K-context models in LongBench's own runs); ``limit_per_task`` keeps the first N samples of each
    task; ``max_new_tokens_cap`` lowers the official generation lengths (null: the official ones);
    ``code_sim_backend`` is the string matcher of lcc and repobench-p: ``levenshtein`` (default, the
    official scorer with python-Levenshtein installed, and kvbench's scores from the start) or
    ``difflib`` (the official scorer without it); see :mod:`kvbench.tasks.longbench_metrics`.
    ``chat_template`` (auto, on, off) says when prompts go through the chat template (module doc,
    step 3)."""

    name: str = "longbench"
    version: int = 1
    tasks: list[str] = field(default_factory=lambda: list(ENGLISH_TASKS))
    source: str = "auto"
    max_prompt_tokens: int = 3500
    limit_per_task: int | None = None
    max_new_tokens_cap: int | None = None
    code_sim_backend: str = "levenshtein"
    chat_template: str = inert("auto")

    def __post_init__(self):
        super().__post_init__()
        check_choice("task.chat_template", self.chat_template, CHAT_TEMPLATE_MODES)
        if isinstance(self.tasks, str):  # task.tasks=hotpotqa names one task, task.tasks=zh a set
            self.tasks = list(TASK_SETS.get(self.tasks, [self.tasks]))
        tasks = list(self.tasks) if isinstance(self.tasks, Sequence) else []
        unknown = [t for t in tasks if t not in ALL_TASKS]
        require(
            bool(tasks) and not unknown,
            "task.tasks",
            unknown or self.tasks,
            f"LongBench v1 tasks are {', '.join(ALL_TASKS)}; or one of en (the 16 English and code "
            "tasks), zh (the 5 Chinese tasks), all",
        )
        require(len(set(tasks)) == len(tasks), "task.tasks", tasks, "no repeated tasks")
        self.tasks = tasks
        chinese = [t for t in tasks if t in CHINESE_TASKS]
        require(
            not chinese or importlib.util.find_spec("jieba") is not None,
            "task.tasks",
            chinese,
            "the Chinese tasks are scored on jieba's word segmentation, which is not installed "
            "(pip install jieba)",
        )
        check_choice("task.source", self.source, SOURCES)
        check_choice("task.code_sim_backend", self.code_sim_backend, CODE_SIM_BACKENDS)
        require(
            self.max_prompt_tokens >= 2,
            "task.max_prompt_tokens",
            self.max_prompt_tokens,
            "an int >= 2 (tokens kept: half from the start of the prompt, half from its end)",
        )
        for key in ("limit_per_task", "max_new_tokens_cap"):
            value = getattr(self, key)
            ok = value is None or value > 0
            require(ok, f"task.{key}", value, "a positive int or null")


def load_protocol(data_root: Path, tasks: Sequence[str] = ()) -> tuple[dict[str, str], dict[str, int]]:
    """The official prompt templates and generation lengths from the data root; each of ``tasks``
    must have both (a copy of the files older than the Chinese tasks would not)."""
    prompts = require_file(data_root, f"{CONFIG_DIR}/dataset2prompt.json", "LongBench prompt templates")
    lengths = require_file(data_root, f"{CONFIG_DIR}/dataset2maxlen.json", "LongBench generation lengths")
    templates, max_lengths = read_json(prompts), read_json(lengths)
    for path, table in ((prompts, templates), (lengths, max_lengths)):
        missing = [t for t in tasks if t not in table]
        if missing:
            why = f"{path} has no entry for them; use LongBench's own file"
            raise ConfigError("task.tasks", missing, why)
    return templates, max_lengths


def resolve_source(source: str, data_root: Path, tasks: Sequence[str]) -> str:
    """``hub`` or ``minilongbench`` for ``auto``, by what the data root holds (see the module doc)."""
    if source != "auto":
        return source
    if all((Path(data_root) / FULL_DIR / f"{t}.jsonl").is_file() for t in tasks):
        return "hub"
    if all((Path(data_root) / MINI_DIR / f"{t}.jsonl").is_file() for t in tasks):
        return "minilongbench"
    return "hub"


def subset_label(source: str) -> str:
    return "minilongbench" if source == "minilongbench" else "longbench"


def load_rows(source: str, data_root: Path, task: str) -> list[dict[str, Any]]:
    """The task's rows, in file order, from ``source`` (``hub`` or ``minilongbench``)."""
    if source == "minilongbench":
        path = require_file(data_root, f"{MINI_DIR}/{task}.jsonl", f"MiniLongBench subset ({task})")
        return read_json_lines(path)
    local = Path(data_root) / FULL_DIR / f"{task}.jsonl"
    if local.is_file():
        return read_json_lines(local)
    return parse_json_lines(_hub_lines(task), f"{HUB_REPO}/{HUB_ARCHIVE}:data/{task}.jsonl")


def _hub_lines(task: str) -> list[str]:
    """``data/<task>.jsonl`` from the Hub's ``data.zip`` (the dataset's own loading script reads the
    same archive; recent ``datasets`` releases no longer run loading scripts)."""
    try:
        from huggingface_hub import hf_hub_download

        archive = hf_hub_download(HUB_REPO, HUB_ARCHIVE, repo_type="dataset")
    except Exception as err:  # offline, blocked or missing: every failure means the same to the user
        raise ConfigError(
            "task.source",
            "hub",
            f"cannot fetch {HUB_REPO}/{HUB_ARCHIVE} from the Hugging Face Hub ({type(err).__name__}); "
            f"put the unpacked files in <data_root>/{FULL_DIR}/ or use task.source=minilongbench",
        ) from None
    with zipfile.ZipFile(archive) as z:
        try:
            return z.read(f"data/{task}.jsonl").decode("utf-8").splitlines()
        except KeyError:
            missing = f"no data/{task}.jsonl in {HUB_REPO}/{HUB_ARCHIVE}"
            raise ConfigError("task.tasks", task, missing) from None


def middle_truncate(tokenizer, prompt: str, budget: int) -> tuple[str, bool]:
    """The official middle truncation: ``(text, truncated)``. Counted with the tokenizer's special
    tokens, as the official script counts; the kept halves are decoded without them."""
    ids = tokenizer(prompt).input_ids
    if len(ids) <= budget:
        return prompt, False
    half = budget // 2
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[-half:], skip_special_tokens=True)
    return head + tail, True


def uses_chat(task: str, tokenizer, mode: str = "auto") -> bool:
    """Whether ``task``'s prompt goes through the chat template under ``task.chat_template=mode``;
    ``on`` with a tokenizer that has no template raises a ConfigError for a task that would use it."""
    return task not in NO_CHAT_TASKS and prompt_format(mode, tokenizer) == "chat"


def chat_text(tokenizer, prompt: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def encode_prompt(tokenizer, task: str, prompt: str, mode: str = "auto") -> tuple[torch.Tensor, bool]:
    """``(input_ids [1, T], chat)``. A chat prompt's special tokens are in its text (so none are
    added); a raw prompt gets the tokenizer's own (a BOS for Llama), as the official script's do."""
    chat = uses_chat(task, tokenizer, mode)
    text = chat_text(tokenizer, prompt) if chat else prompt
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=not chat).input_ids
    return ids, chat


def chat_overhead(tokenizer, task: str, mode: str = "auto") -> int:
    """Tokens the chat template adds around a prompt (0 for raw tasks)."""
    if not uses_chat(task, tokenizer, mode):
        return 0
    return len(tokenizer(chat_text(tokenizer, ""), add_special_tokens=False).input_ids)


@torch.no_grad()
def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


@register_task("longbench")
class LongBench(Task):
    Config = LongBenchConfig
    primary_metric = "score"
    metrics = {"score": Metric(True, "LongBench's per-task metric, in [0, 1] per sample")}
    row_dtypes = GENERATION_ROW_DTYPES

    @classmethod
    def sample_work(cls, config: LongBenchConfig) -> Work:
        # 128 new tokens: the middle of the tasks' generation caps
        return Work(config.max_prompt_tokens, 128, config.max_prompt_tokens)

    def __init__(self, config: LongBenchConfig, data_root: Path, seed: int = 0):
        super().__init__(config, data_root, seed)
        self._protocol: tuple[dict[str, str], dict[str, int]] | None = None
        self._source: str | None = None

    @property
    def source(self) -> str:
        if self._source is None:
            self._source = resolve_source(self.config.source, self.data_root, self.config.tasks)
        return self._source

    @property
    def subset(self) -> str:
        return subset_label(self.source)

    def protocol(self) -> tuple[dict[str, str], dict[str, int]]:
        if self._protocol is None:
            self._protocol = load_protocol(self.data_root, self.config.tasks)
        return self._protocol

    def max_new_tokens(self, task: str) -> int:
        official = int(self.protocol()[1][task])
        cap = self.config.max_new_tokens_cap
        return min(official, cap) if cap else official

    def samples(self) -> list[dict[str, Any]]:
        self.protocol()  # fail before any model work when the templates are missing
        source, subset = self.source, self.subset
        out = []
        for task in self.config.tasks:
            rows = load_rows(source, self.data_root, task)
            if self.config.limit_per_task:
                rows = rows[: self.config.limit_per_task]
            for i, row in enumerate(rows):
                key = row.get("_id") or str(i)
                out.append(
                    {
                        "id": f"{subset}/{task}/{key}",
                        "longbench_task": task,
                        "context": row["context"],
                        "input": row.get("input") or "",
                        "answers": list(row["answers"]),
                        "all_classes": row.get("all_classes"),
                    }
                )
        return out[: self.config.limit] if self.config.limit else out

    def check_model(self, shape, tokenizer) -> None:
        """``task.chat_template=on`` needs a chat template when any chosen task would use it, and every
        task's truncated prompt, chat template and official generation must fit the context."""
        mode = self.config.chat_template
        for task in self.config.tasks:
            uses_chat(task, tokenizer, mode)  # raises for `on` without a template
        limit = shape.max_context
        if not limit:
            return
        budget = self.config.max_prompt_tokens
        for task in self.config.tasks:
            gen, extra = self.max_new_tokens(task), chat_overhead(tokenizer, task, mode)
            if budget + extra + gen > limit:
                raise ConfigError(
                    "task.max_prompt_tokens",
                    budget,
                    f"{task} needs {budget} prompt + {extra} chat-template + {gen} generated tokens, over "
                    f"the model's context of {limit}; use task.max_prompt_tokens <= {limit - extra - gen}",
                )

    def build_input(self, sample: dict[str, Any], tokenizer) -> tuple[torch.Tensor, bool, bool]:
        """``(input_ids [1, T], truncated, chat)`` for one sample."""
        task = sample["longbench_task"]
        prompt = self.protocol()[0][task].format(context=sample["context"], input=sample["input"])
        prompt, truncated = middle_truncate(tokenizer, prompt, self.config.max_prompt_tokens)
        ids, chat = encode_prompt(tokenizer, task, prompt, self.config.chat_template)
        return ids, truncated, chat

    def score(self, sample: dict[str, Any], prediction: str) -> float:
        """The sample's score in [0, 1] under its task's official metric."""
        task = sample["longbench_task"]
        return score_sample(
            METRIC_OF[task],
            task,
            prediction,
            sample["answers"],
            sample["all_classes"],
            code_sim_backend=self.config.code_sim_backend,
        )

    def run(self, sample: dict[str, Any], runner) -> dict[str, Any]:
        task = sample["longbench_task"]
        input_ids, truncated, chat = self.build_input(sample, runner.tokenizer)
        max_new = self.max_new_tokens(task)
        if task == "samsum":
            # The official samsum decoding also stops at the newline token, and neither it nor EOS
            # may be the first token (``min_length`` one past the prompt).
            newline = runner.tokenizer.encode("\n", add_special_tokens=False)[-1]
            gen = runner.generate(input_ids, max_new, stop_token_ids=(newline,), min_new_tokens=1)
        else:
            gen = runner.generate(input_ids, max_new)
        score = self.score(sample, gen.text)
        return {
            "prompt_tokens": int(input_ids.shape[1]),
            "prediction": gen.text,
            "score": score,
            "longbench_task": task,
            "group": GROUP_OF[task],
            "metric": METRIC_OF[task],
            "answers": sample["answers"],
            "truncated": truncated,
            "chat_template": chat,
            "prompt_format": "chat" if chat else "raw",
            "subset": self.subset,
            "max_new_tokens": max_new,
            "generated_tokens": gen.new_tokens,
            "stopped": gen.stopped,
            "memory": gen.memory,
            "prefill_s": gen.prefill_s,
            "decode_s": gen.decode_s,
        }

    def aggregate(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """Points (x100): ``score_<task>`` per task, ``group_<group>`` the mean of its tasks' scores,
        ``score`` the mean of all task scores; ``n`` samples and ``n_<task>`` per task. With Chinese
        tasks among them, also ``score_en`` (mean over the default 16 tasks scored), ``score_zh``
        (mean over the Chinese tasks scored) and ``jieba_version``."""
        by_task: dict[str, list[float]] = {}
        for r in rows:
            if r.get("score") is not None:
                by_task.setdefault(r["longbench_task"], []).append(r["score"])
        task_scores = {t: 100 * _mean(by_task[t]) for t in ALL_TASKS if t in by_task}
        out: dict[str, Any] = {
            "score": _mean(list(task_scores.values())) if task_scores else float("nan"),
            "n": sum(len(v) for v in by_task.values()),
            "subset": rows[0].get("subset", self.subset) if rows else self.subset,
            "tasks_scored": len(task_scores),
            "max_prompt_tokens": self.config.max_prompt_tokens,
            "max_new_tokens_cap": self.config.max_new_tokens_cap,
            "code_sim_backend": self.config.code_sim_backend,
            "prompt_format": "chat" if any(r.get("chat_template") for r in rows) else "raw",
        }
        if any(t in task_scores for t in CHINESE_TASKS):
            # the segmentation, and so the Chinese scores, follow jieba's dictionary
            out["jieba_version"] = importlib.metadata.version("jieba")
            for key, tasks in (("score_en", ENGLISH_TASKS), ("score_zh", CHINESE_TASKS)):
                present = [task_scores[t] for t in tasks if t in task_scores]
                if present:
                    out[key] = _mean(present)
        for group, tasks in GROUPS.items():
            present = [task_scores[t] for t in tasks if t in task_scores]
            if present:
                out[f"group_{group}"] = _mean(present)
        for t, s in task_scores.items():
            out[f"score_{t}"] = s
            out[f"n_{t}"] = len(by_task[t])
        return out
