"""Per-token RTN activation fake-quantization (``model.act_quant``): the equations on a
hand-computed tensor, the config's checks, the model's identity, the hooks on the block linears, and
the full-precision swap (IntactKV's ``pivot: full_precision``) running the model as loaded."""

from __future__ import annotations

import copy
from dataclasses import asdict

import pytest
import torch
from tiny_archs import VOCAB, tiny_model

from kvbench.config import build_config
from kvbench.errors import ConfigError
from kvbench.models import ModelConfig, converted_dir, model_node
from kvbench.models.act_quant import activation_quant, fake_quantize_activations, rtn_fake_quantize_tokens
from kvbench.models.weight_quant import block_linears, fake_quantize_model, loaded_weights
from kvbench.results import run_id

SMOLLM2 = model_node("smollm2-135m")


def test_rtn_equations_on_a_hand_computed_tensor():
    """2 bits (levels 0..3), one range per token (row):

    [0, 1, 2, 3]:       scale 1, zero 0; q = 0 1 2 3; x' = x
    [-1, .2, .9, 2]:    scale 1, zero round(1) = 1; q = 0 1 2 3; x' = -1 0 1 2
    [-.5, 0, .9, 1]:    scale .5, zero round(1) = 1; x/s = -1 0 1.8 2 -> q = 0 1 3 3; x' = -.5 0 1 1
    [.7, .7, .7, .7]:   no range: kept as is
    [-3, -2.2, -1, 1]:  scale 4/3, zero round(2.25) = 2; x/s = -2.25 -1.65 -.75 .75
                        -> round = -2 -2 -1 1, + 2 = 0 0 1 3; x' = (q - 2) 4/3
    """
    x = torch.tensor(
        [
            [0.0, 1.0, 2.0, 3.0],
            [-1.0, 0.2, 0.9, 2.0],
            [-0.5, 0.0, 0.9, 1.0],
            [0.7, 0.7, 0.7, 0.7],
            [-3.0, -2.2, -1.0, 1.0],
        ]
    )
    s = 4 / 3
    expected = torch.tensor(
        [
            [0.0, 1.0, 2.0, 3.0],
            [-1.0, 0.0, 1.0, 2.0],
            [-0.5, 0.0, 1.0, 1.0],
            [0.7, 0.7, 0.7, 0.7],
            [-2 * s, -2 * s, -1 * s, 1 * s],
        ]
    )
    torch.testing.assert_close(rtn_fake_quantize_tokens(x, 2), expected, rtol=0, atol=1e-6)
    # every leading axis is a token: [B, T, C] is quantized row by row as [B*T, C]
    torch.testing.assert_close(
        rtn_fake_quantize_tokens(x[:4].view(2, 2, 4), 2), expected[:4].view(2, 2, 4), rtol=0, atol=1e-6
    )
    # the dtype is kept, and 8 bits moves no value by more than half a step
    assert rtn_fake_quantize_tokens(x.to(torch.bfloat16), 2).dtype == torch.bfloat16
    assert (rtn_fake_quantize_tokens(x, 8) - x).abs().max() <= 0.5 * 4 / 255 + 1e-6


def _config(weight_quant=None, act_quant=None):
    return build_config(
        ModelConfig, {**SMOLLM2, "weight_quant": weight_quant, "act_quant": act_quant}, "model"
    )


@pytest.mark.parametrize(
    ("value", "key", "allowed"),
    [
        ({"bits": 1}, "model.act_quant.bits", "from 2 to 8"),
        ({"bits": 16}, "model.act_quant.bits", "from 2 to 8"),
        ({"bits": 4.0}, "model.act_quant.bits", "int"),
        ({"bits": True}, "model.act_quant.bits", "int"),
        ({}, "model.act_quant", "needs bits"),
        ({"bits": 8, "group_size": 64}, "model.act_quant.group_size", "allowed: bits"),
        (8, "model.act_quant", "a mapping"),
    ],
)
def test_bad_act_quant_is_one_error_naming_the_key(value, key, allowed):
    with pytest.raises(ConfigError) as err:
        _config(act_quant=value)
    assert str(err.value).startswith(f"{key}=")
    assert allowed in str(err.value)


def test_act_quant_is_the_models_identity_and_null_changes_no_run_id():
    plain = _config()
    wq = _config(weight_quant={"bits": 4, "group_size": 64})
    wa = _config(weight_quant={"bits": 4, "group_size": 64}, act_quant={"bits": 8})
    a_only = _config(act_quant={"bits": 6})
    assert plain.name == "smollm2-135m" and wq.name == "smollm2-135m-rtn-w4g64"
    assert wa.name == "smollm2-135m-rtn-w4g64-a8" and a_only.name == "smollm2-135m-rtn-a6"
    # null: the weight-quantized model's note and name exactly as before the option
    assert "activation" not in wq.weights_note
    assert "RTN activation fake-quantization: 8-bit, per token" in wa.weights_note
    assert "RTN" not in wa.source_weights_note and wa.source_weights_note == plain.weights_note
    # rebuilt from its own fields it keeps one suffix
    for cfg in (wa, a_only):
        assert build_config(ModelConfig, asdict(cfg), "model").name == cfg.name
        assert cfg.source_name == plain.name and converted_dir(cfg) == converted_dir(plain)
    # null is left out of the run id: the runs made before the option keep theirs
    # (the committed model nodes do not carry the key, so their runs' config.json stay byte for byte)
    assert "act_quant" not in SMOLLM2
    without = {"model": dict(SMOLLM2), "bits": None, "seed": 0, "task": {"name": "niah"}}
    base = {**without, "model": {**SMOLLM2, "act_quant": None}}
    assert run_id(base) == run_id(without)
    rtn = {"bits": 4, "group_size": 64}
    w_only = {**base, "model": {**SMOLLM2, "weight_quant": rtn}}
    w_null_a = {**base, "model": {**SMOLLM2, "weight_quant": rtn, "act_quant": None}}
    assert run_id(w_only) == run_id(w_null_a)
    w_a = {**base, "model": {**SMOLLM2, "weight_quant": rtn, "act_quant": {"bits": 8}}}
    assert run_id(w_a) != run_id(w_only)


class _Recorder:
    """The inputs every block linear of a model receives, in call order."""

    def __init__(self, model):
        self.inputs: list[torch.Tensor] = []
        # registered after the quantization's hooks: they see what the layer computes with
        self.handles = [m.register_forward_pre_hook(self._hook) for _, m in block_linears(model)]

    def _hook(self, module, args):
        self.inputs.append(args[0].detach().clone())

    def remove(self):
        for h in self.handles:
            h.remove()


@pytest.fixture(scope="module")
def models():
    """``(w4a4, full, shape)``: the tiny Llama with 4-bit weights (groups of 32) and 4-bit
    activations, and the same model as built."""
    model, shape = tiny_model("llama")
    full = copy.deepcopy(model)
    fake_quantize_model(model, {"bits": 4, "group_size": 32})
    assert fake_quantize_activations(model, {"bits": 4}) == len(block_linears(model))
    return model, full, shape


@torch.no_grad()
def test_every_block_linear_sees_quantized_inputs_and_the_swap_sees_the_loaded_model(models):
    quantized, full, _ = models
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    quant = activation_quant(quantized)
    assert quant is not None and quant.bits == 4 and quant.enabled
    rec = _Recorder(quantized)
    try:
        out = quantized(input_ids=ids).logits
        # each input is on the 4-bit grid of its token: at most 16 distinct values per token row
        assert len(rec.inputs) == len(block_linears(quantized))
        for x in rec.inputs:
            rows = x.reshape(-1, x.shape[-1])
            assert all(len(torch.unique(r)) <= 16 for r in rows)
            torch.testing.assert_close(rtn_fake_quantize_tokens(x, 4), x, rtol=0, atol=1e-5)
        rec.inputs.clear()
        with loaded_weights(quantized).swapped_in():
            assert not quant.enabled
            swapped = quantized(input_ids=ids).logits
        assert quant.enabled
        # inside the swap: the full-precision model, weights and activations as loaded
        torch.testing.assert_close(swapped, full(input_ids=ids).logits, rtol=0, atol=0)
        assert any(len(torch.unique(x.reshape(-1, x.shape[-1])[0])) > 16 for x in rec.inputs)
        assert not torch.allclose(out, swapped, atol=1e-3)
        # and outside it again the W4A4 model, exactly
        assert torch.equal(quantized(input_ids=ids).logits, out)
    finally:
        rec.remove()


@torch.no_grad()
def test_act_quant_alone_is_swappable_and_off_is_bit_identical():
    model, _ = tiny_model("llama")
    plain = copy.deepcopy(model)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    reference = plain(input_ids=ids).logits
    assert fake_quantize_activations(model, None) == 0 and loaded_weights(model) is None
    assert torch.equal(model(input_ids=ids).logits, reference)  # the option off: the model as it was
    fake_quantize_activations(model, {"bits": 3})
    weights = loaded_weights(model)
    assert weights is not None and weights.kept == []
    assert not torch.allclose(model(input_ids=ids).logits, reference, atol=1e-3)
    with pytest.raises(RuntimeError, match="inside"):
        with weights.swapped_in():
            assert torch.equal(model(input_ids=ids).logits, reference)
            raise RuntimeError("inside")
    assert activation_quant(model).enabled
    with pytest.raises(ValueError, match="already quantized"):
        fake_quantize_activations(model, {"bits": 3})
    activation_quant(model).remove()
    assert torch.equal(model(input_ids=ids).logits, reference)
