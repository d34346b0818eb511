"""IntactKV's ``pivot`` (kvbench/methods/intactkv.py): with ``full_precision`` on a weight-quantized
model the pivot tokens' KV is the full-precision model's and the quantized model prefills and
decodes the rest over it; ``model`` (the default) is the prefill every run made before the option.

The model is the tiny random Llama of tests/tiny_archs.py, RTN-quantized in memory
(:func:`kvbench.models.weight_quant.fake_quantize_model`, 3 bits in groups of 32); its unquantized
twin is a deep copy taken before the quantization. Caches keep the model's dtype (``fp_dtype:
auto``) so that stored keys can be compared bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_archs import VOCAB, loaded, plain_kv, prefilled, random_prompt, tiny_model

from kvbench.errors import ConfigError
from kvbench.generate import PREFILL_LOGIT_ROWS
from kvbench.methods import build_method
from kvbench.models.weight_quant import fake_quantize_model, loaded_weights
from kvbench.results import run_id

RTN = {"bits": 3, "group_size": 32}
TOKENS = 4
KIVI = {"name": "kivi", "group_size": 8, "residual": 8}


@pytest.fixture(scope="module")
def models():
    """``(quantized, full_precision, shape)``: the same tiny Llama, RTN-quantized and as built."""
    model, shape = tiny_model("llama")
    full = copy.deepcopy(model)
    fake_quantize_model(model, RTN)
    return model, full, shape


def node(pivot: str | None, base=KIVI, tokens=TOKENS) -> dict:
    out = {"name": "intactkv", "bits": 2, "tokens": tokens, "fp_dtype": "auto", "base": dict(base)}
    if pivot is not None:
        out["pivot"] = pivot
    return out


def block_weights(model) -> list[torch.Tensor]:
    return [m.weight.detach().clone() for m, _ in loaded_weights(model).kept]


def test_pivot_kv_is_the_full_precision_models_and_the_rest_the_quantized_models(models):
    quantized, full, shape = models
    ids = random_prompt(40)
    before = block_weights(quantized)
    _, fp_cache, fp_logits = prefilled(quantized, shape, node("full_precision"), ids)
    _, own_cache, own_logits = prefilled(quantized, shape, node("model"), ids)
    reference = plain_kv(full, ids[:, :TOKENS])  # the unquantized model over the pivot tokens alone
    own_reference = plain_kv(quantized, ids[:, :TOKENS])
    for layer in range(shape.num_layers):
        fp, own = fp_cache.layers[layer], own_cache.layers[layer]
        assert fp.sink_k.data.shape[-2] == TOKENS and fp.inner.num_tokens == 40 - TOKENS
        # bit for bit the full-precision model's keys and values ...
        assert torch.equal(fp.sink_k.data, reference.layers[layer].keys)
        assert torch.equal(fp.sink_v.data, reference.layers[layer].values)
        # ... which are not the weight-quantized model's (what pivot=model keeps; computed in a
        # 40-token forward there, so equal to a 4-token forward's up to summation order)
        torch.testing.assert_close(own.sink_k.data, own_reference.layers[layer].keys, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(fp.sink_k.data, own.sink_k.data, atol=1e-2)
    # layer 0's later keys come from their own tokens alone (no attention before them): the same;
    # every later layer's read the pivot through attention, so they differ
    assert torch.equal(fp_cache.layers[0].inner.read()[0], own_cache.layers[0].inner.read()[0])
    for layer in range(1, shape.num_layers):
        assert not torch.allclose(
            fp_cache.layers[layer].inner.read()[0], own_cache.layers[layer].inner.read()[0], atol=1e-3
        )
    assert fp_logits.shape == own_logits.shape == (1, PREFILL_LOGIT_ROWS, VOCAB)
    assert not torch.allclose(fp_logits, own_logits, atol=1e-3)
    # the model is the quantized one again, with the very same tensors
    assert all(torch.equal(a, b) for a, b in zip(before, block_weights(quantized), strict=True))


@torch.no_grad()
def test_prefill_and_decode_are_the_papers_two_model_computation(models):
    """IntactKV over an FP16 cache (Table 1's setting) against the computation written out with
    plain transformers: the full-precision model over the pivot tokens, then the quantized model
    over the rest and each decoded token, on one cache."""
    quantized, full, shape = models
    ids, steps = random_prompt(30, seed=2), 5
    runner, cache, logits = prefilled(quantized, shape, node("full_precision", base={"name": "fp16"}), ids)
    ours = [logits[0, -1]]
    reference = plain_kv(full, ids[:, :TOKENS])
    theirs = [quantized(input_ids=ids[:, TOKENS:], cache=reference, use_cache=True).logits[0, -1]]
    alone = quantized(input_ids=ids).logits[0, -1]  # the weight-quantized model with its own pivot KV
    for _ in range(steps):
        token = ours[-1].argmax().view(1, 1)
        ours.append(runner.decode_step(token, cache)[0, -1])
        theirs.append(quantized(input_ids=token, cache=reference, use_cache=True).logits[0, -1])
    torch.testing.assert_close(torch.stack(ours), torch.stack(theirs).float(), rtol=1e-4, atol=1e-4)
    assert (ours[0] - alone).abs().max() > 1e-2  # the full-precision pivot changed the prediction
    assert runner.method.label() == "intactkv4fp-fp16"


def test_pivot_model_is_the_prefill_of_before(models):
    """``pivot=model``: the node without the key, the same run id, the shared prefill, and the same
    cache and logits as the method's base with sink tokens (IntactKV as it was)."""
    quantized, _, shape = models
    ids = random_prompt(40, seed=3)
    method = build_method(node("model"))
    assert method.config.pivot == "model" and build_method(node(None)).config.pivot == "model"
    assert method.prefill_is_fp16() and not method.drives_prefill()
    assert method.label() == build_method(node(None)).label() == "intactkv4-kivi-2b"
    base = {"model": {"name": "tiny"}, "bits": 2, "seed": 0, "task": {"name": "niah"}}
    assert run_id({**base, "method": node("model")}) == run_id({**base, "method": node(None)})
    assert run_id({**base, "method": node("full_precision")}) != run_id({**base, "method": node(None)})
    _, cache, logits = prefilled(quantized, shape, node("model"), ids)
    sink = {**KIVI, "bits": 2, "sink_tokens": TOKENS, "fp_dtype": "auto"}
    _, plain, plain_logits = prefilled(quantized, shape, sink, ids)
    assert torch.equal(logits, plain_logits)
    for ours, theirs in zip(cache.layers, plain.layers, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours.read(), theirs.read(), strict=True))


def test_logit_rows_and_short_prompts(models):
    """The prefill returns the rows one forward would: the pivot forward's where more rows are asked
    than the rest has; a prompt of ``tokens`` tokens or fewer keeps its last token for the quantized
    model, and a one-token prompt is one quantized forward."""
    quantized, full, shape = models
    ids = random_prompt(10, seed=4)  # 6 tokens after the pivot, 10 rows asked (PREFILL_LOGIT_ROWS > 10)
    _, _, logits = prefilled(quantized, shape, node("full_precision"), ids)
    _, _, own = prefilled(quantized, shape, node("model"), ids)
    assert logits.shape == own.shape == (1, 10, VOCAB)
    with torch.no_grad():
        pivot_rows = full(input_ids=ids[:, :TOKENS]).logits.float()
    torch.testing.assert_close(logits[:, :TOKENS], pivot_rows, rtol=1e-5, atol=1e-5)
    short = random_prompt(3, seed=5)
    _, cache, _ = prefilled(quantized, shape, node("full_precision"), short)
    reference = plain_kv(full, short[:, :2])
    assert torch.equal(cache.layers[1].sink_k.data[:, :, :2], reference.layers[1].keys)
    whole = plain_kv(full, short).layers[1].keys  # the third token's KV: the quantized model's
    assert not torch.equal(cache.layers[1].sink_k.data[:, :, 2:], whole[:, :, 2:])
    one = random_prompt(1, seed=6)
    _, _, a = prefilled(quantized, shape, node("full_precision"), one)
    _, _, b = prefilled(quantized, shape, node("model"), one)
    assert torch.equal(a, b)


def test_generation_runs_and_leaves_the_quantized_weights(models):
    quantized, _, shape = models
    before = block_weights(quantized)
    runner = loaded(quantized, shape).runner(build_method(node("full_precision")))
    gen = runner.generate(random_prompt(20, seed=7), max_new_tokens=6)
    assert len(gen.token_ids) == 6
    assert all(torch.equal(a, b) for a, b in zip(before, block_weights(quantized), strict=True))
    with pytest.raises(ValueError, match="prefill='batch'"):
        runner.generate_batch([random_prompt(20), random_prompt(12)], 4, prefill="batch")


def test_swapped_in_restores_the_quantized_weights_on_error(models):
    quantized, full, _ = models
    kept = loaded_weights(quantized)
    module, original = kept.kept[0]
    quantized_data = module.weight.data
    name = next(n for n, m in quantized.named_modules() if m is module)
    assert torch.equal(original, full.get_submodule(name).weight)
    assert not torch.equal(original, quantized_data)
    with pytest.raises(RuntimeError, match="inside"):
        with kept.swapped_in():
            assert module.weight.data_ptr() == original.data_ptr()
            raise RuntimeError("inside")
    assert module.weight.data_ptr() == quantized_data.data_ptr()
    assert loaded_weights(full) is None


def test_full_precision_pivot_needs_a_weight_quantized_model(models):
    _, full, shape = models
    with pytest.raises(ConfigError, match=r"^method\.pivot='full_precision': .*model\.weight_quant"):
        loaded(full, shape).runner(build_method(node("full_precision")))
    # pivot=model prepares on any model
    loaded(full, shape).runner(build_method(node("model")))


@pytest.mark.parametrize("value", ["fp16", "full", "Model"])
def test_bad_pivot_names_the_choices(value):
    with pytest.raises(ConfigError, match=rf"^method\.pivot='{value}': allowed: model, full_precision$"):
        build_method({**node("model"), "pivot": value})
    with pytest.raises(ConfigError, match=r"^method\.pivot="):
        build_method({**node("model"), "pivot": None})
