"""``lmeval``: any lm-evaluation-harness task, one document per sample, through a kvbench method.

lm-eval's own task object is built once (``lm_eval.tasks.TaskManager``) and kept; for each document
the sample run asks it, through its own API, for what its evaluator would: the few-shot context
(``fewshot_context``), the requests (``construct_requests``), then, after the requests ran on
:class:`kvbench.lmeval_adapter.RunnerLM` (a fresh method cache per request), its filters (``apply_filters``)
and metrics (``process_results``), and at the end its aggregations. Prompts, answer extraction and
scores are therefore lm-eval's; only the model is kvbench's.

Few-shot exemplars are drawn by lm-eval's sampler from one random stream seeded with
``fewshot_seed`` (lm-eval's default 1234) and advanced document by document, so document ``k``'s
exemplars depend on the draws for documents ``0..k-1``. The contexts are replayed in document order
from a fresh seed, which gives every document the prompt it gets in a plain ``lm_eval`` run with the
same seed, whichever documents this run still has to do (resume).

Rows: ``sample_id`` ``<lm-eval task>/<doc_id>``; ``prediction`` (generated text, or the chosen
choice of a multiple-choice task); ``extracted`` (each filter's output, e.g. the extracted answer);
``target`` (lm-eval's ``doc_to_target``); ``metrics`` ({filter: {metric: value}}) and the same values
flat as ``<metric>_<filter>`` columns; ``score`` (the task's first metric under its first filter);
``prompt_tokens`` (longest request context); ``memory`` (the cache of the document's last request).
"""

from __future__ import annotations

import difflib
import functools
import math
import numbers
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvbench.config import require
from kvbench.errors import ConfigError
from kvbench.tasks.base import Metric, Task, TaskConfig, Work, register_task

LM_EVAL_FEWSHOT_SEED = 1234  # lm-eval's default --fewshot_seed


@functools.cache
def task_manager(include_path: str | None = None, include_defaults: bool = True):
    """An lm-eval TaskManager (indexing all of lm-eval's task YAMLs takes ~10-30 s, so one per
    process and include path)."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include_path, include_defaults=include_defaults)


def load_lm_eval_task(manager, name: str, overrides: dict[str, Any] | None = None, key: str = "task.tasks"):
    """lm-eval's task object for ``name`` (a single task, not a group), its YAML config updated with
    ``overrides`` (e.g. a local ``dataset_path: json`` with ``dataset_kwargs.data_files``).

    ConfigError (naming ``key``) for an unknown name, a group, or a dataset that cannot be loaded."""
    entry = manager.task_index.get(name)
    if entry is None or name not in manager.all_subtasks:
        close = difflib.get_close_matches(name, manager.all_subtasks, n=4)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        kind = "a group or tag; name its tasks" if entry is not None else "not an lm-eval task"
        raise ConfigError(key, name, f"{kind} (see `lm_eval ls tasks`){hint}")
    try:
        if overrides:
            from lm_eval.tasks._yaml_loader import load_yaml

            if entry.yaml_path is None:
                raise ConfigError(key, name, "a Python-defined lm-eval task; overrides need a YAML task")
            cfg = {**load_yaml(entry.yaml_path, resolve_func=True), **overrides}
            for structural in ("tag", "group"):
                cfg.pop(structural, None)
            loaded = manager.load(cfg)
        else:
            loaded = manager.load(name)
    except ConfigError:
        raise
    except Exception as err:  # lm-eval/datasets raise anything from ConnectionError to KeyError here
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(key, name, f"lm-eval could not build the task: {first}") from err
    return loaded["tasks"][name]


def _plain(value: Any) -> Any:
    """JSON-safe copy of an lm-eval value (numpy scalars, tuples)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return value if isinstance(value, (str, type(None))) else str(value)


def column(metric: str, filter_name: str) -> str:
    """Flat row column of a metric under a filter: ``exact_match`` x ``strict-match`` ->
    ``exact_match_strict_match``."""
    return re.sub(r"[^0-9A-Za-z]+", "_", f"{metric}_{filter_name}").strip("_")


@dataclass
class LMEvalCommonConfig(TaskConfig):
    """Knobs shared by every lm-eval-backed task.

    ``num_fewshot``: null keeps the task's own count (lm-eval's rule: a task that fixes 0 stays 0).
    ``max_gen_toks``: null keeps the task's own (else 256, lm-eval's default). ``chunk``: continuation
    tokens per forward when scoring log-likelihoods (1: each reads all earlier tokens from storage).
    ``limit`` keeps the first N documents of each task."""

    num_fewshot: int | None = None
    fewshot_seed: int = LM_EVAL_FEWSHOT_SEED
    max_gen_toks: int | None = None
    chunk: int = 1

    def __post_init__(self):
        super().__post_init__()
        ok = self.num_fewshot is None or self.num_fewshot >= 0
        require(ok, "task.num_fewshot", self.num_fewshot, "null or an int >= 0")
        ok = self.max_gen_toks is None or self.max_gen_toks > 0
        require(ok, "task.max_gen_toks", self.max_gen_toks, "null or a positive int")
        require(self.chunk > 0, "task.chunk", self.chunk, "a positive int")


@dataclass
class LMEvalConfig(LMEvalCommonConfig):
    """``tasks``: lm-eval task names (single tasks; list a group's tasks one by one).
    ``include_path``: a folder of extra task YAMLs. ``overrides``: {task: {lm-eval config key: value}}
    applied on top of the task's YAML, e.g. a local data file where the Hub is out of reach:
    ``{arc_easy: {dataset_path: json, dataset_name: null, dataset_kwargs: {data_files: {test: ...}}}}``.
    """

    name: str = "lmeval"
    version: int = 1
    tasks: list[str] = field(default_factory=list)
    include_path: str | None = None
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.tasks, str):
            self.tasks = [self.tasks]
        ok = isinstance(self.tasks, list) and self.tasks and all(isinstance(t, str) and t for t in self.tasks)
        require(ok, "task.tasks", self.tasks, "a non-empty list of lm-eval task names")
        require(len(set(self.tasks)) == len(self.tasks), "task.tasks", self.tasks, "each task once")
        for name in self.overrides:
            require(name in self.tasks, "task.overrides", name, f"one of task.tasks {self.tasks}")
        if self.include_path is not None:
            ok = Path(self.include_path).expanduser().is_dir()
            require(ok, "task.include_path", self.include_path, "an existing folder of lm-eval task YAMLs")


class LMEvalBase(Task):
    """Shared machinery; subclasses say which lm-eval tasks, with which config overrides."""

    primary_metric = "score"
    metrics = {"score": Metric(True, "the lm-eval task's first metric, mean over documents")}

    @classmethod
    def sample_work(cls, config: LMEvalCommonConfig) -> Work:
        # lm-eval's 5-shot GSM8K prompts are 1071-1118 tokens on the default model; 256 new tokens is the
        # generation cap, an upper bound
        return Work(1100, config.max_gen_toks or 256, 1200)

    def __init__(self, config: LMEvalCommonConfig, data_root: Path, seed: int = 0):
        super().__init__(config, data_root, seed)
        self._tasks: dict[str, Any] = {}  # lm-eval task objects, built once
        self._docs: dict[str, list[dict]] = {}
        self._contexts: dict[str, list[Any]] = {}
        self._lm = None

    # -- what subclasses provide ---------------------------------------------------------------
    def task_names(self) -> list[str]:
        raise NotImplementedError

    def manager(self):
        raise NotImplementedError

    def overrides(self, name: str) -> dict[str, Any]:
        return {}

    def extra_fields(self, name: str, doc: dict) -> dict[str, Any]:
        """Task-specific row fields (e.g. GSM8K's final gold number)."""
        return {}

    # -- lm-eval objects -----------------------------------------------------------------------
    def lm_eval_task(self, name: str):
        """lm-eval's task object, with the evaluator's config adjustments (few-shot count, seed,
        generation length), built on first use."""
        if name not in self._tasks:
            task = load_lm_eval_task(self.manager(), name, self.overrides(name))
            c = self.config
            if c.num_fewshot is not None and task.get_config("num_fewshot") != 0:
                task.set_config("num_fewshot", c.num_fewshot)
            elif task.get_config("num_fewshot") is None:
                task.set_config("num_fewshot", 0)
            if task.get_config("output_type") == "generate_until" and c.max_gen_toks is not None:
                task.set_config("generation_kwargs", {"max_gen_toks": c.max_gen_toks}, update=True)
            task.set_fewshot_seed(c.fewshot_seed)
            self._tasks[name] = task
            self._docs[name] = [dict(d) for d in task.eval_docs]
            self._contexts[name] = []
        return self._tasks[name]

    def docs(self, name: str) -> list[dict]:
        self.lm_eval_task(name)
        return self._docs[name]

    def context(self, name: str, doc_id: int):
        """Document ``doc_id``'s prompt, replaying lm-eval's few-shot draws in document order."""
        task = self.lm_eval_task(name)
        contexts, docs = self._contexts[name], self._docs[name]
        shots = task.get_config("num_fewshot") or 0
        while len(contexts) <= doc_id:
            doc = docs[len(contexts)]
            contexts.append(
                task.fewshot_context(
                    doc=doc,
                    num_fewshot=shots,
                    system_instruction=None,
                    apply_chat_template=False,
                    fewshot_as_multiturn=False,
                    chat_template=None,
                    gen_prefix=task.doc_to_prefix(doc),
                )
            )
        return contexts[doc_id]

    def adapter(self, runner):
        from kvbench.lmeval_adapter import DEFAULT_MAX_GEN_TOKS, RunnerLM

        if self._lm is None or self._lm.runner is not runner:
            # one call per document: the run's own bar and warnings speak for the whole task
            self._lm = RunnerLM(
                runner, chunk=self.config.chunk, max_gen_toks=DEFAULT_MAX_GEN_TOKS, announce=False
            )
        return self._lm

    # -- kvbench Task --------------------------------------------------------------------------
    def samples(self) -> list[dict[str, Any]]:
        rows = []
        for name in self.task_names():
            n = len(self.docs(name))
            n = min(n, self.config.limit) if self.config.limit else n
            rows += [{"id": f"{name}/{k}", "lm_eval_task": name, "doc_id": k} for k in range(n)]
        return rows

    def check_model(self, shape, tokenizer) -> None:
        limit = shape.max_context
        if limit and self.config.max_gen_toks and self.config.max_gen_toks >= limit:
            raise ConfigError(
                "task.max_gen_toks", self.config.max_gen_toks, f"fewer than the model's {limit}-token context"
            )

    def run(self, sample: dict[str, Any], runner) -> dict[str, Any]:
        name, doc_id = sample["lm_eval_task"], sample["doc_id"]
        task = self.lm_eval_task(name)
        doc = self._docs[name][doc_id]
        instances = task.construct_requests(
            doc=doc,
            ctx=self.context(name, doc_id),
            metadata=(name, doc_id, task.get_config("repeats") or 1),
            apply_chat_template=False,
            chat_template=None,
        )
        instances = instances if isinstance(instances, list) else [instances]
        lm = self.adapter(runner)
        records = []
        by_type: dict[str, list] = {}
        for inst in instances:
            by_type.setdefault(inst.request_type, []).append(inst)
        for request_type, group in by_type.items():
            # as lm-eval's evaluator: each request `repeats` times, responses appended in order
            cloned = [inst for inst in group for _ in range(inst.repeats)]
            responses = getattr(lm, request_type)(cloned, disable_tqdm=True)
            for inst, resp in zip(cloned, responses, strict=True):
                inst.resps.append(resp)
            records += lm.records
        task._instances = instances  # apply_filters runs lm-eval's filter ensembles on these
        task.apply_filters()
        instances.sort(key=lambda inst: inst.idx)
        filters = list(instances[0].filtered_resps)
        metrics = {}
        for f in filters:
            metrics[f] = _plain(task.process_results(doc, [inst.filtered_resps[f] for inst in instances]))
        flat = {
            column(m, f): v
            for f, values in metrics.items()
            for m, v in values.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        first_metric = next(iter(task.aggregation()))
        row = {
            "lm_eval_task": name,
            "doc_id": doc_id,
            "prompt_tokens": max(r.prompt_tokens for r in records),
            "prediction": self._prediction(task, doc, instances),
            "extracted": {f: _plain(instances[0].filtered_resps[f]) for f in filters},
            "target": _plain(task.doc_to_target(doc)),
            **self.extra_fields(name, doc),
            "metrics": metrics,
            **flat,
            "score": _plain(metrics[filters[0]].get(first_metric)),
            "requests": len(records),
            "memory": records[-1].memory,
        }
        gens = [r for r in records if r.request_type == "generate_until"]
        if gens:
            row["generated_tokens"] = gens[0].new_tokens
            row["stopped"] = gens[0].stopped
        return row

    @staticmethod
    def _prediction(task, doc, instances) -> str:
        resp = instances[0].resps[0]
        if instances[0].request_type == "generate_until":
            return resp
        if task.OUTPUT_TYPE == "multiple_choice":
            choices = task.doc_to_choice(doc)
            lls = [inst.resps[0][0] for inst in instances]
            return str(choices[max(range(len(lls)), key=lls.__getitem__)]) if len(choices) == len(lls) else ""
        return ""

    def aggregate(self, rows: list[dict[str, Any]]) -> dict[str, float]:
        """lm-eval's own aggregation of each metric under each filter, per task (keys
        ``<task>/<metric>,<filter>``, as lm-eval reports ``metric,filter``), plus the mean ``score``."""
        out: dict[str, float] = {}
        scores = [r["score"] for r in rows if isinstance(r.get("score"), (int, float))]
        out["score"] = sum(scores) / len(scores) if scores else float("nan")
        out["n"] = len(rows)
        for name in self.task_names():
            mine = [r for r in rows if r.get("lm_eval_task") == name and r.get("metrics")]
            if not mine:
                continue
            aggregation = self.lm_eval_task(name).aggregation()
            for f in mine[0]["metrics"]:
                for metric in mine[0]["metrics"][f]:
                    values = [r["metrics"][f][metric] for r in mine if metric in r["metrics"].get(f, {})]
                    fn = aggregation.get(metric)
                    try:
                        value = float(fn(values)) if fn else float("nan")
                    except (TypeError, ValueError, ZeroDivisionError):
                        value = float("nan")
                    out[f"{name}/{metric},{f}"] = value if math.isfinite(value) else float("nan")
            out[f"{name}/n"] = len(mine)
        return out


@register_task("lmeval")
class LMEvalTask(LMEvalBase):
    """Any lm-eval tasks by name (``task.tasks=[arc_easy,hellaswag]``)."""

    Config = LMEvalConfig

    def task_names(self) -> list[str]:
        return list(self.config.tasks)

    def manager(self):
        path = self.config.include_path
        return task_manager(str(Path(path).expanduser()) if path else None)

    def overrides(self, name: str) -> dict[str, Any]:
        return dict(self.config.overrides.get(name) or {})
