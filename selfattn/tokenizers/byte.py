"""The byte tokenizer: token id = byte value of the UTF-8 encoding, so any text round-trips."""
from __future__ import annotations


class ByteTokenizer:
    """Token id = byte value of the UTF-8 encoding; vocabulary 256."""

    vocab_size = 256

    def encode(self, text: str, *, special: bool = False) -> list[int]:  # no special tokens either way
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")

    def token_bytes(self, token: int) -> bytes:
        if not 0 <= token < 256:
            raise ValueError(f"byte token {token} is outside 0..255")
        return bytes([token])

    def spec(self) -> dict:
        return {"kind": "byte"}
