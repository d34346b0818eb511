"""Names are names, paths are paths, and every configuration source is checked before a model loads.

- A value that becomes a folder (``model.name``, a registered task or method name, the run id) is one
  safe folder name; anything else is one line naming the key, before any folder is made.
- Every run folder resolves inside ``output.root``; the conversion cache writes only under
  ``$KVBENCH_CACHE_DIR/models`` and never removes or replaces a folder it did not create.
- A conversion is built in a marked temporary folder and renamed at the end: a failure leaves
  nothing, and what a killed conversion left is removed by the next one.
- Environment variables, Hydra's output folders and the model's files (a GGUF or safetensors file
  cut short or not what its name says) are checked up front, each failure one line.

Every case runs against a temporary cache and output root. Where a case could destroy something, a
sentinel folder with files in it stands in the way and must come out intact. No case loads a model:
the GGUF read of a conversion is replaced by a tiny random Llama, and the model the checks look at
is a folder of config.json and a tokenizer.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_bad_input import make_haystack, make_model_folder

import kvbench.__main__ as cli_module
from kvbench import paths
from kvbench.errors import ConfigError
from kvbench.models import ModelConfig, gguf, model_node, peek_model
from kvbench.models.files import safetensors_problem
from kvbench.registry import Registry
from kvbench.run import plan_run, run_folder

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = model_node("smollm2-135m")
ESSAY = b"Startups are hard. The best ones grow fast. " * 40


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    """A private cache; none of kvbench's environment variables from the caller's shell."""
    for name in ("KVBENCH_BLOCK_SIZE", "KVBENCH_DATA_DIR", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))


def sentinel(folder: Path) -> dict[str, bytes]:
    """Fill ``folder`` with files that must survive; returns what it holds."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_bytes(b"my own notes\n")
    (folder / "sub").mkdir(exist_ok=True)
    (folder / "sub" / "data.bin").write_bytes(b"\x00\x01\x02")
    return contents(folder)


def contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(config) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        plan_run(config)
    assert "\n" not in str(info.value)
    return info.value


@pytest.fixture
def inputs(tmp_path) -> dict[str, Path]:
    return {
        "model": make_model_folder(tmp_path / "inputs" / "model"),
        "data": make_haystack(tmp_path / "inputs" / "data", {"one.txt": ESSAY, "two.txt": ESSAY}),
    }


def config_for(inputs, tmp_path, model: dict | None = None, **changes) -> dict:
    """A NIAH run of the weightless model folder (``model`` replaces the whole model node)."""
    config = {
        "model": model if model is not None else {**SMOLLM2, "path": str(inputs["model"]), "name": "m"},
        "task": {"name": "niah", "context_lengths": [256], "depths": [50], "max_new_tokens": 2},
        "seed": 0,
        "device": "cpu",
        "output": {"root": str(tmp_path / "out"), "resume": True},
        "data": {"root": str(inputs["data"])},
    }
    return {**config, **changes}


def written_outside(tmp_path: Path, before: set[str]) -> set[str]:
    """What appeared under ``tmp_path`` since ``before`` (the cache's lock files aside)."""
    now = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}
    return {p for p in now - before if not p.endswith(".lock")}


# --- names --------------------------------------------------------------------------------------------

BAD_NAMES = ["../../x", "..", ".", "", "/abs/folder", "a/b", "a\\b", ".hidden", "a b", "x" * 129, "é"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_a_name_that_is_not_one_safe_folder_name_is_one_line(name):
    with pytest.raises(ConfigError) as info:
        paths.safe_component("model.name", name)
    assert info.value.key == "model.name" and info.value.value == name
    assert "one folder name" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("name", ["smollm2-135m", "llama3.1-8b-instruct", "Tiny_Llama-v1", "a", "x" * 128])
def test_ordinary_names_pass(name):
    assert paths.safe_component("model.name", name) == name
    assert ModelConfig(**{**SMOLLM2, "name": name}).name == name


@pytest.mark.parametrize("name", ["../../x", "..", "/abs/folder", ".hidden", 5])
def test_model_config_refuses_a_path_as_its_name(name):
    with pytest.raises(ConfigError) as info:
        ModelConfig(**{**SMOLLM2, "name": name})
    assert info.value.key == "model.name"


@pytest.mark.parametrize("name", ["../../escaped", "..", "ABSOLUTE"])
def test_a_run_named_to_escape_writes_nothing_anywhere(inputs, tmp_path, name):
    """The name is refused in the run's checks: no run folder, and the folder it names is untouched."""
    target = tmp_path / "victim"
    kept = sentinel(target)
    name = str(target) if name == "ABSOLUTE" else name
    before = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}
    model = {**SMOLLM2, "path": str(inputs["model"]), "name": name}
    error = one_line(config_for(inputs, tmp_path, model=model))
    assert error.key == "model.name" and error.value == name
    assert contents(target) == kept
    assert written_outside(tmp_path, before) == set()


def test_registered_names_are_safe_folder_names():
    from kvbench.methods import METHODS
    from kvbench.tasks import TASKS

    for name in [*METHODS.names(), *TASKS.names()]:
        assert paths.safe_component("name", name) == name
    with pytest.raises(ConfigError) as info:
        Registry("method").register("../evil")
    assert info.value.key == "method name"


def test_run_folder_parts_are_checked_and_stay_inside_the_root(tmp_path):
    root = tmp_path / "out"
    folder = run_folder(str(root), "niah", "m", "kivi-2b", 0, "0123456789ab")
    assert folder == root / "niah" / "m" / "kivi-2b" / "seed0-0123456789ab"
    with pytest.raises(ConfigError) as info:
        run_folder(str(root), "niah", "m", "../kivi", 0, "0123456789ab")
    assert info.value.key == "method"
    # a link inside the root that leads out of it: the folder would land outside
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root.mkdir()
    (root / "niah").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ConfigError, match="outside") as info:
        run_folder(str(root), "niah", "m", "kivi-2b", 0, "0123456789ab")
    assert info.value.key == "output.root"
    assert list(elsewhere.iterdir()) == []


# --- the conversion cache -----------------------------------------------------------------------------


def tiny_read(calls: list | None = None):
    """A stand-in for the GGUF read (~40 s for the real one): a 2-layer random Llama and a
    word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer
    from tokenizers import models as tok_models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    def read(path):
        if calls is not None:
            calls.append(path)
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        )  # fmt: skip
        vocab = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(15)}}
        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(tok_models.WordLevel(vocab, "<unk>")))
        return LlamaForCausalLM(config).eval(), tokenizer

    return read


def package_cfg(name: str = "smollm2-135m") -> ModelConfig:
    return ModelConfig(**{**SMOLLM2, "name": name})


def models_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache" / "models"


def test_a_folder_kvbench_did_not_make_is_never_replaced(tmp_path, monkeypatch):
    """``model.name=mine`` where ``models/mine`` is the user's: refused at every step, kept whole."""
    monkeypatch.setattr(gguf, "load_gguf_model", lambda path: pytest.fail("converted over a user's folder"))
    folder = models_dir(tmp_path) / "mine"
    kept = sentinel(folder)
    cfg = package_cfg("mine")
    for step in (gguf.converted_dir, gguf.ensure_converted, gguf.needs_conversion, peek_model):
        with pytest.raises(ConfigError, match="kvbench did not create it") as info:
            step(cfg)
        assert info.value.key == "model.name" and str(folder) in str(info.value)
    # the last line of defence, called directly: the rename refuses too
    new = models_dir(tmp_path) / ".mine.tmp-x"
    new.mkdir()
    with pytest.raises(ConfigError, match="never replaced"):
        gguf._replace_dir(new, folder)
    assert contents(folder) == kept


def test_a_users_folder_in_the_way_fails_the_run_checks(inputs, tmp_path, monkeypatch):
    folder = models_dir(tmp_path) / "mine"
    kept = sentinel(folder)
    error = one_line(config_for(inputs, tmp_path, model={**SMOLLM2, "name": "mine"}))
    assert error.key == "model.name" and "kvbench did not create it" in error.allowed
    assert contents(folder) == kept and not (tmp_path / "out").exists()


def test_a_conversion_is_marked_and_replaces_only_its_own_folder(tmp_path, monkeypatch):
    reads: list = []
    monkeypatch.setattr(gguf, "load_gguf_model", tiny_read(reads))
    cfg = package_cfg()
    folder = gguf.ensure_converted(cfg)
    assert folder == models_dir(tmp_path) / "smollm2-135m"
    assert (folder / gguf.MARKER_NAME).is_file() and (folder / "config.json").is_file()
    assert not gguf.needs_conversion(cfg) and len(reads) == 1
    # its weights cut short (a full disk): the folder is kvbench's, so it is rebuilt
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    assert "truncated" in safetensors_problem(weights)
    assert gguf.needs_conversion(cfg)
    assert gguf.ensure_converted(cfg) == folder and len(reads) == 2
    assert safetensors_problem(weights) is None
    assert sorted(p.name for p in models_dir(tmp_path).iterdir()) == [".smollm2-135m.lock", "smollm2-135m"]


def test_a_failed_conversion_leaves_nothing_in_the_cache(tmp_path, monkeypatch):
    def truncated(path):
        raise struct.error("unpack requires a buffer of 8 bytes")

    monkeypatch.setattr(gguf, "load_gguf_model", truncated)
    with pytest.raises(ConfigError) as info:
        gguf.ensure_converted(package_cfg())
    assert info.value.key == "model.gguf_file" and "SmolLM2-135M-Instruct.Q4_1.gguf" in str(info.value)
    assert "struct.error" in str(info.value) or "error: unpack" in str(info.value)
    assert [p.name for p in models_dir(tmp_path).iterdir()] == [".smollm2-135m.lock"]


def test_a_full_disk_during_the_save_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(gguf, "load_gguf_model", tiny_read())

    def full(model, tokenizer, folder):
        (folder / "model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf, "_save_dequantized", full)
    with pytest.raises(ConfigError, match="No space left") as info:
        gguf.ensure_converted(package_cfg())
    assert info.value.key == "KVBENCH_CACHE_DIR"
    assert [p.name for p in models_dir(tmp_path).iterdir()] == [".smollm2-135m.lock"]


def test_leftovers_of_a_killed_conversion_go_with_the_next_one(tmp_path, monkeypatch):
    """Marked temporary and set-aside folders of this name go; a user's folder that merely looks
    like one, and another name's conversion (perhaps running now), stay."""
    base = models_dir(tmp_path)
    killed = base / ".smollm2-135m.tmp-abc123"
    set_aside = base / ".smollm2-135m.stale-4242"
    for folder in (killed, set_aside):
        folder.mkdir(parents=True)
        (folder / gguf.MARKER_NAME).write_text("{}")
        (folder / "model.safetensors").write_bytes(b"half")
    users = base / ".smollm2-135m.tmp-mine"
    other = base / ".other-model.tmp-xyz"
    kept_users = sentinel(users)
    other.mkdir()
    (other / gguf.MARKER_NAME).write_text("{}")
    monkeypatch.setattr(gguf, "load_gguf_model", tiny_read())
    gguf.ensure_converted(package_cfg())
    assert not killed.exists() and not set_aside.exists()
    assert contents(users) == kept_users and (other / gguf.MARKER_NAME).is_file()


# --- model files ----------------------------------------------------------------------------------------


def tiny_gguf(path: Path) -> Path:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("t", np.arange(4096, dtype=np.float32).reshape(64, 64))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("keep", [6, 24, 100, -100], ids=["magic", "header", "metadata", "tensor-data"])
def test_a_truncated_gguf_is_one_line_naming_the_file(tmp_path, monkeypatch, keep):
    monkeypatch.setattr(gguf, "load_gguf_model", lambda path: pytest.fail("read a truncated file"))
    whole = tiny_gguf(tmp_path / "whole.gguf")
    assert gguf.check_gguf(ModelConfig(gguf=str(whole))) == whole.resolve()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole.read_bytes()[:keep])
    cfg = ModelConfig(gguf=str(cut))
    for step in (gguf.check_gguf, peek_model, gguf.ensure_converted):
        with pytest.raises(ConfigError, match="truncated") as info:
            step(cfg)
        assert info.value.key == "model.gguf" and str(cut.resolve()) in str(info.value)
        assert "\n" not in str(info.value)
    assert [p.name for p in models_dir(tmp_path).iterdir()] == [gguf.SHA_INDEX]


def test_a_package_file_that_is_not_a_gguf_is_one_line(tmp_path, monkeypatch):
    package = tmp_path / "site" / "fake_models"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "model.gguf").write_bytes(b"<html>404 not found</html>")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    cfg = ModelConfig(name="fake", gguf_package="fake_models", gguf_file="model.gguf")
    with pytest.raises(ConfigError, match="magic bytes") as info:
        peek_model(cfg)
    assert info.value.key == "model.gguf_file" and str(package / "model.gguf") in str(info.value)


def test_a_truncated_safetensors_file_is_one_line_naming_it(inputs, tmp_path):
    import torch
    from safetensors.torch import save_file

    folder = inputs["model"]
    weights = folder / "model.safetensors"
    save_file({"w": torch.zeros(64, 64)}, str(weights))
    whole = weights.read_bytes()
    plan_run(config_for(inputs, tmp_path))  # whole: passes
    for data, phrase in (
        (whole[:-1000], "truncated"),
        (whole[:5], "shorter than"),
        (whole + b"x", "damaged"),
    ):
        weights.write_bytes(data)
        error = one_line(config_for(inputs, tmp_path))
        assert error.key == "model.path" and str(weights) in str(error) and phrase in str(error)
    weights.write_bytes(b"PK\x03\x04" + b"\x00" * 100)  # a zip archive under a safetensors name
    assert "not safetensors" in str(one_line(config_for(inputs, tmp_path)))
    assert not (tmp_path / "out").exists()


# --- environment variables ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-5", "abc", " 16", "16 ", "1.5", "1e3", "١٦"])
def test_a_bad_block_size_is_one_line_before_the_model_loads(inputs, tmp_path, monkeypatch, value):
    monkeypatch.setenv("KVBENCH_BLOCK_SIZE", value)
    error = one_line(config_for(inputs, tmp_path))
    assert error.key == "KVBENCH_BLOCK_SIZE" and error.value == value and "positive integer" in error.allowed


def test_a_good_block_size_is_read(monkeypatch):
    from kvbench.cache.blockwise import DEFAULT_BLOCK_SIZE, configured_block_size

    monkeypatch.setenv("KVBENCH_BLOCK_SIZE", "16")
    assert configured_block_size() == 16
    monkeypatch.setenv("KVBENCH_BLOCK_SIZE", "")
    assert configured_block_size() == DEFAULT_BLOCK_SIZE


def test_a_cache_dir_that_is_a_file_is_one_line(inputs, tmp_path, monkeypatch):
    afile = tmp_path / "a-file"
    afile.write_text("x")
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(afile))
    error = one_line(config_for(inputs, tmp_path))
    assert error.key == "KVBENCH_CACHE_DIR" and "is a file" in error.allowed
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(afile / "below"))
    assert "is a file" in one_line(config_for(inputs, tmp_path, model={**SMOLLM2})).allowed


def test_an_unwritable_cache_fails_before_a_conversion(inputs, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf, "load_gguf_model", lambda path: pytest.fail("converted"))
    monkeypatch.setenv("KVBENCH_CACHE_DIR", "/sys/kvbench-cache")
    error = one_line(config_for(inputs, tmp_path, model={**SMOLLM2}))
    assert error.key == "KVBENCH_CACHE_DIR" and "create and write" in error.allowed
    # a model that needs no conversion runs from a read-only cache
    plan_run(config_for(inputs, tmp_path))
    assert not Path("/sys/kvbench-cache").exists()


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_a_bad_data_dir_is_one_line_naming_the_variable(inputs, tmp_path, monkeypatch, kind):
    path = tmp_path / "nope"
    if kind == "file":
        path.write_text("x")
    monkeypatch.setenv("KVBENCH_DATA_DIR", str(path))
    error = one_line(config_for(inputs, tmp_path, data={"root": None}))
    assert error.key == "KVBENCH_DATA_DIR" and error.value == str(path)
    assert ("a file" if kind == "file" else "not found") in error.allowed


@pytest.mark.parametrize("name", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TRITON_INTERPRET"])
def test_a_yes_no_variable_that_is_neither_is_one_line(inputs, tmp_path, monkeypatch, name):
    monkeypatch.setenv(name, "sometimes")
    error = one_line(config_for(inputs, tmp_path))
    assert error.key == name and "yes (1, true, yes, on)" in error.allowed
    monkeypatch.setenv(name, "0")
    plan_run(config_for(inputs, tmp_path))


# --- Hydra's folders --------------------------------------------------------------------------------------


@pytest.fixture
def cli(tmp_path, inputs, capsys, monkeypatch):
    """The CLI entry in-process, Hydra's job replaced: returns (exit status or 'ran', stderr lines)."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    ran = []
    monkeypatch.setattr(cli_module, "main", lambda: ran.append(True))
    monkeypatch.setattr(sys, "argv", ["kvbench"])

    def call(*args: str):
        common = [
            f"model.path={inputs['model']}",
            f"data.root={inputs['data']}",
            f"output.root={tmp_path / 'out'}",
        ]
        flags = [a for a in args if a == "-m"]
        try:
            cli_module.cli([*flags, *common, *[a for a in args if a not in flags]])
        except SystemExit as exit_info:
            return exit_info.code, capsys.readouterr().err.strip().splitlines()
        assert ran.pop() is True
        return "ran", capsys.readouterr().err.strip().splitlines()

    return call


@pytest.mark.parametrize("multirun", [False, True], ids=["run", "sweep"])
def test_an_unwritable_hydra_folder_is_one_line(cli, tmp_path, multirun):
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    afile = tmp_path / "a-file"
    afile.write_text("x")
    for folder, phrase in (("/sys/kvbench-hydra", "create and write"), (afile / "run", "is a file")):
        code, lines = cli(*(["-m"] if multirun else []), f"{key}={folder}")
        assert code == 2 and len(lines) == 1, lines
        assert lines[0].startswith(f"kvbench: error: {key}=") and phrase in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("multirun", [False, True], ids=["run", "sweep"])
def test_a_foreign_hydra_folder_gets_one_warning(cli, tmp_path, multirun):
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    mine = tmp_path / "my-project"
    kept = sentinel(mine)
    code, lines = cli(*(["-m"] if multirun else []), f"{key}={mine}")
    assert code == "ran" and len(lines) == 1, lines
    assert lines[0].startswith(f"kvbench: warning: {key}={mine} already holds 2 entries")
    assert contents(mine) == kept
    # a folder Hydra ran in before, an empty one and a new one: nothing to say
    trace = cli_module.HYDRA_TRACES[key]
    (mine / trace).parent.mkdir(parents=True, exist_ok=True)
    (mine / trace).write_text("{}")
    (tmp_path / "empty").mkdir()
    for folder in (mine, tmp_path / "empty", tmp_path / "new"):
        assert cli(*(["-m"] if multirun else []), f"{key}={folder}") == ("ran", [])


# --- the real entry point ------------------------------------------------------------------------


def kvbench_cli(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvbench", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), "KVBENCH_CACHE_DIR": str(tmp_path / "cache"), **env},
        cwd=tmp_path,
    )


def assert_one_line(proc: subprocess.CompletedProcess, start: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(start), proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_entry_point_refuses_escapes_in_one_line(tmp_path, inputs):
    """With the default model (a package GGUF the cache would convert into ``models/<name>``): a
    name that is a user's folder, and one that climbs out of the output root."""
    victim = tmp_path / "victim"
    kept = sentinel(victim)
    common = [f"output.root={tmp_path / 'out'}", f"data.root={inputs['data']}"]
    before = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")}
    for name in (str(victim), "../../x"):
        proc = kvbench_cli(tmp_path, f"model.name={name}", *common)
        assert_one_line(proc, f"kvbench: error: model.name='{name}': one folder name")
    proc = kvbench_cli(tmp_path, *common, KVBENCH_BLOCK_SIZE="abc")
    assert_one_line(proc, "kvbench: error: KVBENCH_BLOCK_SIZE='abc': a positive integer")
    assert contents(victim) == kept
    assert written_outside(tmp_path, before) == set()


def test_the_entry_point_names_a_truncated_gguf_in_one_line(tmp_path, inputs):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_gguf(tmp_path / "whole.gguf").read_bytes()[:100])
    proc = kvbench_cli(
        tmp_path, f"model.gguf={cut}", f"output.root={tmp_path / 'out'}", f"data.root={inputs['data']}"
    )
    assert_one_line(proc, "kvbench: error: model.gguf=")
    assert str(cut) in proc.stderr and "truncated" in proc.stderr
    assert not (tmp_path / "out").exists()
    assert not any(p.is_dir() for p in (tmp_path / "cache" / "models").iterdir())
