"""The hook sites: every site of every family fires, an identity hook changes no bit, an edit flows on,
names are TransformerLens's and checked, backward hooks give autograd's gradients."""
import pytest
import torch

from selfattn.interp import hooks, run_with_cache, sites
from selfattn.self_attention import SelfAttention

from helpers.families import tokens
from helpers.models import scrambled, small

# sites the model computes only to show them (each head's write, the explicit scores and pattern beside a
# fused backend, a norm's statistics): a replacement of any must still reach the logits
SHOWN = ("attn.hook_result", "attn.hook_attn_scores", "attn.hook_pattern", "ln1.hook_scale", "ln1.hook_normalized",
         "attn.q_norm.hook_scale", "mlp.hook_router_logits", "mlp.hook_expert_weights", "ln_final.hook_normalized")


def test_an_identity_hook_on_every_site_leaves_the_logits_bitwise_equal(family):
    name, _, model = family
    idx = tokens(2, 24, 1)
    with torch.no_grad():
        expected = model(idx)[0]
        logits, cache = run_with_cache(model, idx)
        with hooks(model, {lambda n: True: lambda t, n: t}):
            hooked = model(idx)[0]
    assert torch.equal(logits, expected) and torch.equal(hooked, expected)
    assert list(cache) == sites(model) and len(cache) > 15 * len(model.blocks)
    assert model.tap is None  # gone after the block: the model's own code again
    print(f"{name}: {len(cache)} sites")


def test_a_replaced_site_reaches_the_logits(family):  # the negative control of the identity test (PR #1257)
    _, _, model = family
    idx = tokens(1, 24, 2)
    with torch.no_grad():
        expected = model(idx)[0]
        present = [n for n in sites(model) if n.startswith("blocks.1.") and n.endswith(SHOWN) or n in SHOWN]
        assert len(present) >= 5, present
        for site in present:
            with hooks(model, {site: lambda t, n: t * 1.01 if t.is_floating_point() else t.flip(-1)}):
                assert not torch.equal(model(idx)[0], expected), site


def test_an_in_place_edit_counts_as_a_replacement():
    model = scrambled(small(n_kv_head=2))
    idx = torch.randint(0, 61, (1, 9))
    def scale(t, name):
        t.mul_(1.5)  # and no return value

    with torch.no_grad():
        expected = model(idx)[0]
        with hooks(model, {"blocks.0.attn.hook_result": scale}):
            assert not torch.equal(model(idx)[0], expected)


def test_replaced_router_logits_route_each_token_to_the_experts_they_favour():
    model = scrambled(small(mlp_kind="moe", n_experts=4, experts_per_token=2, n_kv_head=2))
    idx = torch.randint(0, 61, (2, 7))
    favour = torch.tensor([0.0, 5.0, 0.0, 4.0])  # experts 1 and 3 above the others

    def route(logits, name):
        return logits + 100 * favour

    with torch.no_grad():
        _, plain = run_with_cache(model, idx, names=lambda n: n.startswith("blocks.0.mlp"))
        _, routed = run_with_cache(model, idx, names=lambda n: n.startswith("blocks.0.mlp"),
                                   fwd={"blocks.0.mlp.hook_router_logits": route})
    assert plain["blocks.0.mlp.hook_router_logits"].shape == (2 * 7, 4)
    assert torch.equal(routed["blocks.0.mlp.hook_expert_indices"].sort(-1).values, torch.tensor([[1, 3]] * 14))
    assert not torch.equal(plain["blocks.0.mlp.hook_expert_indices"].sort(-1).values,
                           torch.tensor([[1, 3]] * 14))  # control: unhooked, the router chooses otherwise


def test_a_wrong_site_name_is_refused_naming_the_nearest():
    model = scrambled(small())
    with pytest.raises(ValueError, match=r"'blocks\.0\.attn\.hook_zz'.*'blocks\.0\.attn\.hook_z'"):
        with hooks(model, {"blocks.0.attn.hook_zz": lambda t, n: None}):
            pass
    with pytest.raises(ValueError, match=r"'blocks\.1\.hook_resid_pst'.*'blocks\.1\.hook_resid_post'"):
        run_with_cache(model, torch.zeros(1, 3, dtype=torch.long), names=["blocks.1.hook_resid_pst"])
    with pytest.raises(TypeError, match="GPT"):
        run_with_cache(torch.nn.Linear(2, 2), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="predicate"):
        with hooks(model, {3: lambda t, n: None}):
            pass


def test_a_cache_of_named_sites_costs_one_forward(monkeypatch):
    """The names are checked against what the forward met, not by a forward of their own."""
    model = scrambled(small())
    calls = []
    forward = type(model).forward
    monkeypatch.setattr(type(model), "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    run_with_cache(model, torch.zeros(1, 3, dtype=torch.long), names=["hook_embed", "blocks.1.hook_resid_post"])
    assert len(calls) == 1
    with pytest.raises(ValueError, match="hook_embedd"):
        run_with_cache(model, torch.zeros(1, 3, dtype=torch.long), names=["hook_embedd"])
    assert len(calls) == 3  # the negative control: a wrong name costs the listing's forward too


def test_run_with_cache_keeps_only_the_asked_sites_where_asked(monkeypatch):
    model = scrambled(small(pos="rope", n_kv_head=2))
    idx = torch.randint(0, 61, (2, 7))
    writes = []
    head_writes = SelfAttention.head_writes
    monkeypatch.setattr(SelfAttention, "head_writes", lambda self, z: writes.append(1) or head_writes(self, z))
    _, cache = run_with_cache(model, idx, names=lambda n: n.endswith("hook_z"), dtype=torch.float64)
    assert list(cache) == ["blocks.0.attn.hook_z", "blocks.1.attn.hook_z"] and not writes  # no head's write computed
    assert cache["blocks.0.attn.hook_z"].dtype == torch.float64 and cache["blocks.0.attn.hook_z"].shape == (2, 7, 4, 8)
    _, cache = run_with_cache(model, idx, names=lambda n: n == "blocks.1.attn.hook_result")  # a predicate: no dry run
    assert list(cache) == ["blocks.1.attn.hook_result"] and cache["blocks.1.attn.hook_result"].shape == (2, 7, 4, 32)
    assert cache["blocks.1.attn.hook_result"].requires_grad is False and len(writes) == 1
    _, cache = run_with_cache(model, idx)
    assert cache["blocks.0.attn.hook_k"].shape == (2, 7, 2, 8)  # grouped-query k and v by KV head
    assert cache["blocks.0.attn.hook_pattern"].shape == (2, 4, 7, 7)


def test_backward_hooks_give_the_gradient_autograd_gives():
    model = scrambled(small(pos="rope", n_kv_head=2, softcap=5.0))
    idx = torch.randint(0, 61, (2, 7))
    names = ["blocks.0.hook_resid_mid", "blocks.1.attn.hook_pattern", "blocks.1.attn.hook_result",
             "blocks.0.ln1.hook_scale"]
    kept, grads = {}, {}
    with hooks(model, {n: lambda t, n: kept.__setitem__(n, t) for n in names},
               bwd={n: lambda g, n: grads.__setitem__(n, g) for n in names}):
        logits, _ = model(idx)
    loss = logits[:, -1].logsumexp(-1).sum()
    expected = torch.autograd.grad(loss, [kept[n] for n in names], retain_graph=True)
    loss.backward()
    for n, e in zip(names, expected):
        assert grads[n].abs().amax() > 0 and torch.equal(grads[n], e), n
    # negative control: a backward hook that zeroes the gradient at the embeddings leaves the embedding without one
    model.zero_grad()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())  # untied: wte's gradient is
    with hooks(model, bwd={"hook_embed": lambda g, n: torch.zeros_like(g)}):
        model(idx)[0].sum().backward()
    assert model.wte.weight.grad.abs().amax() == 0
    model.zero_grad()
    model(idx)[0].sum().backward()
    assert model.wte.weight.grad.abs().amax() > 0
