"""The chunked head loss equals the plain one: F.cross_entropy on the whole logits."""
import pytest
import torch
import torch.nn.functional as F

from selfattn.loss import head_cross_entropy


def plain(h, weight, targets, softcap=None):
    logits = (h @ weight.T).float() if h.dtype != torch.float64 else h @ weight.T
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, targets, ignore_index=-100)


def case(dtype, N=13, C=8, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    weight = torch.randn(V, C, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    targets = torch.randint(0, V, (N,), generator=g)
    targets[[2, 5]] = -100
    return h, weight, targets


@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("chunk", [1, 4, 13, 100])
def test_equals_the_plain_loss_and_its_gradients(chunk, softcap):
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        h, weight, targets = case(dtype)
        want = plain(h, weight, targets, softcap)
        want_grads = torch.autograd.grad(want, (h, weight))
        got = head_cross_entropy(h, weight, targets, softcap=softcap, chunk=chunk)
        got_grads = torch.autograd.grad(got, (h, weight))
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        for a, b in zip(got_grads, want_grads):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_gradcheck_in_float64():
    h, weight, targets = case(torch.float64, N=6, C=4, V=5)
    assert torch.autograd.gradcheck(lambda a, b: head_cross_entropy(a, b, targets, softcap=3.0, chunk=4) * 2.5,
                                    (h, weight))


def test_a_frozen_head_gets_no_gradient_and_no_grad_mode_computes_none():
    h, weight, targets = case(torch.float32)
    weight.requires_grad_(False)
    loss = head_cross_entropy(h, weight, targets, chunk=3)
    loss.backward()
    assert weight.grad is None and h.grad is not None
    with torch.no_grad():
        torch.testing.assert_close(head_cross_entropy(h, weight, targets), loss.detach())


def test_under_bfloat16_autocast_as_the_plain_loss_under_autocast():
    h, weight, targets = case(torch.float32, N=64, C=32, V=50)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = F.cross_entropy(F.linear(h, weight).float(), targets, ignore_index=-100)
        got = head_cross_entropy(h, weight, targets, chunk=10)
    want_grads = torch.autograd.grad(want, (h, weight))
    got_grads = torch.autograd.grad(got, (h, weight))
    assert got.dtype == torch.float32 and got_grads[1].dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # the same bf16 products, float32 after them
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)  # bf16 products of the gradient, summed otherwise


def test_all_targets_ignored_is_nan_as_cross_entropy():
    h, weight, targets = case(torch.float32)
    targets[:] = -100
    assert head_cross_entropy(h, weight, targets).isnan() and plain(h, weight, targets).isnan()
