"""What `selfattn export` makes of a LoRA run, and where it writes (#57): ``--adapter`` writes a peft folder that
``AutoPeftModelForCausalLM.from_pretrained(DIR)`` loads in one step, offline (the base a transformers folder it
points at, or a GGUF base written as one into ``DIR/base``), with the tokenizer, every file in the mode a plain
``open()`` gives; a run whose base moved is refused naming it as the run's base, and ``--base`` gives its new
place (the digest still checked); a run fine-tuned from a GGUF file keeps the file's pre-tokenizer name in its
own GGUF export; a GGUF ``--out`` in a folder that does not exist is created, and an obstacle is one line naming
the final path before the model is loaded, never a temporary file."""
import json
import os
import shutil

import gguf
import pytest
import torch
from tokenizers import pre_tokenizers

from selfattn._util import files
from selfattn.formats import checkpoint
from selfattn.io.loading import load
from selfattn.tokenizers import BPETokenizer

from helpers.families import build
from helpers.gguf_export import command

V = 300  # a BPE of the 256 bytes and 44 merges
TEXT = "the cat sat on the mat. the dog sat on the log. 12345 cats, 2024 dogs.\n" * 40
SMOLLM = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                  pre_tokenizers.ByteLevel(add_prefix_space=False)])  # llama.cpp's "smollm"
LLAMA, PLAIN = ("llama-llama3-rope",), dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4})  # plain RoPE:
# a GGUF file of the Llama 3 rule reads back as a rule no GGUF file says again
TRAIN = ["--seq-len", "32", "--lora-rank", "2", "--batch-size", "2", "--max-steps", "2", "--lr", "3e-2",
         "--warmup-steps", "1", "--eval-every", "2", "--set", "eval_batches=1"]


def tokenizer(pre=None) -> str:
    """A tokenizer.json: a byte-level BPE of V tokens trained on TEXT, with the pre-tokenizer ``pre`` when given."""
    tok = BPETokenizer.train(TEXT, V).tok
    if pre is not None:
        tok.pre_tokenizer = pre
    return tok.to_str()


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """(root, a Llama base as a transformers folder, the same as a GGUF file, a LoRA run on each, the text)."""
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    build(*LLAMA, noise=0.05, vocab_size=V, **PLAIN).save_pretrained(base)
    (base / "tokenizer.json").write_text(tokenizer(SMOLLM))
    data = root / "text.txt"
    data.write_text(TEXT)
    code, _, err = command("export", "--ckpt", str(base), "--out", str(root / "base.gguf"))
    assert code == 0, err
    runs = {}
    for name, source in (("folder", base), ("gguf", root / "base.gguf")):
        runs[name] = root / f"run-{name}"
        code, _, err = command("train", "--init-from", str(source), "--data", str(data), *TRAIN,
                               "--out", str(runs[name]))
        assert code == 0, err
    return root, base, root / "base.gguf", runs, data


def logits(model, idx):
    with torch.no_grad():
        out = model(idx)
        return out.logits if hasattr(out, "logits") else out[0]


IDX = torch.randint(0, V, (1, 24), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("base_kind", ["folder", "gguf"])
def test_an_adapter_folder_loads_in_one_step_offline_with_its_tokenizer(made, tmp_path, base_kind):
    os.environ["HF_HUB_OFFLINE"] = "1"
    import peft
    import transformers

    root, base, base_gguf, runs, _ = made
    out = tmp_path / "adapter"
    code, printed, err = command("export", "--ckpt", str(runs[base_kind]), "--out", str(out), "--adapter")
    assert code == 0, err
    config = json.loads((out / "adapter_config.json").read_text())
    if base_kind == "folder":  # the folder it was trained on, absolute
        assert config["base_model_name_or_path"] == str(base.absolute()) and not (out / "base").exists()
        assert "the transformers folder it was trained on" in printed
    else:  # a GGUF base: written as a transformers folder beside the adapters
        assert config["base_model_name_or_path"] == str((out / "base").absolute())
        assert f"{base_gguf}, written as a transformers folder into" in printed
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    assert "AutoPeftModelForCausalLM.from_pretrained" in printed

    theirs = peft.AutoPeftModelForCausalLM.from_pretrained(out).eval()  # one step, from the folder alone
    ours = load(runs[base_kind]).model.eval()
    torch.testing.assert_close(logits(theirs, IDX), logits(ours, IDX), rtol=0, atol=1e-4)
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.encode("the cat sat 2024", add_special_tokens=False) == load(runs[base_kind]).tokenizer.encode(
        "the cat sat 2024")

    (tmp_path / "plain").write_text("")
    mode = (tmp_path / "plain").stat().st_mode & 0o777  # what a plain open() gives
    modes = {str(p.relative_to(out)): p.stat().st_mode & 0o777 for p in out.rglob("*") if p.is_file()}
    assert set(modes.values()) == {mode}, modes  # the weights too (safetensors writes 0600)


def test_atomic_writes_end_in_the_mode_of_a_plain_open(tmp_path):
    old = os.umask(0o027)
    try:
        with files.atomic_path(tmp_path / "a.bin") as tmp:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600)  # as safetensors and mkstemp write theirs
            os.close(fd)
        (tmp_path / "plain.txt").write_text("x")
        assert (tmp_path / "a.bin").stat().st_mode & 0o777 == (tmp_path / "plain.txt").stat().st_mode & 0o777 == 0o640
        assert files.new_file_mode() == 0o640
    finally:
        os.umask(old)


def test_a_run_whose_base_moved_says_so_and_takes_its_new_place(made, tmp_path):
    root, base, _, runs, data = made
    run = tmp_path / "run"
    shutil.copytree(runs["folder"], run)
    expected = logits(load(run).model.eval(), IDX)
    moved = tmp_path / "moved"
    shutil.copytree(base, moved)
    hidden = root / "base-away"
    base.rename(hidden)
    try:
        code, _, err = command("eval", "--ckpt", str(run), "--data", str(data))
        assert code == 2 and err.count("\n") == 1, err
        assert "the base model of the LoRA run" in err and f"'{base}', does not exist (moved?)" in err, err
        assert "give its new place with --base PATH" in err, err
        code, _, err = command("train", "--resume", "--out", str(run), "--max-steps", "3")
        assert code == 2 and f"the base model of this LoRA run, '{base}', does not exist (moved?)" in err, err
        assert "give its new place with --base PATH" in err, err
        resumed = tmp_path / "resumed"
        shutil.copytree(run, resumed)
        code, _, err = command("train", "--resume", "--out", str(resumed), "--max-steps", "3", "--base", str(moved))
        assert code == 0, err  # the digest is the base's: it trains on, and names the new place from now on
        assert checkpoint.read_latest(resumed)[2]["meta"]["lora"]["base"]["path"] == str(moved.absolute())
        code, _, err = command("train", "--init-from", str(moved), "--data", str(data), "--out", str(tmp_path / "new"),
                               "--base", str(moved))
        assert code == 2 and "pass it with --resume" in err and err.count("\n") == 1, err

        code, printed, err = command("eval", "--ckpt", str(run), "--data", str(data), "--base", str(moved))
        assert code == 0, err
        torch.testing.assert_close(logits(load(run, base=moved).model.eval(), IDX), expected, rtol=0, atol=0)
        out = tmp_path / "adapter"
        code, printed, err = command("export", "--ckpt", str(run), "--out", str(out), "--adapter", "--base",
                                     str(moved))
        assert code == 0, err
        assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(moved)

        other = tmp_path / "other"  # another model at --base: refused by its digest, naming both places
        build(*LLAMA, noise=0.07, vocab_size=V, **PLAIN).save_pretrained(other)
        shutil.copy(moved / "tokenizer.json", other)
        code, _, err = command("sample", "--ckpt", str(run), "--base", str(other), "--prompt", "the")
        assert code == 2 and err.count("\n") == 1, err
        assert f"trained on the base model {base} of SHA-256" in err and f"but {other} holds a model" in err, err
        code, _, err = command("sample", "--ckpt", str(moved), "--base", str(moved), "--prompt", "the")
        assert code == 2 and "is not one" in err, err  # --base of a model that is no LoRA run
    finally:
        hidden.rename(base)


def test_a_run_from_a_gguf_file_keeps_its_pre_tokenizer_in_its_gguf(made, tmp_path):
    root, _, base_gguf, runs, _ = made
    source = gguf.GGUFReader(base_gguf).fields["tokenizer.ggml.pre"].contents()
    assert source == "smollm"  # the folder's Digits + ByteLevel, as llama.cpp names it
    out = tmp_path / "run.gguf"
    code, printed, err = command("export", "--ckpt", str(runs["gguf"]), "--out", str(out))
    assert code == 0, err
    assert gguf.GGUFReader(out).fields["tokenizer.ggml.pre"].contents() == "smollm"
    assert "tokenizer gpt2 (pre smollm)" in printed


def test_a_gguf_out_in_a_missing_folder_is_created_and_an_obstacle_is_named_first(made, tmp_path, monkeypatch):
    _, _, _, runs, _ = made
    out = tmp_path / "a" / "b" / "run.gguf"
    code, _, err = command("export", "--ckpt", str(runs["folder"]), "--out", str(out))
    assert code == 0 and out.is_file(), err

    (tmp_path / "file").write_text("in the way")
    import selfattn.cli.export as export_cli

    monkeypatch.setattr(export_cli, "load", lambda *a, **k: pytest.fail("the model was loaded before --out's check"))
    blocked = tmp_path / "file" / "sub" / "run.gguf"
    code, _, err = command("export", "--ckpt", str(runs["folder"]), "--out", str(blocked))
    assert code == 2 and err.count("\n") == 1 and str(tmp_path / "file") in err and ".tmp-" not in err, err


def test_an_atomic_write_into_a_missing_folder_names_the_file_not_a_temporary(tmp_path):
    target = tmp_path / "missing" / "m.gguf"
    with pytest.raises(FileNotFoundError) as e:
        with files.atomic_path(target) as tmp:
            tmp.write_bytes(b"x")
    assert str(target) in str(e.value) and ".tmp-" not in str(e.value)
