"""``SentencePieceTokenizer``: llama.cpp's SPM tokenizer (``LLAMA_VOCAB_TYPE_SPM``, the ``llama``
tokenizer of GGUF files: Llama 2, Mistral, Gemma), id for id.

The vocabulary is a list of tokens (id = position), each with a score and a type (llama.cpp's
``LLAMA_TOKEN_TYPE_*``: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte). Encoding, as
``llama_vocab::impl::tokenize`` does with ``parse_special`` true:

1. the control, unknown and user-defined tokens (``<start_of_turn>``, ``\\n\\n``, runs of spaces) are cut
   out of the text first, the longest (in UTF-8 bytes; equal lengths by id) first, each at its
   occurrences left to right in the text the longer ones left;
2. each piece of text between them gets a space put first when ``add_space_prefix`` and it starts the
   text or follows a token of step 1, then ``▁`` for every space, and is merged: it starts as its
   characters, and the adjacent pair whose concatenation is a token of the highest score (the
   leftmost of equal scores) becomes one symbol, until no pair is a token;
3. a symbol that is a token is that token; one that is not (a character the vocabulary lacks) is its
   UTF-8 bytes, each the ``<0xNN>`` token (or, lacking it, the token that is that one character).

``bos`` is put first and ``eos`` last when asked (``encode(..., special=True)``). A token's bytes are
llama.cpp's piece of it: the text of a control, unknown or user-defined token; a normal token's text
with ``▁`` back to a space; a byte token's byte; nothing for other types. ``decode`` is
``llama_detokenize``: the pieces, the first one's leading space taken off when ``add_space_prefix``.

Not copied: llama.cpp's per-model token attributes (Phi-3's right-strip of special tokens, found by
the model's name) and its retyping of tokens found by their text (``<end_of_turn>`` made control when
a file says otherwise).
"""
from __future__ import annotations

import heapq
import re

from selfattn.tokenizers.bpe import BPETokenizer, import_tokenizers

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6  # llama.cpp's token types (5: unused)
SPECIAL = (UNKNOWN, CONTROL, USER_DEFINED)  # cut out of the text before merging, their text their piece
SPACE = "\u2581"  # ▁, SentencePiece's space
_BYTE_TEXT = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class SentencePieceTokenizer:
    """llama.cpp's SPM tokenizer of ``tokens`` with their ``scores`` and ``types`` (see the module
    docstring); ``bos``/``eos``: the ids put around a prompt by ``encode(..., special=True)`` (None:
    none); ``where``: what the vocabulary came from, named in errors."""

    def __init__(self, tokens: list[str], scores: list[float], types: list[int], *, bos: int | None = None,
                 eos: int | None = None, add_space_prefix: bool = True, where: str = "the tokenizer"):
        n = len(tokens)
        if len(scores) != n or len(types) != n:
            raise ValueError(f"{where}: {n} tokens but {len(scores)} scores and {len(types)} token types")
        if not (set(map(type, tokens)) <= {str} and set(map(type, scores)) <= {int, float}
                and set(map(type, types)) <= {int}):
            raise ValueError(f"{where}: the tokens must be strings, their scores numbers and types integers")
        for name, i in (("bos", bos), ("eos", eos)):
            if i is not None and not (isinstance(i, int) and 0 <= i < n):
                raise ValueError(f"{where}: the {name} token {i!r} is outside the {n} tokens")
        self.tokens, self.scores, self.types = tokens, scores, types
        self.bos, self.eos, self.add_space_prefix, self.where = bos, eos, add_space_prefix, where
        self.vocab_size = n
        self._ids = dict(zip(tokens, range(n)))  # a text twice: the later id, as llama.cpp's map keeps
        special = [i for i, kind in enumerate(types) if kind in SPECIAL and tokens[i]]  # "" would match anywhere
        self._special = sorted(((tokens[i], i) for i in special), key=lambda s: -len(s[0].encode("utf-8")))
        self._byte = {}  # a byte token's id -> its byte
        for i in (i for i, kind in enumerate(types) if kind == BYTE):
            if not _BYTE_TEXT.fullmatch(tokens[i]):
                raise ValueError(f"{where}: token {i} {tokens[i]!r} is a byte token (type {BYTE}) but not <0xNN>")
            self._byte[i] = int(tokens[i][3:5], 16)
        self._byte_ids = [self._ids.get(f"<0x{b:02X}>", self._ids.get(chr(b)) if b < 0x80 else None)
                          for b in range(256)]

    def token_id(self, piece: str) -> int | None:
        """The id of a token written as the vocabulary stores it (``"<start_of_turn>"``, ``"▁the"``), or None."""
        return self._ids.get(piece)

    def piece(self, token: int) -> str:
        """The text of ``token`` as the vocabulary stores it."""
        self._check(token)
        return self.tokens[token]

    def encode(self, text: str, *, special: bool = False) -> list[int]:
        """The ids of ``text``, the control tokens written in it (``<start_of_turn>``) matched as such;
        ``special``: with ``bos`` first and ``eos`` last as well (those that are not None)."""
        ids = [self.bos] if special and self.bos is not None else []
        after_special = True
        for part in self._partition(text):
            if isinstance(part, int):
                ids.append(part)
                after_special = True
                continue
            if self.add_space_prefix and after_special:
                part = " " + part
            ids += self._merge(part.replace(" ", SPACE))
            after_special = False
        return ids + [self.eos] if special and self.eos is not None else ids

    def decode(self, ids) -> str:
        pieces = [self.token_bytes(int(i)) for i in ids]
        if self.add_space_prefix and pieces:
            pieces[0] = pieces[0].removeprefix(b" ")
        return b"".join(pieces).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        self._check(token)
        kind = self.types[token]
        if kind in SPECIAL:
            return self.tokens[token].encode("utf-8")
        if kind == NORMAL:
            return self.tokens[token].replace(SPACE, " ").encode("utf-8")
        return bytes([self._byte[token]]) if kind == BYTE else b""

    def spec(self) -> dict:
        return {"kind": "sentencepiece", "tokens": self.tokens, "scores": self.scores, "types": self.types,
                "bos": self.bos, "eos": self.eos, "add_space_prefix": self.add_space_prefix}

    @classmethod
    def from_spec(cls, spec: dict, where: str = "the tokenizer spec") -> SentencePieceTokenizer:
        """The tokenizer ``spec()`` describes; a ValueError naming ``where`` when it is not one."""
        keys = ("tokens", "scores", "types", "bos", "eos", "add_space_prefix")
        if not all(key in spec for key in keys) or not all(isinstance(spec[k], list) for k in keys[:3]):
            raise ValueError(f"{where}: a sentencepiece tokenizer needs the lists tokens, scores, types and "
                             f"bos, eos, add_space_prefix; got the keys {sorted(spec)}")
        return cls(spec["tokens"], spec["scores"], spec["types"], bos=spec["bos"], eos=spec["eos"],
                   add_space_prefix=bool(spec["add_space_prefix"]), where=where)

    def to_bpe(self) -> BPETokenizer:
        """This tokenizer as a :class:`~selfattn.tokenizers.bpe.BPETokenizer` over a ``tokenizers.Tokenizer``
        (what a ``transformers`` folder's ``tokenizer.json`` holds) that encodes and decodes id for id as
        this one: a BPE with byte fallback whose merges are the splits of each normal token into two tokens,
        ranked by the token's score (highest first; then its id, then where it splits), step 2's order in
        BPE's lowest-rank-first form; the special tokens of step 1 added, unnormalised; spaces become ``▁``
        (with one put first when ``add_space_prefix``); ``bos`` and ``eos`` put around a prompt as
        :meth:`encode` puts them with ``special``.

        Two of the rules have no such form, and a vocabulary that needs them is refused (ValueError): two
        tokens of one score that can meet (step 2 takes the leftmost pair, BPE a fixed rank), and special tokens
        that overlap where the longest-first cut (step 1) and ``tokenizers``' leftmost-longest match part
        ways: every overlap of two special tokens is encoded both ways, and must give the same ids."""
        tokenizers = import_tokenizers()
        ids, scores = self._ids, self.scores
        splits = sorted((-scores[i], i, k) for token, i in ids.items() if self.types[i] == NORMAL
                        for k in range(1, len(token)) if token[:k] in ids and token[k:] in ids)
        merges = [(self.tokens[i][:k], self.tokens[i][k:]) for _, i, k in splits]
        self._check_ties(splits, merges)
        tok = tokenizers.Tokenizer(tokenizers.models.BPE(ids, merges, byte_fallback=True))
        normalizers, decoders = tokenizers.normalizers, tokenizers.decoders
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE)] * self.add_space_prefix
                                              + [normalizers.Replace(" ", SPACE)])
        tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                        + [decoders.Strip(" ", 1, 0)] * self.add_space_prefix)
        tok.add_tokens([tokenizers.AddedToken(text, special=self.types[i] != USER_DEFINED, normalized=False)
                        for text, i in self._special])
        around = [(self.tokens[i], i) for i in (self.bos, self.eos) if i is not None]
        if around:
            single = " ".join(([self.tokens[self.bos]] if self.bos is not None else []) + ["$A"] +
                              ([self.tokens[self.eos]] if self.eos is not None else []))
            tok.post_processor = tokenizers.processors.TemplateProcessing(single=single, special_tokens=around)
        probe = "a".join(self._overlaps())
        if tok.encode(probe, add_special_tokens=False).ids != self.encode(probe):
            raise ValueError(f"{self.where}: special tokens overlap where llama.cpp cuts the longest first and a "
                             f"tokenizers.Tokenizer the leftmost, so no tokenizer.json tokenizes as it does")
        return BPETokenizer(tok, self.where)

    def _check_ties(self, splits: list[tuple], merges: list[tuple[str, str]]) -> None:
        """Refuse two tokens of one score whose pairs can meet, ``x y`` and ``y z`` (``x y z``: llama.cpp merges
        the left pair, a BPE the pair of the lower rank)."""
        by_score: dict[float, list[tuple[int, str, str]]] = {}
        for (score, i, _), (left, right) in zip(splits, merges):
            by_score.setdefault(score, []).append((i, left, right))
        for score, pairs in by_score.items():
            rights = {right: i for i, _, right in pairs}
            for i, left, _ in pairs:
                if rights.get(left, i) != i:
                    first, second = self.tokens[rights[left]], self.tokens[i]
                    raise ValueError(f"{self.where}: the tokens {first!r} and {second!r} share the score {-score} "
                                     f"and meet at {left!r}: llama.cpp merges the leftmost pair, a BPE the one of "
                                     f"the lower rank")

    def _overlaps(self) -> list[str]:
        """A text for each way two special tokens overlap (one's end the other's start), one token a way."""
        ending = {}  # a proper suffix of a special token -> that token (the first, longest, with it)
        for text, _ in self._special:
            for k in range(1, len(text)):
                ending.setdefault(text[k:], text)
        return [ending[text[:k]] + text[k:] for text, _ in self._special for k in range(1, len(text))
                if text[:k] in ending]

    def _check(self, token: int) -> None:
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token {token} is outside the SentencePiece vocabulary of {self.vocab_size}")

    def _partition(self, text: str) -> list[str | int]:
        """``text`` as its pieces of text and the ids of the special tokens cut out of it (step 1)."""
        parts: list[str | int] = [text] if text else []
        for piece, token in self._special:
            if piece not in text:
                continue
            cut = []
            for part in parts:
                if isinstance(part, int) or piece not in part:
                    cut.append(part)
                    continue
                for k, between in enumerate(part.split(piece)):
                    cut += ([token] if k else []) + ([between] if between else [])
            parts = cut
        return parts

    def _merge(self, text: str) -> list[int]:
        """The ids of one piece of text, its spaces already ``▁`` (steps 2 and 3)."""
        ids, scores = self._ids, self.scores
        symbols = list(text)  # merged away: ""
        after = list(range(1, len(symbols) + 1))  # the next live symbol (len(symbols): none)
        before = list(range(-1, len(symbols) - 1))  # the previous live symbol (-1: none)
        queue = []  # (-score of the pair's token, its left symbol, its length in characters)
        for left in range(len(symbols) - 1):
            pair = symbols[left] + symbols[left + 1]
            if (token := ids.get(pair)) is not None:
                queue.append((-scores[token], left, len(pair)))
        heapq.heapify(queue)
        while queue:
            _, left, size = heapq.heappop(queue)
            right = after[left]
            if not symbols[left] or right == len(symbols) or len(symbols[left]) + len(symbols[right]) != size:
                continue  # one of the pair was merged since it was queued (symbols only grow, or go)
            symbols[left] += symbols[right]
            symbols[right] = ""
            after[left] = after[right]
            if after[left] < len(symbols):
                before[after[left]] = left
            for a, b in ((before[left], left), (left, after[left])):
                if a >= 0 and b < len(symbols) and (token := ids.get(symbols[a] + symbols[b])) is not None:
                    heapq.heappush(queue, (-scores[token], a, len(symbols[a]) + len(symbols[b])))
        out = []
        for symbol in filter(None, symbols):
            token = ids.get(symbol)
            out += [token] if token is not None else [self._byte_id(b, symbol) for b in symbol.encode("utf-8")]
        return out

    def _byte_id(self, byte: int, char: str) -> int:
        token = self._byte_ids[byte]
        if token is None:
            raise ValueError(f"{self.where}: the vocabulary has no token for {char!r} nor for its byte "
                             f"0x{byte:02X} (<0x{byte:02X}>), so the text cannot be encoded")
        return token
