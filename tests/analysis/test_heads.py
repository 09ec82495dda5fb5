"""Attention capture and head scores: exact values on hand-built patterns, capture changes nothing."""
import math

import pytest
import torch
from torch import nn

from selfattn import SelfAttention
from selfattn.analysis.heads import (
    attention_entropy,
    attention_layers,
    attention_maps,
    capture,
    duplicate_token_score,
    first_token_score,
    head_scores,
    induction_score,
    mean_attention_distance,
    plot_attention_grid,
    previous_token_score,
    rank_heads,
    repeated_tokens,
)


def _rows(*rows):
    """A (T, T) attention matrix from its lower-triangular rows."""
    T = len(rows)
    w = torch.zeros(T, T)
    for i, r in enumerate(rows):
        assert len(r) == i + 1
        w[i, : i + 1] = torch.tensor(r, dtype=torch.float32)
    return w


PREV = _rows([1], [1, 0], [0, 1, 0], [0, 0, 1, 0])
UNIFORM = _rows([1], [1 / 2] * 2, [1 / 3] * 3, [1 / 4] * 4)
SINK = _rows([1], [1, 0], [1, 0, 0], [1, 0, 0, 0])


def test_row_scores_exact_on_hand_built_heads():
    att = torch.stack([PREV, UNIFORM, SINK])[None, None]  # (L=1, B=1, H=3, T=4, T)
    prev, first = previous_token_score(att), first_token_score(att)
    assert prev.shape == first.shape == (1, 3)
    torch.testing.assert_close(prev, torch.tensor([[1.0, (1 / 2 + 1 / 3 + 1 / 4) / 3, 1 / 3]]))
    torch.testing.assert_close(first, torch.tensor([[1 / 3, (1 / 2 + 1 / 3 + 1 / 4) / 3, 1.0]]))
    # distance of row i: previous 1, uniform i/2, sink i; averaged over i = 1..3
    torch.testing.assert_close(mean_attention_distance(att), torch.tensor([[1.0, 1.0, 2.0]]))
    torch.testing.assert_close(attention_entropy(att), torch.tensor([[0.0, math.log(24) / 3, 0.0]]))


def test_scores_average_over_batch_and_layers_stay_apart():
    att = torch.stack([torch.stack([PREV, SINK]), torch.stack([SINK, SINK])])  # (B=2, H=2, T, T)
    att = torch.stack([att, att.flip(1)])  # (L=2, B=2, H=2, T, T)
    expected = torch.tensor([[(1 + 1 / 3) / 2, 1 / 3], [1 / 3, (1 + 1 / 3) / 2]])
    torch.testing.assert_close(previous_token_score(att), expected)


TOKENS = torch.tensor([[5, 7, 9, 5, 7, 9]])  # L = 3 tokens repeated: query i >= 3 copies key i-3
T6 = 6


def _pattern(targets: dict[int, dict[int, float]]) -> torch.Tensor:
    """(T6, T6) weights: rows listed in ``targets``, every other row on key 0."""
    w = torch.zeros(T6, T6)
    w[:, 0] = 1.0
    for i, row in targets.items():
        w[i] = 0.0
        for j, v in row.items():
            w[i, j] = v
    return w


def test_induction_and_duplicate_exact():
    induction = _pattern({3: {1: 1.0}, 4: {2: 1.0}, 5: {3: 1.0}})  # key after the earlier copy
    duplicate = _pattern({3: {0: 1.0}, 4: {1: 1.0}, 5: {2: 1.0}})  # the earlier copy itself
    half = (induction + duplicate) / 2
    uniform = torch.ones(T6, T6).tril() / torch.arange(1, T6 + 1)[:, None]
    att = torch.stack([induction, duplicate, half, uniform])[None, None]  # (1, 1, 4, T, T)
    spread = (1 / 4 + 1 / 5 + 1 / 6) / 3  # uniform rows 3, 4, 5 put 1/(i+1) on their one target
    torch.testing.assert_close(induction_score(att, TOKENS), torch.tensor([[1.0, 0.0, 0.5, spread]]))
    torch.testing.assert_close(duplicate_token_score(att, TOKENS), torch.tensor([[0.0, 1.0, 0.5, spread]]))


def test_repeats_inside_a_sequence_follow_the_formula():
    # tokens 1 1 1 2: query 1 has copy {0} but its follower is itself (excluded from induction);
    # query 2 has copies {0, 1} and the single follower 1; query 3 is new
    tokens = torch.tensor([[1, 1, 1, 2]])
    w = _rows([1], [0.25, 0.75], [0.5, 0.3, 0.2], [0.25] * 4)[None, None, None]  # (1, 1, 1, 4, 4)
    torch.testing.assert_close(induction_score(w, tokens), torch.tensor([[0.3]]))
    torch.testing.assert_close(duplicate_token_score(w, tokens), torch.tensor([[(0.25 + 0.8) / 2]]))


def test_induction_reduces_to_the_offset_diagonal_on_repeated_tokens():
    L = 7
    g = torch.Generator().manual_seed(1)
    tokens = repeated_tokens(50, L, batch=3, generator=g)  # (3, 14)
    assert torch.equal(tokens[:, :L], tokens[:, L:]) and all(len(set(r[:L].tolist())) == L for r in tokens)
    scores = torch.randn(2, 3, 4, 2 * L, 2 * L, generator=g)
    att = scores.masked_fill(~torch.ones(2 * L, 2 * L, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    diag = torch.diagonal(att, offset=-(L - 1), dim1=-2, dim2=-1)  # (L, B, H, L+1): queries L-1 .. 2L-1
    torch.testing.assert_close(induction_score(att, tokens), diag[..., 1:].mean(dim=(1, 3)))
    dup = torch.diagonal(att, offset=-L, dim1=-2, dim2=-1)  # queries L .. 2L-1
    torch.testing.assert_close(duplicate_token_score(att, tokens), dup.mean(dim=(1, 3)))


def test_scores_reject_bad_input():
    att = UNIFORM[None, None, None]
    with pytest.raises(ValueError, match=r"\(L, B, H, T, T\)"):
        previous_token_score(UNIFORM)
    with pytest.raises(ValueError, match="no token occurs twice in `tokens`, so the duplicate-token score"):
        duplicate_token_score(att, torch.tensor([[1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="no token recurs with another token between its two copies in `tokens`, "
                                         "so the induction score is undefined"):
        induction_score(att, torch.tensor([[1, 1, 2, 3]]))  # a token twice, but adjacent: nothing after a copy
    with pytest.raises(ValueError, match=r"tokens must have shape \(B=1, T=4\)"):
        duplicate_token_score(att, torch.tensor([[1, 2, 1]]))
    with pytest.raises(TypeError, match="integer"):
        induction_score(att, torch.tensor([[1.0, 2.0, 1.0, 2.0]]))
    with pytest.raises(ValueError, match="length=9 distinct tokens"):
        repeated_tokens(8, 9)


def test_a_score_the_tokens_leave_undefined_is_nan_and_ranks_no_head():
    att = torch.stack([UNIFORM, PREV])[None, None].expand(2, 1, 2, 4, 4)  # (L=2, B=1, H=2, T=4, T=4)
    hello = torch.tensor([[104, 101, 108, 108]])  # "hell": the only repeat is adjacent
    scores = head_scores(att, hello)
    assert scores["induction"].shape == (2, 2) and scores["induction"].isnan().all()
    torch.testing.assert_close(scores["duplicate-token"], torch.tensor([[0.25, 1.0]] * 2))  # query 3, key 2
    assert dict(rank_heads(scores, 2))["induction"] == []
    assert [l * 2 + h for l, h, _ in dict(rank_heads(scores, 2))["duplicate-token"]] == [1, 3]
    repeated = torch.tensor([[7, 8, 7, 8]])  # control: with a token between the copies, induction is defined
    assert not head_scores(att, repeated)["induction"].isnan().any()
    assert len(dict(rank_heads(head_scores(att, repeated), 2))["induction"]) == 2


def test_rank_heads_orders_by_score():
    scores = {"previous-token": torch.tensor([[0.1, 0.9], [0.5, 0.2]]), "entropy": torch.zeros(2, 2)}
    assert rank_heads(scores, top=3) == [("previous-token", [(0, 1, pytest.approx(0.9)), (1, 0, 0.5),
                                                             (1, 1, pytest.approx(0.2))])]


class Stack(nn.Module):
    """Any module with SelfAttention layers inside: residual attention blocks."""

    def __init__(self, n_layer=3, backend="sdpa"):
        super().__init__()
        self.layers = nn.ModuleList(SelfAttention(16, 4, backend=backend) for _ in range(n_layer))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_capture_records_weights_and_changes_nothing(backend):
    model = Stack(backend=backend).eval()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        y_plain = model(x)
        with capture(model, layers=[0, 2]) as maps:
            assert [m.backend for m in model.layers] == ["math", backend, "math"]  # only captured layers
            y_captured = model(x)
        reference = SelfAttention(16, 4, backend="math")
        reference.load_state_dict(model.layers[0].state_dict())
        _, w0 = reference(x, return_weights=True)
    if backend == "math":
        assert torch.equal(y_captured, y_plain)
    else:
        torch.testing.assert_close(y_captured, y_plain, rtol=1e-5, atol=1e-6)
    assert sorted(maps) == [0, 2] and maps[0].shape == (2, 4, 5, 5)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(2, 4, 5))
    assert not maps[0].triu(1).any()  # causal: nothing above the diagonal
    assert torch.equal(maps[0], w0)
    assert [m.backend for m in model.layers] == [backend] * 3
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.layers)


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_capture_leaves_gpt_logits_unchanged(backend):
    from selfattn.config import GPTConfig
    from selfattn.model import GPT

    model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=3, n_head=2, n_embd=16, backend=backend)).eval()
    idx = torch.randint(50, (2, 12))
    with torch.no_grad():
        plain, _ = model(idx)
        with capture(model, layers=[1]) as maps:
            captured, _ = model(idx)
    if backend == "math":
        assert torch.equal(captured, plain)
    else:
        torch.testing.assert_close(captured, plain, rtol=1e-5, atol=1e-6)
    assert list(maps) == [1] and maps[1].shape == (2, 2, 12, 12)
    assert [b.attn.backend for b in model.blocks] == [backend] * 3


def test_capture_selects_heads_and_keeps_callers_return_weights():
    attn = SelfAttention(16, 4)
    x = torch.randn(1, 6, 16)
    with capture(attn, heads=[3, 1]) as maps:
        y, w = attn(x, return_weights=True)  # a caller that asked for weights still gets them
    assert torch.equal(maps[0], w[:, [3, 1]].detach())
    assert y.shape == x.shape


def test_capture_restores_on_exception_and_rejects_bad_layers():
    model = Stack()
    with pytest.raises(RuntimeError, match="boom"):
        with capture(model):
            raise RuntimeError("boom")
    assert [m.backend for m in model.layers] == ["sdpa"] * 3
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.layers)
    with pytest.raises(ValueError, match=r"layers \[3\] out of range: the model has 3"):
        with capture(model, layers=[0, 3]):
            pass
    with pytest.raises(ValueError, match=r"heads \[4\] out of range"):
        with capture(model, heads=[4]):
            pass
    assert [m.backend for m in model.layers] == ["sdpa"] * 3
    with pytest.raises(ValueError, match="no selfattn.SelfAttention"):
        with capture(nn.Linear(2, 2)):
            pass


def test_attention_maps_stacks_layers_in_order():
    model = Stack(backend="math")  # so layer 1 computes the same with and without capture
    x = torch.randn(1, 4, 16)
    att = attention_maps(model, x, layers=[2, 0])
    with capture(model) as maps, torch.no_grad():
        model(x)
    assert att.shape == (2, 1, 4, 4, 4)
    assert torch.equal(att[0], maps[2]) and torch.equal(att[1], maps[0])
    assert len(attention_layers(model)) == 3


def test_head_scores_on_a_real_model_are_in_range():
    model = Stack()
    tokens = repeated_tokens(20, 4)  # (1, 8)
    att = attention_maps(model, torch.randn(1, 8, 16))
    scores = head_scores(att, tokens)
    assert list(scores) == ["previous-token", "induction", "duplicate-token", "first-token", "mean-distance",
                            "entropy"]
    for name, s in scores.items():
        assert s.shape == (3, 4)
        assert (s >= 0).all()
    for name in ("previous-token", "induction", "duplicate-token", "first-token"):
        assert (scores[name] <= 1 + 1e-6).all()
    assert (scores["entropy"] <= math.log(8)).all()


def test_plot_attention_grid_writes_a_png(tmp_path):
    att = torch.stack([PREV, UNIFORM, SINK])[None].expand(2, 3, 4, 4)  # (L, H, T, T)
    path = tmp_path / "grid.png"
    plot_attention_grid(att, path, labels=["a", "b", "c", "d"], layers=[0, 5], title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="3 token labels for 4 positions"):
        plot_attention_grid(att, tmp_path / "x.png", labels=["a", "b", "c"])


# ---- the `selfattn heads` command -------------------------------------------------------------
