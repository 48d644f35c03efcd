"""Does the virtual clock predict a real asynchronous run? (issue 29; scripts/async_grpc_check.py)

A run over gRPC logs, per round ``t`` and org ``x`` (docs/METRICS.md "Asynchronous rounds", seconds since the
driver's start): ``async/x/clock_s`` (the end of x's step planning ``t``), ``async/x/trained_at_s`` (the end of the
step that trained ``t``: the one planning ``t + 1``), ``async/x/idle_s`` (x's wait on the staleness bound so far,
through the start of its step planning ``t``) and ``async/x/step_s`` (that step's call, send to reply). From them:

- x's **step ends**: ``clock_s`` of rounds ``1 … R``, then ``trained_at_s`` of round ``R`` (its last step, train
  only: its **finish**);
- x's **step durations** on the driver's clock, steps ``1 … R``: ``end(t) - start(t)`` with
  ``start(t) = end(t - 1) + idle_s(t) - idle_s(t - 1)`` (``end(0) = idle_s(0) = 0``): the call plus the driver's
  own work between a reply and the next send (the last step's start is not logged: not counted);
- x's **lead** over the slow org at time ``T``: the rounds x has published by ``T`` minus those the slow org has.

:func:`compare` feeds each org's mean step duration to :func:`~hacrl_fed.coordinator.async_schedule.simulate` with the
run's ``K`` and ``W`` and sets the prediction against what happened: each org's finish, its lead at its finish and
the largest lead at any of its publications, its idle time through the start of its step planning ``R``, and every
step's end (mean absolute error, also as % of the run: the last finish).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from hacrl_fed.coordinator.async_schedule import ScheduleSpec, simulate

Records = Sequence[Mapping[str, Any]]


def _by_round(records: Records) -> dict[int, Mapping[str, Any]]:
    return {int(rec["round"]): rec for rec in records}


def step_ends(records: Records, org: str, rounds: int) -> list[float]:
    """The ends of ``org``'s steps planning ``1 … R + 1`` (the last: ``trained_at_s`` of round ``R``)."""
    by = _by_round(records)
    return [float(by[t][f"async/{org}/clock_s"]) for t in range(1, rounds + 1)] + [
        float(by[rounds][f"async/{org}/trained_at_s"])
    ]


def step_starts(records: Records, org: str, rounds: int) -> list[float]:
    """The starts of ``org``'s steps planning ``1 … R``: the previous end plus the idle time logged in between."""
    by, ends = _by_round(records), step_ends(records, org, rounds)
    idle = [0.0] + [float(by[t][f"async/{org}/idle_s"]) for t in range(1, rounds + 1)]
    return [(ends[t - 2] if t > 1 else 0.0) + idle[t] - idle[t - 1] for t in range(1, rounds + 1)]


def step_durations(records: Records, org: str, rounds: int) -> list[float]:
    """``org``'s steps planning ``1 … R`` on the driver's clock (``end - start``)."""
    ends = step_ends(records, org, rounds)
    return [end - start for start, end in zip(step_starts(records, org, rounds), ends, strict=False)]


def call_seconds(records: Records, org: str, rounds: int) -> list[float]:
    """``async/<org>/step_s`` of rounds ``1 … R``: each step's call, send to reply."""
    by = _by_round(records)
    return [float(by[t][f"async/{org}/step_s"]) for t in range(1, rounds + 1)]


def spread(values: Sequence[float]) -> dict[str, float]:
    """Mean, standard deviation, coefficient of variation, min, median and max of ``values``."""
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {
        "mean": mean,
        "sd": sd,
        "cv": sd / mean if mean else math.nan,
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
    }


def published_by(ends: Sequence[float], rounds: int, time: float) -> int:
    """Rounds an org whose steps end at ``ends`` (planning ``1 … R + 1``) has published by ``time``."""
    return sum(1 for end in ends[:rounds] if end <= time)


def leads(ends: Mapping[str, Sequence[float]], slow: str, rounds: int) -> dict[str, dict[str, int]]:
    """Per org: ``at_finish`` (rounds published beyond the slow org's when it finishes) and ``max`` (the most at
    any of its publications)."""
    out = {}
    for org, mine in ends.items():
        at = [t - published_by(ends[slow], rounds, mine[t - 1]) for t in range(1, rounds + 1)]
        out[org] = {"at_finish": rounds - published_by(ends[slow], rounds, mine[rounds]), "max": max(at)}
    return out


def predict(durations: Mapping[str, float], rounds: int, staleness: int, window: int | None) -> dict[str, Any]:
    """The virtual clock's schedule for these step durations: per org its step ends (planning ``1 … R + 1``) and
    its idle time through the start of its step planning ``R``."""
    schedule = simulate(ScheduleSpec(dict(durations), rounds, staleness, window))
    ends: dict[str, list[float]] = {org: [] for org in durations}
    idle = dict.fromkeys(durations, 0.0)
    for step in sorted(schedule.steps, key=lambda s: (s.org, s.round)):
        mine = ends[step.org]
        if step.round <= rounds:
            idle[step.org] += step.start - (mine[-1] if mine else 0.0)
        mine.append(step.end)
    return {"ends": ends, "idle": idle}


def _pair(real: float, predicted: float, scale: float) -> dict[str, float]:
    """A real and a predicted figure, their difference in % of ``scale``."""
    return {"real": real, "predicted": predicted, "error_pct": 100 * (predicted - real) / scale if scale else math.nan}


def compare(
    records: Records,
    orgs: Sequence[str],
    rounds: int,
    staleness: int,
    window: int | None,
    slow: str,
    *,
    basis: str = "schedule",
) -> dict[str, Any]:
    """The prediction from each org's mean step duration (``basis``: ``schedule``, end - start on the driver's
    clock, or ``call``, ``step_s``) against the run of ``records`` (module docstring). Errors: a finish in % of the
    real finish, an idle time in % of the run (the last real finish), step ends as a mean absolute error (s, %)."""
    measure = step_durations if basis == "schedule" else call_seconds
    durations = {org: statistics.fmean(measure(records, org, rounds)) for org in orgs}
    real = {org: step_ends(records, org, rounds) for org in orgs}
    guess = predict(durations, rounds, staleness, window)
    run_s = max(ends[-1] for ends in real.values())
    real_lead, guess_lead = leads(real, slow, rounds), leads(guess["ends"], slow, rounds)
    last = _by_round(records)[rounds]
    per_org = {
        org: {
            "step_s": spread(step_durations(records, org, rounds)),
            "call_s": spread(call_seconds(records, org, rounds)),
            "finish_s": _pair(real[org][-1], guess["ends"][org][-1], real[org][-1]),
            "lead_at_finish": {"real": real_lead[org]["at_finish"], "predicted": guess_lead[org]["at_finish"]},
            "max_lead": {"real": real_lead[org]["max"], "predicted": guess_lead[org]["max"]},
            "idle_s": _pair(float(last[f"async/{org}/idle_s"]), guess["idle"][org], run_s),
        }
        for org in orgs
    }
    errors = [abs(r - p) for org in orgs for r, p in zip(real[org], guess["ends"][org], strict=True)]
    mae = statistics.fmean(errors)
    return {
        "basis": basis,
        "durations_s": durations,
        "run_s": run_s,
        "orgs": per_org,
        "step_ends_s": {org: {"real": real[org], "predicted": guess["ends"][org]} for org in orgs},
        "step_end_mae_s": mae,
        "step_end_mae_pct": 100 * mae / run_s,
    }
