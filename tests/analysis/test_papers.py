"""Each paper's own table (kvbench.analysis.papers): cells are the per-configuration means of the
runs the arm selectors pick, the published value sits beside its cell, a node without runs gives its
run command, and every selector of every layout picks exactly one configuration of its node's sweep
(at CPU size or in the node's paper setting)."""

from __future__ import annotations

import copy
import itertools
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from synthetic_claims import EXPERIMENT, SAMPLES, SEEDS, fp16_score, write_claim_runs, write_paper

from kvbench import report
from kvbench.__main__ import load_experiment
from kvbench.analysis import papers
from kvbench.analysis.archive import frames_from_runs
from kvbench.analysis.claims import select
from kvbench.config import to_plain
from kvbench.methods import build_method
from kvbench.paths import CONF_DIR, PAPERS_DIR
from kvbench.results import RunFolder, run_id
from kvbench.run import run_config
from kvbench.tasks.pg19_hitrate import sparsity_key

MODEL = "tiny"
REPO = Path(__file__).resolve().parents[2]
PAPERS = {p.id: p for p in papers.load_papers(conf_dir=CONF_DIR)}
ALL_LAYOUTS = [layout for paper in PAPERS.values() for layout in paper.tables]


def _write_run(root, experiment, task, label, method, bits, seed, rows, metric):
    plan = {"name": experiment, "reference": "fp16", "metric": metric, "alpha": 0.05, "margin": 0.1}
    config = {
        "task": {"name": task},
        "model": {"name": MODEL},
        "method": method,
        "bits": bits,
        "seed": seed,
        "analysis": plan,
    }
    rid = run_id(config)
    folder = RunFolder(root / experiment / label / f"seed{seed}-{rid}")
    folder.write_config({**config, "run_id": rid})
    for sample_id, fields in rows:
        memory = {k: fields.pop(k) for k in ("effective_bits", "code_bits") if k in fields}
        folder.append(
            {
                "sample_id": sample_id,
                "seed": seed,
                "task": task,
                "model": MODEL,
                "method": label,
                "bits": bits,
                **fields,
                "memory": memory,
            }
        )
    folder.write_metrics({"run_id": rid, "primary_metric": metric, "method": label})


# --- KVQuant: 8 arms x 3 bit widths, 4 perplexity windows ------------------------------------------

KVQ_FULL = {"pre_rope": True, "datatype": "nuq", "outlier_fraction": 0.01, "sink": True, "calibrate": True}
KVQ_ARMS = {  # row key -> (method node without bits, base perplexity)
    "int_channel": ({"name": "uniform", "key_axis": "channel", "value_axis": "token", "group_size": 32}, 9.0),
    "full": ({"name": "kvquant", **KVQ_FULL}, 6.0),
    "no_pre_rope": ({"name": "kvquant", **KVQ_FULL, "pre_rope": False}, 6.5),
    "no_nuq": ({"name": "kvquant", **KVQ_FULL, "datatype": "uniform"}, 6.4),
    "no_outliers": ({"name": "kvquant", **KVQ_FULL, "outlier_fraction": 0.0}, 7.0),
    "no_sink": ({"name": "kvquant", **KVQ_FULL, "sink": False}, 6.2),
    "no_outliers_no_sink": ({"name": "kvquant", **KVQ_FULL, "outlier_fraction": 0.0, "sink": False}, 8.0),
}
WINDOWS = 4


def kvq_ppl(row: str, bits: int | None, i: int) -> float:
    if row == "fp16":
        return 5.5 + 0.1 * i
    return KVQ_ARMS[row][1] + (4 - bits) * 0.75 + 0.1 * i + 0.01 * bits * i


def kvq_eff(row: str, bits: int | None, i: int) -> float:
    return 16.0 if row == "fp16" else bits + 0.25 + 0.05 * i + (0.5 if row == "full" else 0.0)


@pytest.fixture(scope="module")
def frames(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    windows = [f"w{i}" for i in range(WINDOWS)]
    for bits in (2, 3, 4):
        for row, (node, _) in KVQ_ARMS.items():
            rows = [
                (w, {"ppl": kvq_ppl(row, bits, i), "effective_bits": kvq_eff(row, bits, i)})
                for i, w in enumerate(windows)
            ]
            label = f"{node['name']}-{bits}b-{row}"
            _write_run(
                root, "kvquant_ablation", "perplexity", label, {**node, "bits": bits}, bits, 0, rows, "ppl"
            )
    rows = [(w, {"ppl": kvq_ppl("fp16", None, i), "effective_bits": 16.0}) for i, w in enumerate(windows)]
    _write_run(root, "kvquant_ablation", "perplexity", "fp16", None, None, 0, rows, "ppl")

    # SpeCache k ablation: 1-bit SpeCache at five k, FP16; 5 samples x 2 seeds
    for seed in (0, 1):
        for k in (0, 16, 32, 64, 128):
            node = {"name": "specache", "bits": 1, "group_size": 32, "topk": k, "zero_point": "specache"}
            rows = [(f"s{i}", {"score": spec_score(k, i, seed)}) for i in range(5)]
            _write_run(root, "specache_k_ablation", "niah", f"specache-1b-k{k}", node, 1, seed, rows, "score")
        rows = [(f"s{i}", {"score": spec_score(None, i, seed)}) for i in range(5)]
        _write_run(root, "specache_k_ablation", "niah", "fp16", None, None, seed, rows, "score")

    # SpeCache hit rates: the FP16 cache, every policy at every sparsity, 3 windows
    rows = [(f"w{i}", {"hit_rate": 0.5, "hit_rates": hit_rates(i)}) for i in range(3)]
    _write_run(root, "specache_hitrate", "pg19_hitrate", "fp16", None, None, 0, rows, "hit_rate")
    return frames_from_runs(root)


def spec_score(k: int | None, i: int, seed: int) -> float:
    if k is None:
        return 1.0 if (i + seed) % 5 else 0.5
    return min(1.0, (k / 128 + (i % 3) / 3 + seed * 0.1) / 1.5)


SPARSITIES = ("0.005", "0.01", "0.02", "0.05", "0.1")
POLICIES = ("exact_topk", "specache", "h2o")


def hit_rates(i: int) -> dict:
    return {
        p: {s: round(0.3 + 0.1 * j + 0.5 * float(s) + 0.01 * i, 6) for s in SPARSITIES}
        for j, p in enumerate(POLICIES)
    }


def _layout(paper: str, node: str) -> papers.Layout:
    return next(layout for layout in PAPERS[paper].tables if layout.node == node)


def _table(layout, frames, n_resamples=500):
    node_frames = {n: papers._model_frame(frames, n, MODEL) for n in layout.nodes}
    plans = {n: (papers.plan_of(f) if f is not None else {}) for n, f in node_frames.items()}
    return papers.table(layout, node_frames, plans, n_resamples=n_resamples)[0].set_index(
        layout.corner or " "
    )


def assert_cell(text: str, want: float, digits: int) -> None:
    """The cell reads ``mean [low, high]`` with the mean computed by hand, to the table's digits,
    inside its interval."""
    mean, low, high = _mean_and_ci(text)
    assert text.split(" [")[0] == f"{want:.{digits}f}", (text, want)
    assert low <= mean <= high and low <= high


def _mean_and_ci(text: str) -> tuple[float, float, float]:
    m = re.fullmatch(r"(-?[\d.]+) \[(-?[\d.]+), (-?[\d.]+)\]", text)
    assert m, text
    return tuple(float(g) for g in m.groups())


# ----------------------------------------------------------------------------------------- tests


def test_kvquant_cells_are_the_hand_computed_means_with_the_published_value_beside(frames):
    layout = _layout("kvquant", "kvquant_ablation")
    table = _table(layout, frames)
    labels = {r.key: r.label for r in layout.rows}
    assert list(table.index) == [r.label for r in layout.rows]
    for key, label in labels.items():
        for bits in (4, 3, 2):
            want = np.mean([kvq_ppl(key, bits, i) for i in range(WINDOWS)])
            assert_cell(table.loc[label, f"{bits}-bit ppl"], want, 2)
            assert _mean_and_ci(table.loc[label, f"{bits}-bit ppl"])[1] < want  # a real interval
            eff = np.mean([kvq_eff(key, bits, i) for i in range(WINDOWS)])
            assert table.loc[label, f"{bits}-bit eff. bits"] == f"{eff:.2f}"  # accounting: no interval
    # the published values sit in the column right after their cell, only on the full method's row
    columns = list(table.columns)
    for bits, bound, ratio in ((4, "0.02", "3.7x"), (3, "0.1", "4.8x"), (2, "0.5", "6.9x")):
        ppl = columns.index(f"{bits}-bit ppl")
        assert columns[ppl + 1] == f"{bits}-bit ppl (paper)"
        published = table[f"{bits}-bit ppl (paper)"]
        assert published[labels["full"]] == f"FP16 + < {bound}"
        assert (published.drop(labels["full"]) == "").all()
        assert table.loc[labels["full"], f"{bits}-bit eff. bits (paper)"].startswith(ratio)
    # FP16 ignores bits: one configuration, the same mean in every bit column
    fp16 = np.mean([kvq_ppl("fp16", None, i) for i in range(WINDOWS)])
    for bits in (4, 3, 2):
        assert_cell(table.loc["FP16", f"{bits}-bit ppl"], fp16, 2)


def test_specache_k_ablation_columns_are_k(frames):
    layout = _layout("specache", "specache_k_ablation")
    table = _table(layout, frames)
    row = "SpeCache-1 (g=32)"
    for k in (0, 16, 64, 128):
        want = np.mean([spec_score(k, i, seed) for seed in (0, 1) for i in range(5)])
        assert_cell(table.loc[row, f"k={k}"], want, 3)
    fp16 = np.mean([spec_score(None, i, seed) for seed in (0, 1) for i in range(5)])
    fp16_cells = {table.loc["FP16", f"k={k}"] for k in (0, 16, 64, 128)}
    assert len(fp16_cells) == 1
    assert_cell(fp16_cells.pop(), fp16, 3)
    assert table.loc[row, "k=16 (paper)"].startswith("markedly above k=0")
    assert table.loc["FP16", "k=16 (paper)"] == "" and "k=64 (paper)" not in table.columns


def test_hit_rate_cells_read_the_policy_and_sparsity_of_the_dict_column(frames):
    layout = _layout("specache", "specache_hitrate")
    table = _table(layout, frames)
    for row in layout.rows:
        for column in layout.columns:
            policy, sparsity = row.vars["policy"], column.vars["sparsity"]
            want = np.mean([hit_rates(i)[policy][sparsity] for i in range(3)])
            assert_cell(table.loc[row.label, column.label], want, 3)
    assert table.loc["query-dependent top-k (exact)", "0.5 % (paper)"] == "about 0.90"


def test_a_node_without_runs_gives_its_run_line(frames):
    # published values: the table is still shown, every measured cell empty
    lines = papers.render(_layout("specache", "specache_niah"), frames, MODEL, n_resamples=100)
    assert "No runs on tiny yet: `python -m kvbench -m +experiment=specache_niah`." in lines
    text = "\n".join(lines)
    assert "| KIVI-1 (g=32, R=128) | - | retrieval severely damaged |" in text
    # no published values: the run line alone
    lines = papers.render(_layout("semkv", "semkv_interpolation_above_cliff"), frames, MODEL)
    assert run_line_of("semkv_interpolation_above_cliff") in lines
    assert not any(line.startswith("|") for line in lines)
    # runs on another model are no runs on this one
    lines = papers.render(_layout("kvquant", "kvquant_ablation"), frames, "other", n_resamples=100)
    assert "No runs on other yet: `python -m kvbench -m +experiment=kvquant_ablation`." in lines


def run_line_of(node: str) -> str:
    return f"No runs on {MODEL} yet: `python -m kvbench -m +experiment={node}`."


def test_attention_probe_renders_when_its_frame_exists(frames, tmp_path):
    layout = _layout("ott", "attention_probe")
    assert run_line_of("attention_probe") in papers.render(layout, frames, MODEL)
    errs = {"fp16": 1e-4, "kivi-2b": 0.30, "ott-2b": 0.12}
    # the OTT row selects the default layout by config (the probe also runs OTT at other G, R, skip_layers)
    ott = {"name": "ott", "bits": 2, "group_size": 128, "residual": 32, "pool_size": 3, "skip_layers": 2}
    nodes = {"fp16": None, "kivi-2b": {"name": "kivi", "bits": 2}, "ott-2b": {**ott, "selection": "smallest"}}
    for label, err in errs.items():
        bits = None if label == "fp16" else 2
        rows = [(f"w{i}", {"rel_err": err * (1 + 0.1 * i)}) for i in range(4)]
        _write_run(
            tmp_path, "attention_probe", "attention_probe", label, nodes[label], bits, 0, rows, "rel_err"
        )
    probe = frames_from_runs(tmp_path)
    lines = papers.render(layout, {**frames, **probe}, MODEL, n_resamples=200)
    assert run_line_of("attention_probe") not in lines
    table = _table(layout, {**frames, **probe})
    for label, err in (("FP16", 1e-4), ("KIVI-2", 0.30), ("OTT-2", 0.12)):
        want = np.mean([err * (1 + 0.1 * k) for k in range(4)])
        assert_cell(table.loc[label, "relative attention-output error"], want, 4)


def test_a_selector_matching_two_configurations_says_so(frames):
    loose = {"method": "kvquant", "bits": 2, "config": {"outlier_fraction": 0.0}}
    layout = papers.Layout(
        paper="kvquant",
        node="kvquant_ablation",
        title="t",
        where="w",
        published_on="m",
        rows=(papers.arm("loose", "no outliers", loose),),
        columns=(papers.axis("ppl", "ppl"),),
    )
    text = _table(layout, frames).loc["no outliers", "ppl"]
    assert text == "2 configurations: kvquant-2b-no_outliers, kvquant-2b-no_outliers_no_sink"


def test_paper_page_keeps_the_claims_and_replaces_the_generic_rows(frames):
    results = report.claims_results(frames, models=[MODEL], n_resamples=100)
    page = report.paper_markdown(PAPERS["kvquant"], results[MODEL], frames, MODEL, n_resamples=100)
    assert "## Claims" in page and "| kvquant-pre-rope |" in page
    assert "## KVQuant: the components one at a time" in page
    assert "## kvquant_ablation" not in page  # the generic per-node table is gone where a layout is
    ppl4 = np.mean([kvq_ppl("full", 4, i) for i in range(WINDOWS)])
    eff4 = np.mean([kvq_eff("full", 4, i) for i in range(WINDOWS)])
    assert f"| KVQuant: pre-RoPE, nuq, 1% outliers, FP16 sink | {ppl4:.2f} [" in page
    assert f"| FP16 + < 0.02 | {eff4:.2f} | 3.7x smaller than FP16 |" in page
    kivi = report.paper_markdown(PAPERS["kivi"], results[MODEL], frames, MODEL, n_resamples=100)
    assert "task=longbench" in kivi and run_line_of("kivi_gsm8k") in kivi


# --------------------------------------------------------- the selectors against the real nodes


def test_every_layout_resolves_and_names_known_nodes():
    nodes = set()
    for layout in ALL_LAYOUTS:
        papers.check(layout)
        nodes |= set(layout.nodes)
        assert layout.paper in PAPERS
    existing = {p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml")}
    assert nodes <= existing
    kvquant = _layout("kvquant", "kvquant_ablation")
    with pytest.raises(papers.LayoutError, match="no variable 'bits'"):
        papers.cell(kvquant, kvquant.rows[1], papers.axis("x", "x"))
    with pytest.raises(papers.LayoutError, match="exactly one of the row and the column"):
        papers.cell(kvquant, kvquant.rows[1], papers.arm("fp16", "FP16", {"method": "fp16"}))


def _sweep(node: str) -> list[dict[str, str]]:
    """Every combination of the node's sweep values (a paper variant's merged over its node's), the
    seed at its first value."""
    params = load_experiment(node)["hydra"]
    params = {k: [v.strip() for v in str(vs).split(",")] for k, vs in params["sweeper"]["params"].items()}
    params["seed"] = params.get("seed", ["0"])[:1]
    keys = list(params)
    return [dict(zip(keys, values, strict=True)) for values in itertools.product(*params.values())]


def _composed(node: str) -> pd.DataFrame:
    """One row per configuration the node's sweep runs, with the frame columns selectors read:
    the label, the method's registered name, the bits the run records and the method node it
    writes to config.json."""
    rows = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for point in _sweep(node):
            overrides = [f"+experiment={node}", *(f"{k}={v}" for k, v in point.items())]
            cfg = to_plain(compose("config", overrides=overrides))
            method = build_method(cfg.get("method"), bits=cfg.get("bits"))
            node_cfg = run_config(cfg).get("method") or {"name": "fp16"}
            rows.append(
                {
                    "method": f"{method.label()}|{sorted(node_cfg.items())}",
                    "method_name": method.registered_name,
                    "bits": math.nan if method.config.bits is None else float(method.config.bits),
                    "method_config": node_cfg,
                }
            )
    frame = pd.DataFrame(rows)
    return frame.drop_duplicates(subset="method").reset_index(drop=True)


def _configurations(node: str) -> pd.DataFrame:
    """What the node runs at CPU size and in its variants (conf/experiment/{paper,strong}/NODE.yaml):
    an arm that fits only a larger model (KIVI's G=128 needs head_dim 128, the short-window arm
    runs on the second model only) is in a variant."""
    variants = [
        folder
        for folder in ("paper", "strong")
        if (Path(CONF_DIR) / "experiment" / folder / f"{node}.yaml").is_file()
    ]
    names = [node] + [f"{folder}/{node}" for folder in variants]
    frame = pd.concat([_composed(name) for name in names])
    return frame.drop_duplicates(subset="method").reset_index(drop=True)


NODE_LAYOUTS = sorted(
    {(layout.paper, layout.node) for layout in ALL_LAYOUTS if layout.node != "attention_probe"}
)


@pytest.mark.parametrize("paper, node", NODE_LAYOUTS)
def test_every_selector_picks_one_configuration_of_its_node(paper, node):
    """Each cell of the layout, resolved against the configurations the node's sweep composes (its
    arms, its bits; at CPU size or in its paper setting), matches exactly one of them: selectors use
    method names and config keys and values that exist."""
    layout = _layout(paper, node)
    composed = {n: _configurations(n) for n in layout.nodes}
    for row in layout.rows:
        for column in layout.columns:
            spec = papers.cell(layout, row, column)
            matched = select(composed[spec.node], spec.selector)
            assert len(matched) == 1, (spec.node, row.key, column.key, list(matched["method"]))
    if node == "specache_hitrate":  # the sparsities are the task's keys
        sparsities = OmegaConf.load(Path(CONF_DIR) / "experiment" / f"{node}.yaml").task.sparsities
        assert [c.vars["sparsity"] for c in layout.columns] == [sparsity_key(s) for s in sparsities]


# ------------------------------------------------------------------------ a paper is one file

KIVI_2 = {"method": "kivi", "bits": 2}
TOY_TABLE = {
    "node": EXPERIMENT,
    "title": "Toy: keys per channel against per token at 2 bits",
    "where": "Toy Table 1",
    "published_on": "a toy model",
    "corner": "cache",
    "rows": [
        {"key": "fp16", "label": "FP16", "select": {"method": "fp16"}},
        {"key": "chan", "label": "K per-channel", "select": {**KIVI_2, "config": {"key_axis": "channel"}}},
        {"key": "tok", "label": "K per-token", "select": {**KIVI_2, "config": {"key_axis": "token"}}},
    ],
    "columns": [{"key": "score", "label": "score"}],
    "published": {"chan": {"score": "near FP16"}, "tok": {"score": 0.0}},
}
TOY_CLAIM = {
    "id": "toy-channel-keys",
    "where": "Table 1",
    "statement": "Keys per channel beat keys per token at 2 bits.",
    "published": "near FP16",
    "experiment": EXPERIMENT,
    "arms": {
        "chan": {**KIVI_2, "config": {"key_axis": "channel"}},
        "tok": {**KIVI_2, "config": {"key_axis": "token"}},
    },
    "rule": "better(chan, tok)",
}


def test_a_new_paper_is_one_yaml_file_found_rendered_and_its_claim_evaluated(tmp_path):
    """A paper file dropped beside the shipped ones is found in its order; its table is rendered
    from the runs its selectors pick, its claim gets a verdict, its page and README table appear."""
    folder = tmp_path / "papers"
    shutil.copytree(PAPERS_DIR, folder)
    write_paper(folder, [TOY_CLAIM], paper="toy", tables=[TOY_TABLE], order=99)
    found = papers.load_papers(folder, conf_dir=CONF_DIR)
    assert [p.id for p in found] == [*PAPERS, "toy"]
    assert papers.load_claims(folder)[-1].id == "toy-channel-keys"

    toy = [p for p in found if p.id == "toy"]
    frames = frames_from_runs(write_claim_runs(tmp_path / "runs"))
    by_model = report.claims_results(frames, toy, ["tiny"], n_resamples=200)
    (result,) = by_model["tiny"]
    assert (result.claim.paper, result.verdict) == ("toy", "reproduced")

    (path,) = report.write_papers(by_model, frames, tmp_path / "out", n_resamples=200, papers=toy)
    page = path.read_text()
    assert path.name == "toy_tiny.md" and page.startswith("# The toy paper: published against measured")
    assert "| toy-channel-keys | Table 1 | near FP16 | chan - tok = " in page and "| reproduced |" in page
    # the channel arm scores FP16's score (0 on one sample of 12), the token arm 0 everywhere
    want = np.mean([fp16_score(i) for _ in SEEDS for i in range(len(SAMPLES))])
    assert_cell(_cell(page, "K per-channel", 1), want, 3)
    assert _cell(page, "K per-channel", 2) == "near FP16" and _cell(page, "K per-token", 2) == "0.0"
    assert_cell(_cell(page, "K per-token", 1), 0.0, 3)
    assert "Paper: Toy Table 1, on a toy model." in page
    block = report.readme_block(by_model, frames, model="tiny", n_resamples=200, papers=toy)
    assert "### Toy: keys per channel against per token at 2 bits" in block
    assert "All of toy's tables: `results/papers/toy_tiny.md`." in block


def _cell(page: str, label: str, column: int) -> str:
    row = next(line for line in page.splitlines() if line.startswith(f"| {label} |"))
    return [c.strip() for c in row.strip("|").split("|")][column]


def _toy_table(**change):
    return {**copy.deepcopy(TOY_TABLE), **change}


def _rows(i, **change):
    rows = copy.deepcopy(TOY_TABLE["rows"])
    rows[i] = {**rows[i], **change}
    return rows


@pytest.mark.parametrize(
    "doc, key, message",
    [
        ({"order": "first"}, "order='first'", "must be a whole number"),
        ({"paper": "other"}, "paper='other'", "must be the file's stem 'toy'"),
        ({"colour": "red"}, "colour='red'", "unknown key; allowed: paper, title, source, order"),
        ({"title": None}, "title=None", "must be text"),
        ({"tables": [_toy_table(digits="two")]}, "tables[0].digits='two'", "must be a whole number"),
        ({"tables": [_toy_table(digits=20)]}, "tables[0].digits=20", "must lie in [0, 10]"),
        ({"tables": [_toy_table(rows=[])]}, "tables[0].rows=[]", "must be a non-empty list"),
        ({"tables": [_toy_table(colour=1)]}, "tables[0].colour=1", "unknown key; allowed: node, title"),
        (
            {"tables": [_toy_table(rows=_rows(1, select={"method": "kivi", "bits": "four"}))]},
            "tables[0].rows[1].select.bits='four'",
            "must be a number or a placeholder such as '$bits'",
        ),
        (
            {"tables": [_toy_table(rows=_rows(1, select={"bits": 2}))]},
            "tables[0].rows[1].select={'bits': 2}",
            "needs 'method' or 'label'",
        ),
        (
            {"tables": [_toy_table(rows=_rows(0, key=4))]},
            "tables[0].rows[0].key=4",
            "must be text (quote a number",
        ),
        (
            {"tables": [_toy_table(published={"nope": {"score": "x"}})]},
            f"tables[0]={EXPERIMENT!r}",
            "published value at ('nope', 'score'): no such cell",
        ),
        (
            {"tables": [_toy_table(columns=[{"key": "s", "label": "s", "select": {"method": "fp16"}}])]},
            f"tables[0]={EXPERIMENT!r}",
            "exactly one of the row and the column selects the arm",
        ),
        (
            {"tables": [_toy_table(node="no_such_node")]},
            "tables[0].node='no_such_node'",
            "no such node under conf/experiment",
        ),
    ],
)
def test_a_bad_paper_file_is_refused_in_one_line_naming_file_key_value_and_what_is_allowed(
    tmp_path, doc, key, message
):
    write_paper(tmp_path, [TOY_CLAIM], tables=[TOY_TABLE])
    path = tmp_path / "toy.yaml"
    good = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**good, **doc}, sort_keys=False))
    with pytest.raises(papers.PaperError) as err:
        papers.load_papers(tmp_path, conf_dir=CONF_DIR)
    text = str(err.value)
    assert text.startswith(f"{path}: {key}: ") and message in text and "\n" not in text, text


def test_a_folder_without_paper_files_is_refused(tmp_path):
    with pytest.raises(papers.PaperError, match="holds no <paper>.yaml"):
        papers.load_papers(tmp_path)
    with pytest.raises(papers.PaperError, match="does not exist"):
        papers.load_papers(tmp_path / "nope")
