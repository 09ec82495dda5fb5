"""The foundation: our SelfAttention is the seed's module, bit for bit, with its defects fixed."""
import subprocess
import sys

import pytest
import torch

from benchmarks.peers import SeedSelfAttention
from selfattn import SelfAttention
from selfattn.analysis.worked_example import worked_example as demo_text


@pytest.mark.parametrize("module", [SelfAttention, SeedSelfAttention])
def test_worked_example_reproduces_exactly(module):
    """The seed document's script, on our module and on the seed's own (the benchmark peer)."""
    torch.manual_seed(0)
    attn = module(8, 2)
    x = torch.randn(1, 4, 8)
    y1 = attn(x)
    x2 = x.clone()
    x2[0, 2] = torch.randn(8)
    y2 = attn(x2)
    assert tuple(y1.shape) == (1, 4, 8)
    assert sum(p.numel() for p in attn.parameters()) == 256
    assert (y1[0, :2] - y2[0, :2]).abs().max().item() == 0.0
    assert round((y1[0, 2:] - y2[0, 2:]).abs().max().item(), 4) == 0.3175


def test_same_random_draws_as_the_seed():
    torch.manual_seed(0)
    seed = SeedSelfAttention(8, 2)
    after_seed = torch.rand(3)
    torch.manual_seed(0)
    ours = SelfAttention(8, 2)
    assert torch.equal(torch.rand(3), after_seed)  # the generator advanced identically
    for name, p in seed.state_dict().items():
        assert torch.equal(ours.state_dict()[name], p)


@pytest.mark.parametrize("C,H", [(8, 2), (12, 3), (16, 1), (32, 8), (6, 6)])
def test_identical_to_seed_module_on_random_configs(C, H):
    g = torch.Generator().manual_seed(C * 100 + H)
    seed = SeedSelfAttention(C, H)
    ours = SelfAttention(C, H, backend="math")
    ours.load_state_dict(seed.state_dict())  # the seed's weights load unchanged
    for B in (1, 2, 3):
        for T in (1, 2, 7, 16, 33):
            x = torch.randn(B, T, C, generator=g)
            assert torch.equal(ours(x), seed(x)), (B, T)  # bitwise
    auto = SelfAttention(C, H)
    auto.load_state_dict(seed.state_dict())
    x = torch.randn(2, 33, C, generator=g)
    torch.testing.assert_close(auto(x), seed(x), rtol=1e-5, atol=1e-6)  # fused kernel: same math, other rounding


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
def test_perturbing_position_t_moves_only_outputs_from_t_on(backend):
    attn = SelfAttention(16, 4, backend=backend)
    x = torch.randn(2, 17, 16)
    y = attn(x)
    for t in range(17):
        x2 = x.clone()
        x2[:, t] += torch.randn(2, 16)
        y2 = attn(x2)
        assert torch.equal(y2[:, :t], y[:, :t]), f"position {t} leaked into earlier outputs"
        assert (y2[:, t] - y[:, t]).abs().min() > 0, f"output at {t} did not move"


def test_parameter_count_is_four_c_squared():
    for C, H in [(8, 2), (64, 4), (96, 12)]:
        assert sum(p.numel() for p in SelfAttention(C, H).parameters()) == 4 * C * C
    assert not SelfAttention(8, 2)._buffers  # no T_max x T_max mask buffer


def test_gradcheck_float64():
    attn = SelfAttention(8, 2, backend="math").double()
    x = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(attn, (x,))


def test_mask_is_built_on_the_input_device():
    attn = SelfAttention(8, 2).to("meta")  # any device that is not the CPU
    y = attn(torch.empty(1, 4, 8, device="meta"))
    assert y.device.type == "meta" and y.shape == (1, 4, 8)


@pytest.mark.parametrize("args,kwargs,error,words", [
    ((10, 3), {}, ValueError, ["n_embd=10", "n_head=3"]),
    ((0, 1), {}, ValueError, ["n_embd", "0"]),
    ((8, -2), {}, ValueError, ["n_head", "-2"]),
    ((8.0, 2), {}, TypeError, ["n_embd", "8.0"]),
    ((8, 2), {"n_kv_head": 3}, ValueError, ["n_head=2", "n_kv_head=3"]),
    ((8, 2), {"backend": "fast"}, ValueError, ["'fast'", "math"]),
    ((8, 2), {"window": 0}, ValueError, ["window", "0"]),
    ((8, 2), {"dropout": 1.5}, ValueError, ["dropout", "1.5"]),
    ((6, 2), {"rope": True}, ValueError, ["head_dim", "3"]),
])
def test_bad_constructor_arguments(args, kwargs, error, words):
    with pytest.raises(error) as info:
        SelfAttention(*args, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("x,error,words", [
    (torch.randn(4, 8), ValueError, ["(B, T, C=8)", "(4, 8)"]),
    (torch.randn(1, 4, 6), ValueError, ["n_embd=8", "6"]),
    (torch.ones(1, 4, 8, dtype=torch.long), TypeError, ["floating", "int64"]),
    ([[0.0] * 8], TypeError, ["tensor", "list"]),
])
def test_bad_inputs(x, error, words):
    with pytest.raises(error) as info:
        SelfAttention(8, 2)(x)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_demo_prints_the_worked_example_live():
    text = demo_text()
    assert "(1, 4, 8)" in text and "256 = 4·8²" in text and "16,777,216" in text
    assert "positions 0-1:      0.0 " in text and "positions 2-3:      0.3175" in text
    other = demo_text(n_embd=16, n_head=4, seq_len=6, seed=3, position=4)
    assert "(1, 6, 16)" in other and "positions 0-3:      0.0 " in other and "0.3175" not in other


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_cli_demo_and_one_line_errors():
    ok = subprocess.run([sys.executable, "-m", "selfattn", "demo"], capture_output=True, text=True)
    assert ok.returncode == 0 and "0.3175" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "selfattn", "demo", "--n-embd", "10", "--n-head", "3"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "n_embd=10" in bad.stderr
    helped = subprocess.run([sys.executable, "-m", "selfattn", "demo", "--help"], capture_output=True, text=True)
    for flag in ("--n-embd", "--n-head", "--seq-len", "--seed", "--position"):
        assert flag in helped.stdout
