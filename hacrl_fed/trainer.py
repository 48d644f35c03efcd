"""Local training: one round's policy update of one learner on its own and (for HACPO/naive) foreign rows.

Rows are already tokenized with the learner's tokenizer. Updates follow docs/ALGORITHM.md "Loss and update schedule":
advantages over the joint groups, rows ordered self first then cross by source, no shuffle, one AdamW step per
mini-batch (grad-norm clip), mini-batches split into micro-batches for memory with exact loss weighting.

Numerics (``trainer.precision``): ``model`` trains in the model's own dtype; ``bf16-autocast`` keeps float32
weights and optimizer states and runs forward/backward under ``torch.autocast(bfloat16)``; ``bf16-master`` keeps the
model (what the ``hf`` engine generates with) in bfloat16 and gives AdamW a float32 master copy of the trainable
weights: bf16 grads are upcast onto the masters, AdamW steps in float32 and the result is rounded back into the
model. ``trainer.gradient_checkpointing`` recomputes each decoder layer in backward (:func:`checkpoint_layers`).
Every tensor of the loss lives on the model's device (``model.device`` from the config: CPU or a CUDA device).

The model stays in eval mode (dropout off): the importance ratios compare one sequence under two forward passes,
and dropout noise would bias them. The one exception is a LoRA adapter's own dropout (``trainer.lora.dropout``):
during the update's forward passes (the ones that carry the gradient) the adapters' dropout modules, and only
they, are in training mode (:func:`adapter_dropout`); generation, the published old log-probs and the frozen KL
reference stay deterministic.

What an algorithm needs (capability cross weights, token-level inputs and weighting) comes from its registry spec
(:class:`~hacrl_fed.algorithm.AlgorithmSpec`); the loss configuration is built once from the algorithm config
(:meth:`~hacrl_fed.algorithm.PolicyLossConfig.from_algorithm`). :meth:`LocalTrainer.update` optimizes exactly the
rows it is given: which foreign rows those are (screen, selection, likelihood screen, context) is the worker's
intake's decision (:mod:`hacrl_fed.worker.intake`); a row without tokens counts in its group's advantage
statistics and is not trained on. The trainer hands the intake its scorer (:meth:`LocalTrainer.log_prob_sums`) and
keeps the likelihood screen's per-source history with its checkpointed state.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from hacrl_fed.algorithm import (
    PolicyLossConfig,
    PolicyLossInputs,
    advantage_metrics,
    capability_coefficients,
    fractions_from_counts,
    get_advantage_estimator,
    get_algorithm,
    get_gradient_rows,
    get_policy_loss,
    hacpo_cross_band,
    kl_k3,
    minibatch_schedule,
    name_sources,
    order_rows,
)
from hacrl_fed.algorithm.capability_rounds import ROUND_ADVANTAGE_ESTIMATORS, capability_coefficients_at_rounds
from hacrl_fed.algorithm.likelihood_screen import GapHistory
from hacrl_fed.config import AlgorithmConfig, TrainerConfig
from hacrl_fed.models.context import context_length
from hacrl_fed.models.native import unsupported_reason
from hacrl_fed.scoring import ScoringBatch, build_scoring_batch_from_ids, token_log_probs

log = logging.getLogger(__name__)

RowCapability = tuple[Sequence[float], Sequence[float]]  # per row: (Phat_learner(t(y)), Phat_source(t(y)))


@dataclass
class TrainRow:
    """One sequence in the learner's tokenization.

    ``old_seq_log_prob`` is ``lbar_old``: the learner's pre-update mean token log-prob for self rows, the source's
    published mean for cross rows. ``old_token_log_probs`` (self rows) feeds token-level losses (GRPO).
    ``norm_length`` > 0 replaces the learner's token count as the divisor of its ``lbar`` of this row (with
    ``algorithm.logprob_norm: per_byte`` a cross row's ``old_seq_log_prob`` is then per byte too).
    """

    prompt_token_ids: list[int]
    response_ids: list[int]
    reward: float
    group: int
    source: int
    is_self: bool
    old_seq_log_prob: float
    old_token_log_probs: list[float] | None = None
    norm_length: float = 0.0  # divisor of this row's lbar; 0: its token count (per_byte cross rows: UTF-8 bytes)
    n_bytes: int = 0  # UTF-8 bytes of the response text (the likelihood screen's per_byte unit)
    claimed_log_prob_sum: float | None = None  # cross rows: the source's claimed sum over its own tokens
    claimed_token_count: int = 0  # cross rows: the source's token count of that claim
    pre_log_prob_sum: float | None = None  # the learner's pre-update log-prob sum (in-band baseline; None: not yet)
    age: int = 0  # rounds between the learner's version and the row's batch's (0: this round's)
    round: int = 0  # the round the row answers (asynchronous rounds; 0: the train request's round)

    def pre_seq_log_prob(self) -> float:
        """``lbar_0``: the pre-update sum over this row's divisor (``norm_length``, else its tokens); a self row
        without one takes its ``old_seq_log_prob`` (the same pre-update weights sampled it)."""
        if self.pre_log_prob_sum is None:
            if not self.is_self:
                raise ValueError("a cross row needs its pre_log_prob_sum (its pre-update score)")
            return self.old_seq_log_prob
        return self.pre_log_prob_sum / max(self.norm_length if self.norm_length > 0 else len(self.response_ids), 1)


def adapter_dropout_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The dropout modules of the model's LoRA adapters (peft's ``lora_dropout``; empty without adapters or with
    dropout 0, where peft puts an ``Identity``)."""
    out: list[torch.nn.Module] = []
    for module in model.modules():
        adapters = getattr(module, "lora_dropout", None)
        if isinstance(adapters, torch.nn.ModuleDict):
            out.extend(m for m in adapters.values() if isinstance(m, torch.nn.Dropout) and m.p > 0)
    return out


@contextlib.contextmanager
def adapter_dropout(modules: Sequence[torch.nn.Module]):
    """Training mode for exactly ``modules`` (the adapters' dropout) inside the block; their mode is restored."""
    before = [m.training for m in modules]
    for m in modules:
        m.train(True)
    try:
        yield
    finally:
        for m, mode in zip(modules, before):
            m.train(mode)


def _pad(rows: Sequence[Sequence[float]], width: int) -> Tensor:
    out = torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.float32)
    return out


class _MetricAccumulator:
    """Averages metrics over steps; ``*_min``/``*_max`` keys keep the extreme, ``num_*`` keys sum."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.counts: dict[str, float] = {}

    def add(self, metrics: dict[str, float], weight: float = 1.0) -> None:
        for k, v in metrics.items():
            v = float(v)
            if k.endswith("_min"):
                self.sums[k] = min(self.sums.get(k, math.inf), v)
            elif k.endswith("_max"):
                self.sums[k] = max(self.sums.get(k, -math.inf), v)
            elif k.rsplit("/", 1)[-1].startswith("num_"):
                self.sums[k] = self.sums.get(k, 0.0) + v
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v * weight
                self.counts[k] = self.counts.get(k, 0.0) + weight

    def merge(self, other: _MetricAccumulator) -> None:
        """Fold in another accumulator's sums and counts (another rank's share of the same steps)."""
        for k, v in other.sums.items():
            if k.endswith("_min"):
                self.sums[k] = min(self.sums.get(k, math.inf), v)
            elif k.endswith("_max"):
                self.sums[k] = max(self.sums.get(k, -math.inf), v)
            else:
                self.sums[k] = self.sums.get(k, 0.0) + v
        for k, c in other.counts.items():
            self.counts[k] = self.counts.get(k, 0.0) + c

    def result(self) -> dict[str, float]:
        return {k: (v / self.counts[k] if k in self.counts else v) for k, v in self.sums.items()}


def checkpoint_layers(model: torch.nn.Module) -> int:
    """Gradient checkpointing for ``model``: every transformers decoder layer (``GradientCheckpointingLayer``)
    recomputes its activations during backward instead of keeping them; returns how many layers were wrapped.

    transformers' own switch (``gradient_checkpointing_enable``) acts only in training mode, and the trainer
    scores in eval mode (no dropout), so the layers' ``forward`` is wrapped here instead (non-reentrant
    ``torch.utils.checkpoint``, only while grad is enabled: generation and no-grad scoring run unchanged).
    Idempotent. Wrap after any ``deepcopy`` of the model (a copy would call the original's layers).
    """
    from torch.utils.checkpoint import checkpoint
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(
            f"trainer.gradient_checkpointing: {type(model).__name__} has no transformers decoder "
            "layers (GradientCheckpointingLayer) to checkpoint"
        )
    for layer in layers:
        if getattr(layer, "_hacrl_checkpointed", False):
            continue
        forward = layer.forward

        def checkpointed(*args, _forward=forward, **kwargs):
            if torch.is_grad_enabled():
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)
            return _forward(*args, **kwargs)

        layer.forward = checkpointed
        setattr(layer, "_hacrl_checkpointed", True)  # noqa: B010 - mark the layer without a typed attribute
    return len(layers)


class LocalTrainer:
    """Owns the optimizer (and a frozen reference model when ``kl_beta > 0``) of one learner."""

    def __init__(self, model: torch.nn.Module, algo: AlgorithmConfig, trainer: TrainerConfig, pad_id: int):
        self.model, self.algo, self.cfg, self.pad_id = model, algo, trainer, int(pad_id)
        self.spec = get_algorithm(algo.name)
        self.loss_fn = get_policy_loss(self.spec.loss)
        self.gradient_rows = get_gradient_rows(self.spec.loss)  # trainer.skip_no_gradient_rows
        self.loss_cfg = PolicyLossConfig.from_algorithm(algo)
        self.by_tokens = self.spec.weights_by_tokens(self.loss_cfg)  # micro-batch weights: tokens or rows
        self.context = context_length(model)[0]  # rows longer than this cannot be scored (the intake's last stage)
        self.dropout = adapter_dropout_modules(model)  # trainer.lora.dropout: on during the update's forwards
        self.native = self._native_forward(model, trainer, self.dropout)  # trainer.forward: auto
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
        self.ref_model = None
        if algo.kl_beta > 0:
            self.ref_model = self._reference_copy(model)
            for p in self.ref_model.parameters():
                p.requires_grad_(False)
        if trainer.gradient_checkpointing:
            checkpoint_layers(model)  # after the deepcopy above (see checkpoint_layers)

    @staticmethod
    def _native_forward(model: torch.nn.Module, cfg: TrainerConfig, dropout: Sequence[torch.nn.Module]) -> bool:
        """Whether the update scores with the hand-written forward (``trainer.forward: auto``, module doc)."""
        return (
            cfg.forward == "auto"
            and cfg.precision == "model"
            and not cfg.gradient_checkpointing
            and not dropout
            and all(p.dtype == torch.float32 for p in model.parameters())
            and unsupported_reason(model) is None
        )

    @staticmethod
    def _master_weights(params: Sequence[torch.Tensor], precision: str) -> list[torch.Tensor] | None:
        dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in params})
        if precision == "bf16-autocast" and dtypes not in ([], ["float32"]):
            raise ValueError(
                f"trainer.precision=bf16-autocast keeps float32 weights but the model's trainable "
                f"weights are {dtypes}: set model.dtype: float32"
            )
        if precision == "bf16-master":
            if dtypes not in ([], ["bfloat16"]):
                raise ValueError(
                    f"trainer.precision=bf16-master trains bfloat16 weights against float32 masters "
                    f"but the model's trainable weights are {dtypes}: set model.dtype: bfloat16"
                )
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

    def advantages(
        self,
        rows: Sequence[TrainRow],
        learner: int,
        capability: Sequence[float],
        row_capability: RowCapability | None = None,
        baseline_rows: Tensor | None = None,
    ) -> Tensor:
        """Advantages of ``rows`` (docs/ALGORITHM.md §2, or plain group normalisation for the baselines). → [N].
        ``row_capability``: per row ``(Phat_learner(t(y)), Phat_source(t(y)))`` of the row's round (asynchronous
        rounds): an estimator with a per-round form (``ROUND_ADVANTAGE_ESTIMATORS``: HACPO's) then takes each row's
        ratio from them; the others do not read capability. ``baseline_rows`` [N] bool (:meth:`baseline_rows`;
        None: every row): the rows HACPO's group statistics are taken over."""
        rewards = torch.tensor([r.reward for r in rows], dtype=torch.float64)
        groups, sources = torch.tensor([r.group for r in rows]), torch.tensor([r.source for r in rows])
        a = self.algo
        opts: dict[str, Any] = dict(
            reward_max=a.reward_max, ratio_min=a.ratio_min, ratio_max=a.ratio_max, eps=a.adv_eps
        )
        if baseline_rows is not None:  # only HACPO's estimators take it (the config refuses in_band elsewhere)
            opts["baseline_rows"] = baseline_rows
        at_rounds = ROUND_ADVANTAGE_ESTIMATORS.get(self.spec.advantage)
        if row_capability is not None and at_rounds is not None:
            learner_cap, source_cap = row_capability
            out = at_rounds(
                rewards, groups, sources, learner, learner_cap, source_cap, **opts, calibrate=a.advantage_calibration
            )
        else:
            fn = get_advantage_estimator(self.spec.advantage)
            out = fn(rewards, groups, sources, learner, capability, **opts, calibrate=a.advantage_calibration)
        return out.float()

    def update(
        self,
        rows: Sequence[TrainRow],
        learner: int,
        capability: Sequence[float],
        names: Sequence[str] | None = None,
        row_capability: RowCapability | None = None,
    ) -> dict[str, float]:
        """One round's update. ``learner``: this agent's index into ``capability`` (``Phat`` per agent);
        ``names``: agent names for the per-source advantage metrics (``hacpo/adv_mean/<name>``);
        ``row_capability``: per row of ``rows``, ``(Phat_learner, Phat_source)`` of the row's round (asynchronous
        rounds; docs/ALGORITHM.md "Capability per round"), used instead of ``capability`` when given."""
        start = time.perf_counter()
        if not rows:
            return {"train/steps": 0.0, "train/num_rows": 0.0}
        # every response counts in its joint group's baseline and std, even one with no tokens to train on
        # (algorithm.baseline_rows: in_band: only own rows and the foreign rows inside the band at step 0)
        base, base_s = self.baseline_rows(rows), time.perf_counter() - start
        adv_all = self.advantages(rows, learner, capability, row_capability, baseline_rows=base)
        all_rows = rows
        scorable = [i for i, r in enumerate(rows) if r.response_ids]
        rows, adv = [rows[i] for i in scorable], adv_all[scorable]
        if not rows:
            return {"train/steps": 0.0, "train/num_rows": 0.0}
        sources = torch.tensor([r.source for r in rows])
        if self.spec.uses_capability_coefficient and self.algo.capability_coefficient and row_capability is not None:
            lc, sc = ([row_capability[k][i] for i in scorable] for k in (0, 1))
            v = capability_coefficients_at_rounds(lc, sc, sources, learner, self.algo.ratio_min, self.algo.ratio_max)
        elif self.spec.uses_capability_coefficient and self.algo.capability_coefficient:
            v = capability_coefficients(capability, learner, sources, self.algo.ratio_min, self.algo.ratio_max)
        else:
            v = torch.ones(len(rows))
        is_self = torch.tensor([r.is_self for r in rows])
        perm = order_rows(is_self, sources).tolist()
        acc = _MetricAccumulator()
        schedule = minibatch_schedule(len(rows), self.cfg.minibatch_size, self.cfg.epochs)
        for step, idx in schedule:
            picked = [perm[i] for i in idx.tolist()]
            # the adapters' dropout is on through forward and backward (gradient checkpointing recomputes in backward)
            with adapter_dropout(self.dropout):
                acc.add(self._step(step, [rows[i] for i in picked], adv[picked], is_self[picked], v[picked]))
        # shares over the whole update (not means of per-step shares), per source pair too
        out = fractions_from_counts(name_sources(acc.result(), names))
        if names is not None:
            out.update(
                advantage_metrics(adv_all, torch.tensor([r.source for r in all_rows]), names, prefix=self.algo.name)
            )
        out.update(self._baseline_metrics(all_rows, base, names, base_s))
        out.update(
            {
                "train/steps": float(len(schedule)),
                "train/num_rows": float(len(rows)),
                "train/num_self": float(is_self.sum()),
                "train/num_cross": float((~is_self).sum()),
                "train/adv_abs_mean": float(adv.abs().mean()),
                "time/update": time.perf_counter() - start,
            }
        )
        return out

    def baseline_rows(self, rows: Sequence[TrainRow]) -> Tensor | None:
        """The rows HACPO's advantage statistics are taken over (``algorithm.baseline_rows``; docs/ALGORITHM.md
        "Baseline rows"). ``joint``: None (every row). ``in_band``: bool [N], True on every own row and on each
        foreign row whose ratio at the pre-update weights (optimizer step 0), ``s = exp(clamp(lbar_0 - lbar_old,
        -M, M))`` with ``lbar_0`` normalised as the loss does (:meth:`TrainRow.pre_seq_log_prob`: per token or per
        byte), lies in the cross band of step 0 (:func:`~hacrl_fed.algorithm.hacpo_cross_band`); a foreign row
        without tokens has no ratio and is left out. ``lbar_0`` comes from the row's ``pre_log_prob_sum`` where
        the likelihood screen left its score (the same weights), else from one no-grad pass of
        :meth:`log_prob_sums` over the rest (:meth:`with_pre_scores`)."""
        if self.algo.baseline_rows == "joint":
            return None
        keep = torch.tensor([r.is_self for r in rows], dtype=torch.bool)
        cross = [i for i, r in enumerate(rows) if not r.is_self and r.response_ids]
        if cross:
            scored = self.with_pre_scores([rows[i] for i in cross])  # the screen's scores where it kept them
            lbar0 = [r.pre_seq_log_prob() for r in scored]
            old = torch.tensor([rows[i].old_seq_log_prob for i in cross], dtype=torch.float64)
            m = self.algo.max_abs_log_ratio
            ratio = torch.exp(torch.clamp(torch.tensor(lbar0, dtype=torch.float64) - old, -m, m))  # s at step 0
            keep[cross] = hacpo_cross_band(ratio, 0, self.loss_cfg)[2]
        return keep

    def _baseline_metrics(
        self, rows: Sequence[TrainRow], base: Tensor | None, names: Sequence[str] | None, seconds: float
    ) -> dict[str, float]:
        """With a :meth:`baseline_rows` mask ``base`` [N] (else nothing): ``time/baseline_rows`` (``seconds``, its
        scoring pass) and, with foreign rows, ``<algo>/num_baseline_cross`` and ``<algo>/baseline_cross_frac``: the
        foreign rows in the baseline (of all the round's foreign rows), the share per source too (``.../<source>``)."""
        if base is None:
            return {}
        cross = torch.tensor([not r.is_self for r in rows], dtype=torch.bool)
        if not cross.any():
            return {"time/baseline_rows": seconds}
        src, p = torch.tensor([r.source for r in rows]), self.algo.name
        out = {"time/baseline_rows": seconds, f"{p}/num_baseline_cross": float((base & cross).sum())}
        out[f"{p}/baseline_cross_frac"] = out[f"{p}/num_baseline_cross"] / float(cross.sum())
        for j in torch.unique(src[cross]).tolist():
            sel = cross & (src == j)
            name = names[j] if names is not None and j < len(names) else f"src{j}"
            out[f"{p}/baseline_cross_frac/{name}"] = float((base & sel).sum()) / float(sel.sum())
        return out

    def log_prob_sums(self, rows: Sequence[TrainRow]) -> list[float]:
        """The learner's sequence log-prob sums ``sum_t log p(y_t)`` of ``rows`` [N] with the current weights, no
        gradient: the update's own scoring path (sorted micro-batches, the native forward, each prompt once). The
        scorer the intake's likelihood screen is handed (:mod:`hacrl_fed.worker.intake`)."""
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
                    tok_lp, _ = token_log_probs(self.model, batch, native=self.native)
                yield micro_idx, tok_lp

    def with_pre_scores(self, rows: Sequence[TrainRow]) -> list[TrainRow]:
        """``rows`` with every cross row's pre-update log-prob sum (``pre_log_prob_sum``) where it has none: one
        no-grad pass of :meth:`log_prob_sums` over those rows with the current (pre-update) weights."""
        todo = [i for i, r in enumerate(rows) if not r.is_self and r.pre_log_prob_sum is None]
        sums = dict(zip(todo, self.log_prob_sums([rows[i] for i in todo]))) if todo else {}
        return [dataclasses.replace(r, pre_log_prob_sum=sums[i]) if i in sums else r for i, r in enumerate(rows)]

    def _step(self, step: int, rows: list[TrainRow], adv: Tensor, is_self: Tensor, v: Tensor) -> dict[str, float]:
        """Optimizer step ``step`` of the round (counted across epochs) over one mini-batch, accumulated over
        micro-batches.

        With a gradient-rows function for the loss (``trainer.skip_no_gradient_rows``; :meth:`_gradient_rows`), the
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
        acc = _MetricAccumulator()
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
            loss, metrics = self.loss_fn(self._sequence_inputs(rows, lbar, adv, is_self, v), step, self.loss_cfg)
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
        self, acc: _MetricAccumulator, loss_total: float, kl_total: float, lbar: Tensor | None
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
        return sel, batch, self._loss_inputs(micro, lp, mask, adv[sel], is_self[sel], v[sel])

    def _forward(self, micro: Sequence[TrainRow]) -> tuple[ScoringBatch, Tensor, Tensor]:
        """``micro``'s responses through the model (with gradient when grad is enabled, the adapters' dropout as
        set): its :class:`ScoringBatch`, ``token_log_probs`` [M, T] and ``response_mask`` [M, T]."""
        batch = build_scoring_batch_from_ids(
            [r.prompt_token_ids for r in micro], [r.response_ids for r in micro], self.pad_id
        )
        with self._autocast(next(self.model.parameters()).device):
            lp, mask = token_log_probs(self.model, batch, dropout=self.dropout, native=self.native)
        return batch, lp, mask

    def _loss_inputs(
        self, micro: Sequence[TrainRow], lp: Tensor, mask: Tensor, adv: Tensor, is_self: Tensor, v: Tensor
    ) -> PolicyLossInputs:
        old_tok = None
        if self.spec.token_level:
            if any(r.old_token_log_probs is None for r in micro):
                raise ValueError(f"{self.algo.name} is token-level: every row needs old_token_log_probs")
            old_tok = _pad([r.old_token_log_probs or [] for r in micro], lp.shape[1]).to(lp.device)
        return PolicyLossInputs(
            token_log_probs=lp,
            response_mask=mask,
            old_seq_log_probs=torch.tensor([r.old_seq_log_prob for r in micro], device=lp.device),
            advantages=adv,
            is_self=is_self,
            capability_coefficient=v,
            old_token_log_probs=old_tok,
            seq_lengths=torch.tensor([r.norm_length for r in micro], device=lp.device),
            source_ids=torch.tensor([r.source for r in micro], device=lp.device),
        )

    def _sequence_inputs(
        self, rows: Sequence[TrainRow], lbar: Tensor, adv: Tensor, is_self: Tensor, v: Tensor
    ) -> PolicyLossInputs:
        """Sequence-level loss inputs from given ``lbar`` [N] (one column, mask 1: ``seq_log_probs() == lbar``)."""
        device = lbar.device
        return PolicyLossInputs(
            token_log_probs=lbar[:, None],
            response_mask=torch.ones(len(rows), 1, device=device),
            old_seq_log_probs=torch.tensor([r.old_seq_log_prob for r in rows], device=device),
            advantages=adv,
            is_self=is_self,
            capability_coefficient=v,
            source_ids=torch.tensor([r.source for r in rows], device=device),
        )

    def _gradient_rows(
        self, step: int, rows: Sequence[TrainRow], adv: Tensor, is_self: Tensor, v: Tensor, device: torch.device
    ) -> Tensor | None:
        """Score the mini-batch's foreign rows without gradient (current weights) and mark those the loss has no
        gradient for. → ``lbar`` [N] float32: the no-grad ``lbar`` of the foreign rows without a gradient, NaN for
        the rows that go through forward and backward (every self row and the foreign rows with a gradient); None
        when skipping does not apply (no gradient-rows function, token weighting, LoRA dropout, no foreign rows,
        or ``trainer.skip_no_gradient_rows: false``): then every row runs forward and backward."""
        if (
            self.gradient_rows is None
            or not self.cfg.skip_no_gradient_rows
            or self.by_tokens
            or self.dropout
            or bool(is_self.all())
        ):
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
