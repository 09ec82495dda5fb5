"""Llama, Mistral and Qwen2 folders saved by transformers load into the one decoder and compute what
transformers computes: the same logits, the same greedy tokens through our KV cache, and one-line
refusals naming what cannot be computed.

Every model is a small random config built offline (eager attention, a fixed seed, every weight
scrambled so a misplaced tensor shows); nothing is ever downloaded.
"""
import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402  (the [hf] extra, part of [dev])

from selfattn.cli import main  # noqa: E402
from selfattn.io import loading  # noqa: E402
from selfattn.norms import RMSNorm  # noqa: E402
from selfattn.tokenizers import BPETokenizer  # noqa: E402

from helpers.families import assert_greedy_as_transformers  # noqa: E402

transformers.logging.set_verbosity_error()
WINDOW = 16  # Mistral's sliding window here: shorter than every sequence the checks run
SIZES = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
CASES = {  # name -> (transformers' class prefix, what it sets beyond SIZES)
    "llama": ("Llama", dict(head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "llama-tied-biased": ("Llama", dict(num_hidden_layers=3, tie_word_embeddings=True, attention_bias=True,
                                        mlp_bias=True, rms_norm_eps=1e-5)),
    "mistral": ("Mistral", dict(num_hidden_layers=3, sliding_window=WINDOW)),
    "qwen2": ("Qwen2", dict(tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2-sliding": ("Qwen2", dict(use_sliding_window=True, sliding_window=12, max_window_layers=0)),
}


def saved(case: str, folder, **overrides):
    """transformers' model of ``case`` in eval mode, every weight scrambled, saved in ``folder``."""
    prefix, kw = CASES[case]
    config = getattr(transformers, f"{prefix}Config")(**{**SIZES, **kw, **overrides}, attn_implementation="eager")
    torch.manual_seed(0)
    hf = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    assert hf.config._attn_implementation == "eager"
    with torch.no_grad():
        for name, p in hf.named_parameters():
            norm = "norm" in name
            p.copy_(torch.randn_like(p) * (0.1 if norm else 0.2) + (1.0 if norm else 0.0))
    hf.save_pretrained(folder)
    return hf, folder


def max_difference(hf, ours, T: int = 80) -> float:
    idx = torch.randint(0, SIZES["vocab_size"], (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = hf(idx).logits, ours(idx)[0]
    assert expected.abs().amax() > 1  # logits large enough for the tolerance to mean something
    return (got - expected).abs().amax().item()


@pytest.fixture(scope="module", params=list(CASES))
def family(request, tmp_path_factory):
    hf, folder = saved(request.param, tmp_path_factory.mktemp(request.param))
    return request.param, hf, loading.load(folder).model.eval()


def test_logits_match_transformers(family):
    name, hf, ours = family
    diff = max_difference(hf, ours)
    print(f"{name}: max |logit difference| {diff:.1e} over 2 x 80 positions")
    assert diff < 1e-4


def test_greedy_generation_through_the_cache_matches_transformers(family):
    _, hf, ours = family
    idx = torch.randint(0, SIZES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(2))
    assert_greedy_as_transformers(hf, ours, idx, 32)


def test_each_config_is_mapped_to_data(family):
    name, hf, ours = family
    cfg, attn = ours.config, ours.blocks[0].attn
    assert (cfg.norm, cfg.mlp_kind, cfg.pos, cfg.n_kv_head) == ("rmsnorm", "swiglu", "rope", 2)
    assert cfg.intermediate_size == 96 and cfg.layer_norm_eps == hf.config.rms_norm_eps
    assert cfg.rope_base == hf.config.rope_parameters["rope_theta"]
    assert cfg.window == {"mistral": WINDOW, "qwen2-sliding": 12}.get(name)
    assert cfg.tie_embeddings == (ours.lm_head.weight is ours.wte.weight) == hf.config.tie_word_embeddings
    assert attn.head_dim == (32 if name == "llama" else 16)
    mlp = ours.blocks[0].mlp
    assert (attn.qkv.bias is not None, attn.proj.bias is not None, mlp.gate_up_proj.bias is not None) == {
        "llama-tied-biased": (True, True, True), "qwen2": (True, False, False),
        "qwen2-sliding": (True, False, False)}.get(name, (False, False, False))


@pytest.mark.parametrize("case, spoil", [
    ("mistral", lambda attn: setattr(attn, "window", WINDOW + 1)),  # a window off by one, either way
    ("mistral", lambda attn: setattr(attn, "window", WINDOW - 1)),
    ("llama", lambda attn: setattr(attn, "rope_base", 10000.0)),  # the default RoPE base, not the config's
    ("qwen2", lambda attn: attn.qkv.bias.data.zero_()),  # Qwen2's q/k/v biases left out
])
def test_a_wrong_window_rope_base_or_bias_fails_the_logits_check(case, spoil, tmp_path):  # negative controls
    hf, folder = saved(case, tmp_path)
    ours = loading.load(folder).model.eval()
    assert max_difference(hf, ours) < 1e-4
    for block in ours.blocks:
        spoil(block.attn)
    diff = max_difference(hf, ours)
    print(f"{case}, spoiled: max |logit difference| {diff:.2f}")
    assert diff > 1e-2


def test_rmsnorm_computes_as_transformers_does_in_every_precision():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    theirs, ours = LlamaRMSNorm(64, eps=1e-5), RMSNorm(64, 1e-5)
    with torch.no_grad():
        ours.weight.copy_(theirs.weight.normal_())
    x = torch.randn(2, 5, 64) * 3
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(ours.to(dtype)(x.to(dtype)), theirs.to(dtype)(x.to(dtype))), dtype


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder / "config.json"


@pytest.mark.parametrize("case, changes, words", [
    ("llama", dict(rope_parameters={"rope_type": "proportional", "factor": 2.0, "rope_theta": 10000.0}),
     ["rope_type 'proportional' is not supported", "'default', 'linear', 'llama3', 'yarn', 'longrope'"]),
    ("mistral", dict(rope_scaling={"type": "dynamic", "factor": 2.0}), ["rope_type 'dynamic'"]),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}),
     ["rope_type 'llama3' needs factor, low_freq_factor, high_freq_factor", "no low_freq_factor, high_freq_factor"]),
    ("llama", dict(hidden_act="gelu"), ["hidden_act 'gelu' is not supported"]),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "local"]),
     ["layer_types must list 2 of 'full_attention', 'sliding_attention'"]),
    ("llama", dict(num_key_value_heads=3), ["num_attention_heads 4 is not a multiple of num_key_value_heads 3"]),
    ("mistral", dict(hidden_size=None), ["a mistral config.json needs hidden_size"]),
    # each message names the config.json field at fault, not what it became
    ("llama", dict(num_key_value_heads=0), ["num_key_value_heads must be a positive int, got 0"]),
    ("qwen2", dict(num_attention_heads=7, hidden_size=576),
     ["hidden_size 576 is not divisible by num_attention_heads 7"]),
    ("mistral", dict(hidden_size=1e7), ["hidden_size must be an int, got float 10000000.0"]),
    ("qwen2", dict(rope_parameters=None, rope_theta="big"), ["rope_theta must be a number, got str 'big'"]),
    ("llama", dict(rope_parameters={"rope_type": "default", "rope_theta": 0.5}),
     ["rope_theta must be a finite number > 1, got 0.5"]),
    # RoPE rules that compute NaN, or nothing said
    ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 0, "rope_theta": 1e4}),
     ["rope_parameters.factor must be a finite number > 0, got 0"]),
    ("llama", dict(rope_parameters={"rope_type": "linear", "factor": -2.0, "rope_theta": 1e4}),
     ["rope_parameters.factor must be a finite number > 0, got -2.0"]),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": float("inf"), "rope_theta": 1e4}),
     ["rope_parameters.factor must be a finite number > 0, got inf"]),
    ("qwen2", dict(rope_scaling={"type": "yarn", "factor": -4.0, "original_max_position_embeddings": 32}),
     ["rope_scaling.factor must be a finite number > 0, got -4.0"]),
    ("mistral", dict(rope_scaling={"factor": 2.0}),
     ["rope_scaling has factor but no rope_type (or type): one of 'default', 'linear', 'llama3', 'yarn', 'longrope'"]),
])
def test_configs_the_decoder_cannot_compute_are_refused_naming_file_and_value(case, changes, words, tmp_path):
    _, folder = saved(case, tmp_path)
    config = edit_config(folder, **changes)
    with pytest.raises((ValueError, TypeError)) as e:
        loading.load(folder)
    message = str(e.value)
    assert message.startswith(f"{config}: ") and "\n" not in message and all(w in message for w in words), message


@pytest.mark.parametrize("drop, add, words", [
    (["model.layers.1.self_attn.k_proj.bias"], {"model.layers.2.mlp.up_proj.weight": torch.zeros(96, 64)},
     "missing 1 tensor: model.layers.1.self_attn.k_proj.bias; unexpected 1 tensor: model.layers.2.mlp.up_proj.weight"),
    ([], {"model.norm.weight": torch.ones(32), "lm_head.weight": torch.zeros(128, 64)},
     "unexpected 1 tensor: lm_head.weight; of another shape 1 tensor: model.norm.weight (32,) instead of (64,)"),
])
def test_tensors_missing_unexpected_or_reshaped_are_refused_naming_them(drop, add, words, tmp_path):
    from safetensors.torch import load_file, save_file

    _, folder = saved("qwen2", tmp_path)  # tied: the folder holds no lm_head.weight
    tensors = {name: t for name, t in load_file(folder / "model.safetensors").items() if name not in drop} | add
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        loading.load(folder)
    assert str(e.value) == f"the weights in {folder} are not those its config.json describes: {words}"


def test_rope_parameters_without_a_rope_type_but_its_base_are_the_default_rule(tmp_path):  # control for the above
    hf, folder = saved("llama", tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    edit_config(folder, rope_parameters={"rope_theta": 500000.0})
    assert max_difference(hf, loading.load(folder).model.eval()) < 1e-4


def test_a_tied_embedding_of_another_shape_is_named_once(tmp_path):
    from selfattn import families
    from selfattn.formats import hf_folder

    _, folder = saved("qwen2", tmp_path)  # tied: the head is the embedding
    family = families.FAMILIES["qwen2"]
    config = family.config({**hf_folder.config(folder), "vocab_size": 100}, "config.json")
    with pytest.raises(ValueError) as e:
        families.load(family, hf_folder.Safetensors(folder), loading.GPT.empty(config), str(folder))
    assert str(e.value) == (f"the weights in {folder} are not those its config.json describes: of another shape "
                            f"1 tensor: model.embed_tokens.weight (128, 64) instead of (100, 64)")


def test_rotary_buffers_older_files_kept_are_ignored(tmp_path):  # control: nothing over-refused
    from safetensors.torch import load_file, save_file

    hf, folder = saved("llama", tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors |= {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(16) for i in range(2)}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert max_difference(hf, loading.load(folder).model.eval()) < 1e-4


def test_a_folder_without_a_readable_tokenizer_loads_and_text_commands_say_why_not(tmp_path, capsys):
    _, folder = saved("mistral", tmp_path / "model")
    assert loading.load(folder).tokenizer is None  # no tokenizer.json
    import tokenizers

    words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "the": 1, "cat": 2}, unk_token="[UNK]"))
    words.decoder = tokenizers.decoders.WordPiece()
    words.save(str(folder / "tokenizer.json"))
    loaded = loading.load(folder)
    assert loaded.tokenizer is None  # words, not bytes: not one BPETokenizer streams byte-exactly
    capsys.readouterr()
    for command in (["sample", "--prompt", "the cat", "--max-new-tokens", "2"],
                    ["heads", "--text", "the cat", "--out", str(tmp_path / "heads")]):
        assert main([command[0], "--ckpt", str(folder), *command[1:]]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err == (f"selfattn {command[0]}: error: {folder} has no tokenizer selfattn can read "
                                     f"(it reads byte-level and SentencePiece-style BPE tokenizer.json files), so "
                                     f"this model cannot encode or decode text\n")
    assert main(["export", "--ckpt", str(folder), "--out", str(tmp_path / "hf")]) == 2  # a Mistral, but no text
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no tokenizer selfattn can read" in err and not (tmp_path / "hf").exists()
    assert main(["heads", "--ckpt", str(folder), "--random-tokens", "4", "--out", str(tmp_path / "heads")]) == 0


def test_a_byte_level_bpe_tokenizer_is_loaded_and_samples(tmp_path, capsys):
    bpe = BPETokenizer.train("the cat sat on the mat. the dog sat on the log. " * 20, vocab_size=280)
    _, folder = saved("qwen2", tmp_path / "model", vocab_size=288)
    bpe.tok.save(str(folder / "tokenizer.json"))
    loaded = loading.load(folder)
    assert isinstance(loaded.tokenizer, BPETokenizer) and loaded.tokenizer.vocab_size == bpe.vocab_size
    assert loaded.start_token == bpe.encode("\n")[0]  # Qwen2 has no bos token: an empty prompt starts at a newline
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(folder), "--prompt", "the cat", "--max-new-tokens", "3", "--seed", "0"]) == 0
    assert capsys.readouterr().out.startswith("the cat")
