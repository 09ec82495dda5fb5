"""The block map against the dense mask, on random layouts: every HIDDEN tile hides all its
pairs, every FULL tile shows all of them, and for single rules every PARTIAL tile has both."""
import random

import pytest
import torch

from selfattn.masks import FULL, HIDDEN, PARTIAL, Mask, allowed


def _random_layout(rng: random.Random, B: int, S: int) -> dict:
    """Random documents (sorted ids, random lengths), random left padding and holes, a window."""
    lengths = [rng.randint(1, max(1, S // 3)) for _ in range(S)]
    docs = torch.tensor([sum(1 for c in torch.tensor(lengths).cumsum(0).tolist() if c <= i) for i in range(S)])
    pad = torch.ones(B, S, dtype=torch.bool)
    for b in range(B):
        pad[b, :rng.randint(0, S // 2)] = False  # left padding
        if rng.random() < 0.3:
            pad[b, rng.randrange(S)] = False  # a hole
    return {"docs": docs.expand(B, S).clone(), "pad": pad, "window": rng.choice([None, 1, 3, 7, 40])}


def _dense_kinds(dense: torch.Tensor, bq: int, bk: int) -> torch.Tensor:
    """(B, T, S) bool -> (B, nq, nk): the true kind of every tile."""
    B, T, S = dense.shape
    out = torch.empty(B, -(-T // bq), -(-S // bk), dtype=torch.uint8)
    for i in range(out.shape[1]):
        for j in range(out.shape[2]):
            tile = dense[:, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk].flatten(1)
            out[:, i, j] = torch.where(tile.all(1), FULL, torch.where(tile.any(1), PARTIAL, HIDDEN))
    return out


RULES = ("causal", "window", "padding", "docs", "padding+causal", "docs+causal", "all")


@pytest.mark.parametrize("rule", RULES)
def test_block_map_agrees_with_the_dense_mask(rule):
    rng = random.Random(RULES.index(rule))
    for _ in range(60):
        B, S = rng.randint(1, 3), rng.randint(1, 48)
        T = rng.randint(1, S)  # T < S: the queries are the last T positions (a cache)
        bq, bk = rng.randint(1, 9), rng.randint(1, 9)
        lay = _random_layout(rng, B, S)
        mask = {"causal": Mask(),
                "window": Mask(window=lay["window"] or 5),
                "padding": Mask(causal=False, key_padding_mask=lay["pad"]),
                "padding+causal": Mask(key_padding_mask=lay["pad"]),
                "docs": Mask(causal=False, doc_ids=lay["docs"]),
                "docs+causal": Mask(doc_ids=lay["docs"]),
                "all": Mask(window=lay["window"], key_padding_mask=lay["pad"], doc_ids=lay["docs"])}[rule]
        kind = mask.blocks(T, S, bq, bk).kind
        truth = _dense_kinds(mask.dense(T, S)[:, 0].expand(B, T, S), bq, bk)
        kind = kind.expand_as(truth)
        where = (T, S, bq, bk, rule)
        assert not (truth[kind == HIDDEN] != HIDDEN).any(), where  # a skipped tile hides every pair
        assert not (truth[kind == FULL] != FULL).any(), where  # an unmasked tile shows every pair
        if rule in ("causal", "window", "padding", "docs"):  # single rules: exact
            assert torch.equal(kind, truth), where


@pytest.mark.parametrize("rule", RULES)
def test_block_map_of_a_part_of_the_sequence_agrees_with_the_predicate_there(rule):
    """q_start, k_start (ring attention's blocks): the map of T queries at q_start over S keys at
    k_start is the dense mask's at those positions, whatever their order."""
    rng = random.Random(100 + RULES.index(rule))
    for _ in range(60):
        B, L = rng.randint(1, 3), rng.randint(2, 48)
        q_start, k_start = rng.randrange(L), rng.randrange(L)
        T, S = rng.randint(1, L - q_start), rng.randint(1, L - k_start)
        bq, bk = rng.randint(1, 9), rng.randint(1, 9)
        lay = _random_layout(rng, B, L)
        mask = {"causal": Mask(), "window": Mask(window=lay["window"] or 5),
                "padding": Mask(causal=False, key_padding_mask=lay["pad"]),
                "padding+causal": Mask(key_padding_mask=lay["pad"]), "docs": Mask(causal=False, doc_ids=lay["docs"]),
                "docs+causal": Mask(doc_ids=lay["docs"]),
                "all": Mask(window=lay["window"], key_padding_mask=lay["pad"], doc_ids=lay["docs"])}[rule]
        kind = mask.blocks(T, S, bq, bk, q_start, k_start).kind
        dense = mask.tile(q_start, q_start + T, k_start, k_start + S)[:, 0].expand(B, T, S)
        truth = _dense_kinds(dense, bq, bk)
        kind = kind.expand_as(truth)
        where = (q_start, T, k_start, S, bq, bk, rule)
        assert not (truth[kind == HIDDEN] != HIDDEN).any(), where
        assert not (truth[kind == FULL] != FULL).any(), where
        if rule in ("causal", "window", "padding", "docs"):
            assert torch.equal(kind, truth), where


def test_block_map_is_exact_on_a_hand_made_layout():
    pad = torch.tensor([[False, False, True, True, True, True, True, True]])
    assert Mask(key_padding_mask=pad).blocks(8, 8, 2, 2).kind.tolist() == [[  # causal and padding
        [HIDDEN, HIDDEN, HIDDEN, HIDDEN],
        [HIDDEN, PARTIAL, HIDDEN, HIDDEN],
        [HIDDEN, FULL, PARTIAL, HIDDEN],
        [HIDDEN, FULL, FULL, PARTIAL]]]
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2]])
    assert Mask(causal=False, doc_ids=docs).blocks(8, 8, 4, 4).kind.tolist() == [[[PARTIAL, PARTIAL],
                                                                                   [PARTIAL, PARTIAL]]]
    assert Mask(window=2).blocks(6, 6, 2, 2).kind.tolist() == [[[PARTIAL, HIDDEN, HIDDEN],
                                                                 [PARTIAL, PARTIAL, HIDDEN],
                                                                 [HIDDEN, PARTIAL, PARTIAL]]]


def test_block_map_of_a_per_batch_mask_has_one_map_per_row_and_follows_the_mask_device():
    pad = torch.ones(3, 10, dtype=torch.bool)
    pad[2] = False
    blocks = Mask(key_padding_mask=pad).blocks(10, 10, 5, 5)
    assert blocks.kind.shape == (3, 2, 2) and blocks.kind.device == pad.device
    assert (blocks.kind[2] == HIDDEN).all() and blocks.density() == pytest.approx(2 * 3 / 12)
    assert Mask().blocks(10, 10, 5, 5).kind.shape == (1, 2, 2)
    assert Mask().blocks(0, 0, 5, 5).kind.shape == (1, 0, 0)


def test_dense_mask_agrees_with_the_plain_python_predicate():
    for T, S, window in ((5, 5, None), (3, 9, 4), (1, 6, 1)):
        dense = Mask(window=window).dense(T, S)[0, 0]
        assert dense.tolist() == [[allowed(S - T + i, j, window=window) for j in range(S)] for i in range(T)]


@pytest.mark.parametrize("T, S, rules, sees_all", [
    (1, 9, {}, True),  # a decoded token over its cache
    (1, 9, {"causal": False}, True),
    (1, 9, {"window": 9}, True),  # the window reaches back over every key
    (1, 9, {"window": 6, "sink_tokens": 3}, True),  # a rolling cache's sinks and window
    (2, 9, {}, False),  # two queries: the first cannot see the second
    (1, 9, {"window": 8}, False),  # the oldest key is outside the window
    (1, 9, {"window": 5, "sink_tokens": 3}, False),
    (1, 9, {"key_padding_mask": torch.ones(1, 9, dtype=torch.bool)}, False),  # per-batch rules are not read
    (1, 9, {"prefix_len": torch.tensor([2])}, False),
])
def test_sees_every_key_only_where_the_dense_mask_shows_every_pair(T, S, rules, sees_all):
    mask = Mask(**rules)
    assert mask.sees_every_key(T, S) == sees_all
    if sees_all:
        assert bool(mask.dense(T, S).all())
    elif not mask.per_batch and mask.prefix_len is None:
        assert not bool(mask.dense(T, S).all())  # the claim is refused exactly where a pair is hidden
