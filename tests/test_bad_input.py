"""Bad input, as a new user would type it: every case is one line on stderr naming the key, exit
status 2, no traceback, and nothing on disk, before any model loads. Legal but self-defeating
settings run with a warning and a flag in metrics.json. Results files never lose a valid row: a
malformed line is set aside with a warning, and a run killed anywhere (inside a sample, in the
middle of appending a row, inside the metrics write) resumes to the result of an uninterrupted run.

The command-line cases call the CLI entry in-process (a `python -m kvbench` start costs seconds);
the model they check against is a folder made here (config.json and a tiny tokenizer, no weights:
nothing may load them), and the NIAH haystack is a few files made here too.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvbench.__main__ as cli_module
from kvbench.errors import ConfigError
from kvbench.models import model_node
from kvbench.results import RunFolder
from kvbench.run import execute, plan_run, summary_line

ROOT = Path(__file__).resolve().parent.parent
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
# The default model's attention geometry (head_dim 64, context 8192), without its weights.
MODEL_CONFIG = {
    "model_type": "llama",
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
    "vocab_size": 16,
    "max_position_embeddings": 8192,
}


def make_model_folder(path: Path, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers

    path.mkdir(parents=True)
    words = "the a . is best thing to do in san francisco".split()
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>"}
    if chat_template:
        tok_config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    # a whole safetensors file holding no tensor: the checks read its header, never its weights
    (path / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    return path


def make_haystack(root: Path, essays: dict[str, bytes]) -> Path:
    folder = root / "niah" / "PaulGrahamEssays"
    folder.mkdir(parents=True)
    for name, text in essays.items():
        (folder / name).write_bytes(text)
    return root


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("inputs")
    essay = b"Startups are hard. The best ones grow fast. " * 40
    regular_file = base / "a-file"
    regular_file.write_text("not a folder")
    broken = base / "broken-config"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    empty = base / "empty"
    empty.mkdir()
    return {
        "model": make_model_folder(base / "model"),
        "model_no_template": make_model_folder(base / "model-no-template", chat_template=None),
        "empty_folder": empty,
        "broken_config": broken,
        "haystack": make_haystack(base / "data", {"one.txt": essay, "two.txt": essay}),
        "latin1_haystack": make_haystack(base / "latin1", {"one.txt": essay, "two.txt": b"caf\xe9 au lait"}),
        "empty_haystack": make_haystack(base / "no-essays", {}),
        "regular_file": regular_file,
    }


@pytest.fixture
def cli(tmp_path, inputs, capsys, monkeypatch):
    """Call the CLI entry in-process; returns (exit status, stderr lines, output root). The run
    itself must never start: a bad input has to be caught before Hydra sets up a job."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(cli_module, "main", lambda: pytest.fail("the input was not rejected before the run"))
    monkeypatch.setattr(sys, "argv", ["kvbench"])
    out = tmp_path / "out"

    def call(*args: str):
        common = [f"model.path={inputs['model']}", f"data.root={inputs['haystack']}", f"output.root={out}"]
        flags = [a for a in args if a in ("-m", "--verbose")]
        overrides = [a for a in args if a not in flags]
        with pytest.raises(SystemExit) as exit_info:
            cli_module.cli([*flags, *common, *overrides])
        captured = capsys.readouterr()
        return exit_info.value.code, captured.err.strip().splitlines(), out

    return call


def fmt(args, inputs):
    return [a.format(**inputs) for a in args]


# (what is typed, the key the line must name, a phrase the line must hold)
CASES = [
    (["output.root=/sys/kvx"], "output.root", "create and write"),
    (["output.root={regular_file}"], "output.root", "is a file"),
    (["output.root={regular_file}/runs"], "output.root", "is a file"),
    (["seed=abc"], "seed", "an int"),
    (["seed=-1"], "seed", "an int in 0.."),
    (["seed=1.5"], "seed", "an int"),
    (["bits=abc"], "bits", "a number"),
    (["bits=[1"], "bits", "override syntax"),
    (["bit=2"], "bit", "did you mean bits?"),
    (["+bit=2"], "bit", "did you mean bits?"),
    (["+method=kivi", "method.grop_size=32"], "method.grop_size", "did you mean group_size?"),
    (["model.nope.x=1"], "model.nope.x", "unknown key"),
    (["logger=foo"], "logger", "none, wandb"),
    (["logger=wandb", "logger.mode=sometimes"], "logger.mode", "auto, online, offline"),
    (["hydra/launcher=nope"], "hydra/launcher", "basic"),
    (["+method=kivi", "+method=kivi"], "method", "more than once"),
    (["model=nope"], "model", "known model nodes"),
    (["+method=nope"], "method", "known method nodes"),
    (["+experiment=nope"], "experiment", "known experiment nodes"),
    (["device=tpu"], "device", "auto, cpu, cuda"),
    (["output.resume=maybe"], "output.resume", "true, false or force"),
    # an unquoted path with a space: the shell makes two arguments of it
    (["task=perplexity", "task.path=/tmp/my", "book.txt"], "book.txt", "quotes: 'task.path=/tmp/my book"),
    (["task.path=/tmp/a(b"], "task.path", "quote a value holding spaces"),
    (["model.name=" + "x" * 5000], "model.name", "(5002 characters)"),
    (["task.limit=0"], "task.limit", "positive"),
    (["task.depths=[150]"], "task.depths", "0..100"),
    (["task.context_lengths=[9000]"], "task.context_lengths", "8192"),
    (["+method=uniform", "method.group_size=48"], "method.group_size", "must divide head_dim=64"),
    (["+method=kivi", "method.residual=100"], "method.residual", "multiple"),
    (["+method=specache", "method.topk=-1"], "method.topk", ">= 0"),
    (["+method=kivi", "bits=9"], "bits", "level count"),
    (["model.path="], "model.path", "null"),
    (["model.path=/nonexistent/model"], "model.path", "no such folder"),
    (["model.path={empty_folder}"], "model.path", "no config.json"),
    (["model.path={broken_config}"], "model.path", "does not parse"),
    (["model.path={model_no_template}", "task.chat_template=on"], "task.chat_template", "no chat template"),
    (["task.chat_template=maybe"], "task.chat_template", "auto, on, off"),
    (["model.path=null", "model.gguf=/nonexistent/model.gguf"], "model.gguf", "no such file"),
    (["model.path=null", "model.gguf={model}"], "model.gguf", "a .gguf file"),
    (["model.gguf=/nonexistent/model.gguf"], "model.gguf", "give either model.path or model.gguf"),
    (["data.root=/nonexistent/data"], "data.root", "not found"),
    (["data.root={regular_file}"], "data.root", "not found"),
    (["data.root={empty_haystack}"], "data.root", "the NIAH haystack essays not found"),
    (["data.root={latin1_haystack}"], "data.root", "UTF-8"),
    (["-m", "+method=kivi", "bits=2,9"], "bits", "sweep point bits=9"),
    (["-m", "seed=0,-1"], "seed", "sweep point seed=-1"),
    (["-m", "+method=uniform,kivi", "method.group_size=48"], "method.group_size", "write ++method.group"),
    (
        ["-m", "+method=uniform,kivi", "++method.group_size=48"],
        "method.group_size",
        "sweep point +method=uniform",
    ),
    (["method.group_size=32"], "method.group_size", "choose one first with +method=NAME"),
    # the declared field types, checked by OmegaConf against each node's dataclass
    (["+method=kivi", "method.group_size=abc"], "method.group_size", "an int"),
    (["+method=kivi", "method.zero_point=[1]"], "method.zero_point", "a string"),
    (["+method=kvquant", "method.pre_rope=maybe"], "method.pre_rope", "true or false"),
    (["task.depths=[a]"], "task.depths[0]", "a number"),
    # with model.path (the other cases' common override) the name comes from the folder instead
    (["model.path=null", "~model.name"], "model.name", "required; give a string"),
]
if not torch.cuda.is_available():
    CASES.append((["device=cuda"], "device", "auto or cpu"))


@pytest.mark.parametrize("args, key, phrase", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_one_line_before_any_work(cli, inputs, args, key, phrase):
    code, lines, out = cli(*fmt(args, inputs))
    assert code == 2
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"kvbench: error: {key}="), lines[0]
    assert phrase in lines[0]
    assert "Traceback" not in lines[0]
    assert not out.exists()  # no run folder, and no Hydra folder either
    assert not Path("/sys/kvx").exists()


def test_verbose_adds_hydras_detail_above_the_line(cli, capsys):
    code, lines, _ = cli("--verbose", "bit=2")
    assert code == 2
    assert lines[-1].startswith("kvbench: error: bit=2: unknown key; did you mean bits?")
    assert len(lines) > 1 and any("Could not override 'bit'" in line for line in lines[:-1])


def test_good_input_passes_the_checks(inputs, tmp_path, monkeypatch):
    # the same entry with legal values reaches Hydra's main, once
    reached = []
    monkeypatch.setattr(cli_module, "main", lambda: reached.append(True))
    monkeypatch.setattr(sys, "argv", ["kvbench"])  # the entry hands its arguments to Hydra there
    common = [
        f"model.path={inputs['model']}",
        f"data.root={inputs['haystack']}",
        f"output.root={tmp_path / 'o'}",
    ]
    cli_module.cli([*common, "+method=kivi", "bits=2"])
    cli_module.cli(["-m", *common, "+method=uniform,kivi", "bits=2,4", "seed=0,1"])
    assert reached == [True, True]
    assert not (tmp_path / "o").exists()


def one_line_error(config) -> str:
    with pytest.raises(ConfigError) as info:
        plan_run(config)
    return str(info.value)


def config_for(inputs, tmp_path, **changes):
    config = {
        "model": {**model_node("smollm2-135m"), "path": str(inputs["model"])},
        "task": {"name": "niah", "context_lengths": [256, 1024], "depths": [50], "max_new_tokens": 2},
        "seed": 0,
        "bits": None,
        "device": "cpu",
        "output": {"root": str(tmp_path / "out"), "resume": True},
        "data": {"root": str(inputs["haystack"])},
    }
    config.update(changes)
    return config


@pytest.mark.parametrize(
    "method, bits, code, phrase",
    [
        ({"name": "specache", "bits": 1, "topk": 100000}, 1, "topk_covers_context", "every prompt length"),
        ({"name": "specache", "bits": 1, "topk": 512}, 1, "topk_covers_context", "prompt lengths [256]"),
        ({"name": "kivi", "bits": 2, "residual": 1024}, 2, "residual_covers_context", "full precision"),
        ({"name": "h2o", "budget": 100000}, None, "budget_covers_context", "FP16 baseline"),
        ({"name": "snapkv", "budget": 1.0}, None, "budget_covers_context", "whole prompt"),
        ({"name": "uniform", "bits": 2, "sink_tokens": 2000}, 2, "sink_tokens_covers_context", "lossless"),
        (None, 2, "bits_ignored", "bits=2 is ignored: no +method was given"),
        ({"name": "h2o"}, 2, "bits_ignored", "h2o-b0.25 has no bits"),
    ],
)
def test_self_defeating_settings_are_named(inputs, tmp_path, method, bits, code, phrase):
    plan = plan_run(config_for(inputs, tmp_path, method=method, bits=bits))
    assert code in plan.warnings and phrase in plan.warnings[code]
    assert not (tmp_path / "out").exists()


def test_ordinary_settings_warn_about_nothing(inputs, tmp_path):
    for method in (None, {"name": "kivi", "bits": 2}, {"name": "specache", "bits": 1}, {"name": "h2o"}):
        assert plan_run(config_for(inputs, tmp_path, method=method)).warnings == {}


def test_unknown_top_level_key_in_a_config_dict(inputs, tmp_path):
    assert "did you mean seed?" in one_line_error(config_for(inputs, tmp_path, sead=1))


def test_summary_names_the_warnings():
    metrics = {
        "task": "niah",
        "model": "m",
        "method": "specache-1b",
        "primary_metric": "score",
        "metrics": {"n": 1, "score": 1.0},
        "memory": {"effective_bits": 18.5, "compression": 0.86},
        "timings": {"run_s": 1.0},
        "warnings": {"topk_covers_context": "...", "more_bytes_than_fp16": "..."},
    }
    assert summary_line(metrics)["notes"] == "topk_covers_context, more_bytes_than_fp16"
    assert "notes" not in summary_line({**metrics, "warnings": {}})


def test_hydra_folders_are_unique_per_process():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=cli_module.CONF_DIR, version_base="1.3"):
        cfg = compose("config", overrides=["output.root=/r"], return_hydra_config=True)
        run_dir = OmegaConf.select(cfg, "hydra.run.dir")
        sweep_dir = OmegaConf.select(cfg, "hydra.sweep.dir")
    stamp, pid = run_dir.rsplit("-", 1)
    assert pid == str(os.getpid())
    assert len(stamp.rpartition(".")[2]) == 6  # microseconds
    # a sweep's folder is dated as Hydra dates it, multirun/<date>/<time>, and unique by the pid
    root, multirun, day, time_pid = sweep_dir.rsplit("/", 3)
    assert (root, multirun) == ("/r", "multirun") and len(day) == 10 and day.count("-") == 2
    assert time_pid.rsplit("-", 1)[1] == str(os.getpid())


# --- results files ---------------------------------------------------------------------------------


def row(sample_id: str, score: float = 1.0) -> str:
    return json.dumps({"sample_id": sample_id, "score": score}) + "\n"


def test_malformed_lines_are_set_aside_and_valid_rows_kept(tmp_path, capsys):
    folder = RunFolder(tmp_path)
    # the last line is cut short, as a kill in the middle of a write leaves it
    lines = [
        row("a"),
        "garbage\n",
        row("b"),
        "{}\n",
        '{"score": 1.0}\n',
        "[1, 2]\n",
        row("c"),
        '{"sample_id": "d", "sc',
    ]
    folder.samples_path.write_text("".join(lines))
    before = folder.samples_path.read_bytes()
    assert [r["sample_id"] for r in folder.rows()] == ["a", "b", "c"]
    assert folder.samples_path.read_bytes() == before  # a plain read changes nothing

    assert [r["sample_id"] for r in folder.resume_rows()] == ["a", "b", "c"]
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "5 malformed line(s) moved to samples.rejected.jsonl" in warning[0]
    rejected = [json.loads(line) for line in folder.rejected_path.read_text().splitlines()]
    assert [r["line"] for r in rejected] == [2, 4, 5, 6, 8]
    assert rejected[0]["text"] == "garbage" and "no sample_id" in rejected[1]["reason"]
    assert "cut short" in rejected[-1]["reason"]
    assert folder.samples_path.read_text() == row("a") + row("b") + row("c")
    folder.append({"sample_id": "d", "score": 0.5})
    assert [r["sample_id"] for r in folder.resume_rows()] == ["a", "b", "c", "d"]
    assert capsys.readouterr().err == ""  # a clean file warns about nothing


def test_non_utf8_line_is_set_aside(tmp_path):
    folder = RunFolder(tmp_path)
    folder.samples_path.write_bytes(row("a").encode() + b'{"sample_id": "\xff"}\n' + row("b").encode())
    assert [r["sample_id"] for r in folder.resume_rows()] == ["a", "b"]
    assert json.loads(folder.rejected_path.read_text())["line"] == 2


def test_orphan_temp_files_are_removed_by_the_next_holder_of_the_lock(tmp_path):
    folder = RunFolder(tmp_path)
    (tmp_path / ".metrics.json.abc123.tmp").write_text("")
    (tmp_path / ".config.json.def456.tmp").write_text('{"run')
    (tmp_path / "metrics.json.keep").write_text("not ours to remove")
    with folder.lock():
        assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "metrics.json.keep"]


# --- killed runs ------------------------------------------------------------------------------------

# Runs one configuration in a fresh interpreter and SIGKILLs it at a chosen point.
KILLER = r"""
import json, os, signal, sys
from kvbench import results, run
from kvbench.tasks.niah import NIAH

config, point = json.loads(sys.argv[1]), sys.argv[2]


def die():
    os.kill(os.getpid(), signal.SIGKILL)


if point == "inside-first-sample":
    NIAH.run = lambda self, sample, runner: die()
elif point == "appending-third-row":
    append, appended = results.RunFolder.append, []

    def cut_append(self, row):
        if len(appended) == 2:
            line = json.dumps(row)
            with open(self.samples_path, "a") as f:
                f.write(line[: len(line) // 2])
            die()
        appended.append(row)
        append(self, row)

    results.RunFolder.append = cut_append
elif point == "inside-metrics-write":
    fdopen = os.fdopen

    def cut_fdopen(fd, *args, **kwargs):
        handle = fdopen(fd, *args, **kwargs)
        handle.write(b'{"run_id": ')  # atomic writes are binary
        handle.flush()
        die()

    write_metrics = results.RunFolder.write_metrics

    def dying_write_metrics(self, metrics):
        os.fdopen = cut_fdopen
        write_metrics(self, metrics)

    results.RunFolder.write_metrics = dying_write_metrics
run.execute(config, progress=False)
"""


def kill_at(config: dict, point: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, json.dumps(config), point],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


def test_run_killed_anywhere_resumes_to_the_uninterrupted_result(tmp_path, data_root, capsys):
    def config(root):
        return {
            "model": model_node("smollm2-135m"),
            # one sample at a time, so that a kill can land between two rows
            "task": {
                "name": "niah",
                "context_lengths": [256, 320],
                "depths": [0, 100],
                "max_new_tokens": 2,
                "batch_size": 1,
            },
            "method": {"name": "kivi", "bits": 2, "group_size": 32, "residual": 64},
            "seed": 0,
            "device": "cpu",
            "output": {"root": str(root), "resume": True},
            "data": {"root": str(data_root)},
        }

    killed = config(tmp_path / "killed")
    folder = plan_run(killed).folder
    kill_at(killed, "inside-first-sample")
    assert RunFolder(folder).rows() == [] and not (folder / "metrics.json").exists()

    kill_at(killed, "appending-third-row")
    assert len(RunFolder(folder).rows()) == 2
    assert not (folder / "samples.jsonl").read_text().endswith("\n")  # the third row, cut short

    kill_at(killed, "inside-metrics-write")
    assert len(RunFolder(folder).rows()) == 4
    assert not (folder / "metrics.json").exists()
    assert [p.name.startswith(".metrics.json.") for p in folder.glob(".*.tmp")] == [True]
    # damage by hand between the two valid rows in the middle: set aside, and nothing rerun for it
    text = (folder / "samples.jsonl").read_text().splitlines(keepends=True)
    (folder / "samples.jsonl").write_text("".join([*text[:2], "{}\n", "garbage\n", *text[2:]]))

    capsys.readouterr()
    resumed = execute(killed, progress=False)
    assert "2 malformed line(s)" in capsys.readouterr().err
    assert resumed["timings"]["samples_run"] == 0
    assert not list(folder.glob(".*.tmp"))
    rejected = [json.loads(line) for line in (folder / "samples.rejected.jsonl").read_text().splitlines()]
    assert len(rejected) == 3  # the cut-short third row, then {} and garbage

    clean = execute(config(tmp_path / "clean"), progress=False)
    assert resumed["metrics"] == clean["metrics"]

    def by_id(run_folder):
        return {r["sample_id"]: (r["prediction"], r["score"]) for r in RunFolder(run_folder).rows()}

    assert by_id(folder) == by_id(clean["folder"])


def test_self_defeating_run_is_flagged_in_metrics(tmp_path, data_root, capsys):
    config = {
        "model": model_node("smollm2-135m"),
        "task": {"name": "niah", "context_lengths": [256], "depths": [50], "max_new_tokens": 2},
        "method": {"name": "specache", "bits": 1, "topk": 100000},
        "seed": 0,
        "device": "cpu",
        "output": {"root": str(tmp_path), "resume": True},
        "data": {"root": str(data_root)},
    }
    metrics = execute(config, progress=False)
    err = capsys.readouterr().err
    assert "kvbench: warning: method.topk=100000 covers the whole prompt" in err
    assert metrics["memory"]["compression"] < 1.0
    written = json.loads((Path(metrics["folder"]) / "metrics.json").read_text())
    assert set(written["warnings"]) == {"topk_covers_context", "more_bytes_than_fp16"}

    (Path(metrics["folder"]) / "metrics.json").write_text("[1, ")  # damaged by hand
    again = execute(config, progress=False)
    assert "does not parse" in capsys.readouterr().err
    assert again["timings"]["samples_run"] == 0 and again["metrics"] == metrics["metrics"]
    assert json.loads((Path(metrics["folder"]) / "metrics.json").read_text())["run_id"] == metrics["run_id"]


def test_command_line_error_in_a_fresh_interpreter(tmp_path, inputs):
    """The real entry point, once: exit status 2, one line, no traceback, nothing written."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvbench",
            "-m",
            "+method=uniform",
            "bits=2,4",
            "method.group_size=48",
            f"model.path={inputs['model']}",
            f"data.root={inputs['haystack']}",
            f"output.root={tmp_path / 'out'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("kvbench: error: method.group_size=48: must divide head_dim=64")
    assert len(proc.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # not even Hydra's folder, nor a stray one in the cwd


def test_reproduce_dry_run_refuses_an_invalid_override(capsys):
    from kvbench.reproduce import main as reproduce_main

    assert reproduce_main(["--override", "bits=0", "--dry-run", "--only", "kivi_axis_ablation"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("kvbench.reproduce: error: --override: bits=0: a positive number"), last


def test_report_claims_refuses_an_unknown_model(tmp_path, capsys):
    from kvbench.report import main as report_main

    assert report_main(["--claims", "--model", "nope", "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvbench.report: error: --model=nope: no runs"), err
    assert "smollm2-135m" in err[0] and not list(tmp_path.rglob("nope*"))
