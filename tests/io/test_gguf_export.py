"""`selfattn export --out FILE.gguf`: a GGUF file that llama.cpp runs. llama.cpp's `llama-completion` on the
file continues a prompt, greedily, byte for byte as our `generate` does on the model written (Llama, Qwen2,
Qwen3, OLMo 2, Gemma 2 and Gemma 3, each with its own fixes: q/k rows interleaved, biases, q/k norms, norms
stored as 1 + w, a sliding pattern of its own; linear, YaRN and Llama 3 RoPE scaling); the file read back
computes our logits; each type holds our weights rounded to it; llama-tokenize gives our tokenizer's ids.
Controls: without the q/k interleave, or without the sliding pattern, llama.cpp's continuation differs.
Every model is small and random (scrambled); the real one (SmolLM2) is marked slow. GPT-2, BLOOM and Phi-3:
test_gguf_export_families.py."""
import dataclasses
import re

import gguf
import pytest
import tokenizers
import torch
from tokenizers import Regex, decoders, pre_tokenizers

from selfattn.config import GPTConfig
from selfattn.families import writing
from selfattn.formats import gguf_write
from selfattn.io.export import Special
from selfattn.io.gguf_export import export_gguf
from selfattn.io.loading import load
from selfattn.tokenizers import BPETokenizer, ByteTokenizer, SentencePieceTokenizer
from selfattn.tokenizers import gguf as tokenizer_gguf
from selfattn.training import checkpoint

from helpers.gguf_export import PROMPT, TOKENS, assert_llama_cpp_continues_as_we_do, command, ours, text
from helpers.llama_cpp import complete, tokenize
from helpers.models import scrambled
from helpers.smollm2 import smollm2

SIZES = dict(vocab_size=256, block_size=128, n_layer=3, n_head=4, n_embd=64)
CASES = {  # a test model -> its family (model_type) and what it sets beyond SIZES and the family's block
    "llama": ("llama", dict(n_kv_head=2, intermediate_size=96)),  # q/k rows interleaved for llama.cpp's RoPE
    "llama-linear-rope": ("llama", dict(n_kv_head=2, intermediate_size=96,
                                        rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-llama3-rope": ("llama", dict(n_kv_head=2, intermediate_size=96, rope_base=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),  # the file's rope_freqs tensor
    "qwen2-yarn-rope": ("qwen2", dict(n_kv_head=2, intermediate_size=96, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 1.3})),
    "qwen3": ("qwen3", dict(n_kv_head=2, intermediate_size=96, head_dim=24)),  # q/k norms per head
    "olmo2": ("olmo2", dict(n_kv_head=2, intermediate_size=96)),  # post-norms, q/k norms over the projection
    "gemma2": ("gemma2", dict(n_kv_head=2, intermediate_size=96, head_dim=16, window=16,  # norms stored as 1 + w
                              window_layers=[True, False, True], softcap=20.0, logit_softcap=15.0)),
    "gemma3": ("gemma3_text", dict(n_kv_head=2, intermediate_size=96, head_dim=16, window=16,
                                   window_layers=[True, False, True], window_rope_base=1e4, rope_base=1e6)),
}


def model(case: str, **overrides):
    """A scrambled model of the case whose greedy answers are no repetition of one token."""
    model_type, fields = CASES[case]
    torch.manual_seed(0)
    gpt = scrambled(GPTConfig(**{**SIZES, **writing.block(model_type, SIZES), **fields, **overrides}))
    with torch.no_grad():
        gpt.wte.weight.mul_(0.3)  # a tied head (Gemma's) would answer the last token again and again
        for name, p in gpt.named_parameters():
            if "norm" in name:  # q/k norms near 1, as the others: near 0, attention would be flat
                p.copy_(torch.randn_like(p) * 0.1 + 1)
    return gpt


def tensor_types(path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.mark.parametrize("case", list(CASES))
def test_llama_cpp_continues_the_file_byte_for_byte_as_we_continue_the_model(case, tmp_path):
    gpt, byte = model(case), ByteTokenizer()
    done = export_gguf(gpt, byte, tmp_path / "m.gguf")
    assert done.written.architecture == case.split("-")[0]
    assert set(done.written.types) == {"F32"}
    assert_llama_cpp_continues_as_we_do(done, gpt, byte)


def test_without_the_q_k_interleave_llama_cpps_continuation_differs(tmp_path, monkeypatch):  # control
    gpt, byte = model("llama"), ByteTokenizer()
    monkeypatch.setattr(gguf_write, "_interleave", lambda a, heads: a)
    gguf_write.write(gpt, byte, tmp_path / "m.gguf")
    expected = text(byte, ours(gpt, byte, PROMPT))
    got = complete(tmp_path / "m.gguf", PROMPT)
    assert got[:4] != expected[:4], (got, expected)


def test_without_the_sliding_pattern_llama_cpp_derives_another_and_differs(tmp_path, monkeypatch):  # control
    gpt, byte = model("gemma3"), ByteTokenizer()
    metadata = gguf_write._metadata
    monkeypatch.setattr(gguf_write, "_metadata", lambda *a: {k: v for k, v in metadata(*a).items()
                                                             if not k.endswith("sliding_window_pattern")})
    gguf_write.write(gpt, byte, tmp_path / "m.gguf")  # llama.cpp's rule: five layers of six slide, so all three
    assert complete(tmp_path / "m.gguf", PROMPT) != text(byte, ours(gpt, byte, PROMPT))


@pytest.mark.parametrize("kind", ["f16", "bf16", "q8_0"])
def test_each_type_holds_our_weights_rounded_to_it(kind, tmp_path):
    gpt = model("llama", intermediate_size=48)  # ffn_down's rows: 48 values, no whole Q8_0 blocks of 32
    done = export_gguf(gpt, ByteTokenizer(), tmp_path / "m.gguf", type=kind)
    types = tensor_types(done.path)
    fallback = "f16" if kind == "q8_0" else kind
    assert types == {name: "F32" if name.endswith("norm.weight") else (fallback if "ffn_down" in name else kind).upper()
                     for name in types}
    back = done.model.state_dict()
    for key, w in gpt.state_dict().items():
        rounded = fallback if kind == "q8_0" and "down_proj" in key else kind
        if w.dim() == 1:  # the norms: float32
            assert torch.equal(back[key], w), key
        elif rounded != "q8_0":  # exactly our weights rounded to the nearest half or bfloat16
            assert torch.equal(back[key], w.to(getattr(torch, {"f16": "float16", "bf16": "bfloat16"}[rounded])).float())
        else:  # each block of 32 values within half a step of its 255 (the step: its largest / 127)
            blocks, got = w.reshape(-1, 32), back[key].reshape(-1, 32)
            step = blocks.abs().amax(1, keepdim=True) / 127  # stored as a half: up to 127 x its rounding more
            assert ((got - blocks).abs() <= step * (0.5 + 127 * 2 ** -11)).all() and not torch.equal(got, blocks), key
    print(f"{kind}: logits of the file read back vs ours: max |difference| {done.logits_error:.2e}")
    assert done.logits_error > 0
    assert len(complete(done.path, PROMPT, 4)) > 0  # llama.cpp runs it


def bpe(pre_tokenizer) -> BPETokenizer:
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizer, decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, show_progress=False, special_tokens=["<|endoftext|>"],
                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TRICKY * 20], trainer)
    return BPETokenizer(tok)


TRICKY = "I'm sure they'll pay 12345 or 2024 cats' fees!!  Don't\n\n\tnaïve 日本 x=42; \"quoted\"   end <|endoftext|>"
LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
PRE = {
    "gpt-2": pre_tokenizers.ByteLevel(add_prefix_space=False),
    "smollm": pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                       pre_tokenizers.ByteLevel(add_prefix_space=False)]),
    "llama-bpe": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(tokenizer_gguf._LLAMA3), "isolated"), LEVEL]),
    "qwen2": pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(tokenizer_gguf._QWEN2), "isolated"), LEVEL]),
}


@pytest.mark.parametrize("pre", list(PRE))
def test_a_byte_level_bpe_is_tokenized_by_llama_cpp_into_our_ids(pre, tmp_path):
    tok = bpe(PRE[pre])
    path = tmp_path / "m.gguf"
    gguf_write.write(model("llama", vocab_size=tok.vocab_size + 3), tok, path)  # 3 [PAD] tokens
    metadata = {f.name: f.contents() for f in gguf.GGUFReader(path).fields.values() if f.name.startswith("tokenizer")}
    assert metadata["tokenizer.ggml.pre"] == pre and metadata["tokenizer.ggml.tokens"][-3:] == [
        f"[PAD{i}]" for i in range(tok.vocab_size, tok.vocab_size + 3)]
    assert metadata["tokenizer.ggml.token_type"][tok.token_id("<|endoftext|>")] == gguf.TokenType.CONTROL
    expected = tok.encode(TRICKY)
    assert len(expected) < len(TRICKY) / 2  # merges were used
    assert tokenize(path, TRICKY, tmp_path, bos=False) == expected


def test_a_sentencepiece_tokenizer_is_written_as_llama_cpps_and_gives_our_ids(tmp_path):
    pieces = ["▁the", "▁cat", "▁c", "at", "▁sat", "▁s", "th", "he", "▁t", "▁"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    spm = SentencePieceTokenizer(tokens, scores, types, bos=1)
    path = tmp_path / "m.gguf"
    gguf_write.write(model("llama", vocab_size=len(tokens)), spm, path, bos=1, eos=(2,))
    sentence = "the cat sat, thé"
    expected = spm.encode(sentence, special=True)
    assert expected[0] == 1 and {tokens.index(p) for p in ("▁cat", "th", "▁sat")} <= set(expected)  # bos, merges
    assert tokenize(path, sentence, tmp_path) == expected


def test_a_model_llama_cpp_cannot_say_is_refused_in_one_line_naming_why(tmp_path):
    unsaid = scrambled(GPTConfig(**SIZES, norm="rmsnorm"))  # learned positions and RMSNorm: no family's
    with pytest.raises(ValueError, match="llama.cpp runs none of the families .* gpt2, gpt_oss .* computes it") as e:
        export_gguf(unsaid, ByteTokenizer(), tmp_path / "m.gguf")
    assert "\n" not in str(e.value)
    scaled = model("gemma3", attn_scale=24 ** -0.5)  # llama.cpp's gemma3 scales by head_dim ** -0.5, no field says
    with pytest.raises(ValueError, match=r"gemma3 file cannot say this model: attn_scale=0.204.* \(the file says 0.25"):
        export_gguf(scaled, ByteTokenizer(), tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []  # nothing left: the file is renamed into place only when it checks out
    llama3 = model("gemma3", rope_scaling=CASES["llama-llama3-rope"][1]["rope_scaling"])
    with pytest.raises(ValueError, match="llama.cpp's gemma3 has no rope_freqs tensor for the model's Llama 3 RoPE"):
        export_gguf(llama3, ByteTokenizer(), tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=r"llama.cpp's gemma2 has no tensor for the model's lm_head.weight \(output"):
        export_gguf(model("gemma2", tie_embeddings=False), ByteTokenizer(), tmp_path / "m.gguf")  # its head is tied
    metaspace = bpe(pre_tokenizers.Metaspace())
    with pytest.raises(ValueError, match="pre-tokenizer .*Metaspace.* none of llama.cpp's"):
        gguf_write.write(model("llama", vocab_size=metaspace.vocab_size), metaspace, tmp_path / "m.gguf")
    with pytest.raises(ValueError, match="unknown GGUF tensor type 'q4_0'"):
        gguf_write.write(model("llama"), ByteTokenizer(), tmp_path / "m.gguf", type="q4_0")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A byte-tokenizer run of a Llama block, one checkpoint of a scrambled model."""
    folder = tmp_path_factory.mktemp("run") / "run"
    gpt = model("llama")
    folder.mkdir()
    checkpoint.save(folder, 1, gpt, torch.optim.AdamW(gpt.parameters()), keep=1,
                    meta={"model": dataclasses.asdict(gpt.config), "tokenizer": ByteTokenizer().spec(), "step": 1})
    return folder


def test_the_command_writes_a_run_that_llama_cpp_continues_as_selfattn_sample_does(run, tmp_path):
    file = tmp_path / "run.gguf"
    code, printed, err = command("export", "--ckpt", str(run), "--out", str(file))
    assert code == 0, err
    assert "llama.cpp's llama (llama)" in printed and "30 F32 tensors" in printed and "perplexity" not in printed
    assert "max |difference| 0.0e+00" in printed and "no end-of-text token declared" in printed
    code, sampled, _ = command("sample", "--ckpt", str(run), "--prompt", PROMPT, "--temperature", "0",
                               "--max-new-tokens", str(TOKENS))
    assert code == 0
    continuation = sampled.removesuffix("\n").removeprefix(PROMPT)  # random bytes: U+FFFD where not UTF-8
    assert len(continuation) > 10 and lossy(complete(file, PROMPT).decode("utf-8", "replace")) == lossy(continuation)


def lossy(text: str) -> str:
    """``text`` without NULs (llama-completion does not print them), a run of U+FFFD as one (the bytes between
    which a NUL is missing are replaced otherwise)."""
    return re.sub("\ufffd+", "\ufffd", text.replace("\0", ""))


def test_a_quantised_file_states_its_perplexity_cost(run, tmp_path):
    (tmp_path / "text.txt").write_text("The cat sat on the mat. " * 40)
    code, printed, err = command("export", "--ckpt", str(run), "--out", str(tmp_path / "q.gguf"), "--type", "q8_0",
                                 "--ppl-data", str(tmp_path / "text.txt"))
    assert code == 0, err
    line = next(line for line in printed.splitlines() if "perplexity on" in line)
    assert "perplexity on 512 tokens of" in line and "the source:" in line and "%)" in line, line
    assert "Q8_0" in printed


@pytest.mark.parametrize("out, args, words", [
    ("dir", ["--type", "f16"], "--type is for a GGUF file"),
    ("m.gguf", ["--ppl-data", "x.txt"], "--ppl-data measures what a --type other than f32 costs"),
    ("m.gguf", ["--adapter"], "--adapter writes a peft folder"),
    ("folder.gguf", [], "is a folder; name the GGUF file"),
    ("old.gguf", [], "exists; pass --force"),
])
def test_what_the_command_refuses_is_one_line_and_leaves_the_file(run, tmp_path, out, args, words):
    target = tmp_path / out
    if out == "folder.gguf":
        target.mkdir()
    if out == "old.gguf":
        target.write_bytes(b"old")
    code, _, err = command("export", "--ckpt", str(run), "--out", str(target), *args)
    assert code == 2 and err.count("\n") == 1 and words in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ([out] if out in ("folder.gguf", "old.gguf") else [])
    assert out != "old.gguf" or target.read_bytes() == b"old"


@pytest.mark.slow
def test_smollm2_exported_continues_in_llama_cpp_as_the_source_does_here(tmp_path):
    source = load(smollm2())
    special = Special(source.bos, source.eos, source.chat.source)
    done = export_gguf(source.model, source.tokenizer, tmp_path / "smol.gguf", special=special, source=source.source)
    assert done.written.tokenizer == "gpt2 (pre smollm)" and done.logits_error == 0.0
    fields = gguf.GGUFReader(done.path).fields
    assert fields["tokenizer.chat_template"].contents() == source.chat.source
    prompt = "The capital of France is"
    expected = source.tokenizer.decode(ours(source.model, source.tokenizer, prompt, 16))
    assert "Paris" in expected
    assert complete(done.path, prompt, 16, 256).decode() == expected
