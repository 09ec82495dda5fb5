"""Weight-only int8 for decoding: a quarter of float32's bytes per weight, read once per token.

:func:`quantize_int8` replaces every ``nn.Linear`` of a model (the attention's projections, the
MLP's, the LM head) by an :class:`Int8Linear`: its weight rounded per output channel to
``round(w / s)`` in int8 with ``s = max|w_row| / 127``, so ``w ≈ s · q``. Opt-in, never on by
default: it changes the model's numbers (by about 1/254 of each row's largest weight), which
``python -m benchmarks int8`` measures (top-1 agreement and perplexity against float32).

The products: a few rows (decoding, a speculative verification: at most :data:`KERNEL_ROWS`) on
the CPU run on :mod:`selfattn.kernels.matvec`, which widens each int8 entry to float32 as it streams
past, sums in float32 and scales each sum by its row's scale (the activations as they are). Where
that kernel cannot be built, PyTorch's int8-weight kernel serves (``torch._weight_int8pack_mm``,
accumulated in float32) with the activations rounded to bfloat16, the one input dtype it has a
fast path for; that rounding costs about as much as the weights' own. More rows (a prompt) and
other devices multiply by the dequantised weight in the activations' dtype, which there is faster
than the kernels (both timings: ``docs/benchmarks.md``, "Measurements the code cites").

Token embeddings stay as they are (a lookup reads one row per token, not the matrix), and a tied
head gets an int8 copy of its own. Experts stored as tensors (a mixture of experts) stay as well.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from selfattn.generation.layout import many_rows
from selfattn.kernels import matvec

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # activations the kernels take (not float64)
KERNEL_ROWS = 32  # up to this many rows the int8 kernel beats the dequantised weight (both measured at 8 and 64)


class Int8Linear(nn.Module):
    """``x @ (scale · q).T + bias`` for an int8 ``q`` (out, in) and a float32 ``scale`` (out,)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach()
        scale = w.float().abs().amax(dim=1).clamp(min=1e-12) / 127  # (out,)
        q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.register_buffer("q", q.contiguous())  # (out, in) rows, as the kernels read them, whatever w's strides
        self.register_buffer("scale", scale)  # float32: cast to the activations' dtype per call
        # the few-row kernel: "matvec" (selfattn.kernels.matvec) where it builds, else "int8pack"
        self.kernel = "matvec" if matvec.failure() is None else "int8pack"
        if self.kernel == "int8pack":  # (only there: a compiled step checks every tensor of the model at each call)
            # its scales, cast once: a compiled decode step cannot feed the kernel a cast (a .to() of a model
            # may change this buffer's dtype: the .to(bfloat16) in forward is then a cast, else nothing)
            self.register_buffer("kernel_scale", scale.to(torch.bfloat16), persistent=False)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()  # (B·T, in)
        if rows.device.type == "cpu" and rows.shape[0] <= KERNEL_ROWS and rows.dtype in KERNEL_DTYPES:
            if self.kernel == "matvec":
                y = matvec.rows(self.q, rows, self.scale)
            else:
                y = torch._weight_int8pack_mm(rows.to(torch.bfloat16), self.q, self.kernel_scale.to(torch.bfloat16))
                y = y.to(rows.dtype)
        else:
            y = many_rows(rows, self.q.to(rows.dtype) * self.scale.to(rows.dtype)[:, None])
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def dequantized(self) -> Tensor:
        """The weight ``scale · q`` ``(out, in)`` in float32, as the many-row products use it (the loss of
        a quantized head: :meth:`selfattn.model.GPT.forward`)."""
        return self.q.float() * self.scale[:, None]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int8, kernel={self.kernel!r}")


@torch.no_grad()
def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every ``nn.Linear`` inside ``model`` by an :class:`Int8Linear` of its weight, in
    place; returns the model (for inference: the int8 weights take no gradient)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_int8 expects a torch module, got {type(model).__name__}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))
    return model
