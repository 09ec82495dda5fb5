"""The rolling KV cache of sliding-window models: O(window) memory, decoding past block_size,
and step by step exactly the full forward over the same windowed mask."""
import pytest
import torch

from selfattn import GPTConfig
from selfattn.generation import generate
from selfattn.kv_cache import RollingKVCache

from helpers.models import assert_same_logits, left_pad, scrambled


def _model(window=4, sink_tokens=None, pos="rope", **kw):
    cfg = GPTConfig(vocab_size=53, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, pos=pos,
                    window=window, sink_tokens=sink_tokens, **kw)
    return scrambled(cfg)


@pytest.mark.parametrize("sink_tokens", [None, 2])
@pytest.mark.parametrize("backend", ["math", "sdpa", "tiled"])
def test_decoding_three_windows_equals_the_full_forward_step_by_step(backend, sink_tokens):
    model = _model(window=5, sink_tokens=sink_tokens, backend=backend)
    idx = torch.randint(0, 53, (2, 16))  # the prompt (4) and then one token at a time, past 3 windows
    full, _ = model(idx)
    cache = model.new_cache(2)
    for layer in cache:  # slots never written hold NaN: reading one would show
        layer.k.fill_(float("nan"))
        layer.v.fill_(float("nan"))
    sizes = {tuple(layer.k.shape) for layer in cache}
    steps = [model(idx[:, :4], cache=cache)[0]]
    steps += [model(idx[:, t:t + 1], cache=cache)[0] for t in range(4, 16)]
    assert_same_logits(torch.cat(steps, dim=1), full)
    assert {tuple(layer.k.shape) for layer in cache} == sizes == {(2, 2, 5 + (sink_tokens or 0), 8)}  # flat


def test_a_chunk_longer_than_the_window_and_left_padding():
    model = _model(window=3)
    prompts = [torch.randint(0, 53, (n,)) for n in (9, 6)]
    idx, mask = left_pad(prompts)  # (2, 9): row 1 left-padded by 3
    full = torch.cat([model(p[None])[0] for p in prompts[1:]], dim=1)  # row 1 alone, unpadded
    cache = model.new_cache(2)
    steps = [model(idx[:, :7], attention_mask=mask[:, :7], cache=cache)[0]]  # a chunk of 7 > window 3
    steps += [model(idx[:, t:t + 1], attention_mask=mask[:, :t + 1], cache=cache)[0] for t in (7, 8)]
    cached = torch.cat(steps, dim=1)
    assert_same_logits(cached[1, 3:], full[0])


def test_generate_runs_past_block_size_with_rope_and_a_window_and_refuses_with_learned_positions():
    model = _model(window=4).eval()
    idx = torch.randint(0, 53, (1, 10))
    tokens = torch.cat(list(generate(model, idx, 40, temperature=0.0)))  # 49 positions > block_size 16
    assert len(tokens) == 40 and model.max_positions is None
    seq = torch.cat([idx[0], tokens[:-1]])[None]  # the whole sequence, read at once, agrees token for token
    greedy = model(seq)[0][0, 9:].argmax(-1)
    assert torch.equal(greedy, tokens)
    learned = _model(window=4, pos="learned").eval()
    assert learned.max_positions == 16
    with pytest.raises(ValueError, match="more than block_size=16"):
        list(generate(learned, idx, 40))


def test_rolling_cache_checks_its_arguments():
    with pytest.raises(ValueError, match="window must be a positive int"):
        RollingKVCache(1, 1, 0, 4)
    cache = RollingKVCache(1, 2, 3, 4)
    with pytest.raises(ValueError, match=r"expected k, v of shape \(B=1, Hkv=2, T, D=4\)"):
        cache.append(torch.zeros(1, 1, 1, 4), torch.zeros(1, 1, 1, 4))


@pytest.mark.parametrize("backend", ["math", "tiled"])
def test_softcap_and_learned_sinks_decode_like_the_full_forward(backend):
    cfg = GPTConfig(vocab_size=53, block_size=24, n_layer=2, n_head=4, n_embd=32, pos="rope", softcap=3.0,
                    sinks=True, backend=backend)
    model = scrambled(cfg)  # the sinks are parameters: scrambled, they matter
    assert all(block.attn.sinks.abs().sum() > 0 for block in model.blocks)
    idx = torch.randint(0, 53, (2, 12))
    full, _ = model(idx)
    cache = model.new_cache(2)
    steps = [model(idx[:, :5], cache=cache)[0]] + [model(idx[:, t:t + 1], cache=cache)[0] for t in range(5, 12)]
    assert_same_logits(torch.cat(steps, dim=1), full)
