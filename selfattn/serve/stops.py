"""A row's text as its tokens come: bytes decoded as they complete characters, cut at the first stop string.

A character whose UTF-8 bytes span several tokens comes out whole once its last byte arrives; text
that may be the start of a stop string is held back until the next tokens tell (it is then sent,
or the stop string is complete and the text ends before it).
"""
from __future__ import annotations

import codecs


class Detokenizer:
    """Tokens in (:meth:`push`), text out; ``tokenizer`` gives each token's bytes (``token_bytes``),
    ``stops`` are the strings that end the text (left out of it)."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        if not all(isinstance(s, str) and s for s in stops):
            raise ValueError(f"stop strings must be non-empty strings, got {stops!r}")
        self.tokenizer, self.stops = tokenizer, tuple(stops)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""  # decoded text that may be the start of a stop string
        self.stopped = False  # a stop string was completed: the text has ended

    def push(self, token: int) -> str:
        """The text that ``token`` lets out (possibly ""); sets :attr:`stopped` when it completes a
        stop string, and then the text before it is all that is let out."""
        if self.stopped:
            raise ValueError("the text ended at a stop string: no token may follow")
        return self._let_out(self._held + self._decoder.decode(self.tokenizer.token_bytes(token)))

    def flush(self) -> str:
        """What is still held when generation ends without a stop string: the held text and an
        unfinished character (as U+FFFD)."""
        if self.stopped:
            return ""
        text, self._held = self._held + self._decoder.decode(b"", final=True), ""
        return text

    def _let_out(self, text: str) -> str:
        ends = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if ends:
            self.stopped, self._held = True, ""
            return text[:min(ends)]
        hold = max((n for s in self.stops for n in range(min(len(s) - 1, len(text)), 0, -1)
                    if text.endswith(s[:n])), default=0)  # the longest end of text that starts a stop string
        self._held = text[len(text) - hold:]
        return text[:len(text) - hold]
