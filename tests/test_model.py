"""The GPT: structure, initialisation, loss, causality, left padding, and input validation."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from selfattn import SelfAttention
from selfattn.config import GPTConfig
from selfattn.model import GPT
from selfattn.norms import RMSNorm

from helpers.models import PAIRS, VARIANTS, assert_same_logits, left_pad, scrambled, small


def test_structure_and_tied_head():
    model = GPT(small(bias=True))
    assert len(model.blocks) == 2 and isinstance(model.blocks[0].attn, SelfAttention)
    assert model.lm_head.weight is model.wte.weight
    assert model.wpe.weight.shape == (24, 32)
    assert GPT(small(pos="rope")).wpe is None and GPT(small(pos="rope")).blocks[0].attn.rope
    attn_only = GPT(small(mlp=False))
    assert all(b.mlp is None and b.ln_2 is None for b in attn_only.blocks)
    assert not any("mlp" in n or "ln_2" in n for n, _ in attn_only.named_parameters())


def test_a_block_is_described_by_data():  # Llama-shaped: RMSNorm, SwiGLU, head_dim apart, biases apart, own head
    cfg = small(pos="rope", norm="rmsnorm", mlp_kind="swiglu", intermediate_size=48, head_dim=16, n_kv_head=2,
                qkv_bias=True, tie_embeddings=False)
    model = GPT(cfg)
    block, H, Hkv, D, C, V = model.blocks[0], 4, 2, 16, 32, 61
    assert block.attn.qkv.weight.shape == ((H + 2 * Hkv) * D, C) and block.attn.qkv.bias is not None
    assert block.attn.proj.weight.shape == (C, H * D) and block.attn.proj.bias is None
    assert isinstance(block.ln_1, RMSNorm) and isinstance(model.ln_f, RMSNorm) and not hasattr(block.ln_1, "bias")
    assert [block.mlp.gate_up_proj.weight.shape, block.mlp.down_proj.weight.shape] == [(2 * 48, C), (C, 48)]
    assert model.lm_head.weight is not model.wte.weight
    assert model.num_params() == GPT(dataclasses.replace(cfg, tie_embeddings=True)).num_params() + V * C
    qwen2 = GPT(small(qkv_bias=True, proj_bias=False, bias=True)).blocks[0].attn  # every bias but o_proj's
    assert qwen2.qkv.bias is not None and qwen2.proj.bias is None
    assert GPT(small(proj_bias=True)).blocks[0].attn.qkv.bias is None  # qkv_bias None follows bias, not proj_bias
    logits, _ = model(torch.randint(0, V, (2, 10)))
    assert logits.shape == (2, 10, V)


@pytest.mark.parametrize("kw", [{}, {"bias": True}, {"pos": "rope"}, {"mlp": False}, {"n_kv_head": 1}])
def test_num_params_matches_the_formula(kw):
    cfg = small(**kw)
    V, L, C, P = cfg.vocab_size, cfg.n_layer, cfg.n_embd, cfg.block_size
    kv = (cfg.n_kv_head or cfg.n_head) * (C // cfg.n_head)  # Hkv·D
    ln = 2 * C if cfg.bias else C
    attn = C * (C + 2 * kv) + C * C + ((C + 2 * kv) + C if cfg.bias else 0)
    mlp = 8 * C * C + (5 * C if cfg.bias else 0) + ln if cfg.mlp else 0
    pos = P * C if cfg.pos == "learned" else 0
    expected = V * C + pos + L * (ln + attn + mlp) + ln  # the tied head adds nothing
    model = GPT(cfg)
    assert model.num_params() == expected
    assert model.num_params(non_embedding=True) == expected - pos


def test_gpt2_initialisation():
    torch.manual_seed(1)
    model = GPT(GPTConfig(vocab_size=512, block_size=64, n_layer=8, n_head=4, n_embd=256, bias=True))
    residual = 0.02 / math.sqrt(2 * 8)
    for block in model.blocks:
        for w, std in ((block.attn.qkv.weight, 0.02), (block.mlp.c_fc.weight, 0.02),
                       (block.attn.proj.weight, residual), (block.mlp.c_proj.weight, residual)):
            assert abs(w.std().item() / std - 1) < 0.03 and abs(w.mean().item()) < 0.1 * std
        assert torch.all(block.attn.qkv.bias == 0) and torch.all(block.ln_1.weight == 1)
    assert abs(model.wte.weight.std().item() / 0.02 - 1) < 0.03
    assert abs(model.wpe.weight.std().item() / 0.02 - 1) < 0.03


def test_logits_and_loss():
    model = scrambled(small())
    idx = torch.randint(0, 61, (3, 10))
    targets = torch.randint(0, 61, (3, 10))
    logits, none = model(idx)
    assert logits.shape == (3, 10, 61) and none is None
    nothing, loss = model(idx, targets)  # with targets, the loss alone: the logits are never held whole
    assert nothing is None
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(30, 61), targets.reshape(30)))
    ignored = targets.clone()
    ignored[:, :4] = -100  # e.g. padding or the prompt
    _, partial = model(idx, ignored)
    torch.testing.assert_close(partial, F.cross_entropy(logits[:, 4:].reshape(18, 61), targets[:, 4:].reshape(18)))
    assert not torch.isclose(partial, loss)  # negative control: ignoring did change the loss


@pytest.mark.parametrize("variant", ["rope", "gemma-shaped"])
def test_recomputed_activations_give_the_same_loss_and_gradients(variant):
    model = scrambled(small(dropout=0.1, **VARIANTS[variant])).train()
    idx, targets = torch.randint(0, 61, (2, 12)), torch.randint(0, 61, (2, 12))
    runs, calls = [], []
    model.blocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
    for checkpointing in (False, True):
        model.checkpointing = checkpointing
        model.zero_grad()
        calls.clear()
        torch.manual_seed(3)  # the same dropout masks: recomputation replays them
        loss = model(idx, targets)[1]
        loss.backward()
        runs.append([loss] + [p.grad.clone() for p in model.parameters()])
        assert len(calls) == 1 + checkpointing  # recomputed: the block ran again in the backward
    for kept, recomputed in zip(*runs):
        assert torch.equal(kept, recomputed)


def test_training_steps_reduce_the_loss():
    model = GPT(small(dropout=0.1))
    idx = torch.arange(20).remainder(7)[None].repeat(4, 1)  # a periodic sequence, learnable
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(30):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    assert loss.item() < 0.5 * first
    assert model.wte.weight.grad is not None and model.wte.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_is_causal(variant):
    model = scrambled(small(**VARIANTS[variant]))
    idx = torch.randint(0, 61, (2, 12))
    logits, _ = model(idx)
    for t in (0, 5, 11):
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1) % 61
        moved, _ = model(changed)
        assert torch.equal(moved[:, :t], logits[:, :t]), f"token {t} leaked into earlier logits"
        assert (moved[:, t] - logits[:, t]).abs().amax() > 1e-3


@pytest.mark.parametrize("variant, backend", PAIRS)
def test_left_padded_batch_equals_each_prompt_alone(variant, backend):
    model = scrambled(small(backend=backend, **VARIANTS[variant]))
    prompts = [torch.randint(1, 61, (n,)) for n in (3, 9, 6)]
    idx, mask = left_pad(prompts, pad=5)
    batched, _ = model(idx, attention_mask=mask)
    for i, p in enumerate(prompts):
        alone, _ = model(p[None])
        assert_same_logits(batched[i, -len(p):], alone[0])
    unmasked, _ = model(idx)  # negative control: without the mask the padding does change the logits
    assert (unmasked[0, -3:] - batched[0, -3:]).abs().amax() > 1e-2
    assert torch.equal(model(idx, attention_mask=mask.bool())[0], batched)  # bool and 0/1 masks agree


@pytest.mark.parametrize("variant, backend", PAIRS)
def test_packed_documents_equal_each_document_alone(variant, backend):
    model = scrambled(small(backend=backend, **VARIANTS[variant]))
    docs = [torch.randint(1, 61, (n,)) for n in (7, 3, 10, 4)]
    idx = torch.cat(docs)[None]  # (1, 24): four documents in one row
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]  # (1, 24)
    packed, _ = model(idx, doc_ids=doc_ids)
    start = 0
    for d in docs:
        alone, _ = model(d[None])
        assert_same_logits(packed[0, start:start + len(d)], alone[0])
        start += len(d)
    unpacked, _ = model(idx)  # negative control: without doc_ids the later documents see the earlier ones
    assert (unpacked[0, 7:10] - packed[0, 7:10]).abs().amax() > 1e-2


@pytest.mark.parametrize("doc_ids, error, words", [
    (torch.tensor([[0, 0, 1, 0]]), ValueError, "non-decreasing"),
    (torch.tensor([[0.0, 0, 1, 1]]), TypeError, "integer"),
    (torch.tensor([[0, 0, 1]]), ValueError, "shape"),
])
def test_bad_doc_ids(doc_ids, error, words):
    with pytest.raises(error, match=words):
        GPT(small())(torch.zeros(1, 4, dtype=torch.long), doc_ids=doc_ids)


def test_doc_ids_refuse_a_cache_and_an_attention_mask():
    model, idx, doc_ids = GPT(small()), torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="cache"):
        model(idx, doc_ids=doc_ids, cache=model.new_cache(1))
    with pytest.raises(ValueError, match="attention_mask"):
        model(idx, doc_ids=doc_ids, attention_mask=torch.ones(1, 4))
    with pytest.raises(ValueError, match="sink_tokens .* unpacked"):
        GPT(small(window=2, sink_tokens=1))(idx, doc_ids=doc_ids)


def test_too_long_is_a_clear_error():
    model = GPT(small())
    model(torch.zeros(1, 24, dtype=torch.long))  # exactly block_size is fine
    with pytest.raises(ValueError, match=r"25 tokens .* block_size=24"):
        model(torch.zeros(1, 25, dtype=torch.long))
    cache = model.new_cache(1)
    model(torch.zeros(1, 20, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"20 cached \+ 5 new"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
    assert cache[0].length == 20  # the failed call wrote nothing


@pytest.mark.parametrize("idx,error,words", [
    (torch.zeros(5, dtype=torch.long), ValueError, ["(B, T)", "(5,)"]),
    (torch.zeros(1, 5), TypeError, ["integer", "float32"]),
    (torch.tensor([[1, 61, 2, 99]]), ValueError, ["vocab_size=61", "[61, 99]"]),
    (torch.tensor([[-1, 3]]), ValueError, ["[-1]"]),
    (torch.zeros(2, 0, dtype=torch.long), ValueError, ["at least one token", "(2, 0)"]),
    ([[1, 2]], TypeError, ["tensor", "list"]),
])
def test_bad_idx(idx, error, words):
    with pytest.raises(error) as info:
        GPT(small())(idx)
    assert all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("mask,error,words", [
    (torch.ones(2, 4, dtype=torch.long), ValueError, ["(B=2, S=5)", "(2, 4)"]),
    (torch.full((2, 5), 2), ValueError, ["0 and 1", "[2]"]),
    (torch.ones(2, 5), TypeError, ["float32"]),
])
def test_bad_attention_mask(mask, error, words):
    with pytest.raises(error) as info:
        GPT(small())(torch.ones(2, 5, dtype=torch.long), attention_mask=mask)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_bad_targets():
    with pytest.raises(ValueError, match=r"shaped like idx \(2, 5\), got \(2, 4\)"):
        GPT(small())(torch.ones(2, 5, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))


@pytest.mark.parametrize("kw,error,words", [
    ({"pos": "alibi"}, ValueError, ["'alibi'"]),
    ({"gelu_approximate": "erf"}, ValueError, ["'erf'"]),
    ({"vocab_size": 0}, ValueError, ["vocab_size", "0"]),
    ({"block_size": 8.0}, TypeError, ["block_size", "8.0"]),
    ({"backend": "fast"}, ValueError, ["'fast'"]),
    ({"layer_norm_eps": 0}, ValueError, ["layer_norm_eps", "0"]),
    ({"n_embd": 30}, ValueError, ["n_embd=30", "n_head=4"]),
    ({"norm": "batchnorm"}, ValueError, ["norm", "'batchnorm'", "'rmsnorm'"]),
    ({"mlp_kind": "relu"}, ValueError, ["mlp_kind", "'relu'", "'swiglu'"]),
    ({"intermediate_size": 0}, ValueError, ["intermediate_size", "0"]),
    ({"head_dim": 0}, ValueError, ["head_dim", "0"]),
    ({"qkv_bias": 1}, TypeError, ["qkv_bias", "1"]),
    ({"proj_bias": "no"}, TypeError, ["proj_bias", "'no'"]),
    ({"tie_embeddings": None}, TypeError, ["tie_embeddings", "None"]),
    ({"norm_position": "middle"}, ValueError, ["norm_position", "'middle'", "'sandwich'"]),
    ({"qk_norm": "all"}, ValueError, ["qk_norm", "'all'", "'projection'"]),
    ({"norm_offset": 1.0}, ValueError, ["norm_offset", "describe an RMSNorm"]),
    ({"mlp_kind": "moe"}, TypeError, ["n_experts", "None"]),
    ({"mlp_kind": "moe", "n_experts": 2, "experts_per_token": 3}, ValueError, ["experts_per_token=3", "n_experts=2"]),
    ({"window_layers": [True, False]}, ValueError, ["window_layers", "window is None"]),
    ({"window": 4, "window_layers": [True]}, ValueError, ["window_layers", "n_layer=2", "[True]"]),
    ({"pos": "rope", "rope_scaling": {"rope_type": "ntk"}}, ValueError, ["rope_type", "'ntk'", "'yarn'"]),
    ({"pos": "rope", "rope_dims": 9}, ValueError, ["even number of rotated channels", "9"]),
    ({"embedding_scale": -1.0}, ValueError, ["embedding_scale", "-1.0"]),
    ({"logit_softcap": 0}, ValueError, ["logit_softcap", "0"]),
])
def test_bad_config(kw, error, words):
    with pytest.raises(error) as info:
        GPT(small(**kw))
    assert all(w in str(info.value) for w in words), str(info.value)


def test_idx_on_another_device():
    model = GPT(small()).to("meta")  # any device other than the CPU
    with pytest.raises(ValueError, match="idx is on cpu but the model is on meta"):
        model(torch.zeros(1, 3, dtype=torch.long))


def test_an_empty_model_has_the_shapes_and_ties_and_draws_no_random_number():
    cfg = small(**VARIANTS["gemma-shaped"])
    state = torch.random.get_rng_state()
    empty = GPT.empty(cfg)
    assert torch.equal(torch.random.get_rng_state(), state)  # nothing drawn: the loader fills every weight
    like = GPT(cfg).state_dict()
    assert {k: v.shape for k, v in empty.state_dict().items()} == {k: v.shape for k, v in like.items()}
    assert empty.lm_head.weight is empty.wte.weight and empty.wte.weight.device.type == "cpu"
    full = GPT(cfg).eval()
    full.load_state_dict(like)
    empty.load_state_dict(like)
    idx = torch.randint(0, 61, (1, 6))
    assert torch.equal(empty.eval()(idx)[0], full(idx)[0])
