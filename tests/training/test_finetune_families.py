"""Fine-tuning models of four families from their ``transformers`` folders: chat data, packed, LoRA and
full; the LoRA run's adapters as a ``peft`` folder and its merged model as a folder, each computing in
``transformers`` (and ``peft``) what the run computes here."""
import json

import pytest
import torch

from selfattn.cli import main
from selfattn.io import loading
from selfattn.tokenizers import BPETokenizer
from selfattn.training import checkpoint

from helpers.families import build

FAMILIES = ["llama-llama3-rope", "qwen2-some-layers-slide", "gemma3", "olmo2"]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
V = 300  # the vocabulary: a local BPE's 256 bytes and 44 merges
QUESTIONS = ["what is red", "name a bird", "count to three", "say hi", "what is two plus two", "name a fish",
             "pick a colour", "what is blue", "name a tree", "say bye", "spell cat", "what is up"]


def folder(case: str, path):
    """A transformers folder of ``case``'s random model with a tiny BPE tokenizer and a chat template."""
    hf = build(case, noise=0.05, vocab_size=V)
    hf.save_pretrained(path)
    text = " ".join(QUESTIONS) * 20
    (path / "tokenizer.json").write_text(BPETokenizer.train(text, V).spec()["json"])
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def chat_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                    {"role": "assistant", "content": q[::-1]}]}) + "\n"
                            for q in QUESTIONS))
    return path


def _logits(model, idx):
    with torch.no_grad():
        return model(idx)[0] if not hasattr(model, "generation_config") else model(idx).logits


@pytest.mark.parametrize("case", FAMILIES)
def test_lora_on_packed_chat_data_exports_as_peft_and_transformers_folders(case, tmp_path, chat_file):
    import peft
    import transformers

    base = folder(case, tmp_path / "base")
    run = tmp_path / "run"
    assert main(["train", "--init-from", str(base), "--data", str(chat_file), "--pack", "--seq-len", "64",
                 "--lora-rank", "4", "--lora-mlp", "--batch-size", "2", "--max-steps", "3", "--lr", "3e-2",
                 "--warmup-steps", "1", "--eval-every", "3", "--set", "eval_batches=1", "--out", str(run)]) == 0
    saved = checkpoint.read_weights(checkpoint.latest(run))[0]
    assert saved and all(k.endswith((".lora_A", ".lora_B")) for k in saved)  # the adapters alone are saved
    tuned, source = loading.load(run), loading.load(base)
    assert tuned.family == source.family and tuned.chat.source == TEMPLATE
    idx = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(1))
    ours = _logits(tuned.model.eval(), idx)
    assert (ours - _logits(source.model.eval(), idx)).abs().amax() > 1e-3  # the adapters moved the model

    adapter = tmp_path / "adapter"
    assert main(["export", "--ckpt", str(run), "--out", str(adapter), "--adapter"]) == 0
    theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    torch.testing.assert_close(_logits(theirs, idx), ours, rtol=0, atol=1e-4)

    merged = tmp_path / "merged"
    assert main(["export", "--ckpt", str(run), "--out", str(merged)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(merged).eval()
    torch.testing.assert_close(_logits(hf, idx), ours, rtol=0, atol=1e-4)


def test_a_lora_run_resumes_exactly_and_refuses_another_base(tmp_path, chat_file, capsys):
    base = folder("llama-llama3-rope", tmp_path / "base")
    flags = ["--init-from", str(base), "--data", str(chat_file), "--seq-len", "64", "--lora-rank", "2",
             "--batch-size", "2", "--lr", "1e-2", "--eval-every", "2", "--set", "eval_batches=1", "--save-every", "2"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    assert main(["train", *flags, "--max-steps", "4", "--out", str(whole)]) == 0
    assert main(["train", *flags, "--max-steps", "2", "--out", str(split)]) == 0
    assert main(["train", *flags, "--max-steps", "4", "--out", str(split), "--resume"]) == 0
    a, b = (checkpoint.read_weights(checkpoint.latest(run))[0] for run in (whole, split))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # the same path, other weights:
    build_other = build("llama-llama3-rope", noise=0.07, vocab_size=V)
    build_other.save_pretrained(base)
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(whole), "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds LoRA adapters trained on the base model" in err, err


def test_full_fine_tuning_on_chat_data_trains_every_weight(tmp_path, chat_file):
    base = folder("gemma3", tmp_path / "base")
    run = tmp_path / "run"
    assert main(["train", "--init-from", str(base), "--data", str(chat_file), "--seq-len", "64", "--batch-size", "2",
                 "--max-steps", "2", "--lr", "1e-2", "--eval-every", "2", "--set", "eval_batches=1",
                 "--out", str(run)]) == 0
    tuned, source = loading.load(run).model.state_dict(), loading.load(base).model.state_dict()
    assert tuned.keys() == source.keys()
    assert all(not torch.equal(tuned[k], source[k]) for k in tuned if k.endswith("qkv.weight"))


@pytest.mark.parametrize("flags, words", [
    (["--lora-rank", "0"], "lora_rank must be a positive int, got 0"),
    (["--lora-rank", "999"], "rank=999 is larger than"),
    (["--lora-alpha", "4"], "give --lora-rank too"),
    (["--pack"], "--pack packs the conversations of chat data"),
])
def test_bad_lora_and_pack_flags_are_one_line(tmp_path, capsys, flags, words):
    base = folder("llama-llama3-rope", tmp_path / "base")
    capsys.readouterr()
    assert main(["train", "--init-from", str(base), "--max-steps", "1", *flags, "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_chat_data_needs_a_model_with_a_chat_template(tmp_path, capsys, chat_file):
    assert main(["train", "--data", str(chat_file), "--max-steps", "1", "--out", str(tmp_path / "r")]) == 2
    assert "give --init-from a chat model" in capsys.readouterr().err


def test_the_commands_take_a_lora_run_as_any_run(tmp_path, chat_file, capsys):
    base = folder("qwen2-some-layers-slide", tmp_path / "base")
    run = tmp_path / "run"
    assert main(["train", "--init-from", str(base), "--data", str(chat_file), "--seq-len", "64", "--lora-rank", "2",
                 "--batch-size", "2", "--max-steps", "1", "--eval-every", "1", "--set", "eval_batches=1",
                 "--out", str(run)]) == 0
    for argv in (["check", "--ckpt", str(run)], ["eval", "--ckpt", str(run), "--data", str(chat_file)],
                 ["sample", "--ckpt", str(run), "--chat", "say hi", "--max-new-tokens", "3", "--temperature", "0"],
                 ["heads", "--ckpt", str(run), "--text", "what is red"],
                 ["explore", "--ckpt", str(run), "--text", "what is red", "--out", str(tmp_path / "page.html")]):
        capsys.readouterr()
        assert main(argv) == 0, (argv, capsys.readouterr().err)
