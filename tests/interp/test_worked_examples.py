"""docs/interp.md's worked examples on SmolLM2 and Gemma 3 run as written, in order, and what the text says of them
holds: the heads that carry a fact (one head, 93 % of the gap, in each model), the indirect object's, the induction
heads whose ablation raises the loss on a repeat far more than other heads', and a head ranking that an F32 copy
keeps bit for bit and a Q8_0 copy nearly."""
import contextlib
import os
import re
from pathlib import Path

import pytest
import torch

from selfattn.cli import main

from helpers.gemma3 import gemma3
from helpers.smollm2 import smollm2

ROOT = Path(__file__).parents[2]
PAGE = (ROOT / "docs" / "interp.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE, flags=re.S)


def _block(first_line: str) -> str:
    """The Python block of docs/interp.md that starts with ``first_line``."""
    found = [b for b in BLOCKS if b.startswith(first_line)]
    assert len(found) == 1, f"{len(found)} blocks of docs/interp.md start with {first_line!r}"
    return found[0]


@contextlib.contextmanager
def _at_root():
    """The blocks' paths are the clone's (``.cache/models/...``)."""
    before = os.getcwd()
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.chdir(before)


def _run(first_line: str, scope: dict) -> dict:
    with _at_root(), torch.random.fork_rng():  # a block that draws leaves the test's generator alone
        exec(_block(first_line), scope)
    return scope


@pytest.fixture(scope="module")
def scope():
    """The two models loaded by the section's first block, once for the module."""
    assert {p.resolve() for p in (ROOT / ".cache" / "models").iterdir()} >= {smollm2().resolve(), gemma3().resolve()}
    return _run("# Worked examples: the two models", {})


@pytest.fixture(scope="module")
def recall(scope):
    """The factual-recall sweeps (block 1), which blocks 2 and 4 use."""
    return _run("# Worked examples, 1:", scope)


def test_factual_recall_is_one_head_in_each_model(recall):
    found = recall["recall"]
    assert found["SmolLM2"][0].shape == (30, 9) and found["Gemma 3"][0].shape == (18, 4)  # (L, H)
    for name, head in (("SmolLM2", "L23H4"), ("Gemma 3", "L12H2")):
        share, on_clean, on_corrupt = found[name]
        assert on_clean > 0 > on_corrupt, (name, on_clean, on_corrupt)
        best = recall["top"](share, k=2)
        assert list(best)[0] == head and best[head] > 0.9, (name, best)  # "one head alone restores 93 %"
        assert list(best.values())[1] < 0.5, (name, best)  # "the next ones restore under half each"


@pytest.mark.slow
def test_the_command_line_sweep_is_the_blocks_and_gemma_needs_its_bos(recall, tmp_path, capsys):
    for ckpt, bos, head, share in ((smollm2(), "", "23     4", "93%"), (gemma3(), "<bos>", "12     2", "93%"),
                                   (gemma3(), "", "11     2", "92%")):
        assert main(["patch", "--ckpt", str(ckpt), "--clean", bos + "The capital of France is", "--corrupt",
                     bos + "The capital of Italy is", "--answer", " Paris", "--wrong", " Rome", "--by", "head",
                     "--top", "3", "--out", str(tmp_path / "patch.png")]) == 0
        rows = capsys.readouterr().out.split("share\n")[1].splitlines()
        assert rows[0].split()[:2] == head.split() and rows[0].endswith(share), (ckpt.name, bos, rows)


@pytest.mark.slow
def test_the_indirect_object_is_spread_over_heads(recall):
    found = _run("# Worked examples, 2:", recall)["ioi"]
    for name, head in (("SmolLM2", "L23H3"), ("Gemma 3", "L11H3")):
        share, on_clean, on_swapped, on_corrupt = found[name]
        assert on_clean > 0 > on_corrupt, (name, on_clean, on_corrupt)  # right on the clean prompt, flipped
        assert on_swapped > 0, (name, on_swapped)  # the first clause's names swapped: still " Mary", no corruption
        best = recall["top"](share)
        assert list(best)[0] == head and 0.3 < best[head] < 0.7, (name, best)  # no head carries it alone
    assert found["Gemma 3"][2] > found["Gemma 3"][1]  # "Gemma 3 more than on the clean prompt"


@pytest.mark.slow
def test_ablating_the_induction_heads_raises_the_loss_on_the_repeat_far_more_than_other_heads(scope):
    found = _run("# Worked examples, 3:", scope)["induction"]
    expected = {"SmolLM2": [(18, 6), (17, 3), (17, 4)], "Gemma 3": [(5, 1), (11, 2), (5, 2)]}
    for name, (heads, unpredictable, before, after, controls) in found.items():
        assert heads == expected[name], (name, heads)
        assert before < unpredictable / 4, (name, before, unpredictable)  # the repeat is predicted
        assert len(controls) == 5 and after > 2 * before and after - before > 5 * (max(controls) - before), (
            name, before, after, controls)  # ablated: far above the control's highest
    _, unpredictable, _, after, _ = found["Gemma 3"]
    assert after > unpredictable  # Gemma 3's repeat as unpredictable as the first copy without its 3 heads


@pytest.mark.slow
def test_the_f32_copy_keeps_the_ranking_bit_for_bit_and_the_q8_0_copy_nearly(recall, capsys):
    found = _run("# Worked examples, 4:", recall)["stability"]
    printed = capsys.readouterr().out
    for name in ("SmolLM2", "Gemma 3"):
        assert found[name]["f32"] == 1.0 and f"{name} f32: weights equal True, sweep equal True" in printed
        assert 0.99 < found[name]["q8_0"] < 1.0, found
    for name, head in (("SmolLM2", "L23H4"), ("Gemma 3", "L12H2")):  # the top head stays
        assert f"{name} q8_0: weights equal False, sweep equal False, top heads {{'{head}'" in printed, printed
