"""``selfattn check``: every built-in case passes, a user's leaking module fails the command."""
import os
import re
import subprocess
import sys
import textwrap

import pytest
import torch

from selfattn.audit.suite import OPTIONS
from selfattn.backends import NAMES, availability, load
from selfattn.cli import main
from selfattn.config import GPTConfig
from selfattn.masks import Mask
from selfattn.model import GPT
from selfattn.training import checkpoint

LEAKY = textwrap.dedent("""
    import torch
    from torch import nn

    class Leaky(nn.Module):
        '''Attention without a mask, and a token model around it.'''
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(8, 24)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)  # (B, T, C) each
            return (q @ k.transpose(1, 2)).softmax(-1) @ v  # (B, T, C)

    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.mix = nn.Embedding(50, 8), Leaky()

        def forward(self, idx):
            return self.mix(self.wte(idx))

    def build():
        return Leaky()

    def causal():
        from selfattn import SelfAttention
        return SelfAttention(12, 3, rope=True)

    def tokens():
        return Tokens()

    def broken():
        raise ValueError("bad factory value")

    class Crashes(nn.Module):
        def forward(self, x):
            raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    def crashes():
        return Crashes()
""")


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    (tmp_path / "user_mod.py").write_text(LEAKY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def run_cli(*args, path=None):
    """``selfattn check ARGS`` in a fresh process (one thread, like a test worker), ``path`` importable."""
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(path or ""), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "selfattn", "check", *args], capture_output=True, text=True, env=env)


REFUSED = {"sdpa": ("softcap", "sinks"), "flex": ("sinks",)}  # cases a backend refuses, said as skipped


@pytest.mark.slow  # make check leaves it out: one of its heaviest tests
def test_every_builtin_case_passes():
    done = run_cli("--seq-len", "8")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    backends = [n for n in NAMES if availability(n) is None]  # every backend that runs on this CPU
    for backend in backends:
        float64 = load(backend).unsupported(*(torch.zeros(1, 1, 1, 8, dtype=torch.float64),) * 3, Mask(), 0.0) is None
        method, leak = (r"per\+jac", r"0 \| 0") if float64 else ("perturb", "0")  # the jacobian runs in float64
        for option in OPTIONS:
            dead = "0,1" if option == "padding" else "-"  # the two left-padding positions
            refused = REFUSED.get(backend, ()) and option in REFUSED[backend]
            want = rf"{backend} {re.escape(option)} +skipped: " if refused else \
                rf"{backend} {re.escape(option)} +{method} +ok +{leak} +{dead} "
            assert any(re.match(want, line) for line in lines), (backend, option)
    for gpt in ("gpt", "gpt rope+gqa+window"):
        assert any(re.match(rf"{re.escape(gpt)} +per\+jac +ok +0 \| 0 ", line) for line in lines), gpt
        assert any(re.match(rf"{re.escape(gpt)} kv-cache +cache +ok ", line) for line in lines), gpt
    assert any(re.match(r"gpt rope\+gqa\+window layer 0 window=4 +per\+jac +ok +0 \| 0 ", line) for line in lines)
    n = len(backends) * len(OPTIONS) - sum(len(REFUSED.get(b, ())) for b in backends) + 5  # 2 gpts, 2 caches, 1 layer
    assert lines[-1] == f"{n} of {n} cases ok"
    assert any(re.match(r"triton +skipped: .*needs a CUDA device", line) for line in lines)  # and says why


@pytest.mark.slow  # make check leaves it out: a fresh interpreter
def test_a_leaking_user_module_fails_the_command(user_modules):
    done = run_cli("--module", "user_mod:build", "--seq-len", "5", path=user_modules)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "user_mod:build" in done.stdout and " LEAK " in done.stdout
    assert "first leak: output 0 depends on input 1" in done.stdout
    assert "    0 █!!!!" in done.stdout  # the picture, printed under the failing case
    assert done.stdout.splitlines()[-1] == "0 of 1 cases ok, 1 FAILED"


def test_user_modules_in_process(user_modules, capsys):
    assert main(["check", "--module", "user_mod:causal", "--shape", "1,6,12", "--method", "jacobian"]) == 0
    out = capsys.readouterr().out
    assert "user_mod:causal" in out and "jacobian" in out and "1 of 1 cases ok" in out
    assert main(["check", "--module", "user_mod:causal"]) == 0  # width 12 read from its first Linear
    assert main(["check", "--module", "user_mod:tokens", "--method", "perturb"]) == 1  # token ids, via .wte
    assert "first leak: output 0 depends on input 1" in capsys.readouterr().out


@pytest.mark.parametrize("args,words", [
    (["--module", "user_mod"], ["pkg.mod:factory", "'user_mod'"]),
    (["--module", "no_such_mod:f"], ["cannot import", "'no_such_mod'"]),
    (["--module", "user_mod:nothing"], ["no callable", "'nothing'"]),
    (["--module", "user_mod:build", "--shape", "2,x,8"], ["--shape", "'2,x,8'"]),
    (["--ckpt", "nowhere", "--module", "user_mod:build"], ["not both"]),
    (["--seq-len", "1"], ["--seq-len", "1"]),
    (["--module", "user_mod:broken"], ["the factory user_mod:broken() raised ValueError: bad factory value"]),
    (["--module", "user_mod:crashes", "--shape", "2,5,8"],
     ["the module user_mod:crashes() built raised RuntimeError on an input of shape (2, 5, 8): mat1 and mat2"]),
])
def test_bad_flags_are_one_line_errors(user_modules, capsys, args, words):
    assert main(["check", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


def test_audits_a_trained_checkpoint(tmp_path, capsys):
    config = GPTConfig(vocab_size=40, block_size=12, n_layer=1, n_head=2, n_embd=8)
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters())
    checkpoint.save(tmp_path, 7, model, optimizer, meta={"model": config.__dict__, "tokenizer": {"kind": "byte"}},
                    keep=1)
    assert main(["check", "--ckpt", str(tmp_path)]) == 0  # unset, --seq-len is 16, or block_size=12 when less
    out = capsys.readouterr().out
    assert f"{tmp_path} " in out and f"{tmp_path} kv-cache " in out and "2 of 2 cases ok" in out
    assert main(["check", "--ckpt", str(tmp_path), "--seq-len", "13"]) == 2  # asked for: refused, not cut to 12
    assert capsys.readouterr().err == (f"selfattn check: error: --seq-len 13 is more than {tmp_path}'s "
                                       f"block_size=12; pass --seq-len 12 or less\n")
    assert main(["check", "--ckpt", str(tmp_path), "--seq-len", "12"]) == 0  # control: the limit itself
    assert "2 of 2 cases ok" in capsys.readouterr().out
    assert main(["check", "--ckpt", str(tmp_path / "empty")]) == 2
