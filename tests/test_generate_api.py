"""A kvbench cache in transformers' own loop (issue 44 items 1-2): ``model.generate()`` over a
method's cache (greedy, sampling, streamer, pipeline, beam search or its one-line refusal), the
Python API (:mod:`kvbench.api`) and the README's example, on the default model."""

import re
import warnings
from pathlib import Path

import pytest
import torch
from transformers import TextStreamer, pipeline

import kvbench
from kvbench.api import unprepare
from kvbench.builder import LoadedModel
from kvbench.cache.reorder import BeamSearchError
from kvbench.errors import ConfigError
from kvbench.generate import ModelRunner
from kvbench.methods import ModelShape, build_method

README = Path(__file__).resolve().parent.parent / "README.md"
NEW = 8
# ~185 tokens: past KIVI's 128-token residual, so its cache holds packed codes after the prefill
TEXT = " ".join(["The quick brown fox jumps over the lazy dog."] * 18) + " Tell me a story:"


@pytest.fixture(scope="module")
def prepared(default_model):
    """The session's default model, prepared for the module and put back as it was after it."""
    model, tokenizer, shape = default_model
    kvbench.prepare(model)
    yield model, tokenizer, shape
    unprepare(model)


@pytest.fixture(scope="module")
def ids(prepared):
    return prepared[1](TEXT, return_tensors="pt", add_special_tokens=False).input_ids


def new_tokens(out: torch.Tensor, ids: torch.Tensor) -> list[int]:
    return out[0, ids.shape[1] :].tolist()


def test_greedy_generate_equals_model_runner_and_holds_packed_codes(prepared, ids):
    model, tokenizer, shape = prepared
    want = ModelRunner(model, tokenizer, build_method({"name": "kivi"}, bits=2), shape).generate(ids, NEW)
    cache = kvbench.new_cache(model, "kivi", bits=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5.24 renames it cache=
        out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW, do_sample=False)
    assert new_tokens(out, ids) == want.token_ids
    report = cache.memory_report()
    assert report.quantized_values > 0 and report.bytes_by_component["codes"] > 0
    assert report.effective_bits < 16
    # the same tokens stored the same way: the runner's request's report, byte for byte
    assert report == want.memory


def test_sampling_top_k_over_a_kivi_cache(prepared, ids):
    model = prepared[0]
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        cache = kvbench.new_cache(model, "kivi", bits=2)
        out = model.generate(ids, cache=cache, max_new_tokens=NEW, do_sample=True, top_k=5)
        runs.append(new_tokens(out, ids))
        assert cache.get_seq_length() == ids.shape[1] + len(runs[-1]) - 1
        assert cache.memory_report().effective_bits < 16
    assert runs[0] == runs[1] and len(runs[0]) == NEW
    # top_k=1 sampling is greedy: the same tokens as do_sample=False
    greedy = model.generate(ids, cache=kvbench.new_cache(model, "kivi", bits=2), max_new_tokens=NEW)
    one = model.generate(
        ids, cache=kvbench.new_cache(model, "kivi", bits=2), max_new_tokens=NEW, do_sample=True, top_k=1
    )
    assert torch.equal(greedy, one)


def test_text_streamer_and_pipeline(prepared, ids):
    model, tokenizer, _ = prepared

    class Collect(TextStreamer):
        text = ""

        def on_finalized_text(self, text, stream_end=False):
            self.text += text

    streamer = Collect(tokenizer, skip_prompt=True)
    out = model.generate(
        ids, cache=kvbench.new_cache(model, "kivi", bits=2), max_new_tokens=NEW, streamer=streamer
    )
    text = tokenizer.decode(new_tokens(out, ids), skip_special_tokens=True)
    assert streamer.text == text and text
    pipe = pipeline("text-generation", model=model, tokenizer=tokenizer)
    cache = kvbench.new_cache(model, "kivi", bits=2)
    got = pipe(TEXT, cache=cache, max_new_tokens=NEW, do_sample=False, return_full_text=False)
    assert got[0]["generated_text"] == text
    assert cache.memory_report().effective_bits < 16


@pytest.mark.parametrize("metric", ["entropy", "hidden_norm"])
def test_a_method_reading_the_forward_gets_it_through_generate(prepared, ids, metric):
    """SemKV allocates bits from each forward's logits (entropy) or hidden states (hidden_norm), in
    Method.after_forward, which the prepared model's hook runs: generate() stores what the runner
    stores."""
    model, tokenizer, shape = prepared
    method = build_method({"name": "semkv", "metric": metric})
    runner = LoadedModel(None, model, tokenizer, shape, 0.0).runner(method)
    try:
        want = runner.generate(ids, NEW)
    finally:
        method.release()
    cache = kvbench.new_cache(model, "semkv", metric=metric)
    assert new_tokens(model.generate(ids, cache=cache, max_new_tokens=NEW), ids) == want.token_ids
    assert cache.memory_report() == want.memory


def test_beam_search_reorders_a_kivi_cache_and_refuses_an_eviction_one(prepared, ids):
    model = prepared[0]
    plain = model.generate(ids, max_new_tokens=4, num_beams=2)  # transformers' own DynamicCache
    fp16 = kvbench.new_cache(model, "fp16", fp_dtype="auto")
    assert torch.equal(model.generate(ids, cache=fp16, max_new_tokens=4, num_beams=2), plain)
    kivi = kvbench.new_cache(model, "kivi", bits=2)
    model.generate(ids, cache=kivi, max_new_tokens=4, num_beams=2)
    assert kivi.memory_report().effective_bits < 16
    with pytest.raises(BeamSearchError, match=r"^num_beams>1: .*H2OLayer.*cannot reorder"):
        model.generate(ids, cache=kvbench.new_cache(model, "h2o"), max_new_tokens=4, num_beams=2)


def test_reorder_takes_the_rows_beam_search_names():
    shape = ModelShape(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=32)
    cache = build_method({"name": "kivi", "residual": 32}, bits=2).new_cache(shape, torch.float32)
    gen = torch.Generator().manual_seed(0)
    for t in (70, 1, 1):  # codes, residual, a flush
        cache.update(torch.randn(3, 2, t, 32, generator=gen), torch.randn(3, 2, t, 32, generator=gen), 0)
        cache.layers[0]._pending = None  # no attention follows in this test
    keys, values = cache.layers[0].read()
    before = cache.memory_report()
    rows = torch.tensor([2, 0, 0])
    cache.reorder_cache(rows)
    got_k, got_v = cache.layers[0].read()
    assert torch.equal(got_k, keys[rows]) and torch.equal(got_v, values[rows])
    assert cache.memory_report() == before


def test_arguments_are_checked_as_the_command_line_checks_them(prepared):
    model = prepared[0]
    with pytest.raises(ConfigError, match=r"^method\.name='kivii': registered methods are .*kivi"):
        kvbench.new_cache(model, "kivii")
    with pytest.raises(ConfigError, match=r"^method\.foo=1: unknown key; allowed: .*residual"):
        kvbench.new_cache(model, "kivi", foo=1)
    with pytest.raises(ConfigError, match=r"^method\.residual=33: must be a positive multiple"):
        kvbench.new_cache(model, "kivi", residual=33)
    with pytest.raises(ConfigError, match=r"^bits=0\.0: allowed values are log2"):
        kvbench.new_cache(model, "kivi", bits=0)
    with pytest.raises(ConfigError, match=r"^method='specache': .*own decode step"):
        kvbench.new_cache(model, "specache", bits=2)
    with pytest.warns(UserWarning, match="bits=2 is ignored: fp16 has no bits"):
        kvbench.new_cache(model, "fp16", bits=2)


def test_an_unprepared_model_names_prepare():
    from tiny_archs import tiny_model

    model, shape = tiny_model("llama")
    cache = build_method({"name": "fp16"}).new_cache(shape, torch.float32)
    with pytest.raises(RuntimeError, match=r"kvbench\.prepare\(model\)"):
        model(input_ids=torch.tensor([[1, 2, 3]]), cache=cache, use_cache=True)
    kvbench.prepare(model)
    model(input_ids=torch.tensor([[1, 2, 3]]), cache=cache, use_cache=True)
    assert cache.get_seq_length() == 3


def test_the_readme_example_runs(capsys):
    text = README.read_text(encoding="utf-8")
    section = text.split("\n## Python API\n", 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    bits = re.search(r"([\d.]+) bits per value", capsys.readouterr().out)
    assert bits is not None and float(bits.group(1)) < 16
