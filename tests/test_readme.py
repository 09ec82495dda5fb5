"""The Python examples of the README and of the pages under docs/ run as written and compute what
their comments say; the README opens with its two set-up commands and stays an overview; every
relative link and image of those pages points at a file (and heading) that exists."""
import re
from pathlib import Path

import pytest
import torch

from selfattn.generation import generate
from selfattn.generation.compiled import compiled_of
from selfattn.generation.steps import set_compiled

from helpers.smollm2 import smollm2

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


def test_the_real_model_example(monkeypatch, capsys):
    assert (ROOT / ".cache" / "models" / smollm2().name).resolve() == smollm2().resolve()  # the link make models left
    monkeypatch.chdir(ROOT)  # the README's path is the clone's
    scope = {}
    exec(_block("import torch\nfrom selfattn.io.loading import load"), scope)
    assert scope["new"].shape == (1, 8) and capsys.readouterr().out.startswith(" Paris.")  # what its comment says


def test_the_compiled_decoding_example():
    scope = {"torch": torch}
    exec(_block("from selfattn import GPT, GPTConfig\nfrom selfattn.generation import compile_decode"), scope)
    model, out = scope["model"], scope["out"]
    assert out.shape == (1, 20) and compiled_of(model) is not None
    set_compiled(model, None)  # the same model, eager: the same tokens
    assert torch.equal(torch.stack(list(generate(model, scope["idx"], 20, temperature=0)), dim=1), out)


def test_the_readme_opens_with_its_two_set_up_commands_and_stays_an_overview():
    first_block = re.search(r"```(\w*)\n(.*?)```", README, flags=re.S)
    assert first_block[1] == "bash" and [line.split()[:2] for line in first_block[2].splitlines()] == [
        ["make", "demo"], ["make", "test"]]
    assert README.index("```bash\nmake demo") < README.index("\n## ")  # before any section
    assert len(README.encode()) <= 15_000, len(README.encode())


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _links(text: str):
    prose = re.sub(r"```.*?```", "", text, flags=re.S)  # links inside code are not links
    prose = re.sub(r"`[^`\n]*`", "", prose)
    return re.findall(r"\]\(([^)\s]+)\)", prose)


def _broken(page: Path, text: str) -> list[str]:
    """The relative links and images of ``text`` (a page at ``page``) whose file or heading is missing."""
    broken = []
    for link in _links(text):
        if re.match(r"[a-z]+:", link):
            continue  # an absolute address
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no file {path}")
        elif anchor:
            headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", path.read_text(), flags=re.S), flags=re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(f"{link}: no heading #{anchor} in {path.name}")
    return broken


@pytest.mark.parametrize("page", list(PAGES), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_image_resolves(page):
    assert _broken(page, PAGES[page]) == []


def test_the_link_check_catches_a_broken_path_and_a_broken_anchor():  # negative controls
    assert _links("see [a](docs/nope.md) and ![b](x.png), not `[c](d)` in\n```\n[e](f)\n```") == [
        "docs/nope.md", "x.png"]
    assert _slug("Masks (`python -m benchmarks masks`)") == "masks-python--m-benchmarks-masks"
    readme = ROOT / "README.md"
    assert _broken(readme, "[ok](docs/gpt.md#train-and-sample) [gone](docs/gone.md) ![img](tiny_loss.png) "
                           "[anchor](docs/gpt.md#no-such-heading) [web](https://example.org)") == [
        f"docs/gone.md: no file {ROOT / 'docs' / 'gone.md'}", f"tiny_loss.png: no file {ROOT / 'tiny_loss.png'}",
        "docs/gpt.md#no-such-heading: no heading #no-such-heading in gpt.md"]
