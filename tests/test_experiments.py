"""Experiment nodes (conf/experiment/*.yaml): every sweep point composes into configs that validate, the
analysis plan validates, missing methods/tasks fail with one line, and the run id keys on what matters."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kvbench.__main__ import CONF_DIR, check_argv, check_experiment, experiment_requirements
from kvbench.config import to_plain
from kvbench.errors import ConfigError
from kvbench.methods import build_method
from kvbench.results import analysis_plan, run_id
from kvbench.run import run_config
from kvbench.tasks import build_task

EXPERIMENTS = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))
BRIEFED = {
    "semkv_cliff",
    "semkv_interpolation",
    "semkv_prune_vs_lowprec",
    "specache_niah",
    "specache_k_ablation",
    "specache_1bit_zero_point",
    "specache_hitrate",
    "kivi_axis_ablation",
    "ott_vs_kivi",
    "kvquant_ablation",
    "readkv_read_budget",
    "attention_probe",
}


def sweep_params(name: str) -> dict[str, list[str]]:
    node = OmegaConf.load(Path(CONF_DIR) / "experiment" / f"{name}.yaml")
    params = OmegaConf.to_container(node.hydra.sweeper.params)
    return {k: [v.strip() for v in str(values).split(",")] for k, values in params.items()}


def compose_point(name: str, point: dict[str, str]) -> dict:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=[f"+experiment={name}", *(f"{k}={v}" for k, v in point.items())])
    return to_plain(cfg)


def points(name: str) -> list[dict[str, str]]:
    """Every value of every sweep parameter at least once (the others at their first value)."""
    params = sweep_params(name)
    first = {k: v[0] for k, v in params.items()}
    out = [first]
    for key, values in params.items():
        out += [{**first, key: v} for v in values[1:]]
    return out


def test_every_briefed_experiment_has_a_node():
    assert BRIEFED <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_node_composes_at_every_sweep_value_and_validates(name, data_root):
    check_experiment(name)  # every method and task it names exists; the plan validates
    seen_methods = set()
    for point in points(name):
        cfg = compose_point(name, point)
        plan = analysis_plan(cfg["analysis"])
        assert plan.name == name
        assert 0 < plan.alpha < 1 and plan.margin > 0 and plan.seeds and plan.n >= 1
        method = build_method(cfg.get("method"), bits=cfg.get("bits"))  # validates without a model
        seen_methods.add(method.registered_name)
        task = build_task(cfg["task"], data_root, int(point.get("seed", 0)))
        assert task.registered_name == cfg["task"]["name"]
        assert cfg["seed"] in plan.seeds
        assert cfg["output"]["root"] == f"results/runs/experiments/{name}"
        if plan.grid_key == "bits" and "bits" in point:
            assert float(point["bits"]) in plan.grid
    assert plan.reference in seen_methods  # the reference arm is part of the sweep


def test_semkv_cliff_sweeps_the_grid_and_the_reference():
    params = sweep_params("semkv_cliff")
    assert [float(b) for b in params["bits"]] == [1, 1.585, 2, 2.322, 2.585, 3, 4]
    assert set(params["+method"]) == {"fp16", "uniform"}
    assert params["seed"] == ["0", "1", "2"]
    plan = analysis_plan(OmegaConf.load(Path(CONF_DIR) / "experiment" / "semkv_cliff.yaml").analysis)
    assert plan.grid == [1, 1.585, 2, 2.322, 2.585, 3, 4] and plan.grid_key == "bits"


def test_fp16_in_a_bits_sweep_is_one_run():
    fp16 = {
        run_id(run_config(compose_point("semkv_cliff", {"+method": "fp16", "bits": b, "seed": "0"})))
        for b in ("1", "4")
    }
    uniform = {
        run_id(run_config(compose_point("semkv_cliff", {"+method": "uniform", "bits": b, "seed": "0"})))
        for b in ("1", "4")
    }
    assert len(fp16) == 1 and len(uniform) == 2
    other_seed = run_id(
        run_config(compose_point("semkv_cliff", {"+method": "fp16", "bits": "1", "seed": "1"}))
    )
    assert other_seed not in fp16


def test_arms_inherit_their_method_node_and_override_knobs():
    cfg = compose_point(
        "kivi_axis_ablation", {"+experiment/arms/kivi_axis_ablation@method": "k_token_v_channel", "bits": "2"}
    )
    assert cfg["method"]["name"] == "uniform"
    assert (cfg["method"]["key_axis"], cfg["method"]["value_axis"]) == ("token", "channel")
    assert cfg["method"]["zero_point"] == "minmax"  # inherited from conf/method/uniform.yaml
    assert "bits" not in cfg["method"]  # an arm needs no bits line: the run fills the knob
    assert run_config(cfg)["method"]["bits"] == cfg["bits"] == 2


def test_attention_probe_arms_fix_their_bits_and_are_distinct_runs():
    """Every arm of the probe fixes its own bits (no top-level bits sweep), so each arm is one
    configuration: one run id, one run folder, and one label except OTT's layout ablations (G, R,
    skip_layers), which OTT's label does not show: they share ott-2b, the frame tells them apart by
    their differing knobs, and the claims select them by config."""
    key = "+experiment/arms/attention_probe@method"
    params = sweep_params("attention_probe")
    # every arm file, swept or not (a larger run adds the others to the sweep), is checked
    arms = sorted(p.stem for p in (Path(CONF_DIR) / "experiment" / "arms" / "attention_probe").glob("*.yaml"))
    assert set(params) == {"seed", key} and set(params[key]) <= set(arms) and len(arms) == 39
    assert len(params[key]) == 32
    labels, ids = {}, set()
    for arm in arms:
        cfg = compose_point("attention_probe", {"seed": "0", key: arm})
        assert cfg["bits"] is None and cfg["task"]["name"] == "attention_probe"
        method = build_method(cfg["method"])
        assert (method.config.bits is None) == (arm == "fp16")
        labels[arm] = method.label()
        ids.add(run_id(run_config(cfg)))
    layout = {"ott2", "ott2_r128", "ott2_g32", "ott2_g32_r128", "ott2_skip0"}
    assert {labels[a] for a in layout} == {"ott-2b"}
    assert len(ids) == 39 and len({labels[a] for a in arms if a not in layout}) == 34
    assert labels["ott2"] == "ott-2b" and labels["kivi2"] == "kivi-2b"
    assert labels["kivi1_specache_zp"] == "kivi-1b-specache0"
    assert labels["readkv8_read2"] == "readkv-2of8b" and labels["semkv2.39"].startswith("semkv-2.39b")


# --- missing methods and tasks ------------------------------------------------------------------


@pytest.fixture
def conf_copy(tmp_path):
    root = tmp_path / "conf"
    shutil.copytree(CONF_DIR, root)
    return root


def test_missing_method_and_task_give_one_line_naming_them(conf_copy):
    (conf_copy / "experiment" / "later.yaml").write_text(
        "# @package _global_\n"
        "defaults:\n  - override /task: no_such_task\n"
        "analysis: {name: later, alpha: 0.05, margin: 0.1, n: 3, seeds: [0]}\n"
        "hydra:\n  sweeper:\n    params:\n      +method: fp16,no_such_method\n"
    )
    with pytest.raises(ConfigError) as err:
        check_experiment("later", str(conf_copy))
    message = str(err.value)
    assert "\n" not in message and message.startswith("experiment='later'")
    assert "method 'no_such_method' (no conf/method/no_such_method.yaml, not registered)" in message
    assert "task 'no_such_task' (no conf/task/no_such_task.yaml, not registered)" in message
    assert "fp16" not in message.split(":", 1)[1]


def test_node_without_registered_code_is_reported(conf_copy):
    # a config node alone does not make a method: it must be registered too
    (conf_copy / "method" / "ghost.yaml").write_text("name: ghost\n")
    arms = conf_copy / "experiment" / "arms" / "ghostly"
    arms.mkdir(parents=True)
    (arms / "g.yaml").write_text("defaults:\n  - /method/ghost@_here_\n  - _self_\n")
    (conf_copy / "experiment" / "ghostly.yaml").write_text(
        "# @package _global_\nanalysis: {name: ghostly, alpha: 0.05, margin: 0.1, n: 1, seeds: [0]}\n"
        "hydra:\n  sweeper:\n    params:\n      +experiment/arms/ghostly@method: g,absent\n"
    )
    needs = experiment_requirements(
        OmegaConf.to_container(OmegaConf.load(conf_copy / "experiment" / "ghostly.yaml")), str(conf_copy)
    )
    assert needs["method"] == {"ghost"} and needs["arm"] == {"experiment/arms/ghostly/absent.yaml"}
    with pytest.raises(
        ConfigError, match=r"arm conf/experiment/arms/ghostly/absent\.yaml.*method 'ghost' \(not registered\)"
    ):
        check_experiment("ghostly", str(conf_copy))


def test_unknown_experiment_name_is_one_line():
    with pytest.raises(ConfigError, match=r"experiment='nope'.*semkv_cliff"):
        check_argv(["-m", "+experiment=nope"])


# --- analysis plan ------------------------------------------------------------------------------

PLAN = {
    "name": "x",
    "alpha": 0.05,
    "margin": 0.1,
    "n": 3,
    "seeds": [0, 1, 2],
    "grid": [1, 2],
    "grid_key": "bits",
}


@pytest.mark.parametrize(
    "change, key",
    [
        ({"alpha": 0}, "analysis.alpha"),
        ({"alpha": 1.0}, "analysis.alpha"),
        ({"margin": 0}, "analysis.margin"),
        ({"margin": -0.1}, "analysis.margin"),
        ({"n": 0}, "analysis.n"),
        ({"seeds": []}, "analysis.seeds"),
        ({"seeds": [0, 0]}, "analysis.seeds"),
        ({"grid": [2, 1]}, "analysis.grid"),
        ({"grid_key": None}, "analysis.grid_key"),
        ({"name": ""}, "analysis.name"),
        ({"alpah": 0.05}, "analysis.alpah"),
    ],
)
def test_bad_plans_name_the_key(change, key):
    with pytest.raises(ConfigError) as err:
        analysis_plan({**PLAN, **change})
    assert err.value.key == key


def test_good_plan_keeps_its_values():
    plan = analysis_plan(PLAN)
    assert (plan.reference, plan.metric, plan.seeds, plan.grid) == ("fp16", "score", [0, 1, 2], [1, 2])
