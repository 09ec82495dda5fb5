"""Every family a folder can hold computes what ``transformers`` computes, option by option.

Each case builds the ``transformers`` model of a small random config with every option of its
family on (a window shorter than the sequences, GQA, RoPE scaling, soft-caps, sinks, experts),
eager attention, every weight scrambled so a misplaced tensor shows; saves it; loads the folder
here; and asserts: float32 logits over 80 tokens within 1e-4; greedy generation of 32 tokens
through our caches (rolling for windowed layers) identical to ``generate(do_sample=False)``; a
left-padded batch of prompts of different lengths equal row by row; bfloat16 logits within the
rule the low-precision backend tests use (error to float64 at most twice ``transformers``'
own bfloat16 error, plus a floor). Nothing is downloaded.
"""
import pytest
import torch

from selfattn.generation import generate
from selfattn.io import loading

from helpers.families import CASES, T, assert_greedy_as_transformers, build, tokens


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    hf = build(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return request.param, hf, folder, loading.load(folder).model.eval()


def test_logits_match_transformers(family):
    name, hf, _, ours = family
    idx = tokens(2, T, 1)
    with torch.no_grad():
        expected, got = hf(idx).logits, ours(idx)[0]
    assert expected.abs().amax() > 1  # logits large enough for the tolerance to mean something
    diff = (got - expected).abs().amax().item()
    print(f"{name}: max |logit difference| {diff:.1e} over 2 x {T} positions")
    assert diff < 1e-4


def test_greedy_generation_through_the_caches_matches_transformers(family):
    _, hf, _, ours = family
    assert_greedy_as_transformers(hf, ours, tokens(2, 24, 2), 32)


def test_a_left_padded_batch_generates_as_transformers_row_by_row(family):
    _, hf, _, ours = family
    lengths = [20, 13, 7]
    idx, mask = torch.zeros(3, 20, dtype=torch.long), torch.zeros(3, 20, dtype=torch.long)
    for row, n in enumerate(lengths):
        idx[row, 20 - n:], mask[row, 20 - n:] = tokens(1, n, 10 + row), 1
    theirs = hf.generate(idx, attention_mask=mask, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                         pad_token_id=0)[:, 20:]
    got = torch.stack(list(generate(ours, idx, 12, temperature=0, attention_mask=mask)), 1)  # (3, 12)
    assert torch.equal(got, theirs), (got, theirs)


def test_bfloat16_logits_keep_the_low_precision_rule(family):
    name, _, folder, ours = family
    idx = tokens(1, 48, 3)
    with torch.no_grad():
        exact = build(name, torch.float64)(idx).logits
        theirs = build(name, torch.bfloat16)(idx).logits.double()
        got = ours.to(torch.bfloat16)(idx)[0].double()
    ours.float()
    error, reference = (got - exact).abs().amax().item(), (theirs - exact).abs().amax().item()
    print(f"{name}: bfloat16 max |logit error| ours {error:.3f}, transformers' {reference:.3f}")
    assert error <= 2 * reference + 0.02 * exact.abs().amax().item()
