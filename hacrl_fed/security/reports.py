"""Signed TrainReports: a learner's verdicts on other orgs (``trust/<source>/...``) count only when signed by it.

What is signed, like a batch (:mod:`hacrl_fed.security.envelope`) but under its own domain, so a report
signature can never pass for a batch signature or the other way round:

    canonical_bytes(report) = b"hacrl-fed/v1/TrainReport\\x00" + codec.encode(report with signature = b"")

that is, run id, round, org id, every metric and every disclosed content key. The coordinator verifies a report
(:func:`verify_report`) against the pinned roster before it acts on its verdicts; a report that fails is ignored
for every verdict, counted as ``round/<org>/report_rejected/<reason>`` (``unknown_org``, ``bad_signature``,
``wrong_run``, ``wrong_round``, ``malformed``). Verification is pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from cryptography.exceptions import InvalidSignature

from hacrl_fed.security.envelope import SIGNATURE_BYTES, RejectedBatch, _public_key
from hacrl_fed.security.identity import OrgIdentity
from hacrl_fed.types import TrainReport
from hacrl_fed.wire import codec

REPORT_DOMAIN = b"hacrl-fed/v1/TrainReport\x00"


def report_bytes(report: TrainReport) -> bytes:
    """The bytes a report signature covers (module docstring)."""
    return REPORT_DOMAIN + codec.encode(dataclasses.replace(report, signature=b""))


def sign_report(report: TrainReport, identity: OrgIdentity) -> TrainReport:
    """``report`` signed by ``identity``, which must be the report's org (ValueError otherwise)."""
    if identity.org_id != report.org_id:
        raise ValueError(f"identity of org {identity.org_id!r} cannot sign a report of org {report.org_id!r}")
    return dataclasses.replace(report, signature=identity.sign_key.sign(report_bytes(report)))


def verify_report(report: Any, roster: Mapping[str, Any], *, run_id: str, round: int) -> TrainReport:
    """Check a report's signature against ``roster`` and its run and round; returns it. Raises only
    :class:`~hacrl_fed.security.envelope.RejectedBatch` (its ``reason`` says why), whatever ``report`` is."""
    if not isinstance(report, TrainReport) or not isinstance(report.org_id, str):
        raise RejectedBatch("malformed", f"expected a TrainReport, got {type(report).__name__}")
    key = _public_key(roster, report.org_id)
    if not isinstance(report.signature, (bytes, bytearray)) or len(report.signature) != SIGNATURE_BYTES:
        raise RejectedBatch("bad_signature", f"report of {report.org_id!r} carries no valid signature")
    try:
        key.verify(bytes(report.signature), report_bytes(report))
    except InvalidSignature:
        raise RejectedBatch("bad_signature", f"report of {report.org_id!r} is not signed by its roster key") from None
    except Exception as err:  # noqa: BLE001 - an in-process report the codec cannot encode
        raise RejectedBatch("malformed", f"report of {report.org_id!r}: {type(err).__name__}: {err}") from None
    if report.run_id != run_id:
        raise RejectedBatch("wrong_run", f"report of {report.org_id!r} is for another run")
    if report.round != round:
        raise RejectedBatch("wrong_round", f"report of {report.org_id!r} is for round {report.round}, not {round}")
    return report
