"""GPT-2 interop with Hugging Face transformers: same logits, same greedy tokens, round trips.

Every model here is a small random GPT2Config built offline; nothing is ever downloaded.
"""
import os
import sys

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402  (the [hf] extra, part of [dev])

from selfattn.config import GPTConfig  # noqa: E402
from selfattn.generation import generate  # noqa: E402
from selfattn.io.hf import from_hf, load_gpt2, to_hf  # noqa: E402
from selfattn.model import GPT  # noqa: E402

from helpers.models import assert_same_logits, left_pad  # noqa: E402

transformers.logging.set_verbosity_error()
CONFIGS = {
    "gelu_new": dict(vocab_size=97, n_positions=40, n_embd=48, n_layer=3, n_head=4),
    "pytorch-tanh-eps": dict(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                             activation_function="gelu_pytorch_tanh", layer_norm_epsilon=1e-3),
    "exact-gelu-1-head": dict(vocab_size=50, n_positions=24, n_embd=16, n_layer=1, n_head=1,
                              activation_function="gelu"),
}


def random_gpt2(**kw):
    """A GPT2LMHeadModel in eval mode with every weight random (LayerNorms too), so a swapped,
    untransposed or dropped tensor changes the logits."""
    config = transformers.GPT2Config(bos_token_id=None, eos_token_id=None, **kw)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_ln_weight = "ln" in name and name.endswith("weight")
            p.copy_(torch.randn_like(p) * (0.1 if "ln" in name else 0.2) + (1.0 if is_ln_weight else 0.0))
    return model


def hf_logits(model, idx, mask=None):
    if mask is None:
        return model(idx).logits
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # transformers' generate does this; its forward does not
    return model(idx, attention_mask=mask, position_ids=positions).logits


@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(name):
    hf = random_gpt2(**CONFIGS[name])
    ours = from_hf(hf)
    assert not ours.training and ours.config.bias and ours.lm_head.weight is ours.wte.weight
    idx = torch.randint(0, hf.config.vocab_size, (3, 17))
    with torch.no_grad():
        expected, got = hf_logits(hf, idx), ours(idx)[0]
    assert_same_logits(got, expected)
    assert expected.abs().amax() > 1  # the logits are large enough for 1e-5 to mean something


@pytest.mark.parametrize("name", ["gelu_new", "pytorch-tanh-eps"])
def test_logits_match_transformers_with_left_padding(name):
    hf = random_gpt2(**CONFIGS[name])
    ours = from_hf(hf)
    idx, mask = left_pad([torch.randint(1, hf.config.vocab_size, (n,)) for n in (12, 5, 9)])
    with torch.no_grad():
        expected, got = hf_logits(hf, idx, mask), ours(idx, attention_mask=mask)[0]
    real = mask.bool()
    assert_same_logits(got[real], expected[real])


def test_a_wrong_conversion_is_caught():
    """Negative control: the parity check fails when one square Conv1D weight is not transposed."""
    hf = random_gpt2(**CONFIGS["gelu_new"])
    ours = from_hf(hf)
    with torch.no_grad():
        ours.blocks[1].attn.proj.weight.copy_(ours.blocks[1].attn.proj.weight.t().clone())
        idx = torch.randint(0, 97, (2, 10))
        assert (ours(idx)[0] - hf(idx).logits).abs().amax() > 1e-2


@pytest.mark.parametrize("padded", [False, True])
def test_greedy_generation_matches_transformers(padded):
    hf = random_gpt2(**CONFIGS["gelu_new"])
    ours = from_hf(hf)
    if padded:
        idx, mask = left_pad([torch.randint(1, 97, (n,)) for n in (8, 3, 6)])
    else:
        idx, mask = torch.randint(0, 97, (2, 8)), None
    theirs = hf.generate(idx, attention_mask=torch.ones_like(idx) if mask is None else mask, max_new_tokens=12,
                         min_new_tokens=12, do_sample=False, pad_token_id=0)[:, idx.shape[1]:]
    got = torch.stack(list(generate(ours, idx, 12, temperature=0, attention_mask=mask)), 1)
    assert torch.equal(got, theirs)
    assert len(set(got.flatten().tolist())) > 3  # not a degenerate repetition of one token


def test_round_trips_are_exact():
    hf = random_gpt2(**CONFIGS["gelu_new"])
    back = to_hf(from_hf(hf))
    assert back.config.activation_function == "gelu_new" and not back.training
    theirs = hf.state_dict()
    assert back.state_dict().keys() == theirs.keys()
    for name, t in back.state_dict().items():
        assert torch.equal(t, theirs[name]), name
    assert back.lm_head.weight is back.transformer.wte.weight
    gpt = GPT(GPTConfig(vocab_size=40, block_size=16, n_layer=2, n_head=2, n_embd=16, bias=True,
                        gelu_approximate="none"))
    again = from_hf(to_hf(gpt))
    assert again.config == gpt.config and again.training
    for name, t in gpt.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name


def test_dtype_is_kept():
    hf = random_gpt2(**CONFIGS["exact-gelu-1-head"]).double()
    ours = from_hf(hf)
    assert ours.wte.weight.dtype == torch.float64
    idx = torch.randint(0, 50, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(idx).logits, rtol=0, atol=1e-12)
    assert to_hf(ours).transformer.h[0].attn.c_attn.weight.dtype == torch.float64


def test_load_gpt2_from_a_saved_directory(tmp_path):
    hf = random_gpt2(**CONFIGS["pytorch-tanh-eps"])
    hf.save_pretrained(tmp_path)
    ours = load_gpt2(tmp_path)
    idx = torch.randint(0, 64, (2, 11))
    with torch.no_grad():
        assert_same_logits(ours(idx)[0], hf(idx).logits)
    assert ours.config.layer_norm_eps == 1e-3 and ours.config.block_size == 32
    with pytest.raises(FileNotFoundError, match="not a directory.*never downloaded"):
        load_gpt2(tmp_path / "missing")


@pytest.mark.parametrize("kw,words", [
    ({"scale_attn_by_inverse_layer_idx": True}, ["scale_attn_by_inverse_layer_idx"]),
    ({"reorder_and_upcast_attn": True}, ["reorder_and_upcast_attn"]),
    ({"scale_attn_weights": False}, ["scale_attn_weights=False"]),
    ({"activation_function": "relu"}, ["'relu'", "gelu_new"]),
    ({"n_inner": 40}, ["n_inner=40", "64"]),
    ({"resid_pdrop": 0.0}, ["resid_pdrop", "attn_pdrop"]),
    ({"tie_word_embeddings": False}, ["not tied"]),
])
def test_unsupported_gpt2_configs(kw, words):
    hf = random_gpt2(**{**CONFIGS["exact-gelu-1-head"], **kw})
    if not kw.get("tie_word_embeddings", True):
        with torch.no_grad():
            hf.lm_head.weight.add_(1.0)  # really different from wte
    with pytest.raises(ValueError) as info:
        from_hf(hf)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("kw,words", [
    ({"pos": "rope"}, ["'pos': 'rope'"]), ({"bias": False}, ["'bias': False"]),
    ({"n_kv_head": 1}, ["'n_kv_head': 1"]), ({"window": 4}, ["'window': 4"]), ({"mlp": False}, ["'mlp': False"]),
])
def test_only_gpt2_architectures_convert_to_transformers(kw, words):
    cfg = dict(vocab_size=40, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=True)
    with pytest.raises(ValueError) as info:
        to_hf(GPT(GPTConfig(**{**cfg, **kw})))
    assert all(w in str(info.value) for w in words), str(info.value)
    with pytest.raises(TypeError, match="GPT2LMHeadModel"):
        from_hf(GPT(GPTConfig(**cfg)))


def test_missing_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'selfattn\[hf\]'"):
        load_gpt2(".")
