"""Weight-only int8: each Linear's products equal those of its dequantised weight, the rounding
error is the per-channel bound, and a quantised GPT decodes through its cache as its full forward
computes, close to the float model."""
import pytest
import torch
from torch import nn

from selfattn.generation import generate
from selfattn.generation.int8 import KERNEL_ROWS, Int8Linear, quantize_int8
from selfattn.kernels import matvec

from helpers.models import VARIANTS, scrambled, small


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows", [3, KERNEL_ROWS + 1])  # a kernel, then the dequantised weight
@pytest.mark.parametrize("kernel", ["matvec", "int8pack"])
def test_an_int8_linear_computes_its_dequantised_weight_within_the_rounding_bound(monkeypatch, dtype, rows, kernel):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48).to(dtype)
    if kernel == "int8pack":  # a machine where the matvec kernel does not build
        monkeypatch.setattr(matvec, "failure", lambda isa=None: "no C++ compiler found")
    q = Int8Linear(linear)
    assert q.kernel == kernel
    assert q.q.dtype == torch.int8 and q.q.abs().max() <= 127 and q.scale.shape == (48,)
    w = linear.weight.float()
    dequantised = q.q.float() * q.scale.float()[:, None]
    assert (dequantised - w).abs().max() <= q.scale.float().max() / 2 + 1e-6  # half a step of each row at most
    x = torch.randn(rows, 64, dtype=dtype)
    expected = x.double() @ (q.q.double() * q.scale.to(dtype).double()[:, None]).t() + linear.bias.double()
    rounds = kernel == "int8pack" and rows <= KERNEL_ROWS and dtype != torch.float64  # activations to bfloat16
    tol = 2e-2 if rounds or dtype == torch.bfloat16 else 1e-6
    y = q(x)
    assert y.dtype == dtype and y.shape == (rows, 48)
    assert torch.allclose(y.double(), expected, atol=tol * expected.abs().max().item(), rtol=0)
    if rounds and dtype == torch.float32:  # control: it is int8pack's bf16 rounding that this tolerance allows
        assert not torch.allclose(y.double(), expected, atol=1e-6 * expected.abs().max().item(), rtol=0)


def test_an_int8_linear_takes_the_matvec_kernel_where_it_builds(monkeypatch):
    linear = nn.Linear(64, 48)
    assert Int8Linear(linear).kernel == "matvec"
    monkeypatch.setattr(matvec, "failure", lambda isa=None: "no C++ compiler found")
    assert Int8Linear(linear).kernel == "int8pack"  # control: PyTorch's kernel where it does not


def test_a_weight_stored_in_decode_layout_quantises_to_the_same_rows():  # decode_layout's (in, out) order
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    transposed = nn.Linear(64, 48)
    transposed.load_state_dict(linear.state_dict())
    transposed.weight.data = transposed.weight.data.t().contiguous().t()
    x = torch.randn(3, 64)
    assert torch.equal(Int8Linear(transposed).q, Int8Linear(linear).q)
    assert torch.equal(Int8Linear(transposed)(x), Int8Linear(linear)(x))


def test_a_per_tensor_scale_would_err_more():  # control: per-channel scales are what keep the error small
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    with torch.no_grad():
        linear.weight[:24] *= 100  # rows of very different sizes
    w = linear.weight.float()
    per_channel = Int8Linear(linear)
    per_channel_err = (per_channel.q.float() * per_channel.scale[:, None] - w)[24:].abs().max()
    s = w.abs().max() / 127
    per_tensor_err = (torch.round(w / s) * s - w)[24:].abs().max()
    assert per_tensor_err > 10 * per_channel_err


@pytest.mark.parametrize("variant", ["llama-shaped", "gemma-shaped"])
def test_a_quantised_gpt_decodes_as_its_forward_and_near_the_float_model(variant):
    torch.manual_seed(0)
    model = scrambled(small(**VARIANTS[variant]))
    idx = torch.randint(0, 61, (2, 16))
    with torch.no_grad():
        reference = model(idx)[0]
        quantize_int8(model)
        logits = model(idx)[0]
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert (logits - reference).abs().max() < 0.1 * reference.abs().max()  # close, not equal: int8 rounds
    assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() > 0.9
    cache = model.new_cache(2)
    with torch.no_grad():
        steps = [model(idx[:, :8], cache=cache)[0]] + [model(idx[:, i:i + 1], cache=cache)[0] for i in range(8, 16)]
    torch.testing.assert_close(torch.cat(steps, 1), logits, rtol=0, atol=1e-4)
    tokens = torch.stack(list(generate(model, idx[:, :4], 6, temperature=0)), 1)
    assert tokens.shape == (2, 6)


@pytest.mark.parametrize("tied", [True, False])
def test_a_quantised_gpt_scores_targets_as_the_cross_entropy_of_its_logits(tied):
    model = quantize_int8(scrambled(small(tie_embeddings=tied, logit_softcap=20.0)).eval())
    idx = torch.randint(0, model.config.vocab_size, (4, 20))  # 80 rows: the dequantised weight's products
    targets = torch.randint(0, model.config.vocab_size, (4, 20))
    targets[0, :5] = -100
    with torch.no_grad():
        logits, _ = model(idx)
        _, loss = model(idx, targets)
    expected = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)


def test_quantize_refuses_what_is_not_a_module():
    with pytest.raises(TypeError, match="quantize_int8 expects a torch module, got str"):
        quantize_int8("model")
