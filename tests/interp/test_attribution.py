"""The residual stream's exact decomposition, the logit lens and direct logit attribution, on every family.

In float64 the sums hold within 1e-12 relative: the stream entering the final norm is the embeddings plus
every layer's ``hook_attn_out`` and ``hook_mlp_out``; the attention's output (``hook_attn_out``, or the post
norm's input ``ln1_post.hook_in`` in sandwich and post-norm models) is its heads' ``hook_result`` plus the
projection's bias; direct logit attribution's parts sum to the logit (before a final soft-cap).
"""
import copy

import pytest
import torch

from selfattn.interp import direct_logit_attribution, logit_lens, run_with_cache
from selfattn.taps import affine

from helpers.families import tokens

EXACT = 1e-12


def relative_error(total: torch.Tensor, parts: list[torch.Tensor]) -> float:
    """|total - sum(parts)| over |total|, the largest of each."""
    return ((total - sum(parts)).abs().amax() / total.abs().amax()).item()


@pytest.fixture(scope="module")
def exact(family):
    """(name, float64 copy of the family's model, its logits and full cache on two rows of 24 tokens)."""
    name, _, model = family
    model = copy.deepcopy(model).double()
    logits, cache = run_with_cache(model, tokens(2, 24, 4))
    return name, model, logits, cache


def attention_output(model, cache, i: int) -> str:
    """The site holding layer i's attention output before any post norm."""
    return f"blocks.{i}.ln1_post.hook_in" if f"blocks.{i}.ln1_post.hook_in" in cache else f"blocks.{i}.hook_attn_out"


def test_the_residual_stream_is_the_sum_of_its_parts(exact):
    name, model, _, cache = exact
    L = len(model.blocks)
    parts = [cache["blocks.0.hook_resid_pre"]] + [cache[f"blocks.{i}.hook_{s}_out"] for i in range(L)
                                                  for s in ("attn", "mlp")]
    errors = {"resid_post": relative_error(cache[f"blocks.{L - 1}.hook_resid_post"], parts)}
    if model.ln_emb is None:
        embed = [cache["hook_embed"]] + ([cache["hook_pos_embed"]] if model.wpe is not None else [])
        errors["embeddings"] = relative_error(cache["blocks.0.hook_resid_pre"], embed)
    for i, block in enumerate(model.blocks):
        bias = [] if block.attn.proj.bias is None else [block.attn.proj.bias]
        errors[f"attn {i}"] = relative_error(cache[attention_output(model, cache, i)],
                                             [cache[f"blocks.{i}.attn.hook_result"].sum(2)] + bias)
    print(f"{name}: largest relative error of the sums {max(errors.values()):.1e}")
    assert max(errors.values()) < EXACT, errors
    # negative control: the checker sees a part left out
    assert relative_error(cache[f"blocks.{L - 1}.hook_resid_post"], parts[:-1]) > 1e-6


def test_the_last_layer_of_the_logit_lens_is_the_logits(family):
    name, _, model = family  # float32, bitwise
    idx = tokens(2, 24, 5)
    logits, cache = run_with_cache(model, idx)
    lens = logit_lens(model, cache)
    assert lens.shape == (len(model.blocks), 2, 24, model.config.vocab_size)
    assert torch.equal(lens[-1], logits)  # TransformerLens's #523
    assert not torch.equal(lens[0], logits)
    # negative control, TransformerLens's #1076: layer 0 through the final norm frozen at the last layer's scale
    centres, weight, bias = affine(model.ln_f)
    resid = cache["blocks.0.hook_resid_post"]
    resid = resid - resid.mean(-1, keepdim=True) if centres else resid
    frozen = resid / cache["ln_final.hook_scale"] * weight + (0 if bias is None else bias)
    assert (model.logits(frozen) - lens[0]).abs().amax() > 1e-3


@pytest.mark.parametrize("wrong", [None, 7])
def test_direct_logit_attribution_sums_to_the_logit(exact, wrong):
    name, model, _, cache = exact
    answer = torch.tensor([[3], [11]])  # one answer per row, every position
    parts = direct_logit_attribution(model, cache, answer, wrong)
    L, H = len(model.blocks), model.blocks[0].attn.n_head
    assert parts.values.shape == (len(parts.labels), 2, 24)
    assert sum(label.startswith("L0H") for label in parts.labels) == H and "embed" in parts.labels
    resid = cache[f"blocks.{L - 1}.hook_resid_post"]
    uncapped = model.lm_head(model.ln_f(resid))  # (B, T, V) the logits before a soft-cap
    expected = uncapped.gather(-1, answer.expand(2, 24)[..., None])[..., 0]
    if wrong is not None:
        expected = expected - uncapped[..., wrong]
    error = relative_error(expected, list(parts.values))
    print(f"{name}: {len(parts.labels)} parts, relative error of their sum {error:.1e}")
    assert error < EXACT
    assert relative_error(expected, list(parts.values[1:])) > 1e-6  # negative control: a part left out


def test_bad_answers_and_caches_are_refused():
    from helpers.models import scrambled, small

    model = scrambled(small())
    _, cache = run_with_cache(model, torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"\[0, 61\)"):
        direct_logit_attribution(model, cache, 61)
    with pytest.raises(TypeError, match="ids"):
        direct_logit_attribution(model, cache, 1.5)
    with pytest.raises(ValueError, match="hook_resid_post"):
        logit_lens(model, {k: v for k, v in cache.items() if "resid_post" not in k})
