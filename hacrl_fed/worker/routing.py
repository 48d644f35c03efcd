"""Run routing of a long-lived policy worker: which run a request belongs to and how the worker gets there.

One worker serves run after run, each from the right starting point. It switches from the run it serves to
another run ``S`` only

* to *resume* ``S`` from its own latest checkpoint of ``S`` (weights, optimizer, RNG, round, and the outcome
  guard's state where it was on; the request guard then applies to ``S``), whatever request of ``S`` arrives; or
* to *start* ``S`` fresh, when ``S`` is a run it has never trained and the request is ``S``'s first one (the
  round-0 evaluation or the plan for round 1): the configured initial weights, a fresh optimizer and the initial
  RNG states, exactly as a newly started worker. The initial weights come from a CPU copy of the trainable
  parameters taken when the model was loaded (:meth:`RunRouting._snapshot`; for LoRA only the adapters: frozen
  weights never change), so a new run costs no model reload, and host memory holds one extra copy of what trains.

Any other request of another run is refused (``wrong_run``), and so is a run it trained but never checkpointed
(its state is gone). A worker that has served no run yet joins the first run it is asked for at any round (as a
newly started organization). Checkpoints are kept per run: ``<run dir>/orgs/<org>/checkpoints/<run id>/``;
``resume=True`` (``hacrl-fed worker --resume``) restores the run checkpointed last at start-up, other runs are
restored when their coordinator resumes them.

:class:`RunRouting` is the part of :class:`~hacrl_fed.worker.policy_worker.PolicyWorker` that does this; it works
on the worker's model, trainer and engine (``_new_trainer`` builds a fresh trainer).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path
from typing import Any

import torch

from hacrl_fed.security.freshness import ChallengeBook
from hacrl_fed.worker.async_checkpoint import ASYNC_KEY, restore_async_state, worker_async_state
from hacrl_fed.worker.checkpoint import (
    checkpoint_round,
    checkpoint_version,
    good_checkpoint,
    latest_run,
    load_checkpoint,
    run_checkpoint_root,
    save_checkpoint,
)
from hacrl_fed.worker.guard import RequestRefused, check_checkpoint
from hacrl_fed.worker.phase import in_phase
from hacrl_fed.worker.recent_rounds import RecentRounds

log = logging.getLogger(__name__)

OUTCOME_KEY = "outcome_guard"  # the outcome guard's state inside a checkpoint's trainer state (trainer.pt)


class RunRouting:
    """Snapshot, fresh start, route, enter, checkpoint and restore (module docstring)."""

    org_id: str
    model: Any
    trainer: Any
    engine: Any
    outcome: Any  # the outcome guard's monitor (hacrl_fed.worker.outcome), None when off
    ckpt_base: Path
    run_id: str | None
    last_round: int
    _trained: dict[str, int]
    _pristine: bool
    _own: Any
    _version: int
    _initial: tuple

    @property
    def recent_rounds(self) -> RecentRounds | None:  # pragma: no cover - PolicyWorker defines it
        """Asynchronous rounds: the worker's last W rounds; None: lock-step."""
        return None

    @property
    def challenges(self) -> ChallengeBook:  # pragma: no cover - PolicyWorker defines it
        raise NotImplementedError

    def _new_trainer(self) -> Any:  # pragma: no cover - PolicyWorker defines it
        raise NotImplementedError

    def _snapshot(self) -> tuple:
        """What a new run starts from: a CPU copy of the trainable parameters and the RNG states (module doc)."""
        params = {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters() if p.requires_grad}
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        return params, torch.get_rng_state(), random.getstate(), cuda

    def _start_fresh(self) -> None:
        """The configured initial weights, a fresh optimizer and the initial RNG states."""
        params, cpu_rng, py_rng, cuda_rng = self._initial
        if not self._pristine:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if name in params:
                        p.copy_(params[name])
            self.trainer = self._new_trainer()
            self.engine.sync_weights(self.model)
        torch.set_rng_state(cpu_rng)
        random.setstate(py_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        self._pristine = True

    def _route(self, run_id: str, first: bool, what: str) -> tuple[str, Path | None, int]:
        """How a request of ``run_id`` is served (no side effects): ``("same" | "resume" | "fresh", checkpoint,
        last round trained in that run)``. ``first``: the request is the first of a run (round-0 evaluation or
        round-1 plan). Refuses another run it may not switch to (module docstring)."""
        if run_id == self.run_id:
            return "same", None, self.last_round
        try:
            root = run_checkpoint_root(self.ckpt_base, run_id)
        except ValueError as err:
            raise RequestRefused("bad_run_id", str(err)) from None
        latest = good_checkpoint(root)  # a truncated or corrupt newest one: the one before (a warning line)
        if latest is not None:
            return "resume", latest, max(checkpoint_round(latest), self._trained.get(run_id, 0))
        if run_id in self._trained:
            raise RequestRefused(
                "wrong_run",
                f"worker {self.org_id!r} trained run {run_id!r} up to round "
                f"{self._trained[run_id]} without a checkpoint: it cannot go back to it",
            )
        if self.run_id is None or first:
            return "fresh", None, 0
        raise RequestRefused(  # never names the run it serves: a caller could then drive that run
            "wrong_run",
            f"worker {self.org_id!r} does not serve run {run_id!r}: it "
            f"starts another run only at its beginning (round-0 evaluation or round-1 plan) or "
            f"resumes one it has a checkpoint of, and got {what}",
        )

    def _enter(self, run_id: str, how: str, checkpoint: Path | None, last_round: int) -> None:
        """Switch to ``run_id`` as :meth:`_route` decided."""
        if how == "same":
            return
        if how == "resume":
            assert checkpoint is not None
            self._restore(checkpoint)
            log.info("worker %s resumed from %s (round %d)", self.org_id, checkpoint, last_round)
        else:
            if self.run_id is not None:
                log.info(
                    "worker %s: run %s starts from the configured initial weights (it served run %s)",
                    self.org_id,
                    run_id,
                    self.run_id,
                )
            self._start_fresh()
        self.run_id, self.last_round, self._own = run_id, last_round, None
        recent = self.recent_rounds
        if checkpoint is not None and recent is not None:  # asynchronous rounds
            self._own = restore_async_state(checkpoint, recent, self.challenges)
        # updates done in this run: the checkpoint's (a rejoin after a restart adopts it), else one per round trained
        saved = checkpoint_version(checkpoint) if checkpoint is not None else None
        self._version = last_round if saved is None else saved

    @in_phase("checkpoint")
    def checkpoint(self, round: int) -> str:
        """Checkpoint the round just trained into this run's folder, ``<run dir>/orgs/<org>/checkpoints/<run id>``."""
        check_checkpoint(self.org_id, round, last_round=self.last_round)
        assert self.run_id is not None  # last_round > 0: a run was trained
        extra = {"org_id": self.org_id, "last_round": self.last_round, "run_id": self.run_id, "version": self._version}
        recent = self.recent_rounds
        if recent is not None:  # asynchronous rounds: what a resume needs besides
            extra[ASYNC_KEY] = worker_async_state(self._own, recent, self.challenges)
        return str(self._save(run_checkpoint_root(self.ckpt_base, self.run_id), round, extra))

    def _save(self, root: Path, round: int, extra: dict[str, Any]) -> Path:
        """Write the checkpoint of ``round`` under ``root`` (the sharded worker writes its shards instead)."""
        return save_checkpoint(root, round, self.model, self._trainer_state(), extra, keep=self._keep())

    def _keep(self) -> int:
        """Checkpoints kept: two, and in asynchronous rounds ``K + 3``: a resume may go back to the one its
        coordinator's last quiescent state counts on (:func:`hacrl_fed.coordinator.async_state.align_checkpoints`)."""
        staleness = getattr(getattr(self, "cfg", None), "federation", None)
        return 2 if staleness is None or staleness.staleness < 1 else staleness.staleness + 3

    def _trainer_state(self) -> dict[str, Any]:
        """The trainer's state and, with the outcome guard on, the guard's (``OUTCOME_KEY``), for a checkpoint."""
        state = self.trainer.state_dict()
        guard = self.outcome.state_dict() if self.outcome is not None else None
        return {**state, OUTCOME_KEY: guard} if guard is not None else state

    def restore(self) -> int:
        """Resume the run checkpointed last (``resume=True``), if any; returns its round (0 when none)."""
        found = latest_run(self.ckpt_base)
        if found is None:
            return 0
        run_id, path = found
        self._enter(run_id, "resume", path, max(checkpoint_round(path), self._trained.get(run_id, 0)))
        return self.last_round

    def _restore(self, path: Path) -> None:
        """Weights, optimizer state and RNG states of checkpoint ``path``."""
        trainer_state, _ = load_checkpoint(path, self.model)
        guard = trainer_state.pop(OUTCOME_KEY, None)
        self.trainer.load_state_dict(trainer_state)
        if guard is not None and self.outcome is not None:
            self.outcome.load_state_dict(guard)
        self.engine.sync_weights(self.model)
        self._pristine = False
