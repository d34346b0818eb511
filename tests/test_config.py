"""Config nodes are checked against their dataclasses as OmegaConf structured configs: the declared
types, unknown keys and required keys fail as one ConfigError naming the key, the value and what is
allowed; annotations OmegaConf cannot type are left to ``__post_init__``; values that were right
before keep their exact type (an int given for a float stays an int)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvbench.config import build_config, describe
from kvbench.errors import ConfigError
from kvbench.methods import METHODS
from kvbench.tasks import TASKS


@dataclass
class Inner:
    root: str = "out"
    resume: bool = True


@dataclass
class Node:
    name: str  # required: no default
    size: int = 4
    scale: float = 1.0
    levels: float | None = None
    either: int | float = 2  # a union OmegaConf cannot type: left to __post_init__
    books: str | list[str] = "a"
    free: Any = None
    depths: list[float] = field(default_factory=lambda: [0, 50])
    extra: dict[str, Any] | None = None
    output: Inner = field(default_factory=Inner)


def error(node, prefix="node") -> str:
    with pytest.raises(ConfigError) as info:
        build_config(Node, node, prefix)
    return str(info.value)


def test_values_of_the_declared_types_pass_unchanged():
    cfg = build_config(Node, {"name": "x", "size": 8, "scale": 2, "depths": [0, 12.5], "either": 1.5}, "node")
    assert cfg.size == 8 and cfg.either == 1.5
    assert cfg.scale == 2 and type(cfg.scale) is int  # int is a float; the spelling is kept
    assert cfg.depths == [0, 12.5] and [type(d) for d in cfg.depths] == [int, float]
    assert cfg.output == Inner()  # a default is the dataclass's own, not OmegaConf's copy


def test_no_conversion_between_primitives():
    """OmegaConf would read '16' as 16 and 'no' as False; a config that means a number says one.
    A number where a string is declared passes as given (the config decides)."""
    assert error({"name": "x", "size": "16"}) == "node.size='16': an int"
    assert error({"name": "x", "scale": True}) == "node.scale=True: a number"
    assert error({"name": "x", "name2": 1}).startswith("node.name2=1: unknown key; did you mean name?")
    assert error({"name": True}) == "node.name=True: a string"
    assert build_config(Node, {"name": 10146}, "node").name == 10146  # Hydra's reading of a bare number
    assert error({"name": "x", "output": {"resume": "no"}}) == "node.output.resume='no': true or false"
    assert error({"name": "x", "output": {"resume": 1}}) == "node.output.resume=1: true or false"
    assert error({"name": "x", "extra": {"k": 1}, "depths": [1, "2"]}) == "node.depths[1]='2': a number"
    cfg = build_config(Node, {"name": "x", "output": {"resume": False}}, "node")
    assert cfg.output == {"resume": False}  # a nested node reaches __post_init__ as given


def test_wrong_types_name_the_key_value_and_type():
    assert error({"name": "x", "size": "abc"}) == "node.size='abc': an int"
    assert error({"name": "x", "size": 2.5}) == "node.size=2.5: an int"
    assert error({"name": "x", "size": True}) == "node.size=True: an int"
    assert error({"name": "x", "scale": "fast"}) == "node.scale='fast': a number"
    assert error({"name": "x", "levels": "many"}) == "node.levels='many': a number, or null"
    assert error({"name": "x", "depths": [0, "mid"]}) == "node.depths[1]='mid': a number"
    assert error({"name": "x", "extra": 3}) == "node.extra=3: a mapping of keys to values, or null"
    assert error({"name": "x", "output": {"resume": "maybe"}}) == "node.output.resume='maybe': true or false"
    assert error({"name": "x", "size": None}) == "node.size=None: not null: an int"


def test_unknown_and_missing_keys():
    assert error({"name": "x", "sise": 4}).startswith("node.sise=4: unknown key; did you mean size? allowed:")
    assert error({"name": "x", "output": {"rot": "y"}}).startswith(
        "node.output.rot='y': unknown key; did you mean root? allowed: resume, root"
    )
    assert error({}) == "node.name=???: required; give a string"
    assert error({"size": 4}, prefix="") == "name=???: required; give a string"


def test_annotations_omegaconf_cannot_type_are_left_to_post_init():
    node = {"name": "x", "either": "anything", "books": ["a", "b"], "free": {"k": [1]}}
    cfg = build_config(Node, node, "n")
    assert cfg.either == "anything" and cfg.books == ["a", "b"] and cfg.free == {"k": [1]}


def test_one_value_for_a_list_is_checked_and_handed_on_as_given():
    cfg = build_config(Node, {"name": "x", "depths": 50}, "node")
    assert cfg.depths == 50  # the dataclass decides whether one value stands for a list
    assert error({"name": "x", "depths": "mid"}) == "node.depths[0]='mid': a number"


def test_describe():
    assert describe(int) == "an int" and describe(bool) == "true or false"
    assert describe(list[int]) == "a list (int each)"
    assert describe(str | None) == "a string, or null"


def test_every_registered_config_has_a_schema_omegaconf_accepts():
    from omegaconf import OmegaConf

    from kvbench.config import schema

    for registry in (METHODS, TASKS):
        for name in registry.names():
            OmegaConf.structured(schema(registry.get(name).Config))


def test_method_and_task_nodes_reject_wrong_types():
    from kvbench.methods import build_method
    from kvbench.tasks import build_task

    with pytest.raises(ConfigError, match=r"^method.group_size='wide': an int$"):
        build_method({"name": "kivi", "bits": 2, "group_size": "wide"})
    with pytest.raises(ConfigError, match=r"^task.max_new_tokens=1.5: an int$"):
        build_task({"name": "niah", "max_new_tokens": 1.5}, None, 0)


@dataclass
class Loose:
    """A default outside its annotation: the field is left to __post_init__."""

    size: int = None  # type: ignore[assignment]
    rate: float = "auto"  # type: ignore[assignment]
    count: int = 0


@dataclass
class Unresolved:
    """An annotation that only resolves for type checkers: every field is left to __post_init__."""

    later: NotImported | None = None  # noqa: F821
    count: int = 0


def test_what_the_dataclass_declares_is_never_rejected():
    cfg = build_config(Loose, {"size": None, "rate": "fast"}, "loose")
    assert cfg.size is None and cfg.rate == "fast"
    with pytest.raises(ConfigError, match=r"^loose.count='3': an int$"):
        build_config(Loose, {"count": "3"}, "loose")  # the other fields are still checked
    assert build_config(Unresolved, {"later": "soon", "count": "3"}, "u").count == "3"
    with pytest.raises(ConfigError, match=r"^u.nope=1: unknown key"):
        build_config(Unresolved, {"nope": 1}, "u")


def test_omegaconf_values_inside_a_plain_dict_are_read_as_plain_data():
    from omegaconf import OmegaConf

    node = dict(OmegaConf.create({"name": "x", "depths": [10, 20], "output": {"root": "r"}}))
    cfg = build_config(Node, node, "node")
    assert cfg.depths == [10, 20] and type(cfg.depths) is list and cfg.output == {"root": "r"}
