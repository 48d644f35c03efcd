"""An organization's policy worker: owns the private model, generates and verifies rollouts, trains locally.

Implements :class:`hacrl_fed.worker.api.WorkerAPI`. Each round: :meth:`generate` (pre-update weights) then
:meth:`train` (own rollouts of that round + foreign ones); with the fused protocol one :meth:`step` call does
round ``r - 1``'s train and round ``r``'s generate. Only text, rewards and sequence log-probs leave it.

Every request is checked against the worker's own state and limits first (:mod:`hacrl_fed.worker.guard`):
after ``train`` of round ``t`` of run ``R`` (remembered in checkpoints) it refuses plans of ``R`` for rounds
``<= t`` (:class:`~hacrl_fed.worker.guard.StaleRoundError`: a coordinator restarted from an older state; it counts
the gap as ``stale_round`` and the org rejoins at ``t + 1``) or too far ahead, trains only the round it generated,
and checkpoints only the round it trained. Its parts, each in a module of its own:

* run routing (:mod:`hacrl_fed.worker.routing`): which run a request belongs to, fresh starts, checkpoints;
* the identity border (:mod:`hacrl_fed.worker.identity_border`): with ``security.signing`` every published batch
  is signed with the org's identity (sealed first for the other orgs in coordinator-blind mode,
  ``security.encrypt``), foreign batches are verified against the pinned roster, reports are signed;
* the intake (:mod:`hacrl_fed.worker.intake`): the one door for foreign rows, from the bound on a request to the
  context fit, with one ledger of what each stage dropped; the trainer (:mod:`hacrl_fed.trainer`) then optimizes
  exactly the rows admitted.

Replay protection (:mod:`hacrl_fed.security.freshness`): every TrainReport carries a fresh challenge and Health the
latest one; every batch signs the digest of the plan it answers; a learner trains on a source batch only when it
answers the learner's own plan of the round and that plan carried the challenge the learner issued last (else
``stale_plan``, and the learner trains on its own rows).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch

from hacrl_fed.algorithm import get_algorithm
from hacrl_fed.algorithm.advantages import Capability
from hacrl_fed.algorithm.loss_inputs import Reweigh
from hacrl_fed.cancel import raise_if_cancelled
from hacrl_fed.config import RunConfig, org_generation, org_trainer
from hacrl_fed.engines import EngineOptions, build_engine
from hacrl_fed.models.context import context_length
from hacrl_fed.models.loading import load_model_and_tokenizer, model_sources
from hacrl_fed.models.lora import wrap_lora
from hacrl_fed.models.prompting import style_of
from hacrl_fed.perf import PhaseMeter
from hacrl_fed.plan.sampler import eval_ids
from hacrl_fed.security.freshness import HEALTH_KEY, ChallengeBook, fresh_digest, plan_digest, recent_keep
from hacrl_fed.seeding import stable_seed
from hacrl_fed.tasks import get_task
from hacrl_fed.tasks.slices import slice_labels, slice_metrics
from hacrl_fed.trainer import LocalTrainer, TrainRow
from hacrl_fed.types import (
    EvalReport,
    EvalRequest,
    RolloutBatch,
    RoundPlan,
    StepReply,
    StepRequest,
    TrainReport,
    TrainRequest,
)
from hacrl_fed.worker.api import VERSION_KEY, run_step
from hacrl_fed.worker.guard import check_capability, check_eval, check_plan, check_step, check_train
from hacrl_fed.worker.identity_border import IdentityBorder
from hacrl_fed.worker.intake import Intake, OwnRound
from hacrl_fed.worker.late_rounds import RecentRounds
from hacrl_fed.worker.learner_round import Extension, LearnerRound
from hacrl_fed.worker.outcome import GuardExtension, OutcomeMonitor
from hacrl_fed.worker.own_rows import sample_plan, verify_samples
from hacrl_fed.worker.phase import in_phase, phase
from hacrl_fed.worker.prompts import PromptBook
from hacrl_fed.worker.routing import RunRouting
from hacrl_fed.worker.samples import SampleBook
from hacrl_fed.worker.weights import Saved, load_params, restore, snapshot, trainable_params

log = logging.getLogger(__name__)


class PolicyWorker(RunRouting):
    """One organization's model, tokenizer, optimizer and generation engine."""

    def __init__(self, cfg: RunConfig, org_id: str, *, run_dir: str | Path, resume: bool = False):
        self.cfg, self.org_id = cfg, org_id
        org = cfg.org(org_id)
        self.gen_cfg, self.trainer_cfg = org_generation(cfg, org_id), org_trainer(cfg, org_id)
        self.seed = org.seed if org.seed is not None else stable_seed(cfg.seed, "org", org_id) % (2**31)
        torch.manual_seed(self.seed)
        with phase(org_id, "load"):
            self.model, self.tokenizer = load_model_and_tokenizer(org.model)
        if self.trainer_cfg.lora.enabled:
            self.model = wrap_lora(self.model, self.trainer_cfg)
        self.task = get_task(cfg.task.name, cfg.task.params, seed=cfg.seed)
        # prompts + token budget must fit the context: checked here where known, guarded per call (models.context)
        self.context, context_source = context_length(
            self.model, self.gen_cfg.max_model_len if self.gen_cfg.engine == "vllm" else None
        )
        self.style = style_of(org.model, self.tokenizer, self.task)  # chat or completion, BOS, stop ids
        self.prompts = PromptBook(org_id, self.task, self.tokenizer, self.style)
        self.prompts.check_fits(
            self.context, context_source, self.gen_cfg, eval_ids(self.task.size("test"), cfg.task.eval_size)
        )
        self.engine = self._build_engine()
        self.eos_id = self.style.end_id
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_id
        self.trainer = self._new_trainer()
        self.ckpt_base = Path(run_dir) / "orgs" / org_id / "checkpoints"  # one folder per run below it
        self.border = IdentityBorder(cfg, org_id, run_dir)
        self.intake = self._build_intake()
        self.outcome, self.extensions = self._extensions()  # the outcome guard (None: off); the learner round's
        self.samples = SampleBook(cfg, org_id, run_dir)  # samples.jsonl for the run report (worker.samples)
        self.run_id: str | None = None  # the run this worker serves (None: it has served none yet)
        self.last_round = 0  # the last round of run_id it trained (0: none)
        self._trained: dict[str, int] = {}  # run id -> last round this process trained in that run
        self._pristine = True  # weights, optimizer and RNG as configured: nothing trained or restored since
        self._own: OwnRound | None = None
        # asynchronous rounds: its last W rounds, for foreign batches of earlier rounds (hacrl_fed.worker.late_rounds)
        fed = cfg.federation
        self._recent = RecentRounds(fed.effective_window) if fed.staleness >= 1 else None
        self._version = 0  # asynchronous rounds: updates done in run_id (signed into every batch it publishes)
        keep = recent_keep(fed.staleness, fed.effective_window) if fed.staleness >= 1 else 1
        self._challenges = ChallengeBook(keep)  # replay protection (hacrl_fed.security.freshness)
        self._initial = self._snapshot()
        if resume:
            self.restore()

    def _build_engine(self):
        """The org's generation engine (``generation.engine``), stopping on the prompt style's stop ids."""
        model_path, tokenizer_path = model_sources(self.cfg.org(self.org_id).model)
        options = EngineOptions.from_config(
            self.gen_cfg,
            seed=self.seed,
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            extra_stop_ids=self.style.stop_ids,
        )
        return build_engine(self.gen_cfg.engine, self.model, self.tokenizer, options)

    def _build_intake(self) -> Intake:
        """The one door for foreign rows (:mod:`hacrl_fed.worker.intake`)."""
        return Intake(
            self.cfg,
            self.org_id,
            selection=self.trainer_cfg.selection,
            screen=self.trainer_cfg.likelihood_screen,
            uses_cross=get_algorithm(self.cfg.algorithm.name).uses_cross,
            task=self.task,
            tokenizer=self.tokenizer,
            eos_id=self.eos_id,
        )

    def _extensions(self) -> tuple[OutcomeMonitor | None, list[Extension]]:
        """The outcome guard's monitor (None: off) and the learner round's extensions (the guard's, when on)."""
        g = self.trainer_cfg.outcome_guard
        mons = OutcomeMonitor.of(
            g,
            seed=self.seed,
            task=self.task,
            prompts=self.prompts,
            max_new_tokens=self.gen_cfg.eval_max_new_tokens,
            store=self.ckpt_base.parent / "guard",
        )
        last = self.cfg.federation.rounds_of(self.org_id)  # its own last round (federation.org_rounds)
        return (mons[0] if mons else None), [GuardExtension(m, last) for m in mons]

    def _new_trainer(self) -> LocalTrainer:
        return LocalTrainer(self.model, self.cfg.algorithm, self.trainer_cfg, self.pad_id)

    @property
    def roster(self):
        """The run's pinned roster (None with signing off)."""
        return self.border.roster

    # -- WorkerAPI -------------------------------------------------------------------------------------------
    @in_phase("generate")
    def generate(self, plan: RoundPlan) -> RolloutBatch:
        """Sample ``G`` responses per prompt with the pre-update weights, verify, and publish them."""
        self.prompts.check_task(plan.task)
        how, path, last = self._route(plan.run_id, plan.round == 1, f"a plan for round {plan.round}")
        check_plan(self.cfg, self.org_id, plan, last_round=last, run_id=plan.run_id)
        self.prompts.check(plan.prompts, "train")
        self._enter(plan.run_id, how, path, last)  # only now: a refused plan changes nothing
        raise_if_cancelled("before generating")
        t0, c0 = time.perf_counter(), time.process_time()
        perf = PhaseMeter(self.device())
        sp = plan.sampling
        tokens_by_prompt, keep, gens = sample_plan(self, plan)
        raise_if_cancelled("after generating")
        t1 = time.perf_counter()
        gen_perf = perf.lap("generate", sum(g.token_count for row in gens for g in row))
        rollouts, rows = verify_samples(self, plan, tokens_by_prompt, [plan.prompts[i] for i in keep], gens)
        fresh = fresh_digest(plan, self.org_id, self._challenges.expect())
        self._own = OwnRound(
            plan.run_id, plan.round, plan.task, plan.prompts, sp.max_new_tokens, tokens_by_prompt, rows, fresh
        )
        if self._recent is not None:
            self._recent.keep(self._own)
        n = max(len(rollouts), 1)
        metrics = {
            "time/generate": t1 - t0,
            "time/verify": time.perf_counter() - t1,
            "gen/mean_tokens": sum(r.token_count for r in rollouts) / n,
            "gen/stop_frac": sum(r.finish_reason == "stop" for r in rollouts) / n,
            "gen/skipped_too_long": float(len(plan.prompts) - len(keep)),
            "cpu/generate": time.process_time() - c0,  # this process's CPU seconds (all its threads)
            **gen_perf,
            "trust/plan_fresh": float(fresh is not None),
        }
        self.samples.record_generate(plan, rollouts)
        acc = sum(r.reward for r in rollouts) / n
        batch = RolloutBatch(
            plan.run_id, plan.round, self.org_id, tuple(rollouts), acc, metrics, plan_digest=plan_digest(plan)
        )
        if self._recent is not None:  # asynchronous rounds: the version and the plan's challenges, signed
            batch = replace(batch, version=self._version, plan_challenges=dict(plan.challenges))
        return self.border.publish(batch, sp.max_new_tokens * self.cfg.security.max_bytes_per_token)

    @in_phase("train")
    def train(self, request: TrainRequest) -> TrainReport:
        """Admit the foreign rows through the intake and run this round's update on exactly the rows it admits: the
        learner round's phases (:mod:`hacrl_fed.worker.learner_round`)."""
        own = check_train(self.org_id, request, self._own)
        check_capability(self.cfg, request.capability)
        for table in request.round_capability.values():
            check_capability(self.cfg, table)
        raise_if_cancelled("before training")
        metrics = LearnerRound(self, request, own).run()
        self._own = None
        self.last_round, self._trained[request.run_id], self._pristine = request.round, request.round, False
        self._version += 1
        return self._report(request, metrics)

    # -- Learner (hacrl_fed.worker.learner): what the learner round's extensions use ---------------------------
    def score(self, rows: Sequence[TrainRow]) -> list[list[float]]:
        return self.trainer.token_log_prob_lists(rows)

    def update(
        self,
        rows: Sequence[TrainRow],
        learner: int,
        capability: Capability,
        importance: Sequence[float] | None = None,
        reweigh: Reweigh | None = None,
    ) -> dict[str, float]:
        return self.trainer.update(rows, learner, capability, importance=importance, reweigh=reweigh)

    def one_step(self, n_rows: int) -> bool:
        return self.trainer.one_step(n_rows)

    def live(self) -> Saved:
        trainable = {n: p.detach() for n, p in self.model.named_parameters() if p.requires_grad}
        return trainable, self.trainer.state_dict()

    def weights(self) -> Saved:
        return snapshot(self.model, self.trainer)

    def params(self) -> dict[str, torch.Tensor]:
        return trainable_params(self.model)

    def load_weights(self, saved: Saved, *, sync: bool = True) -> None:
        restore(self.model, self.trainer, self.engine, saved, sync=sync)

    def load_params(self, params: dict[str, torch.Tensor], *, sync: bool) -> None:
        load_params(self.model, self.engine, params, sync=sync)

    @property
    def recent_rounds(self) -> RecentRounds | None:
        """Asynchronous rounds: its last W rounds (None: lock-step)."""
        return self._recent

    @property
    def challenges(self) -> ChallengeBook:
        return self._challenges

    def _report(self, request: TrainRequest, metrics: dict[str, float]) -> TrainReport:
        """The signed TrainReport with a fresh challenge and, in blind mode, the evidence of lying sources."""
        evidence = self.border.evidence(request, metrics)
        report = TrainReport(
            request.run_id,
            request.round,
            self.org_id,
            metrics,
            disclosed_keys=evidence,
            challenge=self._challenges.issue(),
        )
        return self.border.sign_report(report)

    def step(self, request: StepRequest) -> StepReply:
        """One message of a round: :meth:`train` on round ``r - 1``'s request, :meth:`evaluate` when asked,
        :meth:`generate` on round ``r``'s plan with the updated weights, then :meth:`checkpoint` when asked
        (:func:`hacrl_fed.worker.step.run_step`). The request is refused whole, before any work, when its halves do
        not belong together or the plan is outside this org's limits."""
        if request.train is not None or request.plan is not None:  # evaluate / checkpoint alone: checked by each
            check_step(self.org_id, request)
        train, plan = request.train, request.plan
        if train is not None and plan is not None:  # the plan as generate() will check it once the train is done
            self.prompts.check_task(plan.task)
            check_plan(self.cfg, self.org_id, plan, last_round=train.round, run_id=self.run_id)
            self.prompts.check(plan.prompts, "train")
        self._challenges.hold()  # the plan carries the challenge issued before this message, not the train half's
        try:
            return run_step(self, request)
        finally:
            self._challenges.release()

    @in_phase("evaluate")
    def evaluate(self, request: EvalRequest) -> EvalReport:
        """Greedy accuracy on held-out prompts."""
        self.prompts.check_task(request.task)
        how, path, last = self._route(request.run_id, request.round == 0, f"an evaluation at round {request.round}")
        check_eval(self.cfg, self.org_id, request, run_id=request.run_id)
        self.prompts.check(request.prompts, "test")
        self._enter(request.run_id, how, path, last)
        t0 = time.perf_counter()
        texts, lengths = self.prompts.tokens(request.prompts)
        keep = self.prompts.fitting(
            request.prompts, lengths, request.max_new_tokens, "generation.eval_max_new_tokens", self.context
        )
        gens = self.engine.greedy([texts[i] for i in keep], max_new_tokens=request.max_new_tokens) if keep else []
        rewards = [0.0] * len(request.prompts)  # a prompt that does not fit the context counts as wrong
        for i, g in zip(keep, gens):
            rewards[i] = float(self.task.verify(g.text, request.prompts[i].reference))
        acc = sum(rewards) / max(len(rewards), 1)
        labels = slice_labels(self.task, "test", [p.prompt_id for p in request.prompts])
        return EvalReport(
            request.run_id,
            request.round,
            self.org_id,
            acc,
            len(rewards),
            {
                "time/eval": time.perf_counter() - t0,
                "skipped_too_long": float(len(request.prompts) - len(keep)),
                **slice_metrics(labels, rewards),  # per-slice accuracy (sliced tasks only; hacrl_fed.tasks.slices)
            },
        )

    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def health(self) -> dict[str, str]:
        from hacrl_fed.security.keyring import identity_health  # its signing key: checked before round 1

        return {
            "org_id": self.org_id,
            "status": "ok",
            "round": str(self.last_round),
            VERSION_KEY: str(self._version),  # asynchronous rounds: a rejoin adopts it (coordinator.async_liveness)
            "params": str(sum(p.numel() for p in self.model.parameters())),
            HEALTH_KEY: self._challenges.for_health().hex(),  # for the first plan of a run (freshness)
            **identity_health(self.border.roster, self.border.identity),
        }
