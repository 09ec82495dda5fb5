"""Independent random streams named by tuples: ``stream_seed(seed, "dropout", rank, step)``."""
from __future__ import annotations

import hashlib


def stream_seed(*parts) -> int:
    """A 63-bit seed derived from any tuple of ints, strings and None (independent streams per tuple)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
