"""Perplexity on any text: task.dataset=text in every format, C4 from any local shard, offsets in
tokens and characters, add_bos, the source record, and the one-line errors for each mistake.

Most tests use a tiny word-level tokenizer, so window ids can be asserted exactly; the last ones use
the default model's tokenizer and one FP16 window for what depends on a real tokenizer (its BOS).
The corpora are hand-made here, a few hundred characters each, written into ``tmp_path``.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import time

import pytest

from kvbench.errors import ConfigError
from kvbench.methods import ModelShape
from kvbench.tasks import build_task
from kvbench.tasks import perplexity as ppl_module
from kvbench.tasks.perplexity import load_text, split_windows

FRONT = "FRONT MATTER: title page, licence, contents.\r\n\r\n"
DOCS = [
    "alpha beta gamma delta epsilon zeta eta theta iota kappa",
    "lambda mu nu xi omicron pi rho sigma tau upsilon",
    "phi chi psi omega alpha beta gamma delta epsilon zeta",
]
VOCAB = sorted({w for d in DOCS for w in d.split()} | {"FRONT", "MATTER:"})
UNK, BOS = 900, 901


class WordTokenizer:
    """Whitespace words to their index in VOCAB (anything else: UNK); BOS is ``bos_token_id``."""

    name_or_path = "word-tokenizer"

    def __init__(self, bos: int | None = BOS):
        self.bos_token_id = bos
        self.all_special_ids = [] if bos is None else [bos]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [VOCAB.index(w) if w in VOCAB else UNK for w in text.split()]
        return ([self.bos_token_id] if add_special_tokens and self.bos_token_id is not None else []) + ids


def word_ids(text: str) -> list[int]:
    return WordTokenizer().encode(text, add_special_tokens=False)


def perplexity(data_root, **overrides):
    node = {"name": "perplexity", "context_length": 4, "continuation_length": 2, "windows": 2, **overrides}
    return build_task(node, data_root, seed=0)


def write(path, docs, field="text"):
    """``docs`` as a corpus file in the format ``path``'s suffix names."""
    name = path.name
    if name.endswith(".txt"):
        path.write_text("\n\n".join(docs), encoding="utf-8")
    elif name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"id": list(range(len(docs))), field: docs}), path)
    else:
        lines = "".join(json.dumps({"id": i, field: d}) + "\n" for i, d in enumerate(docs))
        if name.endswith(".gz"):
            with gzip.open(path, "wt", encoding="utf-8") as f:
                f.write(lines)
        else:
            path.write_text(lines, encoding="utf-8")
    return path


def one_line_error(excinfo, key: str) -> str:
    text = str(excinfo.value)
    assert excinfo.value.key == key, text
    assert "\n" not in text
    return text


# --- task.dataset=text: every format ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["c.txt", "c.jsonl", "c.json", "c.jsonl.gz", "c.json.gz", "c.parquet"])
def test_text_formats_give_the_documents_joined_by_blank_lines(tmp_path, name):
    docs = [FRONT + DOCS[0], *DOCS[1:]]
    path = write(tmp_path / name, docs)
    expected = "\n\n".join(docs).replace("\r\n", "\n")
    assert load_text(tmp_path, "text", path=str(path)) == expected
    task = perplexity(tmp_path, dataset="text", path=str(path))
    assert task.text() == expected
    assert [s["id"] for s in task.samples()] == ["w0", "w1"]


@pytest.mark.parametrize("name", ["c.jsonl.gz", "c.parquet"])
def test_text_field_names_the_field_or_column(tmp_path, name):
    path = write(tmp_path / name, DOCS, field="content")
    task = perplexity(tmp_path, dataset="text", path=str(path), text_field="content")
    assert task.text() == "\n\n".join(DOCS)


def test_a_relative_path_is_read_from_the_working_directory_then_the_data_root(tmp_path, monkeypatch):
    root, cwd = tmp_path / "root", tmp_path / "cwd"
    (root / "corpora").mkdir(parents=True)
    cwd.mkdir()
    write(root / "corpora" / "x.txt", ["from the root"])
    monkeypatch.chdir(cwd)
    assert perplexity(root, dataset="text", path="corpora/x.txt").text() == "from the root"
    (cwd / "corpora").mkdir()
    write(cwd / "corpora" / "x.txt", ["from the working directory"])
    assert perplexity(root, dataset="text", path="corpora/x.txt").text() == "from the working directory"


# --- errors: one line, naming the key, the value and what is allowed -------------------------------


def test_missing_file(tmp_path):
    task = perplexity(tmp_path, dataset="text", path="nowhere.txt")
    with pytest.raises(ConfigError) as err:
        task.samples()
    text = one_line_error(err, "task.path")
    assert (
        err.value.value == "nowhere.txt" and "no such file" in text and str(tmp_path / "nowhere.txt") in text
    )


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        ({"dataset": "text"}, "task.path", "required with task.dataset=text"),
        ({"dataset": "text", "path": "book.pdf"}, "task.path", "unknown extension; allowed: .txt, .jsonl"),
        ({"dataset": "c4", "path": "shard.txt"}, "task.path", "allowed: .jsonl.gz, .json.gz"),
        ({"path": "x.txt"}, "task.path", "read only with task.dataset=text or c4"),
        ({"dataset": "text", "path": "x.txt", "text_field": ""}, "task.text_field", "a field"),
        ({"offset": -1}, "task.offset", "a token count"),
        ({"offset": "chars:-5"}, "task.offset", "'chars:N'"),
        ({"offset": "bytes:5"}, "task.offset", "'tokens:N'"),
        ({"offset": "5000"}, "task.offset", "a token count"),
        ({"offset": True}, "task.offset", "a token count"),
        ({"add_bos": "yes"}, "task.add_bos", "true or false"),
    ],
)
def test_bad_config_is_one_line_on_its_key(tmp_path, overrides, key, says):
    with pytest.raises(ConfigError) as err:
        perplexity(tmp_path, **overrides)
    assert says in one_line_error(err, key)


@pytest.mark.parametrize("name", ["c.jsonl", "c.json.gz", "c.parquet"])
def test_missing_field_names_the_fields_there_are(tmp_path, name):
    path = write(tmp_path / name, DOCS, field="body")
    task = perplexity(tmp_path, dataset="text", path=str(path))
    with pytest.raises(ConfigError) as err:
        task.samples()  # before any model work
    text = one_line_error(err, "task.text_field")
    assert err.value.value == "text" and str(path) in text and "id, body" in text


def test_bad_rows_are_named_by_line(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "fine"}\n{"text": 7}\n')
    with pytest.raises(ConfigError) as err:
        perplexity(tmp_path, dataset="text", path=str(path)).samples()
    assert "line 2" in one_line_error(err, "task.text_field") and "int" in str(err.value)
    path.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ConfigError) as err:
        perplexity(tmp_path, dataset="text", path=str(path)).samples()
    assert "line 2 is not JSON" in one_line_error(err, "task.path")


def test_too_short_after_the_offset_says_so(tmp_path):
    path = write(tmp_path / "c.txt", DOCS)
    task = perplexity(tmp_path, dataset="text", path=str(path), offset=25)
    with pytest.raises(ConfigError) as err:
        task.window_pairs(WordTokenizer())
    assert "too short after task.offset=25" in one_line_error(err, "task.windows")
    for offset in (30, "tokens:30"):
        with pytest.raises(ConfigError) as err:
            perplexity(tmp_path, dataset="text", path=str(path), offset=offset).token_ids(WordTokenizer())
        assert "past the end of the text (30 tokens)" in one_line_error(err, "task.offset")
    with pytest.raises(ConfigError) as err:
        perplexity(tmp_path, dataset="text", path=str(path), offset="chars:5000").samples()
    assert "past the end of the text" in one_line_error(err, "task.offset")


# --- offset ----------------------------------------------------------------------------------------


def test_offset_in_tokens_skips_that_many_tokens(tmp_path):
    path = write(tmp_path / "c.txt", [FRONT + DOCS[0], DOCS[1]])
    tok = WordTokenizer()
    all_ids = word_ids(FRONT + DOCS[0] + "\n\n" + DOCS[1])
    front = len(FRONT.split())  # 7 words of front matter
    for offset in (front, f"tokens:{front}"):
        task = perplexity(tmp_path, dataset="text", path=str(path), offset=offset)
        (context, continuation), second = task.window_pairs(tok)
        assert context == [VOCAB.index(w) for w in ("alpha", "beta", "gamma", "delta")]
        assert continuation == [VOCAB.index("epsilon"), VOCAB.index("zeta")]
        assert context + continuation + second[0] + second[1] == all_ids[front : front + 12]
    # the default starts at the front matter
    (context, _), _ = perplexity(tmp_path, dataset="text", path=str(path)).window_pairs(tok)
    assert context == [VOCAB.index("FRONT"), VOCAB.index("MATTER:"), UNK, UNK]


def test_offset_in_characters_drops_that_many_characters_then_tokenizes(tmp_path):
    path = write(tmp_path / "c.txt", [FRONT + DOCS[0]])
    tok = WordTokenizer()
    chars = len(FRONT.replace("\r\n", "\n"))  # offsets count characters of the LF text
    ((context, continuation),) = perplexity(
        tmp_path, dataset="text", path=str(path), offset=f"chars:{chars}", windows=1
    ).window_pairs(tok)
    assert context == [VOCAB.index(w) for w in ("alpha", "beta", "gamma", "delta")]
    assert continuation == [VOCAB.index("epsilon"), VOCAB.index("zeta")]
    # a cut inside a word tokenizes its tail alone: "pha beta ..."
    ((context, _),) = perplexity(
        tmp_path, dataset="text", path=str(path), offset=f"chars:{chars + 2}", windows=1
    ).window_pairs(tok)
    assert context == [UNK, VOCAB.index("beta"), VOCAB.index("gamma"), VOCAB.index("delta")]


def test_offset_applies_to_the_named_datasets_too(data_root):
    tok = WordTokenizer()
    plain = perplexity(data_root).token_ids(tok)
    assert perplexity(data_root, offset=10).token_ids(tok) == plain[10:]
    text = perplexity(data_root).text()
    assert perplexity(data_root, offset="chars:1000").token_ids(tok) == word_ids(text[1000:])


# --- add_bos ---------------------------------------------------------------------------------------


def test_add_bos_puts_bos_before_every_context_and_scores_the_same_tokens(tmp_path):
    path = write(tmp_path / "c.txt", DOCS)
    off = perplexity(tmp_path, dataset="text", path=str(path)).window_pairs(WordTokenizer())
    task = perplexity(tmp_path, dataset="text", path=str(path), add_bos=True)
    on = task.window_pairs(WordTokenizer())
    assert all(context[0] != BOS for context, _ in off)
    assert [(c[0], c[1:], t) for c, t in on] == [(BOS, c, t) for c, t in off]
    assert [len(c) for c, _ in on] == [5, 5] and [len(t) for _, t in on] == [2, 2]
    assert task.prompt_lengths() == [5]


def test_add_bos_without_a_bos_token_is_one_line(tmp_path):
    path = write(tmp_path / "c.txt", DOCS)
    task = perplexity(tmp_path, dataset="text", path=str(path), add_bos=True)
    shape = ModelShape(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, max_context=64)
    with pytest.raises(ConfigError) as err:
        task.check_model(shape, WordTokenizer(bos=None))
    text = one_line_error(err, "task.add_bos")
    assert "word-tokenizer" in text and "no BOS token" in text and "task.add_bos=false" in text
    # without add_bos the same tokenizer is fine
    perplexity(tmp_path, dataset="text", path=str(path)).check_model(shape, WordTokenizer(bos=None))


def test_add_bos_counts_against_the_model_context(tmp_path):
    path = write(tmp_path / "c.txt", DOCS)
    shape = ModelShape(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=8, max_context=6)
    perplexity(tmp_path, dataset="text", path=str(path)).check_model(shape, WordTokenizer())
    with pytest.raises(ConfigError) as err:
        perplexity(tmp_path, dataset="text", path=str(path), add_bos=True).check_model(shape, WordTokenizer())
    assert "+ 1 (add_bos) = 7" in one_line_error(err, "task.context_length")


# --- defaults unchanged ----------------------------------------------------------------------------


def test_new_keys_at_their_defaults_change_no_window(data_root):
    tok = WordTokenizer()
    given = perplexity(data_root, offset=0, add_bos=False, text_field="text", path=None)
    plain = perplexity(data_root)
    assert given.config == plain.config
    ids = tok.encode(load_text(data_root, "wikitext2"), add_special_tokens=False)
    assert plain.window_pairs(tok) == split_windows(ids, 4, 2, 2)


# --- the source record -----------------------------------------------------------------------------


def test_the_run_records_where_the_text_came_from(tmp_path):
    path = write(tmp_path / "c.jsonl.gz", DOCS)
    task = perplexity(tmp_path, dataset="text", path=str(path), offset="chars:6", add_bos=True)
    text = task.aggregate([{"nll_mean": 1.0, "tokens": 2}])["text"]
    assert text == {
        "dataset": "text",
        "files": [
            {
                "path": str(path),
                "bytes": path.stat().st_size,
                "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
            }
        ],
        "text_field": "text",
        "offset": "chars:6",
        "add_bos": True,
        "chars": len("\n\n".join(DOCS)),
    }
    json.dumps(text)  # metrics.json takes it as it is


def test_default_source_is_the_wikitext_file(data_root):
    text = perplexity(data_root).aggregate([])["text"]
    assert text["dataset"] == "wikitext2" and text["offset"] == "tokens:0" and text["add_bos"] is False
    (record,) = text["files"]
    assert record["path"].endswith("wikitext2/wikitext-test.txt") and len(record["sha256"]) == 64


# --- C4 --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["c4-train.00003-of-01024.json.gz", "c4-validation.00001-of-00008.jsonl", "c4-en-val.parquet"]
)
def test_c4_reads_any_local_shard_name_and_parquet(tmp_path, name):
    (tmp_path / "c4").mkdir()
    write(tmp_path / "c4" / name, DOCS)
    assert load_text(tmp_path, "c4", c4_docs=2) == " ".join(DOCS[:2])
    task = perplexity(tmp_path, dataset="c4", c4_documents=3)
    task.samples()
    assert task.source()["files"][0]["path"] == str(tmp_path / "c4" / name)


def test_c4_prefers_gptq_validation_shard_and_path(tmp_path):
    (tmp_path / "c4").mkdir()
    write(tmp_path / "c4" / "c4-train.00000-of-01024.json.gz", ["train"])
    write(tmp_path / "c4" / "c4-validation.00000-of-00008.parquet", ["validation"])
    assert load_text(tmp_path, "c4") == "validation"
    other = write(tmp_path / "elsewhere.jsonl", ["named"])
    assert perplexity(tmp_path, dataset="c4", path=str(other)).text() == "named"


def test_several_c4_shards_and_no_validation_shard_is_one_line(tmp_path):
    (tmp_path / "c4").mkdir()
    write(tmp_path / "c4" / "c4-train.00000-of-01024.json.gz", ["a"])
    write(tmp_path / "c4" / "c4-train.00001-of-01024.json.gz", ["b"])
    with pytest.raises(ConfigError) as err:
        perplexity(tmp_path, dataset="c4").samples()
    text = one_line_error(err, "task.path")
    assert "2 C4 shards" in text and "c4-train.00001-of-01024.json.gz" in text


def test_c4_offline_fails_at_once_listing_the_local_names(tmp_path, monkeypatch):
    from kvbench.models import hub

    def never(*args, **kwargs):
        raise AssertionError("the Hub must not be tried offline")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(ppl_module, "hub_c4_documents", never)
    monkeypatch.setattr(hub, "hub_reachable", never)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        perplexity(tmp_path, dataset="c4").samples()
    assert time.perf_counter() - t0 < 1.0
    text = one_line_error(err, "task.dataset")
    assert "HF_HUB_OFFLINE" in text and "c4-validation.00000-of-00008" in text and "c4-*" in text
    assert ".jsonl.gz, .json.gz, .jsonl, .json, .parquet" in text and "task.path=FILE" in text
    assert str(tmp_path / "c4") in text


def test_c4_hub_not_answering_fails_without_the_hub_retries(tmp_path, monkeypatch):
    from kvbench.models import hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: False)
    monkeypatch.setattr(ppl_module, "hub_c4_documents", lambda n: pytest.fail("the Hub was tried"))
    with pytest.raises(ConfigError) as err:
        perplexity(tmp_path, dataset="c4").samples()
    assert "does not answer" in one_line_error(err, "task.dataset")


# --- the default model's tokenizer -----------------------------------------------------------------


def test_real_tokenizer_bos_and_offsets(data_root, tokenizer):
    assert tokenizer.bos_token_id is not None
    plain = perplexity(data_root, context_length=32, continuation_length=8, windows=1)
    ids = plain.token_ids(tokenizer)
    ((context, continuation),) = perplexity(
        data_root, context_length=32, continuation_length=8, windows=1, offset=5, add_bos=True
    ).window_pairs(tokenizer)
    assert context == [tokenizer.bos_token_id, *ids[5:37]] and continuation == ids[37:45]
    assert plain.window_pairs(tokenizer)[0][0][0] != tokenizer.bos_token_id
    text = plain.text()
    ((context, _),) = perplexity(
        data_root, context_length=32, continuation_length=8, windows=1, offset="chars:200"
    ).window_pairs(tokenizer)
    assert context == tokenizer.encode(text[200:], add_special_tokens=False)[:32]


def test_add_bos_end_to_end_scores_continuation_length_tokens(data_root, fp16_runner):
    rows = {}
    for add_bos in (False, True):
        task = perplexity(data_root, context_length=64, continuation_length=6, windows=1, add_bos=add_bos)
        task.check_model(fp16_runner.shape, fp16_runner.tokenizer)
        (sample,) = task.samples()
        rows[add_bos] = task.run(sample, fp16_runner)
    assert (rows[False]["prompt_tokens"], rows[False]["tokens"]) == (64, 6)
    assert (rows[True]["prompt_tokens"], rows[True]["tokens"]) == (65, 6)
    assert rows[True]["nll_mean"] != rows[False]["nll_mean"]
