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
``S - T + i``), sliding window with sink tokens, prefix-LM, key padding and document ids
(per-key loads), GQA/MQA. Score rules (:mod:`selfattn.scores`) as compile-time flags: ALiBi,
soft-capping (its ``1 - tanh^2`` in the backward) and learned sinks (a gradient for the sink
logits; none for ALiBi slopes, which are refused when they require one). A user ``mask_mod``
or ``score_mod`` is a Python function, which a compiled kernel cannot call: refused, with
``tiled`` or ``flex`` named instead.
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
LN2 = 0.6931471805599453  # 1 / log2(e)
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
                                    ("score_mod", scores is not None and scores.score_mod is not None)) if on]
    if extras:
        return (f"a {' and a '.join(extras)} (Python functions) cannot run inside the compiled kernel; use 'tiled' "
                f"(any device) or 'flex' (GPU)")
    slopes = None if scores is None else scores.alibi_slopes
    if slopes is not None and slopes.requires_grad and torch.is_grad_enabled():
        return "the kernel computes no gradient for ALiBi slopes (learned sinks do get theirs); use 'math' for that"
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
    scores = scores or Scores()
    window = None if mask.window is None else min(mask.window, k.shape[2])  # a window >= S is plain causal
    slopes = None if scores.alibi_slopes is None else scores.alibi_slopes.detach()
    out, _ = torch.ops.selfattn.triton_attention(
        q, k, v, mask.key_padding_mask, mask.doc_ids, mask.prefix_len, slopes, scores.sinks, float(scale),
        mask.causal or window is not None, window, mask.sink_tokens if window is not None else None, scores.softcap,
        k.shape[2] - q.shape[2], 0)
    return out  # (B, H, T, D)


def forward_with_lse(q: Tensor, k: Tensor, v: Tensor, mask: Mask, *, scale: float, q_start: int | None = None,
                     k_start: int = 0) -> tuple[Tensor, Tensor]:
    """:func:`selfattn.backends.tiled.forward_with_lse` in the kernel (ring attention on a GPU):
    out ``(B, H, T, D)`` and the natural-log lse ``(B, H, T, 1)``, -inf on rows that see no key
    here. The queries and keys sit at ``q_start`` (default ``S - T``) and ``k_start`` of the
    sequence ``mask`` speaks of; its padding and document ids cover that whole sequence."""
    q_start = k.shape[2] - q.shape[2] if q_start is None else q_start
    out, lse2 = torch.ops.selfattn.triton_attention(
        q, k, v, mask.key_padding_mask, mask.doc_ids, None, None, None, float(scale),
        mask.causal or mask.window is not None, mask.window, None, None, q_start, k_start)
    lse = torch.where(lse2.isinf(), float("-inf"), lse2 * LN2)  # base 2, +inf when empty -> natural, -inf
    return out, lse[..., None]


def backward_from_lse(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, grad_out: Tensor, mask: Mask, *,
                      scale: float, q_start: int | None = None, k_start: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`selfattn.backends.tiled.backward_from_lse` in the kernel: (dq, dk, dv) of these keys'
    share, from ``out`` and ``lse`` ``(B, H, T, 1)`` of the whole attention (every key block merged)."""
    q_start = k.shape[2] - q.shape[2] if q_start is None else q_start
    lse2 = torch.where(lse.isinf(), float("inf"), lse * LOG2E)[..., 0].float().contiguous()  # (B, H, T) base 2
    dq, dk, dv, _ = torch.ops.selfattn.triton_attention_backward(
        grad_out.to(q.dtype), q, k, v, out, lse2, mask.key_padding_mask, mask.doc_ids, None, None, None,
        float(scale), mask.causal or mask.window is not None, mask.window, None, None, q_start, k_start)
    return dq, dk, dv


@torch.library.custom_op("selfattn::triton_attention", mutates_args=())
def attention_op(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Optional[Tensor], doc_ids: Optional[Tensor],
                 prefix_len: Optional[Tensor], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], scale: float,
                 causal: bool, window: Optional[int], sink_tokens: Optional[int], softcap: Optional[float],
                 q_start: int, k_start: int) -> tuple[Tensor, Tensor]:
    """The forward: output ``(B, H, T, D)`` and the base-2 log-sum-exp ``(B, H, T)`` float32
    (``+inf`` on rows that see nothing and have no sink). Queries and keys sit at positions
    ``q_start + i`` and ``k_start + j`` of the sequence the padding and document ids cover."""
    B, H, T, D = q.shape
    out = torch.empty_like(q)  # (B, H, T, D)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)  # (B, H, T)
    if q.numel() == 0:
        return out, lse
    args = _Launch(q, k, key_padding_mask, doc_ids, prefix_len, alibi_slopes, sinks, scale, causal, window,
                   sink_tokens, softcap, q_start, k_start)
    fwd_kernel[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)](
        q, k, v, out, lse, *args.rules, args.sinks, *args.kv[0], *q.stride(), *k.stride(), *v.stride(),
        *out.stride(), *args.rule_strides, *args.kv[1], *args.sizes, **args.constants, HAS_SINKS=sinks is not None)
    return out, lse


@attention_op.register_fake
def _(q, k, v, key_padding_mask, doc_ids, prefix_len, alibi_slopes, sinks, scale, causal, window, sink_tokens,
      softcap, q_start, k_start):
    B, H, T, D = q.shape
    return torch.empty_like(q), q.new_empty(B, H, T, dtype=torch.float32)


@torch.library.custom_op("selfattn::triton_attention_backward", mutates_args=())
def attention_backward_op(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          key_padding_mask: Optional[Tensor], doc_ids: Optional[Tensor], prefix_len: Optional[Tensor],
                          alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], scale: float, causal: bool,
                          window: Optional[int], sink_tokens: Optional[int], softcap: Optional[float],
                          q_start: int, k_start: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq ``(B, H, T, D)``, dk and dv ``(B, Hkv, S, D)`` from the saved output and log-sum-exp,
    and d sinks ``(H,)`` (empty without sinks)."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    dsinks = q.new_zeros(0) if sinks is None else torch.zeros_like(sinks)
    if q.numel() == 0:
        return dq, dk.zero_(), dv.zero_(), dsinks
    args = _Launch(q, k, key_padding_mask, doc_ids, prefix_len, alibi_slopes, sinks, scale, causal, window,
                   sink_tokens, softcap, q_start, k_start)
    delta = torch.empty_like(lse)  # (B, H, T)
    block = INTERPRET_BLOCK if INTERPRET else 128
    bwd_delta_kernel[(triton.cdiv(T, block), B * H)](
        out, dout, delta, *out.stride(), *dout.stride(), H, T, D=D, BLOCK_D=args.constants["BLOCK_D"],
        BLOCK_M=block)
    bwd_dq_kernel[lambda meta: (triton.cdiv(T, meta["BLOCK_M"]), B * H)](
        q, k, v, dout, dq, lse, delta, *args.rules, *args.kv[0], *q.stride(), *k.stride(), *v.stride(),
        *dout.stride(), *dq.stride(), *args.rule_strides, *args.kv[1], *args.sizes, **args.constants)
    bwd_dkdv_kernel[lambda meta: (triton.cdiv(S, meta["BLOCK_N"]), B * Hkv)](
        q, k, v, dout, dk, dv, lse, delta, *args.rules, *args.q[0], *q.stride(), *k.stride(), *v.stride(),
        *dout.stride(), *dk.stride(), *dv.stride(), *args.rule_strides, *args.q[1], *args.sizes, **args.constants)
    if sinks is not None:  # d sink_h = -sum over h's rows of p_sink * delta (the sink's value is zero)
        p_sink = torch.exp2(args.sinks[None, :, None] - lse)  # (B, H, T)
        dsinks = -(p_sink * delta).sum(dim=(0, 2)).to(sinks.dtype)
    return dq, dk, dv, dsinks


@attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, key_padding_mask, doc_ids, prefix_len, alibi_slopes, sinks, scale, causal, window,
      sink_tokens, softcap, q_start, k_start):
    dsinks = q.new_empty(0) if sinks is None else torch.empty_like(sinks)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


class _Launch:
    """The arguments the three tiled kernels share, derived once from a request."""

    def __init__(self, q: Tensor, k: Tensor, key_padding_mask: Optional[Tensor], doc_ids: Optional[Tensor],
                 prefix_len: Optional[Tensor], alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], scale: float,
                 causal: bool, window: Optional[int], sink_tokens: Optional[int], softcap: Optional[float],
                 q_start: int, k_start: int):
        B, H, T, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        # Absent masks and rules pass q as a placeholder pointer that the kernels never read.
        kpm = q if key_padding_mask is None else key_padding_mask.view(torch.uint8)  # (B, S)
        prefix = q if prefix_len is None else prefix_len.to(q.device, torch.int64).contiguous()  # (B,) or (1,)
        slopes = q if alibi_slopes is None else alibi_slopes.to(q.device, torch.float32).contiguous()  # (H,)
        self.rules = (kpm, q if doc_ids is None else doc_ids, prefix, slopes)
        self.rule_strides = (*(key_padding_mask.stride() if key_padding_mask is not None else (0, 0)),
                             *(doc_ids.stride() if doc_ids is not None else (0, 0)),
                             0 if prefix_len is None or prefix_len.numel() == 1 else 1)  # one prefix for all rows: 0
        self.sinks = q if sinks is None else (sinks.detach().float() * LOG2E).contiguous()  # (H,) exp2 domain
        mask = Mask(causal, window, key_padding_mask, doc_ids, sink_tokens=sink_tokens, prefix_len=prefix_len)
        self.kv, self.q = _block_lists(mask, B, T, S, q_start, k_start, q.device)
        buckets = (triton.next_power_of_2(T), triton.next_power_of_2(S))  # autotuning keys
        self.sizes = (H, H // Hkv, T, S, q_start, k_start, 0 if window is None else window, sink_tokens or 0, scale,
                      scale * LOG2E, softcap or 1.0, *buckets)
        self.constants = dict(
            CAUSAL=causal, HAS_WINDOW=window is not None, HAS_KPM=key_padding_mask is not None,
            HAS_DOC=doc_ids is not None, HAS_PREFIX=prefix_len is not None, HAS_ALIBI=alibi_slopes is not None,
            HAS_SOFTCAP=softcap is not None, D=D, BLOCK_D=max(16, triton.next_power_of_2(D)), MAP_BLOCK=MAP_BLOCK,
            # input_precision matters only for float32 operands; half types keep Triton's default.
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")


def _block_lists(mask: Mask, B: int, T: int, S: int, q_start: int, k_start: int, device) -> tuple[tuple, tuple]:
    """The kernels' block lists: (tensors, strides) per key tile for the query-tile kernels, and
    per query tile for the dK/dV kernel. A map tile that is FULL but reaches past T or S (the
    ragged last row or column) is walked as PARTIAL, so mask-free tiles never need bounds."""
    blocks = mask.blocks(T, S, MAP_BLOCK, MAP_BLOCK, q_start, k_start)
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
    q, k, v, key_padding_mask, doc_ids, prefix_len, alibi_slopes, sinks, *options = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, doc_ids, prefix_len, alibi_slopes, sinks)
    ctx.options = options  # scale, causal, window, sink_tokens, softcap, q_start, k_start


def _backward(ctx, dout, _dlse):
    *saved, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = torch.ops.selfattn.triton_attention_backward(dout, *saved, sinks, *ctx.options)
    return dq, dk, dv, None, None, None, None, None if sinks is None else dsinks, *[None] * len(ctx.options)


attention_op.register_autograd(_backward, setup_context=_setup_context)
