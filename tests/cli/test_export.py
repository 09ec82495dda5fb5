"""`selfattn export`: a folder that transformers loads offline, with our logits, our greedy
text token for token, our tokenizer's ids; and back into `selfattn sample`.

Every model here is small and random (scrambled, so logits are O(1) and a wrong tensor shows);
nothing is ever downloaded.
"""
import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import time

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402  (the [hf] extra, part of [dev])
from safetensors.torch import load_file, save_file  # noqa: E402

from selfattn.cli import main as cli  # noqa: E402
from selfattn.config import GPTConfig  # noqa: E402
from selfattn.generation.text import new_tokens  # noqa: E402
from selfattn.io.export import EOT, export, unsupported  # noqa: E402
from selfattn.io.loading import load  # noqa: E402
from selfattn.tokenizers import BPETokenizer, ByteTokenizer  # noqa: E402
from selfattn.training import checkpoint  # noqa: E402

from helpers.gemma3 import gemma3  # noqa: E402
from helpers.gpt2 import gpt2_folder  # noqa: E402
from helpers.models import assert_same_logits, scrambled  # noqa: E402

transformers.logging.set_verbosity_error()
FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
PROMPT = "the cat"
UTF8 = "".join(chr(c) for c in range(1, 0x900, 7)) + " caf\u00e9 \u65e5\u672c\u8a9e \U0001f642\n\t\r"


def save_run(folder, cfg: GPTConfig, tokenizer) -> None:
    """A run folder holding one checkpoint of a scrambled model."""
    model = scrambled(cfg)
    folder.mkdir()
    checkpoint.save(folder, 1, model, torch.optim.AdamW(model.parameters()), keep=1,
                    meta={"model": dataclasses.asdict(cfg), "tokenizer": tokenizer.spec(), "step": 1})


def small(**kw) -> GPTConfig:
    return GPTConfig(**{**dict(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=16), **kw})


def exported(root, cfg: GPTConfig, tokenizer) -> tuple:
    """(run folder, exported folder, what `selfattn export` printed)."""
    save_run(root / "run", cfg, tokenizer)
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert cli(["export", "--ckpt", str(root / "run"), "--out", str(root / "hf")]) == 0
    return root / "run", root / "hf", printed.getvalue()


@pytest.fixture(scope="module")
def byte_export(tmp_path_factory):
    """A byte-tokenizer run without biases, exported."""
    return exported(tmp_path_factory.mktemp("byte"), small(), ByteTokenizer())


@pytest.fixture(scope="module")
def bpe_export(tmp_path_factory):
    """A BPE run with biases and exact GELU, exported."""
    bpe = BPETokenizer.train("the cat sat on the mat. the dog sat on the log. " * 30, vocab_size=300)
    return exported(tmp_path_factory.mktemp("bpe"), small(vocab_size=bpe.vocab_size, bias=True,
                                                         gelu_approximate="none"), bpe)


def greedy_pipeline(folder, prompt: str, n: int) -> tuple[str, list[int]]:
    generate = transformers.pipeline("text-generation", model=str(folder), device="cpu")
    out = generate(prompt, max_new_tokens=n, do_sample=False, return_full_text=True)[0]["generated_text"]
    ids = generate(prompt, max_new_tokens=n, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
    return out, list(ids)


def sample_text(capsys, ckpt, prompt: str, n: int) -> str:
    assert cli(["sample", "--ckpt", str(ckpt), "--prompt", prompt, "--max-new-tokens", str(n),
                "--temperature", "0"]) == 0
    return capsys.readouterr().out.removesuffix("\n")


def test_the_command_writes_the_folder_and_says_what_it_wrote(byte_export):
    run, folder, text = byte_export
    assert sorted(p.name for p in folder.iterdir()) == FILES
    assert "GPT2LMHeadModel: 2 layers x 2 heads, C=16, vocab 256, context 64" in text
    assert "no biases" not in text and "logits of the export vs ours" in text  # a model without biases: nothing to say
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["n_positions"] == 64 and config["vocab_size"] == 256


def test_transformers_logits_equal_ours(byte_export, bpe_export):
    for run, folder, _ in (byte_export, bpe_export):
        ours = load(run).model.eval()
        theirs = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
        assert type(theirs).__name__ == "GPT2LMHeadModel" and theirs.dtype == torch.float32
        idx = torch.randint(0, ours.config.vocab_size, (2, 40))
        with torch.no_grad():
            expected, got = ours(idx)[0], theirs(idx).logits
        assert_same_logits(got, expected)
        assert expected.abs().amax() > 1  # large enough for 1e-5 to mean something


def test_a_wrong_export_is_caught(byte_export, tmp_path):  # negative control of the logits check
    run, folder, _ = byte_export
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in FILES:
        (broken / name).write_bytes((folder / name).read_bytes())
    tensors = load_file(folder / "model.safetensors")
    tensors["transformer.h.1.attn.c_proj.weight"] = tensors["transformer.h.1.attn.c_proj.weight"].t().contiguous()
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(broken, local_files_only=True).eval()
    idx = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        assert (theirs(idx).logits - load(run).model.eval()(idx)[0]).abs().amax() > 1e-2


def test_the_byte_tokenizer_exports_with_ids_equal_to_bytes(byte_export):
    tok = transformers.AutoTokenizer.from_pretrained(byte_export[1], local_files_only=True)
    ours = ByteTokenizer()
    assert len(tok) == 256
    assert tok(UTF8)["input_ids"] == ours.encode(UTF8) == list(UTF8.encode())
    assert tok.decode(ours.encode(UTF8)) == UTF8
    for byte in range(256):  # every id, lone continuation and invalid bytes included, decodes as ours does
        assert tok.decode([byte]) == ours.decode([byte]), byte
    ascii_text = "".join(map(chr, range(128)))
    assert tok(ascii_text)["input_ids"] == list(range(128))
    assert tok.convert_ids_to_tokens([32, 10, 200]) == ["\u0120", "\u010a", "\u00c8"]  # GPT-2's byte alphabet


def test_a_bpe_run_exports_its_own_tokenizer(bpe_export):
    run, folder, _ = bpe_export
    ours = load(run).tokenizer
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    text = "the dog sat on the cat, caf\u00e9 \U0001f642"
    assert tok(text)["input_ids"] == ours.encode(text) and tok.decode(ours.encode(text)) == text
    assert json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"] == \
        json.loads(ours.tok.to_str())["model"]["vocab"]


def test_greedy_pipeline_text_equals_selfattn_sample_token_for_token(byte_export, bpe_export, capsys):
    for run, folder, _ in (byte_export, bpe_export):
        loaded = load(run)
        model = loaded.model.eval()
        ids = loaded.tokenizer.encode(PROMPT)
        ours = list(new_tokens(model, ids, 24, temperature=0))
        text, theirs = greedy_pipeline(folder, PROMPT, 24)
        assert theirs == ids + ours
        assert text == sample_text(capsys, run, PROMPT, 24)


def test_the_exported_folder_loads_back_into_selfattn(byte_export, capsys):
    run, folder, _ = byte_export
    back, ours = load(folder).model.eval(), load(run).model.eval()
    idx = torch.randint(0, 256, (2, 30))
    with torch.no_grad():
        assert_same_logits(back(idx)[0], ours(idx)[0])
    assert sample_text(capsys, folder, PROMPT, 16) == sample_text(capsys, run, PROMPT, 16)


def test_a_gpt2_folder_reexports_with_its_end_of_text_token(tmp_path):
    folder = gpt2_folder(tmp_path / "gpt2")
    loaded = load(folder)
    done = export(loaded.model, loaded.tokenizer, tmp_path / "again")
    assert done.logits_error < 1e-5
    eot = loaded.tokenizer.token_id(EOT)
    assert json.loads((tmp_path / "again" / "generation_config.json").read_text())["eos_token_id"] == eot
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "again", local_files_only=True)
    assert tok.eos_token == EOT and tok.eos_token_id == eot


def test_configs_gpt2_cannot_express_are_refused_naming_each_field(tmp_path, capsys):
    config = small(pos="rope", n_kv_head=1, window=8, mlp=False)
    reasons = unsupported(config)
    assert [r.split("=")[0] for r in reasons] == ["pos", "n_kv_head", "window", "mlp"]
    assert "no rotary" in reasons[0] and "no GQA or MQA" in reasons[1]
    assert [r.split("=")[0] for r in unsupported(small(pos="none", alibi=True, softcap=30.0, sinks=True))] == \
        ["pos", "alibi", "softcap", "sinks"]
    assert unsupported(small()) == [] and unsupported(small(n_kv_head=2)) == []  # n_kv_head == n_head is MHA
    save_run(tmp_path / "rope", small(pos="rope"), ByteTokenizer())
    assert cli(["export", "--ckpt", str(tmp_path / "rope"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pos='rope': GPT-2 has learned absolute positions only" in err
    assert not (tmp_path / "hf").exists()


def test_gemma3s_gguf_file_exports_to_a_folder_that_tokenizes_and_computes_as_it(tmp_path, capsys):
    out = tmp_path / "gemma"
    assert cli(["export", "--ckpt", str(gemma3()), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Gemma3ForCausalLM" in printed and "tokenizer.json" in printed
    source, back = load(gemma3()), load(out)
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    texts = ["The capital of France is", "<start_of_turn>user\nHi  there\n\n<end_of_turn>\n", "ünï 日本 🎉 𓀀"]
    for text in texts:  # SentencePiece's ids through tokenizer.json: transformers', and ours reading the folder
        ids = source.tokenizer.encode(text, special=True)
        assert theirs(text)["input_ids"] == back.tokenizer.encode(text, special=True) == ids, text
        assert theirs.decode(ids) == source.tokenizer.decode(ids), text
    assert (back.bos, back.eos) == (source.bos, source.eos)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.tensor([source.tokenizer.encode(texts[0], special=True)])
    with torch.no_grad():
        assert_same_logits(model(ids).logits, source.model.float().eval()(ids)[0])


def test_an_existing_folder_is_replaced_only_with_force(byte_export, tmp_path, capsys):
    run, *_ = byte_export
    out = tmp_path / "out"
    out.mkdir()
    assert cli(["export", "--ckpt", str(run), "--out", str(out)]) == 0  # empty: fine
    (out / "stale.bin").write_bytes(b"old")
    assert cli(["export", "--ckpt", str(run), "--out", str(out)]) == 2
    assert "exists and is not empty; pass --force" in capsys.readouterr().err
    assert (out / "stale.bin").exists()
    assert cli(["export", "--ckpt", str(run), "--out", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == FILES  # replaced whole: the stale file is gone
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left
    assert cli(["export", "--ckpt", str(out), "--out", str(out), "--force"]) == 2  # an exported folder, re-exported
    assert "holds the model being exported" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert cli(["export", "--ckpt", str(run), "--out", str(tmp_path / "file")]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def run_files(folder) -> dict:
    """Every file under ``folder`` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_run_folder_is_never_replaced_force_or_not(byte_export, tmp_path, capsys):
    run, *_ = byte_export
    other = tmp_path / "runs" / "other"
    other.parent.mkdir()
    save_run(other, small(), ByteTokenizer())
    (other / "log.jsonl").write_text('{"step": 1}\n')
    locked = tmp_path / "locked"  # a run that has started and written nothing but its lock yet
    locked.mkdir()
    (locked / ".lock").write_text("4242 host\n")
    for target, shown in ((other, "ckpt-0000001.safetensors, log.jsonl"), (locked, ".lock"),
                          (tmp_path / "runs", "other/ckpt-0000001.safetensors, other/log.jsonl")):
        before = run_files(target)
        for force in ([], ["--force"]):
            assert cli(["export", "--ckpt", str(run), "--out", str(target), *force]) == 2
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and f"will not replace {str(target)!r}, force or not: it holds a " \
                f"selfattn run ({shown}); choose another --out" in err, err
            assert run_files(target) == before  # nothing deleted, nothing changed
    (locked / ".lock").unlink()
    (locked / "notes.txt").write_text("mine")  # control: the same folder without the run's files is replaced
    assert cli(["export", "--ckpt", str(run), "--out", str(locked), "--force"]) == 0
    assert sorted(p.name for p in locked.iterdir()) == FILES


def test_a_run_that_starts_in_the_folder_during_the_export_is_kept(byte_export, tmp_path, monkeypatch):
    from selfattn.io import export as export_module

    run, *_ = byte_export
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    save = export_module._save_quietly

    def save_while_a_run_starts(hf_model, hf_tokenizer, folder):
        save(hf_model, hf_tokenizer, folder)
        (out / ".lock").write_text("4242 host\n")  # `selfattn train --out out` began meanwhile
    monkeypatch.setattr(export_module, "_save_quietly", save_while_a_run_starts)
    loaded = load(run)
    with pytest.raises(ValueError, match="force or not: it holds a selfattn run"):
        export(loaded.model, loaded.tokenizer, out, force=True)
    assert sorted(p.name for p in out.iterdir()) == [".lock", "old.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # the temporary folder is gone
    (out / ".lock").unlink()  # control: without the run, the same export replaces the folder
    monkeypatch.setattr(export_module, "_save_quietly", save)
    assert export(loaded.model, loaded.tokenizer, out, force=True).files == FILES


@pytest.mark.slow  # make check leaves it out: a live training process
def test_exporting_onto_a_live_run_kills_nothing_and_loses_nothing(byte_export, tmp_path, capsys):
    run, *_ = byte_export
    live = tmp_path / "live"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = subprocess.Popen([sys.executable, "-m", "selfattn", "train", "--n-layer", "1", "--n-embd", "16",
                              "--n-head", "2", "--block-size", "16", "--batch-size", "4", "--max-steps", "300",
                              "--eval-every", "300", "--set", "eval_batches=1", "--save-every", "1", "--set", "keep=2",
                              "--out", str(live)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not list(live.glob("ckpt-*.safetensors")) and train.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert list(live.glob("ckpt-*.safetensors")) and train.poll() is None, "the run did not get going"
        code = cli(["export", "--ckpt", str(run), "--out", str(live), "--force"])
        still_training = train.poll() is None
        out, err = train.communicate(timeout=600)
    finally:
        if train.poll() is None:
            train.kill()
    assert still_training, "the run ended before the export tried: nothing was tested"
    printed = capsys.readouterr()
    assert code == 2 and "force or not: it holds a selfattn run" in printed.err and printed.err.count("\n") == 1
    assert train.returncode == 0, err[-2000:]  # the run went on to its end, undisturbed
    assert [p.name for p in sorted(live.glob("ckpt-*.safetensors"))] == ["ckpt-0000299.safetensors",
                                                                        "ckpt-0000300.safetensors"]
    steps = [json.loads(line)["step"] for line in (live / "log.jsonl").read_text().splitlines()]
    assert steps == [0, *range(1, 301), 300]  # every step and both evaluations logged, none lost
    assert (live / "tokens" / "meta.json").is_file() and load(live).source.name == "best.safetensors"  # step 300's
    assert checkpoint.read(live / "best.safetensors")[1]["meta"]["step"] == 300


def test_a_run_without_a_checkpoint_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli(["export", "--ckpt", str(tmp_path / "empty"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no checkpoint" in err


def test_a_gemma2_block_without_a_window_exports_a_folder_transformers_loads(tmp_path, capsys):
    run = tmp_path / "gemma2"
    assert cli(["train", "--arch", "gemma2", "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
                "--batch-size", "4", "--max-steps", "2", "--eval-every", "2", "--set", "eval_batches=1",
                "--out", str(run)]) == 0  # no --set window: no layer slides
    capsys.readouterr()
    assert cli(["export", "--ckpt", str(run), "--out", str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    assert "logits of the export vs ours" in capsys.readouterr().out  # transformers loaded it and agreed
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["layer_types"] == ["full_attention"] * 2 and config["sliding_window"] == 32
