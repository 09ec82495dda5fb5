"""Activation patching: each batched patch, started from the cached residual at its layer, equals a plain forward
with that one patch (float64, within 1e-10) on every site and grouping; TransformerLens 4.3's ``patching`` gives the
same values on the same folder (float32, within 1e-4 of the largest), GPT-2 and a grouped-query Llama, and the two
real models (SmolLM2's 30 layers of 9 heads over 3 KV heads, Gemma 3's 18 of 4 over 1)."""
import itertools

import pytest
import torch

from selfattn.interp import hooks, logit_diff, patch, run_with_cache
from selfattn.interp.patching import BY, SITES

from helpers.families import build, tokens
from helpers.gpt2 import gpt2_folder
from helpers.models import VARIANTS, scrambled, small

EXACT = 1e-10


def one_patch(model, corrupt_ids, cache, metric, site, by, index):
    """The metric of one forward of ``corrupt_ids`` with the clean values at ``index`` = (layer, *rest) of ``by``."""
    spec, layer, rest = SITES[site], index[0], index[1:]
    name = spec.name(layer)

    def put(x, n):
        at = [slice(None)] * x.dim()
        axes = {"layer": [], "position": [spec.positions], "head": [spec.heads],
                "head,position": [spec.positions, spec.heads]}[by]
        for axis, i in zip(axes, rest):
            at[axis] = i
        x = x.clone()
        x[tuple(at)] = cache[name][tuple(at)]
        return x

    with torch.no_grad(), hooks(model, {name.__eq__: put}):  # a predicate: no dry run to check the name
        return metric(model(corrupt_ids)[0])


def reference(model, corrupt_ids, cache, metric, site, by, shape, shift=0):
    """Every patch as its own forward; ``shift`` moves each to another layer (a wrong reference)."""
    out = torch.empty(shape, dtype=torch.float64)
    L = len(model.blocks)
    for index in itertools.product(*map(range, shape)):
        out[index] = one_patch(model, corrupt_ids, cache, metric, site, by, ((index[0] + shift) % L, *index[1:]))
    return out


EVERY = [(site, by) for site, by in itertools.product(SITES, BY) if "head" not in by or SITES[site].heads is not None]
SOME = [("resid_mid", "position"), ("mlp_out", "layer"), ("result", "head"), ("k", "head,position"),
        ("pattern", "head,position")]


@pytest.mark.parametrize("variant, pairs", [("learned", EVERY), ("llama-shaped", EVERY), ("gemma-shaped", SOME),
                                            ("post-norm-experts-sinks", SOME)], ids=lambda v: v if isinstance(v, str)
                         else "every" if v is EVERY else "some")
def test_each_batched_patch_equals_a_forward_with_that_one_patch(variant, pairs):
    model = scrambled(small(**VARIANTS[variant])).double()
    clean_ids, corrupt_ids = torch.randint(0, 61, (2, 5)), torch.randint(0, 61, (2, 5))
    _, cache = run_with_cache(model, clean_ids)
    metric = logit_diff(torch.tensor([3, 5]), 7)
    worst = 0.0
    for site, by in pairs:
        ours = patch(model, corrupt_ids, cache, metric, site=site, by=by, batch_size=5)  # chunks of 5 patches
        expected = reference(model, corrupt_ids, cache, metric, site, by, ours.shape)
        worst = max(worst, (ours - expected).abs().amax().item())
        assert (ours - expected).abs().amax() < EXACT, (site, by)
    print(f"{variant}: largest difference from one forward per patch {worst:.1e}")
    # negative control: the comparison sees a patch at the wrong layer
    ours = patch(model, corrupt_ids, cache, metric, site="z", by="head")
    assert (ours - reference(model, corrupt_ids, cache, metric, "z", "head", ours.shape, shift=1)).abs().amax() > 1e-3


def test_kv_are_patched_by_kv_head_and_hooks_outside_still_apply():
    model = scrambled(small(pos="rope", n_kv_head=2)).double()
    clean_ids, corrupt_ids = torch.randint(0, 61, (1, 6)), torch.randint(0, 61, (1, 6))
    _, cache = run_with_cache(model, clean_ids)
    metric = logit_diff(3, 7)
    assert patch(model, corrupt_ids, cache, metric, site="k", by="head").shape == (2, 2)  # Hkv = 2 (#980)
    assert patch(model, corrupt_ids, cache, metric, site="q", by="head,position").shape == (2, 6, 4)
    ablate = {"blocks.1.attn.hook_z": lambda z, n: z * 0.5}
    plain = patch(model, corrupt_ids, cache, metric, site="v", by="head,position")
    with hooks(model, ablate):
        ours = patch(model, corrupt_ids, cache, metric, site="v", by="head,position")
        expected = reference(model, corrupt_ids, cache, metric, "v", "head,position", ours.shape)
    assert (ours - expected).abs().amax() < EXACT and (ours - plain).abs().amax() > 1e-3


def test_bad_requests_are_refused_naming_the_values():
    model = scrambled(small())
    clean_ids, corrupt_ids = torch.randint(0, 61, (1, 7)), torch.randint(0, 61, (1, 9))
    _, cache = run_with_cache(model, clean_ids)
    metric = logit_diff(3, 7)
    with pytest.raises(ValueError, match=r"clean prompt has 7 positions and the corrupted one 9"):
        patch(model, corrupt_ids, cache, metric, site="z", by="head")
    corrupt_ids = corrupt_ids[:, :7]
    with pytest.raises(ValueError, match=r"'resid_pre' has no heads.*by='head'"):
        patch(model, corrupt_ids, cache, metric, site="resid_pre", by="head")
    with pytest.raises(ValueError, match=r"site must be one of.*'hook_z'"):
        patch(model, corrupt_ids, cache, metric, site="hook_z", by="head")
    with pytest.raises(ValueError, match=r"by must be one of.*'heads'"):
        patch(model, corrupt_ids, cache, metric, site="z", by="heads")
    with pytest.raises(ValueError, match=r"to one value a patch, shape \(4,\), got \(\)"):  # a TransformerLens metric
        patch(model, corrupt_ids, cache, lambda logits: (logits[:, -1, 3] - logits[:, -1, 5]).mean(), site="z",
              by="head")
    with pytest.raises(ValueError, match=r"no 'blocks\.0\.attn\.hook_z'"):
        patch(model, corrupt_ids, {"blocks.0.hook_resid_pre": cache["blocks.0.hook_resid_pre"]}, metric, site="z",
              by="head")
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        patch(model, corrupt_ids, cache, metric, site="z", by="head", batch_size=0)
    attention_only = scrambled(small(mlp=False))
    with pytest.raises(ValueError, match=r"no site 'blocks\.0\.hook_mlp_out'"):
        patch(attention_only, corrupt_ids, run_with_cache(attention_only, clean_ids)[1], metric, site="mlp_out")


# TransformerLens's function -> our site and grouping (its pattern by position is (L, H, T), ours (L, T, H))
TL = {"get_act_patch_resid_pre": ("resid_pre", "position"), "get_act_patch_resid_mid": ("resid_mid", "position"),
      "get_act_patch_attn_out": ("attn_out", "position"), "get_act_patch_mlp_out": ("mlp_out", "position"),
      "get_act_patch_attn_head_out_by_pos": ("z", "head,position"),
      "get_act_patch_attn_head_out_all_pos": ("z", "head"), "get_act_patch_attn_head_q_all_pos": ("q", "head"),
      "get_act_patch_attn_head_k_by_pos": ("k", "head,position"),
      "get_act_patch_attn_head_v_by_pos": ("v", "head,position"),
      "get_act_patch_attn_head_k_all_pos": ("k", "head"), "get_act_patch_attn_head_v_all_pos": ("v", "head"),
      "get_act_patch_attn_head_pattern_all_pos": ("pattern", "head"),
      "get_act_patch_attn_head_pattern_by_pos": ("pattern", "head,position")}


@pytest.mark.slow  # make check leaves it out: TransformerLens boots each family
@pytest.mark.parametrize("case", ["gpt2", "llama-llama3-rope"])  # the Llama is grouped-query: 4 heads, 2 KV heads
def test_patching_equals_transformer_lens(case, tmp_path):
    from selfattn.io import loading

    if case == "gpt2":
        gpt2_folder(tmp_path, n_layer=2, n_head=4, n_embd=64)
    else:
        build(case).save_pretrained(tmp_path)
    worst = agrees_with_transformer_lens(loading.load(tmp_path).model.eval(), tmp_path, TL)
    print(f"{case}: {len(TL)} of TransformerLens's patching functions, largest difference {worst:.1e} of the largest")


# the sweeps over every head (one forward each in TransformerLens) and over positions, k by KV head
REAL = ["get_act_patch_attn_head_out_all_pos", "get_act_patch_attn_head_k_all_pos", "get_act_patch_resid_pre"]


def test_patching_equals_transformer_lens_on_the_real_models(real):
    name, folder, ours = real
    worst = agrees_with_transformer_lens(ours, folder, {f: TL[f] for f in REAL})
    print(f"{name}: {', '.join(REAL)}: largest difference {worst:.1e} of the largest")


def agrees_with_transformer_lens(ours, folder, functions: dict) -> float:
    """Asserts that each of TransformerLens's patching ``functions`` (name -> our site and grouping) on
    ``folder`` gives our ``patch``'s values within 1e-4 of the largest; returns the largest difference."""
    from interp.test_transformer_lens import bridge
    from transformer_lens import patching

    theirs = bridge(folder)
    clean_ids, corrupt_ids = tokens(2, 5, 1), tokens(2, 5, 2)
    metric = logit_diff(torch.tensor([3, 5]), 7)  # over the leading axes: a scalar for their (B, T, V)
    with torch.no_grad():
        _, cache = run_with_cache(ours, clean_ids)
        _, their_cache = theirs.run_with_cache(clean_ids)
    worst = 0.0
    for function, (site, by) in functions.items():
        with torch.no_grad():
            expected = getattr(patching, function)(theirs, corrupt_ids, their_cache, metric)
        got = patch(ours, corrupt_ids, cache, metric, site=site, by=by)
        got = got.transpose(1, 2) if function.endswith("pattern_by_pos") else got
        assert got.shape == expected.shape, function
        error = ((got - expected).abs().amax() / expected.abs().amax().clamp(min=1)).item()
        worst = max(worst, error)
        assert error < 1e-4, function
    return worst
