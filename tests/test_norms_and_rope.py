"""The norms and RoPE rules the families use compute what ``transformers`` computes.

Norms bit for bit in float32, bfloat16 and float16 (the order of the weight and the cast is what
tells Llama's RMSNorm from Gemma's and OLMo 2's); RoPE frequencies of every scaling type within
float32 rounding of ``transformers``' own (it computes them in float32, we in float64), with a
negative control per type; partial rotary leaves the other channels alone.
"""
import math

import pytest
import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

from selfattn.norms import Norm, RMSNorm
from selfattn.rope import apply_rope, check_scaling, rope_angles, rope_frequencies, rope_tables, rotate


@pytest.mark.parametrize("theirs, ours", [
    (LlamaRMSNorm, dict()), (Gemma2RMSNorm, dict(offset=1.0, weight_in_float32=True)),
    (Olmo2RMSNorm, dict(weight_in_float32=True)),
])
def test_each_rmsnorm_variant_is_bit_exact_in_every_precision(theirs, ours):
    reference, norm = theirs(64, eps=1e-6), RMSNorm(64, 1e-6, **ours)
    with torch.no_grad():
        reference.weight.normal_()
        norm.weight.copy_(reference.weight)
    x = torch.randn(2, 5, 64) * 3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(norm.to(dtype)(x.to(dtype)), reference.to(dtype)(x.to(dtype))), dtype


def test_the_rounding_order_matters_in_half_precision():  # negative control for the test above
    weight = torch.randn(64)
    gemma_like, llama_like = RMSNorm(64, 1e-6, weight_in_float32=True), RMSNorm(64, 1e-6)
    with torch.no_grad():
        gemma_like.weight.copy_(weight)
        llama_like.weight.copy_(weight)
    x = (torch.randn(8, 64) * 3).bfloat16()
    assert not torch.equal(gemma_like.bfloat16()(x), llama_like.bfloat16()(x))


def test_a_fresh_offset_norm_scales_by_one_and_a_layernorm_refuses_an_offset():
    x = torch.randn(3, 16)
    assert torch.allclose(RMSNorm(16, 1e-6, offset=1.0)(x), RMSNorm(16, 1e-6)(x))
    with pytest.raises(ValueError, match="describe an RMSNorm"):
        Norm("layernorm", offset=1.0)


ROTARY, BASE, MAX = 32, 10000.0, 4096
RULES = {
    "linear": {"factor": 4.0},
    "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "yarn": {"factor": 16.0, "original_max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0},
    "yarn-untruncated": {"factor": 32.0, "original_max_position_embeddings": 512, "truncate": False},
    "yarn-mscale": {"factor": 8.0, "original_max_position_embeddings": 512, "mscale": 0.707, "mscale_all_dim": 0.707},
    "longrope": {"short_factor": [1.0 + i / 8 for i in range(16)], "long_factor": [2.0 + i for i in range(16)],
                 "original_max_position_embeddings": 1024, "factor": 4.0},
}


def _theirs(rope_type: str, params: dict, seq_len: int | None):
    config = PretrainedConfig(hidden_size=ROTARY * 4, num_attention_heads=4, max_position_embeddings=MAX)
    config.rope_parameters = {"rope_type": rope_type, "rope_theta": BASE, **params}
    config.standardize_rope_params = lambda: None
    inv_freq, attention = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", seq_len=seq_len)
    return inv_freq.double(), attention


@pytest.mark.parametrize("name", list(RULES))
@pytest.mark.parametrize("seq_len", [100, 2000])  # longrope: short factors, then long ones
def test_rope_frequencies_of_every_scaling_type_match_transformers(name, seq_len):
    rope_type = name.split("-")[0]
    scaling = check_scaling({"rope_type": rope_type, **RULES[name]}, ROTARY)
    expected, expected_attention = _theirs(rope_type, RULES[name], seq_len)
    got, attention = rope_frequencies(ROTARY, BASE, scaling, seq_len)
    assert torch.allclose(got, expected, rtol=1e-6, atol=0) and math.isclose(attention, expected_attention,
                                                                            rel_tol=1e-6)
    plain, _ = rope_frequencies(ROTARY, BASE, None)
    assert not torch.allclose(plain, expected, rtol=1e-3)  # control: the rule changes the frequencies


def test_partial_rotary_rotates_the_first_channels_only():
    x = torch.randn(1, 2, 5, 16)
    cos, sin = rope_angles(torch.arange(5), 8)  # 8 of 16 channels
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[..., 8:], x[..., 8:]) and not torch.allclose(y[..., 1:, :8], x[..., 1:, :8])
    assert torch.allclose(y[..., :8].norm(dim=-1), x[..., :8].norm(dim=-1), atol=1e-5)  # a rotation


@pytest.mark.parametrize("scaling, words", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type must be one of"),
    ({"rope_type": "linear"}, "needs factor; got no factor"),
    ({"rope_type": "linear", "factor": 2.0, "beta": 1}, "unknown beta"),
    ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0], "original_max_position_embeddings": 8},
     "must hold rotary_dim / 2 = 16 factors, got 1"),
    # a factor of 0 divides by zero, a negative one or inf gives no frequency: each one a NaN or a wrong angle
    ({"rope_type": "linear", "factor": 0}, r"^rope_scaling.factor must be a finite number > 0, got 0$"),
    ({"rope_type": "linear", "factor": -2.0}, r"^rope_scaling.factor must be a finite number > 0, got -2.0$"),
    ({"rope_type": "yarn", "factor": math.inf, "original_max_position_embeddings": 64}, "factor .* got inf"),
    ({"rope_type": "yarn", "factor": -4.0, "original_max_position_embeddings": 64}, "factor .* got -4.0"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}, "original_max_position_embed"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": math.nan}, "beta_fast"),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0,
      "original_max_position_embeddings": 64}, "high_freq_factor must be greater than low_freq_factor"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 15 + [0.0], "long_factor": [1.0] * 16,
      "original_max_position_embeddings": 64}, r"short_factor must be a finite number > 0, got 0.0"),
])
def test_a_rule_rope_cannot_compute_is_refused_naming_it(scaling, words):
    with pytest.raises(ValueError, match=words):
        check_scaling(scaling, ROTARY)


@pytest.mark.parametrize("scaling, words", [
    ({"rope_type": "linear", "factor": "2"}, "rope_scaling.factor must be a number, got str '2'"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "truncate": "no"},
     "rope_scaling.truncate must be True or False"),
    ({"rope_type": "longrope", "short_factor": 1.0, "long_factor": [1.0] * 16, "original_max_position_embeddings": 64},
     "rope_scaling.short_factor must be a list of rotary_dim / 2 = 16 factors, got float 1.0"),
])
def test_a_rule_parameter_of_the_wrong_type_is_a_type_error_naming_it(scaling, words):
    with pytest.raises(TypeError, match=words):
        check_scaling(scaling, ROTARY)


def test_a_factor_below_one_compresses_and_is_computed():  # control: refused are the rules without frequencies
    scaling = check_scaling({"rope_type": "linear", "factor": 0.5}, ROTARY)
    assert torch.allclose(rope_frequencies(ROTARY, BASE, scaling)[0], 2 * rope_frequencies(ROTARY, BASE)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("R", [16, 8])  # every channel, or partial rotary
def test_rotate_is_the_rotate_half_formula_to_the_last_bit(dtype, R):
    x = (torch.randn(2, 3, 7, 16) * 4).to(dtype)
    cos, sin = rope_angles(torch.arange(100, 107), R, 10000.0)  # float64, (1, 1, T, R/2)
    work = torch.float32
    x1, x2 = x[..., :R].to(work).chunk(2, dim=-1)
    c, s = cos.to(work), sin.to(work)
    formula = torch.cat([torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(dtype), x[..., R:]], dim=-1)
    assert torch.equal(rotate(x, *rope_tables(cos, sin, work)), formula)
    assert torch.equal(apply_rope(x, cos, sin), formula)
    wrong_sign = rope_tables(cos, -sin, work)  # control: the rotation the other way
    assert not torch.equal(rotate(x, *wrong_sign), formula)
