"""kvbench.quant.rope: per-layer RoPE specs read from transformers configs (default, linear, llama3,
per layer type), equal to the frequencies transformers computes, and the default type unchanged."""

import math

import pytest
import torch

from kvbench.models import ModelShape, shape_of_config
from kvbench.quant.rope import RoPESpec, cos_sin, inv_freq, layer_rope, pre_rope_problem, rope_specs


def _llama(rope_parameters, head_dim=16):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=head_dim,
        rope_parameters=rope_parameters,
    )


LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _gemma3(full=None, sliding=None):
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=100,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": full or {"rope_type": "linear", "rope_theta": 100.0, "factor": 2.0},
            "sliding_attention": sliding or {"rope_type": "default", "rope_theta": 10.0},
        },
    )


def test_default_spec_gives_the_same_tables_as_theta():
    # SmolLM2's RoPE: the spec read from the config turns keys exactly as the theta path always did
    shape = shape_of_config(_llama({"rope_type": "default", "rope_theta": 100000.0}, head_dim=64))
    spec = layer_rope(shape, 1)
    assert spec.rope_type == "default" and spec.dim == 64 and spec.attention_scaling == 1.0
    assert torch.equal(spec.frequencies(), inv_freq(64, 100000.0))
    pos = torch.arange(0, 5000, 7)
    for got, want in zip(spec.cos_sin(pos), cos_sin(pos, 64, 100000.0), strict=True):
        assert torch.equal(got, want)
    assert shape.rope_theta == 100000.0 and pre_rope_problem(shape) is None


def test_a_shape_built_by_hand_means_default_rope_from_theta():
    shape = ModelShape(num_layers=3, num_heads=2, num_kv_heads=2, head_dim=8, rope_theta=10.0)
    assert layer_rope(shape, 2) == RoPESpec.default(8, 10.0)
    assert layer_rope(ModelShape(1, 2, 2, 8), 0) is None
    # the derived field is left out of == (shapes read from configs still equal hand-built ones)
    config = _llama({"rope_type": "default", "rope_theta": 10.0})
    assert shape_of_config(config) == ModelShape(2, 2, 1, 16, config.max_position_embeddings, 10.0)


def test_llama3_frequencies_equal_transformers():
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = _llama(dict(LLAMA3))
    spec = layer_rope(shape_of_config(config), 0)
    reference = LlamaRotaryEmbedding(config)
    assert spec.rope_type == "llama3" and spec.attention_scaling == reference.attention_scaling == 1.0
    assert torch.equal(spec.frequencies(), reference.inv_freq)
    # the scaling did something: the lowest frequency is the default one divided by the factor
    plain = inv_freq(16, 500000.0)
    assert spec.frequencies()[-1].item() == pytest.approx(plain[-1].item() / 8, rel=1e-6)
    assert spec.frequencies()[0].item() == plain[0].item()  # the highest is left alone
    # and cos/sin equal the model's own at far positions
    pos = torch.arange(3000, 3010)
    cos, sin = reference(torch.zeros(1, 1, 10, 16), pos[None])
    got_cos, got_sin = spec.cos_sin(pos)
    assert torch.allclose(got_cos, cos[0], atol=1e-6) and torch.allclose(got_sin, sin[0], atol=1e-6)


def test_linear_frequencies_are_divided_by_the_factor():
    spec = rope_specs(_llama({"rope_type": "linear", "rope_theta": 100.0, "factor": 4.0}, head_dim=4))[0]
    # head_dim 4: w = (1, 100^-1/2) / 4
    assert spec.frequencies().tolist() == pytest.approx([0.25, 0.025])


def test_gemma3_frequencies_per_layer_type():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = _gemma3()
    specs = shape_of_config(config).rope
    assert [s.layer_type for s in specs] == config.layer_types
    assert [s.rope_type for s in specs] == ["default", "default", "linear", "default"]
    # head_dim 4: sliding theta 10 -> (1, 10^-1/2); full theta 100, linear factor 2 -> (1, 0.1) / 2
    assert specs[0].frequencies().tolist() == pytest.approx([1.0, 1 / math.sqrt(10)])
    assert specs[2].frequencies().tolist() == pytest.approx([0.5, 0.05])
    assert specs[0] is specs[1] is specs[3]
    reference = Gemma3RotaryEmbedding(config)
    assert torch.equal(specs[0].frequencies(), reference.sliding_attention_inv_freq)
    assert torch.equal(specs[2].frequencies(), reference.full_attention_inv_freq)
    assert shape_of_config(config).rope_theta is None and pre_rope_problem(shape_of_config(config)) is None


@pytest.mark.parametrize(
    "params, rope_type",
    [
        ({"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}, "dynamic"),
        ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}, "yarn"),
    ],
)
def test_types_pre_rope_cannot_undo_are_named(params, rope_type):
    problem = pre_rope_problem(shape_of_config(_llama(params)))
    assert problem == (
        f"layer 0 uses rope_type={rope_type!r}, which pre-RoPE keys cannot undo "
        "(supported: default, linear, llama3)"
    )


def test_a_refused_layer_type_is_named_with_its_layer():
    config = _gemma3(full={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0})
    problem = pre_rope_problem(shape_of_config(config))
    assert problem.startswith("layer 2 (full_attention) uses rope_type='yarn'")


def test_scaled_cos_sin_and_partial_rotation_are_refused():
    scaled = RoPESpec("linear", (1.0, 0.1), head_dim=4, attention_scaling=1.2)
    assert "scales cos/sin by 1.2" in scaled.pre_rope_problem()
    partial = RoPESpec("default", (1.0,), head_dim=4)
    assert "turns 2 of its 4 key channels" in partial.pre_rope_problem()
    # a partial rotation turns the first channels only (GPT-NeoX layout) where it is applied
    x = torch.tensor([[0.0, 1.0, 5.0, 7.0]])
    out = partial.apply(x, torch.tensor([1]))
    assert out[0, 2:].tolist() == [5.0, 7.0]
    assert out[0, :2].tolist() == pytest.approx([-math.sin(1), math.cos(1)])


def test_unreadable_parameters_are_recorded_not_raised():
    config = _llama(dict(LLAMA3))
    config.rope_parameters = {"rope_type": "llama3", "rope_theta": 10000.0}  # no factor, set after validation
    spec = rope_specs(config)[0]
    assert spec.inv_freq is None and "KeyError" in spec.problem
    assert "parameters kvbench could not read" in spec.pre_rope_problem()


def test_a_model_without_rope():
    from transformers import GPT2Config

    shape = shape_of_config(GPT2Config(n_layer=2, n_embd=32, n_head=2))
    assert shape.rope == (None, None)
    assert "no rotary position embedding" in pre_rope_problem(shape)
