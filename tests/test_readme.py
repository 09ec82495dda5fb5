"""The Python examples of the README and of the pages under docs/ run as written and compute what
their comments say."""
import re
from pathlib import Path

import torch

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text()
PAGES = {path: path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
BLOCKS = [b for text in PAGES.values() for b in re.findall(r"```python\n(.*?)```", text, flags=re.S)]


def _block(first_line: str) -> str:
    """The Python block of the README or a docs page that starts with ``first_line``."""
    found = [b for b in BLOCKS if b.startswith(first_line)]
    assert len(found) == 1, f"{len(found)} blocks of README.md and docs/*.md start with {first_line!r}"
    return found[0]


def _runnable(block: str) -> str:
    """A block up to its first line with a ``...`` placeholder (the signature lines that follow)."""
    lines = block.splitlines()
    cut = next((i for i, line in enumerate(lines) if "..." in line.split("#")[0]), len(lines))
    return "\n".join(lines[:cut])


def test_the_module_example():
    scope = {}
    exec(_block("import torch\nfrom selfattn import SelfAttention"), scope)
    assert scope["y"].shape == (1, 4, 8)
    assert sum(p.numel() for p in scope["attn"].parameters()) == 4 * 8 * 8  # 4·C²


def test_the_functional_and_programmable_examples():
    q, k, v = torch.randn(3, 1, 8, 32, 16).unbind(0)  # (B, H, T, D), 8 heads as the example's slopes
    scope = {"torch": torch, "q": q, "k": k, "v": v}
    exec(_block("from selfattn import attention\n"), scope)
    assert scope["out"].shape == (1, 8, 32, 16)
    from selfattn import attention
    assert torch.equal(scope["out"], attention(q, k, v))  # the signature's values are the defaults
    exec(_runnable(_block("from selfattn.scores import alibi_slopes")), scope)
    assert scope["out"].shape == (1, 8, 32, 16) and torch.isfinite(scope["out"]).all()


def test_the_gpt_examples(capsys):
    scope = {}
    exec(_block("import torch\nfrom selfattn import GPT, GPTConfig"), scope)
    assert scope["logits"].shape == (8, 64, 256) and scope["loss"].ndim == 0
    assert len(capsys.readouterr().out.split()) == 50  # 50 streamed tokens
    exec(_block("idx  = torch.tensor("), scope)
    assert scope["out"].shape == (2, 10)

