"""How a model's weights are stored and multiplied for batch-1 decoding (:meth:`GPT.decode_layout`).

A batch-1 decode step multiplies one row by every weight matrix once, so it runs at the speed
PyTorch's CPU kernels stream a matrix for a single row, which depends on the dtype and on the
order the matrix is stored in. Measured on a 2-core Xeon (AVX-512, AMX), SmolLM2-135M's matrices:

- float32: ``F.linear`` over an (in, out)-ordered matrix streams fastest (the order of GPT-2's
  Conv1D; GPT-2 small decoded about 1.3x faster than in ``nn.Linear``'s (out, in) order);
- bfloat16 and float16: the general matrix product at one row is slow (the model's matrices:
  26.4 ms a step in (in, out) order, 21.0 in (out, in)), while the matrix-vector product
  ``torch.mv`` over the (out, in) matrix takes 14.2 ms: one decode step 41 -> 28 ms.

So :func:`decode_layout` re-stores float32 matrices in (in, out) order, leaves half-precision
ones in (out, in) order, and turns every ``nn.Linear`` into a :class:`RowLinear`, which
multiplies a single row with ``torch.mv`` (as fast as ``F.linear`` in float32, faster in half
precision) and anything else with ``F.linear``. Values, shapes and ``state_dict`` are unchanged.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

HALF = (torch.bfloat16, torch.float16)


class RowLinear(nn.Linear):
    """An ``nn.Linear`` that multiplies a single row (B·T = 1) with ``torch.mv``."""

    def forward(self, x: Tensor) -> Tensor:
        if x.numel() != self.in_features:
            return F.linear(x, self.weight, self.bias)
        y = torch.mv(self.weight, x.reshape(-1))  # (out,)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def decode_layout(model: nn.Module) -> nn.Module:
    """Store and multiply ``model``'s weights as batch-1 decoding reads them fastest (see the
    module docstring), in place; returns the model. Idempotent. Meant for inference: the
    (in, out) order slows the token-embedding lookups of training. Call it again after casting
    the model to another dtype (``.to()`` keeps each matrix's order)."""
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = RowLinear  # the same parameters and state_dict, another forward
        if isinstance(module, (nn.Linear, nn.Embedding)):  # also a model cast since: .to() keeps strides
            w = module.weight.data  # copied only when stored in the other order
            module.weight.data = w.contiguous() if w.dtype in HALF else w.t().contiguous().t()  # strides (1, out)
    return model
