"""The Triton kernels of the ``triton`` backend: FlashAttention-2 forward and backward.

Imported only by :mod:`selfattn.backends.triton`, which checks that Triton is installed,
validates the request and launches these. Layouts (any strides): q, o, dq ``(B, H, T, D)``;
k, v, dk, dv ``(B, Hkv, S, D)``; lse and delta ``(B, H, T)`` float32, contiguous.
Key padding and document ids ``(B, L)``, indexed by position in the sequence the mask speaks of.

Conventions inside the kernels:
- query i sits at position ``p = Q_START + i`` and key j at ``m = K_START + j`` of that sequence
  (by default ``Q_START = S - T``, ``K_START = 0``, ``L = S``: bottom-right causal alignment; ring
  attention passes where its blocks lie); loads of Q, K and V use i and j, the mask p and m;
- scores live in the exp2 domain: ``s = (q . k) * scale * log2(e)``, so softmax uses
  ``exp2`` and the saved log-sum-exp ``lse = m + log2(l)`` is in base 2 as well;
- a row that sees no key keeps ``m = -inf`` and ``l = 0``: its output is 0 and its lse is
  ``+inf``, so the backward's ``exp2(s - lse)`` is 0 there (never NaN, and no finite
  sentinel that a fully masked row would turn into weight 1);
- the score rules (:mod:`selfattn.scores`) are compile-time flags: ALiBi subtracts
  ``slope_h * (p - m)`` from the natural-unit score, soft-capping maps it to ``c * tanh(score / c)``
  (the backward multiplies dS by ``1 - tanh^2``), and learned sinks join each row's
  denominator at the end of the forward (their gradient, from lse and delta, is the host's);
  prefix-LM and sink tokens are part of the mask predicate;
- the head dim D is padded to BLOCK_D (a power of two >= 16) by masked loads;
- each program visits only the tiles its block lists name (the mask's block map,
  :meth:`selfattn.masks.Mask.blocks`, at MAP x MAP tiles, per batch row): the PARTIAL ones
  with the mask applied, the FULL ones without; HIDDEN tiles are never loaded. The kernel's
  own tiles (BLOCK_M x BLOCK_N, chosen by the autotuner) divide MAP, so each map tile is a
  few kernel tiles. Forward and dQ walk key tiles per query tile (lists ``kv``), dK/dV walk
  query tiles per key tile (lists ``q``, the transpose).
"""
import torch
import triton
import triton.language as tl

INTERPRET = bool(triton.knobs.runtime.interpret)  # read once, as triton.jit does at decoration
INTERPRET_BLOCK = 16  # small tiles under the interpreter: short tests still cross many tile edges

# Tile candidates (BLOCK_M, BLOCK_N, num_warps, num_stages) for the GPU autotuner, from the
# Triton fused-attention tutorial's Hopper search space, kept short because every candidate
# is compiled once per mask kind, head dim and dtype (seconds each). Retuned per power-of-two
# bucket of T and of S (a generation loop tunes once per bucket, not once per step); the
# autotuner adds the tensors' dtypes to the key. T_BUCKET and S_BUCKET are kernel arguments
# only the autotuner reads. float32 gets one small tile: its IEEE dot products compile to
# FMA loops, minutes to compile with large tiles (the accuracy path, not the fast one).
FWD_TILES = [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3)]
DQ_TILES = [(128, 32, 4, 3), (64, 64, 4, 2)]
DKDV_TILES = [(32, 128, 4, 3), (64, 64, 4, 2)]
FLOAT32_TILES = [(32, 32, 4, 2)]
TUNING_KEY = ["D", "CAUSAL", "HAS_WINDOW", "HAS_KPM", "HAS_DOC", "HAS_PREFIX", "HAS_ALIBI", "HAS_SOFTCAP",
              "T_BUCKET", "S_BUCKET"]
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
MAP = 128  # the block map's tile (INTERPRET_BLOCK under the interpreter): every BLOCK_M and BLOCK_N divides it
assert all(MAP % m == 0 and MAP % n == 0 for m, n, _, _ in FWD_TILES + DQ_TILES + DKDV_TILES + FLOAT32_TILES)


def _configs(tiles):
    """Autotuner configs; under the interpreter one fixed small tile (one config: no benchmarking)."""
    if INTERPRET:
        tiles = [(INTERPRET_BLOCK, INTERPRET_BLOCK, 1, 1)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in tiles]


def _prune(configs, named_args, **kwargs):
    """float32 inputs: only the small tile (see FLOAT32_TILES)."""
    return _configs(FLOAT32_TILES) if named_args["Q"].dtype == torch.float32 else configs


def _autotune(tiles):
    return triton.autotune(configs=_configs(tiles), key=TUNING_KEY, prune_configs_by={"early_config_prune": _prune})

@triton.jit
def _visible(p, n, KPM, DOC, doc_q, skpm_s, sdoc_s, S, p_end, k_start, W, sink_n, prefix,
             CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DOC: tl.constexpr):
    """The mask predicate on a tile: p (query positions) and n (key indices, at positions
    k_start + n) broadcast against each other; doc_q has p's shape. Keys past S and rows past
    the end (p >= p_end) are hidden too. The first sink_n keys stay inside the window; keys
    before ``prefix`` (0: none) are visible to every query."""
    inside = (n < S) & (p < p_end)
    m = k_start + n  # key positions
    ok = inside
    if CAUSAL:
        ok = ok & (m <= p)
    if HAS_WINDOW:
        ok = ok & ((m > p - W) | (m < sink_n))
    ok = ok | (inside & (m < prefix))
    if HAS_KPM:
        ok = ok & (tl.load(KPM + m * skpm_s, mask=n < S, other=0) != 0)
    if HAS_DOC:
        ok = ok & (tl.load(DOC + m * sdoc_s, mask=n < S, other=0) == doc_q)
    return ok


@triton.jit
def _scores(qk, p, m, scale, qk_scale, slope, cap, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """A tile's scores in the exp2 domain from its dot products qk, with query and key
    positions p and m broadcasting against it, and dS_raw / dS for the backward
    (soft-capping's 1 - tanh^2, else 1)."""
    dcap = 1.0
    if HAS_ALIBI or HAS_SOFTCAP:
        s = qk * scale  # natural units
        if HAS_ALIBI:
            s = s - slope * (p - m).to(tl.float32)
        if HAS_SOFTCAP:
            t = 2.0 * tl.sigmoid(2.0 * s / cap) - 1.0  # tanh(s / cap)
            s = cap * t
            dcap = 1.0 - t * t
        s = s * LOG2E
    else:
        s = qk * qk_scale  # scale * log2(e) folded into one multiply
    return s, dcap


@triton.jit
def _key_tile(q, p, doc_q, n0, K, V, KPM, DOC, sk_s, sk_d, sv_s, sv_d, skpm_s, sdoc_s, S, p_end, k_start, W, sink_n,
              prefix, scale, qk_scale, slope, cap, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
              HAS_WINDOW: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DOC: tl.constexpr, HAS_ALIBI: tl.constexpr,
              HAS_SOFTCAP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              DOT_PRECISION: tl.constexpr):
    """Load the key tile [n0, n0 + BLOCK_N) of K and V, each (BN, BD), and score the query
    tile q against it: s (BM, BN) in the exp2 domain, -inf where the mask hides a pair, and
    its soft-capping derivative (see _scores)."""
    offs_d = tl.arange(0, BLOCK_D)
    n = n0 + tl.arange(0, BLOCK_N)
    kv_mask = offs_d[None, :] < D
    if MASKED:  # mask-free tiles lie wholly inside [0, S)
        kv_mask = kv_mask & (n[:, None] < S)
    k = tl.load(K + n[:, None] * sk_s + offs_d[None, :] * sk_d, mask=kv_mask, other=0.0)  # (BN, BD)
    v = tl.load(V + n[:, None] * sv_s + offs_d[None, :] * sv_d, mask=kv_mask, other=0.0)  # (BN, BD)
    s, dcap = _scores(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), p[:, None], k_start + n[None, :],
                      scale, qk_scale, slope, cap, HAS_ALIBI, HAS_SOFTCAP)  # (BM, BN)
    if MASKED:
        ok = _visible(p[:, None], n[None, :], KPM, DOC, doc_q[:, None], skpm_s, sdoc_s, S, p_end, k_start, W,
                      sink_n, prefix, CAUSAL, HAS_WINDOW, HAS_KPM, HAS_DOC)
        s = tl.where(ok, s, float("-inf"))
    return k, v, s, dcap


@triton.jit
def _fwd_tiles(acc, l_i, m_i, q, p, doc_q, K, V, KPM, DOC, sk_s, sk_d, sv_s, sv_d, skpm_s, sdoc_s,
               S, p_end, k_start, W, sink_n, prefix, scale, qk_scale, slope, cap, start, stop,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KPM: tl.constexpr,
               HAS_DOC: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, D: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax over the key tiles [start, stop): running max m_i, sum l_i, output acc."""
    for n0 in range(start, stop, BLOCK_N):
        k, v, s, _ = _key_tile(q, p, doc_q, n0, K, V, KPM, DOC, sk_s, sk_d, sv_s, sv_d, skpm_s, sdoc_s, S, p_end,
                               k_start, W, sink_n, prefix, scale, qk_scale, slope, cap, MASKED, CAUSAL, HAS_WINDOW,
                               HAS_KPM, HAS_DOC, HAS_ALIBI, HAS_SOFTCAP, D, BLOCK_N, BLOCK_D, DOT_PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing seen yet: exp2(-inf) = 0
        alpha = tl.exp2(m_i - m_use)
        pr = tl.exp2(s - m_use[:, None])  # (BM, BN)
        l_i = l_i * alpha + tl.sum(pr, 1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _query_tile(Q, K, V, KPM, DOC, PREFIX, SLOPES, NUM, IDX, FULL_NUM, FULL_IDX, sq_b, sq_h, sq_t, sq_d, sk_b, sk_h,
                sv_b, sv_h, skpm_b, sdoc_b, sdoc_s, sprefix_b, snum_b, snum_r, sidx_b, sidx_r, H, GROUP, T, Q_START,
                HAS_DOC: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_ALIBI: tl.constexpr, D: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MAP_BLOCK: tl.constexpr):
    """What the two query-tile kernels (forward and dQ) set up alike: this program's batch
    row b, head h and query rows i (at positions p), the q tile, K/V/KPM/DOC moved to the
    batch row and key/value head, the queries' document ids, the row's prefix length and the
    head's ALiBi slope (0 when off), and the block lists (partial, full) of the map row
    holding these queries."""
    tl.static_assert(MAP_BLOCK % BLOCK_M == 0, "query tiles must divide the block map's tiles")
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // GROUP  # GQA: query head h reads key/value head h // (H / Hkv), nothing copied
    i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p = Q_START + i  # query positions
    offs_d = tl.arange(0, BLOCK_D)
    q_mask = (i[:, None] < T) & (offs_d[None, :] < D)
    q = tl.load(Q + b * sq_b + h * sq_h + i[:, None] * sq_t + offs_d[None, :] * sq_d, mask=q_mask, other=0.0)
    DOC += b * sdoc_b
    doc_q = tl.zeros([BLOCK_M], dtype=tl.int32)
    if HAS_DOC:
        doc_q = tl.load(DOC + p * sdoc_s, mask=i < T, other=0)
    prefix = 0
    if HAS_PREFIX:
        prefix = tl.load(PREFIX + b * sprefix_b)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h)
    row = pid_m * BLOCK_M // MAP_BLOCK  # the map row of these queries
    num, idx = b * snum_b + row * snum_r, b * sidx_b + row * sidx_r
    return (b, h, i, p, offs_d, q_mask, q, K + b * sk_b + hk * sk_h, V + b * sv_b + hk * sv_h, KPM + b * skpm_b, DOC,
            doc_q, prefix, slope, NUM + num, IDX + idx, FULL_NUM + num, FULL_IDX + idx)


@_autotune(FWD_TILES)
@triton.jit
def fwd_kernel(Q, K, V, O, LSE, KPM, DOC, PREFIX, SLOPES, SINKS, NUM, IDX, FULL_NUM, FULL_IDX,
               sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
               so_b, so_h, so_t, so_d, skpm_b, skpm_s, sdoc_b, sdoc_s, sprefix_b, snum_b, snum_r, sidx_b, sidx_r,
               H, GROUP, T, S, Q_START, K_START, W, sink_n, scale, qk_scale, cap, T_BUCKET, S_BUCKET,
               CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DOC: tl.constexpr,
               HAS_PREFIX: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
               D: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, MAP_BLOCK: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, batch * head): O and LSE for BLOCK_M queries."""
    b, h, i, p, offs_d, q_mask, q, K, V, KPM, DOC, doc_q, prefix, slope, NUM, IDX, FULL_NUM, FULL_IDX = _query_tile(
        Q, K, V, KPM, DOC, PREFIX, SLOPES, NUM, IDX, FULL_NUM, FULL_IDX, sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sv_b, sv_h,
        skpm_b, sdoc_b, sdoc_s, sprefix_b, snum_b, snum_r, sidx_b, sidx_r, H, GROUP, T, Q_START, HAS_DOC, HAS_PREFIX,
        HAS_ALIBI, D, BLOCK_D, BLOCK_M, MAP_BLOCK)
    p_end = Q_START + T
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for jj in range(0, tl.load(NUM)):  # the partial tiles: masked
        n0 = tl.load(IDX + jj) * MAP_BLOCK
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, p, doc_q, K, V, KPM, DOC, sk_s, sk_d, sv_s, sv_d, skpm_s,
                                   sdoc_s, S, p_end, K_START, W, sink_n, prefix, scale, qk_scale, slope, cap, n0,
                                   n0 + MAP_BLOCK, True, CAUSAL, HAS_WINDOW, HAS_KPM, HAS_DOC, HAS_ALIBI,
                                   HAS_SOFTCAP, D, BLOCK_N, BLOCK_D, DOT_PRECISION)
    for jj in range(0, tl.load(FULL_NUM)):  # the full tiles: no mask
        n0 = tl.load(FULL_IDX + jj) * MAP_BLOCK
        acc, l_i, m_i = _fwd_tiles(acc, l_i, m_i, q, p, doc_q, K, V, KPM, DOC, sk_s, sk_d, sv_s, sv_d, skpm_s,
                                   sdoc_s, S, p_end, K_START, W, sink_n, prefix, scale, qk_scale, slope, cap, n0,
                                   n0 + MAP_BLOCK, False, CAUSAL, HAS_WINDOW, HAS_KPM, HAS_DOC, HAS_ALIBI,
                                   HAS_SOFTCAP, D, BLOCK_N, BLOCK_D, DOT_PRECISION)

    if HAS_SINKS:  # the head's sink logit joins the denominator and carries no value
        sink = tl.load(SINKS + h)  # exp2 domain
        m_f = tl.maximum(m_i, sink)
        keys = tl.exp2(m_i - m_f)  # 0 on a row that saw no key
        l_f = l_i * keys + tl.exp2(sink - m_f)
        o = acc * (keys / l_f)[:, None]
        lse = m_f + tl.log2(l_f)
    else:
        empty = l_i == 0.0  # the row saw no key: output 0, lse +inf
        l_safe = tl.where(empty, 1.0, l_i)
        o = acc / l_safe[:, None]
        lse = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
    tl.store(O + b * so_b + h * so_h + i[:, None] * so_t + offs_d[None, :] * so_d, o.to(O.dtype.element_ty),
             mask=q_mask)
    tl.store(LSE + (b * H + h) * T + i, lse, mask=i < T)


@triton.jit
def bwd_delta_kernel(O, DO, DELTA, so_b, so_h, so_t, so_d, sdo_b, sdo_h, sdo_t, sdo_d, H, T,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O), the softmax backward's correction term, per query."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    i = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (i[:, None] < T) & (offs_d[None, :] < D)
    o = tl.load(O + b * so_b + h * so_h + i[:, None] * so_t + offs_d[None, :] * so_d, mask=mask, other=0.0)
    do = tl.load(DO + b * sdo_b + h * sdo_h + i[:, None] * sdo_t + offs_d[None, :] * sdo_d, mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * T + i, delta, mask=i < T)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, p, doc_q, K, V, KPM, DOC, sk_s, sk_d, sv_s, sv_d, skpm_s, sdoc_s,
              S, p_end, k_start, W, sink_n, prefix, scale, qk_scale, slope, cap, start, stop,
              MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KPM: tl.constexpr,
              HAS_DOC: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, D: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dQ (unscaled) over the key tiles [start, stop), recomputing P from the saved lse."""
    for n0 in range(start, stop, BLOCK_N):
        k, v, s, dcap = _key_tile(q, p, doc_q, n0, K, V, KPM, DOC, sk_s, sk_d, sv_s, sv_d, skpm_s, sdoc_s, S, p_end,
                                  k_start, W, sink_n, prefix, scale, qk_scale, slope, cap, MASKED, CAUSAL,
                                  HAS_WINDOW, HAS_KPM, HAS_DOC, HAS_ALIBI, HAS_SOFTCAP, D, BLOCK_N, BLOCK_D,
                                  DOT_PRECISION)
        pr = tl.exp2(s - lse[:, None])  # the softmax weights, (BM, BN)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (BM, BN)
        ds = pr * (dp - delta[:, None]) * dcap
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    return dq


@_autotune(DQ_TILES)
@triton.jit
def bwd_dq_kernel(Q, K, V, DO, DQ, LSE, DELTA, KPM, DOC, PREFIX, SLOPES, NUM, IDX, FULL_NUM, FULL_IDX,
                  sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
                  sdo_b, sdo_h, sdo_t, sdo_d, sdq_b, sdq_h, sdq_t, sdq_d, skpm_b, skpm_s, sdoc_b, sdoc_s, sprefix_b,
                  snum_b, snum_r, sidx_b, sidx_r, H, GROUP, T, S, Q_START, K_START, W, sink_n, scale, qk_scale, cap,
                  T_BUCKET, S_BUCKET, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KPM: tl.constexpr,
                  HAS_DOC: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, MAP_BLOCK: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (query tile, batch * head): dQ for BLOCK_M queries over their key tiles."""
    b, h, i, p, offs_d, q_mask, q, K, V, KPM, DOC, doc_q, prefix, slope, NUM, IDX, FULL_NUM, FULL_IDX = _query_tile(
        Q, K, V, KPM, DOC, PREFIX, SLOPES, NUM, IDX, FULL_NUM, FULL_IDX, sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sv_b, sv_h,
        skpm_b, sdoc_b, sdoc_s, sprefix_b, snum_b, snum_r, sidx_b, sidx_r, H, GROUP, T, Q_START, HAS_DOC, HAS_PREFIX,
        HAS_ALIBI, D, BLOCK_D, BLOCK_M, MAP_BLOCK)
    p_end = Q_START + T
    do = tl.load(DO + b * sdo_b + h * sdo_h + i[:, None] * sdo_t + offs_d[None, :] * sdo_d, mask=q_mask,
                 other=0.0)
    row = (b * H + h) * T + i  # this head's rows of the (B, H, T) statistics
    lse = tl.load(LSE + row, mask=i < T, other=0.0)
    delta = tl.load(DELTA + row, mask=i < T, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for jj in range(0, tl.load(NUM)):
        n0 = tl.load(IDX + jj) * MAP_BLOCK
        dq = _dq_tiles(dq, q, do, lse, delta, p, doc_q, K, V, KPM, DOC, sk_s, sk_d, sv_s, sv_d, skpm_s, sdoc_s,
                       S, p_end, K_START, W, sink_n, prefix, scale, qk_scale, slope, cap, n0, n0 + MAP_BLOCK, True,
                       CAUSAL, HAS_WINDOW, HAS_KPM, HAS_DOC, HAS_ALIBI, HAS_SOFTCAP, D, BLOCK_N, BLOCK_D,
                       DOT_PRECISION)
    for jj in range(0, tl.load(FULL_NUM)):
        n0 = tl.load(FULL_IDX + jj) * MAP_BLOCK
        dq = _dq_tiles(dq, q, do, lse, delta, p, doc_q, K, V, KPM, DOC, sk_s, sk_d, sv_s, sv_d, skpm_s, sdoc_s,
                       S, p_end, K_START, W, sink_n, prefix, scale, qk_scale, slope, cap, n0, n0 + MAP_BLOCK, False,
                       CAUSAL, HAS_WINDOW, HAS_KPM, HAS_DOC, HAS_ALIBI, HAS_SOFTCAP, D, BLOCK_N, BLOCK_D,
                       DOT_PRECISION)
    dq = dq * scale  # d(scale * q . k)/dq
    tl.store(DQ + b * sdq_b + h * sdq_h + i[:, None] * sdq_t + offs_d[None, :] * sdq_d, dq.to(DQ.dtype.element_ty),
             mask=q_mask)


@triton.jit
def _dkdv_tiles(dk, dv, k, v, n, Q, DO, LSE, DELTA, KPM, DOC, sq_t, sq_d, sdo_t, sdo_d, skpm_s, sdoc_s,
                T, S, q_start, k_start, W, sink_n, prefix, scale, qk_scale, slope, cap, start, stop,
                MASKED: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KPM: tl.constexpr,
                HAS_DOC: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr, D: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """dK (unscaled) and dV of one key tile over the query tiles [start, stop), in the
    transposed layout (keys on rows, queries on columns)."""
    offs_d = tl.arange(0, BLOCK_D)
    for m0 in range(start, stop, BLOCK_M):
        i = m0 + tl.arange(0, BLOCK_M)
        p = q_start + i  # query positions
        q_mask = offs_d[None, :] < D
        if MASKED:  # mask-free tiles lie wholly inside [0, T)
            q_mask = q_mask & (i[:, None] < T)
        q = tl.load(Q + i[:, None] * sq_t + offs_d[None, :] * sq_d, mask=q_mask, other=0.0)  # (BM, BD)
        do = tl.load(DO + i[:, None] * sdo_t + offs_d[None, :] * sdo_d, mask=q_mask, other=0.0)  # (BM, BD)
        lse = tl.load(LSE + i, mask=i < T, other=0.0)
        delta = tl.load(DELTA + i, mask=i < T, other=0.0)
        s_t, dcap_t = _scores(tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION), p[None, :],
                              k_start + n[:, None], scale, qk_scale, slope, cap, HAS_ALIBI, HAS_SOFTCAP)  # (BN, BM)
        if MASKED:
            doc_q = tl.zeros([BLOCK_M], dtype=tl.int32)
            if HAS_DOC:
                doc_q = tl.load(DOC + p * sdoc_s, mask=i < T, other=0)
            ok = _visible(p[None, :], n[:, None], KPM, DOC, doc_q[None, :], skpm_s, sdoc_s, S, q_start + T, k_start,
                          W, sink_n, prefix, CAUSAL, HAS_WINDOW, HAS_KPM, HAS_DOC)
            s_t = tl.where(ok, s_t, float("-inf"))
        p_t = tl.exp2(s_t - lse[None, :])  # the softmax weights, transposed (BN, BM)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (BN, BM)
        ds_t = p_t * (dp_t - delta[None, :]) * dcap_t
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    return dk, dv


@_autotune(DKDV_TILES)
@triton.jit
def bwd_dkdv_kernel(Q, K, V, DO, DK, DV, LSE, DELTA, KPM, DOC, PREFIX, SLOPES, NUM, IDX, FULL_NUM, FULL_IDX,
                    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_s, sk_d, sv_b, sv_h, sv_s, sv_d,
                    sdo_b, sdo_h, sdo_t, sdo_d, sdk_b, sdk_h, sdk_s, sdk_d, sdv_b, sdv_h, sdv_s, sdv_d,
                    skpm_b, skpm_s, sdoc_b, sdoc_s, sprefix_b, snum_b, snum_c, sidx_b, sidx_c,
                    H, GROUP, T, S, Q_START, K_START, W, sink_n, scale, qk_scale, cap, T_BUCKET, S_BUCKET,
                    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_KPM: tl.constexpr, HAS_DOC: tl.constexpr,
                    HAS_PREFIX: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, DOT_PRECISION: tl.constexpr, MAP_BLOCK: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One program per (key tile, batch * kv head): dK and dV of BLOCK_N keys, summed over
    the GROUP query heads that share them (GQA without copies or atomics), over the query
    tiles of the transposed block lists."""
    tl.static_assert(MAP_BLOCK % BLOCK_N == 0, "key tiles must divide the block map's tiles")
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    Hkv = H // GROUP
    b = (bhk // Hkv).to(tl.int64)
    hk = (bhk % Hkv).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    kv_mask = (n[:, None] < S) & (offs_d[None, :] < D)
    k = tl.load(K + b * sk_b + hk * sk_h + n[:, None] * sk_s + offs_d[None, :] * sk_d, mask=kv_mask, other=0.0)
    v = tl.load(V + b * sv_b + hk * sv_h + n[:, None] * sv_s + offs_d[None, :] * sv_d, mask=kv_mask, other=0.0)
    KPM += b * skpm_b
    DOC += b * sdoc_b
    prefix = 0
    if HAS_PREFIX:
        prefix = tl.load(PREFIX + b * sprefix_b)
    col = pid_n * BLOCK_N // MAP_BLOCK  # the map column of these keys
    NUM += b * snum_b + col * snum_c
    IDX += b * sidx_b + col * sidx_c
    FULL_NUM += b * snum_b + col * snum_c
    FULL_IDX += b * sidx_b + col * sidx_c

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        Qh = Q + b * sq_b + h * sq_h
        DOh = DO + b * sdo_b + h * sdo_h
        LSEh = LSE + bh * T
        DELTAh = DELTA + bh * T
        slope = 0.0
        if HAS_ALIBI:
            slope = tl.load(SLOPES + h)
        for jj in range(0, tl.load(NUM)):
            m0 = tl.load(IDX + jj) * MAP_BLOCK
            dk, dv = _dkdv_tiles(dk, dv, k, v, n, Qh, DOh, LSEh, DELTAh, KPM, DOC, sq_t, sq_d, sdo_t, sdo_d, skpm_s,
                                 sdoc_s, T, S, Q_START, K_START, W, sink_n, prefix, scale, qk_scale, slope, cap, m0,
                                 m0 + MAP_BLOCK, True, CAUSAL, HAS_WINDOW, HAS_KPM, HAS_DOC, HAS_ALIBI, HAS_SOFTCAP,
                                 D, BLOCK_M, BLOCK_D, DOT_PRECISION)
        for jj in range(0, tl.load(FULL_NUM)):
            m0 = tl.load(FULL_IDX + jj) * MAP_BLOCK
            dk, dv = _dkdv_tiles(dk, dv, k, v, n, Qh, DOh, LSEh, DELTAh, KPM, DOC, sq_t, sq_d, sdo_t, sdo_d, skpm_s,
                                 sdoc_s, T, S, Q_START, K_START, W, sink_n, prefix, scale, qk_scale, slope, cap, m0,
                                 m0 + MAP_BLOCK, False, CAUSAL, HAS_WINDOW, HAS_KPM, HAS_DOC, HAS_ALIBI, HAS_SOFTCAP,
                                 D, BLOCK_M, BLOCK_D, DOT_PRECISION)
    dk = dk * scale
    tl.store(DK + b * sdk_b + hk * sdk_h + n[:, None] * sdk_s + offs_d[None, :] * sdk_d, dk.to(DK.dtype.element_ty),
             mask=kv_mask)
    tl.store(DV + b * sdv_b + hk * sdv_h + n[:, None] * sdv_s + offs_d[None, :] * sdv_d, dv.to(DV.dtype.element_ty),
             mask=kv_mask)
