"""``generate`` under hooks: the prompt's forward fires every site over its T positions, each new token's step
fires them with T = 1 (the pattern over the cache's S keys), and greedy tokens equal a recompute of the
whole sequence at each step under the same hooks; a compiled model decodes eagerly while hooked, and says so."""
import warnings

import pytest
import torch

from selfattn.generation import compile_decode, generate
from selfattn.generation.compiled import CompiledDecode
from selfattn.generation.steps import steps_of
from selfattn.interp import hooks

from helpers.models import scrambled, small


def ablate_head_0(z, name):  # (B, T, H, D): head 0's output zeroed
    z = z.clone()
    z[:, :, 0] = 0
    return z


ABLATE = {lambda n: n.endswith("attn.hook_z"): ablate_head_0}


def recomputed(model, idx, n):
    """n greedy tokens, each from a full forward over the sequence so far (no cache)."""
    seq = idx
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], 1)
    return seq[:, idx.shape[1]:]


def model_and_prompt():
    model = scrambled(small(pos="rope", n_kv_head=2))
    return model, torch.randint(0, 61, (2, 5))


def test_greedy_tokens_under_hooks_equal_a_recompute_without_the_cache():
    model, idx = model_and_prompt()
    shapes = []
    with hooks(model, {**ABLATE, "blocks.1.attn.hook_pattern": lambda t, n: shapes.append(tuple(t.shape))}):
        got = torch.stack(list(generate(model, idx, 8, temperature=0)), 1)  # (B, 8)
        seen = list(shapes)
        expected = recomputed(model, idx, 8)
    assert torch.equal(got, expected)
    # the prompt over T = 5 positions, then one position a step over the cache's keys (the last token not fed)
    assert seen == [(2, 4, 5, 5)] + [(2, 4, 1, 5 + s) for s in range(1, 8)]
    unhooked = torch.stack(list(generate(model, idx, 8, temperature=0)), 1)
    assert not torch.equal(unhooked, got)  # negative control: the hook changes the tokens
    assert torch.equal(unhooked, recomputed(model, idx, 8))


def test_a_compiled_model_under_hooks_decodes_eagerly_and_says_so():
    model, idx = model_and_prompt()
    eager_hooked = None
    with hooks(model, ABLATE):
        eager_hooked = torch.stack(list(generate(model, idx, 8, temperature=0)), 1)
    compile_decode(model)
    fast = torch.stack(list(generate(model, idx, 8, temperature=0)), 1)
    with hooks(model, ABLATE), pytest.warns(UserWarning, match="decodes eagerly"):
        hooked = torch.stack(list(generate(model, idx, 8, temperature=0)), 1)
    assert torch.equal(hooked, eager_hooked)
    assert not torch.equal(hooked, fast)  # the hooks applied (the compiled steps would not have called them)
    assert isinstance(steps_of(model), CompiledDecode)  # after the block: the fast path again, and no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(torch.stack(list(generate(model, idx, 8, temperature=0)), 1), fast)
