"""``gsm8k``: GSM8K (Cobbe et al. 2021, grade-school math word problems) by lm-evaluation-harness's
own protocol, every request through the method's cache (:mod:`kvbench.tasks.lmeval_task`).

``variant`` names lm-eval's task definition, used unchanged (prompt, exemplars, stop strings,
filters, metric):

- ``gsm8k`` (default): 5-shot, exemplars drawn from the train split (seed 1234), prompt
  ``Question: ...\\nAnswer:``, the exemplars' worked solutions ending ``#### N``; stops at
  ``Question:``; up to 256 new tokens.
- ``gsm8k_cot``: 8-shot chain of thought with Wei et al.'s fixed exemplars (``Q: ...\\nA: ...
  The answer is N.``); stops at ``Q:``.
- ``gsm8k_cot_zeroshot``: ``A: Let's think step by step.``, no exemplars.

Answer extraction is lm-eval's two filter pipelines, each a regex then ``take_first``:
``strict-match`` takes the first ``#### N`` (``gsm8k``) or ``The answer is N.`` (the CoT variants)
and yields ``[invalid]`` without one; ``flexible-extract`` takes the *last* number-like span in the
output (``-?[$0-9.,]{2,}`` or ``-?[0-9]+``). The metric is lm-eval's ``exact_match`` with case
ignored and ``,``, ``$``, everything up to ``#### `` and a final ``.`` removed from both sides, so
``$1,000.`` matches the gold ``1000``. Rows carry both: ``exact_match_strict_match`` and
``exact_match_flexible_extract``; ``score`` is the strict one; ``answer`` is the gold number.

Data: ``source: local`` reads ``gsm8k/test.jsonl`` and ``gsm8k/train.jsonl`` (OpenAI's
grade-school-math files, fields ``question``/``answer``) under the data root as lm-eval's
``dataset_path: json``; ``hub`` keeps lm-eval's ``openai/gsm8k`` (same rows, needs the Hub);
``auto`` takes the local files when they are there, else the Hub.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvbench.config import check_choice
from kvbench.data import require_file
from kvbench.errors import ConfigError
from kvbench.tasks.base import limited, register_task
from kvbench.tasks.lmeval_task import LMEvalBase, LMEvalCommonConfig, task_manager

VARIANTS = ("gsm8k", "gsm8k_cot", "gsm8k_cot_zeroshot")
SOURCES = ("auto", "local", "hub")
TEST_FILE, TRAIN_FILE = "gsm8k/test.jsonl", "gsm8k/train.jsonl"
TEST_PROBLEMS = 1319  # problems in the test split


def gold_answer(answer: str) -> str:
    """The final number of a GSM8K solution: what follows its ``#### `` marker."""
    return answer.split("####")[-1].strip()


def lm_eval_gsm8k_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent / "gsm8k"


@dataclass
class GSM8KConfig(LMEvalCommonConfig):
    name: str = "gsm8k"
    version: int = 1
    variant: str = "gsm8k"
    source: str = "auto"

    def __post_init__(self):
        super().__post_init__()
        check_choice("task.variant", self.variant, VARIANTS)
        check_choice("task.source", self.source, SOURCES)


@register_task("gsm8k")
class GSM8K(LMEvalBase):
    Config = GSM8KConfig

    @classmethod
    def planned_samples(cls, config: GSM8KConfig) -> int:
        return limited(TEST_PROBLEMS, config)

    def task_names(self) -> list[str]:
        return [self.config.variant]

    def manager(self):
        # only lm-eval's gsm8k folder is indexed: seconds instead of the whole catalogue
        return task_manager(str(lm_eval_gsm8k_dir()), include_defaults=False)

    def data_source(self) -> str:
        if self.config.source != "auto":
            return self.config.source
        return "local" if (Path(self.data_root) / TEST_FILE).is_file() else "hub"

    def overrides(self, name: str) -> dict[str, Any]:
        if self.data_source() == "hub":
            return {}
        test = require_file(self.data_root, TEST_FILE, "the GSM8K test split")
        train = require_file(self.data_root, TRAIN_FILE, "the GSM8K train split (few-shot exemplars)")
        return {
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {"train": str(train), "test": str(test)}},
        }

    def lm_eval_task(self, name: str):
        try:
            return super().lm_eval_task(name)
        except ConfigError as err:
            if self.data_source() == "hub" and err.key == "task.tasks":
                raise ConfigError(
                    "data.root",
                    str(self.data_root),
                    f"no {TEST_FILE} there and the Hub's openai/gsm8k is unreachable ({err.allowed})",
                ) from err
            raise

    def extra_fields(self, name: str, doc: dict) -> dict[str, Any]:
        return {"answer": gold_answer(doc["answer"])}
