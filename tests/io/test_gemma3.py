"""A second real model, offline: Gemma 3 270M as a Q4_K_M GGUF file loads into the one decoder (sandwich norms
stored as 1 + w, q/k norms, a window of 512 on five layers of six with their own RoPE base, a tied head of
262,144 rows) and continues prompts as llama.cpp does, token for token, on the float32 copy of the file. Its
own oracle is llama.cpp: transformers reads this file wrongly. The commands run on it."""
import pytest
import torch

from selfattn.cli import main
from selfattn.formats import gguf as formats_gguf
from selfattn.generation import generate
from selfattn.io import loading

from helpers.gemma3 import gemma3, gemma3_f32
from helpers.llama_cpp import complete

LONG = ("The lighthouse keeper wrote the weather into a leather book every evening: wind, rain, fog and the state "
        "of the sea, in a small neat hand. ") * 24 + "On the last page of the book he wrote"  # past the window
PROMPTS = ["The capital of France is", "def fibonacci(n):\n", "1, 1, 2, 3, 5, 8, 13,", LONG]
TOKENS = 16


@pytest.fixture(scope="module")
def f32():
    return loading.load(gemma3_f32())


def test_the_config_is_what_llama_cpp_derives_for_gemma3(f32):
    c = f32.model.config
    assert (c.n_layer, c.n_head, c.n_kv_head, c.n_embd, c.head_dim, c.vocab_size) == (18, 4, 1, 640, 256, 262144)
    assert c.window == 512 and [i for i, s in enumerate(c.window_layers) if not s] == [5, 11, 17]
    assert (c.rope_base, c.window_rope_base, c.attn_scale) == (1e6, 1e4, 256 ** -0.5)
    assert c.tie_embeddings and c.embedding_scale == pytest.approx(640 ** 0.5) and c.norm_offset == 1.0
    assert f32.start_token == 2 and 1 in f32.eos
    stored = {t.name: t for t in formats_gguf._reader(gemma3_f32()).tensors}
    for ours, theirs in ((f32.model.blocks[0].ln_1, "blk.0.attn_norm"), (f32.model.blocks[17].attn.k_norm,
                                                                          "blk.17.attn_k_norm")):
        assert torch.equal(ours.weight + 1, torch.tensor(stored[theirs + ".weight"].data))  # stored as 1 + w


@pytest.mark.slow
def test_greedy_continuations_equal_llama_cpps_on_the_float32_copy(f32):
    model = f32.model
    for prompt in PROMPTS:
        ids = f32.tokenizer.encode(prompt, special=True)
        assert ids[0] == 2 and (prompt is not LONG or len(ids) > model.config.window)
        ours = _continue(f32, prompt, TOKENS)
        theirs = complete(gemma3_f32(), prompt, TOKENS, 1024).decode()
        assert ours == theirs and len(ours.strip()) > 10, (prompt[-40:], ours, theirs)


def _continue(loaded, prompt: str, tokens: int) -> str:
    ids = loaded.tokenizer.encode(prompt, special=True)  # bos first, as `selfattn sample --prompt` and llama.cpp
    return loaded.tokenizer.decode([int(t) for t in generate(loaded.model.eval(), torch.tensor([ids]), tokens,
                                                             temperature=0)])


def test_without_taking_the_norm_offset_off_the_continuation_is_gibberish(f32):  # control
    assert "capital" in _continue(f32, PROMPTS[0], 8)
    norms = [p for name, p in f32.model.named_parameters() if name.split(".")[-2].startswith(("ln", "post_ln", "q_norm",
                                                                                               "k_norm"))]
    assert len(norms) == 18 * 6 + 1
    try:
        with torch.no_grad():
            for p in norms:
                p.add_(1.0)  # the converter's 1 left on: 1 + 1 + w
        out = _continue(f32, PROMPTS[0], 8)
    finally:
        with torch.no_grad():
            for p in norms:
                p.sub_(1.0)
    assert "capital" not in out and "Paris" not in out, out


@pytest.mark.slow
@pytest.mark.parametrize("command", [["sample", "--prompt", "The capital of France is", "--temperature", "0",
                                      "--max-new-tokens", "8"],
                                     ["check", "--method", "perturb", "--seq-len", "8"],
                                     ["heads", "--text", "the cat sat, the cat sat", "--layers", "0,17"],
                                     ["explore", "--text", "the cat sat, the cat sat"],
                                     ["eval", "--context", "32"]])
def test_sample_check_heads_explore_and_eval_run_on_the_q4_k_m_file(command, tmp_path, capsys):
    (tmp_path / "text.txt").write_text("The capital of France is Paris. The capital of Italy is Rome. " * 4)
    out = {"heads": ["--out", str(tmp_path / "heads")], "explore": ["--out", str(tmp_path / "page.html")],
           "eval": ["--data", str(tmp_path / "text.txt")]}
    assert main([command[0], "--ckpt", str(gemma3()), *command[1:], *out.get(command[0], [])]) == 0
    printed = capsys.readouterr().out
    expected = {"sample": "The capital of France is", "check": "2 of 2 cases ok", "heads": "induction",
                "explore": "18 layers x 4 heads", "eval": "perplexity"}[command[0]]
    assert expected in printed, printed
