"""One loader for every model path: run folder, checkpoint file, state dict, GPT-2 folder."""
import json
import os

import pytest
import torch

from selfattn.cli import main
from selfattn.io import loading
from selfattn.training import checkpoint

from helpers.gpt2 import gpt2_folder

os.environ["HF_HUB_OFFLINE"] = "1"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A micro run of `selfattn train` with two checkpoints (steps 2 and 4)."""
    out = tmp_path_factory.mktemp("loading") / "run"
    assert main(["train", "--n-layer", "1", "--n-embd", "16", "--n-head", "2", "--block-size", "16",
                 "--batch-size", "4", "--max-steps", "4", "--eval-every", "4", "--set", "eval_batches=1",
                 "--save-every", "2", "--out", str(out)]) == 0
    return out


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_run_folder_loads_its_best_checkpoint_else_its_newest(run, tmp_path):
    loaded = loading.load(run)  # one evaluation after step 0, at step 4: the best
    assert loaded.source == run / "best.safetensors" and checkpoint.load(loaded.source)["step"] == 4
    assert _same_weights(loaded.model, loading.load(run / "ckpt-0000004.safetensors").model)
    assert loaded.start_token == loaded.tokenizer.encode("\n")[0] and loaded.model.training
    older = loading.load(run / "ckpt-0000002.safetensors")
    assert older.source.name == "ckpt-0000002.safetensors"
    assert not _same_weights(older.model, loaded.model)  # control: two steps of training changed the weights
    without = tmp_path / "without-best"  # a run without a best (written before there was one): its newest
    without.mkdir()
    for step in (2, 4):
        (without / f"ckpt-000000{step}.safetensors").write_bytes((run / f"ckpt-000000{step}.safetensors").read_bytes())
    assert loading.load(without).source == without / "ckpt-0000004.safetensors"


def test_a_checkpoint_file_and_a_torch_save_state_dict_load_the_same_model(run):
    loaded = loading.load(run / "ckpt-0000004.safetensors")
    assert _same_weights(loaded.model, loading.load(run).model)
    weights, _ = checkpoint.read_weights(run / "ckpt-0000004.safetensors")
    torch.save(weights, run / "exported.pt")
    assert _same_weights(loading.load(run / "exported.pt").model, loaded.model)


def test_a_gpt2_folder_loads_with_its_tokenizer(tmp_path):
    import transformers

    folder = gpt2_folder(tmp_path / "gpt2")
    loaded = loading.load(folder)
    assert loaded.source == folder and loaded.start_token == loaded.tokenizer.token_id("<|endoftext|>") is not None
    ids = torch.tensor([loaded.tokenizer.encode("the cat sat")])
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, local_files_only=True).eval()
    torch.testing.assert_close(loaded.model.eval()(ids)[0], hf(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make,words", [
    (lambda p: p / "missing", ["does not exist"]),
    (lambda p: p, ["holds no checkpoint", "and no transformers config.json"]),
    (lambda p: (p / "config.json").write_text('{"hidden_size": 64}') and p,  # a config.json of another kind
     ["holds no checkpoint", "its config.json names no model_type (a transformers config.json does)"]),
    (lambda p: (p / "ckpt-0000001.safetensors").write_bytes(b"garbage") and p / "ckpt-0000001.safetensors",
     ["truncated or corrupted"]),
])
def test_paths_without_a_model_are_value_errors_naming_the_path(tmp_path, make, words):
    path = make(tmp_path)
    with pytest.raises(ValueError) as info:
        loading.load(path)
    assert str(path) in str(info.value) and all(w in str(info.value) for w in words), str(info.value)


@pytest.mark.parametrize("command", [["check"], ["sample", "--max-new-tokens", "3", "--seed", "0"],
                                     ["heads", "--random-tokens", "4"]])
def test_every_command_takes_every_kind_of_model_path(command, run, tmp_path, capsys):
    folder = gpt2_folder(tmp_path / "gpt2")
    extra = ["--out", str(tmp_path / "heads")] if command[0] == "heads" else []
    for path in (run, run / "ckpt-0000004.safetensors", folder, llama_folder(tmp_path / "llama")):
        assert main([command[0], "--ckpt", str(path), *command[1:], *extra]) == 0, path
    capsys.readouterr()
    assert main([command[0], "--ckpt", str(tmp_path / "nowhere"), *command[1:], *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err


def test_a_gpt2_folder_with_pickled_weights_is_refused_with_how_to_convert(tmp_path):
    folder = gpt2_folder(tmp_path / "gpt2")
    weights = transformers_state(folder)
    (folder / "model.safetensors").unlink()
    torch.save(weights, folder / "pytorch_model.bin")
    with pytest.raises(ValueError) as e:
        loading.load(folder)
    message = str(e.value)
    assert "pytorch_model.bin" in message and "only safetensors weights are loaded" in message
    assert f"from_pretrained('{folder}').save_pretrained('{folder}') writes model.safetensors" in message
    assert "weights_only" not in message and "\n" not in message


def transformers_state(folder):
    import transformers

    return transformers.GPT2LMHeadModel.from_pretrained(folder, local_files_only=True).state_dict()


@pytest.mark.parametrize("damage, words", [
    (lambda f: (f / "model.safetensors").write_bytes((f / "model.safetensors").read_bytes()[:5000]),
     ["cannot read", "model.safetensors: ", "incomplete metadata"]),
    (lambda f: (f / "model.safetensors").write_bytes(b"\x07" * 8 + (f / "model.safetensors").read_bytes()[8:]),
     ["cannot read", "model.safetensors: ", "header"]),
    (lambda f: (f / "config.json").write_text('{"model_type": "gpt2", '), ["config.json", "invalid JSON"]),
    (lambda f: (f / "tokenizer.json").write_text("[1, 2]"), ["tokenizer.json", "is not a tokenizer"]),
])
def test_a_damaged_gpt2_folder_is_a_value_error_naming_the_file(tmp_path, damage, words):
    folder = gpt2_folder(tmp_path / "gpt2")
    damage(folder)
    with pytest.raises(ValueError) as e:
        loading.load(folder)
    assert str(folder) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)
    assert "\n" not in str(e.value)


def test_an_invalid_config_json_beside_a_state_dict_names_the_file(run, tmp_path):
    weights, _ = checkpoint.read_weights(run / "ckpt-0000004.safetensors")
    torch.save(weights, tmp_path / "weights.pt")
    (tmp_path / "config.json").write_text('{"model": {"n_layer": 1},\n "train": }')
    with pytest.raises(ValueError) as e:
        loading.load(tmp_path / "weights.pt")
    assert str(e.value) == f"{tmp_path / 'config.json'}: invalid JSON at line 2 column 11: Expecting value"


def test_a_tokenizer_without_a_newline_needs_a_prompt(tmp_path, capsys):
    import tokenizers
    import transformers
    from tokenizers import decoders, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(["the cat sat on the mat"] * 10, trainers.BpeTrainer(vocab_size=40, show_progress=False))
    config = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=16, n_embd=8, n_layer=1, n_head=2,
                                     bos_token_id=None, eos_token_id=None)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path)
    tok.save(str(tmp_path / "tokenizer.json"))
    capsys.readouterr()
    assert tok.encode("\n").ids == [] and loading.load(tmp_path).start_token is None  # no newline, no <|endoftext|>
    assert main(["sample", "--ckpt", str(tmp_path), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no token for a newline and no <|endoftext|>" in err and "--prompt" in err
    assert main(["sample", "--ckpt", str(tmp_path), "--prompt", "the cat", "--max-new-tokens", "2", "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("the cat")


def llama_folder(path):
    """A tiny Llama with tied embeddings, saved by transformers with a BPE tokenizer.json beside it."""
    import transformers

    gpt2 = gpt2_folder(path)  # for its tokenizer.json
    (gpt2 / "model.safetensors").unlink()
    config = transformers.LlamaConfig(vocab_size=400, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_a_folder_of_another_model_type_is_refused_naming_it(tmp_path, capsys):
    folder = llama_folder(tmp_path / "gemma")
    config = folder / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "gemma"}))  # a type not served
    capsys.readouterr()  # save_pretrained's progress bars
    expected = (f"unsupported model_type 'gemma' in {config}: this version loads gpt2, llama, mistral, qwen2, qwen3, "
                f"gemma2, gemma3_text, phi3, olmo2, bloom, gpt_oss folders")
    with pytest.raises(ValueError) as e:
        loading.load(folder)
    assert str(e.value) == expected
    from selfattn.io.hf import load_gpt2

    with pytest.raises(ValueError, match=r"config.json has model_type 'gemma', not 'gpt2'"):
        load_gpt2(folder)  # called directly, not through load(): refused too
    for command in (["sample", "--max-new-tokens", "3", "--prompt", "the cat"],
                    ["export", "--out", str(tmp_path / "hf")]):
        assert main([command[0], "--ckpt", str(folder), *command[1:]]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == f"selfattn {command[0]}: error: {expected}\n"  # no noise, no random export
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.pop("transformer.h.1.mlp.c_fc.weight"), ["missing 1 tensor: transformer.h.1.mlp.c_fc.weight"]),
    (lambda t: t.update({"transformer.h.2.ln_1.weight": torch.ones(16)}),
     ["unexpected 1 tensor: transformer.h.2.ln_1.weight"]),
    (lambda t: [t.pop(k) for k in sorted(t) if ".h.0." in k],
     ["missing 12 tensors: transformer.h.0.attn.c_attn.bias, transformer.h.0.attn.c_attn.weight, "
      "transformer.h.0.attn.c_proj.bias, transformer.h.0.attn.c_proj.weight and 8 more"]),
])
def test_a_gpt2_folder_with_tensors_missing_or_unexpected_loads_not_at_all(tmp_path, capsys, edit, words):
    from safetensors.torch import load_file, save_file

    folder = gpt2_folder(tmp_path / "gpt2")
    tensors = load_file(folder / "model.safetensors")
    edit(tensors)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    capsys.readouterr()
    with pytest.raises(ValueError) as e:
        loading.load(folder)
    message = str(e.value)
    assert f"the weights in {folder} are not GPT-2's for its config.json" in message and "\n" not in message
    assert all(w in message for w in words), message
    assert main(["export", "--ckpt", str(folder), "--out", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err.count("\n") == 1 and not (tmp_path / "hf").exists()


def test_gpt2_weights_named_without_the_transformer_prefix_still_load(tmp_path):  # control: nothing over-refused
    import transformers
    from safetensors.torch import load_file, save_file

    folder = gpt2_folder(tmp_path / "gpt2")
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(folder / "model.safetensors").items()}
    tensors |= {f"h.{i}.attn.bias": torch.ones(1, 1, 32, 32).tril() for i in range(2)}  # old files keep the mask
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    ids = torch.tensor([[5, 9, 30, 7]])
    hf = transformers.GPT2LMHeadModel.from_pretrained(folder, local_files_only=True).eval()
    torch.testing.assert_close(loading.load(folder).model.eval()(ids)[0], hf(ids).logits, atol=1e-5, rtol=1e-5)


def _poison(file, name: str, value: float) -> None:
    """Set one entry of the tensor ``name`` of a safetensors ``file`` to ``value``, its header kept."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    tensors[name].view(-1)[3] = value
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_weight_is_refused_at_load_naming_the_tensor(tmp_path, capsys, value):
    folder = gpt2_folder(tmp_path / "gpt2")
    assert loading.load(folder).model is not None  # control: the undamaged folder loads
    _poison(folder / "model.safetensors", "transformer.wte.weight", value)
    with pytest.raises(ValueError, match=r"the weights hold 1 NaN or infinite value in wte.weight \(\d+, 16\); "
                                         r"the file is damaged"):
        loading.load(folder)
    capsys.readouterr()
    for command in (["sample", "--prompt", "the"], ["explore", "--text", "the cat", "--out", str(tmp_path / "p.html")]):
        assert main([command[0], "--ckpt", str(folder), *command[1:]]) == 2  # not "attends to future keys"
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "NaN or infinite" in err, err
    assert not (tmp_path / "p.html").exists()


def test_a_non_finite_weight_in_a_run_checkpoint_is_refused(run, tmp_path):
    _, _, header = checkpoint.read_latest(run)
    model = loading.load(run).model
    with torch.no_grad():
        model.blocks[0].mlp.c_fc.weight[0, 0] = float("nan")  # a run whose weights went NaN, saved as they were
    checkpoint.save(tmp_path, 4, model, torch.optim.AdamW(model.parameters()), meta=header["meta"], keep=1)
    with pytest.raises(ValueError, match=r"NaN or infinite value in blocks.0.mlp.c_fc.weight"):
        loading.load(tmp_path)


def test_a_vocabulary_that_cannot_write_a_newline_starts_from_no_token_instead_of_failing_the_load():
    from selfattn.tokenizers import ByteTokenizer
    from selfattn.tokenizers.sentencepiece import SentencePieceTokenizer

    no_newline = SentencePieceTokenizer(["a", "\u2581a"], [0.0, 1.0], [1, 1], add_space_prefix=False)
    with pytest.raises(ValueError, match="no token for"):
        no_newline.encode("\n")
    assert loading._newline(no_newline) is None and loading._newline(ByteTokenizer()) == 10
