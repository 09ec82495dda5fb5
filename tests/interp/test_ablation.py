"""Head ablation: the listed heads' hook_z is zero (or their reference mean) and nothing else moves; it equals the
same hooks written by hand, nests with other hooks and goes when the block ends; bad heads are refused by value."""
import pytest
import torch

from selfattn.interp import ablate, hooks, random_heads, run_with_cache

from helpers.models import VARIANTS, scrambled, small


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return scrambled(small(n_layer=3, **VARIANTS["llama-shaped"])).double()  # 3 layers x 4 heads, 2 KV heads


def z_names(name):
    return name.endswith("hook_z")


def test_zero_ablation_zeroes_the_listed_heads_and_only_them(model):
    ids = torch.randint(0, 61, (2, 7))
    before, clean = run_with_cache(model, ids, names=z_names)
    with ablate(model, [(1, 2), (1, 0), (2, 3)]):
        after, cache = run_with_cache(model, ids, names=z_names)
    assert torch.equal(cache["blocks.0.attn.hook_z"], clean["blocks.0.attn.hook_z"])  # below: untouched
    z1 = cache["blocks.1.attn.hook_z"]
    assert (z1[:, :, [0, 2]] == 0).all() and torch.equal(z1[:, :, [1, 3]], clean["blocks.1.attn.hook_z"][:, :, [1, 3]])
    assert (cache["blocks.2.attn.hook_z"][:, :, 3] == 0).all()
    assert not torch.allclose(after, before)

    def by_hand(z, name):  # the same, written with hooks
        z = z.clone()
        z[:, :, {"blocks.1.attn.hook_z": [0, 2], "blocks.2.attn.hook_z": [3]}[name]] = 0
        return z
    with hooks(model, {"blocks.1.attn.hook_z": by_hand, "blocks.2.attn.hook_z": by_hand}):
        expected, _ = model(ids)
    assert torch.equal(after, expected)
    assert torch.equal(model(ids)[0], before)  # gone after the block


def test_mean_ablation_puts_each_heads_reference_mean_at_every_position(model):
    reference, ids = torch.randint(0, 61, (3, 5)), torch.randint(0, 61, (2, 7))
    _, ref = run_with_cache(model, reference, names=z_names)
    with ablate(model, [(0, 1)], mean=ref):
        _, cache = run_with_cache(model, ids, names=z_names)
    expected = ref["blocks.0.attn.hook_z"][:, :, 1].mean(dim=(0, 1))  # (D,)
    assert torch.allclose(cache["blocks.0.attn.hook_z"][:, :, 1], expected.expand(2, 7, -1), rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match=r"blocks\.2\.attn\.hook_z"):
        with ablate(model, [(2, 0)], mean={"blocks.0.attn.hook_z": ref["blocks.0.attn.hook_z"]}):
            pass


def test_nothing_ablated_changes_no_bit_and_ablations_nest_with_hooks(model):
    ids = torch.randint(0, 61, (1, 6))
    plain, _ = model(ids)
    with ablate(model, []):
        assert torch.equal(model(ids)[0], plain)
    seen = []
    with hooks(model, {"blocks.0.attn.hook_z": lambda z, n: seen.append(z.clone())}), ablate(model, [(0, 0)]):
        model(ids)
    assert len(seen) == 1 and (seen[0][:, :, 0] != 0).any()  # the outer hook sees the site before the ablation


def test_bad_heads_are_refused_naming_them(model):
    with pytest.raises(ValueError, match=r"layer 3, head 0.*3 layers .0\.\.2. of 4 heads"):
        with ablate(model, [(3, 0)]):
            pass
    with pytest.raises(ValueError, match="head 4"):
        with ablate(model, [(0, 4)]):
            pass
    with pytest.raises(TypeError, match=r"pairs \(layer, head\)"):
        with ablate(model, [1, 2]):
            pass


def test_random_heads_are_distinct_and_avoid_the_heads_given(model):
    avoid = [(0, 0), (1, 1), (2, 2)]
    drawn = random_heads(model, 9, avoid=avoid, generator=torch.Generator().manual_seed(0))
    assert len(set(drawn)) == 9 and not set(drawn) & set(avoid)
    assert sorted(drawn) == sorted({(l, h) for l in range(3) for h in range(4)} - set(avoid))  # every one left
    with pytest.raises(ValueError, match=r"k must be an int in 0\.\.9"):
        random_heads(model, 10, avoid=avoid)
