"""`selfattn heads`: the scores it prints and writes are the library's, on every kind of model path."""
import dataclasses
import json

import pytest
import torch

from selfattn.analysis.heads import attention_maps, head_scores
from selfattn.cli import main as cli
from selfattn.config import GPTConfig
from selfattn.model import GPT
from selfattn.tokenizers import BPETokenizer
from selfattn.training import checkpoint

from helpers.gpt2 import gpt2_folder


def _save_run(folder, cfg):

    model = GPT(cfg)
    folder.mkdir()
    checkpoint.save(folder, 1, model, torch.optim.AdamW(model.parameters()), keep=1,
                    meta={"model": dataclasses.asdict(cfg), "tokenizer": {"kind": "byte"}, "step": 1})
    return model


def test_heads_command_on_our_checkpoint(tmp_path, capsys):
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=16, mlp=False)
    model = _save_run(tmp_path / "run", cfg).eval()
    assert cli(["heads", "--ckpt", str(tmp_path / "run"), "--random-tokens", "8", "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "2 layers x 2 heads on cpu in float32; input: 8 random tokens, repeated (T=16)" in text
    for role in ("previous-token", "induction", "duplicate-token", "first-token"):
        assert f"  {role}" in text
    result = json.loads((tmp_path / "out" / "scores.json").read_text())
    tokens = torch.tensor([result["tokens"]])
    assert torch.equal(tokens[:, :8], tokens[:, 8:])
    expected = head_scores(attention_maps(model, tokens), tokens)  # the same weights, computed here
    for name, s in expected.items():
        torch.testing.assert_close(torch.tensor(result["scores"][name]), s)
    best = result["ranking"]["induction"][0]
    assert best["score"] == pytest.approx(expected["induction"].max().item())
    assert (tmp_path / "out" / "attention.png").read_bytes()[:4] == b"\x89PNG"
    assert cli(["heads", "--ckpt", str(tmp_path / "run"), "--layers", "0,2", "--out", str(tmp_path / "o")]) == 2
    assert "--layers [2] out of range: the model has 2 layers" in capsys.readouterr().err


def test_heads_command_on_a_gpt2_folder(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = gpt2_folder(tmp_path / "gpt2", n_head=4)
    tokenizer = BPETokenizer.from_folder(folder)
    text = "the cat sat. the cat sat."
    assert cli(["heads", "--ckpt", str(folder), "--text", text, "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "2 layers x 4 heads on cpu in float32; input: --text" in out and "induction" in out
    result = json.loads((tmp_path / "out" / "scores.json").read_text())
    assert result["tokens"] == tokenizer.encode(text)
    assert torch.tensor(result["scores"]["induction"]).shape == (2, 4)
    assert cli(["heads", "--ckpt", str(folder), "--text", "abc", "--out", str(tmp_path / "o2")]) == 0
    assert "no token occurs twice" in capsys.readouterr().out


def test_heads_on_a_text_whose_only_repeat_is_adjacent_shows_induction_as_n_a(tmp_path, capsys):
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=16)
    model = _save_run(tmp_path / "run", cfg).eval()
    for given, tokens in ((["--text", "hello"], list(b"hello")), (["--random-tokens", "1"], None)):
        assert cli(["heads", "--ckpt", str(tmp_path / "run"), *given, "--out", str(tmp_path / "out")]) == 0
        text = capsys.readouterr().out
        assert "induction: n/a, undefined on this input: no token recurs with another token between its two " \
               "copies" in text and "no token occurs twice" not in text
        assert "\n  induction         n/a\n" in text and text.count("n/a") == 2 + 4  # the note, the ranking, 4 heads
        result = json.loads((tmp_path / "out" / "scores.json").read_text())
        assert tokens is None or result["tokens"] == tokens
        assert result["scores"]["induction"] == [[None, None], [None, None]] and result["ranking"]["induction"] == []
        ids = torch.tensor([result["tokens"]])
        expected = head_scores(attention_maps(model, ids), ids)["duplicate-token"]  # defined: "ll", or the pair
        torch.testing.assert_close(torch.tensor(result["scores"]["duplicate-token"]), expected)
    assert cli(["heads", "--ckpt", str(tmp_path / "run"), "--random-tokens", "17", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == ("selfattn heads: error: --random-tokens 17 shows 34 tokens, more than the "
                                       "model's block_size=32; pass --random-tokens 16 or less\n")
    assert cli(["heads", "--ckpt", str(tmp_path / "run"), "--random-tokens", "16", "--out", str(tmp_path / "out")]) == 0
