"""The tiled backend's own machinery: tiny tiles, the custom backward, tile skipping, dropout, memory."""
import itertools
import pathlib
import random
import subprocess
import sys

import pytest
import torch

from selfattn import Mask, attention, backends
from selfattn.backends import math, tiled
from selfattn.backends._common import repeat_kv
from selfattn.masks import FULL, HIDDEN, PARTIAL, BlockMap
from selfattn.scores import Scores, alibi_slopes

from helpers.parity import F64, HEADS, MASK_KINDS, assert_close_all, assert_flash_rule, forward_backward, make_case


def _mask(kwargs: dict) -> Mask:
    """The Mask that ``attention(**kwargs)`` builds."""
    return Mask(causal=kwargs.get("causal", True), window=kwargs.get("window"),
                key_padding_mask=kwargs.get("key_padding_mask"), doc_ids=kwargs.get("doc_ids"))


def _tiled_grads(q, k, v, grad, mask, **blocks):
    out = tiled.run(q, k, v, mask, scale=q.shape[-1] ** -0.5, **blocks)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad))


BLOCKS = [(4, 4), (5, 7), (16, 8), (8, 32), (128, 128)]  # square, ragged, tall, wide, one tile


@pytest.mark.parametrize("block_q,block_k", BLOCKS)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("T,S", [(37, 37), (23, 50)])
def test_custom_backward_matches_math_float64(T, S, heads, mask_kind, block_q, block_k):
    (q, k, v, grad), kwargs = make_case(*HEADS[heads], T, S, 8, mask_kind)
    want = math.run(q, k, v, _mask(kwargs), scale=8 ** -0.5)
    want = (want.detach(), *torch.autograd.grad(want, (q, k, v), grad))
    assert_close_all(_tiled_grads(q, k, v, grad, _mask(kwargs), block_q=block_q, block_k=block_k), want, **F64)


@pytest.mark.parametrize("mask_kind", MASK_KINDS)
@pytest.mark.parametrize("heads", ["MHA", "GQA"])
def test_attention_over_key_blocks_merged_by_lse_equals_attention_over_all_keys(heads, mask_kind):
    """forward_with_lse / backward_from_lse, ring attention's kernel: the queries of [20, 37)
    over three key blocks at their own positions, merged by log-sum-exp, and the gradients from
    the merged lse, equal math on the whole sequence (float64)."""
    T = 37
    (q, k, v, grad), kwargs = make_case(*HEADS[heads], T, T, 8, mask_kind)
    mask, scale, rows = _mask(kwargs), 8 ** -0.5, slice(20, T)
    want = math.run(q, k, v, mask, scale=scale)
    g = torch.zeros_like(grad)
    g[:, :, rows] = grad[:, :, rows]  # only these queries' outputs matter
    want = (want.detach()[:, :, rows], *torch.autograd.grad(want, (q, k, v), g))
    qb, blocks = q.detach()[:, :, rows], [(0, 9), (9, 30), (30, T)]
    out, lse = torch.zeros_like(qb), torch.full((*qb.shape[:3], 1), float("-inf"), dtype=q.dtype)
    for a, b in blocks:  # merged in the order of no importance
        o, l = tiled.forward_with_lse(qb, k.detach()[:, :, a:b], v.detach()[:, :, a:b], mask, scale=scale,
                                      q_start=20, k_start=a)
        new = torch.logaddexp(lse, l)
        safe = torch.where(new.isinf(), 0.0, new)
        out, lse = out * (lse - safe).exp() + o * (l - safe).exp(), new
    dq, dk, dv = torch.zeros_like(qb), torch.zeros_like(k), torch.zeros_like(v)
    for a, b in blocks:
        dq_b, dk[:, :, a:b], dv[:, :, a:b] = tiled.backward_from_lse(
            qb, k.detach()[:, :, a:b], v.detach()[:, :, a:b], out, lse, grad[:, :, rows], mask, scale=scale,
            q_start=20, k_start=a)
        dq += dq_b
    full_dq = torch.zeros_like(q)
    full_dq[:, :, rows] = dq
    assert_close_all((out, full_dq, dk, dv), want, **F64)


@pytest.mark.parametrize("wrong", [HIDDEN, FULL])
def test_a_block_map_wrong_in_one_partial_tile_fails_the_parity_check(monkeypatch, wrong):
    """Negative control: the parity check catches one PARTIAL tile called HIDDEN or FULL."""
    (q, k, v, grad), kwargs = make_case(4, 2, 37, 37, 8, "all")
    mask = _mask(kwargs)
    want = math.run(q, k, v, mask, scale=8 ** -0.5)
    want = (want.detach(), *torch.autograd.grad(want, (q, k, v), grad))
    assert_close_all(_tiled_grads(q, k, v, grad, mask, block_q=8, block_k=8), want, **F64)  # the true map passes
    real = Mask.blocks

    def one_tile_wrong(self, *args):
        blocks = real(self, *args)
        kind = blocks.kind.clone()
        kind.view(-1)[(kind.view(-1) == PARTIAL).nonzero()[len(kind) // 2]] = wrong
        return BlockMap(kind, blocks.block_q, blocks.block_k)
    monkeypatch.setattr(Mask, "blocks", one_tile_wrong)
    with pytest.raises(AssertionError, match="max error"):
        assert_close_all(_tiled_grads(q, k, v, grad, mask, block_q=8, block_k=8), want, **F64)


@pytest.mark.parametrize("kwargs", [
    {},
    {"window": 3},
    {"causal": False, "doc_ids": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2]])},
    {"window": 4, "key_padding_mask": torch.tensor([[False, False, False, False, True, True, False, True, True]])},
])
def test_gradcheck_small_blocks(kwargs):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 6, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 1, 9, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    mask = _mask(kwargs)
    fn = lambda q, k, v: tiled.run(q, k, v, mask, scale=0.5, block_q=2, block_k=4)  # 3 x 3 tiles, keys 4, 4, 1
    assert torch.autograd.gradcheck(fn, (q, k, v))


def test_backward_is_once_differentiable():
    q = torch.randn(1, 1, 4, 2, dtype=torch.float64, requires_grad=True)
    out = tiled.run(q, q, q, Mask(), scale=1.0)
    w = torch.randn(out.shape, dtype=torch.float64, requires_grad=True)
    (dq,) = torch.autograd.grad(out, q, w, create_graph=True)  # a double-backward path through the kernel
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()


def _brute_force_tiles(mask, T, S, block_q, block_k):
    """Every tile with at least one visible pair; masked when it also has a hidden one."""
    dense = mask.dense(T, S)[0, 0]  # (T, S)
    tiles = []
    for i0, k0 in itertools.product(range(0, T, block_q), range(0, S, block_k)):
        block = dense[i0:i0 + block_q, k0:k0 + block_k]
        if block.any():
            tiles.append((i0, min(i0 + block_q, T), k0, min(k0 + block_k, S), not bool(block.all())))
    return tiles


def test_plan_visits_exactly_the_tiles_the_mask_does_not_hide():
    rng = random.Random(0)
    for _ in range(300):
        S = rng.randint(1, 40)
        T = rng.randint(1, S)
        causal = rng.random() < 0.8
        mask = Mask(causal=causal, window=rng.choice([None, 1, 3, 8, 50]) if causal else None)
        bq, bk = rng.randint(1, 12), rng.randint(1, 12)
        (group,) = tiled.plan(mask, T, S, bq, bk)
        assert group.rows is None
        assert [tuple(t) for t in group.tiles] == _brute_force_tiles(mask, T, S, bq, bk), (T, S, mask, bq, bk)


def test_plan_groups_batch_rows_by_their_block_map():
    pad = torch.ones(3, 20, dtype=torch.bool)
    pad[1, :10] = False  # row 1: its first two key tiles are padding
    docs = torch.zeros(3, 20, dtype=torch.long)
    groups = tiled.plan(Mask(key_padding_mask=pad, doc_ids=docs), 20, 20, 5, 5)
    assert sorted(g.rows.tolist() for g in groups) == [[0, 2], [1]]
    for g in groups:
        dense = Mask(key_padding_mask=pad[g.rows], doc_ids=docs[g.rows]).dense(20, 20)[:, 0]  # (rows, T, S)
        want = [t for t in _brute_force_tiles(Mask(key_padding_mask=pad[g.rows[:1]]), 20, 20, 5, 5)]
        assert [tuple(t) for t in g.tiles] == want
        assert all(dense[:, t.i0:t.i1, t.k0:t.k1].all() != t.masked for t in g.tiles)
    (one,) = tiled.plan(Mask(key_padding_mask=torch.ones(2, 20, dtype=torch.bool)), 20, 20, 5, 5)
    assert one.rows is None  # rows with the same map are one group of all rows: no gather


def test_hidden_tiles_are_skipped_by_the_kernel_and_kv_is_never_repeated(monkeypatch):
    B, H, Hkv, T, D = 2, 4, 2, 64, 8
    q = torch.randn(B, H, T, D)
    k, v = torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    score_tiles = []
    baddbmm = torch.baddbmm

    def counting_baddbmm(c, a, b, *args, **kwargs):
        if b.untyped_storage().data_ptr() == k.untyped_storage().data_ptr():  # a q·kᵀ score tile
            score_tiles.append(tuple(a.shape[:2]) + (b.shape[2],))
        return baddbmm(c, a, b, *args, **kwargs)
    monkeypatch.setattr(torch, "baddbmm", counting_baddbmm)
    tiled.run(q, k, v, Mask(window=16), scale=1.0, block_q=16, block_k=16)
    # 4 x 4 tiles; causal keeps the 10 on and below the diagonal; window 16 drops the 3 farthest
    assert len(score_tiles) == 7 == len(tiled.plan(Mask(window=16), T, T, 16, 16)[0].tiles)
    assert set(score_tiles) == {(B * Hkv, 16 * (H // Hkv), 16)}  # one matmul per tile for all B·Hkv groups
    score_tiles.clear()
    tiled.run(q, k, v, Mask(causal=False), scale=1.0, block_q=16, block_k=16)
    assert len(score_tiles) == 16


def _dense_keep(mask, B, H, Hkv, T, S, dropout_p, seed, block_q, block_k):
    """The kernel's dropout multipliers assembled into one (B, H, T, S) tensor, tile by tile."""
    G = H // Hkv
    keep = torch.zeros(B * Hkv, T * G, S, dtype=torch.float64)  # the kernel's layout
    for group in tiled.plan(mask, T, S, block_q, block_k):
        part = tiled._Part(group, mask, Scores(), B, Hkv, G, 1.0, (S - T, 0), dropout_p, seed)
        rows = torch.arange(B * Hkv) if part.index is None else part.index
        for t in group.tiles:
            like = torch.empty(len(rows), (t.i1 - t.i0) * G, t.k1 - t.k0, dtype=torch.float64)
            keep[rows, t.i0 * G:t.i1 * G, t.k0:t.k1] = part.keep(t, like)
    return keep.view(B, Hkv, T, G, S).transpose(2, 3).reshape(B, H, T, S)  # (B, H, T, S)


@pytest.mark.parametrize("mask_kind", ["causal", "all"])
def test_dropout_forward_and_backward_match_a_dense_reference(mask_kind):
    B, H, Hkv, T, S, D, p, seed = 2, 4, 2, 29, 40, 8, 0.3, 1234
    (q, k, v, grad), kwargs = make_case(H, Hkv, T, S, D, mask_kind, B=B)
    mask = _mask(kwargs)
    keep = _dense_keep(mask, B, H, Hkv, T, S, p, seed, 8, 16)
    weights = math.run_with_weights(q, k, v, mask, scale=D ** -0.5)[1]  # (B, H, T, S), differentiable
    want = (weights * keep) @ repeat_kv(v, H)  # (B, H, T, D)
    want = (want.detach(), *torch.autograd.grad(want, (q, k, v), grad))
    got = tiled.run(q, k, v, mask, scale=D ** -0.5, dropout_p=p, seed=seed, block_q=8, block_k=16)
    assert_close_all((got.detach(), *torch.autograd.grad(got, (q, k, v), grad)), want, **F64)
    visible = mask.dense(T, S).expand(B, H, T, S)
    dropped = (keep[visible] == 0).double().mean().item()
    assert abs(dropped - p) < 0.03, dropped  # ~9000 visible entries
    kept = keep[visible][keep[visible] != 0]
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - p)))  # kept weights are scaled by 1 / (1 - p)
    part = tiled._Part(tiled.Group(None, []), Mask(), Scores(), 1, 2, 1, 1.0, (0, 0), p, seed)
    first, second = (part.keep(tiled.Tile(0, 64, k0, k0 + 64, False), torch.empty(2, 64, 64)) for k0 in (0, 64))
    assert not torch.equal(first, second)  # each tile draws its own mask


def test_dropout_is_reproducible_from_torchs_generator():
    q = torch.randn(1, 2, 33, 8)
    run = lambda: attention(q, q, q, dropout_p=0.2, backend="tiled")
    torch.manual_seed(7)
    a, b = run(), run()
    torch.manual_seed(7)
    assert torch.equal(run(), a) and not torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes_are_preserved(dtype, either_cpu):
    q, k, v = (torch.randn(2, 4, 9, 8, dtype=dtype, requires_grad=True) for _ in range(3))
    out = tiled.run(q, k[:, :2], v[:, :2], Mask(), scale=0.3)
    out.sum().backward()
    assert out.dtype == q.grad.dtype == k.grad.dtype == v.grad.dtype == dtype


# --- half-precision tiles: multiplied as they are where the device multiplies them natively ----

HALF_FLOOR = {torch.bfloat16: 8e-3, torch.float16: 1e-3}  # about one ulp of max|x|, as in test_parity
PRODUCTS = {  # how a device returns the float32 product of half tiles
    "cpu": tiled._half_product,  # PyTorch's CPU matmul: rounded to half precision first
    "gpu": lambda a, b: torch.bmm(a.float(), b.float()),  # exact, as a GPU's out_dtype=float32 returns it
}


@pytest.fixture
def half_tiles(monkeypatch):
    """Half tiles on this CPU as on one with AVX512-BF16 or AMX; returns the dtypes that reached the products."""
    seen = set()
    before = backends.assume_native_half(True)

    def use(product):
        def spy(a, b):
            seen.add((a.dtype, b.dtype))
            return product(a, b)
        monkeypatch.setattr(tiled, "_half_product", spy)
        monkeypatch.setattr(tiled, "_exact_half_product", lambda device: product is not PRODUCTS["cpu"])
        return seen
    yield use
    backends.assume_native_half(before)


HALF_CASES = list(itertools.product(HALF_FLOOR, PRODUCTS, ("MHA", "GQA"), ("causal", "padding", "all", "many-docs"),
                                    ((97, 0, 128), (600, 19, 16))))


@pytest.mark.parametrize("dtype,product,heads,mask_kind,shape", HALF_CASES,
                         ids=[f"{str(d)[6:]}-{p}-{h}-{m}-T{s[0]}-blocks{s[2]}" for d, p, h, m, s in HALF_CASES])
def test_half_tiles_keep_the_flash_rule(half_tiles, dtype, product, heads, mask_kind, shape):
    T, extra, block = shape  # (600, 19, 16): 38 key tiles per row, each product rounded on the CPU
    H, Hkv = HEADS[heads]
    seen = half_tiles(PRODUCTS[product])
    inputs64, kwargs = make_case(H, Hkv, T, T + extra, 16, mask_kind)
    exact = forward_backward("math", *inputs64, **kwargs)
    inputs, kwargs = make_case(H, Hkv, T, T + extra, 16, mask_kind, dtype=dtype)
    same = forward_backward("math", *inputs, **kwargs)
    got = _tiled_grads(*inputs, _mask(kwargs), block_q=block, block_k=block)
    assert seen == {(dtype, dtype)}  # every tile was multiplied in the input's dtype
    assert all(t.dtype == dtype for t in got)
    assert_flash_rule(got, same, exact, rel_floor=HALF_FLOOR[dtype])


def test_negative_control_half_accumulators_fail_the_flash_rule(half_tiles, monkeypatch):
    """The rule tells float32 accumulation from bfloat16: the same kernel keeping its sums,
    running output and statistics in bfloat16 fails it, on dv over 38 key tiles."""
    half_tiles(PRODUCTS["cpu"])
    inputs64, kwargs = make_case(4, 2, 600, 619, 16, "causal")
    exact = forward_backward("math", *inputs64, **kwargs)
    inputs, kwargs = make_case(4, 2, 600, 619, 16, "causal", dtype=torch.bfloat16)
    same = forward_backward("math", *inputs, **kwargs)
    assert_flash_rule(_tiled_grads(*inputs, Mask(), block_q=16, block_k=16), same, exact, rel_floor=8e-3)
    monkeypatch.setattr(tiled, "_accumulated", lambda tile_dtype: tile_dtype)
    half_tiles(torch.bmm)  # products, sums and statistics all in bfloat16
    with pytest.raises(AssertionError, match="dv: error"):
        assert_flash_rule(_tiled_grads(*inputs, Mask(), block_q=16, block_k=16), same, exact, rel_floor=8e-3)


def test_half_tiles_serve_score_rules_sinks_and_dropout(half_tiles, monkeypatch):
    """ALiBi, soft-capping and learned sinks by the rule; dropout draws the same mask as float32 tiles."""
    seen = half_tiles(PRODUCTS["cpu"])
    (q, k, v, grad), kwargs = make_case(4, 2, 97, 97, 16, "padding", dtype=torch.bfloat16)
    rules = {"alibi_slopes": alibi_slopes(4).bfloat16(), "softcap": 5.0,
             "sinks": torch.linspace(-1, 1, 4, dtype=torch.bfloat16)}
    inputs64, _ = make_case(4, 2, 97, 97, 16, "padding")
    exact = forward_backward("math", *inputs64, **kwargs, **{n: r.double() if torch.is_tensor(r) else r
                                                               for n, r in rules.items()})
    same = forward_backward("math", q, k, v, grad, **kwargs, **rules)
    assert_flash_rule(forward_backward("tiled", q, k, v, grad, **kwargs, **rules), same, exact, rel_floor=8e-3)
    assert seen == {(torch.bfloat16, torch.bfloat16)}
    torch.manual_seed(3)
    half = forward_backward("tiled", q, k, v, grad, dropout_p=0.3, **kwargs)
    backends.assume_native_half(False)  # float32 tiles (the fixture restores the setting)
    torch.manual_seed(3)
    full = forward_backward("tiled", q, k, v, grad, dropout_p=0.3, **kwargs)
    for a, b in zip(half, full):  # the same dropped weights: the two differ by bf16 rounding only
        torch.testing.assert_close(a, b, atol=0.05, rtol=0.02)


def test_autocast_leaves_the_tiles_in_their_dtypes():
    """Under autocast (mixed-precision training) the kernels compute exactly as without it."""
    (q, k, v, grad), kwargs = make_case(4, 2, 97, 97, 16, "window", dtype=torch.bfloat16)
    plain = forward_backward("tiled", q, k, v, grad, **kwargs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = forward_backward("tiled", q, k, v, grad, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(plain, mixed))


@pytest.mark.parametrize("name,value,error", [("block_q", 0, ValueError), ("block_k", -3, ValueError),
                                              ("block_q", 2.0, TypeError), ("block_k", True, TypeError)])
def test_bad_block_sizes(name, value, error):
    q = torch.randn(1, 1, 4, 2)
    with pytest.raises(error, match=f"{name} must be a(n| positive) int, got .*{value!r}"):
        tiled.run(q, q, q, Mask(), scale=1.0, **{name: value})


MEMORY_SCRIPT = """
import resource, sys, torch
torch.set_num_threads(1)
from selfattn import attention
T, H, D = 16384, 1, 64
q, k, v = (torch.randn(1, H, T, D, requires_grad=True) for _ in range(3))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = attention(q, k, v, backend="tiled")
out.backward(torch.ones_like(out))
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
tail = attention(q[:, :, -3:].detach(), k.detach(), v.detach(), backend="math")  # the last 3 rows, exactly
ok = all(torch.isfinite(t.grad).all() for t in (q, k, v))
print((peak - before) * unit, (out[:, :, -3:] - tail).abs().max().item(), ok)
"""


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_memory_grows_with_t_not_t_squared():
    """Forward and backward at T = 16384 (one head): one float32 score tensor alone would be
    1 GiB; the tiled backend's peak resident memory grows by less than an eighth of that."""
    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT], capture_output=True, text=True, timeout=120,
                          cwd=pathlib.Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    growth, tail_error, finite = done.stdout.split()
    score_tensor = 16384 * 16384 * 4
    assert int(growth) < score_tensor / 8, f"peak RSS grew by {int(growth) / 2**20:.0f} MiB"
    assert float(tail_error) < 1e-5 and finite == "True"
