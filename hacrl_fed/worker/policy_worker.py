"""An organization's policy worker: owns the private model, generates and verifies rollouts, trains locally.

Implements :class:`hacrl_fed.worker.api.WorkerAPI`. Each round: :meth:`generate` (pre-update weights) then
:meth:`train` (own rollouts of that round + foreign ones); with the fused protocol one :meth:`step` call does
round ``r - 1``'s train and round ``r``'s generate. Only text, rewards and sequence log-probs leave it.

Every request is checked against the worker's own state and limits first (:mod:`hacrl_fed.worker.guard`):
after ``train`` of round ``t`` of run ``R`` (remembered in checkpoints) it refuses plans of ``R`` for rounds
``<= t`` (:class:`~hacrl_fed.worker.guard.StaleRoundError`: a coordinator restarted from an older state; it counts
the gap as ``stale_round`` and the org rejoins at ``t + 1``) or too far ahead, trains only the round it generated,
and checkpoints only the round it trained. Foreign rollouts are screened per source before any tokenization
(signature, decryption, plan bounds, exactly G per prompt, rewards re-verified with this org's own verifier), then
selected by the org's ``trainer.selection`` rule and budget (:mod:`hacrl_fed.algorithm.selection`): only the
selected ones are re-tokenized and scored.

Run isolation: one long-lived worker serves run after run, each from the right starting point. It switches from
the run it serves to another run ``S`` only

* to *resume* ``S`` from its own latest checkpoint of ``S`` (weights, optimizer, RNG, round; the guard above then
  applies to ``S``), whatever request of ``S`` arrives; or
* to *start* ``S`` fresh, when ``S`` is a run it has never trained and the request is ``S``'s first one (the
  round-0 evaluation or the plan for round 1): the configured initial weights, a fresh optimizer and the initial
  RNG states, exactly as a newly started worker. The initial weights come from a CPU copy of the trainable
  parameters taken when the model was loaded (for LoRA only the adapters: frozen weights never change), so a new
  run costs no model reload, and host memory holds one extra copy of what trains.

Any other request of another run is refused (``wrong_run``), and so is a run it trained but never checkpointed
(its state is gone). A worker that has served no run yet joins the first run it is asked for at any round (as a
newly started organization). Checkpoints are kept per run: ``<run dir>/orgs/<org>/checkpoints/<run id>/``;
``resume=True`` (``hacrl-fed worker --resume``) restores the run checkpointed last at start-up, other runs are
restored when their coordinator resumes them.

With ``security.signing`` every published batch is signed with the org's identity (sealed first for the other
orgs in coordinator-blind mode, ``security.encrypt``). Replay protection (:mod:`hacrl_fed.security.freshness`):
every TrainReport carries a fresh challenge and Health the latest one; every batch signs the digest of the plan it
answers; a learner trains on a source batch only when it answers the learner's own plan of the round and that
plan carried the challenge the learner issued last (else ``stale_plan``, and the learner trains on its own rows).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from hacrl_fed.algorithm.selection import SOURCE_ORDERED, resolve_budget, select_rollouts, source_order
from hacrl_fed.config import RunConfig, org_generation, org_trainer
from hacrl_fed.engines import EngineOptions, build_engine
from hacrl_fed.models.chat import eos_token_id, render_prompt
from hacrl_fed.models.context import check_task_fits, context_length, fits
from hacrl_fed.models.loading import load_model_and_tokenizer, model_sources
from hacrl_fed.perf import PhaseMeter
from hacrl_fed.plan.sampler import eval_ids
from hacrl_fed.scoring import response_token_ids
from hacrl_fed.security.freshness import HEALTH_KEY, ChallengeBook, check_fresh, fresh_digest, plan_digest
from hacrl_fed.seeding import stable_seed
from hacrl_fed.tasks import get_task
from hacrl_fed.trainer import LocalTrainer, TrainRow
from hacrl_fed.types import (
    EvalReport,
    EvalRequest,
    Prompt,
    Rollout,
    RolloutBatch,
    RoundPlan,
    StepReply,
    StepRequest,
    TrainReport,
    TrainRequest,
)
from hacrl_fed.worker.api import run_step
from hacrl_fed.worker.cancel import raise_if_cancelled
from hacrl_fed.worker.checkpoint import (
    checkpoint_round,
    latest_checkpoint,
    latest_run,
    load_checkpoint,
    run_checkpoint_root,
    save_checkpoint,
)
from hacrl_fed.worker.guard import (
    LazyTake,
    RequestRefused,
    check_capability,
    check_checkpoint,
    check_eval,
    check_plan,
    check_step,
    screen_sources,
)

log = logging.getLogger(__name__)


FOREIGN_LENGTH_FACTOR = 8  # foreign responses longer than this × max_new_tokens (learner tokens) are not trained on


@dataclass
class _OwnRound:
    """What :meth:`PolicyWorker.generate` keeps for this round's :meth:`PolicyWorker.train`."""

    run_id: str
    round: int
    task: str
    prompts: tuple[Prompt, ...]  # as this worker received them in its plan (references for re-verification)
    max_new_tokens: int
    tokens_by_prompt: dict[int, list[int]]  # prompt_id -> learner tokens of the rendered prompt
    rows: list[TrainRow]
    # the digest source batches must sign (hacrl_fed.security.freshness); None: the plan did not carry this
    # worker's latest challenge, so it trains this round on its own rollouts only
    fresh_digest: bytes | None = None


class PolicyWorker:
    """One organization's model, tokenizer, optimizer and generation engine."""

    def __init__(self, cfg: RunConfig, org_id: str, *, run_dir: str | Path, resume: bool = False):
        self.cfg, self.org_id = cfg, org_id
        org = cfg.org(org_id)
        self.gen_cfg, self.trainer_cfg = org_generation(cfg, org_id), org_trainer(cfg, org_id)
        self.seed = org.seed if org.seed is not None else stable_seed(cfg.seed, "org", org_id) % (2**31)
        torch.manual_seed(self.seed)
        self.model, self.tokenizer = load_model_and_tokenizer(org.model)
        if self.trainer_cfg.lora.enabled:
            self.model = _wrap_lora(self.model, self.trainer_cfg)
        self.task = get_task(cfg.task.name, cfg.task.params, seed=cfg.seed)
        # prompts + token budget must fit the context: checked here where known, guarded per call (models.context)
        self.context, context_source = context_length(
            self.model, self.gen_cfg.max_model_len if self.gen_cfg.engine == "vllm" else None
        )
        check_task_fits(
            org_id,
            self.task,
            self.tokenizer,
            lambda p: render_prompt(self.tokenizer, p.messages),
            self.context,
            context_source,
            max_new_tokens=self.gen_cfg.max_new_tokens,
            eval_max_new_tokens=self.gen_cfg.eval_max_new_tokens,
            eval_ids=eval_ids(self.task.size("test"), cfg.task.eval_size),
        )
        model_path, tokenizer_path = model_sources(org.model)
        self.engine = build_engine(
            self.gen_cfg.engine,
            self.model,
            self.tokenizer,
            EngineOptions.from_config(
                self.gen_cfg, seed=self.seed, model_path=model_path, tokenizer_path=tokenizer_path
            ),
        )
        self.eos_id = eos_token_id(self.tokenizer)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_id
        self.trainer = LocalTrainer(self.model, cfg.algorithm, self.trainer_cfg, self.pad_id)
        self.ckpt_base = Path(run_dir) / "orgs" / org_id / "checkpoints"  # one folder per run below it
        from hacrl_fed.security.keyring import load_org_identity, load_run_roster

        self.roster = load_run_roster(cfg, run_dir)  # None when signing is off
        self.identity = load_org_identity(cfg, org_id, run_dir)
        self.run_id: str | None = None  # the run this worker serves (None: it has served none yet)
        self.last_round = 0  # the last round of run_id it trained (0: none)
        self._trained: dict[str, int] = {}  # run id -> last round this process trained in that run
        self._pristine = True  # weights, optimizer and RNG as configured: nothing trained or restored since
        self._own: _OwnRound | None = None
        self._prompt_cache: dict[tuple[int, tuple], str] = {}
        self._challenges = ChallengeBook()  # replay protection (hacrl_fed.security.freshness)
        self._initial = self._snapshot()
        if resume:
            self.restore()

    # -- runs --------------------------------------------------------------------------------------------------
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
            self.trainer = LocalTrainer(self.model, self.cfg.algorithm, self.trainer_cfg, self.pad_id)
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
        latest = latest_checkpoint(root)
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

    # -- rendering -------------------------------------------------------------------------------------------
    def _render(self, prompt: Prompt) -> str:
        key = (prompt.prompt_id, prompt.messages)
        if key not in self._prompt_cache:
            if len(self._prompt_cache) > 100_000:
                self._prompt_cache.clear()
            self._prompt_cache[key] = render_prompt(self.tokenizer, prompt.messages)
        return self._prompt_cache[key]

    def _check_prompts(self, prompts: tuple[Prompt, ...], split: str) -> None:
        """Every prompt (messages and reference) must equal this org's own copy of the task's prompt with that id:
        the coordinator cannot change what is asked or what counts as right."""
        try:
            own = self.task.prompts(split, [p.prompt_id for p in prompts])
        except (ValueError, KeyError, IndexError) as err:
            raise RequestRefused("unknown_prompt", str(err)) from None
        for mine, theirs in zip(own, prompts):
            if mine != theirs:
                raise RequestRefused(
                    "prompt_mismatch",
                    f"{split} prompt {theirs.prompt_id} differs from this org's copy "
                    f"of task {self.task.name!r} (task name, params and seed must match the run's)",
                )

    def _check_task(self, task: str) -> None:
        if task != self.task.name:
            raise ValueError(f"request is for task {task!r} but worker {self.org_id!r} runs {self.task.name!r}")

    # -- WorkerAPI -------------------------------------------------------------------------------------------
    def generate(self, plan: RoundPlan) -> RolloutBatch:
        """Sample ``G`` responses per prompt with the pre-update weights, verify, and publish them."""
        self._check_task(plan.task)
        how, path, last = self._route(plan.run_id, plan.round == 1, f"a plan for round {plan.round}")
        check_plan(self.cfg, self.org_id, plan, last_round=last, run_id=plan.run_id)
        self._check_prompts(plan.prompts, "train")
        self._enter(plan.run_id, how, path, last)  # only now: a refused plan changes nothing
        raise_if_cancelled("before generating")
        t0, c0 = time.perf_counter(), time.process_time()
        perf = PhaseMeter(self._device())
        sp = plan.sampling
        texts = [self._render(p) for p in plan.prompts]
        tokens_by_prompt = dict(
            zip((p.prompt_id for p in plan.prompts), self.tokenizer(texts, add_special_tokens=False)["input_ids"])
        )
        keep = self._fitting(plan.prompts, tokens_by_prompt, sp.max_new_tokens, "generation.max_new_tokens")
        gens = (
            self.engine.generate(
                [texts[i] for i in keep],
                num_samples=sp.num_samples,
                temperature=sp.temperature,
                top_p=sp.top_p,
                top_k=sp.top_k,
                max_new_tokens=sp.max_new_tokens,
                seed=stable_seed(sp.seed, self.seed) % (2**31),
            )
            if keep
            else []
        )
        raise_if_cancelled("after generating")
        t1 = time.perf_counter()
        gen_perf = perf.lap("generate", sum(g.token_count for row in gens for g in row))
        rollouts, rows = [], []
        for prompt, samples in zip([plan.prompts[i] for i in keep], gens):
            for j, g in enumerate(samples):
                reward = float(self.task.verify(g.text, prompt.reference))
                rollouts.append(
                    Rollout(
                        self.org_id,
                        plan.round,
                        prompt.prompt_id,
                        j,
                        g.text,
                        g.finish_reason,
                        reward,
                        g.logprob_sum,
                        g.token_count,
                    )
                )
                rows.append(
                    TrainRow(
                        list(tokens_by_prompt[prompt.prompt_id]),
                        list(g.token_ids),
                        reward,
                        prompt.prompt_id,
                        0,
                        True,
                        g.logprob_sum / max(g.token_count, 1),
                        list(g.token_log_probs),
                        n_bytes=len(g.text.encode("utf-8")),
                    )
                )
        fresh = fresh_digest(plan, self.org_id, self._challenges.expect())
        self._own = _OwnRound(
            plan.run_id, plan.round, plan.task, plan.prompts, sp.max_new_tokens, tokens_by_prompt, rows, fresh
        )
        acc = sum(r.reward for r in rollouts) / max(len(rollouts), 1)
        metrics = {
            "time/generate": t1 - t0,
            "time/verify": time.perf_counter() - t1,
            "gen/mean_tokens": sum(r.token_count for r in rollouts) / max(len(rollouts), 1),
            "gen/stop_frac": sum(r.finish_reason == "stop" for r in rollouts) / max(len(rollouts), 1),
            "gen/skipped_too_long": float(len(plan.prompts) - len(keep)),
            "cpu/generate": time.process_time() - c0,  # this process's CPU seconds (all its threads)
            **gen_perf,
        }
        metrics["trust/plan_fresh"] = float(fresh is not None)
        batch = RolloutBatch(
            plan.run_id, plan.round, self.org_id, tuple(rollouts), acc, metrics, plan_digest=plan_digest(plan)
        )
        return self._publish(batch, sp.max_new_tokens * self.cfg.security.max_bytes_per_token)

    def _publish(self, batch: RolloutBatch, max_text_bytes: int) -> RolloutBatch:
        """Seal the text for the other orgs (coordinator-blind mode), then sign (encrypt-then-sign)."""
        if self.identity is None:
            return batch
        from hacrl_fed.security.envelope import signed
        from hacrl_fed.security.sealing import seal_batch

        t0 = time.perf_counter()
        if self.cfg.security.encrypt:
            recipients = {o: k for o, k in (self.roster or {}).items() if o != self.org_id}
            pad_limit = max_text_bytes if self.cfg.security.pad_sealed else None
            batch = seal_batch(batch, recipients, pad_limit=pad_limit)
        metrics = {**batch.metrics, "time/seal_sign": time.perf_counter() - t0}  # signing itself: ~0.1 ms
        return signed(replace(batch, metrics=metrics), self.identity)

    def _open_source(self, batch: RolloutBatch) -> RolloutBatch:
        """Verify a foreign batch against the pinned roster and open it when sealed; raises RejectedBatch."""
        from hacrl_fed.security.envelope import verify_signed
        from hacrl_fed.security.sealing import is_sealed, open_batch

        own = self._own
        assert own is not None and self.roster is not None and self.identity is not None
        batch = verify_signed(batch, self.roster, run_id=own.run_id, round=own.round)
        check_fresh(batch, own.fresh_digest)  # made for the plan this learner answered, this round (stale_plan)
        if not is_sealed(batch):
            return batch
        return open_batch(batch, self.org_id, self.identity.box_key, padded=self.cfg.security.pad_sealed)

    def train(self, request: TrainRequest) -> TrainReport:
        """Score foreign rollouts with this model's tokenizer and run this round's update."""
        own = self._own
        if own is None or own.round != request.round:
            raise RequestRefused(
                "not_generated",
                f"train for round {request.round} but this worker generated "
                f"{'nothing' if own is None else f'round {own.round}'}",
            )
        if request.run_id != own.run_id:
            raise RequestRefused(
                "wrong_run", f"train for run {request.run_id[:80]!r}, not the run round {own.round} was generated for"
            )
        if request.org_id != self.org_id:
            raise RequestRefused(
                "wrong_org", f"train request for org {request.org_id!r} sent to worker {self.org_id!r}"
            )
        check_capability(self.cfg, request.capability)
        raise_if_cancelled("before training")
        t0, c0 = time.perf_counter(), time.process_time()
        perf = PhaseMeter(self._device())
        sel = self.trainer_cfg.selection  # the learner's own choice of foreign rows, before any tokenization
        select_seed = stable_seed(self.seed, "select", own.round)
        foreign, trust = screen_sources(
            self.cfg,
            self.org_id,
            request,
            prompts=own.prompts,
            task=own.task,
            verify=self.task.verify if self.cfg.security.reverify_rewards else None,
            open_source=self._open_source if self.identity is not None else None,
            lazy=self._lazy_take(sel, len(own.rows), select_seed),
        )
        t_trust, c_trust = time.perf_counter(), time.process_time()
        known = {o.id for o in self.cfg.orgs}
        agents = sorted({a for a in request.capability if a in known} | {self.org_id} | {r.org_id for r in foreign})
        learner = agents.index(self.org_id)
        capability = [float(request.capability.get(a, 1.0)) for a in agents]
        for row in own.rows:
            row.source = learner
        foreign, selected = select_rollouts(foreign, own.rows, sel.rule, sel.budget, sel.budget_multiple, select_seed)
        foreign_rows, dropped = self._foreign_rows(foreign, own, agents)
        score_perf = perf.lap("score", sum(len(r.response_ids) for r in foreign_rows))
        raise_if_cancelled("before the update")
        t1, c1 = time.perf_counter(), time.process_time()
        with self.engine.released():  # a vLLM engine may sleep during the update (generation.sleep_during_train)
            metrics = self.trainer.update(own.rows + foreign_rows, learner, capability, names=agents)
        self.engine.sync_weights(self.model)
        c2 = time.process_time()
        metrics.update({**score_perf, **perf.lap("train", metrics.get("train/num_tokens", 0.0))})
        self._own = None
        self.last_round, self._trained[request.run_id], self._pristine = request.round, request.round, False
        metrics.update(trust)
        metrics.update(selected)
        metrics.update(
            {
                "time/trust": t_trust - t0,
                "time/score": t1 - t_trust,
                "time/train": time.perf_counter() - t1,
                "train/foreign_received": float(
                    len(request.foreign) + request.unread_foreign + sum(len(b.rollouts) for b in request.source_batches)
                ),
                "train/foreign_unscored": float(dropped),
                "cpu/trust": c_trust - c0,  # this process's CPU seconds (all its threads), as time/... splits them
                "cpu/update": c2 - c1,
                "cpu/train": time.process_time() - c0,  # the whole train call
            }
        )
        return self._sign_report(
            TrainReport(
                request.run_id,
                request.round,
                self.org_id,
                metrics,
                disclosed_keys=self._evidence(request, trust),
                challenge=self._challenges.issue(),
            )
        )

    @staticmethod
    def _lazy_take(sel, own_rows: int, seed: int) -> LazyTake | None:
        """A source-ordered rule (``peer_sample``) screens sources in its order only until its budget is full."""
        if sel.rule not in SOURCE_ORDERED:
            return None
        budget = resolve_budget(sel.budget, sel.budget_multiple, own_rows)
        assert budget is not None  # the config requires one for these rules
        return LazyTake(order=lambda names: source_order(names, seed), budget=budget)

    def _evidence(self, request: TrainRequest, trust: dict[str, float]) -> dict[str, bytes]:
        """Blind mode: the content key of every source batch in which this learner found reward mismatches, so
        the coordinator can open that batch and check the verdict itself (SECURITY.md)."""
        if not self.cfg.security.encrypt or self.identity is None:
            return {}
        from hacrl_fed.security.envelope import RejectedBatch
        from hacrl_fed.security.sealing import content_key

        keys = {}
        for batch in request.source_batches:
            src = str(getattr(batch, "org_id", ""))
            if trust.get(f"trust/{src}/mismatches", 0.0) > 0 and src not in keys:
                try:
                    keys[src] = content_key(batch, self.org_id, self.identity.box_key)
                except RejectedBatch:  # its batch did not open here either: nothing to disclose
                    continue
        return keys

    def _sign_report(self, report: TrainReport) -> TrainReport:
        """Sign the report with this org's identity (signing on), so its verdicts on other orgs count."""
        if self.identity is None:
            return report
        from hacrl_fed.security.reports import sign_report

        return sign_report(report, self.identity)

    def step(self, request: StepRequest) -> StepReply:
        """One message of a round: :meth:`train` on round ``r - 1``'s request, :meth:`evaluate` and
        :meth:`checkpoint` when asked, then :meth:`generate` on round ``r``'s plan with the updated weights
        (:func:`hacrl_fed.worker.step.run_step`). The request is refused whole, before any work, when its halves do
        not belong together or the plan is outside this org's limits."""
        if request.train is not None or request.plan is not None:  # evaluate / checkpoint alone: checked by each
            check_step(self.org_id, request)
        train, plan = request.train, request.plan
        if train is not None and plan is not None:  # the plan as generate() will check it once the train is done
            self._check_task(plan.task)
            check_plan(self.cfg, self.org_id, plan, last_round=train.round, run_id=self.run_id)
            self._check_prompts(plan.prompts, "train")
        self._challenges.hold()  # the plan carries the challenge issued before this message, not the train half's
        try:
            return run_step(self, request)
        finally:
            self._challenges.release()

    def _foreign_rows(self, foreign: list[Rollout], own: _OwnRound, agents: list[str]) -> tuple[list[TrainRow], int]:
        """Re-tokenize screened foreign responses with this learner's template and tokenizer (EOS iff the source
        stopped)."""
        usable = [r for r in foreign if r.prompt_id in own.tokens_by_prompt]
        dropped = len(foreign) - len(usable)
        if not usable:
            return [], dropped
        # prompts: this round's rendered-and-tokenized ids from generate(); responses: the learner's tokens
        responses = response_token_ids(
            self.tokenizer, [r.response for r in usable], [r.finish_reason for r in usable], eos_token_id=self.eos_id
        )
        cap = FOREIGN_LENGTH_FACTOR * own.max_new_tokens
        per_byte = self.cfg.algorithm.logprob_norm == "per_byte"
        rows = []
        for r, resp in zip(usable, responses):
            if not resp or len(resp) > cap:  # kept with no tokens: counts in the group's baseline, not trained on
                dropped += 1
                resp = []
            # per_byte: both sides' sequence log-prob is its sum over the response's UTF-8 bytes (>= 1)
            n_bytes = float(max(len(r.response.encode("utf-8")), 1)) if per_byte else 0.0
            rows.append(
                TrainRow(
                    own.tokens_by_prompt[r.prompt_id],
                    resp,
                    float(r.reward),
                    r.prompt_id,
                    agents.index(r.org_id),
                    False,
                    r.logprob_sum / n_bytes if per_byte else r.mean_log_prob,  # lbar_j per byte, or per token
                    norm_length=n_bytes,
                    n_bytes=len(r.response.encode("utf-8")),
                    claimed_log_prob_sum=float(r.logprob_sum),
                    claimed_token_count=int(r.token_count),
                )
            )
        return rows, dropped

    def evaluate(self, request: EvalRequest) -> EvalReport:
        """Greedy accuracy on held-out prompts."""
        self._check_task(request.task)
        how, path, last = self._route(request.run_id, request.round == 0, f"an evaluation at round {request.round}")
        check_eval(self.cfg, self.org_id, request, run_id=request.run_id)
        self._check_prompts(request.prompts, "test")
        self._enter(request.run_id, how, path, last)
        t0 = time.perf_counter()
        texts = [self._render(p) for p in request.prompts]
        lengths = dict(
            zip((p.prompt_id for p in request.prompts), self.tokenizer(texts, add_special_tokens=False)["input_ids"])
        )
        keep = self._fitting(request.prompts, lengths, request.max_new_tokens, "generation.eval_max_new_tokens")
        gens = self.engine.greedy([texts[i] for i in keep], max_new_tokens=request.max_new_tokens) if keep else []
        rewards = [0.0] * len(request.prompts)  # a prompt that does not fit the context counts as wrong
        for i, g in zip(keep, gens):
            rewards[i] = float(self.task.verify(g.text, request.prompts[i].reference))
        acc = sum(rewards) / max(len(rewards), 1)
        return EvalReport(
            request.run_id,
            request.round,
            self.org_id,
            acc,
            len(rewards),
            {"time/eval": time.perf_counter() - t0, "skipped_too_long": float(len(request.prompts) - len(keep))},
        )

    def _fitting(self, prompts, tokens_by_prompt: dict, budget: int, field: str) -> list[int]:
        """Indices of ``prompts`` whose tokens plus ``budget`` fit the model's context (hacrl_fed.models.context);
        the rest are skipped with a warning (and counted by the caller)."""
        keep = [i for i, p in enumerate(prompts) if fits(len(tokens_by_prompt[p.prompt_id]), budget, self.context)]
        if len(keep) < len(prompts):
            longest = max(len(tokens_by_prompt[p.prompt_id]) for p in prompts)
            log.warning(
                "worker %s: skipped %d of %d prompts that do not fit the model's context of %s tokens with "
                "%s=%d (longest prompt %d tokens)",
                self.org_id,
                len(prompts) - len(keep),
                len(prompts),
                self.context,
                field,
                budget,
                longest,
            )
        return keep

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def health(self) -> dict[str, str]:
        from hacrl_fed.security.keyring import identity_health  # its signing key: checked before round 1

        return {
            "org_id": self.org_id,
            "status": "ok",
            "round": str(self.last_round),
            "params": str(sum(p.numel() for p in self.model.parameters())),
            HEALTH_KEY: self._challenges.for_health().hex(),  # for the first plan of a run (freshness)
            **identity_health(self.roster, self.identity),
        }

    def checkpoint(self, round: int) -> str:
        """Checkpoint the round just trained into this run's folder, ``<run dir>/orgs/<org>/checkpoints/<run id>``."""
        check_checkpoint(self.org_id, round, last_round=self.last_round)
        assert self.run_id is not None  # last_round > 0: a run was trained
        path = save_checkpoint(
            run_checkpoint_root(self.ckpt_base, self.run_id),
            round,
            self.model,
            self.trainer.state_dict(),
            {"org_id": self.org_id, "last_round": self.last_round, "run_id": self.run_id},
        )
        return str(path)

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
        self.trainer.load_state_dict(trainer_state)
        self.engine.sync_weights(self.model)
        self._pristine = False


def _wrap_lora(model, trainer_cfg):
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:  # pragma: no cover - peft is optional
        raise ImportError("trainer.lora.enabled needs peft: pip install 'hacrl-fed[lora]'") from err
    lc = trainer_cfg.lora
    return get_peft_model(
        model,
        LoraConfig(
            r=lc.r,
            lora_alpha=lc.alpha,
            lora_dropout=lc.dropout,
            target_modules=lc.target_modules,
            task_type="CAUSAL_LM",
        ),
    )
