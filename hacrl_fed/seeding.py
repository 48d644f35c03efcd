"""Stable seeds: the same parts give the same seed in every process and Python version (no ``hash()``)."""

from __future__ import annotations

import hashlib


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``repr``-stable parts (ints, strings): ``sha256("|".join(parts))``."""
    digest = hashlib.sha256("|".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
