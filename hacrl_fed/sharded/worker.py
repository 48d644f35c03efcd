"""The collective policy worker: :class:`ShardedPolicyWorker`, one org's worker over ``N`` ranks.

Same constructor and the same :class:`~hacrl_fed.worker.api.WorkerAPI` methods as
:class:`~hacrl_fed.worker.policy_worker.PolicyWorker`, but every method is *collective*: ``torch.distributed`` is
initialised by the caller (torchrun's environment, the endpoint side), and every rank calls the same method with
the same request in the same order. Each rank then runs the same checks, the same intake and the same bookkeeping
on the same request, so they all take the same decisions; the one random input to those decisions, the replay
challenge a TrainReport issues, is drawn on rank 0 and broadcast (:class:`RankChallengeBook`), and one is agreed at
construction so that ``health`` (rank 0 alone) never has to issue one; rank 0's return value is the org's reply
(the other ranks return the same value, signed alike). Collective: ``step``, ``evaluate``, ``checkpoint`` (and the
deprecated ``generate`` / ``train`` halves); construction with ``resume=True`` too. ``health`` is local (no
collective): rank 0 may answer it alone.

What is split over the ranks: the update (FSDP2 shards of the trainable weights and optimizer state, each rank's
share of a mini-batch's micro-batches, :mod:`hacrl_fed.sharded.trainer`), the evaluation's engine batches, and
the sampling's single random stream on rank 0 (:mod:`hacrl_fed.sharded.generation`). With one process (no
process group, or a group of one) it *is* a :class:`PolicyWorker`: the same trainer, engine and checkpoints.

Supported: the ``hf`` and ``fast`` engines (each rank generates with a plain replica of the whole weights). The
``vllm`` engine with ``sharding.ranks > 1`` (vLLM tensor parallelism over the org's GPUs) is not implemented and
is refused (:func:`check_supported`, before any worker starts: :mod:`hacrl_fed.refusals`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hacrl_fed.config import ConfigError, RunConfig
from hacrl_fed.refusals import check_sharded_org, org_field
from hacrl_fed.security.freshness import ChallengeBook
from hacrl_fed.sharded.checkpoint import load_sharded, save_sharded
from hacrl_fed.sharded.fsdp import broadcast, copy_full_weights, world
from hacrl_fed.sharded.generation import RankEngine
from hacrl_fed.sharded.trainer import ShardedTrainer
from hacrl_fed.trainer import LocalTrainer
from hacrl_fed.worker.checkpoint import SHARDED_DIR, load_checkpoint, load_trainer_state
from hacrl_fed.worker.policy_worker import PolicyWorker


def check_supported(cfg: RunConfig, org_id: str, world_size: int | None = None) -> None:
    """ConfigError naming the field when org ``org_id``'s worker cannot run sharded as configured
    (:func:`hacrl_fed.refusals.check_sharded_org`, the rule the coordinator's preflight checks too), or a process
    group whose size is not ``sharding.ranks``."""
    check_sharded_org(cfg, org_id)
    ranks = cfg.org(org_id).sharding.ranks
    if world_size is not None and world_size != ranks:
        raise ConfigError(
            f"{org_field(cfg, org_id, 'sharding.ranks')}={ranks} (org {org_id!r}) but the worker's process group has "
            f"{world_size} ranks"
        )


class RankChallengeBook(ChallengeBook):
    """The replay challenges of a worker over ranks: rank 0's fresh challenge on every rank (collective
    :meth:`issue`), so that every rank expects the challenge the org's reply carried."""

    def issue(self) -> bytes:
        self.latest = broadcast(super().issue())
        return self.latest


class ShardedPolicyWorker(PolicyWorker):
    """One organization's worker as one rank of its process group (module docstring); collective methods."""

    def __init__(self, cfg: RunConfig, org_id: str, *, run_dir: str | Path, resume: bool = False):
        self.rank, self.world_size = world()
        check_supported(cfg, org_id, self.world_size)
        self.sharding = cfg.org(org_id).sharding
        super().__init__(cfg, org_id, run_dir=run_dir, resume=resume)
        self.samples.enabled = self.samples.enabled and self.rank == 0  # one writer of samples.jsonl per org
        if self.world_size > 1:
            self.engine = RankEngine(self.engine)
            self._challenges = RankChallengeBook()
            self._challenges.issue()  # agreed now: Health (rank 0 alone) reports it instead of issuing one

    @property
    def sharded(self) -> bool:
        """Whether the update is sharded over several ranks (a group of one trains as one process)."""
        return self.world_size > 1

    def _new_trainer(self) -> LocalTrainer:
        if not self.sharded:
            return super()._new_trainer()
        return ShardedTrainer(self.model, self.cfg.algorithm, self.trainer_cfg, self.pad_id, self.sharding)

    def _save(self, root: Path, round: int, extra: dict[str, Any]) -> Path:
        if not self.sharded:
            return super()._save(root, round, extra)
        return save_sharded(root, round, self.trainer.model, self.trainer.optimizer, self.trainer.state_dict(), extra)

    def _restore(self, path: Path) -> None:
        """Weights, optimizer and RNG states of checkpoint ``path``, written at any ``N``: a sharded checkpoint's
        shards straight into this rank's shards; a one-process checkpoint through the whole weights."""
        if not self.sharded:
            return super()._restore(path)
        if (path / SHARDED_DIR).is_dir():
            load_sharded(path, self.trainer.model, self.trainer.optimizer)
            copy_full_weights(self.trainer.model, self.model)
            trainer_state = load_trainer_state(path)
        else:
            trainer_state, _ = load_checkpoint(path, self.model)
        self.trainer.load_state_dict(trainer_state)
        self.engine.sync_weights(self.model)
        self._pristine = False
