"""Speculative decoding is lossless: caches roll back exactly; greedy speculation yields plain
greedy's tokens for every model variant and drafter (batched, left-padded, with eos); sampled
speculation draws plain sampling's distribution with every drafter and cache kind (a chi-square
test against the exact law, which accepting every draft fails); the draft length adapts; bad
arguments fail at the call."""
import copy
import itertools
import math
import re
from pathlib import Path

import pytest
import torch

from selfattn.generation import generate, speculative
from selfattn.generation.sampling import probabilities
from selfattn.generation.speculative import Speculative
from selfattn.kv_cache import KVCache, RollingKVCache

from helpers.models import VARIANTS, assert_same_logits, left_pad, scrambled, small

CACHE_KINDS = {**VARIANTS, "window-sinks": {"pos": "rope", "n_kv_head": 2, "window": 4, "sink_tokens": 2}}
METHODS = ["lookup", "self:1", "draft"]


def noisy_copy(model, scale=0.05, seed=0):
    """A draft that agrees with ``model`` often but not always: its weights, perturbed."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return draft


def speculation(name, model, **kw):
    """A :class:`Speculative` of drafter ``name``; prompt lookup drafting after any repeated token
    (``ngram=1``), as it must on a random model's text for the tests to judge drafts."""
    return Speculative(noisy_copy(model) if name == "draft" else name, ngram=1, **kw)


def tokens_of(model, idx, n, **kw):
    """Every step of ``generate(model, ...)`` stacked: ``(B, steps)``."""
    return torch.stack(list(generate(model, idx, n, **kw)), 1)


def repetitive(B, period, repeats, seed=0):
    """Prompts ``(B, period * repeats)`` repeating a random pattern: prompt lookup finds matches."""
    return torch.randint(0, 61, (B, period), generator=torch.Generator().manual_seed(seed)).repeat(1, repeats)


@pytest.mark.parametrize("variant", CACHE_KINDS)
def test_truncating_and_continuing_equals_the_full_forward(variant):
    model = scrambled(small(**CACHE_KINDS[variant]))
    idx = torch.randint(0, 61, (2, 16))
    full, _ = model(idx)
    cache = model.new_cache(2, rollback=3)
    got = [model(idx[:, :5], cache=cache)[0]]
    for t in range(5, 16):  # a verification: the real token and 3 rejected drafts, then rolled back
        chunk = torch.cat([idx[:, t:t + 1], torch.randint(0, 61, (2, 3))], dim=1)
        got.append(model(chunk, cache=cache)[0][:, :1])
        for layer in cache:
            layer.truncate(t + 1)
    assert_same_logits(torch.cat(got, dim=1), full)
    assert all(layer.length == 16 for layer in cache)


def test_a_rolling_cache_without_the_extra_slots_cannot_roll_back():
    model = scrambled(small(**VARIANTS["gqa-window"]))  # window 4
    idx = torch.randint(0, 61, (1, 12))
    full, _ = model(idx)
    cache = model.new_cache(1)  # no rollback slots: three rejected drafts overwrite what the window needs
    model(idx[:, :6], cache=cache)
    model(torch.cat([idx[:, 6:7], torch.randint(0, 61, (1, 3))], dim=1), cache=cache)
    with pytest.raises(ValueError, match="rollback=0 slots holds only 6 on; allocate rollback >= 2"):
        cache[0].truncate(7)
    for layer in cache:  # negative control: forgetting the drafts by the length alone reads overwritten slots
        layer.length = 7
    wrong = model(idx[:, 7:8], cache=cache)[0]
    assert (wrong - full[:, 7:8]).abs().amax() > 1e-3


def test_truncate_bounds():
    ring = RollingKVCache(1, 1, 4, 2, sink_tokens=1, rollback=2)  # 1 sink + 6 ring slots
    ring.append(torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2))
    ring.truncate(0)  # nothing overwritten yet: any length back works
    ring.append(torch.randn(1, 1, 12, 2), torch.randn(1, 1, 12, 2))
    ring.truncate(9)  # back rollback + 1 = 3 positions: the ring holds 6..11, the next query needs 6..8
    assert ring.length == 9 and ring.positions().max() < 9
    ring.append(torch.randn(1, 1, 3, 2), torch.randn(1, 1, 3, 2))
    with pytest.raises(ValueError, match="cannot truncate 12 positions to 8"):
        ring.truncate(8)
    flat = KVCache(1, 1, 8, 2)
    flat.append(torch.randn(1, 1, 5, 2), torch.randn(1, 1, 5, 2))
    flat.truncate(2)
    assert flat.length == 2
    with pytest.raises(ValueError, match="cannot truncate to length=3, it holds only 2"):
        flat.truncate(3)
    with pytest.raises(ValueError, match="length must be a non-negative int, got -1"):
        flat.truncate(-1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("variant", CACHE_KINDS)
def test_greedy_speculation_yields_plain_greedy_tokens(variant, method):
    model = scrambled(small(**CACHE_KINDS[variant]))
    idx = repetitive(3, 4, 2)  # (3, 8): 3 rows, each accepting its own number of drafts
    plain = tokens_of(model, idx, 12, temperature=0)
    spec = speculation(method, model, k=2, max_k=6)
    stream = generate(model, idx, 12, temperature=0, speculative=spec)
    assert iter(stream) is stream
    steps = list(stream)  # one (B,) tensor per step, as without speculation
    assert len(steps) == 12 and all(t.shape == (3,) and t.dtype == torch.long for t in steps)
    assert torch.equal(torch.stack(steps, 1), plain)
    assert spec.stats.tokens == 12 and spec.stats.forwards <= 12 and spec.stats.drafted > 0


@pytest.mark.parametrize("method", METHODS)
def test_accepting_every_draft_is_caught(method, monkeypatch):  # negative control of the test above
    model = scrambled(small(**VARIANTS["rope-gqa-window-bias"]))
    idx = repetitive(3, 4, 2)
    plain = tokens_of(model, idx, 15, temperature=0)
    monkeypatch.setattr(speculative, "_verdicts", lambda p, q, sample: torch.ones_like(p, dtype=torch.bool))
    assert not torch.equal(tokens_of(model, idx, 15, temperature=0, speculative=speculation(method, model)), plain)


def test_a_smaller_draft_of_another_shape():
    model = scrambled(small(**VARIANTS["llama-shaped"]))
    draft = scrambled(small(n_layer=1, n_embd=16, n_head=2, pos="rope"))  # only the vocabulary is shared
    idx = repetitive(2, 3, 2)
    spec = Speculative(draft, k=3)
    assert torch.equal(tokens_of(model, idx, 12, temperature=0, speculative=spec),
                       tokens_of(model, idx, 12, temperature=0))
    assert spec.stats.draft_forwards > 0


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("variant", ["learned", "rope-gqa-window-bias", "llama-shaped"])
def test_left_padded_rows_speculate_as_they_decode(variant, method):
    model = scrambled(small(**VARIANTS[variant]))
    g = torch.Generator().manual_seed(3)
    pattern = [torch.randint(1, 61, (n,), generator=g) for n in (2, 3, 4)]
    idx, mask = left_pad([p.repeat(r) for p, r in zip(pattern, (2, 3, 1))])  # lengths 4, 9, 4
    plain = tokens_of(model, idx, 12, temperature=0, attention_mask=mask)
    got = tokens_of(model, idx, 12, temperature=0, attention_mask=mask, speculative=speculation(method, model))
    assert torch.equal(got, plain)


@pytest.mark.parametrize("method", METHODS)
def test_eos_finishes_rows_and_the_stream_as_plain_decoding(method):
    model = scrambled(small(**VARIANTS["rope"]))
    idx = repetitive(2, 3, 2, seed=4)
    free = tokens_of(model, idx, 12, temperature=0)
    eos = next(t for s, t in enumerate(free[0].tolist()) if s > 0 and t not in free[0, :s] and t not in free[1])
    for prompt in (idx, idx[:1]):  # both rows (one finishes), then one row (the stream ends early)
        plain = tokens_of(model, prompt, 12, temperature=0, eos_token=eos)
        got = tokens_of(model, prompt, 12, temperature=0, eos_token=eos, speculative=speculation(method, model))
        assert torch.equal(got, plain)
    assert plain.shape[1] < 12 and plain[0, -1] == eos


def test_the_draft_length_adapts_to_the_acceptance():
    model = scrambled(small(**VARIANTS["rope-gqa-window-bias"]))  # no position limit: 43 positions
    idx = torch.randint(0, 61, (1, 4))
    perfect = Speculative(copy.deepcopy(model), k=1, max_k=8)  # every draft stands: k = 1, 3, 5, 7, 8, 8, ...
    assert torch.equal(tokens_of(model, idx, 40, temperature=0, speculative=perfect),
                       tokens_of(model, idx, 40, temperature=0))
    # the prefill's token, then rounds of k drafts + 1: 2, 4, 6, 8, 9, 9 tokens (39), and the last one alone
    assert perfect.stats.acceptance_rate == 1.0 and perfect.stats.forwards == 1 + 7
    poor = Speculative(scrambled(small(**VARIANTS["rope-gqa-window-bias"])), k=8, max_k=8)  # an unrelated draft
    list(generate(model, idx, 20, temperature=0, speculative=poor))
    assert poor.stats.accepted == 0 and poor.stats.forwards == 1 + 19  # one token per round
    # a draft model's drafts cost forwards: none of 8 stood in round 1, so k = 1; from k = 1 each miss
    # pauses drafting for 1, 4, 16 rounds: rounds 2, 4 and 9 draft one token, the other 15 are plain steps
    assert poor.stats.drafted == 8 + 3 * 1
    assert poor.stats.draft_forwards == poor.stats.drafted


def test_prompt_lookup_copies_the_longest_agreeing_run_for_as_long_as_it_ran():
    lookup = speculative._Lookup(scrambled(small()), ngram=3, reach=8)
    text = [9, 3, 4, 7, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4]  # "3 4" twice before: the second run is 4 long
    seq = torch.tensor([text + [0] * 8])  # (1, 24) the committed text, then room
    lens, start = torch.tensor([len(text)]), torch.tensor([0])

    def drafts(seq, lens, m):
        rnd = lookup.draft(seq, lens, int(lens.min()) - 1, m, start, None, {})
        return rnd.tokens[rnd.drafted].tolist()

    assert drafts(seq, lens, 9) == [5, 6, 7, 8]  # "1 2 3 4" agreed for 4 tokens: 4 drafts after it
    assert drafts(seq, lens, 3) == [5, 6]  # no more than the round holds
    short = seq.clone()
    short[0, 12] = 0  # the run is now "2 3 4": 3 tokens, still enough
    assert drafts(short, lens, 9) == [5, 6, 7]
    short[0, 13] = 0  # "3 4" twice: shorter than ngram, no draft
    assert drafts(short, lens, 9) == [] and lookup.draft(short, lens, 15, 9, start, None, {}).m == 1
    padded = torch.tensor([[1, 2, 3, 4, 5, 1, 2, 3, 0, 0, 0]])  # left-padded by 3: the text is "4 5 1 2 3"
    rnd = lookup.draft(padded, torch.tensor([8]), 7, 4, torch.tensor([3]), None, {})
    assert not rnd.drafted.any()  # "1 2 3" agrees with the padding only, which is no text to copy
    unpadded = lookup.draft(padded, torch.tensor([8]), 7, 4, torch.tensor([0]), None, {})
    assert unpadded.tokens[0, 1:].tolist() == [4, 5, 1]  # control: were it text, "1 2 3" would be copied on


def test_prompt_lookup_on_text_that_repeats_what_it_read():
    model = scrambled(small(**VARIANTS["rope-gqa-window-bias"]))  # window 3, 2 layers, RoPE
    P = torch.randint(0, 61, (1, 6))
    G = tokens_of(model, P, 20, temperature=0)
    idx = torch.cat([P, G, P], dim=1)  # each token depends on the last 5 only: after P it writes G again
    spec = Speculative("lookup", k=4)
    got = tokens_of(model, idx, 20, temperature=0, speculative=spec)
    assert torch.equal(got, G) and torch.equal(got, tokens_of(model, idx, 20, temperature=0))
    print(f"prompt lookup: {spec.stats.tokens_per_forward:.2f} tokens per forward, "
          f"{spec.stats.acceptance_rate:.2f} of {spec.stats.drafted} drafts accepted")
    assert spec.stats.acceptance_rate == 1.0 and spec.stats.tokens_per_forward >= 4.0  # 1 + 4+6+8 + 1


def test_each_row_of_a_batch_accepts_its_own_number_of_drafts():
    model = scrambled(small(**VARIANTS["rope-gqa-window-bias"]))
    P = torch.randint(0, 61, (1, 6))
    G = tokens_of(model, P, 20, temperature=0)
    idx = torch.cat([torch.cat([P, G, P], dim=1), torch.randint(0, 61, (1, 32))])  # (2, 32): easy, then hard
    spec, hard = Speculative("lookup", k=4), Speculative("lookup", k=4)
    got = tokens_of(model, idx, 20, temperature=0, speculative=spec)
    assert torch.equal(got, tokens_of(model, idx, 20, temperature=0)) and torch.equal(got[0], G[0])
    tokens_of(model, idx[1:], 20, temperature=0, speculative=hard)
    assert hard.stats.accepted <= 2  # the hard row alone accepts next to nothing
    assert spec.stats.accepted >= hard.stats.accepted + 8  # the easy row ran ahead: its drafts stood


# sampling: the first three tokens of many independent rows against their exact law
V, ROWS, NEW = 6, 6000, 3
SAMPLING = dict(temperature=0.9, top_k=5, top_p=0.95)


def chi_square(counts, probs):
    """Pearson's statistic of ``counts`` against ``probs`` (cells expecting under 5 merged),
    its degrees of freedom, and the critical value at significance 0.001 by the Wilson-Hilferty
    approximation (within 1% of the exact quantile for these df: df 48 gives 84.1, exact 84.0)."""
    expected = probs.double() * counts.sum()
    rare = expected < 5
    observed = torch.cat([counts[~rare], counts[rare].sum()[None]])
    expected = torch.cat([expected[~rare], expected[rare].sum()[None]])
    observed, expected = observed[expected > 0], expected[expected > 0]
    df = len(expected) - 1
    z = 3.0902  # the standard normal's 0.999 quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return ((observed - expected) ** 2 / expected).sum().item(), df, critical


def test_the_chi_square_critical_value():
    assert abs(chi_square(torch.full((49,), 100.0), torch.ones(49) / 49)[2] - 84.04) < 0.3  # df 48, table 84.04
    assert abs(chi_square(torch.full((11,), 100.0), torch.ones(11) / 11)[2] - 29.59) < 0.3  # df 10, table 29.59


# the caches sampling rolls back: the full one, and rolling windows (with sink tokens) that wrap
# around within the NEW tokens, their rollback slots all a round of k = 2 drafts gives them
SAMPLED_CACHES = {"full": {}, "window": {"window": 3}, "window-sinks": {"window": 3, "sink_tokens": 1}}


@pytest.fixture(scope="module", params=SAMPLED_CACHES)
def tiny(request):
    """A tiny model of a cache kind, its exact law of the first NEW tokens after a repetitive
    prompt, and drafts."""
    torch.manual_seed(0)
    model = scrambled(small(vocab_size=V, n_embd=16, n_head=2, n_layer=2, **SAMPLED_CACHES[request.param]))
    prompt = tokens_of(model, torch.tensor([[0]]), 8, temperature=0)[:, 3:]  # (1, 5) its own greedy text, which
    assert len(set(prompt[0].tolist())) < 5  # repeats: prompt lookup drafts for most rows
    seqs = torch.tensor(list(itertools.product(range(V), repeat=NEW)))  # (V^NEW, NEW) every continuation
    with torch.no_grad():
        logits = model(torch.cat([prompt.expand(len(seqs), -1), seqs], dim=1))[0][:, 4:-1]  # (V^NEW, NEW, V)
    law = probabilities(logits, **SAMPLING).gather(-1, seqs[..., None])[..., 0].prod(dim=-1)  # (V^NEW,)
    drafts = {"lookup": "lookup", "self:1": "self:1",
              "draft": scrambled(small(vocab_size=V, n_embd=16, n_head=2, n_layer=1))}
    cache = model.new_cache(1, rollback=2)[0]
    assert isinstance(cache, RollingKVCache) == ("window" in request.param)
    assert not isinstance(cache, RollingKVCache) or cache.k.shape[2] < prompt.shape[1] + NEW  # its slots wrap
    return model, prompt, law, drafts


def sampled_counts(model, prompt, **kw):
    """How often each continuation of NEW tokens came out over ROWS rows of one generate call
    (of one more, so that the first round can draft the second and third tokens together)."""
    g = torch.Generator().manual_seed(1)
    steps = tokens_of(model, prompt.expand(ROWS, -1), NEW + 1, generator=g, **SAMPLING, **kw)[:, :NEW]
    return torch.bincount((steps * V ** torch.arange(NEW - 1, -1, -1)).sum(dim=1), minlength=V ** NEW).double()


def test_plain_sampling_passes_the_chi_square_test(tiny):  # the exact law is plain sampling's
    model, prompt, law, _ = tiny
    stat, df, critical = chi_square(sampled_counts(model, prompt), law)
    print(f"plain: chi2 {stat:.1f}, df {df}, critical {critical:.1f}")
    assert stat < critical


@pytest.mark.parametrize("method", METHODS)
def test_speculative_sampling_draws_plain_samplings_distribution(tiny, method, monkeypatch):
    model, prompt, law, drafts = tiny
    spec = Speculative(drafts[method], k=2, max_k=2, ngram=1)  # lookup drafts after any repeated token
    stat, df, critical = chi_square(sampled_counts(model, prompt, speculative=spec), law)
    print(f"{method}: chi2 {stat:.1f}, df {df}, critical {critical:.1f}, {spec.stats}")
    assert stat < critical and spec.stats.accepted > 0.05 * spec.stats.drafted > 0
    monkeypatch.setattr(speculative, "_verdicts", lambda p, q, sample: torch.ones_like(p, dtype=torch.bool))
    spec = Speculative(drafts[method], k=2, max_k=2, ngram=1)
    stat, df, critical = chi_square(sampled_counts(model, prompt, speculative=spec), law)
    print(f"{method}, accepting every draft: chi2 {stat:.1f}")
    assert stat > critical  # negative control


@pytest.mark.parametrize("speculative_, error, words", [
    ("self:0", ValueError, ["'self:0'", "positive int"]),
    ("self:x", ValueError, ["'self:x'"]),
    ("self:2", ValueError, ["'self:2'", "n_layer=2"]),
    ("medusa", ValueError, ["'medusa'", "lookup"]),
    (42, TypeError, ["int"]),
])
def test_bad_speculative_arguments_fail_at_the_call(speculative_, error, words):
    model = scrambled(small())
    with pytest.raises(error) as info:
        generate(model, torch.zeros(1, 4, dtype=torch.long), 3, speculative=speculative_)  # no next()
    assert all(w in str(info.value) for w in words), str(info.value)


def test_bad_drafts_and_draft_lengths():
    model = scrambled(small())
    idx = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="vocab_size=50 differs from the model's vocab_size=61"):
        generate(model, idx, 3, speculative=scrambled(small(vocab_size=50)))
    with pytest.raises(ValueError, match="block_size=8 positions, this generation needs 13"):
        generate(model, idx, 10, speculative=scrambled(small(block_size=8)))
    with pytest.raises(ValueError, match="k must be a positive int, got 0"):
        Speculative("lookup", k=0)
    with pytest.raises(ValueError, match="max_k=2 is below k=4"):
        Speculative("lookup", max_k=2)
    with pytest.raises(TypeError, match="ngram must be an int"):
        Speculative("lookup", ngram=2.5)



def test_the_docs_example(capsys):
    text = (Path(__file__).parents[2] / "docs" / "gpt.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    scope = {}
    for first in ("import torch\nfrom selfattn import GPT", "idx  = torch.tensor(",
                  "from selfattn.generation.speculative"):
        exec(next(b for b in blocks if b.startswith(first)), scope)
    assert torch.equal(scope["fast"], scope["out"])  # what the plain example generated, greedy
    per_forward, rate = map(float, capsys.readouterr().out.split()[-2:])  # after the 50 streamed tokens
    assert per_forward >= 1.0 and 0.0 <= rate <= 1.0 and scope["spec"].stats.tokens == 10
