"""Run folders: results written atomically, resume skips finished samples, run ids are stable."""

import json
from pathlib import Path

import pytest

from kvbench import run as run_module
from kvbench.errors import Interrupted
from kvbench.methods import METHODS
from kvbench.models import model_node
from kvbench.paths import CONF_DIR
from kvbench.results import RunFolder, run_id
from kvbench.tasks.niah import NIAH


def tiny_config(root, data_root, method=None):
    cfg = {
        "model": model_node("smollm2-135m"),
        # one sample at a time: these tests interrupt and count samples one by one
        # (test_batched_run_matches_one_at_a_time covers batches)
        "task": {
            "name": "niah",
            "context_lengths": [256, 320],
            "depths": [0, 100],
            "max_new_tokens": 3,
            "batch_size": 1,
        },
        "seed": 0,
        "bits": 2,
        "device": "cpu",
        "output": {"root": str(root), "resume": True},
        "data": {"root": str(data_root)},
    }
    if method:
        cfg["method"] = method
    return cfg


def test_batched_run_matches_one_at_a_time(tmp_path, data_root, monkeypatch):
    """``task.batch_size=3`` runs the 4 samples as a batch of 3 and one of 1 (each prompt prefilled
    alone, the decode steps batched): the same generations, scores and storage as one at a time,
    each row recording its batch. An interrupt inside the second batch keeps the first batch's
    rows, and the same command finishes the run."""
    kivi = {"name": "kivi", "bits": 2, "group_size": 32, "residual": 64}
    single = run_module.execute(tiny_config(tmp_path / "one", data_root, kivi), progress=False)
    cfg = tiny_config(tmp_path / "batch", data_root, kivi)
    cfg["task"]["batch_size"] = 3
    original, calls = NIAH.run_batch, []

    def dying(self, samples, runner):
        calls.append(len(samples))
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(self, samples, runner)

    monkeypatch.setattr(NIAH, "run_batch", dying)
    with pytest.raises(Interrupted, match="interrupted after 3 of 4 samples"):
        run_module.execute(cfg, progress=False)
    monkeypatch.setattr(NIAH, "run_batch", original)
    batched = run_module.execute(cfg, progress=False)
    assert calls == [3, 1] and batched["run_id"] != single["run_id"]
    rows = {r["sample_id"]: r for r in RunFolder(Path(batched["folder"])).rows()}
    alone = {r["sample_id"]: r for r in RunFolder(Path(single["folder"])).rows()}
    assert sorted(rows) == sorted(alone)
    assert sorted(r["batch_size"] for r in rows.values()) == [1, 3, 3, 3]
    for sid, row in rows.items():
        for key in ("prediction", "score", "generated_tokens", "stopped", "memory", "prompt_tokens"):
            assert row[key] == alone[sid][key], (sid, key)


def test_killed_run_resumes_without_redoing_finished_samples(tmp_path, data_root, monkeypatch):
    cfg = tiny_config(tmp_path, data_root, {"name": "kivi", "bits": 2, "group_size": 32, "residual": 64})
    calls = []
    original = NIAH.run

    def dying_run(self, sample, runner):
        calls.append(sample["id"])
        if len(calls) == 3:
            raise KeyboardInterrupt  # the job is killed while on its third sample
        return original(self, sample, runner)

    monkeypatch.setattr(NIAH, "run", dying_run)
    with pytest.raises(Interrupted, match="interrupted after 2 of 4 samples; the same command resumes"):
        run_module.execute(cfg, progress=False)
    folders = list(tmp_path.glob("niah/smollm2-135m/kivi-2b/seed0-*"))
    assert len(folders) == 1
    assert len(RunFolder(folders[0]).rows()) == 2
    assert not (folders[0] / "metrics.json").exists()

    calls.clear()
    monkeypatch.setattr(NIAH, "run", original)
    monkeypatch.setattr(NIAH, "run", lambda self, s, r: (calls.append(s["id"]), original(self, s, r))[1])
    metrics = run_module.execute(cfg, progress=False)
    assert len(calls) == 2  # only the two unfinished samples ran
    rows = RunFolder(folders[0]).rows()
    assert sorted(r["sample_id"] for r in rows) == sorted(["L256_d0", "L256_d100", "L320_d0", "L320_d100"])
    assert metrics["metrics"]["n"] == 4
    assert metrics["timings"]["samples_resumed"] == 2
    written = json.loads((folders[0] / "metrics.json").read_text())
    assert written["run_id"] == metrics["run_id"]
    assert 2.0 < written["memory"]["effective_bits"] < 16.0

    # a resubmitted sweep: the point is complete, so not even the model is loaded
    import kvbench.builder

    monkeypatch.setattr(
        kvbench.builder, "load_model", lambda *a, **k: pytest.fail("model loaded for a finished run")
    )
    again = run_module.execute(cfg, progress=False)
    assert again["run_id"] == metrics["run_id"] and again["metrics"] == written["metrics"]
    assert len(RunFolder(folders[0]).rows()) == 4


def test_truncated_last_line_is_dropped(tmp_path):
    folder = RunFolder(tmp_path)
    folder.append({"sample_id": "a", "score": 1.0})
    with open(folder.samples_path, "a") as f:
        f.write('{"sample_id": "b", "sco')  # killed mid-write
    assert [r["sample_id"] for r in folder.resume_rows()] == ["a"]
    folder.append({"sample_id": "b", "score": 0.5})
    assert [r["sample_id"] for r in folder.rows()] == ["a", "b"]


def test_run_id_ignores_paths_but_not_knobs():
    base = {
        "model": {"name": "m"},
        "task": {"name": "niah"},
        "bits": 2,
        "method": {"name": "kivi", "bits": 2},
        "output": {"root": "a"},
    }
    assert run_id(base) == run_id({**base, "output": {"root": "b"}, "data": {"root": "/x"}})
    assert run_id(base) != run_id({**base, "bits": 3, "method": {"name": "kivi", "bits": 3}})
    assert run_id(base) != run_id({**base, "task": {"name": "niah", "version": 2}})


def test_keys_added_later_keep_old_run_ids_at_their_default_only():
    old = {"model": {"name": "m"}, "task": {"name": "perplexity", "version": 2}, "method": {"name": "fp16"}}
    new = {
        "model": {"name": "m", "gguf": None},
        "task": {"name": "perplexity", "version": 2, "path": None, "offset": 0, "add_bos": False},
        "method": {"name": "fp16"},
    }
    assert run_id(old) == run_id(new)
    for key, value in (("offset", "chars:10"), ("add_bos", True), ("path", "book.txt"), ("offset", False)):
        changed = {**new, "task": {**new["task"], key: value}}
        assert run_id(changed) != run_id(old), key
    niah = {
        "model": {"name": "m"},
        "task": {"name": "niah", "chat_template": "auto"},
        "method": {"name": "fp16"},
    }
    assert run_id(niah) == run_id({**niah, "task": {"name": "niah"}})
    assert run_id(niah) != run_id({**niah, "task": {"name": "niah", "chat_template": "off"}})


def test_run_id_ignores_the_analysis_plan():
    base = {
        "model": {"name": "m"},
        "task": {"name": "niah"},
        "bits": 2,
        "method": {"name": "uniform", "bits": 2},
    }
    plan = {"name": "semkv_cliff", "alpha": 0.05, "margin": 0.05, "n": 3, "seeds": [0, 1, 2]}
    assert run_id(base) == run_id({**base, "analysis": plan})
    assert run_id(base) == run_id({**base, "analysis": {**plan, "alpha": 0.1}})


def test_fp16_gets_one_run_id_whatever_the_top_level_bits():
    fp16 = {"name": "fp16", "fp_dtype": "float16", "sink_tokens": 0}
    base = {"model": {"name": "m"}, "task": {"name": "niah"}, "method": fp16}
    ids = {run_id({**base, "bits": b}) for b in (1, 1.585, 2, 4, None)}
    assert len(ids) == 1
    # no method at all is the FP16 baseline as well
    bare = {"model": {"name": "m"}, "task": {"name": "niah"}}
    assert run_id({**bare, "bits": 1}) == run_id({**bare, "bits": 4})
    # a method that reads bits keeps them in the id
    uniform = {**base, "method": {"name": "uniform", "bits": 2.0}}
    assert run_id({**uniform, "bits": 2}) != run_id(
        {**uniform, "bits": 3, "method": {"name": "uniform", "bits": 3.0}}
    )


def test_run_folder_lock_admits_one_writer_at_a_time(tmp_path, capsys):
    import threading

    folder = RunFolder(tmp_path)
    entered = threading.Event()

    def second_writer():
        with RunFolder(tmp_path).lock():
            entered.set()

    with folder.lock():
        thread = threading.Thread(target=second_writer)
        thread.start()
        assert not entered.wait(0.5)  # blocked while the first holds the folder
    thread.join(timeout=10)
    assert entered.is_set()  # and admitted once it is released
    assert "in use by another process" in capsys.readouterr().err


def test_a_folder_without_results_is_discarded_with_its_empty_parents(tmp_path):
    root = tmp_path / "runs"
    unused = RunFolder(root / "niah" / "m" / "kvquant" / "seed0-a")
    unused.write_config({"seed": 0})
    (unused.path / ".lock").touch()
    kept = RunFolder(root / "niah" / "m" / "kivi" / "seed0-b")
    kept.write_config({"seed": 0})
    kept.append({"sample_id": "s0", "score": 1.0})
    assert unused.discard_if_unused(root)
    assert not (root / "niah" / "m" / "kvquant").exists()  # its empty parent went too
    assert not kept.discard_if_unused(root)  # a sample row is a result: nothing is removed
    assert [r["sample_id"] for r in kept.rows()] == ["s0"] and root.is_dir()


# --- the top-level bits reaches the method through the run ----------------------------------------


def composed(*overrides: str) -> dict:
    """The CLI's config for ``overrides``, composed from conf/ as ``python -m kvbench`` does."""

    from hydra import compose, initialize_config_dir

    from kvbench.config import to_plain

    conf = str(CONF_DIR)
    with initialize_config_dir(config_dir=conf, version_base="1.3"):
        return to_plain(compose("config", overrides=list(overrides)))


@pytest.mark.parametrize("name", [n for n in METHODS.names() if METHODS.get(n).Config.bits_knob == "bits"])
def test_method_nodes_carry_no_bits_line_and_still_read_bits(name, tmp_path, data_root):
    # 2.322 bits (5 levels) is inside every method's range and no method's default
    cfg = composed(f"+method={name}", "bits=2.322", f"output.root={tmp_path}", f"data.root={data_root}")
    assert "bits" not in cfg["method"]  # the node does not have to remember a line
    plan = run_module.plan_run(cfg)
    assert plan.method.config.bits == 2.322
    assert plan.config["method"]["bits"] == 2.322  # what config.json holds and the run id hashes
    assert "bits_ignored" not in plan.warnings
    assert plan.run_id == run_id({**cfg, "method": {**cfg["method"], "bits": 2.322}})
    default = run_module.plan_run({**cfg, "bits": None})
    assert default.method.config.bits == METHODS.get(name).Config.default_bits != 2.322
    assert default.run_id != plan.run_id


def test_readkv_reads_the_run_bits_as_its_read_budget(tmp_path, data_root):
    cfg = composed("+method=readkv", "bits=3", f"output.root={tmp_path}", f"data.root={data_root}")
    plan = run_module.plan_run(cfg)
    assert (plan.method.config.bits, plan.method.config.read_bits) == (8.0, 3.0)
    assert plan.method.label() == "readkv-3of8b"
    # without a bit width, its own default read budget
    default = run_module.plan_run({**cfg, "bits": None})
    assert default.method.config.read_bits == 4.0


def test_a_value_the_node_sets_wins_and_the_ignored_bits_are_named(tmp_path, data_root):
    cfg = tiny_config(tmp_path, data_root, {"name": "kivi", "bits": 4})
    plan = run_module.plan_run({**cfg, "bits": 3})
    assert plan.method.config.bits == 4.0
    assert "method node sets method.bits=4" in plan.warnings["bits_ignored"]
    # the same value twice is no conflict
    assert "bits_ignored" not in run_module.plan_run({**cfg, "bits": 4}).warnings


@pytest.mark.parametrize(
    "method, phrase",
    [
        (None, "no +method was given, so this is the FP16 baseline"),
        ({"name": "fp16"}, "fp16 has no bits"),
        ({"name": "h2o"}, "h2o-b0.25 has no bits"),
    ],
)
def test_methods_without_a_bits_knob_ignore_bits_as_before(method, phrase, tmp_path, data_root):
    cfg = tiny_config(tmp_path, data_root, method)
    plan = run_module.plan_run({**cfg, "bits": 3})
    assert plan.warnings["bits_ignored"] == f"bits=3 is ignored: {phrase}"
    assert plan.method.config.bits is None
    assert plan.config.get("method") == method  # nothing written into the node
    # one run whatever the bits
    assert plan.run_id == run_module.plan_run({**cfg, "bits": 1}).run_id
