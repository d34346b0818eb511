"""The data root: what a missing dataset's error tells the user, the committed test fixtures and
their provenance, and the sandbox that keeps the suite off data beside the checkout."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.data import missing_file, require_file
from kvbench.errors import ConfigError
from kvbench.tasks import build_task

TESTS = Path(__file__).resolve().parent
FIXTURES = TESTS / "fixtures"


# --- missing data: one line that says where kvbench looked and what the user can do ---------------


@pytest.mark.parametrize(
    ("node", "relpath", "source"),
    [
        ({"name": "niah"}, "niah/PaulGrahamEssays/*.txt", "make assets"),
        ({"name": "perplexity"}, "wikitext2/wikitext-test.txt", "Salesforce/wikitext"),
        ({"name": "perplexity", "dataset": "pg19"}, "pg19/10146.txt", "deepmind/pg19"),
        ({"name": "pg19_hitrate"}, "pg19/10146.txt", "deepmind/pg19"),
        ({"name": "gsm8k", "source": "local"}, "gsm8k/test.jsonl", "task.source=hub"),
        ({"name": "longbench", "source": "minilongbench"}, "longbench/config/dataset2prompt.json", "hub"),
    ],
)
def test_missing_dataset_error_names_the_root_the_file_and_the_ways_to_get_it(
    tmp_path, node, relpath, source
):
    with pytest.raises(ConfigError) as err:
        build_task(node, tmp_path, 0).samples()
    text = str(err.value)
    assert err.value.key == "data.root" and err.value.value == str(tmp_path)
    assert "\n" not in text and relpath in text and source in text
    assert "data.root=/path" in text and "KVBENCH_DATA_DIR" in text
    # `make assets` fetches the model and the haystack only: no other dataset may point at it
    assert ("make assets" in text) == relpath.startswith("niah/")


def test_require_file_returns_the_path_when_present(tmp_path):
    (tmp_path / "pg19").mkdir()
    (tmp_path / "pg19" / "7.txt").write_text("x")
    assert require_file(tmp_path, "pg19/7.txt", "a book") == tmp_path / "pg19" / "7.txt"
    assert "make assets" not in str(missing_file(tmp_path, "c4/shard.json.gz", "C4"))


# --- fixtures: small, each one listed with its size and hash in SOURCES.md ------------------------


def test_every_fixture_file_is_listed_with_its_size_and_sha256():
    listed = {
        m.group(1): (int(m.group(2)), m.group(3))
        for m in re.finditer(
            r"^\| `(data/[^`]+)` \| (\d+) \| `([0-9a-f]{64})` \|$",
            (FIXTURES / "SOURCES.md").read_text(),
            re.M,
        )
    }
    on_disk = {p.relative_to(FIXTURES).as_posix(): p for p in (FIXTURES / "data").rglob("*") if p.is_file()}
    assert set(listed) == set(on_disk)
    for name, path in on_disk.items():
        data = path.read_bytes()
        assert (len(data), hashlib.sha256(data).hexdigest()) == listed[name], name
    assert sum(size for size, _ in listed.values()) < 500_000


def test_fixture_root_has_every_dataset_the_tasks_read(data_root):
    assert sorted(p.name for p in data_root.iterdir()) == ["gsm8k", "longbench", "niah", "pg19", "wikitext2"]
    # CRLF survives the checkout (.gitattributes), so the loaders' CRLF handling stays under test
    assert b"\r\n" in (data_root / "wikitext2" / "wikitext-test.txt").read_bytes()[:200]
    assert b"\r\n" in (data_root / "pg19" / "10146.txt").read_bytes()[:200]


# --- the sandbox: a forbidden folder cannot be read by the tests or by any Python they start -------


def test_sandbox_refuses_and_records_reads_under_a_forbidden_folder(tmp_path):
    forbidden, log = tmp_path / "forbidden", tmp_path / "forbidden.log"
    forbidden.mkdir()
    (forbidden / "data.txt").write_text("secret")
    (tmp_path / "allowed.txt").write_text("fine")
    env = {
        **os.environ,
        "KVBENCH_TEST_FORBIDDEN": str(forbidden),
        "KVBENCH_TEST_FORBIDDEN_LOG": str(log),
        "PYTHONPATH": str(TESTS / "sandbox"),
    }
    script = (
        "import os, sys\n"
        f"print(open({str(tmp_path / 'allowed.txt')!r}).read())\n"
        "for read in (lambda: open(sys.argv[1] + '/data.txt').read(), lambda: os.listdir(sys.argv[1])):\n"
        "    try:\n"
        "        read()\n"
        "    except PermissionError as err:\n"
        "        print('refused:', err)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(forbidden)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.splitlines()
    assert (
        out[0] == "fine"
        and len(out) == 3
        and all(line.startswith("refused: test sandbox") for line in out[1:])
    )
    events = [line.split()[1:] for line in log.read_text().splitlines()]
    assert events == [["open", str(forbidden / "data.txt")], ["os.listdir", str(forbidden)]]


# --- corpus files named by path (perplexity's task.dataset=text and C4 shards) ---------------------


def test_corpus_suffix_is_the_longest_known_ending_in_any_case():
    from kvbench.data import corpus_suffix

    assert corpus_suffix("a/b.JSONL.GZ") == ".jsonl.gz"
    assert corpus_suffix("c4-validation.00000-of-00008.json.gz") == ".json.gz"
    assert corpus_suffix("book.txt") == ".txt" and corpus_suffix("x.parquet") == ".parquet"
    assert corpus_suffix("book.txt.bak") is None and corpus_suffix("x.csv") is None


def test_read_documents_stops_at_the_limit(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvbench.data import read_documents

    lines = tmp_path / "d.jsonl"
    lines.write_text('{"text": "one"}\n\n{"text": "two"}\n{"text": 3}\n')
    assert read_documents(lines, limit=2) == ["one", "two"]  # the bad third row is never read
    table = tmp_path / "d.parquet"
    pq.write_table(pa.table({"text": ["one", "two", None]}), table, row_group_size=1)
    assert read_documents(table, limit=2) == ["one", "two"]
    with pytest.raises(ConfigError, match=r"^task\.text_field='text': row 3 of .* has NoneType"):
        read_documents(table)


def test_read_documents_errors_name_the_key_that_named_the_file(tmp_path):
    from kvbench.data import read_documents

    broken = tmp_path / "d.json.gz"
    broken.write_bytes(b"not gzip at all")
    with pytest.raises(ConfigError) as err:
        read_documents(broken, key="task.path")
    assert err.value.key == "task.path" and "a readable .json.gz file" in str(err.value)
    latin = tmp_path / "d.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"^task\.path=.*byte 3"):
        read_documents(latin, key="task.path")
    with pytest.raises(ConfigError, match=r"^data\.root=.*unknown extension; allowed: \.txt"):
        read_documents(tmp_path / "d.csv")


def test_file_record_is_path_size_and_sha256(tmp_path):
    from kvbench.data import file_record

    path = tmp_path / "t.txt"
    path.write_bytes(b"abc")
    assert file_record(path) == {
        "path": str(path.resolve()),
        "bytes": 3,
        "sha256": hashlib.sha256(b"abc").hexdigest(),
    }


class _CountingTokenizer:
    """Encodes characters as their code points and counts the calls."""

    def __init__(self):
        self.calls = 0

    def encode(self, text, add_special_tokens=True):
        assert add_special_tokens is False
        self.calls += 1
        return [ord(ch) for ch in text]


def test_encode_text_tokenizes_a_text_once_per_tokenizer():
    from kvbench.data import encode_text

    tok, other = _CountingTokenizer(), _CountingTokenizer()
    first = encode_text(tok, "abc")
    # an equal text read again (a new string object, as each job reads its file) is not re-encoded
    again = encode_text(tok, "".join(["a", "bc"]))
    assert first == [97, 98, 99] and again is first and tok.calls == 1
    # another tokenizer object, or another text, is encoded afresh
    assert encode_text(other, "abc") == [97, 98, 99] and other.calls == 1
    assert encode_text(tok, "abd") == [97, 98, 100] and tok.calls == 2


def test_encode_text_keeps_few_texts():
    from kvbench import data

    tok = _CountingTokenizer()
    for i in range(data._ENCODED_MAX + 2):
        data.encode_text(tok, f"text {i}")
    assert len(data._ENCODED) == data._ENCODED_MAX
    data.encode_text(tok, "text 0")  # the oldest was dropped: encoded again
    assert tok.calls == data._ENCODED_MAX + 3
