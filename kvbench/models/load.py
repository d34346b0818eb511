"""Loading ``(model, tokenizer)`` from a model node: a local folder, a converted GGUF (a file or a
package's; :mod:`kvbench.models.gguf`) or a Hugging Face Hub id; and reading a model's shape and
tokenizer from its files alone, before any weights load (:func:`peek_model`), so that every check
against the model (context limit, head_dim, chat template) fails before the slow part."""

from __future__ import annotations

import functools
import json
import struct
from pathlib import Path
from typing import Any

import torch

from kvbench.errors import ConfigError
from kvbench.models.act_quant import fake_quantize_activations
from kvbench.models.config import DTYPES, ModelConfig
from kvbench.models.files import check_safetensors
from kvbench.models.gguf import check_gguf, converted_dir, ensure_converted
from kvbench.models.hub import hub_offline, hub_reachable
from kvbench.models.shape import ModelShape, shape_of_config
from kvbench.models.weight_quant import fake_quantize_model


def load_model(
    cfg: ModelConfig, attn_implementation: str | None = None, device: str = "cpu"
) -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)`` in eval mode, without gradients, in ``cfg.dtype`` on ``device``.

    ``attn_implementation`` may be a built-in name ("sdpa", "eager") or a name registered beforehand
    with ``transformers.AttentionInterface.register`` (kvbench's own: the name
    :func:`kvbench.cache.register_attention` returns). Register a mask function under the same name
    too (``ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)``): for a name it has no mask
    function for, transformers passes ``attention_mask=None``, silently dropping padding.

    With ``cfg.weight_quant`` set, the transformer blocks' linear weights are then replaced by their
    RTN fake-quantized values (:func:`kvbench.models.weight_quant.fake_quantize_model`); with
    ``cfg.act_quant`` set, their inputs are RTN fake-quantized per token
    (:func:`kvbench.models.act_quant.fake_quantize_activations`).
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
    model = _freeze(model)
    # RTN weight fake-quantization (model.weight_quant), in memory on every load: no cache holds it
    fake_quantize_model(model, cfg.weight_quant)
    # per-token RTN of the same layers' inputs (model.act_quant): forward pre-hooks on the model
    fake_quantize_activations(model, cfg.act_quant)
    return model, tokenizer


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
    for weights in sorted(folder.glob("*.safetensors")):
        check_safetensors(weights, "model.path", path)
    return folder


def files_folder(cfg: ModelConfig, fetch: bool = False) -> Path | None:
    """The local folder that holds this model's config.json and tokenizer, found without loading,
    converting or downloading any weights; None when it is not on disk yet (a GGUF never converted,
    a Hub model not in the cache). ``fetch``: download a Hub model's config and tokenizer files
    (kilobytes, never its weights) when the Hub answers."""
    if cfg.source == "path":
        return _local_folder(cfg.path)
    if cfg.source == "gguf":
        folder = converted_dir(cfg)
        return folder if (folder / "config.json").is_file() else None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(cfg.hub_id, "config.json", revision=cfg.revision)
    if isinstance(found, str):
        return Path(found).parent
    return _fetch_hub_files(cfg) if fetch else None


# A Hub model's files that describe it without being its weights: config, tokenizer, chat template.
HUB_DESCRIPTION_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "vocab*",
    "merges.txt",
    "*.tiktoken",
    "chat_template*",
]


def _fetch_hub_files(cfg: ModelConfig) -> Path | None:
    """The Hub snapshot folder holding just the model's config and tokenizer, downloaded now; None
    when the Hub is offline, unreachable or refuses (the load then reports it with its own hint)."""
    if hub_offline() or not hub_reachable():
        return None
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(cfg.hub_id, revision=cfg.revision, allow_patterns=HUB_DESCRIPTION_FILES)
    except Exception:  # gated, missing, network trouble: all reported by the load itself
        return None
    return Path(folder) if (Path(folder) / "config.json").is_file() else None


@functools.lru_cache(maxsize=8)
def _config_and_tokenizer(folder: str, gguf_file: str | None = None) -> tuple[Any, Any]:
    """Config and tokenizer from a model folder, or from a GGUF file's metadata (``gguf_file`` in
    ``folder``; tens of seconds, but no tensor is dequantized)."""
    from transformers import AutoConfig, AutoTokenizer

    extra = {"gguf_file": gguf_file} if gguf_file else {}
    config = AutoConfig.from_pretrained(folder, local_files_only=True, **extra)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, **extra)
    _ensure_pad_token(tokenizer)
    return config, tokenizer


def peek_model(cfg: ModelConfig) -> tuple[ModelShape, Any] | None:
    """``(shape, tokenizer)`` from the model's files alone, so checks against head_dim, the context
    limit or the chat template run before the weights load: a local folder, a converted GGUF's
    folder, the metadata of a GGUF not converted yet, or a Hub model's config and tokenizer files
    (from the Hugging Face cache, else downloaded without the weights). None only when a Hub model's
    files cannot be had (the checks then run right after the load)."""
    folder = files_folder(cfg, fetch=True)
    gguf_file = None
    if folder is None and cfg.source == "gguf":
        gguf = check_gguf(cfg)  # a missing, truncated or mislabelled file is the user's: say so now
        folder, gguf_file = gguf.parent, gguf.name
    if folder is None:
        return None
    try:
        config, tokenizer = _config_and_tokenizer(str(folder), gguf_file)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, IndexError, struct.error) as err:
        if cfg.source == "hub":
            return None  # the load itself reports it, with the source's own hint
        key = {"path": "model.path", "gguf": "model.gguf" if cfg.gguf else "model.gguf_file"}[cfg.source]
        value = {"model.path": cfg.path, "model.gguf": cfg.gguf, "model.gguf_file": cfg.gguf_file}[key]
        raise ConfigError(
            key,
            value,
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


def _from_hub(cfg: ModelConfig, attn_implementation: str | None, device: str) -> tuple[torch.nn.Module, Any]:
    """Load a Hub id; offline or unreachable Hub falls back to the local HF cache, else a ConfigError."""
    from huggingface_hub.errors import EntryNotFoundError

    local_only = hub_offline() or not hub_reachable()
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


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [""])[0][:200]
