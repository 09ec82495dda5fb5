"""What the GGUF export tests share: our greedy continuation, its bytes as llama-completion prints them, the
check that llama.cpp continues an exported file as we continue its model, and the command run in-process."""
import contextlib
import io

import torch

from selfattn.cli import main as cli
from selfattn.generation import generate

from helpers.llama_cpp import complete
from helpers.models import assert_same_logits

PROMPT = "The cat sat on the mat; the dog sat on the log."  # 48 bytes: past Gemma's window of 16
TOKENS = 24


def ours(gpt, tokenizer, prompt: str, n: int = TOKENS) -> list[int]:
    ids = tokenizer.encode(prompt, special=True)
    return [int(t) for t in generate(gpt.eval(), torch.tensor([ids]), n, temperature=0)]


def text(tokenizer, ids) -> bytes:
    """The bytes of ``ids`` as llama-completion prints them: each token's text as a C string (a NUL: nothing)."""
    return b"".join(tokenizer.token_bytes(i) for i in ids).replace(b"\0", b"")


def assert_llama_cpp_continues_as_we_do(done, gpt, tokenizer) -> None:
    """The file ``done`` wrote (an ``ExportedGGUF`` of ``gpt``), read back, computes our logits, and
    ``llama-completion`` continues :data:`PROMPT` on it, greedily, byte for byte as our ``generate`` does."""
    idx = torch.randint(0, 256, (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_logits(done.model(idx)[0], gpt.eval()(idx)[0])  # the file read back computes our logits
    expected = ours(gpt, tokenizer, PROMPT)
    assert len(set(expected)) > 5 and 11 not in expected  # not a repetition; 11 would stop llama.cpp (its eos)
    assert complete(done.path, PROMPT) == text(tokenizer, expected)


def command(*args) -> tuple[int, str, str]:
    """``selfattn ARGS`` in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli(list(args))
    return code, out.getvalue(), err.getvalue()
