"""End to end on the real default model: the cache plumbing changes nothing it should not, and
quantization reaches the model's outputs."""

import pytest
import torch
from transformers import DynamicCache

from kvbench.cache import ATTN_IMPLEMENTATION
from kvbench.generate import ModelRunner
from kvbench.methods import build_method

PROMPT = [{"role": "user", "content": "Name three colours of the rainbow and say one thing about each."}]


@pytest.fixture(scope="module")
def prompt_ids(default_model):
    _, tokenizer, _ = default_model
    ids = tokenizer.apply_chat_template(
        PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    return ids["input_ids"]


def runner_for(default_model, node):
    model, tokenizer, shape = default_model
    return ModelRunner(model, tokenizer, build_method(node), shape)


@torch.no_grad()
def plain_greedy(model, ids, n):
    """Greedy decoding with transformers' own DynamicCache and SDPA, token by token."""
    cache, out = DynamicCache(config=model.config), []
    model.set_attn_implementation("sdpa")
    try:
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits
        for _ in range(n):
            nxt = int(logits[0, -1].argmax())
            out.append(nxt)
            logits = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True).logits
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return out


@pytest.mark.parametrize("fp_dtype", ["auto", "float16"])
def test_fp16_generation_equals_plain_transformers(default_model, prompt_ids, fp_dtype):
    model = default_model[0]
    n = 40
    want = plain_greedy(model, prompt_ids, n)
    got = runner_for(default_model, {"name": "fp16", "fp_dtype": fp_dtype}).generate(prompt_ids, n)
    # the reference ignores EOS; compare up to where ours stopped
    assert got.token_ids == want[: len(got.token_ids)]
    assert len(got.token_ids) >= 20


def test_quantized_cache_reaches_the_outputs(default_model, prompt_ids):
    """A destructive cache (1-bit, no residual to hide behind) changes the generated text; KIVI-4
    with its residual keeps it close to FP16."""
    fp = runner_for(default_model, {"name": "fp16"}).generate(prompt_ids, 24)
    broken = runner_for(default_model, {"name": "uniform", "bits": 1}).generate(prompt_ids, 24)
    assert broken.token_ids[:10] != fp.token_ids[:10]
    assert broken.memory.effective_bits < 2.1
    assert fp.memory.effective_bits == 16.0


def test_scoring_reads_the_quantized_cache(default_model):
    _, tokenizer, _ = default_model
    text = "The quick brown fox jumps over the lazy dog. " * 30
    ids = tokenizer(text, return_tensors="pt").input_ids
    ctx, cont = ids[:, :200], ids[:, 200:216]
    fp = runner_for(default_model, {"name": "fp16"}).score(ctx, cont)
    one_bit = runner_for(default_model, {"name": "uniform", "bits": 1}).score(ctx, cont)
    chunked = runner_for(default_model, {"name": "fp16"}).score(ctx, cont, chunk=16)
    assert len(fp.nll) == len(one_bit.nll) == 16
    assert sum(one_bit.nll) > sum(fp.nll) + 1.0
    # one forward of 16 tokens over an FP16 cache equals 16 single-token forwards up to rounding
    assert chunked.nll == pytest.approx(fp.nll, abs=2e-3)


@pytest.mark.slow
def test_stop_token_ids_and_min_new_tokens(default_model, prompt_ids):
    runner = runner_for(default_model, {"name": "fp16"})
    first = runner.generate(prompt_ids, 2).token_ids[0]
    # the first greedy token declared a stop token ends decoding before anything is emitted ...
    cut = runner.generate(prompt_ids, 2, stop_token_ids=(first,))
    assert cut.token_ids == [] and cut.stopped
    # ... unless stops are barred from the first position, which then takes the runner-up
    barred = runner.generate(prompt_ids, 2, stop_token_ids=(first,), min_new_tokens=1)
    assert barred.token_ids[0] != first and len(barred.token_ids) >= 1
