"""What the run report shows, read from a run folder: pure functions from ``metrics.jsonl`` records (docs/METRICS.md)
and the orgs' ``samples.jsonl`` (:mod:`hacrl_fed.worker.samples`) to one JSON-ready dict (:func:`report_data`).

Every section is computed from the records alone, so a report of a run in progress (``hacrl-fed report`` while it
runs) shows the rounds written so far; a half-written last line is skipped.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hacrl_fed.run_files import SUMMARY_FILE
from hacrl_fed.worker.samples import SAMPLES_FILE

METRICS_FILE = "metrics.jsonl"
SAMPLE_BUDGET_BYTES = 3_600_000  # the most sample bytes one report embeds (all orgs; rows thinned evenly beyond)
MAX_EVENTS = 4000  # trust events listed (the earliest; the count of the rest is shown)
PHASES = ("generate", "verify", "seal_sign", "trust", "score", "train", "outcome_shadow")  # <org>/time/<phase>

INTAKE = re.compile(r"^(?P<learner>[^/]+)/intake/(?P<source>[^/]+)/(?P<what>received|kept|dropped/[^/]+/[^/]+)$")


def read_records(run_dir: str | Path) -> list[dict[str, Any]]:
    """``metrics.jsonl``'s records; lines that do not parse (a line being written) are skipped."""
    return list(_json_lines(Path(run_dir) / METRICS_FILE))


def _json_lines(path: Path, limit: int | None = None) -> Iterable[dict[str, Any]]:
    if not path.is_file():
        return
    with path.open("rb") as f:
        data = f.read() if limit is None else f.read(limit)
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            yield rec


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


ORG_KEYS = (
    re.compile(r"^capability/(?P<org>[^/]+)$"),
    re.compile(r"^security/(?P<org>[^/]+)/excluded$"),
    re.compile(r"^eval/(?P<org>[^/]+)/accuracy$"),
)


def _orgs(records: list[dict[str, Any]]) -> list[str]:
    """The org ids: those with a capability estimate, an exclusion flag (every configured org) or an evaluation."""
    return sorted({m["org"] for rec in records for k in rec for p in ORG_KEYS if (m := p.match(k))})


def series(records: list[dict[str, Any]], template: str, orgs: list[str]) -> dict[str, list[list[float]]]:
    """Per org ``[[round, value], ...]`` of the key ``template.format(org=org)`` (rounds where it is a number)."""
    out: dict[str, list[list[float]]] = {}
    for org in orgs:
        key = template.format(org=org)
        pts = {int(r["round"]): v for r in records if (v := _num(r.get(key))) is not None and "round" in r}
        if pts:
            out[org] = [[float(t), pts[t]] for t in sorted(pts)]
    return out


def header(evals: dict[str, list[list[float]]], rewards: dict[str, list[list[float]]], orgs: list[str]) -> list[dict]:
    """Per org: held-out accuracy at its first and last evaluation, train reward in its first and last round."""
    rows = []
    for org in orgs:
        e, r = evals.get(org, []), rewards.get(org, [])
        rows.append(
            {
                "org": org,
                "acc_before": e[0][1] if e else None,
                "acc_after": e[-1][1] if e else None,
                "acc_rounds": [e[0][0], e[-1][0]] if e else None,
                "reward_first": r[0][1] if r else None,
                "reward_last": r[-1][1] if r else None,
            }
        )
    return rows


def intake_matrix(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """Learner × source, summed over rounds, from the ledger's ``<learner>/intake/<source>/...`` counters:
    ``{learner: {source: {"received", "kept", "dropped": {"<stage>/<reason>": rows}}}}``."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for rec in records:
        for k, v in rec.items():
            m = INTAKE.match(k)
            n = _num(v)
            if m is None or n is None:
                continue
            cell = out.setdefault(m["learner"], {}).setdefault(m["source"], {"received": 0, "kept": 0, "dropped": {}})
            what = m["what"]
            if what.startswith("dropped/"):
                reason = what[len("dropped/") :]
                cell["dropped"][reason] = cell["dropped"].get(reason, 0) + int(n)
            else:
                cell[what] += int(n)
    return out


def phase_times(records: list[dict[str, Any]], orgs: list[str]) -> dict[str, dict[str, float]]:
    """Per org, mean seconds per round of each phase it reported (``<org>/time/<phase>``; ``eval`` from
    ``eval/<org>/time/eval``, per evaluation)."""
    out: dict[str, dict[str, float]] = {}
    for org in orgs:
        phases: dict[str, float] = {}
        keys = {p: f"{org}/time/{p}" for p in PHASES} | {"eval": f"eval/{org}/time/eval"}
        for phase, key in keys.items():
            vals = [v for r in records if (v := _num(r.get(key))) is not None]
            if vals:
                phases[phase] = sum(vals) / len(vals)
        if phases:
            out[org] = phases
    return out


def read_samples(run_dir: str | Path, budget: int = SAMPLE_BUDGET_BYTES) -> tuple[list[dict], dict[str, dict]]:
    """Every org's ``samples.jsonl`` rows (thinned evenly when all together exceed ``budget`` bytes) and per org
    the file's size and rows."""
    files = sorted((Path(run_dir) / "orgs").glob(f"*/{SAMPLES_FILE}"))
    share = budget // max(len(files), 1)
    rows: list[dict] = []
    info: dict[str, dict] = {}
    for path in files:
        size = path.stat().st_size
        every = max(math.ceil(size / share), 1) if share else 0
        found = [r for r in _json_lines(path, limit=8 * share) if isinstance(r.get("kind"), str)]
        taken = found[::every] if every else []
        info[path.parent.name] = {"bytes": size, "rows": len(found), "shown": len(taken)}
        rows += taken
    return rows, info


def report_data(run_dir: str | Path) -> dict[str, Any]:
    """Everything the page shows (module docstring), JSON-ready."""
    from hacrl_fed.report.events import trust_events

    run_dir = Path(run_dir)
    records = read_records(run_dir)
    orgs = _orgs(records)
    evals = series(records, "eval/{org}/accuracy", orgs)
    rewards = series(records, "round/{org}/accuracy", orgs)
    events = trust_events(records)
    samples, samples_info = read_samples(run_dir)
    summary = run_dir / SUMMARY_FILE
    return {
        "name": run_dir.name,
        "generated": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "rounds": max((int(r.get("round", 0)) for r in records), default=0),
        "orgs": orgs,
        "header": header(evals, rewards, orgs),
        "eval": evals,
        "reward": rewards,
        "capability": series(records, "capability/{org}", orgs),
        "matrix": intake_matrix(records),
        "events": events[:MAX_EVENTS],
        "events_total": len(events),
        "phases": phase_times(records, orgs),
        "samples": samples,
        "samples_info": samples_info,
        "summary": summary.read_text(errors="replace")[:20000] if summary.is_file() else "",
    }
