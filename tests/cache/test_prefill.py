"""A prefill shared across methods (kvbench.cache.prefill) leaves every declaring method's cache
exactly as its own prefill does: the same held tensors, byte for byte, the same logits, and the same
decode steps after it. On the default model, with the prefill recorded under another method."""

import pytest
import torch

from kvbench.cache import memory_report
from kvbench.cache.prefill import SHARED_PREFILLS, PrefillStore, record_prefill, token_digest
from kvbench.generate import PREFILL_LOGIT_ROWS, ModelRunner
from kvbench.methods import METHODS, build_method

# every registered method at the node the method contract uses, plus the variants the experiment
# nodes run whose prefill takes another path (an attention-scored SemKV, a pivot around KIVI, a
# pool chosen by its own rule)
EXTRA = [
    {"name": "semkv", "metric": "attn_sum", "bits": 2.39},
    {"name": "semkv", "metric": "entropy", "bits": 2.39},
    {"name": "intactkv", "tokens": 4, "bits": 2},
    {"name": "ott", "bits": 2, "selection": "largest"},
    {"name": "snapkv", "budget": 0.5},
]
# KVQuant without calibration fits its codebooks on the prompt itself: uniform ones here, as k-means
# on 300 tokens x 30 layers costs 20 s and takes the same prefill path
FAST = {"kvquant": {"datatype": "uniform"}}
NODES = [{"name": n, **METHODS.get(n).contract_node, **FAST.get(n, {})} for n in METHODS.names()] + EXTRA
PROMPT, STEPS = 300, 3


def _id(node):
    return "-".join(f"{v}" for v in node.values())


@pytest.fixture(scope="module")
def prompt(default_model):
    torch.manual_seed(0)
    return torch.randint(100, 40000, (1, PROMPT))


def _held(cache) -> list[torch.Tensor]:
    out = []
    for layer in cache.layers:
        for part in (layer, getattr(layer, "inner", None)):
            if part is None or not hasattr(part, "held_tensors"):
                continue
            for _, tensors in sorted(part.held_tensors().items()):
                tensors = tensors if isinstance(tensors, (list, tuple)) else [tensors]
                out += [t for t in tensors if isinstance(t, torch.Tensor)]
    return out


def _run(runner, prompt):
    """Prefill then STEPS greedy decode steps: (held tensors after the prefill, memory report, every
    step's logits)."""
    runner.method.new_request(STEPS)
    cache = runner.new_cache()
    logits = [runner.prefill(prompt, cache)[:, -1]]
    held = [t.clone() for t in _held(cache)]
    report = memory_report(cache.layers).bytes_by_component
    for _ in range(STEPS):
        nxt = logits[-1].argmax(-1, keepdim=True)
        logits.append(runner.decode_step(nxt, cache)[:, -1])
    runner.method.end_request(cache)
    return held, report, logits


@pytest.fixture
def store(monkeypatch):
    fresh = PrefillStore(2**31)
    monkeypatch.setattr("kvbench.generate.SHARED_PREFILLS", fresh)
    return fresh


def test_every_method_but_h2o_declares_its_prefill_fp16():
    declared = {n for n in METHODS.names() if METHODS.get(n).fp16_prefill}
    assert declared == set(METHODS.names()) - {"h2o"}
    assert not build_method({"name": "semkv", "metric": "hidden_norm", "bits": 2.39}).prefill_is_fp16()
    assert not build_method({"name": "semkv", "metric": "entropy", "bits": 2.39}).prefill_is_fp16()
    assert not build_method({"name": "h2o", "budget": 64}).prefill_is_fp16()


@pytest.mark.parametrize("node", NODES, ids=_id)
def test_shared_prefill_holds_the_same_bytes(node, default_model, prompt, store):
    model, tokenizer, shape = default_model
    method = build_method(dict(node))
    runner = ModelRunner(model, tokenizer, method, shape)
    store.budget = 0  # its own prefill
    torch.manual_seed(1)
    own_held, own_report, own_logits = _run(runner, prompt)
    store.budget = 2**31
    # the record comes from another method's forward (fp16), as in a node whose first arm is fp16
    fp16 = ModelRunner(model, tokenizer, build_method(None), shape)
    fp16.prefill(prompt, fp16.new_cache())
    hits = store.hits
    torch.manual_seed(1)
    held, report, logits = _run(runner, prompt)
    shared = method.prefill_is_fp16()
    assert store.hits == hits + shared
    assert report == own_report
    assert len(held) == len(own_held) and all(
        a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(held, own_held, strict=True)
    )
    for a, b in zip(logits, own_logits, strict=True):
        assert torch.equal(a, b)


def test_the_kept_rows_give_the_whole_prompts_last_logits(default_model, prompt):
    """PREFILL_LOGIT_ROWS rows of the output projection give the last position's logits bit for bit
    as the whole prompt's projection does (one row would not: a matrix-vector product sums in
    another order)."""
    model = default_model[0]
    with torch.no_grad():
        full = model(input_ids=prompt).logits[:, -1]
        kept = model(input_ids=prompt, logits_to_keep=PREFILL_LOGIT_ROWS).logits[:, -1]
    assert torch.equal(full, kept)


def test_a_record_is_only_kept_for_a_plain_prefill(default_model, prompt):
    """A recorder that saw another cache, or a layer twice, keeps nothing."""
    model, tokenizer, shape = default_model
    runner = ModelRunner(model, tokenizer, build_method(None), shape)
    cache, other = runner.new_cache(), runner.new_cache()
    with record_prefill(other) as recorder:
        logits = runner.forward(prompt, cache, logits_to_keep=PREFILL_LOGIT_ROWS)
    assert recorder.finish(logits) is None
    with record_prefill(cache) as recorder:
        logits = runner.forward(prompt, cache, logits_to_keep=PREFILL_LOGIT_ROWS)
    record = recorder.finish(logits)
    assert record is not None and len(record.layers) == shape.num_layers
    assert record.nbytes > 2 * shape.num_layers * PROMPT * shape.num_kv_heads * shape.head_dim * 4


def test_a_full_store_keeps_what_it_holds(default_model, prompt):
    model, tokenizer, shape = default_model
    runner = ModelRunner(model, tokenizer, build_method(None), shape)
    with record_prefill(cache := runner.new_cache()) as recorder:
        logits = runner.forward(prompt, cache, logits_to_keep=PREFILL_LOGIT_ROWS)
    record = recorder.finish(logits)
    store = PrefillStore(record.nbytes + 1)
    assert store.put(model, ("prefill", token_digest(prompt)), record)
    assert not store.put(model, ("prefill", token_digest(prompt[:, 1:])), record) and store.refused == 1
    assert store.get(model, ("prefill", token_digest(prompt))) is record
    assert store.get(model, ("prefill", token_digest(prompt[:, 1:]))) is None


def test_the_process_store_reads_its_budget(monkeypatch):
    monkeypatch.setenv("KVBENCH_PREFILL_STORE_GB", "0")
    assert not PrefillStore().enabled
    monkeypatch.setenv("KVBENCH_PREFILL_STORE_GB", "many")
    with pytest.raises(ValueError, match="KVBENCH_PREFILL_STORE_GB='many'"):
        PrefillStore().enabled  # noqa: B018
    assert SHARED_PREFILLS is not None
