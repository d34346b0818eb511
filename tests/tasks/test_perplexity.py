"""Perplexity: windowing, corpus aggregation, Gutenberg body extraction, config errors, one real run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from kvbench.cache import MemoryReport
from kvbench.errors import ConfigError
from kvbench.methods import ModelShape
from kvbench.tasks import build_task
from kvbench.tasks import perplexity as ppl_module
from kvbench.tasks.perplexity import corpus_metrics, gutenberg_body, load_text, split_windows

SHAPE = ModelShape(num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, max_context=8192)


def perplexity(data_root, **overrides):
    return build_task({"name": "perplexity", **overrides}, data_root, seed=0)


# --- windowing -------------------------------------------------------------------------------------


def test_split_windows_consecutive_and_sized():
    ids = list(range(100))
    pairs = split_windows(ids, context=10, continuation=5, n=3)
    assert len(pairs) == 3
    assert all(len(c) == 10 and len(t) == 5 for c, t in pairs)
    flat = [i for c, t in pairs for i in (*c, *t)]
    assert flat == list(range(45))  # consecutive, non-overlapping, from the start


def test_split_windows_too_short():
    with pytest.raises(ValueError, match="6 windows"):
        split_windows(list(range(100)), context=10, continuation=5, n=7)


def test_task_windows_on_real_text(data_root, tokenizer):
    task = perplexity(data_root, context_length=64, continuation_length=16, windows=3)
    ids = task.token_ids(tokenizer)
    pairs = task.window_pairs(tokenizer)
    assert [(len(c), len(t)) for c, t in pairs] == [(64, 16)] * 3
    assert [i for c, t in pairs for i in (*c, *t)] == ids[:240]
    assert [s["id"] for s in task.samples()] == ["w0", "w1", "w2"]


def test_too_many_windows(data_root, tokenizer):
    task = perplexity(data_root, dataset="pg19", context_length=4000, continuation_length=96, windows=1000)
    with pytest.raises(ConfigError, match=r"task\.windows.*too short"):
        task.check_model(SHAPE, tokenizer)


def test_text_is_tokenized_without_special_tokens(data_root, tokenizer):
    ids = perplexity(data_root).token_ids(tokenizer)
    assert set(ids).isdisjoint(tokenizer.all_special_ids)


# --- aggregation -----------------------------------------------------------------------------------


def test_aggregate_weights_every_token():
    rows = [
        {"nll_mean": 1.0, "tokens": 2, "ppl": math.e},
        {"nll_mean": 3.0, "tokens": 1, "ppl": math.e**3},
    ]
    agg = corpus_metrics(rows)
    assert agg["ppl"] == pytest.approx(math.exp(5 / 3))
    assert agg["nll_mean"] == pytest.approx(5 / 3)
    assert agg["n"] == 2
    # not the mean of window perplexities, nor exp of the mean of window nlls
    assert agg["ppl"] != pytest.approx((math.e + math.e**3) / 2)
    assert agg["ppl"] != pytest.approx(math.exp(2.0))


def test_task_aggregate_is_corpus_ppl(data_root):
    task = perplexity(data_root)
    rows = [{"nll_mean": 1.0, "tokens": 2}, {"nll_mean": 3.0, "tokens": 1}]
    assert task.aggregate(rows)["ppl"] == pytest.approx(math.exp(5 / 3))
    assert task.primary_metric == "ppl"


# --- data ------------------------------------------------------------------------------------------


def test_gutenberg_body_drops_header_and_footer():
    text = (
        "The Project Gutenberg EBook of X\r\nheader line\r\n\r\n"
        "***START OF THE PROJECT GUTENBERG EBOOK X, A\r\nVERY LONG TITLE***\r\n"
        "Chapter 1.\r\nBody text.\r\n"
        "***END OF THE PROJECT GUTENBERG EBOOK X\r\nfooter line\r\n"
    )
    assert gutenberg_body(text) == "Chapter 1.\r\nBody text.\r\n"
    spaced = text.replace("***START", "*** START").replace("***END", "*** END")
    assert gutenberg_body(spaced) == "Chapter 1.\r\nBody text.\r\n"


def test_gutenberg_body_without_markers():
    with pytest.raises(ConfigError, match=r"data\.root"):
        gutenberg_body("just some text\n")


def test_pg19_book_body(data_root):
    body = load_text(data_root, "pg19", "10146")
    assert "\r" not in body
    assert "PROJECT GUTENBERG EBOOK" not in body
    assert "START OF" not in body and "END OF" not in body
    assert body.lstrip().startswith("E-text prepared by Josephine Paolucci")
    assert body.rstrip().endswith("to have as a fellow workman.")
    # the fixture keeps 21,931 characters of the body (CRLF counted as two; tests/fixtures/SOURCES.md)
    assert len(body) + body.count("\n") == 21_931


def test_wikitext_is_lf(data_root):
    text = load_text(data_root, "wikitext2")
    assert "\r" not in text
    assert " = Robert Boulter = " in text[:100]


def book(title: str, body: str) -> str:
    """A hand-made Project Gutenberg file with CRLF line endings around ``body``."""
    return (
        f"The Project Gutenberg EBook of {title}\r\nLicense blurb.\r\n\r\n"
        f"*** START OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\r\n"
        f"{body}"
        f"*** END OF THIS PROJECT GUTENBERG EBOOK {title.upper()} ***\r\nFooter.\r\n"
    )


def test_wikitext_crlf_becomes_lf_rows_joined_by_blank_lines(tmp_path):
    (tmp_path / "wikitext2").mkdir()
    (tmp_path / "wikitext2" / "wikitext-test.txt").write_bytes(
        b" = Title = \r\n\r\n A row .\r\n\r\n\r\n Next ."
    )
    assert load_text(tmp_path, "wikitext2") == " = Title = \n\n A row .\n\n\n Next ."


def test_pg19_books_bodies_only_lf_in_the_order_given(tmp_path):
    (tmp_path / "pg19").mkdir()
    (tmp_path / "pg19" / "7.txt").write_bytes(book("Seven", "Line one.\r\nLine two.\r\n").encode())
    (tmp_path / "pg19" / "12.txt").write_bytes(book("Twelve", "Only line.\r\n").encode())
    assert load_text(tmp_path, "pg19", "7") == "Line one.\nLine two.\n"
    assert load_text(tmp_path, "pg19", ["12", "7"]) == "Only line.\n\n\nLine one.\nLine two.\n"
    # all: every book, by number (7 before 12, not by string order)
    assert load_text(tmp_path, "pg19", "all") == "Line one.\nLine two.\n\n\nOnly line.\n"
    task = perplexity(tmp_path, dataset="pg19", pg19_book=[12, 7])  # Hydra gives ints
    assert task.config.pg19_book == ["12", "7"]
    assert "License" not in task.text() and "Footer" not in task.text()


def test_c4_local_shard_first_documents_joined_by_spaces(tmp_path):
    import gzip
    import json

    (tmp_path / "c4").mkdir()
    docs = [{"text": "First doc.\r\nSecond line.", "url": "a"}, {"text": "Second doc."}, {"text": "Third."}]
    with gzip.open(tmp_path / "c4" / "c4-validation.00000-of-00008.json.gz", "wt", encoding="utf-8") as f:
        f.write("".join(json.dumps(d) + "\n" for d in docs))
    assert load_text(tmp_path, "c4", c4_docs=2) == "First doc.\nSecond line. Second doc."
    task = perplexity(tmp_path, dataset="c4", c4_documents=3)
    assert [s["id"] for s in task.samples()] == ["w0", "w1", "w2", "w3"]
    assert task.text().endswith("Second doc. Third.")


def test_c4_missing_and_hub_unreachable_is_one_clear_error(tmp_path, monkeypatch):
    calls = []

    def unreachable(n):
        calls.append(n)
        raise ConnectionError("no network")

    monkeypatch.setattr(ppl_module, "hub_unavailable", lambda: None)  # the probe answered
    monkeypatch.setattr(ppl_module, "hub_c4_documents", unreachable)
    task = perplexity(tmp_path, dataset="c4", c4_documents=5)
    with pytest.raises(ConfigError) as err:
        task.samples()  # before any model work
    assert calls == [5]
    assert err.value.key == "task.dataset" and err.value.value == "c4"
    assert "c4-validation.00000-of-00008" in str(err.value) and "ConnectionError" in str(err.value)
    assert ".json.gz" in str(err.value) and ".parquet" in str(err.value) and "task.path" in str(err.value)
    assert "\n" not in str(err.value)


# --- config ----------------------------------------------------------------------------------------


def test_defaults(data_root):
    c = perplexity(data_root).config
    assert (
        c.dataset,
        c.pg19_book,
        c.context_length,
        c.continuation_length,
        c.windows,
        c.chunk,
        c.version,
    ) == (
        "wikitext2",
        "10146",
        512,
        64,
        4,
        1,
        2,
    )


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"dataset": "c5"}, "task.dataset"),
        ({"pg19_book": "ten"}, "task.pg19_book"),
        ({"pg19_book": ["10146", "10146"]}, "task.pg19_book"),
        ({"c4_documents": 0}, "task.c4_documents"),
        ({"context_length": 0}, "task.context_length"),
        ({"continuation_length": -1}, "task.continuation_length"),
        ({"windows": 0}, "task.windows"),
        ({"chunk": 1.5}, "task.chunk"),
    ],
)
def test_bad_config(data_root, overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        perplexity(data_root, **overrides)


def test_window_above_max_context(data_root, tokenizer):
    task = perplexity(data_root, context_length=8192, continuation_length=64)
    with pytest.raises(ConfigError, match=r"task\.context_length.*8192"):
        task.check_model(SHAPE, tokenizer)


def test_missing_data_root(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.root.*wikitext-test\.txt"):
        perplexity(tmp_path).samples()
    with pytest.raises(ConfigError, match=r"data\.root.*pg19/123\.txt"):
        perplexity(tmp_path, dataset="pg19", pg19_book=123).samples()


# --- end to end ------------------------------------------------------------------------------------


def test_end_to_end_fp16(data_root, fp16_runner):
    task = perplexity(data_root, context_length=128, continuation_length=8, windows=1)
    task.check_model(fp16_runner.shape, fp16_runner.tokenizer)
    (sample,) = task.samples()
    row = task.run(sample, fp16_runner)
    assert sample["id"] == "w0"
    assert (row["prompt_tokens"], row["tokens"], row["prediction"]) == (128, 8, "")
    assert math.isfinite(row["ppl"]) and row["ppl"] > 1
    assert row["ppl"] == pytest.approx(math.exp(row["nll_mean"]))
    assert isinstance(row["memory"], MemoryReport)
    assert row["memory"].tokens >= 128 + 7  # the context plus the continuation tokens fed after it
    assert row["seconds"] > 0
    agg = task.aggregate([row])
    assert agg["ppl"] == pytest.approx(row["ppl"]) and agg["n"] == 1


def test_conf_node_builds_the_defaults(data_root):
    from omegaconf import OmegaConf

    node = OmegaConf.load(Path(__file__).parents[2] / "kvbench" / "conf" / "task" / "perplexity.yaml")
    assert build_task(node, data_root, seed=0).config == perplexity(data_root).config
