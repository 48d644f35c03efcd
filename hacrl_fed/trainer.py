"""Local training: one round's policy update of one learner on its own and (for HACPO/naive) foreign rows.

Rows are already tokenized with the learner's tokenizer. Updates follow docs/ALGORITHM.md "Loss and update schedule":
advantages over the joint groups, rows ordered self first then cross by source, no shuffle, one AdamW step per
mini-batch (grad-norm clip), mini-batches split into micro-batches for memory with exact loss weighting.

Numerics (``trainer.precision``): ``model`` trains in the model's own dtype; ``bf16-autocast`` keeps float32
weights and optimizer states and runs forward/backward under ``torch.autocast(bfloat16)``; ``bf16-master`` keeps the
model (what the ``hf`` engine generates with) in bfloat16 and gives AdamW a float32 master copy of the trainable
weights: bf16 grads are upcast onto the masters, AdamW steps in float32 and the result is rounded back into the
model. Every tensor of the loss lives on the model's device (``model.device`` from the config: CPU or CUDA).

The model stays in eval mode (dropout off): the importance ratios compare one sequence under two forward passes.
Only a LoRA adapter's own dropout is on, during the update's forward passes (:mod:`hacrl_fed.models.training_mode`).

What an algorithm needs (capability cross weights, token-level inputs and weighting) comes from its registry spec
(:class:`~hacrl_fed.algorithm.AlgorithmSpec`); the loss configuration is built once from the algorithm config
(:meth:`~hacrl_fed.algorithm.PolicyLossConfig.from_algorithm`). :meth:`LocalTrainer.update` optimizes exactly the
rows it is given (the worker's intake chose them); a row without tokens counts in its group's advantage statistics
and is not trained on. The trainer hands the intake its scorer (:meth:`LocalTrainer.log_prob_sums`) and keeps the
likelihood screen's per-source history with its checkpointed state.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from hacrl_fed.algorithm import (
    PolicyLossConfig,
    PolicyLossInputs,
    advantage_metrics,
    capability_coefficients,
    capability_per_row,
    fractions_from_counts,
    get_advantage_estimator,
    get_algorithm,
    get_gradient_rows,
    get_policy_loss,
    kl_k3,
    minibatch_schedule,
    name_sources,
    order_rows,
)
from hacrl_fed.algorithm.advantages import Capability
from hacrl_fed.algorithm.likelihood_screen import GapHistory
from hacrl_fed.algorithm.loss_inputs import Reweigh, loss_inputs, on_policy, sequence_inputs
from hacrl_fed.algorithm.pre_update import PreUpdate, pre_update
from hacrl_fed.config import AlgorithmConfig, TrainerConfig
from hacrl_fed.models.context import context_length
from hacrl_fed.models.native import unsupported_reason
from hacrl_fed.models.training_mode import adapter_dropout, adapter_dropout_modules, checkpoint_layers
from hacrl_fed.refusals import check_precision
from hacrl_fed.scoring import ScoringBatch, build_scoring_batch_from_ids, token_log_probs
from hacrl_fed.train_rows import TrainRow
from hacrl_fed.update_metrics import MetricAccumulator

__all__ = ["LocalTrainer", "TrainRow"]  # TrainRow: hacrl_fed.train_rows, here too for the modules that import it

log = logging.getLogger(__name__)


class LocalTrainer:
    """Owns the optimizer (and a frozen reference model when ``kl_beta > 0``) of one learner."""

    def __init__(self, model: torch.nn.Module, algo: AlgorithmConfig, trainer: TrainerConfig, pad_id: int):
        self.model, self.algo, self.cfg, self.pad_id = model, algo, trainer, int(pad_id)
        self.spec = get_algorithm(algo.name)
        self.loss_fn = get_policy_loss(self.spec.loss)
        self.gradient_rows = get_gradient_rows(self.spec.loss)  # only the rows with a gradient run backward
        self.loss_cfg = PolicyLossConfig.from_algorithm(algo)
        self.by_tokens = self.spec.token_level  # micro-batch weights: tokens (GRPO's token mean) or rows
        self.context = context_length(model)[0]  # rows longer than this cannot be scored (the intake's last stage)
        self.dropout = adapter_dropout_modules(model)  # trainer.lora.dropout: on during the update's forwards
        self.native = self._native_forward(model, trainer, self.dropout)  # the hand-written forward where it applies
        params = [p for p in model.parameters() if p.requires_grad]
        self.model_params = params
        self.master = self._master_weights(params, trainer.precision)  # fp32 copies (bf16-master) or None
        self.optimizer = torch.optim.AdamW(
            self.master if self.master is not None else params,
            lr=trainer.lr,
            betas=(trainer.betas[0], trainer.betas[1]),
            weight_decay=trainer.weight_decay,
        )
        self.screen_history: dict[str, GapHistory] = {}  # per source name: its claimed-minus-learner gap so far
        self._reweigh: Reweigh | None = None  # during an update with ``reweigh`` (update's doc)
        self.ref_model = None
        if algo.kl_beta > 0:
            self.ref_model = self._reference_copy(model)
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        if trainer.gradient_checkpointing:
            checkpoint_layers(model)  # after the deepcopy above (see checkpoint_layers)

    @staticmethod
    def _native_forward(model: torch.nn.Module, cfg: TrainerConfig, dropout: Sequence[torch.nn.Module]) -> bool:
        """Whether the update scores with the hand-written forward (:mod:`hacrl_fed.models.native`): float32
        weights, ``trainer.precision: model``, no gradient checkpointing, no adapter dropout, a supported model."""
        return (
            cfg.precision == "model"
            and not cfg.gradient_checkpointing
            and not dropout
            and all(p.dtype == torch.float32 for p in model.parameters())
            and unsupported_reason(model) is None
        )

    @staticmethod
    def _master_weights(params: Sequence[torch.Tensor], precision: str) -> list[torch.Tensor] | None:
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        check_precision(precision, dtypes)  # hacrl_fed.refusals: the preflight checks it before any worker starts
        if precision == "bf16-master":
            return [p.detach().float().clone().requires_grad_(True) for p in params]
        if precision == "model" and any(d in ("bfloat16", "float16") for d in dtypes):
            log.warning(
                "trainer.precision=model with %s weights: AdamW runs in half precision and drops updates "
                "below its resolution; consider trainer.precision: bf16-master",
                dtypes,
            )
        return None

    def _autocast(self, device: torch.device):
        if self.cfg.precision != "bf16-autocast":
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    def prepare(self, rows: Sequence[TrainRow], names: Sequence[str] | None = None) -> PreUpdate:
        """The algorithm's pre-update pass over ``rows`` with the current weights (:mod:`hacrl_fed.algorithm.
        pre_update`; nothing for most): what the advantages need scored once per row before the first step."""
        return pre_update(rows, self.algo, self.loss_cfg, self.log_prob_sums, names)

    def advantages(
        self, rows: Sequence[TrainRow], learner: int, capability: Capability, prepared: PreUpdate | None = None
    ) -> Tensor:
        """Advantages of ``rows`` (docs/ALGORITHM.md §2, or plain group normalisation for the baselines). → [N].
        ``capability``: one ``Phat`` per agent, or per row the figures of the row's round
        (:func:`~hacrl_fed.algorithm.capability_per_row`); ``prepared``: the pre-update pass's result (the rows the
        group statistics are taken over)."""
        rewards = torch.tensor([r.reward for r in rows], dtype=torch.float64)
        groups, sources = torch.tensor([r.group for r in rows]), torch.tensor([r.source for r in rows])
        a = self.algo
        opts: dict[str, Any] = dict(reward_max=a.reward_max, ratio_min=a.ratio_min, ratio_max=a.ratio_max)
        opts.update(prepared.advantage_options() if prepared is not None else {})
        fn = get_advantage_estimator(self.spec.advantage)
        return fn(rewards, groups, sources, learner, capability, **opts, calibrate=a.advantage_calibration).float()

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
        """One round's update. ``learner``: this agent's index among the agents; ``capability``: one ``Phat`` per
        agent, or per row of ``rows`` the figures of its round (asynchronous rounds; docs/ALGORITHM.md "Capability
        per round"); ``names``: agent names for the per-source metrics (``hacpo/adv_mean/<name>``); ``prepared``: the
        pre-update pass over ``rows`` (None: :meth:`prepare` runs it now); ``importance``: a weight ``w_i >= 0`` per
        row that multiplies its advantage, ``A_i <- w_i * A_i`` (the outcome guard's shadow learning from rows another
        policy sampled, :mod:`hacrl_fed.worker.shadow`; for ``w >= 0``, ``min(s w A, clip(s) w A) = w min(s A,
        clip(s) A)``: the row's loss term times ``w``; None: ones); ``reweigh``: the rows are their own old policy
        and each advantage is reweighed in the forward (:func:`~hacrl_fed.algorithm.loss_inputs.on_policy`: the
        shadow without its scoring pass), for an update of one optimizer step only (:meth:`one_step`); its rows with
        ``A = 0`` (a group whose rewards are all equal: every estimator's advantage there) run no forward or backward,
        as they add exactly nothing to the gradient (the mini-batch's weights still count them; the loss and metrics
        are then those of the rows with a gradient)."""
        if reweigh is not None and not self.one_step(len(rows)):
            raise ValueError(f"reweigh needs one optimizer step; {len(rows)} rows take more (one_step)")
        self._reweigh = reweigh
        try:
            return self._update(rows, learner, capability, names, prepared, importance)
        finally:
            self._reweigh = None

    def one_step(self, n_rows: int) -> bool:
        """Whether an update of ``n_rows`` rows takes a single optimizer step (one epoch, one mini-batch)."""
        return self.cfg.epochs == 1 and n_rows <= self.cfg.minibatch_size

    def _update(
        self,
        rows: Sequence[TrainRow],
        learner: int,
        capability: Capability,
        names: Sequence[str] | None,
        prepared: PreUpdate | None,
        importance: Sequence[float] | None,
    ) -> dict[str, float]:
        """:meth:`update`'s body."""
        start = time.perf_counter()
        if not rows:
            return {"train/steps": 0.0, "train/num_rows": 0.0}
        # every response counts in its joint group's statistics, even one with no tokens to train on
        prepared = self.prepare(rows, names) if prepared is None else prepared
        adv_all = self.advantages(rows, learner, capability, prepared)
        adv_all = adv_all if importance is None else adv_all * torch.tensor(importance, dtype=adv_all.dtype)
        scorable = [i for i, r in enumerate(rows) if r.response_ids]
        train_rows, adv = [rows[i] for i in scorable], adv_all[scorable]
        if not train_rows:
            return {"train/steps": 0.0, "train/num_rows": 0.0}
        v = self._coefficients(rows, learner, capability, scorable)
        out = self._optimize(train_rows, adv, v, names)
        if names is not None:
            out.update(advantage_metrics(adv_all, torch.tensor([r.source for r in rows]), names, prefix=self.algo.name))
        out.update(prepared.metrics)
        out["train/adv_abs_mean"] = float(adv.abs().mean())
        out["time/update"] = time.perf_counter() - start
        return out

    def _coefficients(
        self, rows: Sequence[TrainRow], learner: int, capability: Capability, scorable: Sequence[int]
    ) -> Tensor:
        """``v(j, k)`` [S] of the trained rows ``scorable`` (ones where the algorithm has none or it is off)."""
        if not (self.spec.uses_capability_coefficient and self.algo.capability_coefficient):
            return torch.ones(len(scorable))
        sources = torch.tensor([r.source for r in rows])
        lc, sc = capability_per_row(capability, learner, sources)
        return capability_coefficients(
            (lc[scorable], sc[scorable]), learner, sources[scorable], self.algo.ratio_min, self.algo.ratio_max
        )

    def _optimize(self, rows: list[TrainRow], adv: Tensor, v: Tensor, names: Sequence[str] | None) -> dict[str, float]:
        """The mini-batch schedule over ``rows`` (self first, then cross by source; no shuffle): one :meth:`_step`
        per mini-batch. → the update's metrics, shares over the whole update (not means of per-step shares)."""
        sources, is_self = torch.tensor([r.source for r in rows]), torch.tensor([r.is_self for r in rows])
        perm = order_rows(is_self, sources).tolist()
        acc = MetricAccumulator()
        schedule = minibatch_schedule(len(rows), self.cfg.minibatch_size, self.cfg.epochs)
        for step, idx in schedule:
            picked = [perm[i] for i in idx.tolist()]
            # the adapters' dropout is on through forward and backward (gradient checkpointing recomputes in backward)
            with adapter_dropout(self.dropout):
                acc.add(self._step(step, [rows[i] for i in picked], adv[picked], is_self[picked], v[picked]))
        out = fractions_from_counts(name_sources(acc.result(), names))
        out.update(
            {
                "train/steps": float(len(schedule)),
                "train/num_rows": float(len(rows)),
                "train/num_self": float(is_self.sum()),
                "train/num_cross": float((~is_self).sum()),
            }
        )
        return out

    def log_prob_sums(self, rows: Sequence[TrainRow]) -> list[float]:
        """The learner's sequence log-prob sums ``sum_t log p(y_t)`` of ``rows`` [N] with the current weights, no
        gradient: the update's own scoring path (sorted micro-batches, the native forward, each prompt once). The
        scorer the intake's likelihood screen and the pre-update pass are handed."""
        sums: dict[int, float] = {}
        for micro_idx, tok_lp in self._scored(rows):
            sums.update(zip(micro_idx, tok_lp.double().sum(-1).tolist()))
        return [sums[i] for i in range(len(rows))]

    def token_log_prob_lists(self, rows: Sequence[TrainRow]) -> list[list[float]]:
        """The learner's per-token log-probs of each row's response with the current weights, no gradient (the
        same path as :meth:`log_prob_sums`); the outcome guard's shadow re-scores its rows with it."""
        out: dict[int, list[float]] = {}
        for micro_idx, tok_lp in self._scored(rows):
            out.update((i, tok_lp[j, : len(rows[i].response_ids)].tolist()) for j, i in enumerate(micro_idx))
        return [out[i] for i in range(len(rows))]

    def _scored(self, rows: Sequence[TrainRow]):
        """``(micro_idx, token_log_probs [b, T])`` per sorted micro-batch of ``rows``, no gradient (left-aligned)."""
        device = next(self.model.parameters()).device
        with torch.no_grad():
            for micro_idx in self._micro_batches(rows, range(len(rows))):
                batch = build_scoring_batch_from_ids(
                    [rows[i].prompt_token_ids for i in micro_idx],
                    [rows[i].response_ids for i in micro_idx],
                    self.pad_id,
                )
                with self._autocast(device):
                    tok_lp, _ = token_log_probs(self.model, batch, native=self.native)  # no dropout: a score
                yield micro_idx, tok_lp

    def _step(self, step: int, rows: list[TrainRow], adv: Tensor, is_self: Tensor, v: Tensor) -> dict[str, float]:
        """Optimizer step ``step`` of the round (counted across epochs) over one mini-batch, accumulated over
        micro-batches.

        With a gradient-rows function for the loss (:meth:`_gradient_rows`), the
        foreign rows are scored without gradient first and only the rows the loss has a gradient for (every self
        row, the foreign rows inside the band) run forward and backward; each micro-batch's loss is weighted by its
        share of the whole mini-batch's rows, so the gradient is the mini-batch's. The loss value and the metrics
        are then computed over all rows of the mini-batch at once from their detached ``lbar``.
        """
        self._zero_grad(self.optimizer)
        device = next(self.model.parameters()).device
        adv, is_self, v = adv.to(device), is_self.to(device), v.to(device)
        total_tokens = sum(len(r.response_ids) for r in rows)
        self_tokens = sum(len(r.response_ids) for r in rows if r.is_self)
        lbar = self._gradient_rows(step, rows, adv, is_self, v, device)  # [N] detached lbar of scored rows, or None
        train = list(range(len(rows))) if lbar is None else torch.isnan(lbar).nonzero().flatten().tolist()
        if self._reweigh is not None:  # A = 0 (a group of equal rewards): no gradient, no pass (update's doc)
            train = [i for i in train if float(adv[i]) != 0.0]
        acc = MetricAccumulator()
        loss_total, kl_total = 0.0, 0.0
        for micro_idx, scale in self._rank_share(self._micro_batches(rows, train)):
            sel, batch, inputs = self._score_micro(rows, micro_idx, adv, is_self, v)
            micro, lp, mask = [rows[i] for i in micro_idx], inputs.token_log_probs, inputs.response_mask
            loss, metrics = self.loss_fn(inputs, step, self.loss_cfg)
            # exact mini-batch mean from micro-batch means: weight by rows (or tokens for token-mean GRPO)
            weight = float(mask.sum()) / total_tokens if self.by_tokens else len(micro) / len(rows)
            objective = loss * weight
            if self.ref_model is not None and self_tokens > 0:
                kl_term = self._kl_sum(batch, lp, mask, is_self[sel]) / self_tokens  # token mean over self tokens
                objective = objective + self.algo.kl_beta * kl_term
                kl_total += kl_term.item() * scale
            (objective if scale == 1.0 else objective * scale).backward()
            if not scale:  # a stand-in pass of a rank with fewer micro-batches (_rank_share): no gradient, no metric
                continue
            if lbar is None:
                loss_total += loss.item() * weight
                acc.add(metrics, weight=len(micro))
            else:
                lbar[sel] = inputs.seq_log_probs().detach().float()
        loss_total, kl_total, lbar = self._across_ranks(acc, loss_total, kl_total, lbar)
        if lbar is not None:  # the loss and metrics of every row, from the lbar scored with and without gradient
            loss, metrics = self.loss_fn(sequence_inputs(rows, lbar, adv, is_self, v), step, self.loss_cfg)
            loss_total = loss.item()
            acc.add(metrics, weight=len(rows))
        if not train:  # no row has a gradient: a zero gradient, as the full pass would have given
            for p in self.model_params:
                p.grad = torch.zeros_like(p)
        grad_norm = self._apply_gradient()
        out = acc.result()
        out.update(
            {
                "train/loss": loss_total,
                "train/grad_norm": float(grad_norm),
                "train/kl": kl_total,
                "train/num_tokens": float(sum(len(r.prompt_token_ids) + len(r.response_ids) for r in rows)),
                "train/num_backward": float(len(train)),
            }
        )
        return out

    def _zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """Clear ``optimizer``'s grads and the model's own (its params are not the optimizer's in bf16-master)."""
        optimizer.zero_grad(set_to_none=True)
        for p in self.model_params:
            p.grad = None

    def _apply_gradient(self) -> Tensor:
        """Clip the accumulated gradient and take the update's AdamW step (:meth:`_clip_and_step`)."""
        return self._clip_and_step(self.optimizer)

    def _clip_and_step(self, optimizer: torch.optim.Optimizer) -> Tensor:
        """Clip the accumulated gradient and take ``optimizer``'s step (through the float32 masters in bf16-master);
        returns the gradient norm before clipping."""
        if self.master is not None:  # bf16 grads -> float32 masters
            for p, master in zip(self.model_params, self.master):
                master.grad = None if p.grad is None else p.grad.detach().float()
                p.grad = None
        grad_norm = torch.nn.utils.clip_grad_norm_(
            [p for g in optimizer.param_groups for p in g["params"]], self.cfg.grad_clip
        )
        optimizer.step()
        if self.master is not None:  # float32 masters -> bf16 model weights
            with torch.no_grad():
                for p, master in zip(self.model_params, self.master):
                    p.copy_(master)
        return grad_norm

    def _rank_share(self, micro_batches: list[list[int]]) -> list[tuple[list[int], float]]:
        """The micro-batches of a mini-batch this process runs forward and backward, each with its scale (1: its
        own; 0: a stand-in pass that keeps the ranks' collectives in step). One process: all of them, scale 1;
        the sharded trainer (:mod:`hacrl_fed.sharded.trainer`) hands each rank its share."""
        return [(m, 1.0) for m in micro_batches]

    def _across_ranks(
        self, acc: MetricAccumulator, loss_total: float, kl_total: float, lbar: Tensor | None
    ) -> tuple[float, float, Tensor | None]:
        """The mini-batch's loss, KL and metrics (into ``acc``) and ``lbar`` [N] summed over the ranks that each
        ran a share of its micro-batches; one process: as they are."""
        return loss_total, kl_total, lbar

    def _reference_copy(self, model: torch.nn.Module) -> torch.nn.Module:
        """The frozen KL reference: a copy of the model as it is now (``algorithm.kl_beta > 0``)."""
        return copy.deepcopy(model).eval()

    def _micro_batches(self, rows: Sequence[TrainRow], index: Sequence[int]) -> list[list[int]]:
        """``index`` in micro-batches of ``trainer.micro_batch_size`` rows; when it takes more than one, the rows
        are ordered by prompt, then response length (stable), so a micro-batch holds few distinct prompts (each
        runs once under the native forward) and pads to similar responses."""
        size = self.cfg.micro_batch_size
        order = list(index)
        if len(order) > size:
            order.sort(key=lambda i: (rows[i].prompt_token_ids, len(rows[i].response_ids)))
        return [order[s : s + size] for s in range(0, len(order), size)]

    def _score_micro(
        self, rows: Sequence[TrainRow], micro_idx: Sequence[int], adv: Tensor, is_self: Tensor, v: Tensor
    ) -> tuple[Tensor, ScoringBatch, PolicyLossInputs]:
        """One micro-batch through the model (with gradient when grad is enabled): its row index ``sel`` [M] on the
        model's device, its :class:`ScoringBatch` and the loss inputs (``token_log_probs`` [M, T] and the rest)."""
        micro = [rows[i] for i in micro_idx]
        sel = torch.tensor(list(micro_idx), device=adv.device, dtype=torch.long)
        batch, lp, mask = self._forward(micro)
        inputs = loss_inputs(
            micro, lp, mask, adv[sel], is_self[sel], v[sel], token_level=self.spec.token_level, algorithm=self.algo.name
        )
        return sel, batch, (inputs if self._reweigh is None else on_policy(inputs, self._reweigh))

    def _forward(self, micro: Sequence[TrainRow]) -> tuple[ScoringBatch, Tensor, Tensor]:
        """``micro``'s responses through the model (with gradient when grad is enabled, the adapters' dropout as
        set): its :class:`ScoringBatch`, ``token_log_probs`` [M, T] and ``response_mask`` [M, T]."""
        batch = build_scoring_batch_from_ids(
            [r.prompt_token_ids for r in micro], [r.response_ids for r in micro], self.pad_id
        )
        with self._autocast(next(self.model.parameters()).device):
            lp, mask = token_log_probs(self.model, batch, dropout=self.dropout, native=self.native)
        return batch, lp, mask

    def _gradient_rows(
        self, step: int, rows: Sequence[TrainRow], adv: Tensor, is_self: Tensor, v: Tensor, device: torch.device
    ) -> Tensor | None:
        """Score the mini-batch's foreign rows without gradient (current weights) and mark those the loss has no
        gradient for. → ``lbar`` [N] float32: the no-grad ``lbar`` of the foreign rows without a gradient, NaN for
        the rows that go through forward and backward (every self row and the foreign rows with a gradient); None
        when skipping does not apply (no gradient-rows function, token weighting, LoRA dropout, no foreign rows):
        then every row runs forward and backward. At step 0 the weights are the likelihood screen's, but its scores
        (``pre_log_prob_sum``) are not taken instead: float64 sums over other micro-batches, they differ from this
        float32 ``lbar`` in the last bits on some rows, which the rows' loss and metrics would carry (issue 42)."""
        if self.gradient_rows is None or self.by_tokens or self.dropout or bool(is_self.all()):
            return None
        lbar = torch.full((len(rows),), float("nan"), device=device)
        cross = [i for i in range(len(rows)) if not rows[i].is_self]
        with torch.no_grad():
            for micro_idx in self._micro_batches(rows, cross):
                sel, _, inputs = self._score_micro(rows, micro_idx, adv, is_self, v)
                seq = inputs.seq_log_probs().float()
                has_grad = self.gradient_rows(seq, inputs, step, self.loss_cfg)
                lbar[sel] = torch.where(has_grad, torch.full_like(seq, float("nan")), seq)
        return lbar

    def _kl_sum(self, batch, lp: Tensor, mask: Tensor, is_self: Tensor) -> Tensor:
        """Sum of k3 KL to the frozen reference over the self tokens of a micro-batch."""
        if self.ref_model is None:
            raise RuntimeError("KL needs the frozen reference model (algorithm.kl_beta > 0)")
        with torch.no_grad(), self._autocast(lp.device):
            ref_lp, _ = token_log_probs(self.ref_model, batch, native=self.native)
        self_mask = mask * is_self.to(device=mask.device, dtype=mask.dtype)[:, None]
        return (kl_k3(lp, ref_lp.to(lp.device), self.algo.max_abs_log_ratio) * self_mask).sum()

    def state_dict(self) -> dict:
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict()}
        if self.screen_history:
            state["likelihood_screen"] = {k: [h.center, h.scale, h.rounds] for k, h in self.screen_history.items()}
        if self.master is not None:
            state["master"] = [m.detach() for m in self.master]
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore the optimizer (and float32 masters: saved ones, else the model's current weights upcast)."""
        if self.master is not None:
            saved = state.get("master")
            with torch.no_grad():
                for i, (p, m) in enumerate(zip(self.model_params, self.master)):
                    m.copy_(saved[i] if saved is not None else p.float())
        if state.get("optimizer") is not None:  # None: a sharded trainer restored its shards itself
            self.optimizer.load_state_dict(state["optimizer"])
        self.screen_history = {
            str(k): GapHistory(float(v[0]), float(v[1]), int(v[2]))
            for k, v in (state.get("likelihood_screen") or {}).items()
        }
