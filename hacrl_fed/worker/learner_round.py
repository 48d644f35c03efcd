"""The learner's round in named phases (docs/ARCHITECTURE.md step 5): what :meth:`PolicyWorker.train` runs.

1. **begin**: each extension's state before admission (the outcome guard: its reference, validated before a run's
   first update, and the sources it quarantines this round);
2. **admit**: the intake (:mod:`hacrl_fed.worker.intake`), the one door for foreign rows;
3. **prepare**: the algorithm's pre-update pass over the admitted rows (:meth:`LocalTrainer.prepare`: what it scores
   once per row with the pre-update weights, e.g. the in-band baseline's step-0 ratios);
4. **update**: the trainer's optimizer steps (:meth:`LocalTrainer.update`), each extension's work beside it (the
   guard's shadow trains on the learner's own rows) while the engine is released, then the engine synced;
5. **after**: each extension after the update (the guard validates when due and may roll the weights back).

Extensions (:class:`Extension`) see the learner only through :class:`~hacrl_fed.worker.learner.Learner`.
Capability reaches the trainer in one form: per row where the rows come from several rounds (asynchronous
rounds), else one figure per agent (every row of the round ``t``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from hacrl_fed.cancel import raise_if_cancelled
from hacrl_fed.perf import PhaseMeter
from hacrl_fed.seeding import stable_seed
from hacrl_fed.types import Rollout, TrainRequest
from hacrl_fed.worker.intake import Admitted, LeaveOut, OwnRound, Scoring
from hacrl_fed.worker.late_rounds import LateRounds
from hacrl_fed.worker.learner import Learner
from hacrl_fed.worker.ledger import Ledger

# the PolicyWorker (hacrl_fed.worker.policy_worker), not imported: it imports this module (tests/test_layers.py)
PolicyWorker = Any


class Extension(Protocol):
    """Work a learner does around its update (the outcome guard: :class:`hacrl_fed.worker.outcome.GuardExtension`)."""

    def begin(self, run_id: str, round: int, learner: Learner) -> tuple[dict[str, float], LeaveOut]: ...

    def beside(self, learner: Learner, round: int, admitted: Admitted) -> dict[str, float]: ...

    def after(self, learner: Learner, round: int, admitted: Admitted) -> dict[str, float]: ...


@dataclass
class LearnerRound:
    """One train request's round at one learner (module doc)."""

    worker: PolicyWorker
    request: TrainRequest
    own: OwnRound

    def run(self) -> dict[str, float]:
        """Every phase in order; → the round's metrics for the TrainReport."""
        w, own = self.worker, self.own
        c0, perf = time.process_time(), PhaseMeter(w.device())
        metrics, leave_out = self.begin()
        admitted = self.admit(leave_out)
        metrics.update(perf.lap("score", admitted.scored_tokens))
        raise_if_cancelled("before the update")
        t1, c1 = time.perf_counter(), time.process_time()
        with w.engine.released():  # a vLLM engine may sleep during the update (generation.sleep_during_train)
            prepared = w.trainer.prepare(admitted.rows, admitted.agents)
            capability = admitted.row_capability or admitted.capability
            update = w.trainer.update(admitted.rows, admitted.learner, capability, admitted.agents, prepared)
            for ext in w.extensions:
                metrics.update(ext.beside(w, own.round, admitted))
        w.engine.sync_weights(w.model)
        for ext in w.extensions:
            metrics.update(ext.after(w, own.round, admitted))
        metrics = {**admitted.update_metrics(update), **metrics}
        metrics.update(perf.lap("train", update.get("train/num_tokens", 0.0)))
        c2 = time.process_time()  # cpu/...: this process's CPU seconds (all its threads), split as time/...
        metrics.update(admitted.metrics(self.request), **{"time/train": time.perf_counter() - t1})
        metrics.update({"cpu/update": c2 - c1, "cpu/train": c2 - c0})
        w.samples.record_train(self.request, own.prompts, admitted)  # samples.jsonl (hacrl_fed.worker.samples)
        return metrics

    def begin(self) -> tuple[dict[str, float], LeaveOut | None]:
        """Phase 1: each extension's metrics so far and its quarantine, chained (None: no extension)."""
        metrics: dict[str, float] = {}
        outs: list[LeaveOut] = []
        for ext in self.worker.extensions:
            m, leave_out = ext.begin(self.request.run_id, self.own.round, self.worker)
            metrics.update(m)
            outs.append(leave_out)
        return metrics, chain(outs) if outs else None

    def admit(self, leave_out: LeaveOut | None) -> Admitted:
        """Phase 2: the intake, lock-step or over the learner's recent rounds (asynchronous rounds)."""
        w, request, own = self.worker, self.request, self.own
        opener: Any  # the identity border's Opener, or its LateOpener (asynchronous rounds)
        late: LateRounds | None = None
        recent = w.recent_rounds
        if recent is not None:  # asynchronous rounds: each source batch against the plan of its own round
            opener = w.border.late_opener(own.run_id, recent, w.challenges.recent)
            late = LateRounds(w.intake, request, own, recent, opener=opener, leave_out=leave_out)
        else:
            opener = w.border.opener(own.run_id, own.round, own.fresh_digest)
        seed = stable_seed(w.seed, "select", own.round)
        scoring = Scoring.of(w.trainer)
        return w.intake.admit(request, own, seed=seed, opener=opener, scoring=scoring, leave_out=leave_out, late=late)


def chain(outs: Sequence[LeaveOut]) -> LeaveOut:
    """Several quarantines as one: each leaves out of what the previous ones admitted; their counts merged."""

    def leave_out(foreign: list[Rollout], ledger: Ledger) -> tuple[list[Rollout], dict[str, float]]:
        counts: dict[str, float] = {}
        for out in outs:
            foreign, c = out(foreign, ledger)
            counts.update(c)
        return foreign, counts

    return leave_out
