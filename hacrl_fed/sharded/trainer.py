"""The sharded learner's update: :class:`~hacrl_fed.trainer.LocalTrainer` over an FSDP2 copy of the model.

Every rank holds the round's whole rows (the request is the same on every rank and the intake is deterministic),
so the advantages, the group baselines, the row order, the mini-batch schedule and each micro-batch's weight in its
mini-batch (rows or tokens over the *whole* mini-batch) are the single-process ones. Only the forward/backward
passes of a mini-batch's micro-batches are split: rank ``r`` runs micro-batches ``r, r + N, ...``
(:func:`~hacrl_fed.sharded.fsdp.shares`), a rank with one fewer runs a stand-in pass scaled by 0 so the FSDP
collectives stay in step, and FSDP2 sums the gradients over the ranks (:func:`~hacrl_fed.sharded.fsdp.shard_model`):
the summed gradient is the single-process mini-batch gradient up to float round-off (the order of the sum). The
gradient clip uses the global norm (``clip_grad_norm_`` over DTensor gradients), AdamW steps on each rank's
shards, and the KL term's token mean is over the whole mini-batch's self tokens. No-gradient scoring (the intake's
likelihood screen, the rows without a gradient (which skip forward and backward), the step-0 ratios of
``algorithm.baseline_rows: in_band``) runs whole on every rank, so every rank takes the same decisions.

Two copies of the weights per rank: the FSDP2 shards (what trains, with the optimizer state) and a plain replica
with the whole weights (what the engine generates with, what a fresh run starts from); after each update the
replica is refreshed from the shards (``DTensor.full_tensor()``, :func:`~hacrl_fed.sharded.fsdp.copy_full_weights`).
With ``sharding.mixed_precision`` the shards (and AdamW) are float32 whatever the replica's dtype (e.g. a
bfloat16 replica with ``model.dtype: bfloat16``), FSDP2 computes forward and backward in bf16/fp16 and reduces
gradients in float32, and the replica receives the updated weights rounded to its dtype.
The KL reference is a plain frozen copy of the replica. Scoring runs through the model's own ``forward`` (FSDP2's
hooks gather each layer), never the hand-written native forward, which reads parameters directly.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence

import torch
from torch import Tensor

from hacrl_fed.algorithm.advantages import Capability
from hacrl_fed.algorithm.loss_inputs import Reweigh
from hacrl_fed.algorithm.pre_update import PreUpdate
from hacrl_fed.config import AlgorithmConfig, ShardingConfig, TrainerConfig
from hacrl_fed.sharded.fsdp import copy_full_weights, full_tensor, gather, shard_model, shares, world
from hacrl_fed.trainer import LocalTrainer, TrainRow
from hacrl_fed.update_metrics import MetricAccumulator


def rows_digest(rows: Sequence[TrainRow]) -> str:
    """A short digest of what an update trains on (each row's tokens, reward, group, source and claim), equal on
    every rank that admitted the same rows."""
    h = hashlib.sha256()
    for r in rows:
        h.update(repr((r.prompt_token_ids, r.response_ids, r.reward, r.group, r.source, r.is_self)).encode())
        h.update(repr((r.old_seq_log_prob, r.norm_length, r.claimed_log_prob_sum)).encode())
    return h.hexdigest()[:16]


class ShardedTrainer(LocalTrainer):
    """A learner's optimizer over the FSDP2 shards of ``replica``'s copy; ``replica`` keeps the whole weights."""

    def __init__(
        self,
        replica: torch.nn.Module,
        algo: AlgorithmConfig,
        trainer: TrainerConfig,
        pad_id: int,
        sharding: ShardingConfig,
    ):
        self.replica = replica
        self.rank, self.size = world()
        sharded = copy.deepcopy(replica)
        if sharding.mixed_precision != "off":  # float32 shards and AdamW; FSDP2 computes in the policy's dtype
            sharded = sharded.float()
        sharded = shard_model(sharded, sharding.mixed_precision, sharding.cpu_offload)
        super().__init__(sharded, algo, trainer, pad_id)

    @staticmethod
    def _native_forward(model, cfg, dropout) -> bool:
        return False  # FSDP2 gathers a layer's weights in its forward hook: the native forward would see shards

    def _reference_copy(self, model: torch.nn.Module) -> torch.nn.Module:
        return copy.deepcopy(self.replica).eval()  # a plain frozen copy of the whole weights

    def _rank_share(self, micro_batches: list[list[int]]) -> list[tuple[list[int], float]]:
        return shares(micro_batches, self.rank, self.size)

    def _across_ranks(
        self, acc: MetricAccumulator, loss_total: float, kl_total: float, lbar: Tensor | None
    ) -> tuple[float, float, Tensor | None]:
        """Sum the ranks' loss and KL shares, merge their metrics into ``acc``, and fill ``lbar`` [N] with the
        entries each rank scored (NaN elsewhere on each rank)."""
        parts = gather((acc.sums, acc.counts, loss_total, kl_total, None if lbar is None else lbar.cpu()))
        acc.sums, acc.counts = {}, {}
        for sums, counts, _, _, _ in parts:
            other = MetricAccumulator()
            other.sums, other.counts = sums, counts
            acc.merge(other)
        if lbar is not None:
            merged = parts[0][4]
            for _, _, _, _, theirs in parts[1:]:
                merged = torch.where(torch.isnan(merged), theirs, merged)
            lbar = merged.to(lbar.device)
        return sum(p[2] for p in parts), sum(p[3] for p in parts), lbar

    def _apply_gradient(self) -> Tensor:
        return full_tensor(super()._apply_gradient())  # the global norm (a replicated DTensor over the ranks)

    def update(
        self,
        rows: Sequence[TrainRow],
        learner: int,
        capability: Capability,
        names: Sequence[str] | None = None,
        prepared: PreUpdate | None = None,
        importance: Sequence[float] | None = None,
        reweigh: Reweigh | None = None,
    ) -> dict[str, float]:
        """:meth:`LocalTrainer.update` on the shards, then the replica refreshed from them (collective). The ranks
        first check they admitted the same rows (:func:`rows_digest`): a rank that took another decision would
        otherwise wait in a collective the others never reach."""
        digests = gather(rows_digest(rows))
        if len(set(digests)) > 1:
            raise RuntimeError(f"the ranks admitted different rows for this update (digests by rank: {digests})")
        out = super().update(rows, learner, capability, names, prepared, importance, reweigh)
        if out.get("train/steps", 0.0):
            copy_full_weights(self.model, self.replica)
        return out

    def state_dict(self) -> dict:
        """The trainer state but the optimizer's, which the checkpoint's shards hold
        (:mod:`hacrl_fed.sharded.checkpoint`)."""
        return {**super().state_dict(), "optimizer": None}

    def load_state_dict(self, state: dict) -> None:
        """Restore the trainer state; with a one-process checkpoint's optimizer state (keyed by position), the
        whole weights the replica was just given and that state go into the shards (collective)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        from hacrl_fed.sharded.dcp_files import named_optimizer_state

        if state.get("optimizer") is not None:
            whole = StateDictOptions(full_state_dict=True)
            set_model_state_dict(self.model, self.replica.state_dict(), options=whole)
            named = named_optimizer_state(state["optimizer"], self.replica)
            set_optimizer_state_dict(self.model, self.optimizer, named, options=whole)
        super().load_state_dict({**state, "optimizer": None})
