"""The ``llama`` (SentencePiece) tokenizer of GGUF files gives llama.cpp's ids, id for id: on Gemma 3's
file (262,144 tokens, user-defined runs of spaces and newlines, byte fallback), and on a small
vocabulary written here whose ids show each rule (score order, leftmost ties, only token pairs merge,
byte fallback, special tokens cut out first and the longest first, the space put first). llama.cpp's
``llama-tokenize`` is the oracle; its pieces check ``token_bytes``; a tokenizer built as
``transformers`` builds one from the same scores gives other ids (the negative control). ``to_bpe``, the form a
``tokenizer.json`` holds, gives our ids on Gemma 3's vocabulary and refuses one it cannot follow."""
import json
from pathlib import Path

import gguf
import pytest
import tokenizers
from tokenizers import normalizers

from selfattn.formats.gguf import Metadata, _reader
from selfattn.generation.text import text_pieces
from selfattn.tokenizers import from_spec
from selfattn.tokenizers.gguf import from_metadata
from selfattn.tokenizers.sentencepiece import BYTE, CONTROL, NORMAL, UNKNOWN, USER_DEFINED, SentencePieceTokenizer

from helpers.gemma3 import gemma3
from helpers.llama_cpp import tokenize

TEXTS = ["The capital of France is", " leading space", "trailing space ", "a  b   c    d", "     ", "\n",
         "one\ntwo\n\n\nthree\n\n", "digits 2024, 3.14159 and 1234567890 - 007",
         "Wait... what?! (yes) [no] {maybe}; a-b_c/d\\e 'q' \"qq\" @#$%^&*~`",
         'def f(x):\n    if x:\n        return {"a": [1, 2]}\n\treturn None  # done\n',
         "emoji 🎉🚀👩‍💻 and ünïcödé, 中文, русский, العربية, हिन्दी, 日本語",
         "rare 𓀀 and 𠀋!",  # characters Gemma's vocabulary lacks: their bytes
         "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n", "<bos>text<eos><start_of_turn",
         "<table><tr><td>x</td></tr></table> <s>old</s>", "literal <0x41> and [multimodal]",
         "\t\tindented\r\nwindows\r\n", "x" * 50 + " " + "ab" * 30]
CUT = "<unused99>"  # a control token between the texts: each piece between two is tokenized alone


@pytest.fixture(scope="module")
def ours():
    return from_metadata(Metadata(_reader(gemma3()), gemma3()))


@pytest.fixture(scope="module")
def llama_ids(tmp_path_factory):
    """llama.cpp's ids of the texts joined by CUT, bos first: one run of llama-tokenize for them all."""
    return tokenize(gemma3(), CUT.join(TEXTS), tmp_path_factory.mktemp("prompt"))


def by_text(ids: list[int], cut: int) -> list[list[int]]:
    """The ids between the CUT tokens, the bos taken off: one list per text."""
    texts = [[]]
    for i in ids[1:]:
        texts[-1:] = [texts[-1], []] if i == cut else [texts[-1] + [i]]
    return texts


def test_gemma3_gives_llama_cpps_ids_and_its_text_back(ours, llama_ids):
    assert isinstance(ours, SentencePieceTokenizer) and ours.vocab_size == 262144
    ids = ours.encode(CUT.join(TEXTS), special=True)
    for text, theirs, mine in zip(TEXTS, by_text(llama_ids, ours.token_id(CUT)), by_text(ids, ours.token_id(CUT))):
        assert mine == theirs == ours.encode(text), text
    assert ids == llama_ids and ids[0] == ours.bos == 2
    assert ours.encode("The capital of France is", special=True) == [2, 818, 5279, 529, 7001, 563]  # bos + 5
    for text in TEXTS:
        assert ours.decode(ours.encode(text)) == text
        assert "".join(text_pieces(ours, ours.encode(text))) == text  # token by token, characters split or not
    kinds = {text: [ours.types[i] for i in ours.encode(text)] for text in TEXTS}
    assert kinds["rare 𓀀 and 𠀋!"].count(BYTE) == 8 and USER_DEFINED in kinds["a  b   c    d"]
    assert kinds[TEXTS[12]].count(CONTROL) == 3 and len(ours.encode("<end_of_turn>")) == 1


def test_gemma3_token_bytes_are_llama_cpps_pieces(ours, tmp_path):
    text = CUT.join(TEXTS)
    listed = b"".join(b"%6d -> '%s'\n" % (i, ours.token_bytes(i)) for i in ours.encode(text, special=True))
    assert tokenize(gemma3(), text, tmp_path, pieces=True) == listed  # bos, control, user-defined, byte, normal


def test_gemma3_empty_text_and_no_bos(ours, tmp_path):
    assert tokenize(gemma3(), "", tmp_path) == ours.encode("", special=True) == [2]
    assert tokenize(gemma3(), "", tmp_path, bos=False) == ours.encode("") == []
    assert tokenize(gemma3(), TEXTS[6], tmp_path, bos=False) == ours.encode(TEXTS[6]) != []


def test_gemma3_with_user_defined_tokens_as_normal_ones_the_ids_differ(ours, llama_ids):  # negative control
    normal = [NORMAL if kind == USER_DEFINED else kind for kind in ours.types]
    wrong = SentencePieceTokenizer(ours.tokens, ours.scores, normal, bos=ours.bos, add_space_prefix=False)
    assert wrong.encode(CUT.join(TEXTS), special=True) != llama_ids


# a vocabulary whose ids show the rules: (text, type, score)
SMALL = [("<unk>", UNKNOWN, 0.0), ("<s>", CONTROL, 0.0), ("</s>", CONTROL, 0.0),
         *[(f"<0x{b:02X}>", BYTE, 0.0) for b in range(256)], *[(c, NORMAL, -100.0) for c in "▁abcdmnopqrtxyz"],
         ("ab", NORMAL, -1.0), ("bc", NORMAL, -2.0),  # abc: ab c (the higher score)
         ("yz", NORMAL, -1.0), ("xy", NORMAL, -2.0),  # xyz: x yz
         ("aa", NORMAL, -3.0), ("qr", NORMAL, -4.0), ("pq", NORMAL, -4.0),  # aaa: aa a; pqr: pq r (the leftmost)
         ("cd", NORMAL, -5.0), ("abcd", NORMAL, -6.0),  # abcd: ab cd, then abcd
         ("mno", NORMAL, -7.0),  # mno: m n o (neither mn nor no is a token)
         ("▁a", NORMAL, -8.0),
         ("uvw", USER_DEFINED, 0.0), ("tu", USER_DEFINED, 0.0), ("\n", USER_DEFINED, 0.0)]  # tuvw: t uvw
RULES = {  # text -> pieces without and with the space put first
    "abc": ("ab c", "▁ ab c"), "xyz": ("x yz", "▁ x yz"), "aaa": ("aa a", "▁ aa a"), "pqr": ("pq r", "▁ pq r"),
    "abcd": ("abcd", "▁ abcd"), "mno": ("m n o", "▁ m n o"), "é": ("<0xC3> <0xA9>", "▁ <0xC3> <0xA9>"),
    "tuvw": ("t uvw", "▁ t uvw"), "a\nb": ("a \n b", "▁a \n ▁ b"), "  a": ("▁ ▁a", "▁ ▁ ▁a"),
    "<s>a</s> a": ("<s> a </s> ▁a", "<s> ▁a </s> ▁ ▁a"), "<unk>": ("<unk>", "<unk>"), "": ("", ""),
}


def small(prefix: bool) -> SentencePieceTokenizer:
    tokens, types, scores = zip(*SMALL)
    return SentencePieceTokenizer(list(tokens), list(scores), list(types), bos=1, add_space_prefix=prefix)


def write(path: Path, tok: SentencePieceTokenizer) -> Path:
    """A GGUF file of ``tok``'s vocabulary alone, as llama-tokenize reads one (bos 1, eos 2)."""
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, 1), (w.add_context_length, 16), (w.add_embedding_length, 8),
                       (w.add_feed_forward_length, 16), (w.add_head_count, 1), (w.add_head_count_kv, 1),
                       (w.add_layer_norm_rms_eps, 1e-5), (w.add_vocab_size, tok.vocab_size),
                       (w.add_tokenizer_model, "llama"), (w.add_token_list, tok.tokens), (w.add_token_types, tok.types),
                       (w.add_token_scores, tok.scores), (w.add_bos_token_id, 1), (w.add_eos_token_id, 2),
                       (w.add_unk_token_id, 0), (w.add_add_space_prefix, tok.add_space_prefix)):
        add(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    return path


@pytest.mark.parametrize("prefix", [False, True], ids=["no-space-prefix", "space-prefix"])
def test_a_small_vocabulary_follows_each_rule_as_llama_cpp_does(prefix, tmp_path):
    tok = small(prefix)
    path = write(tmp_path / "small.gguf", tok)
    for text, pieces in RULES.items():
        ids = tok.encode(text)
        assert " ".join(tok.piece(i) for i in ids) == pieces[prefix], text
        assert tokenize(path, text, tmp_path) == tok.encode(text, special=True) == [1, *ids], text
    for text in ("abc", "  a", "é pqr", ""):  # no special token in them: the text comes back
        assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(" x", special=True)) == "<s>" + " " * prefix + " x"  # only a first piece's space goes


def test_a_tokenizer_built_as_transformers_builds_one_gives_other_ids(tmp_path):  # negative control
    tok = small(False)
    rank = dict(zip(tok.tokens, tok.scores))  # merges: every split into two tokens, by the token's score
    merges = sorted(((t[:i], t[i:], s) for t, s in rank.items() for i in range(1, len(t))
                     if t[:i] in rank and t[i:] in rank), key=lambda m: -m[2])
    theirs = tokenizers.Tokenizer(tokenizers.models.BPE(dict(zip(tok.tokens, range(tok.vocab_size))),
                                                        [m[:2] for m in merges], byte_fallback=True))
    theirs.normalizer = normalizers.Replace(" ", "▁")
    theirs.add_special_tokens([t for t, kind in zip(tok.tokens, tok.types) if kind == CONTROL])
    path = write(tmp_path / "small.gguf", tok)
    assert theirs.encode("abc xyz").ids == tok.encode("abc xyz") == tokenize(path, "abc xyz", tmp_path, bos=False)
    for text in ("pqr", "tuvw"):  # equal scores (pq, qr); user-defined tokens cut out first
        assert theirs.encode(text).ids != tok.encode(text) == tokenize(path, text, tmp_path, bos=False)


def test_gemma3_as_a_bpe_gives_the_same_ids_and_text(ours):
    bpe = ours.to_bpe()
    text = CUT.join(TEXTS)
    assert bpe.encode(text, special=True) == ours.encode(text, special=True)
    assert bpe.tok.decode(ours.encode(text), skip_special_tokens=False) == ours.decode(ours.encode(text))


def without(*texts: str) -> list:
    """:data:`SMALL` less the tokens ``texts``."""
    return [token for token in SMALL if token[0] not in texts]


@pytest.mark.parametrize("prefix", [False, True], ids=["no-space-prefix", "space-prefix"])
def test_a_small_vocabulary_as_a_bpe_follows_each_rule(prefix):
    tokens, types, scores = zip(*without("qr", "tu"))  # no tie of scores, no overlapping special tokens
    tok = SentencePieceTokenizer(list(tokens), list(scores), list(types), bos=1, eos=2, add_space_prefix=prefix)
    bpe = tok.to_bpe()
    for text in [*RULES, "pqr", "abcd abc\naaa<s>xyz", "é  mno"]:
        assert bpe.encode(text) == tok.encode(text), text
        assert bpe.encode(text, special=True) == tok.encode(text, special=True), text
        assert bpe.tok.decode(tok.encode(text), skip_special_tokens=False) == tok.decode(tok.encode(text)), text


def test_a_vocabulary_a_bpe_cannot_follow_is_refused():
    with pytest.raises(ValueError, match=r"the tokens 'pq' and 'qr' share the score -4\.0 and meet at 'q'"):
        small(False).to_bpe()
    tokens, types, scores = zip(*without("qr"))  # "tu" and "uvw" overlap: "tuvw" is cut t uvw, not tu vw
    with pytest.raises(ValueError, match="special tokens overlap"):
        SentencePieceTokenizer(list(tokens), list(scores), list(types)).to_bpe()


def test_the_spec_gives_the_same_tokenizer_back():
    tok = small(True)
    back = from_spec(json.loads(json.dumps(tok.spec())))
    assert isinstance(back, SentencePieceTokenizer) and back.spec() == tok.spec()
    assert [back.encode(t, special=True) for t in RULES] == [tok.encode(t, special=True) for t in RULES]


def test_bad_vocabularies_are_refused_naming_where_and_what():
    tokens, types, scores = (list(column) for column in zip(*SMALL))
    with pytest.raises(ValueError, match=r"^here: 288 tokens but 287 scores and 288 token types$"):
        SentencePieceTokenizer(tokens, scores[1:], types, where="here")
    with pytest.raises(ValueError, match=r"^here: token 3 '<0x0G>' is a byte token \(type 6\) but not <0xNN>$"):
        SentencePieceTokenizer([*tokens[:3], "<0x0G>", *tokens[4:]], scores, types, where="here")
    with pytest.raises(ValueError, match=r"^here: the bos token 288 is outside the 288 tokens$"):
        SentencePieceTokenizer(tokens, scores, types, bos=288, where="here")
    with pytest.raises(ValueError, match=r"^the tokenizer spec: a sentencepiece tokenizer needs"):
        from_spec({"kind": "sentencepiece", "tokens": tokens})
    no_bytes = SentencePieceTokenizer(tokens[:3] + tokens[259:], scores[:3] + scores[259:], types[:3] + types[259:],
                                      add_space_prefix=False, where="here")
    assert no_bytes.encode("ab") == [no_bytes.token_id("ab")]  # control: what the vocabulary has encodes
    with pytest.raises(ValueError, match=r"^here: the vocabulary has no token for 'é' nor for its byte 0xC3"):
        no_bytes.encode("é")
