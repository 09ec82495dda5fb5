"""``selfattn train --init-from PATH``: fine-tuning starts from any model ``load`` reads, with its
weights, its config (flags change single fields) and its own tokenizer; everything else of ``train``
as it is (resume, digests, the lock)."""
import pytest
import torch

from selfattn.cli import main
from selfattn.io import loading
from selfattn.training import checkpoint, finetune

from helpers.smollm2 import smollm2

MICRO = ["--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16", "--batch-size", "4",
         "--eval-every", "2", "--set", "eval_batches=2", "--save-every", "2"]
FROZEN = ["--lr", "0", "--min-lr", "0", "--weight-decay", "0"]  # steps that leave the weights as they are


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    out = tmp_path_factory.mktemp("init") / "base"
    assert main(["train", *MICRO, "--max-steps", "4", "--lr", "1e-2", "--out", str(out)]) == 0
    return out


def _log(run) -> list[dict]:
    import json
    return [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]


def test_a_run_starts_from_the_models_weights_and_its_step_0_loss_is_the_models(base, tmp_path):
    out = tmp_path / "tuned"
    assert main(["train", "--init-from", str(base), "--batch-size", "4", "--max-steps", "2", "--eval-every", "2",
                 "--set", "eval_batches=2", "--out", str(out), *FROZEN]) == 0
    theirs, ours = loading.load(base).model.state_dict(), loading.load(out).model.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in theirs)  # lr 0: unmoved
    assert loading.load(out).model.config == loading.load(base).model.config
    assert _log(out)[0]["val_loss"] == pytest.approx(_log(base)[-1]["val_loss"], rel=1e-6)  # the same batches
    fresh = tmp_path / "fresh"  # control: the same run from random weights starts elsewhere
    assert main(["train", *MICRO, "--max-steps", "2", "--out", str(fresh), *FROZEN]) == 0
    assert _log(fresh)[0]["val_loss"] != pytest.approx(_log(out)[0]["val_loss"], rel=1e-3)


@pytest.mark.parametrize("lora", [[], ["--lora-rank", "2"]], ids=["full", "lora"])
def test_the_source_is_read_once(base, tmp_path, monkeypatch, lora):
    read = []

    def counted(path, **kwargs):
        read.append(str(path))
        return loading.load(path, **kwargs)

    monkeypatch.setattr(finetune, "load", counted)
    flags = ["--init-from", str(base), *lora, "--batch-size", "4", "--max-steps", "1", "--eval-every", "1",
             "--set", "eval_batches=1", "--save-every", "1"]
    assert main(["train", *flags, "--out", str(tmp_path / "run")]) == 0
    assert read == [str(base)]  # its config for the flags and its weights for the run: one read
    given = finetune.Source(str(base))
    given.take()
    with pytest.raises(ValueError, match="was taken already"):  # a source serves one run
        given.take()
    if lora:  # control: a LoRA run resumed reads its base again, the model its adapters need
        assert main(["train", *flags, "--max-steps", "2", "--resume", "--out", str(tmp_path / "run")]) == 0
        assert len(read) == 3 and read[-1].startswith(str(base.absolute()))


def test_flags_change_single_fields_and_a_shape_the_weights_cannot_fill_is_refused(base, tmp_path, capsys):
    out = tmp_path / "window"
    assert main(["train", "--init-from", str(base), "--set", "dropout=0.1", "--batch-size", "4", "--max-steps", "1",
                 "--eval-every", "1", "--set", "eval_batches=1", "--out", str(out)]) == 0
    assert loading.load(out).model.config.dropout == 0.1  # surgery: one field, the weights kept
    capsys.readouterr()
    assert main(["train", "--init-from", str(base), "--n-embd", "32", "--out", str(tmp_path / "wide")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the flags change the model's shape, which its weights cannot fill" in err, err
    assert not (tmp_path / "wide").exists()  # nothing left behind


@pytest.mark.parametrize("flags, words", [
    (["--init-from", "nowhere"], "--init-from: 'nowhere' does not exist"),
    (["--preset", "tiny"], "--init-from starts from the model's own config: drop --preset"),
    (["--tokenizer", "bpe"], "--init-from trains with the model's own tokenizer"),
])
def test_bad_input_is_one_line(base, tmp_path, capsys, flags, words):
    argv = flags if flags[0] == "--init-from" else ["--init-from", str(base), *flags]
    assert main(["train", *argv, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_a_fine_tuned_run_resumes_exactly(base, tmp_path):
    flags = ["--init-from", str(base), "--batch-size", "4", "--eval-every", "2", "--set", "eval_batches=1",
             "--save-every", "2", "--lr", "1e-2"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(["train", *flags, "--max-steps", "4", "--out", str(whole)]) == 0
    assert main(["train", *flags, "--max-steps", "2", "--out", str(split)]) == 0
    assert main(["train", *flags, "--max-steps", "4", "--out", str(split), "--resume"]) == 0
    a, b = (checkpoint.read_weights(checkpoint.latest(run))[0] for run in (whole, split))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_smollm2_fine_tunes_with_its_own_tokenizer(tmp_path):
    data = tmp_path / "notes.txt"
    data.write_text("The Zorblax project keeps its notes in plain text. " * 40)
    out = tmp_path / "smol"
    assert main(["train", "--init-from", str(smollm2()), "--data", str(data), "--seq-len", "32",
                 "--batch-size", "2", "--max-steps", "1", "--eval-every", "1", "--set", "eval_batches=1",
                 "--out", str(out), *FROZEN]) == 0
    tuned, source = loading.load(out), loading.load(smollm2())
    assert tuned.tokenizer.vocab_size == source.tokenizer.vocab_size == 49152  # its own, not a byte tokenizer
    assert tuned.tokenizer.encode("The Zorblax") == source.tokenizer.encode("The Zorblax")
    w = "blocks.0.attn.qkv.weight"
    assert torch.equal(tuned.model.state_dict()[w], source.model.state_dict()[w])  # lr 0: the file's weights
    assert tuned.model.config.block_size == source.model.config.block_size  # rows of 32 tokens; its context kept
    assert (tuned.bos, tuned.eos, tuned.start_token) == (source.bos, source.eos, source.start_token) == (1, (2,), 1)
    conversation = [{"role": "user", "content": "Hi"}]
    assert tuned.require_chat().render(conversation) == source.require_chat().render(conversation)
    plain = loading.load(checkpoint.latest(out))  # the checkpoint file alone carries them too
    assert plain.eos == (2,) and plain.chat is not None
