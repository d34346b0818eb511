"""User errors on the command line: one line naming the key, exit status 2, no traceback."""

import os
import subprocess
import sys

import pytest


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
        (["+method=kivi", "method.name=nope"], "registered methods are fp16, kivi, uniform"),
    ],
)
def test_user_errors_are_one_clear_line(args, expected, tmp_path):
    proc = run_cli(*args, f"output.root={tmp_path}")
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("kvbench: error:")]
    assert len(errors) == 1


@pytest.mark.parametrize("args, expected", [(["+method=nope"], "kivi"), (["model=nope"], "smollm2-135m")])
def test_unknown_config_names_list_the_options(args, expected, tmp_path):
    proc = run_cli(*args, f"output.root={tmp_path}")
    assert proc.returncode != 0
    assert "Could not find" in proc.stderr and expected in proc.stderr
    assert "Traceback" not in proc.stderr
