"""The worker side of the outcome guard (``trainer.outcome_guard``; the decisions are
:mod:`hacrl_fed.algorithm.outcome_guard`'s): the private validation split, the reference weights kept in a file,
the quarantine of foreign rows and the rollback.

* the split: ``val_size`` prompts of the task's **train** split, ids drawn with the org's private seed (the
  train/test partition keeps them apart from the held-out evaluation; the coordinator never sees which they are),
  and the **final split**: ``final_size`` more, apart from those, on which the last round's choice between the
  learner and its shadow is made (the validation split selected the learner's weights all run, so a second look
  at it would favour them);
* before the first update of a run the initial weights are validated and kept as the reference; after an update
  when validation is due the updated weights are validated and judged: a new reference replaces the file
  ``<run_dir>/orgs/<org>/guard/reference.pt`` (:class:`~hacrl_fed.worker.stash.Stash`: memory-mapped when read,
  so neither the reference nor the shadow stays in the learner's memory), and a rollback copies the reference's
  parameters and trainer state (optimizer, likelihood-screen history) back and syncs the engine;
* :meth:`OutcomeMonitor.leave_out` drops a quarantined source's rows before selection (ledger stage ``outcome``);
* with ``counterfactual`` on, a shadow of the learner trains on the learner's own rows alone
  (:mod:`hacrl_fed.worker.shadow`) and is validated on the same split every ``every``-th round and the last; the
  learner adopts its weights when
  :func:`hacrl_fed.algorithm.counterfactual.against_shadow` says so (``outcome/adopted``,
  ``outcome/<source>/blamed_counterfactual``).

The state lives in the org's ``guard/`` folder for the worker's current run and rides in the worker's checkpoints
(:meth:`OutcomeMonitor.state_dict`: the guard's verdict state in ``trainer.pt``, the reference's and the shadow's
files linked into the checkpoint's ``files/``, :mod:`hacrl_fed.worker.checkpoint_files`), so a worker resumed from
a checkpoint continues the guard of the run it left, shadow included; a checkpoint written without it (the guard off
then) starts the guard afresh from the restored weights.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hacrl_fed.algorithm import counterfactual
from hacrl_fed.algorithm.advantages import Capability
from hacrl_fed.algorithm.outcome_guard import OutcomeGuard, OutcomeParams, Verdict
from hacrl_fed.algorithm.sequential import prompts_read
from hacrl_fed.config import OutcomeGuardConfig
from hacrl_fed.perf import CpuTally
from hacrl_fed.seeding import stable_seed
from hacrl_fed.trainer import TrainRow
from hacrl_fed.types import Rollout
from hacrl_fed.worker.answers import Answers, Read, chunk, on_engine
from hacrl_fed.worker.checkpoint_files import LinkedFile
from hacrl_fed.worker.intake import Admitted, LeaveOut
from hacrl_fed.worker.learner import Learner
from hacrl_fed.worker.ledger import Ledger
from hacrl_fed.worker.shadow import Shadow
from hacrl_fed.worker.stash import Stash
from hacrl_fed.worker.weights import Saved


class OutcomeMonitor:
    """One learner's outcome guard with its validation split and reference weights (module doc)."""

    def __init__(
        self, cfg: OutcomeGuardConfig, *, seed: int, task: Any, prompts: Any, max_new_tokens: int, store: Path
    ):
        self.cfg, self.task, self.book, self.max_new_tokens, self.store = cfg, task, prompts, max_new_tokens, store
        rng = random.Random(stable_seed(seed, "outcome-validation"))
        # in the draw's order: a prefix is a random sample (the sequential test reads prefixes)
        ids = rng.sample(range(task.size("train")), min(cfg.val_size, task.size("train")))
        self.prompts = task.prompts("train", ids)
        final = _final_ids(seed, task.size("train"), cfg.final_size, set(ids)) if cfg.counterfactual else []
        self.final = task.prompts("train", final)  # the last round's choice with the shadow: none without it
        self.params = OutcomeParams(cfg.every, cfg.z, cfg.margin, cfg.probation, cfg.backoff)
        self.run_id: str | None = None
        self.guard = OutcomeGuard(self.params)
        self.reference = Stash(store / "reference.pt")
        self.saved = False  # a reference is stashed for run_id
        self.shadow: Shadow | None = None  # the counterfactual learner (None: off, or before the run's start)
        self.cpu = CpuTally("outcome")  # cpu/outcome_<part>: where the guard's CPU seconds go (guard_overhead.py)

    @classmethod
    def of(
        cls, cfg: OutcomeGuardConfig, *, seed: int, task: Any, prompts: Any, max_new_tokens: int, store: Path
    ) -> list[OutcomeMonitor]:
        """A learner's after-update extensions for the guard: its monitor (its private seed, task, prompt book,
        evaluation budget and folder for its files), or none when off."""
        if not cfg.enabled:
            return []
        return [cls(cfg, seed=seed, task=task, prompts=prompts, max_new_tokens=max_new_tokens, store=store)]

    def validate(self, engine: Any, context: int | None, prompts: Sequence[Any] | None = None) -> list[bool]:
        """Greedy correctness of the current weights on the validation split, or on ``prompts`` (the final split);
        a prompt that does not fit counts as wrong."""
        prompts = self.prompts if prompts is None else prompts
        with self.cpu("verify"):
            texts, lengths = self.book.tokens(prompts)
            keep = self.book.fitting(prompts, lengths, self.max_new_tokens, "generation.eval_max_new_tokens", context)
        with self.cpu("generate"):
            gens = engine.greedy([texts[i] for i in keep], max_new_tokens=self.max_new_tokens) if keep else []
        right = [False] * len(prompts)
        with self.cpu("verify"):
            for i, g in zip(keep, gens):
                right[i] = float(self.task.verify(g.text, prompts[i].reference)) >= 1.0
        return right

    def start(self, run_id: str, learner: Learner) -> dict[str, float]:
        """Before an update: a run this monitor has no reference of starts with the current weights validated and
        kept as the reference."""
        if run_id == self.run_id and self.saved:
            return {}
        t0 = time.perf_counter()
        self.run_id, self.guard = run_id, OutcomeGuard(self.params)
        right = Answers(self._live(learner, self.prompts)).upto(min(self.cfg.look, len(self.prompts)))
        self.guard.judge(0, right)  # its first look; the checks read further from the reference's file
        with self.cpu("stash"):
            self.reference.put(learner.live())
        self.saved = True
        # the shadow starts from the same weights and state: a second name of the reference's file, not a rewrite
        self.shadow = self._shadow_from(self.reference.file()) if self.cfg.counterfactual else None
        return {"outcome/reference_accuracy": _acc(right), "time/outcome_reference": time.perf_counter() - t0}

    def state_dict(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of this monitor: the run, the verdict state (plain data) and the reference's and
        shadow's files (:class:`~hacrl_fed.worker.checkpoint_files.LinkedFile`: a checkpoint links them in, it does
        not serialize their weights and optimizer state again); None before the run's reference exists."""
        if self.run_id is None or not self.saved:
            return None
        return {
            "run_id": self.run_id,
            "guard": self.guard.state(),
            "reference": self.reference.file(),
            "shadow": None if self.shadow is None else self.shadow.stash.file(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the guard :meth:`state_dict` described (a resumed worker): its run, verdict state, reference
        and shadow (a checkpoint's files, taken by link; a checkpoint written before ``files/`` holds them inline,
        ``{"params", "state"}``); a shadow the checkpoint lacks (counterfactual off then) starts from the reference."""
        self.run_id = str(state["run_id"])
        self.guard = OutcomeGuard.from_state(self.params, state["guard"])
        reference = _saved(state["reference"])
        if isinstance(reference, LinkedFile):
            self.reference.take(reference)
        else:
            self.reference.put(reference)
        self.saved = True
        shadow = state.get("shadow")
        if not self.cfg.counterfactual:
            self.shadow = None
        else:
            self.shadow = self._shadow_from(_saved(shadow) if shadow else reference)

    def _shadow_from(self, saved: Saved | LinkedFile) -> Shadow:
        return Shadow(self.store, saved, self.cfg.importance_clip, self.cpu)

    def leave_out(self, foreign: list[Rollout], round: int, ledger: Ledger) -> tuple[list[Rollout], dict[str, float]]:
        """The rows of sources the guard admits this round; ``outcome/<source>/...`` for every source offered."""
        admitted = {src: self.guard.admits(src, round) for src in sorted({str(r.org_id) for r in foreign})}
        dropped = Counter(str(r.org_id) for r in foreign if not admitted[str(r.org_id)])
        out: dict[str, float] = {}
        for src, ok in admitted.items():
            ledger.drop(src, "outcome", "quarantined", dropped[src])
            out[f"outcome/{src}/quarantined"] = float(not ok)
            out[f"outcome/{src}/dropped_quarantine"] = float(dropped[src])
            out[f"outcome/{src}/strikes"] = float(self.guard.strikes.get(src, 0))
        return [r for r in foreign if admitted[str(r.org_id)]], out

    def train_shadow(
        self, learner: Learner, rows: Sequence[TrainRow], index: int, capability: Capability
    ) -> dict[str, float]:
        """The shadow's update on the learner's own rows of this round (nothing with the counterfactual off)."""
        return self.shadow.train(learner, rows, index, capability) if self.shadow is not None else {}

    def after_update(self, round: int, last_round: int, trained: Sequence[str], learner: Learner) -> dict[str, float]:
        """Record the sources the update trained on; when due, validate (as many prompts as the sequential test
        reads), judge and apply the verdict, then check the counterfactual when it is due."""
        self.guard.trained(trained)
        if not self.guard.due(round, last_round):
            return {"outcome/validated": 0.0, **self.cpu.take()}
        t0 = time.perf_counter()
        current = Answers(self._live(learner, self.prompts))
        reference = Answers(self._stashed(learner, self.prompts, self.reference), self.guard.reference or ())
        n = self._read(reference, current, len(self.prompts), self.params.z, self.params.margin)
        self.guard.reference = list(reference.known)  # the reference's weights answered further: kept
        right = current.upto(n)
        shadow = Answers(self._shadowed(learner, self.prompts)) if self.shadow is not None else None
        gate = shadow.upto(n) if shadow is not None and self.guard.needs_shadow(right) else None
        verdict = self.guard.judge(round, right, gate)
        out = {**_verdict_metrics(verdict, right), "outcome/val_read": float(n)}
        if gate is not None:
            out["outcome/shadow_accuracy"] = _acc(gate)
        if verdict.rollback and self.saved:
            with self.cpu("stash"):
                learner.load_weights(self.reference.get())
            current = Answers(current.read, self.guard.reference or ())  # the weights now on the model
        elif verdict.new_reference:
            with self.cpu("stash"):
                self.reference.put(learner.live())
        out["time/outcome"] = time.perf_counter() - t0
        if shadow is not None and counterfactual.due(round, last_round, self.params.every):
            out.update(self._counterfactual(round, last_round, current, shadow, learner))
        return {**out, **self.cpu.take()}

    def _read(self, reference: Answers, current: Answers, budget: int, z: float, margin: int) -> int:
        """Prompts the sequential test reads of ``budget`` (:func:`hacrl_fed.algorithm.sequential.prompts_read`)."""

        def pairs(n: int) -> tuple[list[bool], list[bool]]:
            mine = current.upto(n)  # the weights on the model first, then the other ones
            return reference.upto(n), mine

        return prompts_read(
            pairs,
            budget=budget,
            look=self.cfg.look,
            z=z,
            margin=margin,
            futility=self.cfg.futility,
        )

    def _live(self, learner: Learner, prompts: Sequence[Any]) -> Read:
        """Read ``prompts[a:b]`` with the weights on the engine."""
        return lambda a, b: self._answer(learner, prompts, a, b)

    def _stashed(self, learner: Learner, prompts: Sequence[Any], stash: Stash) -> Read:
        """Read ``prompts[a:b]`` with a stash's parameters on the engine (the learner's put back)."""
        return lambda a, b: on_engine(
            learner, stash.params, lambda: self._answer(learner, prompts, a, b), lambda: self.cpu("swap")
        )

    def _shadowed(self, learner: Learner, prompts: Sequence[Any]) -> Read:
        """Read ``prompts[a:b]`` with the shadow's parameters on the engine."""
        shadow = self.shadow
        assert shadow is not None
        return lambda a, b: shadow.validate(learner, lambda engine, context: self._answer(learner, prompts, a, b))

    def _answer(self, learner: Learner, prompts: Sequence[Any], a: int, b: int) -> list[bool]:
        """:meth:`validate` on ``prompts[a:b]`` (the whole validation split as :meth:`validate`'s default)."""
        part = chunk(prompts, a, b)
        if part is self.prompts:
            return self.validate(learner.engine, learner.context)
        return self.validate(learner.engine, learner.context, part)

    def _counterfactual(
        self, round: int, last_round: int, learner_answers: Answers, shadow: Answers, learner: Learner
    ) -> dict[str, float]:
        """Compare the learner (``learner_answers``: the weights on the model) with its shadow, as far as the
        sequential test reads; on a verdict to adopt, the learner takes the shadow's weights. At the last round,
        with a final split, the two are compared on it instead (module doc)."""
        assert self.shadow is not None
        t0 = time.perf_counter()
        last = round >= last_round
        final: dict[str, float] = {}
        mine, against, budget = learner_answers, shadow, len(self.prompts)
        if last and self.final:
            mine, against = Answers(self._live(learner, self.final)), Answers(self._shadowed(learner, self.final))
            budget = len(self.final)
        z, margin = (self.cfg.last_z, 0) if last else (self.params.z, self.params.margin)
        n = self._read(against, mine, budget, z, margin)
        right, theirs = mine.upto(n), against.upto(n)
        if last and self.final:
            final = {"outcome/final_accuracy": _acc(right), "outcome/shadow_final_accuracy": _acc(theirs)}
        cf = counterfactual.against_shadow(
            theirs, right, z=self.params.z, margin=self.params.margin, last=last, last_z=self.cfg.last_z
        )
        quarantined: dict[str, int] = {}
        if cf.adopt:
            with self.cpu("stash"):
                self.shadow.adopted_by(learner)
                self.reference.put(learner.live())
            quarantined = self.guard.adopt(round, list(shadow.known), cf.strike)  # its answers read on the split
        out = {
            **({"outcome/shadow_accuracy": _acc(shadow.known)} if shadow.known else {}),
            "outcome/cf_lost": float(cf.comparison.lost),
            "outcome/cf_gained": float(cf.comparison.gained),
            "outcome/cf_read": float(n),
            "outcome/adopted": float(cf.adopt),
            "time/outcome_counterfactual": time.perf_counter() - t0,
            **final,
        }
        out.update({f"outcome/{src}/blamed_counterfactual": 1.0 for src in quarantined})
        out.update({f"outcome/{src}/quarantined_until": float(t) for src, t in quarantined.items()})
        return out


def _verdict_metrics(verdict: Verdict, right: Sequence[bool]) -> dict[str, float]:
    out = {
        "outcome/validated": 1.0,
        "outcome/val_accuracy": _acc(right),
        "outcome/lost": float(verdict.comparison.lost),
        "outcome/gained": float(verdict.comparison.gained),
        "outcome/rollback": float(verdict.rollback),
        "outcome/rebased": float(verdict.rebased),
        "outcome/new_reference": float(verdict.new_reference),
        "outcome/spared": float(bool(verdict.spared)),
    }
    out.update({f"outcome/{src}/quarantined_until": float(t) for src, t in verdict.quarantined.items()})
    out.update({f"outcome/{src}/spared": 1.0 for src in verdict.spared})
    return out


def _final_ids(seed: int, size: int, n: int, validation: set[int]) -> list[int]:
    """``n`` ids of the train split for the final split, drawn with the org's seed, apart from the validation ids
    (all the others when the split has fewer), in the draw's order."""
    rng = random.Random(stable_seed(seed, "outcome-final"))
    free = size - len(validation)
    if n >= free:
        ids = [i for i in range(size) if i not in validation]
        rng.shuffle(ids)
        return ids
    drawn: dict[int, None] = {}  # in the draw's order: a prefix is a random sample
    while len(drawn) < n:
        i = rng.randrange(size)
        if i not in validation:
            drawn[i] = None
    return list(drawn)


def _saved(part: LinkedFile | dict[str, Any]) -> Saved | LinkedFile:
    """A checkpoint's reference or shadow: its file, or (written before ``files/``) its weights and state inline."""
    return part if isinstance(part, LinkedFile) else (part["params"], part["state"])


def _acc(right: Sequence[bool]) -> float:
    return sum(right) / max(len(right), 1)


class GuardExtension:
    """The outcome guard as the learner round's extension (:mod:`hacrl_fed.worker.learner_round`): its reference
    and quarantine before admission, the shadow's update beside the learner's, the verdict after it."""

    def __init__(self, monitor: OutcomeMonitor, last_round: int):
        self.monitor, self.last_round = monitor, last_round

    def begin(self, run_id: str, round: int, learner: Learner) -> tuple[dict[str, float], LeaveOut]:
        """Before admission: the reference (validated before a run's first update) and this round's quarantine."""
        monitor = self.monitor
        return monitor.start(run_id, learner), lambda foreign, ledger: monitor.leave_out(foreign, round, ledger)

    def beside(self, learner: Learner, round: int, admitted: Admitted) -> dict[str, float]:
        """During the update (engine released): the shadow's update on the learner's own rows, no foreign one."""
        return self.monitor.train_shadow(learner, admitted.rows, admitted.learner, admitted.capability)

    def after(self, learner: Learner, round: int, admitted: Admitted) -> dict[str, float]:
        """After the update (engine synced): validate when due; a regression rolls the weights back."""
        trained = sorted({admitted.agents[r.source] for r in admitted.rows if not r.is_self})
        return self.monitor.after_update(round, self.last_round, trained, learner)
