"""`selfattn export --out FILE.gguf` for the families llama.cpp has an architecture for beyond those of
test_gguf_export.py: GPT-2 (llama.cpp's gpt2: the default block of `selfattn train`, its missing biases written
as zeros; GPT-2 itself from a transformers folder), BLOOM (bloom: ALiBi, fused q, k, v regrouped), Phi-3
(phi3: fused projections, RoPE on half of each head, GQA, linear RoPE scaling) and gpt-oss (gpt-oss: a mixture
of experts, its gate and up split and transposed; learned sinks, every other layer sliding, YaRN). llama.cpp's
`llama-completion` continues a prompt, greedily, byte for byte as our `generate` does on the model written; the
file read back computes our logits. llama.cpp's own converter's file of a GPT-2 folder holds the tensors and fields
ours holds, and reads back as the folder. Controls: BLOOM's q, k, v rows left per head (either of the two reorders
left out), Phi-3's rotated channels left unsaid, or gpt-oss's gate and up split as halves rather than alternated,
and llama.cpp continues otherwise. Refused in one line: what llama.cpp computes otherwise (GPT-2's exact GELU,
Phi-3's window, LongRoPE, gpt-oss's expert clamp, YaRN's ramp unrounded), gpt-oss without a sliding
layer (llama.cpp's asserts one)."""
import json

import gguf
import pytest
import torch
import transformers

from selfattn.config import GPTConfig
from selfattn.families import writing
from selfattn.formats import gguf as formats_gguf
from selfattn.formats import gguf_write
from selfattn.io.gguf_export import export_gguf
from selfattn.io.loading import load
from selfattn.tokenizers import ByteTokenizer

from helpers import llama_cpp
from helpers.gguf_export import PROMPT, assert_llama_cpp_continues_as_we_do, command, ours, text
from helpers.llama_cpp import complete
from helpers.models import assert_same_logits, scrambled

SIZES = dict(vocab_size=256, block_size=128, n_layer=3, n_head=4, n_embd=64)
CASES = {  # a test model -> llama.cpp's architecture and what it sets beyond SIZES
    "gpt2": ("gpt2", {}),  # GPTConfig's default block: no biases (written as zeros), GELU's tanh approximation
    "bloom": ("bloom", dict(block_size=2048, pos="none", alibi=True, bias=True, embedding_norm=True)),
    "phi3": ("phi3", dict(pos="rope", rope_dims=8, n_kv_head=2, norm="rmsnorm", mlp_kind="swiglu",
                          intermediate_size=96, tie_embeddings=False,
                          rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "gpt-oss": ("gpt-oss", dict(n_layer=2, pos="rope", n_kv_head=2, head_dim=16, norm="rmsnorm",
                                norm_weight_in_float32=True, qkv_bias=True, proj_bias=True, sinks=True, mlp_kind="moe",
                                intermediate_size=96, n_experts=4, experts_per_token=2, tie_embeddings=False,
                                window=16, window_layers=[True, False], rope_base=150000.0,
                                rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 32})),
}


def model(case: str, **overrides):
    """A scrambled model of the case whose greedy answers are no repetition of one token."""
    torch.manual_seed(0)
    gpt = scrambled(GPTConfig(**{**SIZES, **CASES[case][1], **overrides}))
    with torch.no_grad():  # a tied head would answer the last token again and again
        for p in [gpt.wte.weight] if gpt.ln_emb is None else [gpt.ln_emb.weight, gpt.ln_emb.bias]:  # BLOOM's: normed
            p.mul_(0.3 if gpt.ln_emb is None else 0.1)
    return gpt


@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_continues_the_file_byte_for_byte_as_we_continue_the_model(case, tmp_path):
    gpt, byte = model(case), ByteTokenizer()
    done = export_gguf(gpt, byte, tmp_path / "m.gguf")
    assert done.written.architecture == CASES[case][0] and set(done.written.types) == {"F32"}
    assert done.written.zero_biases == (case == "gpt2")
    assert_llama_cpp_continues_as_we_do(done, gpt, byte)


def _first_tokens_differ(path, gpt, prompt: str = PROMPT) -> None:
    byte = ByteTokenizer()
    expected, got = text(byte, ours(gpt, byte, prompt)), complete(path, prompt)
    assert got[:4] != expected[:4], (got, expected)


@pytest.mark.parametrize("left_out", ["the regroup of q, k, v", "the folder's per-head order"])
def test_without_either_reorder_of_blooms_qkv_llama_cpps_continuation_differs(left_out, tmp_path, monkeypatch):
    gpt = model("bloom")  # ours [q; k; v] -> the folder's per head (writing) -> llama.cpp's [q; k; v] (gguf_write)
    if left_out == "the regroup of q, k, v":
        monkeypatch.setattr(gguf_write, "_regroup", lambda a, heads: a)
    else:
        monkeypatch.setattr(writing, "_folder_order", lambda family, key, tensor, config: tensor)
    gguf_write.write(gpt, ByteTokenizer(), tmp_path / "m.gguf")
    _first_tokens_differ(tmp_path / "m.gguf", gpt)


def test_without_the_rotated_channels_llama_cpp_rotates_whole_heads_and_differs(tmp_path, monkeypatch):
    gpt = model("phi3")
    metadata = gguf_write._metadata
    monkeypatch.setattr(gguf_write, "_metadata", lambda *a: {k: v for k, v in metadata(*a).items()
                                                             if not k.endswith("rope.dimension_count")})
    gguf_write.write(gpt, ByteTokenizer(), tmp_path / "m.gguf")
    _first_tokens_differ(tmp_path / "m.gguf", gpt)


def test_without_gpt_oss_alternated_gate_and_up_llama_cpp_continues_otherwise(tmp_path, monkeypatch):
    gpt = model("gpt-oss")  # gate_up_proj (E, C, 2I), gate at even columns -> ffn_gate_exps and ffn_up_exps
    monkeypatch.setattr(gguf_write, "_unalternated", lambda a: [a[..., :a.shape[-1] // 2], a[..., a.shape[-1] // 2:]])
    gguf_write.write(gpt, ByteTokenizer(), tmp_path / "m.gguf")
    _first_tokens_differ(tmp_path / "m.gguf", gpt)


def test_gpt_oss_experts_in_q8_0_where_their_rows_are_whole_blocks_and_llama_cpp_runs_them(tmp_path):
    gpt = model("gpt-oss", intermediate_size=48)  # ffn_down_exps' rows: 48 values, no whole Q8_0 blocks of 32
    done = export_gguf(gpt, ByteTokenizer(), tmp_path / "m.gguf", type="q8_0")
    types = {t.name: (t.tensor_type.name, len(t.shape)) for t in gguf.GGUFReader(done.path).tensors}
    assert types == {name: ("F32" if name.endswith(".bias") or ".ffn_gate_inp." in name or dims == 1 else  # as the
                            "F16" if "ffn_down_exps" in name else "Q8_0", dims)  # converter: biases and router F32
                     for name, (_, dims) in types.items()}
    assert types["blk.0.ffn_up_exps.weight"] == ("Q8_0", 3) and types["blk.1.ffn_gate_exps.bias"] == ("F32", 2)
    assert 0 < done.logits_error and len(complete(done.path, PROMPT, 4)) > 0  # llama.cpp runs it


def _gpt2_folder(path, vocab: dict[str, int] | None = None, merges=(), n_embd: int = 64):
    """A scrambled GPT-2 saved in ``path`` (with ``n_ctx``, as GPT-2's own config.json has it, which llama.cpp's
    converter reads), its tokenizer a byte-level BPE of ``vocab`` (default: the 256 bytes) and ``merges``."""
    import tokenizers

    from selfattn.io.export import byte_level_tokenizer

    tok = byte_level_tokenizer() if vocab is None else tokenizers.Tokenizer(tokenizers.models.BPE(vocab, merges))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    if vocab is not None:  # GPT-2's own, as the converter recognises it
        tok.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True)])
        path.mkdir()
        (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer",
                                                                "bos_token": "<|endoftext|>",
                                                                "eos_token": "<|endoftext|>"}))
    config = transformers.GPT2Config(vocab_size=tok.get_vocab_size(), n_positions=128, n_ctx=128, n_embd=n_embd,
                                     n_layer=2, n_head=4, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            gain = ".ln_" in name and name.endswith("weight")  # a LayerNorm's gain near 1
            small = ".ln_" in name or name == "transformer.wte.weight"  # a tied head that does not echo the token
            p.copy_(torch.randn_like(p) * (0.1 if small else 0.3) + (1.0 if gain else 0.0))
    hf.save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_gpt2_from_a_transformers_folder_is_written_and_continues_as_sample_does(tmp_path):
    folder, file = _gpt2_folder(tmp_path / "gpt2"), tmp_path / "gpt2.gguf"
    code, printed, err = command("export", "--ckpt", str(folder), "--out", str(file))
    assert code == 0, err
    assert "llama.cpp's gpt2 (gpt2)" in printed and "max |difference| 0.0e+00" in printed, printed
    assert "written as zeros" not in printed  # GPT-2 has its biases
    source = load(folder)
    expected = ours(source.model, source.tokenizer, PROMPT)
    assert len(set(expected)) > 5 and 11 not in expected  # 11 would stop llama.cpp (its eos)
    assert complete(file, PROMPT) == text(source.tokenizer, expected)


def test_llama_cpps_converter_writes_a_gpt2_folder_as_we_do_and_we_read_its_file(tmp_path):
    shipped = formats_gguf.read(llama_cpp.source("models/ggml-vocab-gpt-2.gguf")).metadata  # a vocabulary it knows
    vocab = {t: i for i, t in enumerate(shipped.value("tokenizer.ggml.tokens"))}
    merges = [tuple(m.split(" ")) for m in shipped.value("tokenizer.ggml.merges")]
    folder = _gpt2_folder(tmp_path / "gpt2", vocab, merges, n_embd=32)
    log = llama_cpp.convert([(folder, tmp_path / "theirs.gguf")])
    assert (tmp_path / "theirs.gguf").is_file(), log
    source, theirs = load(folder), load(tmp_path / "theirs.gguf")
    idx = torch.randint(0, len(vocab), (2, 80), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_same_logits(theirs.model.eval()(idx)[0], source.model.eval()(idx)[0])  # its file, read here
    export_gguf(source.model, source.tokenizer, tmp_path / "ours.gguf")
    mine, converted = (formats_gguf.read(tmp_path / name) for name in ("ours.gguf", "theirs.gguf"))
    names = [{f.tensors.gguf_name(n) for n in f.tensors} for f in (mine, converted)]
    assert names[0] == names[1] and "position_embd.weight" in names[0]
    assert all(torch.equal(mine.tensors[n], converted.tensors[n]) for n in mine.tensors)  # F32: the same values
    keys = [f"gpt2.{k}" for k in ("context_length", "embedding_length", "feed_forward_length", "block_count",
                                  "attention.head_count", "attention.layer_norm_epsilon")]  # what the converter writes
    assert [mine.metadata.value(k) for k in keys] == [converted.metadata.value(k) for k in keys]


def test_what_llama_cpp_computes_otherwise_is_refused_in_one_line_naming_it(tmp_path):
    exact = model("gpt2", gelu_approximate="none")
    with pytest.raises(ValueError, match=r"llama.cpp's gpt2 computes gpt2's activation_function 'gelu_new' .*"
                                         r"gelu_approximate='none' \(llama.cpp's: 'tanh'\)") as e:
        export_gguf(exact, ByteTokenizer(), tmp_path / "m.gguf")
    windowed = model("phi3", window=16, rope_scaling=None)
    with pytest.raises(ValueError, match=r"llama.cpp's phi3 computes phi3's sliding_window None .*window=\[16, 16, 16"):
        export_gguf(windowed, ByteTokenizer(), tmp_path / "m.gguf")
    longrope = model("phi3", rope_scaling={"rope_type": "longrope", "factor": 4.0, "short_factor": [1.0, 1.5, 2.0, 2.5],
                                           "long_factor": [3.0, 4.0, 6.0, 8.0], "original_max_position_embeddings": 32})
    with pytest.raises(ValueError, match="rope_type 'longrope' is not written to GGUF: llama.cpp takes the long"):
        export_gguf(longrope, ByteTokenizer(), tmp_path / "m.gguf")
    clamped = model("gpt-oss", expert_clamp=5.0)
    with pytest.raises(ValueError, match=r"llama.cpp's gpt-oss computes gpt_oss's swiglu_limit 7.0, attention_bias "
                                         r"True .*expert_clamp=5.0 \(llama.cpp's: 7.0\)"):
        export_gguf(clamped, ByteTokenizer(), tmp_path / "m.gguf")
    unrounded = model("gpt-oss", rope_scaling={**CASES["gpt-oss"][1]["rope_scaling"], "truncate": False})
    with pytest.raises(ValueError, match=r"'yarn' with truncate=False \(llama.cpp's: True\) is not written to GGUF"):
        export_gguf(unrounded, ByteTokenizer(), tmp_path / "m.gguf")
    unwindowed = model("gpt-oss", window=None, window_layers=None)  # llama.cpp's gpt-oss asserts a sliding layer
    with pytest.raises(ValueError, match="llama.cpp's gpt-oss needs gpt-oss.attention.sliding_window"):
        export_gguf(unwindowed, ByteTokenizer(), tmp_path / "m.gguf")
    nowhere = model("gpt2", norm="rmsnorm")  # learned positions and RMSNorm: no family of llama.cpp's
    with pytest.raises(ValueError, match="llama.cpp runs none of the families"):
        export_gguf(nowhere, ByteTokenizer(), tmp_path / "m.gguf")
    assert "\n" not in str(e.value) and list(tmp_path.iterdir()) == []
