"""The implementations ``python -m benchmarks`` times, built alike and called alike.

An implementation is ours (``SelfAttention(backend=...)`` for ``auto`` and every backend) or
a peer (:mod:`benchmarks.peers`); every one is a causal self-attention layer
``(B, T, C) -> (B, T, C)`` loaded with the same reference weights, and one timed unit is
:func:`call`: a forward, or a forward and the backward of a fixed output gradient.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from benchmarks import peers
from selfattn import backends
from selfattn.masks import Mask
from selfattn.self_attention import SelfAttention

OURS = ("auto",) + backends.NAMES
IMPLS = OURS + peers.ATTENTION_PEERS
MODES = ("fwd", "fwd+bwd")


@dataclass(frozen=True)
class Impl:
    """An implementation: its name, ``"ours"`` or ``"peer"``, and how to build it from the
    reference ``SelfAttention`` whose weights it takes."""
    name: str
    kind: str
    build: Callable[[SelfAttention], nn.Module] = field(compare=False)

    def unavailable(self, device: torch.device, dtype: torch.dtype, n_head: int, head_dim: int) -> str | None:
        """Why this implementation cannot run here (a missing extra, a backend that refuses
        the device or dtype), or None."""
        if self.kind == "ours":
            name = backends.resolve(self.name)
            why = backends.availability(name, device)
            if why:
                return why
            probe = torch.zeros(1, n_head, 8, head_dim, device=device, dtype=dtype, requires_grad=True)  # (B, H, T, D)
            return backends.load(name).unsupported(probe, probe, probe, Mask(), 0.0)  # the suite times backward too
        if self.name.startswith("hf-"):
            try:
                import transformers.models.gpt2.modeling_gpt2  # noqa: F401
            except ImportError as e:
                return f"needs transformers ({e}): pip install 'selfattn[hf]'"
        if self.name == "seed" and device.type != "cpu":
            return "the seed's module builds its mask with torch.tril(torch.ones(T, T)) on the CPU"
        return None


def implementation(name: str) -> Impl:
    if name in OURS:
        return Impl(name, "ours", lambda ref, n=name: _ours(n, ref))
    if name in peers.ATTENTION_PEERS:
        return Impl(name, "peer", lambda ref, n=name: peers.attention_peer(n, ref))
    raise ValueError(f"unknown implementation {name!r}; choose from {IMPLS}")


def _ours(backend: str, ref: SelfAttention) -> nn.Module:
    C = ref.n_head * ref.head_dim
    ours = SelfAttention(C, ref.n_head, backend=backend).to(device=ref.qkv.weight.device, dtype=ref.qkv.weight.dtype)
    ours.load_state_dict(ref.state_dict())
    return ours


def reference(n_embd: int, n_head: int, device, dtype) -> SelfAttention:
    """The weights every implementation gets: drawn in float32 from a fixed seed, then cast."""
    g = torch.Generator().manual_seed(1234)
    ref = SelfAttention(n_embd, n_head, backend="math")
    with torch.no_grad():
        for p in ref.parameters():
            p.uniform_(-n_embd ** -0.5, n_embd ** -0.5, generator=g)  # nn.Linear's default range
    return ref.to(device=device, dtype=dtype)


def build(name: str, n_embd: int, n_head: int, device, dtype) -> nn.Module:
    """Implementation ``name`` with the reference weights (the memory child uses this too)."""
    module = implementation(name).build(reference(n_embd, n_head, device, dtype)).eval()
    if name in OURS:
        backends.load(backends.resolve(name))  # import the backend now, not inside a measured call
    return module


def inputs(B: int, T: int, C: int, device, dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The input ``x`` and the output gradient ``g``, both ``(B, T, C)``, fixed by ``seed`` and T."""
    g = torch.Generator().manual_seed(seed * 100003 + T)
    x = torch.randn(B, T, C, generator=g).to(device=device, dtype=dtype)  # (B, T, C)
    grad = torch.randn(B, T, C, generator=g).to(device=device, dtype=dtype)  # (B, T, C)
    return x, grad


def call(module: nn.Module, x: torch.Tensor, grad: torch.Tensor, mode: str) -> torch.Tensor:
    """One timed unit: the output (``fwd``) or the input gradient (``fwd+bwd``)."""
    if mode == "fwd":
        with torch.no_grad():
            return module(x)
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    module(x).backward(grad)
    return x.grad
