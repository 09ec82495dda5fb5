"""Every family of the table that llama.cpp has an architecture for loads from the GGUF file that llama.cpp's
own converter (``convert_hf_to_gguf.py``, from the source ``make llama-cpp`` unpacks) writes of the random
``transformers`` folder its parity case builds (:mod:`helpers.families`), and computes what the folder computes:
float32 logits over 80 tokens within 1e-4 of the folder's as this library loads it, and as close to
``transformers``' exact (float64) logits as ``transformers``' own float32 ones are, within twice (Gemma's, in
float32, are 1e-4 off their float64 ones in ``transformers`` too). Leaving out one of the fixes the reading
undoes (a row order, a norm offset, the RoPE factors, the halves of a split tensor) changes the logits.

Where llama.cpp cannot represent an option of a parity case (the family's docstring says which and why), the
case here is the nearest one it can: no sliding window for Mistral, Qwen2, Qwen3 and Phi-3 (those architectures
read none, or turn it off); Qwen3 without biases (llama.cpp's qwen3 has no ``o_proj`` bias); Gemma 2's head as
wide as its ``query_pre_attn_scalar`` (llama.cpp scales scores by the head size); Gemma 3 with six layers in its
fixed five-of-six sliding pattern (the converter writes no ``layer_types``); gpt-oss's YaRN with the ends of its
ramp rounded, as llama.cpp rounds them.

The converter reads the folder's tokenizer: a SentencePiece model trained here (``tokenizer.model``), or, for the
families whose converter reads only a byte-level BPE it recognises by how it splits a test text (OLMo 2, BLOOM,
gpt-oss), GPT-2's, made of the vocabulary llama.cpp ships (``models/ggml-vocab-gpt-2.gguf``), the models'
vocabulary as large as it. Two processes convert half of the folders each.
"""
import dataclasses
import io
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from selfattn.families import FAMILIES, bloom, gemma, gpt_oss, llama
from selfattn.formats import gguf as formats_gguf
from selfattn.io import loading

from helpers import families, gguf_files, llama_cpp
from helpers.families import T, build, tokens

GPT2 = "models/ggml-vocab-gpt-2.gguf"  # in llama.cpp's source
# parity case -> (llama.cpp's architecture its converter writes, what the case changes so llama.cpp can represent it,
# the tokenizer the converter reads: "sentencepiece" or "gpt2")
CASES = {
    "llama-llama3-rope": ("llama", {}, "sentencepiece"),
    "mistral": ("llama", dict(sliding_window=None), "sentencepiece"),
    "qwen2-some-layers-slide": ("qwen2", dict(use_sliding_window=False), "sentencepiece"),
    "qwen3": ("qwen3", dict(use_sliding_window=False, layer_types=None, attention_bias=False), "sentencepiece"),
    "gemma2": ("gemma2", dict(head_dim=24), "sentencepiece"),  # = its query_pre_attn_scalar
    "gemma3": ("gemma3", dict(num_hidden_layers=6, layer_types=None), "sentencepiece"),
    "phi3": ("phi3", dict(sliding_window=None), "sentencepiece"),
    "olmo2": ("olmo2", {}, "gpt2"),
    "bloom": ("bloom", {}, "gpt2"),
    "gpt-oss": ("gpt-oss", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                 "beta_fast": 32.0, "beta_slow": 1.0,
                                                 "original_max_position_embeddings": 4096}), "gpt2"),
}


def _sentencepiece() -> dict[str, bytes]:
    """A small SentencePiece BPE (``tokenizer.model``), a newline among its pieces (which a model without a
    bos token starts from)."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(gguf_files.TEXT.splitlines()), model_writer=model,
                                             vocab_size=60, model_type="bpe", user_defined_symbols=["\n"],
                                             minloglevel=2, num_threads=1)
    return {"tokenizer.model": model.getvalue()}


def _gpt2() -> tuple[dict[str, bytes], int]:
    """GPT-2's tokenizer as a folder holds it (``tokenizer.json``, ``tokenizer_config.json``), made of the
    vocabulary and merges llama.cpp ships, and its number of tokens."""
    import gguf
    import tokenizers

    fields = gguf.GGUFReader(llama_cpp.source(GPT2)).fields
    vocab = fields["tokenizer.ggml.tokens"].contents()
    merges = [tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"].contents()]
    tok = tokenizers.Tokenizer(tokenizers.models.BPE({t: i for i, t in enumerate(vocab)}, merges))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.add_special_tokens([tokenizers.AddedToken("<|endoftext|>", special=True)])
    config = {"tokenizer_class": "GPT2Tokenizer", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
    return {"tokenizer.json": tok.to_str().encode(), "tokenizer_config.json": json.dumps(config).encode()}, len(vocab)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """case -> (the keywords its models are built with, its folder, the GGUF file llama.cpp's converter wrote of
    it, the end of the converter's log)."""
    llama_cpp.source("convert_hf_to_gguf.py")  # fails first, saying how to get it, when it is absent
    root = tmp_path_factory.mktemp("converted")
    (gpt2, n_gpt2), spm = _gpt2(), _sentencepiece()
    built = {}
    for case, (_, change, tokenizer) in CASES.items():
        built[case] = {**change, **({"vocab_size": n_gpt2} if tokenizer == "gpt2" else {})}
        build(case, **built[case]).save_pretrained(root / case)
        for name, data in (gpt2 if tokenizer == "gpt2" else spm).items():
            (root / case / name).write_bytes(data)
    halves = [list(CASES)[0::2], list(CASES)[1::2]]
    with ThreadPoolExecutor(2) as pool:  # two processes, each converting half of the folders
        logs = list(pool.map(llama_cpp.convert, [[(root / c, root / f"{c}.gguf") for c in half] for half in halves]))
    return {case: (built[case], root / case, root / f"{case}.gguf", log) for half, log in zip(halves, logs)
            for case in half}


def logits(model) -> torch.Tensor:
    """``model``'s logits (ours or ``transformers``') over 2 x T tokens, in float64."""
    with torch.no_grad():
        out = model(tokens(2, T, 1))
    return (out.logits if hasattr(out, "logits") else out[0]).double()


@pytest.mark.parametrize("case", list(CASES))
def test_the_file_llama_cpps_converter_writes_computes_what_the_folder_does(converted, case):
    built, folder, path, log = converted[case]
    assert path.is_file(), log
    assert formats_gguf.read(path).metadata.value("general.architecture", str) == CASES[case][0]
    got, folder_logits = logits(loading.load(path).model.eval()), logits(loading.load(folder).model.eval())
    theirs, exact = logits(build(case, **built)), logits(build(case, torch.float64, **built))
    diff, rule = (got - folder_logits).abs().amax().item(), (got - exact).abs().amax().item()
    bound = 2 * (theirs - exact).abs().amax().item() + 1e-5
    print(f"{case} ({CASES[case][0]}): max |logit difference| to the folder loaded here {diff:.1e}, to transformers' "
          f"{(got - theirs).abs().amax().item():.1e} (float32), {rule:.1e} to its float64 (at most {bound:.1e})")
    assert exact.abs().amax() > 1 and diff < 1e-4 and rule <= bound


def _replaced(family, **change):
    """Set ``family.GGUF`` to its declaration with ``change`` (by the monkeypatch given)."""
    return lambda monkeypatch: monkeypatch.setattr(family, "GGUF", dataclasses.replace(family.GGUF, **change))


def _no_rope_factors(monkeypatch):
    """The RoPE read without its factors tensors."""
    rope = formats_gguf.rope

    def without(value, factors, c, head_dim):
        rope(value, lambda name: None, c, head_dim)

    monkeypatch.setattr(formats_gguf, "rope", without)


CONTROLS = {  # a fix left out -> (the case whose logits it changes, the change)
    "llama's q/k rows as interleaved": ("llama-llama3-rope", _replaced(llama, interleaved=frozenset())),
    "llama 3's rope_freqs ignored": ("llama-llama3-rope", _no_rope_factors),
    "phi-3's longrope factors ignored": ("phi3", _no_rope_factors),
    "gemma's norms with their offset": ("gemma3", _replaced(gemma, norm_offset=0.0)),
    "bloom's q, k, v rows apart": ("bloom", _replaced(bloom, by_head=frozenset())),
    "gpt-oss's gate and up swapped": ("gpt-oss", _replaced(gpt_oss, alternated={
        name: halves[::-1] for name, halves in gpt_oss.GGUF.alternated.items()})),
}


@pytest.mark.parametrize("control", list(CONTROLS))
def test_without_a_fix_the_logits_differ(converted, monkeypatch, control):  # the negative controls
    case, change = CONTROLS[control]
    _, folder, path, log = converted[case]
    assert path.is_file(), log
    change(monkeypatch)
    diff = (logits(loading.load(path).model.eval()) - logits(loading.load(folder).model.eval())).abs().amax().item()
    assert diff > 1e-2, diff


def test_every_family_case_is_converted_and_every_declared_architecture_is_written():
    declared = {arch for family in FAMILIES.values() for arch in family.GGUF.architectures}
    assert set(CASES) == set(families.CASES)
    assert {arch for arch, _, _ in CASES.values()} | {"gpt2"} == declared  # GPT-2's: test_gguf_export_families.py
