"""The policy worker's own checks of every request (defence in depth: it does not rely on the coordinator).

A worker refuses (:class:`RequestRefused`, a ``ValueError``, so gRPC answers INVALID_ARGUMENT) any request that
does not fit its own state and configured limits:

* the run: a request must be of the run the worker serves (``run_id``); the policy worker switches to another run
  only to resume it from its own checkpoint of that run, or to start a run it never trained at that run's first
  request, from its configured initial weights (:mod:`hacrl_fed.worker.policy_worker`); anything else is
  ``wrong_run``, and so is a train request for another run than the round it generated;
* rounds only forward: a plan's round is after the last trained one and at most :data:`MAX_ROUND_STEP`
  ahead of it; a plan at most ``security.max_stale_rounds`` rounds behind is a coordinator restart
  (``stale_round``), one further behind means another client drove the worker ahead (``round_ahead``, counted as
  an attack); ``train`` only for the round it generated; ``checkpoint`` only for the round it last trained;
* no plan or eval request without prompts (``empty_plan``); the capability table of a train request has at most
  one entry per configured org and none for others (``bad_capability``), and so has a plan's challenge map, whose
  values are exactly 32 bytes (``bad_challenges``; :mod:`hacrl_fed.security.freshness`);
* a fused round (``StepRequest``): the train request is for this org and the plan is of the same run and the
  round right after it (``step_mismatch``); the plan is checked against the limits below before the train half
  starts, and each half then passes its own checks;
* plan size: ``num_samples``, ``max_new_tokens`` and the number of prompts at most the worker's own configured
  values (``generation.num_samples``, ``generation.max_new_tokens``, ``federation.prompts_per_round``); eval
  requests at most ``task.eval_size`` prompts and ``generation.eval_max_new_tokens`` tokens.

Foreign rollouts are admitted by the intake (:mod:`hacrl_fed.worker.intake`), not here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hacrl_fed.config import RunConfig, org_generation
from hacrl_fed.types import EvalRequest, Prompt, RoundPlan, StepRequest, TrainRequest

MAX_ROUND_STEP = 1000  # how far ahead of its last trained round a worker accepts a plan (fixed since issue 42)


class RequestRefused(ValueError):
    """A request that does not fit the worker's state or limits; ``reason`` is a short metrics-friendly code.

    ``failure_cause`` (:mod:`hacrl_fed.failures`): how the coordinator counts the refusal, ``stale_round`` or
    ``round_ahead`` for those reasons, else ``error``; it travels with the error over gRPC and Flower.
    No message names the run the worker serves (only the request's own run id), so a caller with a wrong run id
    learns nothing about the run it could then drive."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.failure_cause = reason if reason in ("stale_round", "round_ahead") else "error"


class StaleRoundError(RequestRefused):
    """A plan for a round this worker already trained in the same run (a coordinator restarted from an older
    state); the coordinator counts it as ``stale_round`` and the org rejoins at the next round."""

    def __init__(self, message: str) -> None:
        super().__init__("stale_round", message)


class RoundAheadError(RequestRefused):
    """A plan more than ``security.max_stale_rounds`` rounds behind what this worker trained in that run: no
    restart of the coordinator explains it (it saves its state every round, so a restarted one is at most one
    round behind its workers); someone else drove this worker ahead. Counted as ``round_ahead``, not as a
    restart."""

    def __init__(self, message: str) -> None:
        super().__init__("round_ahead", message)


def check_plan(cfg: RunConfig, org_id: str, plan: RoundPlan, *, last_round: int, run_id: str | None) -> None:
    """Refuse a plan for another run, a stale or far-future round, an empty one, or one larger than this org's
    limits."""
    if run_id is not None and plan.run_id != run_id:
        raise RequestRefused("wrong_run", f"worker {org_id!r} does not serve run {plan.run_id[:80]!r}")
    if plan.round <= last_round:
        behind = last_round - plan.round + 1
        if behind > cfg.security.max_stale_rounds:
            raise RoundAheadError(
                f"worker {org_id!r} trained {behind} rounds of run {plan.run_id[:80]!r} beyond this plan's round "
                f"{plan.round} (security.max_stale_rounds={cfg.security.max_stale_rounds}): not a restart; "
                "another client drove this worker ahead"
            )
        raise StaleRoundError(
            f"worker {org_id!r} already trained round {last_round} of run {plan.run_id[:80]!r}; "
            f"refusing a plan for round {plan.round}"
        )
    if not plan.prompts:
        raise RequestRefused("empty_plan", "the plan lists no prompts")
    if plan.round > last_round + MAX_ROUND_STEP:
        raise RequestRefused(
            "round_too_far",
            f"round {plan.round} is more than {MAX_ROUND_STEP} rounds after the last trained round {last_round}",
        )
    gen, sp = org_generation(cfg, org_id), plan.sampling
    _at_most("num_samples", sp.num_samples, gen.num_samples, "generation.num_samples")
    _at_most("max_new_tokens", sp.max_new_tokens, gen.max_new_tokens, "generation.max_new_tokens")
    _at_most("prompts", len(plan.prompts), cfg.federation.prompts_per_round, "federation.prompts_per_round")
    _distinct_prompts(plan.prompts)
    check_challenges(cfg, plan)


def check_eval(cfg: RunConfig, org_id: str, request: EvalRequest, *, run_id: str | None) -> None:
    """Refuse an eval request of another run or beyond this org's eval limits."""
    if run_id is not None and request.run_id != run_id:
        raise RequestRefused("wrong_run", f"worker {org_id!r} does not serve run {request.run_id[:80]!r}")
    if not request.prompts:
        raise RequestRefused("empty_plan", "the eval request lists no prompts")
    gen = org_generation(cfg, org_id)
    _at_most("max_new_tokens", request.max_new_tokens, gen.eval_max_new_tokens, "generation.eval_max_new_tokens")
    _at_most("prompts", len(request.prompts), cfg.task.eval_size, "task.eval_size")


def check_step(org_id: str, request: StepRequest) -> None:
    """A fused round (:class:`StepRequest`) holds a train request for this org and the plan of the round right
    after it, of the same run; each half is then checked as its own request would be."""
    train, plan = request.train, request.plan
    if train is None and plan is None:
        raise RequestRefused("empty_step", "the step request carries neither a train request nor a plan")
    if train is not None and train.org_id != org_id:
        raise RequestRefused("wrong_org", f"train request for org {train.org_id!r} sent to worker {org_id!r}")
    if train is None or plan is None:
        return
    if plan.run_id != train.run_id:
        raise RequestRefused("step_mismatch", f"train of run {train.run_id!r} with a plan of run {plan.run_id!r}")
    if plan.round != train.round + 1:
        raise RequestRefused(
            "step_mismatch", f"train of round {train.round} with a plan for round {plan.round}, not {train.round + 1}"
        )


def check_train(org_id: str, request: TrainRequest, own: Any) -> Any:
    """A train request is for the round this worker generated last (``own``: what it kept of that round, None when
    nothing), of the same run, for this org; returns ``own``."""
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
    if request.org_id != org_id:
        raise RequestRefused("wrong_org", f"train request for org {request.org_id!r} sent to worker {org_id!r}")
    return own


def check_checkpoint(org_id: str, round: int, *, last_round: int) -> None:
    """A checkpoint is written only for the round this worker last trained."""
    if last_round == 0 or round != last_round:
        raise RequestRefused(
            "bad_checkpoint_round",
            f"worker {org_id!r} last trained round {last_round}; refusing a checkpoint for round {round}",
        )


def check_capability(cfg: RunConfig, capability: Mapping[str, float]) -> None:
    """The capability table is bounded by the run's orgs: at most one entry per configured org, none for others."""
    orgs = {o.id for o in cfg.orgs}
    if len(capability) > len(orgs):
        raise RequestRefused("bad_capability", f"{len(capability)} capability entries for {len(orgs)} orgs")
    unknown = sorted(k for k in capability if k not in orgs)
    if unknown:
        raise RequestRefused("bad_capability", f"capability entries for orgs not in the run: {unknown[:4]}")


def check_challenges(cfg: RunConfig, plan: RoundPlan) -> None:
    """A plan's challenge map (replay protection) is bounded by the run's orgs: at most one entry per configured
    org, none for others, every challenge exactly :data:`~hacrl_fed.security.freshness.CHALLENGE_BYTES` bytes."""
    from hacrl_fed.security.freshness import challenges_problem

    problem = challenges_problem(plan.challenges, (o.id for o in cfg.orgs))
    if problem is not None:
        raise RequestRefused("bad_challenges", problem)


def _at_most(what: str, value: int, limit: int, field: str) -> None:
    if value > limit:
        raise RequestRefused("over_limit", f"{what}={value} exceeds this worker's {field}={limit}")


def _distinct_prompts(prompts: tuple[Prompt, ...]) -> None:
    ids = [p.prompt_id for p in prompts]
    if len(set(ids)) != len(ids):
        raise RequestRefused("duplicate_prompt", "the plan lists a prompt id twice")
