"""The in-process virtual clock of asynchronous rounds: a benchmark's setting, not the run config's (issue 42).

The asynchronous driver (:mod:`hacrl_fed.coordinator.async_driver`) orders the in-process replies by a virtual
clock, so a run is deterministic. :class:`VirtualClock` says how long one step of each org takes on it and when an
org dies and comes back (fault injection). It rides on the transport that has that clock,
:class:`~hacrl_fed.coordinator.inprocess.InProcessTransport` (``clock=``); a transport without one (gRPC, Flower)
runs on the wall clock, where a step takes what it takes and a call that fails or times out is the death. The
benchmark tools set it (``configs/bench/matrix.yaml``: ``federation.virtual_step_s`` and the other two names of
:data:`BENCH_FIELDS` in a method's ``set``, split off the run config by :mod:`hacrl_tools.bench.matrix`); a user's
run config that names one is refused, naming the field (:mod:`hacrl_fed.config.federation`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_STEP_S = 1.0  # virtual seconds of a step of an org ``step_s`` does not name
# the benchmark layer's names of the three maps (as the run config had them before issue 42)
BENCH_FIELDS = {
    "federation.virtual_step_s": "step_s",
    "federation.virtual_dies": "dies",
    "federation.virtual_rejoins": "rejoins",
}


@dataclass(frozen=True)
class VirtualClock:
    """``step_s``: org id -> the virtual seconds one step of that org takes (default 1.0; 4.0 = four times slower);
    ``dies``: org id -> the virtual second it dies (its step in flight is lost, it stops counting in the staleness
    bound); ``rejoins``: org id -> the virtual second it comes back (after its death), at the current round."""

    step_s: Mapping[str, float] = field(default_factory=dict)
    dies: Mapping[str, float] = field(default_factory=dict)
    rejoins: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def from_bench(cls, fields: Mapping[str, Any]) -> VirtualClock:
        """The clock of a benchmark layer ``{"federation.virtual_step_s": {...}, ...}`` (:data:`BENCH_FIELDS`)."""
        unknown = sorted(set(fields) - set(BENCH_FIELDS))
        if unknown:
            raise ValueError(f"not a virtual clock field: {unknown} (one of {sorted(BENCH_FIELDS)})")
        return cls(**{BENCH_FIELDS[k]: {str(o): float(v) for o, v in (m or {}).items()} for k, m in fields.items()})

    def duration(self, org: str) -> float:
        """The virtual seconds of one step of ``org``."""
        return float(self.step_s.get(org, DEFAULT_STEP_S))

    def check(self, orgs: Iterable[str], staleness: int) -> None:
        """ValueError naming the field (its benchmark name) when an entry names an org not in the run, a duration is
        not finite and > 0, a fault time not finite and >= 0, an org rejoins no later than it dies, or a death is
        set in lock-step rounds (``staleness`` 0: the driver that kills is the asynchronous one)."""
        known = set(orgs)
        for name, attr in BENCH_FIELDS.items():
            values = getattr(self, attr)
            if unknown := sorted(set(values) - known):
                raise ValueError(f"{name} names orgs not in the run: {unknown}")
            steps = attr == "step_s"
            if bad := {o: s for o, s in values.items() if not (math.isfinite(s) and (s > 0 if steps else s >= 0))}:
                what = "step duration must be finite and > 0" if steps else "fault time must be finite and >= 0"
                raise ValueError(f"{name}: every {what}, got {bad}")
        if late := {o: t for o, t in self.rejoins.items() if not t > self.dies.get(o, math.inf)}:
            raise ValueError(f"federation.virtual_rejoins: an org rejoins only after its virtual_dies second: {late}")
        if staleness == 0 and self.dies:
            raise ValueError("federation.virtual_dies needs federation.staleness >= 1 (the asynchronous driver)")
