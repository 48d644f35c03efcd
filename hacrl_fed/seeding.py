"""Stable seeds: the same parts give the same seed in every process, machine and Python version (no ``hash()``).

The one :func:`stable_seed` of the project: the coordinator's prompt sampler (``("prompts", seed, round)``) and
sampling seeds (``("sampling", seed, round)``), and each worker's org seed (``(seed, "org", org_id)``) and
per-round generation seed all come from it. ``tests/test_sampler.py`` pins known values: changing the hash would
change every sampled prompt and every rollout of every run.
"""

from __future__ import annotations

import hashlib


def stable_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts``: SHA-256 of their ``repr`` joined by ``|``, first 8 bytes, shifted right by one.

    ``repr`` keeps types apart (``1`` and ``"1"`` give different seeds). Python's ``hash()`` is salted per process
    for ``str``, so it cannot be used here.
    """
    text = "|".join(repr(p) for p in parts)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 1
