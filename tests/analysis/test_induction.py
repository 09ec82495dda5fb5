"""The induction experiment: its data, its metrics, determinism, and the command at a tiny size."""
import json
import math

import pytest
import torch
from torch import nn

from selfattn.analysis.induction import InductionConfig, half_losses, probe_batch, sample_batch, train
from selfattn.cli import main as cli

TINY = dict(n_head=2, n_embd=16, vocab_size=16, seq_len=8, min_repeat=2, steps=12, batch_size=8, eval_every=6)


def test_training_rows_repeat_a_segment_of_varying_length():
    cfg = InductionConfig(batch_size=256, seq_len=32, min_repeat=8)
    x = sample_batch(cfg, torch.Generator().manual_seed(0))
    assert x.shape == (256, 32) and x.dtype == torch.int64 and 0 <= x.min() and x.max() < cfg.vocab_size
    lengths = []
    for row in x:
        fits = [L for L in range(8, 17) if torch.equal(row[L:2 * L], row[:L])]
        assert fits, "every row must hold A A with len(A) in [min_repeat, T/2]"
        lengths.append(fits[0])
    assert set(lengths) == set(range(8, 17))  # every length occurs: no fixed offset solves the task
    again = sample_batch(cfg, torch.Generator().manual_seed(0))
    assert torch.equal(x, again)


def test_probe_is_distinct_tokens_twice():
    cfg = InductionConfig(seq_len=32, vocab_size=64)
    probe = probe_batch(cfg)
    assert probe.shape[1] == 32 and torch.equal(probe[:, :16], probe[:, 16:])
    assert all(len(set(row[:16].tolist())) == 16 for row in probe)


class CopyOracle(nn.Module):
    """Uniform logits on the first half; on the repeated half, the copied token with a big margin."""

    def __init__(self, V):
        super().__init__()
        self.V = V

    def forward(self, idx):
        B, T = idx.shape
        logits = torch.zeros(B, T, self.V)
        L = (T + 1) // 2  # the probe has 2L tokens; the model sees the first 2L - 1
        for t in range(L, T):
            logits[torch.arange(B), t, idx[:, t - L + 1]] = 50.0  # predict the token after the earlier copy
        return logits, None


def test_half_losses_separate_chance_from_copying():
    cfg = InductionConfig(seq_len=16, vocab_size=32)
    probe = probe_batch(cfg)
    first, repeated = half_losses(CopyOracle(32), probe)
    assert first == pytest.approx(math.log(32), abs=1e-5)
    assert repeated < 1e-6
    unrelated = torch.cat([probe[:, :8], probe[:, :8].roll(1, dims=0)], dim=1)  # second half from another row
    first, repeated = half_losses(CopyOracle(32), unrelated)
    assert repeated > 10.0  # negative control: when nothing repeats, copying is confidently wrong


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="n_embd=30 is not divisible by n_head=4"):
        InductionConfig(n_embd=30)
    with pytest.raises(ValueError, match="seq_len must be even"):
        InductionConfig(seq_len=31)
    with pytest.raises(ValueError, match="min_repeat=20 is longer than seq_len/2=16"):
        InductionConfig(min_repeat=20)
    with pytest.raises(ValueError, match="distinct tokens"):
        InductionConfig(vocab_size=8, seq_len=32, min_repeat=4)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        InductionConfig(steps=0)
    with pytest.raises(ValueError, match="pos must be 'rope' or 'learned', got 'sinusoidal'"):
        InductionConfig(pos="sinusoidal")
    with pytest.raises(ValueError, match="n_head must be >= 2"):
        InductionConfig(n_head=1)


def test_training_is_deterministic_and_restores_global_settings():
    threads, strict = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    cfg = InductionConfig(**TINY)
    a, b = train(cfg, 2), train(cfg, 2)
    assert [r["step"] for r in a.curve] == [0, 6, 12]
    assert a.curve == b.curve  # bitwise: every loss of every evaluation
    for name in a.scores:
        assert torch.equal(a.scores[name], b.scores[name])
    assert torch.equal(a.maps, b.maps) and a.maps.shape == (2, 2, 8, 8)
    other = train(InductionConfig(**{**TINY, "seed": 1}), 2)
    assert other.curve != a.curve  # negative control: the seed matters
    assert (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()) == (threads, strict)


def test_induction_command_reports_and_writes(tmp_path, capsys):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()]
    assert cli(["induction", *flags, "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for row in ("loss, first half", "loss, repeated half", "in-context gain", "best previous-token head",
                "best induction head", "2 heads of D=8", "1 head of D=16"):
        assert row in text
    for name in ("curve.png", "key_heads.png", "heads_2.png", "heads_1.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    result = json.loads((tmp_path / "induction.json").read_text())
    assert [r["n_head"] for r in result["runs"]] == [2, 1]
    assert result["config"]["steps"] == 12 and len(result["runs"][0]["scores"]["induction"]) == 2
    assert cli(["induction", "--n-head", "3", "--out", str(tmp_path)]) == 2  # 64 % 3: a one-line error
    assert "n_embd=64 is not divisible by n_head=3" in capsys.readouterr().err
