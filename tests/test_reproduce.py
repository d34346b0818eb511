"""``python -m kvbench.reproduce``: the nodes it finds, the jobs its dry run lists, the paper profile's
variants, and the run loop (with a fake subprocess runner: no model loads here)."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kvbench import reproduce
from kvbench.__main__ import CONF_DIR, check_experiment, load_experiment
from kvbench.config import to_plain
from kvbench.methods import build_method
from kvbench.node_plan import CPU_RUN_OVERHEAD_S
from kvbench.results import analysis_plan

NODES = reproduce.discover()
# The model each paper ran, by the node's name prefix (conf/experiment/paper/*.yaml say why).
PAPER_MODELS = {
    "kivi": "llama2-7b",
    "intactkv": "llama2-7b",
    "kvquant": "llama2-7b",
    "readkv": "llama2-7b",
    "ott": "llama3-8b-instruct",
    "specache": "llama3-8b-instruct",
    "semkv": "llama3.1-8b-instruct",
    "attention": "llama3-8b-instruct",  # attention_probe tests OTT's claim
}


def sweep_values(name: str) -> dict[str, list[str]]:
    params = load_experiment(name)["hydra"]["sweeper"]["params"]
    return {k: [v.strip() for v in str(values).split(",")] for k, values in params.items()}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory: no stored runs, no archives."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_discover_finds_the_nodes_and_not_their_arms_or_variants():
    top = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))
    assert NODES == top and len(NODES) >= 16
    assert "semkv_cliff" in NODES and not any("/" in n or n in ("arms", "paper") for n in NODES)


def test_dry_run_lists_every_node_with_the_product_of_its_sweep(workdir):
    for node in NODES:
        plan = reproduce.plan_node(node, "cpu", compose=False, results=workdir)
        assert plan.error is None, (node, plan.error)
        assert len(plan.jobs) == math.prod(len(v) for v in sweep_values(node).values()), node
        assert all(j.samples >= 1 and j.seconds > 0 for j in plan.jobs), node
    # by hand: seeds x {fp16, uniform} x 7 bit widths; 1 seed x 2 bit widths x 5 arms
    assert len(reproduce.plan_node("semkv_cliff", compose=False, results=workdir).jobs) == 3 * 2 * 7
    intactkv = reproduce.plan_node("intactkv_ppl", compose=False, results=workdir)
    assert len(intactkv.jobs) == 1 * 2 * 5
    assert intactkv.jobs[0].label == "bits=2 +experiment/arms/intactkv_ppl@method=fp16"
    assert intactkv.jobs[0].samples == load_experiment("intactkv_ppl")["task"]["windows"]


def _write_run(folder: Path, samples: list[str], seconds: float, model: str, method: str, finished: bool):
    folder.mkdir(parents=True)
    rows = [{"sample_id": s, "seconds": seconds, "model": model, "method": method} for s in samples]
    (folder / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if finished:
        (folder / "metrics.json").write_text("{}\n")


GSM8K_LIMIT = load_experiment("kivi_gsm8k")["task"]["limit"]  # problems per job at CPU size
HITRATE_WINDOWS = load_experiment("specache_hitrate")["task"]["windows"]


def test_dry_run_finds_shared_runs_and_stored_samples(workdir):
    n = GSM8K_LIMIT
    plan = reproduce.plan_node("kivi_gsm8k", results=workdir)
    labels = [j.label for j in plan.jobs]
    assert labels == [
        "+method=fp16 bits=2",
        "+method=fp16 bits=4",
        "+method=kivi bits=2",
        "+method=kivi bits=4",
    ]
    # FP16 ignores bits: its two jobs write one run folder
    assert [j.same_as for j in plan.jobs] == [None, 0, None, None] and len(plan.runs) == 3
    assert [j.samples for j in plan.jobs] == [n] * 4 and plan.todo == 3 * n
    fp16, _, kivi2, kivi4 = plan.jobs
    assert fp16.folder.parts[:5] == ("results", "runs", "experiments", "kivi_gsm8k", "gsm8k")
    assert (fp16.method, kivi2.method, fp16.model) == ("fp16", "kivi-2b", "smollm2-135m")
    # the cost model: 1100 prompt tokens and 256 steps, 1.3x for a quantizing method
    base = reproduce.CPU_PREFILL_S_PER_KTOK * 1.1 + reproduce.CPU_STEP_S * 256
    assert fp16.seconds == pytest.approx(base) and kivi2.seconds == pytest.approx(1.3 * base)

    # fp16 finished at 4 s per sample, KIVI-2 one sample short at 10 s per sample
    _write_run(workdir / fp16.folder, [f"s{i}" for i in range(n)], 4.0, "smollm2-135m", "fp16", True)
    _write_run(
        workdir / kivi2.folder, [f"s{i}" for i in range(n - 1)], 10.0, "smollm2-135m", "kivi-2b", False
    )
    plan = reproduce.plan_node("kivi_gsm8k", results=workdir)
    fp16, _, kivi2, kivi4 = plan.jobs
    assert (fp16.complete, fp16.done, kivi2.complete, kivi2.done) == (True, n, False, n - 1)
    assert (kivi2.seconds, kivi2.source) == (10.0, "stored")
    node_mean = (n * 4 + (n - 1) * 10) / (2 * n - 1)  # no kivi-4b rows: the node's rows on this model
    assert kivi4.source == "stored (node)" and kivi4.seconds == pytest.approx(node_mean)
    assert plan.todo == 1 + n and not plan.complete
    overhead = 2 * CPU_RUN_OVERHEAD_S
    assert plan.estimate_s() == pytest.approx(1 * 10 + n * node_mean + overhead)


@pytest.mark.parametrize(
    "profile, unit, todo",
    [
        ("cpu", "est_min", 3 * GSM8K_LIMIT + HITRATE_WINDOWS),
        ("paper", "est_gpu_h", 3 * 1319 + HITRATE_WINDOWS),
    ],
)
def test_dry_run_prints_jobs_table_and_total(workdir, capsys, profile, unit, todo):
    assert (
        reproduce.main(
            # an empty results folder: the checkout's committed archives would price the jobs
            ["--dry-run", "--profile", profile, "--only", "kivi_gsm8k", "specache_hitrate"]
            + ["--results", str(workdir / "results")]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "kivi_gsm8k (+experiment=" in out and "4 jobs, 3 runs" in out
    assert "same run as job 0" in out and unit in out
    total = [line for line in out.splitlines() if line.startswith("total: ")]
    assert len(total) == 1 and total[0].startswith(f"total: 5 jobs, 4 runs, {todo} samples to run, about ")
    assert ("idle machine" in out) == (profile == "cpu")  # no stored runs: every time is modelled
    if profile == "paper":
        assert "+experiment=paper/kivi_gsm8k" in out and "1319 samples" in out and "GPU h" in out


@pytest.mark.parametrize("node", NODES)
def test_paper_profile_composes_and_sets_the_papers_model(node):
    name = reproduce.config_name(node, "paper")
    assert name == f"paper/{node}"
    check_experiment(name)  # what `python -m kvbench +experiment=paper/NAME` checks first
    params = sweep_values(name)
    first = {k: v[0] for k, v in params.items()}
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = to_plain(
            compose("config", overrides=[f"+experiment={name}", *(f"{k}={v}" for k, v in first.items())])
        )
        cpu = to_plain(
            compose("config", overrides=[f"+experiment={node}", *(f"{k}={v}" for k, v in first.items())])
        )
    expected = PAPER_MODELS.get(node.split("_")[0])
    if expected is not None:
        assert cfg["model"]["name"] == expected
    assert cfg["model"]["name"] != cpu["model"]["name"] == "smollm2-135m"
    plan = analysis_plan(cfg["analysis"])
    assert plan.name == node and cfg["output"]["root"] == cpu["output"]["root"]  # same unit, same folder
    assert plan.n == reproduce.samples_per_job(cfg)  # the declared n is what a job runs
    assert {int(s) for s in params.get("seed", ["0"])} == set(plan.seeds)
    build_method(cfg.get("method"), bits=cfg.get("bits"))  # the arm validates


def test_paper_group_ablation_adds_the_g128_arm():
    assert sweep_values("paper/kivi_group_ablation")["+experiment/arms/kivi_group_ablation@method"] == [
        "fp16",
        "g32",
        "g64",
        "g128",
    ]
    assert "g128" not in sweep_values("kivi_group_ablation")["+experiment/arms/kivi_group_ablation@method"]


class FakeRunner:
    """Stands in for the subprocesses: records every command, fails the nodes it is told to."""

    def __init__(self, fail: set[str] = frozenset()):
        self.fail, self.calls = fail, []

    def __call__(self, cmd, env, log=None):
        self.calls.append((cmd, env, log))
        node = next(
            (a.partition("=")[2].rpartition("/")[2] for a in cmd if a.startswith("+experiment=")), None
        )
        return 1 if node in self.fail else 0

    def nodes(self) -> list[str]:
        return [c[4].partition("=")[2] for c, _, _ in self.calls if c[1:3] == ["-m", "kvbench"]]

    def reports(self) -> list[list[str]]:
        return [c[3:] for c, _, _ in self.calls if c[1:3] == ["-m", "kvbench.report"]]


def test_reproduce_runs_every_node_once_then_archives_and_regenerates(workdir, monkeypatch, capsys):
    fake = FakeRunner(fail={"kivi_gsm8k"})
    monkeypatch.setattr(reproduce, "run_command", fake)
    # one node is stored in full already: it is not started
    plan = reproduce.plan_node("specache_hitrate", results=workdir)
    (job,) = plan.jobs
    _write_run(workdir / job.folder, [f"w{i}" for i in range(job.samples)], 1.0, job.model, job.method, True)

    code = reproduce.main(["--runs", "runs", "--results", "res", "--threads", "1"])
    assert code == 1  # one node failed
    assert fake.nodes() == [
        n for n in NODES if n != "specache_hitrate"
    ]  # each once, in order, past the failure
    assert fake.reports() == [["--archive", "runs", "--results", "res"], ["--regenerate", "--results", "res"]]
    first_cmd, env, log = fake.calls[0]
    assert first_cmd[1:5] == ["-m", "kvbench", "-m", f"+experiment={NODES[0]}"]
    assert env["OMP_NUM_THREADS"] == "1" and log is None
    out = capsys.readouterr().out
    table = out[out.index("node ") :].splitlines()
    rows = {line.split()[0]: line for line in table[1:] if line.strip()}
    assert "failed (exit 1)" in rows["kivi_gsm8k"] and "done" in rows["specache_hitrate"]
    assert rows["semkv_cliff"].split()[1:2] == ["42"] and rows["semkv_cliff"].rstrip().endswith("ok")
    assert "ok" in rows["[archive]"] and "ok" in rows["[regenerate]"]
    assert "reproduce: 1 failed: kivi_gsm8k" in out and " min in all" in out
    summary = (Path("runs") / ".reproduce" / "cpu" / "summary.md").read_text()
    assert "- failed: kivi_gsm8k" in summary and "threads per node: 1" in summary
    assert "\n".join(table[:3]) in summary  # the printed table, as printed


def test_paper_profile_runs_the_variants_and_fails_a_node_without_one(workdir, monkeypatch, capsys):
    conf = workdir / "conf"
    shutil.copytree(CONF_DIR, conf)
    (conf / "experiment" / "newcomer.yaml").write_text(
        (conf / "experiment" / "specache_hitrate.yaml").read_text().replace("specache_hitrate", "newcomer")
    )
    fake = FakeRunner()
    monkeypatch.setattr(reproduce, "run_command", fake)
    argv = [
        "--profile",
        "paper",
        "--only",
        "newcomer",
        "kivi_gsm8k",
        "--conf-dir",
        str(conf),
        "--parallel",
        "2",
    ]
    argv += ["--launcher", "slurm", "--override", "hydra.launcher.partition=gpu", "--no-report"]
    assert reproduce.main(argv) == 1
    (cmd, env, log), *rest = fake.calls
    assert not rest and cmd[3:] == [
        "-m",
        "+experiment=paper/kivi_gsm8k",
        "hydra/launcher=slurm",
        # a node's arms share a job (and so its model load and prefills) on the cluster
        "hydra.launcher.points_per_job=auto",
        "hydra.launcher.partition=gpu",
    ]
    assert log == Path("results/runs/.reproduce/paper/kivi_gsm8k.log")
    assert env["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 2))
    out = capsys.readouterr().out
    assert "no paper setting: add conf/experiment/paper/newcomer.yaml" in out
    # the two lanes print whole lines (unlocked prints had spliced one node's line into another's)
    assert all(line.count("reproduce:") <= 1 for line in out.splitlines())


@pytest.mark.parametrize("flag", ["--only", "--skip"])
def test_unknown_node_is_one_line_listing_the_known_ones(workdir, capsys, flag):
    assert reproduce.main([flag, "semkv_cliff", "nope", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err
    assert err.startswith(f"kvbench.reproduce: error: {flag}: unknown node nope; known nodes: ")
    assert all(n in err for n in NODES)


STRONG = sorted(p.stem for p in (Path(CONF_DIR) / "experiment" / "strong").glob("*.yaml"))


def test_strong_profile_runs_only_the_nodes_with_a_second_model_variant(workdir, capsys):
    assert STRONG == [
        "attention_probe",
        "intactkv_ppl",
        "kivi_axis_ablation",
        "kivi_group_ablation",
        "kivi_gsm8k",
        "kvquant_ablation",
        "ott_vs_kivi",
        "semkv_cliff",
        "semkv_interpolation",
        "semkv_interpolation_above_cliff",
        "semkv_prune_vs_lowprec",
        "semkv_turboquant_cliff",
        "semkv_turboquant_interpolation",
        "specache_1bit_zero_point",
        "specache_hitrate",
        "specache_k_ablation",
        "specache_niah",
    ]
    assert reproduce.profile_nodes(reproduce.discover(), "strong", None) == STRONG
    assert reproduce.profile_nodes(["readkv_read_budget"], "cpu", None) == ["readkv_read_budget"]
    # a node named by --only stays, and fails with the file to add
    assert reproduce.profile_nodes(["readkv_read_budget"], "strong", ["readkv_read_budget"]) == [
        "readkv_read_budget"
    ]
    with pytest.raises(ValueError, match="add conf/experiment/strong/readkv_read_budget.yaml"):
        reproduce.config_name("readkv_read_budget", "strong")
    assert reproduce.main(["--dry-run", "--profile", "strong", "--results", str(workdir / "results")]) == 0
    out = capsys.readouterr().out
    assert "+experiment=strong/kivi_gsm8k" in out and "+experiment=strong/kivi_group_ablation" in out
    assert "readkv_read_budget" not in out and "est_min" in out


@pytest.mark.parametrize("node", STRONG)
def test_strong_variant_keeps_the_node_and_changes_the_model(node):
    name = reproduce.config_name(node, "strong")
    check_experiment(name)
    params = sweep_values(name)
    first = {k: v[0] for k, v in params.items()}
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = to_plain(
            compose("config", overrides=[f"+experiment={name}", *(f"{k}={v}" for k, v in first.items())])
        )
    assert cfg["model"]["name"] == "qwen2.5-coder-1.5b-instruct"
    assert cfg["analysis"]["name"] == node and cfg["output"]["root"] == f"results/runs/experiments/{node}"
    # the pairs the node's analysis declares are the samples each of its jobs plans (a NIAH grid's
    # lengths x depths, a perplexity or hit-rate node's windows, another task's limit)
    plan = reproduce.plan_node(node, "strong", compose=False)
    assert not plan.error and {job.samples for job in plan.jobs} == {cfg["analysis"]["n"]}
    # the cost model scales with the model: the 1.5B's modelled sample costs more than the default's
    params_15, *_ = reproduce.model_shape(cfg["model"])
    assert params_15 / reproduce.CPU_MODEL_PARAMETERS > 10
