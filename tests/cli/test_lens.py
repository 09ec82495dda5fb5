"""`selfattn lens`: each layer's top tokens are the library's logit lens, the last layer's the model's own greedy
next token (on a run of ours, a GPT-2 folder and a GGUF file); the heatmap is written; bad positions are one line,
exit 2."""

import pytest
import torch

from selfattn.cli import main as cli
from selfattn.config import GPTConfig
from selfattn.interp import logit_lens, run_with_cache
from selfattn.tokenizers import BPETokenizer

from helpers.gpt2 import gpt2_folder
from helpers.models import byte_run
from helpers.smollm2 import smollm2

TEXT = "the cat sat on the mat. the cat"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lens")
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=3, n_head=2, n_embd=16)
    return root, byte_run(root / "run", cfg)


def _byte(token: int) -> str:
    return repr(bytes([token]).decode("utf-8", errors="replace"))


def _rows(out: str, position: int, label: str) -> list[str]:
    """The lines of one position's block: one a layer."""
    block = next(b for b in out.split("\n\n") if b.lstrip().startswith(f"position {position} {label}"))
    return block.splitlines()[1:]


def test_lens_prints_each_layers_top_tokens_and_the_last_is_the_models_own(run, capsys):
    root, model = run
    png = root / "figs" / "lens.png"
    assert cli(["lens", "--ckpt", str(root / "run"), "--text", TEXT, "--positions=-1,3", "--top", "2",
                "--out", str(png)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    ids = torch.tensor([list(TEXT.encode())])
    with torch.no_grad():
        logits, cache = run_with_cache(model, ids)
        probs = logit_lens(model, cache)[:, 0].softmax(-1)  # (L, T, V)
    T = ids.shape[1]
    for t in (T - 1, 3):
        rows = _rows(out, t, repr(TEXT[t]))
        assert len(rows) == 3
        for layer, row in enumerate(rows):
            top = probs[layer, t].topk(2)
            cells = "  ".join(f"{_byte(i)} {p:.3f}" for i, p in zip(top.indices.tolist(), top.values.tolist()))
            assert row == f"  L{layer:<4}{cells}"
        greedy = logits[0, t].argmax().item()  # the model's own next token: the last layer's first
        assert rows[-1].startswith(f"  L2   {_byte(greedy)} {logits[0, t].softmax(-1)[greedy]:.3f}")
    assert f"position 3 {TEXT[3]!r}, next in the text {TEXT[4]!r}" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert cli(["lens", "--ckpt", str(root / "run"), "--out", str(png)]) == 0  # random tokens, repeated
    assert "input: 16 random tokens, repeated (T=32)" in capsys.readouterr().out


def test_lens_on_a_gpt2_folder_ends_on_the_greedy_token(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = gpt2_folder(tmp_path / "gpt2")
    tokenizer = BPETokenizer.from_folder(folder)
    text = "the dog sat on the"
    assert cli(["lens", "--ckpt", str(folder), "--text", text, "--out", str(tmp_path / "lens.png")]) == 0
    out = capsys.readouterr().out
    from selfattn.io.loading import load

    model = load(folder).model.eval()
    ids = tokenizer.encode(text)
    with torch.no_grad():
        greedy = model(torch.tensor([ids]))[0][0, -1].argmax().item()
    label = repr(tokenizer.token_bytes(greedy).decode("utf-8", errors="replace"))
    rows = _rows(out, len(ids) - 1, repr(tokenizer.token_bytes(ids[-1]).decode()))
    assert len(rows) == 2 and rows[-1].startswith(f"  L1   {label} ")


def test_lens_on_a_gguf_file_ends_on_the_models_answer(tmp_path, capsys):
    assert cli(["lens", "--ckpt", str(smollm2()), "--text", "The capital of France is", "--top", "2",
                "--out", str(tmp_path / "lens.png")]) == 0
    rows = _rows(capsys.readouterr().out, 4, repr(" is"))
    assert len(rows) == 30 and rows[-1].startswith("  L29  ' Paris' ") and "' Paris'" not in rows[0]


@pytest.mark.parametrize("positions, words", [("-40", "--positions [-40] out of range: the input has 31 tokens"),
                                              ("1,x", "--positions must be comma-separated integers")])
def test_lens_refuses_positions_out_of_range_in_one_line(run, positions, words, capsys):
    root, _ = run
    assert cli(["lens", "--ckpt", str(root / "run"), "--text", TEXT, f"--positions={positions}",
                "--out", str(root / "bad.png")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("selfattn lens: error: ") and words in err, err
    assert not (root / "bad.png").exists()
