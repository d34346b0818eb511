"""Each method's config node (kvbench/conf/method/<name>.yaml) restates its dataclass defaults, so a
user reading the node sees what runs; nothing else checks that the two agree."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

import kvbench
from kvbench.methods import METHODS

NODES = Path(kvbench.__file__).resolve().parent / "conf" / "method"


def test_every_registered_method_has_a_node_and_every_node_a_method():
    assert sorted(p.stem for p in NODES.glob("*.yaml")) == METHODS.names()


@pytest.mark.parametrize("name", METHODS.names())
def test_node_defaults_equal_the_dataclass(name):
    node = yaml.safe_load((NODES / f"{name}.yaml").read_text()) or {}
    config = METHODS.get(name).Config
    fields = {f.name: f for f in dataclasses.fields(config) if f.init}
    unknown = sorted(set(node) - set(fields))
    assert not unknown, f"{name}.yaml sets {unknown}, which {config.__name__} does not have"
    for key, value in node.items():
        if isinstance(value, str) and value.startswith("${"):
            continue  # an interpolation of the run's own keys (e.g. the seed)
        field = fields[key]
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            continue
        if key == "bits" and default is None:
            default = getattr(config, "default_bits", None)  # None in the class: its own default width
        if isinstance(default, tuple) and isinstance(value, list):
            value = tuple(value)
        assert value == default, f"{name}.yaml: {key}: {value!r} but {config.__name__}.{key} = {default!r}"
