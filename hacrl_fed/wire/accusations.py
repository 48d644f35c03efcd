"""The names of a learner's accusations in its TrainReport: one rule for the worker that writes them, the codec
that bounds them and the coordinator that judges them (SECURITY.md "Receivers' verdicts can be checked").

* Lock-step rounds (``federation.staleness: 0``): ``trust/<source>/mismatches`` in ``TrainReport.metrics``, the
  rewards of ``<source>``'s batch of the report's round that the learner's verifier contradicted, with the batch's
  content key as ``TrainReport.disclosed_keys[<source>]``.
* Asynchronous rounds in coordinator-blind mode (``federation.staleness >= 1``, ``security.encrypt``): a train
  request may carry several batches of one source (rounds of the window), so an accusation names the batch:
  ``trust/<source>/round/<round>/mismatches`` (beside ``.../checked``), with that batch's content key as
  ``TrainReport.disclosed_keys["<source>/<round>"]``.

An org id never holds ``/`` (``orgs[].id``), so both forms parse unambiguously. A counter is a whole count >= 0
(>= 1 accuses); a per-round counter whose round is not a decimal integer is malformed.
"""

from __future__ import annotations

ACCUSATION_SUFFIX = "/mismatches"  # trust/<source>/mismatches, trust/<source>/round/<round>/mismatches


def source_counter(source: str, what: str = "mismatches") -> str:
    """``trust/<source>/<what>``: a learner's count about ``source``'s batch (lock-step rounds)."""
    return f"trust/{source}/{what}"


def round_counter(source: str, round: int, what: str = "mismatches") -> str:
    """``trust/<source>/round/<round>/<what>``: a learner's count about ``source``'s batch of ``round``."""
    return f"trust/{source}/round/{round}/{what}"


def round_key(source: str, round: int) -> str:
    """``<source>/<round>``: where ``TrainReport.disclosed_keys`` holds the content key of that one batch."""
    return f"{source}/{round}"


def is_counter(key: str) -> bool:
    """Whether metric ``key`` is a mismatch counter (per source or per (source, round))."""
    return key.startswith("trust/") and key.endswith(ACCUSATION_SUFFIX)


def parse_round_counter(key: str) -> tuple[str, int] | None:
    """``(source, round)`` of a per-round counter ``trust/<source>/round/<round>/mismatches``; None for a
    per-source counter or any other key. Raises ValueError for a per-round counter whose round is not a decimal
    integer (a malformed accusation)."""
    parts = key.split("/")
    if len(parts) != 5 or parts[0] != "trust" or parts[2] != "round" or parts[4] != "mismatches":
        return None
    if not (parts[3].isascii() and parts[3].isdigit()) or not parts[1]:
        raise ValueError(f"{key[:80]!r} does not name a (source, round)")
    return parts[1], int(parts[3])
