"""The implementations ``python -m benchmarks`` measures ours against, each loaded with the same weights.

Attention peers, all ``(B, T, C) -> (B, T, C)`` modules with a fused q/k/v projection and an
output projection, no biases (the seed's module): build one with :func:`attention_peer` from
a reference :class:`~selfattn.self_attention.SelfAttention`, whose ``qkv.weight`` ``(3C, C)`` and
``proj.weight`` ``(C, C)`` it copies.

- ``seed``: the seed document's module, exactly as the seed writes it;
- ``torch-mha``: ``torch.nn.MultiheadAttention`` with a causal boolean mask;
- ``nanogpt``: nanoGPT's ``CausalSelfAttention``, calling
  ``scaled_dot_product_attention(is_causal=True)`` directly;
- ``hf-gpt2``, ``hf-gpt2-eager``: ``transformers``' ``GPT2Attention`` with its default
  (SDPA) and its eager attention (optional extra ``hf``).

Model peer: :class:`NanoGPT`, a nanoGPT-equivalent GPT (``NanoGPT.from_ours(gpt)`` copies
the weights of one of our :class:`~selfattn.model.GPT`), for the ``train`` benchmark.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from selfattn.self_attention import SelfAttention

ATTENTION_PEERS = ("seed", "torch-mha", "nanogpt", "hf-gpt2", "hf-gpt2-eager")


# The seed document's "In code", verbatim (only the class name differs).
class SeedSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        assert n_embd % n_head == 0
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.proj = nn.Linear(n_embd, n_embd, bias=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * self.head_dim ** -0.5
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class TorchMHA(nn.Module):
    """``nn.MultiheadAttention`` used for causal self-attention the documented way: a boolean
    ``attn_mask`` (True = *not* allowed, the opposite of our convention) plus the
    ``is_causal`` hint, ``need_weights=False`` so PyTorch may take its fused path."""

    def __init__(self, n_embd: int, n_head: int):
        super().__init__()
        self.mha = nn.MultiheadAttention(n_embd, n_head, bias=False, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[1]
        hidden = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)  # (T, T) True above the diagonal
        return self.mha(x, x, x, attn_mask=hidden, need_weights=False, is_causal=True)[0]


class NanoGPTAttention(nn.Module):
    """nanoGPT's ``CausalSelfAttention`` (flash path, no dropout, no biases)."""

    def __init__(self, n_embd: int, n_head: int, bias: bool = False, dropout: float = 0.0):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # (B, T, C) x3
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
                                           is_causal=True)  # (B, H, T, D)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class HFGPT2Attention(nn.Module):
    """``transformers``' ``GPT2Attention`` as a ``(B, T, C) -> (B, T, C)`` module.

    In transformers 5 the causal mask is built by the model, not the attention layer: the
    SDPA implementation applies ``is_causal`` itself, the eager one needs the model's
    additive mask (0 where allowed, the dtype's minimum elsewhere), built here per call as
    ``GPT2Model`` builds it per forward. GPT-2's ``Conv1D`` biases exist and are zero.
    """

    def __init__(self, n_embd: int, n_head: int, implementation: str = "sdpa"):
        super().__init__()
        from transformers.models.gpt2.modeling_gpt2 import GPT2Attention, GPT2Config
        config = GPT2Config(n_embd=n_embd, n_head=n_head, attn_pdrop=0.0, resid_pdrop=0.0)
        config._attn_implementation = implementation
        self.implementation = implementation
        self.attn = GPT2Attention(config, layer_idx=0)
        with torch.no_grad():
            self.attn.c_attn.bias.zero_()
            self.attn.c_proj.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        mask = None
        if self.implementation == "eager":
            T = x.shape[1]
            hidden = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)  # (T, T)
            mask = torch.zeros(T, T, dtype=x.dtype, device=x.device).masked_fill_(
                hidden, torch.finfo(x.dtype).min)[None, None]  # (1, 1, T, T)
        return self.attn(x, attention_mask=mask)[0]


def attention_peer(name: str, ref: SelfAttention) -> nn.Module:
    """The peer called ``name`` with the weights of ``ref`` (a bias-free, full-head
    ``SelfAttention``), on ``ref``'s device and dtype. ImportError when ``transformers`` is
    missing for the ``hf-*`` peers."""
    if not isinstance(ref, SelfAttention):
        raise TypeError(f"attention_peer needs a SelfAttention reference, got {type(ref).__name__}")
    if ref.n_kv_head != ref.n_head or ref.qkv.bias is not None or ref.rope or ref.window is not None:
        raise ValueError(f"attention peers are plain causal multi-head attention without biases; got {ref!r}")
    C, H = ref.n_head * ref.head_dim, ref.n_head
    w_qkv, w_proj = ref.qkv.weight.detach(), ref.proj.weight.detach()  # (3C, C), (C, C)
    if name == "seed":
        peer = SeedSelfAttention(C, H)
        params = {"qkv.weight": w_qkv, "proj.weight": w_proj}
    elif name == "torch-mha":
        peer = TorchMHA(C, H)  # in_proj_weight stacks W_q, W_k, W_v like our qkv
        params = {"mha.in_proj_weight": w_qkv, "mha.out_proj.weight": w_proj}
    elif name == "nanogpt":
        peer = NanoGPTAttention(C, H)
        params = {"c_attn.weight": w_qkv, "c_proj.weight": w_proj}
    elif name in ("hf-gpt2", "hf-gpt2-eager"):
        try:
            peer = HFGPT2Attention(C, H, "eager" if name.endswith("eager") else "sdpa")
        except ImportError as e:
            raise ImportError("the hf-gpt2 peers need transformers: pip install 'selfattn[hf]'") from e
        params = {"attn.c_attn.weight": w_qkv.t(), "attn.c_proj.weight": w_proj.t()}  # Conv1D: (in, out)
    else:
        raise ValueError(f"unknown attention peer {name!r}; choose one of {ATTENTION_PEERS}")
    peer = peer.to(device=w_qkv.device, dtype=w_qkv.dtype)
    state = peer.state_dict()
    with torch.no_grad():
        for key, value in params.items():
            state[key].copy_(value)
    return peer


class NanoGPT(nn.Module):
    """A nanoGPT-equivalent GPT: nanoGPT's ``model.py`` architecture (pre-norm blocks of
    ``CausalSelfAttention`` with SDPA and an MLP, learned positions, tied head), with the
    GELU variant and LayerNorm epsilon of the GPT it is made from, so that the two compute
    the same function and differ only in their code."""

    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, *,
                 bias: bool = True, gelu_approximate: str = "tanh", layer_norm_eps: float = 1e-5):
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(_NanoBlock(n_embd, n_head, bias, gelu_approximate, layer_norm_eps)
                               for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, eps=layer_norm_eps, bias=bias)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying, as nanoGPT
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @classmethod
    def from_ours(cls, gpt) -> NanoGPT:
        """The nanoGPT-equivalent of one of our GPTs (learned positions, full heads, an MLP,
        no window, no dropout), with its weights, dtype and device."""
        c = gpt.config
        if c.pos != "learned" or c.n_kv_head not in (None, c.n_head) or not c.mlp or c.window is not None \
                or c.dropout or c.alibi or c.softcap is not None or c.sinks:
            raise ValueError(f"NanoGPT mirrors GPT-2-style configs only (learned positions, full heads, MLP, "
                             f"no window, no dropout), got {c}")
        nano = cls(c.vocab_size, c.block_size, c.n_layer, c.n_head, c.n_embd, bias=c.bias,
                   gelu_approximate=c.gelu_approximate, layer_norm_eps=c.layer_norm_eps)
        w = gpt.wte.weight
        nano = nano.to(device=w.device, dtype=w.dtype)
        theirs = nano.state_dict()
        with torch.no_grad():
            for key, value in gpt.state_dict().items():
                theirs[cls.key_for(key)].copy_(value)
        return nano

    @staticmethod
    def key_for(key: str) -> str:
        """The name in NanoGPT of our GPT's parameter ``key`` (``blocks.0.attn.qkv.weight`` ->
        ``h.0.attn.c_attn.weight``); the other names are the same."""
        for ours, theirs in (("blocks.", "h."), (".attn.qkv.", ".attn.c_attn."), (".attn.proj.", ".attn.c_proj.")):
            key = key.replace(ours, theirs)
        return key

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        B, T = idx.size()
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100)  # (B·T, V)
        return logits, loss


class _NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool, gelu_approximate: str, eps: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd, eps=eps, bias=bias)
        self.attn = NanoGPTAttention(n_embd, n_head, bias=bias)
        self.ln_2 = nn.LayerNorm(n_embd, eps=eps, bias=bias)
        self.mlp = _NanoMLP(n_embd, bias, gelu_approximate)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class _NanoMLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool, gelu_approximate: str):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.gelu = nn.GELU(approximate=gelu_approximate)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # (B, T, 4C) inside, (B, T, C) out
