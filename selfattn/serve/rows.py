"""Rows that each own their cache, decoded together: the batch that requests join and leave.

A row is one request's sequence. Its :class:`RowCache` is the model's own per-layer caches for a
batch of one (a :class:`~selfattn.kv_cache.KVCache`, or a rolling one for a sliding-window layer),
grown as the row grows; a row joins by being prefilled alone into its cache (:func:`prefill`, the
very forward :func:`~selfattn.generation.generate` runs for a prompt) and leaves by being dropped.
No row ever waits for, pads to or restarts with another.

:func:`decode_step` feeds one token to each of B rows in one forward of the model: the embeddings,
norms, feed-forward blocks and the head run on the ``(B, 1, C)`` batch, each weight matrix read
once for all rows; each row's attention sublayer runs alone on its own cache (:class:`RowsAttention`).

Why a row computes the bits it would alone. Its attention sublayer is the batch-1 call of the solo
decode, on the same keys. Everything else works row by row: elementwise ops, norms over a row, and
the products of :func:`~selfattn.generation.layout.decode_layout`'s ``matvec`` form, whose sums take
the same order whatever rows come with it (:mod:`selfattn.kernels.matvec`) for up to
:data:`~selfattn.generation.layout.FEW` rows. So a greedy row yields token for token what
``generate(model, prompt, n, temperature=0)`` yields on the same laid-out model, whatever runs
beside it, wherever the products take that form (the CPU, the kernel built: :func:`rows_keep_their_bits`).
Elsewhere (a GPU's BLAS, a mixture of experts' expert products) the batched products may round
differently from one row's, and a near tie may then break the other way.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from selfattn.generation.layout import FEW, RowLinear, decode_layout
from selfattn.kv_cache import KVCache
from selfattn.model import GPT, MoE
from selfattn.self_attention import SelfAttention

FIRST_POSITIONS = 256  # a row's cache starts with room for its prompt and this many more, then doubles


class RowCache:
    """One row's caches, a batch of one per layer, holding up to ``limit`` positions: allocated
    for what the row needs first and grown (doubled, its positions copied) as it goes on."""

    def __init__(self, model: GPT, limit: int):
        self.model, self.limit = model, limit
        self.layers: list = model.new_cache(1, min(limit, FIRST_POSITIONS))

    @property
    def length(self) -> int:
        """The positions cached so far."""
        return self.layers[0].length

    def reserve(self, n: int) -> None:
        """Make room for ``n`` more positions (within ``limit``: a caller's bug otherwise)."""
        need = self.length + n
        assert need <= self.limit, f"a row of limit {self.limit} asked for {need} positions"
        grown = [c for c in self.layers if isinstance(c, KVCache) and c.max_len < need]
        if not grown:
            return
        size = min(self.limit, max(need, 2 * grown[0].max_len))
        fresh = self.model.new_cache(1, size)
        for i, old in enumerate(self.layers):
            if isinstance(old, KVCache):  # a rolling cache keeps its window of slots whatever the length
                L = old.length
                fresh[i].k[:, :, :L], fresh[i].v[:, :, :L] = old.k[:, :, :L], old.v[:, :, :L]  # (1, Hkv, L, D)
                fresh[i].length = L
                self.layers[i] = fresh[i]


class LayerRows(Sequence):
    """One layer's caches of the rows of a step, in the batch's order: what a layer's
    :class:`RowsAttention` receives as its ``cache``."""

    def __init__(self, caches: list):
        self.caches = caches

    def __getitem__(self, b):
        return self.caches[b]

    def __len__(self) -> int:
        return len(self.caches)


class RowsAttention(SelfAttention):
    """:class:`~selfattn.self_attention.SelfAttention` that, given :class:`LayerRows`, attends each row
    alone on its own cache, exactly as a batch of one (positions from the row's cache, no mask);
    for any other cache, or none, it is SelfAttention unchanged. The batch's other arguments (the
    mask and positions :func:`decode_step` describes the rows by) are not needed then."""

    def forward(self, x: Tensor, *, cache=None, **kw) -> Tensor:
        if not isinstance(cache, LayerRows):
            return super().forward(x, cache=cache, **kw)
        return torch.cat([super(RowsAttention, self).forward(x[b:b + 1], cache=c)  # (1, T, C) each
                          for b, c in enumerate(cache)])  # (B, T, C)


def prepare(model: GPT) -> GPT:
    """``model``, in place, ready to decode rows: evaluation mode, its weights laid out for decoding
    (:func:`~selfattn.generation.layout.decode_layout`), its attention modules :class:`RowsAttention`
    (the same parameters and ``state_dict``; every other call behaves as before). Idempotent."""
    if not isinstance(model, GPT):
        raise TypeError(f"rows decode a selfattn GPT, got {type(model).__name__}")
    decode_layout(model.eval())
    for block in model.blocks:
        block.attn.__class__ = RowsAttention
    return model


def rows_keep_their_bits(model: GPT) -> bool:
    """Whether a row of :func:`decode_step` computes the bits it would alone (see the module
    docstring): every product in a form whose rows keep their bits, and no expert products."""
    linears = [m for m in model.modules() if isinstance(m, RowLinear)]
    return (bool(linears) and all(m.one_row == m.few_rows == "matvec" and m.weight.device.type == "cpu"
                                  for m in linears) and not any(isinstance(m, MoE) for m in model.modules()))


def prefill(model: GPT, ids: list[int], cache: RowCache) -> Tensor:
    """Prefill a row alone: the prompt ``ids`` into its empty ``cache``; the hidden states ``(1, T, C)``
    (the logits of the next token are ``model.logits(h[:, -1])``, as :func:`generate` computes them)."""
    cache.reserve(len(ids))
    idx = torch.tensor([ids], device=model.wte.weight.device)  # (1, T)
    return model.hidden(idx, None, cache.layers, 0)  # (1, T, C)


def decode_step(model: GPT, tokens: Tensor, rows: list[RowCache]) -> Tensor:
    """Feed ``tokens`` ``(B,)``, one per row of ``rows`` (B <= :data:`~selfattn.generation.layout.FEW`),
    each continuing its own cache, in one forward: the logits of each row's next token ``(B, V)``.

    The rows are described to the model as left-padded in one timeline: row b's mask holds its
    ``L_b`` cached positions and the new one at the right, so that the positions it gives (the
    mask's cumulative sum) are each row's own ``L_b``."""
    B = len(rows)
    assert 0 < B <= FEW and tokens.shape == (B,), (B, tuple(tokens.shape))
    for row in rows:
        row.reserve(1)
    lengths = torch.tensor([row.length for row in rows], device=tokens.device)  # (B,)
    S = int(lengths.max()) + 1
    mask = torch.arange(S, device=tokens.device) >= (S - 1 - lengths)[:, None]  # (B, S) each row's L_b + 1 at the right
    layers = [LayerRows([row.layers[i] for row in rows]) for i in range(len(model.blocks))]
    h = model.hidden(tokens[:, None], mask, layers, S - 1)  # (B, 1, C)
    return model.logits(h[:, -1])  # (B, V)
