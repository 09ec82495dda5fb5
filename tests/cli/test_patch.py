"""`selfattn patch`: the metrics and the table it prints are the library's (run_with_cache, patch), the heatmap is
written, and prompts of two lengths or an answer of several tokens are one line and exit 2."""

import pytest
import torch

from selfattn.cli import main as cli
from selfattn.config import GPTConfig
from selfattn.interp import logit_diff, patch, run_with_cache

from helpers.models import byte_run

CLEAN, CORRUPT = "the cat sat on the", "the dog sat on the"  # byte-level: 18 tokens each


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A random byte-level GPT saved as a run folder, and the model."""
    root = tmp_path_factory.mktemp("patch")
    cfg = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=16)
    return root, byte_run(root / "run", cfg)


def _library(model, metric, site, by):
    clean, corrupt = (torch.tensor([list(t.encode())]) for t in (CLEAN, CORRUPT))
    with torch.no_grad():
        logits, cache = run_with_cache(model, clean)
        on_clean, on_corrupt = metric(logits).item(), metric(model(corrupt)[0]).item()
    return on_clean, on_corrupt, patch(model, corrupt, cache, metric, site=site, by=by)


def _table(out: str) -> list[list[str]]:
    """The table's rows, without the header: the layer, the position, the head and the value, the share."""
    lines = out.split("\n\n")[1].splitlines()
    return [line.split() for line in lines[1:]]


@pytest.mark.parametrize("by, site, wrong", [("position", "resid_pre", "y"), ("head", "z", None),
                                             ("head,position", "v", "y")])
def test_patch_prints_the_librarys_metrics_and_its_best_patches(run, by, site, wrong, capsys):
    root, model = run
    png = root / "figs" / f"{by}.png"
    argv = ["patch", "--ckpt", str(root / "run"), "--clean", CLEAN, "--corrupt", CORRUPT, "--answer", "x",
            "--by", by, "--top", "3", "--out", str(png)] + (["--wrong", wrong] if wrong else [])
    if site != "z":  # z is --by head's default
        argv += ["--site", site]
    assert cli(argv) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    metric = logit_diff(ord("x"), ord("y")) if wrong else (lambda logits: logits[..., -1, ord("x")].mean(-1))
    on_clean, on_corrupt, values = _library(model, metric, site, by)
    assert f"at the last position: clean {on_clean:.4f}, corrupt {on_corrupt:.4f}" in out
    assert f"site {site} by {by}" in out.splitlines()[0]
    rows = _table(out)
    assert len(rows) == 3
    best = values.max() if on_clean >= on_corrupt else values.min()  # the patch restoring most of the gap
    assert float(rows[0][-2]) == pytest.approx(best.item(), abs=1e-4)
    index = [int(i) for i in torch.unravel_index(values.flatten().argmax() if on_clean >= on_corrupt
                                                 else values.flatten().argmin(), values.shape)]
    layer = int(rows[0][0])
    if by == "head":
        assert [layer, int(rows[0][1])] == index
    else:
        assert [layer, int(rows[0][1])] == index[:2]  # layer, position (then the token, and the head)
        line = out.split("\n\n")[1].splitlines()[1]
        assert line[19:19 + 18].rstrip() == repr(CLEAN[index[1]]), line
    if by == "head,position":
        assert int(rows[0][-3]) == index[2]
    share = (best.item() - on_corrupt) / (on_clean - on_corrupt)
    assert rows[0][-1] == f"{share:.0%}".replace("-0%", "0%")
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("change, words", [
    ({"--corrupt": "the dogs sat on the"}, "--clean is 18 tokens and --corrupt 19: patching compares"),
    ({"--answer": "xy"}, "--answer 'xy' is 2 tokens for this model ('x' + 'y'), not one"),
    ({"--wrong": ""}, "--wrong '' is 0 tokens for this model (nothing), not one"),
    ({"--by": "head", "--site": "resid_pre"}, "site 'resid_pre' has no heads"),
    ({"--top": "0"}, "--top must be positive, got 0"),
])
def test_patch_refuses_bad_input_in_one_line(run, change, words, capsys):
    root, _ = run
    given = {"--clean": CLEAN, "--corrupt": CORRUPT, "--answer": "x", "--out": str(root / "bad.png"), **change}
    assert cli(["patch", "--ckpt", str(root / "run"), *[x for kv in given.items() for x in kv]]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("selfattn patch: error: ") and words in err, err
    assert not (root / "bad.png").exists()
