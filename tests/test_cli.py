"""User errors on the command line: one line naming the key, exit status 2, no traceback."""

import json
import os
import subprocess
import sys

import pytest

from kvbench.analysis import load_results
from kvbench.methods import METHODS

CONF = os.path.join(os.path.dirname(__file__), "..", "kvbench", "conf")


def nodes(group):
    return ", ".join(sorted(f[:-5] for f in os.listdir(os.path.join(CONF, group)) if f.endswith(".yaml")))


def run_cli(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "kvbench", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize(
    "args, expected",
    [
        (["+method=kivi", "bits=9"], "kvbench: error: bits=9.0: "),
        (["+method=kivi", "bits=2", "method.residual=100"], "kvbench: error: method.residual=100: "),
        (["+method=uniform", "method.group_size=48"], "kvbench: error: method.group_size=48: must divide"),
        (["data.root=/nonexistent/kv"], "kvbench: error: data.root="),
        (["+method=kivi", "method.name=nope"], f"registered methods are {', '.join(METHODS.names())}\n"),
    ],
)
def test_user_errors_are_one_clear_line(args, expected, tmp_path):
    proc = run_cli(*args, f"output.root={tmp_path}")
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kvbench: error:")]
    assert len(errors) == 1


@pytest.mark.parametrize(
    "args, expected",
    [
        (["+method=nope"], f"kvbench: error: method='nope': known method nodes: {nodes('method')}"),
        (["-m", "+method=kivi,nope"], "kvbench: error: method='nope': known method nodes:"),
        (["model=nope"], "kvbench: error: model='nope': known model nodes: llama2-7b,"),
        (
            ["task=nope"],
            f"kvbench: error: task='nope': known task nodes: {nodes('task')}",
        ),
    ],
)
def test_unknown_config_names_list_the_options(args, expected, tmp_path):
    proc = run_cli(*args, f"output.root={tmp_path}")
    assert proc.returncode == 2
    assert proc.stderr.strip() == expected or proc.stderr.startswith(expected)
    assert len(proc.stderr.strip().splitlines()) == 1


def test_multirun_sweep_writes_one_folder_per_point(tmp_path):
    proc = run_cli(
        "-m",
        "+method=uniform,kivi",
        "bits=2,4",
        "task.context_lengths=[300]",
        "task.depths=[50]",
        "task.max_new_tokens=2",
        f"output.root={tmp_path}",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    folders = sorted(p.parent.parent.name for p in tmp_path.glob("niah/smollm2-135m/*/*/metrics.json"))
    assert folders == ["kivi-2b", "kivi-4b", "uniform-2b", "uniform-4b"]
    assert proc.stdout.count("eff_bits") == 5  # each job prints its summary table, then the sweep's
    # The sweep's own dated folder, one subfolder per point naming its run folder, and the table of
    # all four points at the end.
    (sweep,) = tmp_path.glob("multirun/*/*")
    index = json.loads((sweep / "sweep.json").read_text())
    linked = sorted((sweep / r["folder"]).resolve().parent.name for r in index["runs"])
    assert linked == folders and all(r["finished"] for r in index["runs"])
    table = proc.stdout.rpartition(f"sweep of 4 points: {sweep}")[2]
    assert sorted(line.split()[0] for line in table.splitlines()[2:6]) == ["0", "1", "2", "3"]
    # Another sweep into the same root; the report of the first folder reads its four points only.
    again = run_cli(
        "-m",
        "+method=fp16",
        "task.context_lengths=[300]",
        "task.depths=[50]",
        "task.max_new_tokens=2",
        f"output.root={tmp_path}",
    )
    assert again.returncode == 0, again.stderr[-2000:]
    report = subprocess.run(
        [sys.executable, "-m", "kvbench.report", str(sweep), "--out", str(tmp_path / "report")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert report.returncode == 0, report.stderr[-2000:]
    frame = load_results(sweep)
    assert sorted(frame["method"].unique()) == folders
    assert "fp16" in set(load_results(tmp_path)["method"])


def test_kvbench_local_sweep_reports_every_point_on_the_terminal(tmp_path, haystack_only_root):
    # A failure only the run meets (KVQuant's calibration text is read after the model loads; a bad
    # config value would be refused before any point starts): the data root holds the haystack only.
    proc = run_cli(
        "-m",
        "hydra/launcher=kvbench_local",
        "+method=uniform,kvquant",
        "bits=2",
        f"data.root={haystack_only_root}",
        "task.context_lengths=[300]",
        "task.depths=[50]",
        "task.max_new_tokens=2",
        f"output.root={tmp_path}/out",
    )
    # The bad point is one line naming its log; the good one still runs; exit 2 (a user error).
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "UncompletedJobError" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("kvbench:")]
    assert line.startswith("kvbench: error: point #1 (+method=kvquant): data.root="), line
    log = line.rpartition("[log: ")[2].rstrip("]")
    assert "kvquant calibration needs one of wikitext2/" in open(log).read()
    folders = sorted(p.parent.parent.name for p in tmp_path.glob("out/niah/smollm2-135m/*/*/metrics.json"))
    assert folders == ["uniform-2b"]
    # The summary table of both points, on the sweep's own stdout.
    table = {row.split()[0]: row for row in proc.stdout.splitlines() if row[:1].isdigit()}
    assert sorted(table) == ["0", "1"]
    assert "uniform-2b" in table["0"] and table["0"].split()[-2:] == ["COMPLETED", "-"]
    assert table["1"].split()[-2:] == ["FAILED", log]


def test_slurm_launcher_node_composes(tmp_path):
    proc = run_cli(
        "hydra/launcher=slurm", "hydra.launcher.partition=gpu", f"output.root={tmp_path}", "--cfg", "hydra"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "SlurmLauncher" in proc.stdout and "partition: gpu" in proc.stdout
    assert "array_parallelism: 32" in proc.stdout


def run_entry(*args, env=None, cwd=None):
    """The ``kvbench`` console script as installed (``kvbench.__main__:entry`` with argv[0] the
    script's path), without installing it."""
    code = "import sys; sys.argv[0] = '/usr/local/bin/kvbench'; from kvbench.__main__ import entry; entry()"
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env={**os.environ, **(env or {})},
    )


def test_console_script_is_declared():
    import tomllib

    with open(os.path.join(os.path.dirname(__file__), "..", "pyproject.toml"), "rb") as handle:
        scripts = tomllib.load(handle)["project"]["scripts"]
    assert scripts["kvbench"] == "kvbench.__main__:entry"


def test_help_names_kvbench_and_hides_internal_groups():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("kvbench: ") and "powered by Hydra" not in proc.stdout
    groups = {line.partition(":")[0] for line in proc.stdout.split("== Config ==")[0].splitlines()}
    assert {"method", "model", "task", "experiment", "logger"} <= groups
    assert not [g for g in groups if g.startswith("experiment/arms")]
    assert f"method: {nodes('method')}" in proc.stdout
    # the config as a run takes it: kvbench's interpolations resolved, none left as ${...} text
    config = proc.stdout.split("== Config ==")[1]
    assert "${" not in config and "  name: smollm2-135m" in config and "max_context: 8192" in config


def test_info_lists_each_launcher_once():
    proc = run_cli("--info", "plugins")
    assert proc.returncode == 0, proc.stderr[-2000:]
    launchers = proc.stdout.split("Launcher:")[1].split("Sweeper:")[0].split()[1:]
    assert "KvbenchSlurmLauncher" in launchers and "KvbenchLocalLauncher" in launchers
    assert len(launchers) == len(set(launchers)), launchers


def test_tab_completion_works_for_the_console_script():
    install = run_entry("-sc", "install=bash")
    assert install.returncode == 0, install.stderr[-2000:]
    assert install.stdout.rstrip().endswith("-F hydra_bash_completion kvbench")
    # what the installed completion asks the command while the user types `kvbench +method=ki<TAB>`
    query = run_entry("-sc", "query=bash", env={"COMP_LINE": "kvbench +method=ki", "COMP_POINT": "18"})
    assert query.returncode == 0, query.stderr[-2000:]
    assert query.stdout.split() == ["+method=kivi"]
    query = run_entry("-sc", "query=bash", env={"COMP_LINE": "kvbench mod", "COMP_POINT": "11"})
    assert "model=" in query.stdout.split()
