"""Tokenizers, the built-in corpus, the memory-mapped token cache, batches and bad-data errors."""
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from selfattn import tokenizers as toks
from selfattn.training import data

TEXTS = ["", "hello", "héllo wörld", "日本語のテキスト", "emoji 🎉🧪 and ZWJ 👩‍👩‍👧", "e\u0301 combining",
         "tabs\tand\r\nCRLF", "\x00 NUL is text too", "Ελληνικά, русский, עברית, العربية"]


def _random_texts(n=50, seed=0):
    rng = random.Random(seed)
    ranges = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x3FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F6FF), (0, 0x10FFFF)]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(ranges)
            c = rng.randint(lo, hi)
            chars.append(chr(c if not 0xD800 <= c <= 0xDFFF else 0x41))  # surrogates are not text
        out.append("".join(chars))
    return out


def test_byte_tokenizer_round_trips_any_text():
    tok = toks.ByteTokenizer()
    for text in TEXTS + _random_texts():
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8")
    with pytest.raises(ValueError, match="256"):
        tok.token_bytes(256)


@pytest.fixture(scope="module")
def bpe():
    text, _ = data.read_corpus(None)
    return toks.BPETokenizer.train(text[:60_000], vocab_size=400)


def test_bpe_round_trips_any_text_and_compresses(bpe):
    assert bpe.vocab_size == 400
    for text in TEXTS + _random_texts():
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
        assert b"".join(bpe.token_bytes(i) for i in ids) == text.encode("utf-8")  # what sample streams
    english = "The return value of the function is the object itself."
    assert len(bpe.encode(english)) < len(english.encode()) / 2  # merges were learned
    again = toks.from_spec(bpe.spec())
    assert again.encode(english) == bpe.encode(english)


def test_bpe_vocab_size_is_checked():
    with pytest.raises(ValueError, match=r"vocab_size must be an int > 256 \(the bytes plus merges\), got 100"):
        toks.BPETokenizer.train("some text", vocab_size=100)


def test_byte_alphabet_matches_tokenizers_bytelevel():
    import tokenizers

    table = toks.bpe.bytes_to_unicode()
    assert sorted(table) == list(range(256))
    assert len(set(table.values())) == 256  # a bijection
    assert set(table.values()) == set(tokenizers.pre_tokenizers.ByteLevel.alphabet())


def test_builtin_corpus_is_pythons_own_documentation():
    import pydoc_data.topics

    text, description = data.read_corpus(None)
    assert len(text) > 400_000 and "pydoc_data" in description
    assert pydoc_data.topics.topics["assert"] in text


def test_folder_corpus_skips_hidden_files(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("third")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / ".hidden").write_bytes(b"\x00\x01binary")
    text, description = data.read_corpus(tmp_path)
    assert text == "first\n\nsecond\n\nthird" and "3 files" in description


def test_prepare_splits_caches_and_memory_maps(tmp_path):
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text("abcdefghij" * 100 + "é")  # 1002 bytes
    kw = dict(data=str(corpus_file), tokenizer="byte", bpe_vocab=300, val_fraction=0.1, block_size=16)
    c = data.prepare(tmp_path / "tokens", **kw)
    raw = torch.tensor(list(corpus_file.read_bytes()))
    assert len(c.val) == 100 and len(c.train) == 902
    assert torch.equal(torch.cat([c.train, c.val]).long(), raw)  # val is the tail, nothing lost
    if Path("/proc/self/maps").exists():
        assert str(tmp_path / "tokens" / "train.bin") in Path("/proc/self/maps").read_text()  # mapped, not read
    stamp = (tmp_path / "tokens" / "train.bin").stat().st_mtime_ns
    c2 = data.prepare(tmp_path / "tokens", **kw)
    assert (tmp_path / "tokens" / "train.bin").stat().st_mtime_ns == stamp and c2.fingerprint == c.fingerprint
    c3 = data.prepare(tmp_path / "tokens", **{**kw, "val_fraction": 0.2})  # another recipe: rebuilt
    assert len(c3.val) == 200


def test_prepare_bpe_stores_16_bit_ids(tmp_path):
    text, _ = data.read_corpus(None)
    (tmp_path / "c.txt").write_text(text[:30_000])
    c = data.prepare(tmp_path / "tokens", data=str(tmp_path / "c.txt"), tokenizer="bpe", bpe_vocab=300,
                     val_fraction=0.1, block_size=16)
    assert c.train.dtype == torch.uint16 and c.tokenizer.vocab_size == 300
    assert c.tokenizer.decode(torch.cat([c.train, c.val]).tolist()) == text[:30_000]


def test_batch_depends_only_on_seed_and_step_and_parts_tile_the_batch():
    split = torch.arange(1000, dtype=torch.int32)
    x, y = data.batch(split, seed=3, step=7, batch_size=8, block_size=5)
    assert x.shape == y.shape == (8, 5) and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)  # next-token targets
    data.batch(split, seed=3, step=6, batch_size=8, block_size=5)  # other calls do not shift the stream
    assert torch.equal(data.batch(split, seed=3, step=7, batch_size=8, block_size=5)[0], x)
    assert not torch.equal(data.batch(split, seed=3, step=8, batch_size=8, block_size=5)[0], x)
    assert not torch.equal(data.batch(split, seed=4, step=7, batch_size=8, block_size=5)[0], x)
    parts = [data.batch(split, seed=3, step=7, batch_size=8, block_size=5, part=i, parts=4)[0] for i in range(4)]
    assert torch.equal(torch.cat(parts), x)  # ranks x micro-steps read exactly the single-process batch
    with pytest.raises(ValueError, match="part 0 of 3"):
        data.batch(split, seed=3, step=7, batch_size=8, block_size=5, part=0, parts=3)


def _write_bad(tmp_path, kind):
    path = tmp_path / f"{kind}.txt"
    if kind == "empty":
        path.write_text("")
    elif kind == "binary":
        path.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))
    elif kind == "latin1":
        path.write_bytes("café".encode("latin-1"))
    elif kind == "short":
        path.write_text("too short for one block")
    elif kind == "empty_folder":
        path = tmp_path / "nothing_here"
        path.mkdir()
    return path


@pytest.mark.slow  # make check leaves it out: a fresh interpreter each
@pytest.mark.parametrize("kind, message", [("missing", "does not exist"), ("binary", "looks binary")])
def test_bad_data_is_one_line_and_exit_2_in_a_subprocess(tmp_path, kind, message):
    path = tmp_path / "missing.txt" if kind == "missing" else _write_bad(tmp_path, kind)
    r = subprocess.run([sys.executable, "-m", "selfattn", "train", "--data", str(path), "--out", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("selfattn train: error: ") and message in lines[0] and str(path) in lines[0]


@pytest.mark.parametrize("kind, message", [
    ("empty", "holds no text (empty)"),
    ("latin1", "is not UTF-8 text"),
    ("empty_folder", "has no files"),
    ("short", "corpus too short: 23 tokens split into 21 train / 2 val, but one block of the train split needs "
              "block_size + 1 = 33"),
])
def test_bad_data_errors_name_the_problem(tmp_path, capsys, kind, message):
    from selfattn.cli import main

    path = _write_bad(tmp_path, kind)
    assert main(["train", "--data", str(path), "--out", str(tmp_path / "run"), "--block-size", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("selfattn train: error: ") and message in err
    assert str(path) in err or kind == "short"


def test_a_damaged_or_half_rebuilt_cache_is_rebuilt_not_trusted(tmp_path):
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text("abcdefghij" * 100)
    kw = dict(data=str(corpus_file), tokenizer="byte", bpe_vocab=300, val_fraction=0.1, block_size=16)
    cache = tmp_path / "tokens"
    want = data.prepare(cache, **kw).train.clone()
    (cache / "train.bin").write_bytes((cache / "train.bin").read_bytes()[:100])  # cut short
    assert torch.equal(data.prepare(cache, **kw).train, want)
    (cache / "meta.json").write_text("{not json")
    assert torch.equal(data.prepare(cache, **kw).train, want)
    stamp = (cache / "meta.json").stat().st_mtime_ns
    assert data.prepare(cache, **kw) and (cache / "meta.json").stat().st_mtime_ns == stamp  # control: whole, reused


def test_refusals_come_before_anything_is_written(tmp_path):
    corpus_file = tmp_path / "corpus.txt"
    corpus_file.write_text("abcdefghij" * 10)
    kw = dict(data=str(corpus_file), tokenizer="byte", bpe_vocab=300, val_fraction=0.1)
    with pytest.raises(ValueError, match="corpus too short"):
        data.prepare(tmp_path / "tokens", **kw, block_size=64)
    with pytest.raises(ValueError, match=r"is not the one this run was trained on \(SHA-256 0123456789ab...\)"):
        data.prepare(tmp_path / "tokens", **kw, block_size=4, trained_on="0123456789abcdef")
    assert not (tmp_path / "tokens").exists()
    assert data.prepare(tmp_path / "tokens", **kw, block_size=4).fingerprint  # control: valid, it writes
    assert (tmp_path / "tokens" / "meta.json").exists()


def test_a_device_file_or_a_corpus_past_the_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"'/dev/zero' is not a regular file or a folder \(a device or a pipe\?\)"):
        data.read_corpus("/dev/zero")  # read whole, it never ends
    big = tmp_path / "big.txt"
    big.write_text("x" * 2000)
    monkeypatch.setattr(data, "MAX_CORPUS_BYTES", 1000)
    with pytest.raises(ValueError, match="holds 2,000 bytes, more than the 1,000 this reader tokenizes in memory"):
        data.read_corpus(big)
    monkeypatch.setattr(data, "MAX_CORPUS_BYTES", 4000)  # control: within the limit it is read
    assert data.read_corpus(big)[0] == "x" * 2000
