"""The run report's timeline of trust events, from ``metrics.jsonl`` records (docs/METRICS.md).

One rule per kind of event: a key pattern, the event's kind, who it is about and a one-line text. A key is an event
in a round where its value is nonzero (a flag that is 1, a count above 0); ``security/<org>/excluded`` only in the
round it turns 1.
"""

from __future__ import annotations

import math
import re
from typing import Any

# (kind, pattern with named groups, text with those groups and {n} for the value)
RULES: tuple[tuple[str, re.Pattern, str], ...] = tuple(
    (kind, re.compile(pattern), text)
    for kind, pattern, text in (
        ("exclusion", r"^security/(?P<org>[^/]+)/excluded$", "{org} excluded from the pool"),
        ("exclusion", r"^(?P<org>[^/]+)/trust/(?P<src>[^/]+)/excluded$", "{org} dropped {src}'s rows (mismatch rate)"),
        (
            "accusation",
            r"^(?P<org>[^/]+)/trust/(?P<src>[^/]+)/mismatches$",
            "{org} found {n} contradicted rewards in {src}'s batch",
        ),
        ("accusation", r"^round/(?P<org>[^/]+)/false_accusation$", "{org} accused falsely (excluded)"),
        ("accusation", r"^round/(?P<org>[^/]+)/unproven_accusation$", "{org}: {n} unproven accusations"),
        ("accusation", r"^round/(?P<org>[^/]+)/malformed_accusation$", "{org} sent a malformed accusation"),
        (
            "trust drop",
            r"^(?P<org>[^/]+)/trust/(?P<src>[^/]+)/rejected/(?P<why>[^/]+)$",
            "{org} rejected {n} rows of {src}: {why}",
        ),
        (
            "trust drop",
            r"^round/(?P<org>[^/]+)/rejected/(?P<why>[^/]+)$",
            "coordinator rejected {n} rows of {org}: {why}",
        ),
        (
            "trust drop",
            r"^round/(?P<org>[^/]+)/report_rejected/(?P<why>[^/]+)$",
            "coordinator rejected {org}'s report: {why}",
        ),
        (
            "screen drop",
            r"^(?P<org>[^/]+)/screen/(?P<src>[^/]+)/dropped_(?P<why>[^/]+)$",
            "{org}'s likelihood screen dropped {n} rows of {src}: {why}",
        ),
        ("guard", r"^(?P<org>[^/]+)/outcome/validated$", "{org}'s outcome guard validated its weights"),
        ("rollback", r"^(?P<org>[^/]+)/outcome/rollback$", "{org} rolled back to its last passing weights"),
        ("adoption", r"^(?P<org>[^/]+)/outcome/adopted$", "{org} adopted its shadow's weights"),
        ("guard", r"^(?P<org>[^/]+)/outcome/new_reference$", "{org}'s weights became its new reference"),
        ("guard", r"^(?P<org>[^/]+)/outcome/spared$", "{org} regressed but was spared (shadow no better)"),
        ("guard", r"^(?P<org>[^/]+)/outcome/rebased$", "{org} rebased its reference (own rows only)"),
        (
            "quarantine",
            r"^(?P<org>[^/]+)/outcome/(?P<src>[^/]+)/quarantined$",
            "{org}'s outcome guard quarantined {src}",
        ),
        ("failure", r"^round/(?P<org>[^/]+)/failure/(?P<why>[^/]+)$", "{org} contributed nothing: {why}"),
        ("failure", r"^round/(?P<org>[^/]+)/train_failure/(?P<why>[^/]+)$", "{org}'s train call failed: {why}"),
    )
)
KINDS = tuple(dict.fromkeys(kind for kind, _, _ in RULES))


def _event(key: str, value: Any) -> tuple[str, str, str] | None:
    """``(kind, org, text)`` when ``key`` with ``value`` is an event."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        return None
    for kind, pattern, text in RULES:
        m = pattern.match(key)
        if m:
            n = int(value) if float(value).is_integer() else round(float(value), 3)
            return kind, m["org"], text.format(n=n, **m.groupdict())
    return None


def trust_events(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every event in round order: ``{"round", "kind", "org", "text"}`` (module docstring)."""
    out: list[dict[str, Any]] = []
    excluded: set[str] = set()
    for rec in records:
        rnd = rec.get("round")
        if not isinstance(rnd, int):
            continue
        for key in sorted(rec):
            ev = _event(key, rec[key])
            if ev is None:
                continue
            kind, org, text = ev
            if key.startswith("security/"):  # a flag written every round: the round it turns on
                if org in excluded:
                    continue
                excluded.add(org)
            out.append({"round": rnd, "kind": kind, "org": org, "text": text})
    return out
