"""Speculative decoding on real families' folders: ``transformers``' models saved and loaded
into the one decoder generate, greedy, token for token what plain greedy decoding generates,
with each drafter, past the window of their sliding layers (rolling caches rolled back)."""
import pytest
import torch

from selfattn.generation import generate, speculative
from selfattn.generation.speculative import Speculative
from selfattn.io import loading

from helpers.families import W, build, tokens

FAMILIES = ["llama-llama3-rope", "mistral", "gemma3", "gpt-oss"]  # full, rolling, mixed windows, sinks + experts


def ours(case, tmp_path_factory):
    folder = tmp_path_factory.mktemp(case)
    build(case).save_pretrained(folder)
    return loading.load(folder).model.eval()


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """Another family of the same vocabulary as every target's: OLMo 2."""
    return ours("olmo2", tmp_path_factory)


@pytest.mark.parametrize("case", FAMILIES)
def test_greedy_speculation_on_a_family_yields_plain_greedy_tokens(case, draft, tmp_path_factory, monkeypatch):
    model = ours(case, tmp_path_factory)
    idx = tokens(2, 6, 3).repeat(1, 2)  # (2, 12) a repeated stretch for prompt lookup to find
    steps = W + 8  # 12 + 24 positions: past the window of the sliding layers
    plain = torch.stack(list(generate(model, idx, steps, temperature=0)), 1)
    assert len(set(plain.flatten().tolist())) > 3  # not a degenerate repetition of one token
    for method in ("lookup", "self:1", draft):
        spec = Speculative(method, k=3, ngram=1)  # lookup drafts on random text too
        got = torch.stack(list(generate(model, idx, steps, temperature=0, speculative=spec)), 1)
        assert torch.equal(got, plain), (case, spec, got, plain)
        assert spec.stats.drafted > 0 and spec.stats.forwards <= steps
    monkeypatch.setattr(speculative, "_verdicts", lambda p, q, sample: torch.ones_like(p, dtype=torch.bool))
    wrong = torch.stack(list(generate(model, idx, steps, temperature=0, speculative="self:1")), 1)
    assert not torch.equal(wrong, plain)  # negative control: accepting every draft shows
