"""The run's typed config (kvbench/spec.py): resolved and validated once at the entry, the same ids
and errors as before, and nothing below the entry converts a config node again."""

import collections
import dataclasses
import json
import sys

import pytest
from omegaconf import OmegaConf

import kvbench.builder  # noqa: F401 - imported before the counting patch, as a run imports it
import kvbench.logger  # noqa: F401
from kvbench import config as config_module
from kvbench import run as run_module
from kvbench.__main__ import main
from kvbench.errors import ConfigError
from kvbench.methods import METHODS, build_method
from kvbench.methods.base import with_run_bits
from kvbench.models import model_node
from kvbench.results import RunFolder, run_id
from kvbench.spec import RunSpec, run_config


def one_sample(root, data_root, method=None, **top):
    """A one-sample NIAH run of the default model (256 tokens, two new tokens)."""
    cfg = {
        "model": model_node("smollm2-135m"),
        "task": {"name": "niah", "context_lengths": [256], "depths": [50], "max_new_tokens": 2},
        "seed": 0,
        "bits": 2,
        "device": "cpu",
        "output": {"root": str(root), "resume": True},
        "data": {"root": str(data_root)},
        **top,
    }
    if method:
        cfg["method"] = method
    return cfg


class Conversions:
    """Counts every ``to_plain`` call made outside kvbench/config.py (where it is the conversion of
    a node, not a step inside ``build_config``) and every ``build_config`` call by the class built,
    wherever a kvbench module holds either name."""

    def __init__(self, monkeypatch):
        self.to_plain = 0
        self.built: collections.Counter = collections.Counter()
        to_plain, build_config = config_module.to_plain, config_module.build_config

        def counting_to_plain(node):
            self.to_plain += 1
            return to_plain(node)

        def counting_build_config(cls, node, prefix):
            self.built[cls.__name__] += 1
            return build_config(cls, node, prefix)

        monkeypatch.setattr(config_module, "build_config", counting_build_config)
        for name, module in list(sys.modules.items()):
            if not name.startswith("kvbench.") or module is config_module:
                continue
            if getattr(module, "to_plain", None) is to_plain:
                monkeypatch.setattr(module, "to_plain", counting_to_plain)
            if getattr(module, "build_config", None) is build_config:
                monkeypatch.setattr(module, "build_config", counting_build_config)

    def reset(self):
        self.to_plain = 0
        self.built.clear()


def test_a_run_converts_its_config_once_and_builds_each_node_once(tmp_path, data_root, monkeypatch):
    method = {"name": "kivi", "group_size": 32, "residual": 64}
    cfg = OmegaConf.create(one_sample(tmp_path, data_root, method, logger={"name": "none"}))
    counts = Conversions(monkeypatch)
    metrics = run_module.execute(cfg, progress=False)
    assert metrics["metrics"]["n"] == 1
    assert counts.to_plain == 1  # the entry's resolution of the DictConfig, nothing after it
    # every node of the run, each validated exactly once (the logger's and the method's were
    # validated a second time when the run id was hashed and the logger built)
    assert counts.built == {
        name: 1
        for name in (
            "RunConfig",
            "OutputConfig",
            "DataConfig",
            "LoggerConfig",
            "KIVIConfig",
            "ModelConfig",
            "NIAHConfig",
        )
    }
    folder = RunFolder(metrics["folder"])
    stored = json.loads((folder.path / "config.json").read_text())
    assert stored["run_id"] == metrics["run_id"] == run_id(run_config(cfg))
    assert stored["method"]["bits"] == 2  # the run's bits, written into the method's knob

    # the same command again: the finished point is read back, the config once more converted once
    counts.reset()
    again = run_module.execute(cfg, progress=False)
    assert again["run_id"] == metrics["run_id"]
    assert counts.to_plain == 1 and max(counts.built.values()) == 1


def test_the_spec_holds_the_typed_nodes_and_is_frozen(tmp_path, data_root):
    cfg = one_sample(tmp_path, data_root, {"name": "uniform"}, bits=1.585)
    spec = RunSpec.from_config(OmegaConf.create(cfg))
    assert (spec.seed, spec.output.root, spec.run.torch_device()) == (0, str(tmp_path), "cpu")
    assert spec.method.config.bits == 1.585
    assert (spec.task.registered_name, spec.model.name) == ("niah", "smollm2-135m")
    assert spec.logger.name == "none" and spec.analysis is None
    assert spec.experiment_group == "adhoc-niah"
    # the plain config is what the run id hashes, byte for byte as a dict config gives it
    assert spec.run_id == run_id(run_config(cfg)) == RunSpec.from_config(cfg).run_id
    assert spec.folder == tmp_path / "niah" / "smollm2-135m" / spec.method.label() / f"seed0-{spec.run_id}"
    assert RunSpec.from_config(spec) is spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.run_id = "elsewhere"


@pytest.mark.parametrize("bits", [None, 2, 1.585, 2.322])
@pytest.mark.parametrize("name", METHODS.names())
def test_the_built_method_config_hashes_as_the_node_does(name, bits):
    # a run hands its built method config to the run id instead of building the node again: the
    # id must not move for any method at any bit width (1.585 and 2.322 pack base-L words)
    node = with_run_bits({"name": name, "backend": "auto"}, bits)
    try:
        method = build_method(node)
    except ConfigError:
        pytest.skip(f"{name} takes no bits={bits}")
    config = {"model": model_node("smollm2-135m"), "task": {"name": "niah"}, "bits": bits, "method": node}
    assert run_id(config, method.config) == run_id(config)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"bitz": 2}, "bitz=2: unknown key; did you mean bits? allowed: "),
        (
            {"method": {"name": "kivi", "grop_size": 32}},
            "method.grop_size=32: unknown key; did you mean group_size? allowed: ",
        ),
        ({"seed": -1}, "seed=-1: an int in 0..4294967295"),
    ],
)
def test_a_bad_key_is_the_same_one_line_error_at_the_entry(bad, message, tmp_path, data_root, capsys):
    cfg = {**one_sample(tmp_path / "out", data_root), **bad}
    with pytest.raises(ConfigError) as spec_error:
        RunSpec.from_config(OmegaConf.create(cfg))
    assert str(spec_error.value).startswith(message)
    for entry in (run_module.plan_run, run_module.execute):
        with pytest.raises(ConfigError) as err:
            entry(cfg)
        assert str(err.value) == str(spec_error.value)
    # the Hydra job's entry (a launcher's job process): one line, exit 2
    with pytest.raises(SystemExit) as exit_:
        main(OmegaConf.create(cfg))
    assert exit_.value.code == 2
    assert capsys.readouterr().err == f"kvbench: error: {spec_error.value}\n"
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
