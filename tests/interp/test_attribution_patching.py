"""Attribution patching: each estimate is the derivative of the metric along the patch, d/dα metric(corrupt + α·(clean
- corrupt)) at α = 0, taken by autograd through a plain hooked forward (float64, within 1e-10 relative); AtP*'s QK
fix is the pattern's gradient times the exact change of the pattern; Spearman's rank correlation by hand."""
import copy

import pytest
import torch

from selfattn.interp import attribution_patch, hooks, logit_diff, patch, rank_correlation, run_with_cache
from selfattn.interp.patching import BY, SITES

from helpers.families import tokens
from helpers.models import VARIANTS, scrambled, small


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model = scrambled(small(**VARIANTS["llama-shaped"])).double()
    clean_ids, corrupt_ids = torch.randint(0, 61, (2, 6)), torch.randint(0, 61, (2, 6))
    _, clean = run_with_cache(model, clean_ids)
    return model, clean_ids, corrupt_ids, clean, logit_diff(torch.tensor([3, 5]), 7)


def along(model, corrupt_ids, clean, metric, site, by, index, alpha):
    """metric of the corrupted run with the patch ``index`` = (layer, *rest) moved ``alpha`` of the way to clean."""
    spec, layer = SITES[site], index[0]
    name = spec.name(layer)
    axes = {"layer": [], "position": [spec.positions], "head": [spec.heads],
            "head,position": [spec.positions, spec.heads]}[by]

    def move(x, n):
        where = torch.zeros_like(x)
        at = [slice(None)] * x.dim()
        for axis, i in zip(axes, index[1:]):
            at[axis] = i
        where[tuple(at)] = 1
        return x + alpha * where * (clean[name] - x.detach())

    with hooks(model, {name.__eq__: move}):
        return metric(model(corrupt_ids)[0][None])[0]


@pytest.mark.parametrize("site", list(SITES))
def test_each_estimate_is_the_derivative_along_its_patch(case, site):
    model, clean_ids, corrupt_ids, clean, metric = case
    worst = 0.0
    for by in BY:
        if "head" in by and SITES[site].heads is None:
            continue
        ours = attribution_patch(model, clean_ids, corrupt_ids, metric, site=site, by=by)
        assert ours.shape == patch(model, corrupt_ids, clean, metric, site=site, by=by).shape
        for index in [(1,) + (1,) * (ours.dim() - 1), (0,) + (-1,) * (ours.dim() - 1)]:
            alpha = torch.zeros((), dtype=torch.float64, requires_grad=True)
            expected, = torch.autograd.grad(along(model, corrupt_ids, clean, metric, site, by, index, alpha), alpha)
            error = ((ours[index] - expected).abs() / expected.abs().clamp(min=1e-3)).item()
            worst = max(worst, error)
            assert error < 1e-10, (by, index, ours[index].item(), expected.item())
    print(f"{site}: largest relative difference from autograd along the patch {worst:.1e}")


def test_the_estimates_are_the_derivatives_on_the_real_models(real):
    name, _, model = real
    model = copy.deepcopy(model).double()
    clean_ids, corrupt_ids = tokens(1, 6, 1), tokens(1, 6, 2)
    metric = logit_diff(3, 7)
    _, clean = run_with_cache(model, clean_ids)
    L, H = len(model.blocks), model.config.n_head
    worst = 0.0
    for site, by, indices in [("z", "head", [(1, 2), (L - 1, H - 1)]), ("resid_pre", "position", [(L // 2, 3)])]:
        ours = attribution_patch(model, clean_ids, corrupt_ids, metric, site=site, by=by)
        for index in indices:
            alpha = torch.zeros((), dtype=torch.float64, requires_grad=True)
            expected, = torch.autograd.grad(along(model, corrupt_ids, clean, metric, site, by, index, alpha), alpha)
            worst = max(worst, ((ours[index] - expected).abs() / expected.abs().clamp(min=1e-3)).item())
    print(f"{name}: largest relative difference from autograd along the patch {worst:.1e}")
    assert worst < 1e-10


def test_the_derivative_is_the_first_order_of_patching(case):
    """Finite differences agree (a check of the reference), and a wrong index does not (negative control)."""
    model, clean_ids, corrupt_ids, clean, metric = case
    ours = attribution_patch(model, clean_ids, corrupt_ids, metric, site="z", by="head")
    with torch.no_grad():
        h = 1e-5
        difference = (along(model, corrupt_ids, clean, metric, "z", "head", (1, 2), h) -
                      along(model, corrupt_ids, clean, metric, "z", "head", (1, 2), -h)) / (2 * h)
    assert abs(ours[1, 2] - difference) < 1e-7
    assert abs(ours[1, 3] - difference) > 1e-3
    with torch.no_grad():  # alpha = 1 is the exact patch
        exact = patch(model, corrupt_ids, clean, metric, site="z", by="head")
        assert abs(exact[1, 2] - along(model, corrupt_ids, clean, metric, "z", "head", (1, 2), 1.0)) < 1e-10


@pytest.mark.parametrize("site", ["q", "k"])
def test_the_qk_fix_is_the_pattern_gradient_times_the_exact_change_of_the_pattern(case, site):
    model, clean_ids, corrupt_ids, clean, metric = case
    ours = attribution_patch(model, clean_ids, corrupt_ids, metric, site=site, by="head,position", qk_fix=True)
    pattern, grad = {}, {}
    with hooks(model, {"blocks.1.attn.hook_pattern": lambda t, n: pattern.__setitem__(0, t)},
               bwd={"blocks.1.attn.hook_pattern": lambda g, n: grad.__setitem__(0, g)}):
        metric(model(corrupt_ids)[0][None])[0].backward()
    layer, position, head = 1, 5, 1  # the last layer's patch reaches the metric at the last position only
    name = SITES[site].name(layer)

    def put(x, n):
        x = x.clone()
        x[:, position, head] = clean[name][:, position, head]
        return x

    keep = {name: put, "blocks.1.attn.hook_pattern": lambda t, n: pattern.__setitem__(1, t)}
    with torch.no_grad(), hooks(model, keep):
        model(corrupt_ids)
    expected = ((pattern[1] - pattern[0].detach()) * grad[0]).sum()
    assert abs(ours[layer, position, head] - expected) < 1e-10 * max(1.0, abs(expected.item()))
    assert ours[layer, position, head] != ours[layer, position, 0]
    plain = attribution_patch(model, clean_ids, corrupt_ids, metric, site=site, by="head,position")
    exact = patch(model, corrupt_ids, clean, metric, site=site, by="head,position") - \
        metric(model(corrupt_ids)[0][None])[0].detach()
    print(f"{site}: rank correlation with exact patching: AtP {rank_correlation(plain, exact):.2f}, "
          f"AtP* {rank_correlation(ours, exact):.2f}; mean error AtP {(plain - exact).abs().mean():.3f}, "
          f"AtP* {(ours - exact).abs().mean():.3f}")


def test_attribution_correlates_with_exact_patching(case):
    model, clean_ids, corrupt_ids, clean, metric = case
    for site, by in [("z", "head"), ("resid_pre", "position"), ("pattern", "head,position")]:
        exact = patch(model, corrupt_ids, clean, metric, site=site, by=by)
        estimate = attribution_patch(model, clean_ids, corrupt_ids, metric, site=site, by=by)
        rho = rank_correlation(estimate, exact)
        print(f"{site} by {by}: Spearman's rank correlation of attribution and exact patching {rho:.2f}")
        assert rho > 0 or site == "resid_pre"  # a whole token's change at layer 0 is far from first order


def test_rank_correlation_by_hand():
    assert rank_correlation(torch.tensor([1.0, 2, 3, 4]), torch.tensor([10.0, 20, 25, 400])) == pytest.approx(1.0)
    assert rank_correlation(torch.tensor([1.0, 2, 3]), torch.tensor([3.0, 2, 1])) == pytest.approx(-1.0)
    # ties share their mean rank: ranks (1.5, 1.5, 3) against (1, 2, 3) correlate 1.5 / sqrt(1.5 * 2)
    assert rank_correlation(torch.tensor([1.0, 1, 2]), torch.tensor([1.0, 2, 3])) == pytest.approx(1.5 / 3 ** 0.5)
    with pytest.raises(ValueError, match=r"one shape"):
        rank_correlation(torch.ones(3), torch.ones(4))


def test_bad_requests_are_refused(case):
    model, clean_ids, corrupt_ids, clean, metric = case
    with pytest.raises(ValueError, match="clean prompt has 6 positions and the corrupted one 4"):
        attribution_patch(model, clean_ids, corrupt_ids[:, :4], metric, site="z", by="head")
    with pytest.raises(ValueError, match="qk_fix.*not 'z'"):
        attribution_patch(model, clean_ids, corrupt_ids, metric, site="z", by="head", qk_fix=True)
