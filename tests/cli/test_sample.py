"""`selfattn sample`: text token by token, reproducible seeds, UTF-8 across tokens, every kind of --ckpt."""
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from selfattn.cli import main
from selfattn.cli import sample as sample_cli
from selfattn.generation import compile_decode, compiled, generate, int8
from selfattn.generation.compiled import compiled_of
from selfattn.generation.int8 import quantize_int8
from selfattn.generation.text import new_tokens, text_pieces
from selfattn.io import loading
from selfattn.tokenizers import ByteTokenizer
from selfattn.tokenizers.chat import ChatTemplate


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A micro model trained for a few steps (block_size 16, so long samples slide)."""
    out = tmp_path_factory.mktemp("sample") / "run"
    assert main(["train", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
                 "--batch-size", "8", "--max-steps", "4", "--eval-every", "4", "--set", "eval_batches=1",
                 "--save-every", "4", "--lr", "1e-2", "--out", str(out)]) == 0
    return out


class _Terminal:
    """A stdout that records each write and each flush."""

    def __init__(self):
        self.events = []

    def write(self, text):
        self.events.append(("write", text))

    def flush(self):
        self.events.append(("flush", None))

    def text(self):
        return "".join(t for kind, t in self.events if kind == "write")


def _sample(monkeypatch, *args):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert main(["sample", *args]) == 0
    return terminal


def test_prints_one_flush_per_token_and_reproduces_with_a_seed(run, monkeypatch):
    terminal = _sample(monkeypatch, "--ckpt", str(run), "--prompt", "The ", "--max-new-tokens", "40", "--seed", "7")
    writes = [t for kind, t in terminal.events if kind == "write"]
    assert terminal.events.count(("flush", None)) == 40  # the terminal sees every token as it comes
    assert writes[0] == "The " and writes[-1] == "\n"
    loaded = loading.load(run)
    model, tokenizer = loaded.model, loaded.tokenizer
    tokens = list(new_tokens(model.eval(), tokenizer.encode("The "), 40,
                                generator=torch.Generator().manual_seed(7), temperature=0.8))
    assert terminal.text() == "The " + tokenizer.decode(tokens) + "\n"
    assert _sample(monkeypatch, "--ckpt", str(run), "--prompt", "The ", "--max-new-tokens", "40",
                   "--seed", "7").text() == terminal.text()
    assert _sample(monkeypatch, "--ckpt", str(run), "--prompt", "The ", "--max-new-tokens", "40",
                   "--seed", "8").text() != terminal.text()  # control: another seed, other text


@pytest.mark.slow  # make check leaves it out: a fresh interpreter
def test_a_fresh_process_prints_the_same_text(run, monkeypatch):
    args = ["--ckpt", str(run), "--max-new-tokens", "30", "--seed", "3", "--top-k", "20", "--top-p", "0.9"]
    r = subprocess.run([sys.executable, "-m", "selfattn", "sample", *args], capture_output=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode("utf-8") == _sample(monkeypatch, *args).text()


def test_characters_split_across_tokens_are_printed_whole():
    tok = ByteTokenizer()
    pieces = list(text_pieces(tok, tok.encode("a日🎉")))
    assert pieces == ["a", "", "", "日", "", "", "", "🎉"]
    naive = [bytes([t]).decode("utf-8", errors="replace") for t in tok.encode("a日🎉")]
    assert "\ufffd" in "".join(naive)  # control: decoding token by token breaks the characters
    assert "".join(text_pieces(tok, [0x61, 0xFF, 0x62])) == "a\ufffdb"  # invalid byte
    assert "".join(text_pieces(tok, tok.encode("日")[:2])) == "\ufffd"  # cut short at the end


def test_generation_slides_past_block_size(run):
    loaded = loading.load(run)
    model, start = loaded.model.eval(), loaded.start_token
    block = model.config.block_size
    long = list(new_tokens(model, [start], 3 * block, temperature=0.0))
    assert len(long) == 3 * block
    direct = torch.cat(list(generate(model, torch.tensor([[start]]), block, temperature=0.0))).tolist()
    assert long[:block] == direct  # within one window, exactly generate(model, ...)


def test_sample_from_a_checkpoint_file_and_a_torch_save_state_dict(run, monkeypatch):
    from selfattn.training import checkpoint

    args = ["--max-new-tokens", "20", "--seed", "1", "--prompt", "x"]
    expected = _sample(monkeypatch, "--ckpt", str(run), *args).text()
    assert _sample(monkeypatch, "--ckpt", str(checkpoint.latest(run)), *args).text() == expected
    weights, _ = checkpoint.read_weights(checkpoint.latest(run))
    torch.save(weights, run / "exported.pt")
    assert _sample(monkeypatch, "--ckpt", str(run / "exported.pt"), *args).text() == expected


def test_sample_errors_are_one_line(tmp_path, capsys):
    assert main(["sample", "--ckpt", str(tmp_path)]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err
    assert main(["sample", "--ckpt", str(tmp_path / "nope.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--top-p", "1.5"], "--top-p must be in (0, 1] or unset, got 1.5"),
    (["--top-k", "0"], "--top-k must be a positive int or unset, got 0"),
    (["--top-p", "inf"], "--top-p must be in (0, 1] or unset, got inf"),
    (["--top-p", "nan"], "--top-p must be in (0, 1] or unset, got nan"),
    (["--temperature", "-1"], "--temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    (["--temperature", "inf"], "--temperature must be a finite number >= 0 (0 = greedy), got inf"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0 (0 = greedy), got nan")])
def test_sampling_flags_are_refused_by_their_names_before_the_prompt_is_printed(run, capsys, flags, message):
    assert main(["sample", "--ckpt", str(run), "--prompt", "The prompt", "--max-new-tokens", "3", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"selfattn sample: error: {message}\n"
    good = {"--top-p": "1.0", "--top-k": "1", "--temperature": "0"}[flags[0]]  # control: a value in range samples
    assert main(["sample", "--ckpt", str(run), "--prompt", "The prompt", "--max-new-tokens", "3", flags[0], good]) == 0
    assert capsys.readouterr().out.startswith("The prompt")


def test_sample_from_a_local_gpt2_folder_matches_transformers(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import transformers

    from selfattn.tokenizers import BPETokenizer
    from selfattn.training.data import read_corpus

    text, _ = read_corpus(None)
    bpe = BPETokenizer.train(text[:20_000], vocab_size=300)
    bpe.tok.add_special_tokens(["<|endoftext|>"])
    bpe.tok.save(str(tmp_path / "tokenizer.json"))
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=301, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=300, eos_token_id=300)
    hf = transformers.GPT2LMHeadModel(config).eval()
    hf.save_pretrained(tmp_path)
    prompt = "The value "
    ids = bpe.encode(prompt)
    want = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=300)[0, len(ids):]
    got = _sample(monkeypatch, "--ckpt", str(tmp_path), "--prompt", prompt, "--temperature", "0",
                  "--max-new-tokens", "12").text()
    assert got == prompt + BPETokenizer.from_json(open(tmp_path / "tokenizer.json").read()).decode(want.tolist()) + "\n"
    (tmp_path / "tokenizer.json").unlink()
    monkeypatch.setattr(sys, "stdout", _Terminal())
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        loading.load(tmp_path)


def test_quantize_int8_samples_with_the_int8_model(run, monkeypatch):
    quantised = []
    monkeypatch.setattr(int8, "quantize_int8", lambda model: quantised.append(quantize_int8(model)) or model)
    text = _sample(monkeypatch, "--ckpt", str(run), "--prompt", "The ", "--max-new-tokens", "30",
                   "--temperature", "0", "--quantize", "int8").text()
    [model] = quantised
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())  # every projection is int8
    tokenizer = loading.load(run).tokenizer
    tokens = list(new_tokens(model, tokenizer.encode("The "), 30, temperature=0))
    assert text == "The " + tokenizer.decode(tokens) + "\n"  # what the int8 model writes


def test_compile_samples_the_eager_text_across_slides(run, monkeypatch):
    args = ["--ckpt", str(run), "--prompt", "The ", "--max-new-tokens", "40", "--temperature", "0"]  # block_size 16
    compiled = []
    monkeypatch.setattr(sample_cli, "compile_decode", lambda model: compiled.append(model) or compile_decode(model))
    assert _sample(monkeypatch, *args, "--compile").text() == _sample(monkeypatch, *args).text()
    assert len(compiled) == 1 and compiled_of(compiled[0]) is not None


@pytest.mark.slow  # make check leaves it out: compiles graphs
def test_compile_speculates_through_compiled_forwards_with_the_eager_text(run, monkeypatch):
    args = ["--ckpt", str(run), "--prompt", "The ", "--max-new-tokens", "12", "--temperature", "0"]
    calls = []
    for name in ("hidden", "logits"):  # a graph's forward, or the decode kernel's verification
        method = getattr(compiled.CompiledDecode, name)
        monkeypatch.setattr(compiled.CompiledDecode, name,
                            lambda self, *a, method=method, **kw: calls.append(a) or method(self, *a, **kw))
    for how in ("lookup", f"draft:{run}"):
        speculated = _sample(monkeypatch, *args, "--speculative", how, "--compile").text()
        assert speculated == _sample(monkeypatch, *args).text() and calls
        calls.clear()


def test_quantize_refuses_an_unknown_kind(run, capsys):
    with pytest.raises(SystemExit) as e:
        main(["sample", "--ckpt", str(run), "--quantize", "int4"])
    assert e.value.code == 2 and "--quantize: invalid choice: 'int4'" in capsys.readouterr().err


def test_the_library_refuses_an_infinite_temperature_too(run):
    model = loading.load(run).model.eval()
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        list(generate(model, torch.tensor([[1]]), 3, temperature=float("inf")))
    assert len(list(generate(model, torch.tensor([[1]]), 3, temperature=1e30))) == 3  # control: finite, however large


def _with_chat(run, monkeypatch):
    """``run`` loaded with a chat template that writes the message, then ">" (one token a byte)."""
    loaded = dataclasses.replace(loading.load(run), chat=ChatTemplate("{{ messages[0].content }}>", {}, "test"))
    monkeypatch.setattr(sample_cli, "load", lambda path: loaded)


@pytest.mark.parametrize("message, new, fix", [("abcdefghij", 7, "pass --max-new-tokens 6 or less"),
                                               ("x" * 39, 1, "shorten the message")])
def test_a_chat_longer_than_the_context_is_refused_before_generating(run, monkeypatch, capsys, message, new, fix):
    _with_chat(run, monkeypatch)  # block_size 16
    generated = []
    monkeypatch.setattr(sample_cli, "new_tokens", lambda *a, **kw: generated.append(a) or iter(()))
    args = ["sample", "--ckpt", str(run), "--chat", message, "--max-new-tokens"]
    assert main([*args, str(new)]) == 2
    out, err = capsys.readouterr()
    prompt = len(message) + 1
    assert out == "" and not generated
    assert err == (f"selfattn sample: error: --chat: the chat is {prompt} tokens (its template included) and "
                   f"--max-new-tokens asks for {new} more, past the model's context of 16 tokens, which would cut "
                   f"the chat's start; {fix}\n")
    if new > 1:  # control: one token fewer fits (the last new token is never read back), and is generated
        assert main([*args, str(new - 1)]) == 0 and generated


@pytest.mark.parametrize("prompt, generated, printed", [("The", " cat", "The cat\n"), ("The", "", "The\n"),
                                                       ("The", " cat\n", "The cat\n"), ("", "", "")])
def test_ctrl_c_ends_the_printed_line_before_the_message(run, monkeypatch, capsys, prompt, generated, printed):
    tokens = loading.load(run).tokenizer.encode(generated)

    def interrupted(*args, **kwargs):
        yield from tokens
        raise KeyboardInterrupt

    monkeypatch.setattr(sample_cli, "new_tokens", interrupted)
    assert main(["sample", "--ckpt", str(run), "--prompt", prompt]) == 130
    assert capsys.readouterr() == (printed, "selfattn sample: interrupted\n")  # a line of its own; no blank line
