"""What a fine-tune costs the model: the general loss beside the task's, the warnings of
:mod:`selfattn.training.forgetting`, and the best checkpoint a run folder means to the commands."""
import json
import math

import pytest
import torch

from selfattn.cli import main
from selfattn.io import loading
from selfattn.tokenizers import ByteTokenizer
from selfattn.training import checkpoint
from selfattn.training.forgetting import GENERAL_RISE, RISING, Watch, general_rows

MICRO = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "4",
         "--set", "eval_batches=2"]


def _log(run) -> list[dict]:
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def test_the_watch_warns_past_each_threshold_and_not_before():
    watch = Watch()
    assert watch.add(0, 3.0, 2.0) == [] and watch.best_step is None  # step 0 is the start, not a candidate
    assert watch.add(10, 2.0, 2.0 + GENERAL_RISE * 0.9) == [] and watch.best_step == 10  # control: below both
    assert watch.add(20, 2.1, 2.0) == []  # above the best once: RISING is 2
    warnings = watch.add(30, 2.2, 2.0 + GENERAL_RISE * 1.1)
    assert RISING == 2 and len(warnings) == 2 and watch.best_step == 10, warnings
    assert warnings[0].startswith("the val loss has been above its best (2.0000 at step 10) for 2 evaluations")
    assert warnings[1].startswith(f"the general loss is {2.0 + GENERAL_RISE * 1.1:.4f}, +0.1100 nats")
    assert watch.add(50, 2.3, 2.5) == [] and watch.above_best == 3  # each warning once
    assert watch.add(40, 1.5, None) == [] and watch.best_step == 40  # a new best resets the count
    replayed = Watch.of([{"step": 0, "val_loss": 3.0}, {"step": 1, "loss": 9.0}, {"step": 10, "val_loss": 2.0},
                         {"step": 20, "val_loss": 2.5}])
    assert (replayed.best_step, replayed.best_val, replayed.above_best, replayed.start_val) == (10, 2.0, 1, 3.0)


def test_general_rows_are_the_first_tokens_of_the_text(tmp_path):
    text = tmp_path / "general.txt"
    text.write_text("".join(chr(97 + i % 26) for i in range(100)))
    rows = general_rows(ByteTokenizer(), str(text), 40, 8)  # 5 rows of 9 tokens
    assert rows.shape == (5, 9) and rows.flatten().tolist() == list(text.read_bytes()[:45])
    with pytest.raises(ValueError, match=r"holds 100 tokens, fewer than the 201 of one row of seq_len 200 \+ 1"):
        general_rows(ByteTokenizer(), str(text), 400, 200)
    assert general_rows(ByteTokenizer(), None, 64, 16).shape == (4, 17)  # the built-in corpus


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("forgetting") / "base"
    assert main(["train", *MICRO, "--max-steps", "20", "--lr", "1e-2", "--eval-every", "10", "--out", str(out)]) == 0
    return out


def test_a_fine_tune_measures_the_general_loss_from_the_models_own(base, tmp_path, capsys):
    general = tmp_path / "general.txt"
    general.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    out = tmp_path / "frozen"
    assert main(["train", "--init-from", str(base), "--batch-size", "4", "--max-steps", "2", "--eval-every", "1",
                 "--set", "eval_batches=1", "--lr", "0", "--min-lr", "0", "--weight-decay", "0",
                 "--set", f"general_data={general}", "--set", "general_tokens=64", "--out", str(out)]) == 0
    model = loading.load(base).model.eval()
    rows = general_rows(ByteTokenizer(), str(general), 64, 16)  # what the run measures, measured here
    with torch.no_grad():
        own = float(model(rows[:, :-1], rows[:, 1:])[1])
    losses = [r["general_loss"] for r in _log(out) if "general_loss" in r]
    assert len(losses) == 3 and losses == pytest.approx([own] * 3, rel=1e-6)  # lr 0: the model's own, unmoved
    printed = capsys.readouterr().out
    assert "step 0: val loss" in printed and f"general loss {own:.4f}" in printed and "warning" not in printed


def test_a_fine_tune_that_forgets_is_warned_of_and_its_best_checkpoint_is_what_the_run_folder_means(base, tmp_path,
                                                                                                      capsys):
    data = tmp_path / "narrow.txt"  # train on one letter; the held-out end is another, general text a third
    data.write_text("a" * 2000 + "b" * 240)
    general = tmp_path / "general.txt"
    general.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    out = tmp_path / "narrow"
    assert main(["train", "--init-from", str(base), "--data", str(data), "--batch-size", "4", "--max-steps", "12",
                 "--eval-every", "3", "--save-every", "12", "--set", "eval_batches=1", "--lr", "3e-2",
                 "--warmup-steps", "1", "--set", f"general_data={general}", "--set", "general_tokens=64",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    log = [r for r in _log(out) if "val_loss" in r]
    best = min(log[1:], key=lambda r: r["val_loss"])
    assert "warning: the general loss is" in printed and "the fine-tune is making the model forget" in printed
    assert max(r["general_loss"] for r in log) > log[0]["general_loss"] + GENERAL_RISE  # what the warning says
    assert best["step"] < 12 and "warning: the val loss has been above its best" in printed, log
    assert f"the best val loss, {best['val_loss']:.4f} at step {best['step']}, is {out / 'best.safetensors'}" in printed
    saved = checkpoint.read(out / "best.safetensors")[1]["meta"]
    assert saved["step"] == best["step"]
    last = checkpoint.latest(out)
    means = loading.load(out)
    assert means.source == out / "best.safetensors"
    ours, theirs = means.model.state_dict(), loading.load(last).model.state_dict()
    assert any(not torch.equal(ours[k], theirs[k]) for k in ours)  # control: the last is another model
    assert math.isfinite(log[-1]["val_loss"])
