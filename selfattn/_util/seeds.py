"""Seeds of independent random generators, each named by a tuple: ``seed_for(seed, "dropout", rank, step)``."""
from __future__ import annotations

import hashlib


def seed_for(*parts) -> int:
    """A 63-bit seed derived from any tuple of ints, strings and None: one independent generator per tuple."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
