"""A fused FlashAttention-2 kernel written from scratch in Triton (optional extra ``triton``).

Forward: one program per (query tile, batch * head) walks the key tiles its mask can show,
keeping a running max and sum (online softmax in base 2: ``scale * log2(e)`` is folded into
the scores so the kernel calls ``exp2``) and saves the log-sum-exp per query. Backward
recomputes the weights from that log-sum-exp: ``delta = rowsum(dO * O)`` first, then

- dK, dV: one program per (key tile, batch * kv head) walks the query tiles that can see
  it, for each of the H / Hkv query heads sharing the kv head (GQA/MQA without copying or
  expanding K and V, and no reduction over heads afterwards);
- dQ: a second kernel, one program per (query tile, batch * head) walking its key tiles.
  We chose this over atomic adds into dQ from the dK/dV kernel: it recomputes Q·Kᵀ and
  dO·Vᵀ once more (7 matmuls per tile pair instead of 5), but needs no float32 dQ buffer
  and no atomics, so gradients are deterministic, bit for bit from run to run.

Masks (:mod:`selfattn.masks`): causal aligned bottom-right (query i at key position
``S - T + i``), sliding window, key padding and document ids (per-key loads), GQA/MQA.
Each program walks only the tiles the mask's block map lists for its batch row
(:meth:`Mask.blocks`, FlexAttention's ``kv_num_blocks``/``kv_indices`` idea): partial tiles
with the mask, full tiles without it; hidden tiles (causality, window, padding, other
documents) are never loaded. A row that sees nothing outputs zeros, with zero
gradients. Head dims 1..128 (padded inside the kernel to a power of two >= 16); float16
and bfloat16 are multiplied as they are and accumulated in float32, softmax statistics in
float32; float32 inputs use IEEE float32 dot products (no TF32: pick float32 for
accuracy, a half type for speed). Dropout and float64 are refused by :func:`unsupported`.

On the CPU the kernels run only under Triton's interpreter: ``TRITON_INTERPRET=1`` set
before Triton is first imported (tests do this in a subprocess). ``torch.compile`` sees
the forward and the backward each as one op: ``torch.ops.selfattn.triton_attention`` and
``torch.ops.selfattn.triton_attention_backward`` (``torch.library`` custom ops, their
autograd link registered with ``register_autograd``, the custom-op form of an
``autograd.Function``).
"""
from typing import Optional

import torch
from torch import Tensor

try:
    import triton
except ImportError as e:  # the optional extra is missing
    raise ImportError("backend 'triton' needs Triton: pip install 'selfattn[triton]'") from e

from selfattn.backends.triton_kernels import (
    INTERPRET,
    INTERPRET_BLOCK,
    MAP,
    bwd_delta_kernel,
    bwd_dkdv_kernel,
    bwd_dq_kernel,
    fwd_kernel,
)
from selfattn.masks import FULL, PARTIAL, BlockMap, Mask
from selfattn.scores import Scores

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 128
LOG2E = 1.4426950408889634
MAP_BLOCK = INTERPRET_BLOCK if INTERPRET else MAP  # the block map's tile for the kernels
RETURNS_WEIGHTS = False


def available(device: torch.device) -> str | None:
    """A CUDA device, or the CPU under Triton's interpreter."""
    if device.type == "cuda" and torch.cuda.is_available():
        return None
    if device.type == "cpu" and INTERPRET:
        return None
    return (f"needs a CUDA device, or the CPU under Triton's interpreter (TRITON_INTERPRET=1 set before triton "
            f"is imported); {device} is neither")


def unsupported(q: Tensor, k: Tensor, v: Tensor, mask: Mask, dropout_p: float,
                scores: Scores | None = None) -> str | None:
    """Why the kernel cannot serve this request, or None when it can."""
    extras = [name for name, on in (("mask_mod", mask.mask_mod is not None),
                                    ("prefix_len", mask.prefix_len is not None),
                                    ("sink_tokens", mask.sink_tokens is not None),
                                    ("score rules (ALiBi, softcap, score_mod, sinks)",
                                     scores is not None and not scores.is_plain)) if on]
    if extras:
        return f"{', '.join(extras)}: not in the Triton kernel yet; use 'tiled' (any device) or 'flex' (GPU)"
    if dropout_p > 0.0:
        return f"dropout is not implemented in the Triton kernel (dropout_p={dropout_p}); use 'math' or 'sdpa'"
    if q.dtype not in DTYPES:
        return f"dtype {q.dtype} is not supported (float16, bfloat16 or float32)"
    D = q.shape[-1]
    if not 1 <= D <= MAX_HEAD_DIM:
        return f"head dim D={D} is not supported (1 <= D <= {MAX_HEAD_DIM})"
    if q.device.type != "cuda" and not INTERPRET:
        return (f"tensors on {q.device} need a GPU; on the CPU the kernel runs only under Triton's "
                f"interpreter (TRITON_INTERPRET=1 set before triton is imported)")
    span = max(t.shape[2] * t.stride(2) + t.shape[3] * t.stride(3) for t in (q, k, v))
    if span >= 2**31:
        return f"one head spans {span} elements, beyond the kernel's 32-bit in-head offsets"
    return None


def run(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, scale: float, dropout_p: float = 0.0,
        scores: Scores | None = None) -> Tensor:
    why = unsupported(q, k, v, mask, dropout_p, scores)
    if why:
        raise ValueError(f"backend 'triton' cannot serve this request: {why}")
    window = None if mask.window is None else min(mask.window, k.shape[2])  # a window >= S is plain causal
    out, _ = torch.ops.selfattn.triton_attention(q, k, v, mask.key_padding_mask, mask.doc_ids, float(scale),
                                                 mask.causal or window is not None, window)
    return out  # (B, H, T, D)


@torch.library.custom_op("selfattn::triton_attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], doc_ids: Optional[Tensor],
                 scale: float, causal: bool, window: Optional[int]) -> tuple[Tensor, Tensor]:
    """The forward: output ``(B, H, T, D)`` and the base-2 log-sum-exp ``(B, H, T)`` float32
    (``+inf`` on rows that see nothing)."""
    B, H, T, D = q.shape
    out = torch.empty_like(q)  # (B, H, T, D)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)  # (B, H, T)
    if q.numel() == 0:
        return out, lse
    args = _Launch(q, k, key_padding_mask, doc_ids, scale, causal, window)
    fwd_kernel[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)](
        q, k, v, out, lse, args.kpm, args.doc, *args.kv[0], *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        *args.mask_strides, *args.kv[1], *args.sizes, **args.constants)
    return out, lse


@attention_op.register_fake
def _(q, k, v, key_padding_mask, doc_ids, scale, causal, window):
    B, H, T, D = q.shape
    return torch.empty_like(q), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("selfattn::triton_attention_backward", mutates_args=())
def attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          key_padding_mask: Optional[Tensor], doc_ids: Optional[Tensor], scale: float,
                          causal: bool, window: Optional[int]) -> tuple[Tensor, Tensor, Tensor]:
    """dq ``(B, H, T, D)``, dk and dv ``(B, Hkv, S, D)`` from the saved output and log-sum-exp."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if q.numel() == 0:
        return dq, dk.zero_(), dv.zero_()
    args = _Launch(q, k, key_padding_mask, doc_ids, scale, causal, window)
    delta = torch.empty_like(lse)  # (B, H, T)
    block = INTERPRET_BLOCK if INTERPRET else 128
    bwd_delta_kernel[(triton.cdiv(T, block), B * H)](
        out, dout, delta, *out.stride(), *dout.stride(), H, T, D=D, BLOCK_D=args.constants["BLOCK_D"],
        BLOCK_M=block)
    bwd_dq_kernel[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)](
        q, k, v, dout, dq, lse, delta, args.kpm, args.doc, *args.kv[0], *q.stride(), *k.stride(), *v.stride(),
        *dout.stride(), *dq.stride(), *args.mask_strides, *args.kv[1], *args.sizes_bwd, **args.constants)
    bwd_dkdv_kernel[lambda meta: (triton.cdiv(S, meta["BLOCK_N"]), B * Hkv)](
        q, k, v, dout, dk, dv, lse, delta, args.kpm, args.doc, *args.q[0], *q.stride(), *k.stride(), *v.stride(),
        *dout.stride(), *dk.stride(), *dv.stride(), *args.mask_strides, *args.q[1], *args.sizes_bwd,
        **args.constants)
    return dq, dk, dv


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, key_padding_mask, doc_ids, scale, causal, window):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _Launch:
    """The arguments the three tiled kernels share, derived once from a request."""

    def __init__(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], doc_ids: Optional[Tensor],
                 scale: float, causal: bool, window: Optional[int]):
        B, H, T, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        # Absent masks pass q as a placeholder pointer that the kernels never read.
        self.kpm = q if key_padding_mask is None else key_padding_mask.view(torch.uint8)  # (B, S)
        self.doc = q if doc_ids is None else doc_ids  # (B, S)
        self.mask_strides = (*(key_padding_mask.stride() if key_padding_mask is not None else (0, 0)),
                             *(doc_ids.stride() if doc_ids is not None else (0, 0)))
        W = 0 if window is None else window
        self.kv, self.q = _block_lists(Mask(causal, window, key_padding_mask, doc_ids), B, T, S, q.device)
        buckets = (triton.next_power_of_2(T), triton.next_power_of_2(S))  # autotuning keys
        self.sizes = (H, H // Hkv, T, S, W, scale * LOG2E, *buckets)
        self.sizes_bwd = (H, H // Hkv, T, S, W, scale, scale * LOG2E, *buckets)
        self.constants = dict(
            CAUSAL=causal, HAS_WINDOW=window is not None, HAS_KPM=key_padding_mask is not None,
            HAS_DOC=doc_ids is not None, D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), MAP_BLOCK=MAP_BLOCK,
            # input_precision matters only for float32 operands; half types keep Triton's default.
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def _block_lists(mask: Mask, B: int, T: int, S: int, device) -> tuple[tuple, tuple]:
    """The kernels' block lists: (tensors, strides) per key tile for the query-tile kernels, and
    per query tile for the dK/dV kernel. A map tile that is FULL but reaches past T or S (the
    ragged last row or column) is walked as PARTIAL, so mask-free tiles never need bounds."""
    blocks = mask.blocks(T, S, MAP_BLOCK, MAP_BLOCK)
    kind = blocks.kind.to(device)  # (B or 1, nq, nk)
    if T % MAP_BLOCK:
        kind[:, -1][kind[:, -1] == FULL] = PARTIAL
    if S % MAP_BLOCK:
        kind[:, :, -1][kind[:, :, -1] == FULL] = PARTIAL
    out = []
    for lists in (BlockMap(kind, MAP_BLOCK, MAP_BLOCK), BlockMap(kind, MAP_BLOCK, MAP_BLOCK).transposed()):
        (num, idx), (full_num, full_idx) = lists.lists(PARTIAL), lists.lists(FULL)
        batch = (lambda t: 0 if t.shape[0] == 1 else t.stride(0))  # one map for every batch row: stride 0
        out.append(((num, idx, full_num, full_idx), (batch(num), num.stride(1), batch(idx), idx.stride(1))))
    return out[0], out[1]


def _setup_context(ctx, inputs, output):
    q, k, v, key_padding_mask, doc_ids, scale, causal, window = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, doc_ids)
    ctx.scale, ctx.causal, ctx.window = scale, causal, window


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, key_padding_mask, doc_ids = ctx.saved_tensors
    dq, dk, dv = torch.ops.selfattn.triton_attention_backward(
        dout, q, k, v, out, lse, key_padding_mask, doc_ids, ctx.scale, ctx.causal, ctx.window)
    return dq, dk, dv, None, None, None, None, None


attention_op.register_autograd(_backward, setup_context=_setup_context)
