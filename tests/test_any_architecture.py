"""Every registered method on every architecture: tiny random-weight Llama, Mistral, Qwen2 (four
query heads per KV head), Gemma-3 (local sliding-window and global layers, RoPE per layer type) and a
head_dim-128 Llama, built from configs (tests/tiny_archs.py; no download, no tokenizer).

Per (model, method): the builder checks and prepares the method on the model, a greedy generation
and a perplexity-style scoring pass run through :class:`kvbench.generate.ModelRunner`, and

- the memory report's FP16 reference is what transformers' own cache holds for the same tokens
  (on Gemma-3 the windows of its local layers, not the whole sequence);
- FP16 (``fp_dtype=auto``) equals plain transformers: greedy tokens, logits, NLLs, cache bytes;
- every method that quantizes or evicts holds less than that reference; FP16 holds exactly it;
- a method may refuse a model only where ``MAY_REFUSE`` allows it, with a one-line ConfigError
  (today nowhere: KVQuant's pre-RoPE keys run on Gemma-3's per-layer-type RoPE too).

The methods come from the registry with the node their class declares for the method contract
(tests/methods/test_method_table.py); eviction methods get a budget below the prompt so they evict.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_archs import CONFIGS, VOCAB, kvbench_logits, loaded, reference, tiny_model

from kvbench.cache.sliding import SlidingWindowLayer
from kvbench.errors import ConfigError
from kvbench.methods import METHODS, build_method
from kvbench.methods.eviction import EvictionMethod

PROMPT = 192  # past KIVI's 128-token residual and SpeCache's 64 + 64 (FP16 on the accelerator)
STEPS = 4

# (arch, case) -> why the method may refuse that model
# (none since KVQuant's pre-RoPE path handles per-layer-type RoPE, kvbench/quant/rope.py)
MAY_REFUSE: dict[tuple[str, str], str] = {}


def method_node(case: str) -> dict:
    if case == "kvquant-pre_rope":
        return {"name": "kvquant", "bits": 2, "calibrate": False, "pre_rope": True, "datatype": "uniform"}
    cls = METHODS.get(case)
    node = {"name": case, **cls.contract_node}
    if issubclass(cls, EvictionMethod):
        node["budget"] = 64
    if case == "kvquant":
        # the online k-means of the nuq codebook takes seconds per layer and does not depend on the
        # architecture (tests/methods/test_kvquant.py covers it)
        node["datatype"] = "uniform"
    return node


CASES = [*METHODS.names(), "kvquant-pre_rope"]


@pytest.fixture(scope="module", params=list(CONFIGS))
def arch(request):
    model, shape = tiny_model(request.param)
    prompt = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    return request.param, model, shape, prompt, reference(model, prompt, STEPS)


def test_fp16_equals_transformers(arch):
    name, model, shape, prompt, ref = arch
    runner = loaded(model, shape).runner(build_method({"name": "fp16", "fp_dtype": "auto"}))
    assert runner.generate(prompt, STEPS).token_ids == ref.tokens
    logits, cache = kvbench_logits(runner, prompt, ref.tokens)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-4, atol=1e-4)
    scored = runner.score(prompt, torch.tensor([ref.tokens]))
    assert scored.nll == pytest.approx(ref.nll(), abs=1e-4) and scored.greedy
    elements, nbytes = ref.held[STEPS]
    assert scored.memory.total_bytes == nbytes and scored.memory.n_values == elements
    windows = [i for i, layer in enumerate(cache.layers) if isinstance(layer, SlidingWindowLayer)]
    assert windows == shape.sliding_layers() == ([0, 2] if name == "gemma3" else [])


@pytest.mark.parametrize("case", CASES)
def test_every_method_runs_on_every_architecture(arch, case):
    name, model, shape, prompt, ref = arch
    try:
        method = build_method(method_node(case))
        runner = loaded(model, shape).runner(method)
    except ConfigError as err:
        assert (name, case) in MAY_REFUSE, f"{case} refused {name}: {err}"
        assert "\n" not in str(err) and str(err).startswith("method.")
        return
    quantizes = method.config.bits is not None
    evicts = isinstance(method, EvictionMethod)

    gen = runner.generate(prompt, STEPS)
    assert len(gen.token_ids) == STEPS and all(0 <= t < VOCAB for t in gen.token_ids)
    scored = runner.score(prompt, torch.tensor([ref.tokens]))
    assert len(scored.nll) == STEPS and all(math.isfinite(x) and x >= 0 for x in scored.nll)

    # generation holds the prompt and every decoded token but the last; scoring all of them
    for memory, fed in ((gen.memory, STEPS - 1), (scored.memory, STEPS)):
        elements, _ = ref.held[fed]
        assert memory.tokens == PROMPT + fed
        assert memory.fp16_bytes == 2 * elements  # the reference is transformers' own cache
        if quantizes or evicts:
            assert memory.total_bytes < memory.fp16_bytes, f"{case} holds FP16 size on {name}"
        else:
            assert memory.total_bytes == memory.fp16_bytes
