"""GGUF files load into the one decoder and compute what transformers computes from them: small
files written as llama.cpp's converter writes them (its q/k row interleaving, every tensor type the
loader dequantises), and one-line refusals naming the file and the field or tensor."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from selfattn import families  # noqa: E402
from selfattn.cli import main  # noqa: E402
from selfattn.formats import gguf as formats_gguf  # noqa: E402
from selfattn.generation import generate  # noqa: E402
from selfattn.generation.text import text_pieces  # noqa: E402
from selfattn.io import loading  # noqa: E402

from helpers import gguf_files  # noqa: E402
from helpers.alive import most_alive  # noqa: E402
from helpers.sentencepiece import TEXTS, sentencepiece  # noqa: E402

transformers.logging.set_verbosity_error()
Q, V = gguf.GGMLQuantizationType, gguf.GGUFValueType
TYPES = {r"token_embd\.weight": Q.Q8_0, r"blk\.0\.attn_[qk].*": Q.Q8_0, r"blk\.0\.attn_v.*": Q.Q4_0,
         r"blk\.0\.attn_output.*": Q.Q4_1, r"blk\.1\.attn_q.*": Q.Q5_0, r"blk\.1\.attn_k.*": Q.Q5_1,
         r"blk\.1\.attn_v.*": Q.BF16, r"blk\.1\.attn_output.*": Q.F16, r"blk\.\d\.ffn_(gate|up).*": Q.Q8_0}
K_QUANTS = {"blk.0.ffn_down.weight": (Q.Q4_K,), "blk.1.ffn_down.weight": (Q.Q6_K,)}  # rows of 256 values


@pytest.fixture(scope="module")
def vocab():
    return len(gguf_files.tokenizer()[0])


@pytest.fixture(scope="module")
def hf(vocab):
    return gguf_files.random_llama(vocab)


def ids(vocab, T=40):
    return torch.randint(0, vocab, (2, T), generator=torch.Generator().manual_seed(1))


def logits(model, idx):
    with torch.no_grad():
        out = model(idx)
    return out.logits if hasattr(out, "logits") else out[0]


def test_a_float32_gguf_computes_what_the_model_it_was_converted_from_computes(hf, vocab, tmp_path):
    ours = loading.load(gguf_files.write(tmp_path / "m.gguf", hf)).model.eval()
    expected = logits(hf, ids(vocab))
    diff = (logits(ours, ids(vocab)) - expected).abs().max().item()
    print(f"F32 GGUF against the transformers model it was written from: max |logit difference| {diff:.1e}")
    assert expected.abs().max() > 1 and diff < 1e-4


def test_without_undoing_the_rope_interleaving_the_logits_differ(hf, vocab, tmp_path, monkeypatch):  # control
    path = gguf_files.write(tmp_path / "m.gguf", hf)
    monkeypatch.setattr(formats_gguf, "_rope_rows", lambda rows, heads, where: np.arange(rows))
    diff = (logits(loading.load(path).model.eval(), ids(vocab)) - logits(hf, ids(vocab))).abs().max().item()
    assert diff > 1e-2, diff


def test_every_quantisation_type_matches_transformers_reading_the_same_file(hf, vocab, tmp_path):
    tensors = {name: gguf_files.random_blocks(64, 256, *kind) for name, kind in K_QUANTS.items()}
    path = gguf_files.write(tmp_path / "q.gguf", hf, types=TYPES, tensors=tensors)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert kinds == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"}
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="q.gguf", dtype=torch.float32).eval()
    ours = loading.load(path).model.eval()
    expected = logits(ref, ids(vocab))
    diff = (logits(ours, ids(vocab)) - expected).abs().max().item()
    print(f"quantised GGUF against transformers reading it: max |logit difference| {diff:.1e}")
    assert expected.abs().max() > 1 and diff < 1e-4
    assert (logits(ours, ids(vocab)) - logits(hf, ids(vocab))).abs().max() > 1e-3  # control: quantisation shows


def test_a_qwen2_gguf_its_biases_and_rows_as_they_are_computes_what_transformers_does(vocab, tmp_path):
    hf = gguf_files.random_llama(vocab, "Qwen2")
    assert hf.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's q/k/v biases travel too
    path = gguf_files.write(tmp_path / "qwen2.gguf", hf, arch="qwen2", types=TYPES)
    loaded = loading.load(path)
    assert loaded.model.config.qkv_bias and formats_gguf.read(path).config["model_type"] == "qwen2"
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="qwen2.gguf", dtype=torch.float32)
    expected = logits(ref.eval(), ids(vocab))
    diff = (logits(loaded.model.eval(), ids(vocab)) - expected).abs().max().item()
    assert expected.abs().max() > 1 and diff < 1e-4, diff


def test_an_untied_head_greedy_decodes_as_transformers(vocab, tmp_path):
    hf = gguf_files.random_llama(vocab, tie_word_embeddings=False)
    loaded = loading.load(gguf_files.write(tmp_path / "m.gguf", hf))
    ours = loaded.model.eval()
    assert not ours.config.tie_embeddings and loaded.model.lm_head.weight is not loaded.model.wte.weight
    idx = ids(vocab, 12)
    theirs = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=16, min_new_tokens=16,
                         do_sample=False, pad_token_id=0)[:, 12:]
    assert torch.equal(torch.stack(list(generate(ours, idx, 16, temperature=0)), 1), theirs)


def test_the_metadata_becomes_the_config_and_the_tokenizer_comes_along(hf, vocab, tmp_path):
    path = gguf_files.write(tmp_path / "m.gguf", hf)
    file = formats_gguf.read(path)
    assert {k: file.config[k] for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                        "num_key_value_heads", "intermediate_size", "max_position_embeddings",
                                        "vocab_size", "tie_word_embeddings")} == \
        dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, max_position_embeddings=128, vocab_size=vocab, tie_word_embeddings=True)
    assert file.config["rms_norm_eps"] == pytest.approx(1e-5) and file.config["rope_theta"] == 10000.0
    loaded = loading.load(path)
    assert (loaded.start_token, loaded.eos) == (vocab - 2, (vocab - 1,))  # bos, eos of the metadata
    assert loaded.tokenizer.encode("<|im_start|>the cat") [0] == vocab - 2
    assert loaded.chat.render([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_loading_reads_one_tensor_at_a_time(hf, tmp_path, monkeypatch):
    file = formats_gguf.read(gguf_files.write(tmp_path / "m.gguf", hf))
    most = most_alive(monkeypatch, formats_gguf.Tensors)
    family = families.FAMILIES["llama"]
    model = loading.GPT(family.config(file.config, "m"))
    families.load(family, file.tensors, model, "m")
    assert most[0] == 1, most
    state = families.state_dict(family, file.tensors, model, "m")  # control: a whole state dict holds them all
    assert most[0] > len(state) // 2, most


def _cut(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:len(data) + keep])
    return path


def _rewrite(where, fmt: str, value):
    """A damage: the bytes at ``where(path)`` rewritten to ``value`` (packed as ``struct``'s ``fmt``)."""
    return lambda path: gguf_files.overwrite(path, where(path), fmt, value)


@pytest.mark.parametrize("damage, words", [
    (lambda p: _cut(p, -100), ["truncated GGUF file", "tensor output_norm.weight needs bytes up to"]),
    (lambda p: _cut(p, 300),
     ["truncated GGUF file (300 bytes): the metadata field llama.attention.head_count_kv needs bytes up to 304"]),
    (lambda p: _cut(p, gguf.GGUFReader(p).tensors[0].field.offset + 9),
     ["truncated or damaged GGUF file", "GGUF.tensor_count is 20, but the 9 bytes from byte",
      "on hold at most 0 tensor descriptions (of 24 bytes or more each)"]),
    (_rewrite(lambda p: gguf_files.field_offset(p, "GGUF.tensor_count"), "Q", 10**12),
     ["truncated or damaged GGUF file", "GGUF.tensor_count is 1000000000000, but the", "tensor descriptions"]),
    (_rewrite(lambda p: gguf_files.field_offset(p, "GGUF.kv_count"), "Q", 10**12),
     ["truncated or damaged GGUF file", "GGUF.kv_count is 1000000000000, but the", "metadata fields"]),
    (_rewrite(lambda p: gguf_files.field_offset(p, "tokenizer.ggml.tokens") + 4, "Q", 10**12),  # its length
     ["the array length of metadata field tokenizer.ggml.tokens is 1000000000000, but the",
      "entries (of 8 bytes or more each)"]),
    (_rewrite(lambda p: gguf_files.tensor_offset(p, "blk.0.attn_q.weight", "type"), "I", Q.F16),  # was Q8_0
     ["tensor blk.0.attn_q.weight (F16, shape (64, 64): 8192 bytes from byte",
      "runs into tensor blk.0.attn_k.weight (from byte", "a type, shape or offset of the file is wrong"]),
    (_rewrite(lambda p: gguf_files.tensor_offset(p, "blk.0.attn_q.weight", "type"), "I", 99),
     ["tensor blk.0.attn_q.weight is of type 99, which is no GGML tensor type"]),
    (_rewrite(lambda p: gguf_files.tensor_offset(p, "blk.0.attn_q.weight", "shape"), "Q", 48),
     ["tensor blk.0.attn_q.weight (Q8_0, shape (64, 48)) has rows of 48 values, not whole blocks of 32"]),
    (lambda p: _cut(p, 2), ["not a GGUF file (it starts with b'GG', not b'GGUF')"]),
    (lambda p: p.write_bytes(b"PK\x03\x04 a zip, not a model") and p,
     ["not a GGUF file (it starts with b'PK\\x03\\x04'"]),
])
def test_a_damaged_or_foreign_file_is_one_line_naming_the_file_and_what_is_cut(hf, tmp_path, capsys, damage, words):
    path = gguf_files.write(tmp_path / "m.gguf", hf, types=TYPES)
    loading.load(path)  # control: undamaged, it loads
    damage(path)
    with pytest.raises(ValueError) as e:
        loading.load(path)
    message = str(e.value)
    assert message.startswith(f"{path}: ") and "\n" not in message and all(w in message for w in words), message
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(path), "--prompt", "the", "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err == f"selfattn sample: error: {message}\n"


def test_a_file_is_gguf_by_its_first_four_bytes_whatever_its_name(hf, tmp_path):
    path = gguf_files.write(tmp_path / "model.bin", hf, types=TYPES)
    assert formats_gguf.is_gguf(path) and loading.load(path).model.config.vocab_size == hf.config.vocab_size
    assert not formats_gguf.is_gguf(tmp_path) and not formats_gguf.is_gguf(tmp_path / "absent.gguf")
    _cut(path, 3)  # negative control: "GGU" is no GGUF file
    assert not formats_gguf.is_gguf(path)


@pytest.mark.parametrize("change, words", [
    (dict(tensors={"blk.1.ffn_norm.weight": np.ones(64, np.int32)}),
     "tensor blk.1.ffn_norm.weight is of type I32, which gguf cannot dequantise (it reads F32, F16, Q4_0"),
    (dict(arch="falcon"), "general.architecture 'falcon' is not supported; this version reads llama, qwen2, qwen3, "
     "gemma2, gemma3, phi3, olmo2, bloom, gpt-oss, gpt2 GGUF files"),
    (dict(metadata={"llama.rope.dimension_count": (8, V.UINT32)}),
     "llama.rope.dimension_count is 8, not the head size 16: RoPE on part of each head is not supported"),
    (dict(metadata={"llama.rope.scaling.type": ("dynamic", V.STRING)}),
     "llama.rope.scaling.type 'dynamic' is not supported"),
    (dict(metadata={"llama.attention.head_count": ("four", V.STRING)}),
     "metadata field llama.attention.head_count is 'four', expected a int"),
    *[(dict(metadata={f"llama.{field}": (0, V.UINT32)}), f"metadata field llama.{field} is 0, expected at least 1")
      for field in ("attention.head_count", "attention.head_count_kv", "embedding_length", "block_count")],
    (dict(metadata={"llama.embedding_length": (576, V.UINT32), "llama.attention.head_count": (7, V.UINT32)}),
     "llama.embedding_length 576 is not divisible by llama.attention.head_count 7 (and there is no "
     "llama.attention.key_length to give the head size)"),
])
def test_what_the_loader_does_not_read_is_refused_naming_file_and_field(hf, tmp_path, change, words):
    path = gguf_files.write(tmp_path / "m.gguf", hf, **change)
    with pytest.raises(ValueError) as e:
        loading.load(path)
    assert str(e.value).startswith(f"{path}: ") and words in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_a_missing_config_field_is_named(hf, tmp_path, monkeypatch):
    path = gguf_files.write(tmp_path / "m.gguf", hf)
    fields = formats_gguf.Metadata.__init__

    def without(self, reader, where):
        fields(self, reader, where)
        self._fields = {k: v for k, v in self._fields.items() if k != "llama.feed_forward_length"}

    monkeypatch.setattr(formats_gguf.Metadata, "__init__", without)
    with pytest.raises(ValueError, match=r"^.*m\.gguf: the GGUF metadata has no field llama\.feed_forward_length$"):
        loading.load(path)


@pytest.mark.parametrize("change, words", [
    (dict(tensors={"blk.0.attn_k.weight": np.zeros((16, 64), np.float32)}),
     "of another shape 1 tensor: model.layers.0.self_attn.q_proj.weight + model.layers.0.self_attn.k_proj.weight + "
     "model.layers.0.self_attn.v_proj.weight (64, 64) + (16, 64) + (32, 64) instead of (128, 64)"),
    (dict(drop=("blk.1.ffn_up.weight",)), "missing 1 tensor: model.layers.1.mlp.up_proj.weight"),
    (dict(tensors={"blk.0.attn_rope.weight": np.zeros(4, np.float32)}), "unexpected 1 tensor: blk.0.attn_rope.weight"),
])
def test_tensors_that_do_not_fit_are_refused_naming_them(hf, tmp_path, change, words):
    path = gguf_files.write(tmp_path / "m.gguf", hf, **change)
    with pytest.raises(ValueError) as e:
        loading.load(path)
    assert str(e.value).startswith(f"the weights in {path} are not those") and words in str(e.value), str(e.value)


def test_a_tokenizer_of_another_kind_loads_the_model_and_text_commands_say_why_not(hf, tmp_path, capsys):
    path = gguf_files.write(tmp_path / "m.gguf", hf, metadata={"tokenizer.ggml.model": ("bert", V.STRING)})
    loaded = loading.load(path)
    assert loaded.tokenizer is None and loaded.chat is None
    capsys.readouterr()
    assert main(["sample", "--ckpt", str(path), "--prompt", "the", "--max-new-tokens", "2"]) == 2
    assert capsys.readouterr().err == (
        f"selfattn sample: error: {path} has no tokenizer selfattn can read (tokenizer.ggml.model 'bert' is not "
        f"supported; this version reads gpt2 (byte-level BPE) and llama (SentencePiece) tokenizers), so this model "
        f"cannot encode or decode text\n")
    assert main(["check", "--ckpt", str(path)]) == 0  # what needs no text still runs


def test_a_sentencepiece_tokenizer_gives_the_ids_transformers_makes_of_its_scores(tmp_path):
    tok = sentencepiece("legacy")
    tokens = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]
    kinds = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x") else 1 for t in tokens]
    scores = [-float(i) for i in range(len(tokens))]  # earlier tokens, earlier merges
    path = gguf_files.write(tmp_path / "sp.gguf", gguf_files.random_llama(len(tokens)),
                            sentencepiece=(tokens, scores, kinds))
    ours = loading.load(path).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="sp.gguf")
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False), text
        assert "".join(text_pieces(ours, ids)).removeprefix(" ") == text
    assert len(ours.encode(TEXTS[0])) < len(TEXTS[0]) / 2  # merged, not spelt out


def test_a_gguf_file_is_known_by_its_first_bytes_whatever_its_name(hf, vocab, tmp_path):
    path = gguf_files.write(tmp_path / "m.gguf", hf)
    renamed = path.rename(tmp_path / "weights.bin")  # a name the loader would otherwise read as torch.save's
    assert torch.equal(logits(loading.load(renamed).model.eval(), ids(vocab)), logits(loading.load(
        gguf_files.write(tmp_path / "again.gguf", hf)).model.eval(), ids(vocab)))


@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_a_non_finite_quantisation_scale_is_refused_at_load_naming_the_tensor(hf, tmp_path, scale):
    path = gguf_files.write(tmp_path / "m.gguf", hf, types=TYPES)
    assert loading.load(path).model is not None  # control: the undamaged file loads
    embedding = next(t for t in gguf.GGUFReader(path).tensors if t.name == "token_embd.weight")  # Q8_0 blocks
    gguf_files.overwrite(path, int(embedding.data_offset), "e", scale)  # the first block's float16 scale
    with pytest.raises(ValueError, match=r"NaN or infinite values? in wte\.weight .*; the file is damaged"):
        loading.load(path)
