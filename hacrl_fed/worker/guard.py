"""The policy worker's own checks of every request (defence in depth: it does not rely on the coordinator).

A worker refuses (:class:`RequestRefused`, a ``ValueError``, so gRPC answers INVALID_ARGUMENT) any request that
does not fit its own state and configured limits:

* the run: a request must be of the run the worker serves (``run_id``); the policy worker switches to another run
  only to resume it from its own checkpoint of that run, or to start a run it never trained at that run's first
  request, from its configured initial weights (:mod:`hacrl_fed.worker.policy_worker`); anything else is
  ``wrong_run``, and so is a train request for another run than the round it generated;
* rounds only forward: a plan's round is after the last trained one and at most ``security.max_round_step``
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

Foreign rollouts are screened per source by :func:`screen_sources` before any tokenization: signature (when
signing is on) against the pinned roster, freshness (the batch must sign the digest of the learner's own plan of
the round, which carried the learner's latest challenge: ``stale_plan``, :mod:`hacrl_fed.security.freshness`),
decryption (coordinator-blind mode), known org, this round's prompts,
exactly ``G`` samples per prompt, finite log-probs <= 0, text within the plan's byte bound, and the claimed
reward re-verified with this worker's own task verifier. Every drop is counted per source and reason in the
TrainReport as ``trust/<source>/rejected/<reason>``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Mapping

from hacrl_fed.config import RunConfig, org_generation
from hacrl_fed.plan.screening import Screened, screen_batch
from hacrl_fed.types import (
    EvalRequest,
    Prompt,
    Rollout,
    RolloutBatch,
    RoundPlan,
    SamplingParams,
    StepRequest,
    TrainRequest,
)


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
    step = cfg.security.max_round_step
    if plan.round > last_round + step:
        raise RequestRefused(
            "round_too_far",
            f"round {plan.round} is more than security.max_round_step={step} "
            f"rounds after the last trained round {last_round}",
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


# ---------------------------------------------------------------------------------------------- foreign rollouts


@dataclasses.dataclass
class SourceReport:
    """Per source org: what arrived, what was kept, and the verified rewards (for capability in blind mode)."""

    received: int = 0
    screened: Screened | None = None
    rejected: Counter = dataclasses.field(default_factory=Counter)
    excluded: bool = False
    unscreened: int | None = None  # lazy screening only: rollouts of a source the selection did not reach

    def metrics(self, source: str) -> dict[str, float]:
        s = self.screened or Screened()
        rejected = self.rejected + s.rejected
        out = {
            f"trust/{source}/received": float(self.received),
            f"trust/{source}/accepted": float(0 if self.excluded else len(s.accepted)),
            f"trust/{source}/checked": float(s.checked),
            f"trust/{source}/mismatches": float(s.mismatches),
            f"trust/{source}/verified_reward_sum": float(s.verified_reward_sum),
            f"trust/{source}/excluded": float(self.excluded),
        }
        if self.unscreened is not None:
            out[f"trust/{source}/unscreened"] = float(self.unscreened)
        out.update({f"trust/{source}/rejected/{why}": float(n) for why, n in rejected.items()})
        return out


def source_plan(
    cfg: RunConfig, source: str, run_id: str, round: int, task: str, prompts: tuple[Prompt, ...]
) -> RoundPlan:
    """The plan ``source`` answered, as this worker reconstructs it from its own config and this round's prompts."""
    gen = org_generation(cfg, source)
    return RoundPlan(
        run_id, round, task, prompts, SamplingParams(max_new_tokens=gen.max_new_tokens, num_samples=gen.num_samples)
    )


def max_foreign(cfg: RunConfig, org_id: str, n_prompts: int) -> int:
    """(orgs − 1) × prompts × G: the most foreign rollouts an honest round can hold (G per source org)."""
    return sum(n_prompts * org_generation(cfg, o.id).num_samples for o in cfg.orgs if o.id != org_id)


def _collect_sources(
    request: TrainRequest, *, signing: bool, reports: dict[str, SourceReport]
) -> dict[str, RolloutBatch]:
    """Foreign batches by claimed source org, in arrival order, none opened yet: the signed envelopes when signing
    (a second batch of one source is ``duplicate_source``, loose rollouts are ``unsigned``), else the flat list
    grouped by org id."""
    batches: dict[str, RolloutBatch] = {}
    if signing:
        unsigned = len(request.foreign) + request.unread_foreign
        if unsigned:
            reports.setdefault("coordinator", SourceReport()).rejected["unsigned"] += unsigned
        for batch in request.source_batches:
            src = str(getattr(batch, "org_id", "?"))[:64]
            rep = reports.setdefault(src, SourceReport())
            rep.received += len(getattr(batch, "rollouts", ()) or ())
            if src in batches:
                rep.rejected["duplicate_source"] += max(len(batch.rollouts), 1)
                continue
            batches[src] = batch
        return batches
    grouped: dict[str, list[Rollout]] = {}
    for r in request.foreign:
        grouped.setdefault(str(r.org_id), []).append(r)
    for src, rollouts in grouped.items():
        reports.setdefault(src, SourceReport()).received += len(rollouts)
        batches[src] = RolloutBatch(request.run_id, request.round, src, tuple(rollouts), 0.0)
    return batches


@dataclasses.dataclass(frozen=True)
class LazyTake:
    """Screen sources lazily for a source-ordered selection rule (``peer_sample``): in ``order(names)``, and no
    further once ``budget`` rows are accepted; a source not reached is counted ``trust/<source>/unscreened``."""

    order: Callable[[list[str]], list[str]]
    budget: int


def screen_sources(
    cfg: RunConfig,
    org_id: str,
    request: TrainRequest,
    *,
    prompts: tuple[Prompt, ...],
    task: str,
    verify: Callable[[str, str], float] | None,
    open_source: Callable[[RolloutBatch], RolloutBatch] | None = None,
    lazy: LazyTake | None = None,
) -> tuple[list[Rollout], dict[str, float]]:
    """Foreign rollouts this worker will train on, and ``trust/...`` metrics saying what was dropped and why.

    ``prompts`` are this round's prompts as the worker received them in its own plan (never the train
    request's copy); ``open_source`` verifies (and decrypts) one signed source batch, raising RejectedBatch.
    ``lazy``: screen only as many sources as a source-ordered selection takes (:class:`LazyTake`). The accepted
    rollouts keep the sources' arrival order either way; a lazy screen returns the accepted rollouts of the
    sources it reached, which hold every row the selection would take after a full screen.
    """
    signing = cfg.security.signing
    reports: dict[str, SourceReport] = {}
    total = sum(len(b.rollouts) for b in request.source_batches) if signing else len(request.foreign)
    known = {o.id for o in cfg.orgs if o.id != org_id}
    too_many_batches = signing and len(request.source_batches) > len(known)
    if total > max_foreign(cfg, org_id, len(prompts)) or too_many_batches:
        rep = reports.setdefault("*", SourceReport(received=total))
        rep.rejected["too_many_foreign"] += total
        return [], _metrics(reports)
    batches = _collect_sources(request, signing=signing, reports=reports)
    kept: dict[str, list[Rollout]] = {}
    taken = 0
    for src in batches if lazy is None else lazy.order(list(batches)):
        rep, batch = reports[src], batches[src]
        if lazy is not None:
            rep.unscreened = 0
            if taken >= lazy.budget:  # the selection is full: this source is never opened or checked
                rep.unscreened = len(batch.rollouts)
                continue
        if signing and open_source is not None:
            try:
                batch = open_source(batch)
            except ValueError as err:  # RejectedBatch: bad signature, unknown org, wrong run/round, undecryptable
                rep.rejected[getattr(err, "reason", "malformed")] += max(len(batch.rollouts), 1)
                continue
        if src not in known:
            rep.rejected["unknown_org"] += max(len(batch.rollouts), 1)
            continue
        plan = source_plan(cfg, src, request.run_id, request.round, task, prompts)
        rep.screened = screen_batch(
            batch, plan, src, verify=verify, max_bytes_per_token=cfg.security.max_bytes_per_token
        )
        if rep.screened.mismatch_rate > cfg.security.max_mismatch_rate:
            rep.excluded = True
            rep.rejected["source_excluded"] += len(rep.screened.accepted)
            continue
        kept[src] = rep.screened.accepted
        taken += len(rep.screened.accepted)
    accepted = [r for src in batches if src in kept for r in kept[src]]  # arrival order of the sources
    return accepted, _metrics(reports)


def _metrics(reports: Mapping[str, SourceReport]) -> dict[str, float]:
    out: dict[str, float] = {}
    for src, rep in reports.items():
        out.update(rep.metrics(src))
    out["trust/foreign_accepted"] = float(
        sum(0 if r.excluded else len((r.screened or Screened()).accepted) for r in reports.values())
    )
    out["trust/foreign_rejected"] = float(
        sum(sum((r.rejected + (r.screened or Screened()).rejected).values()) for r in reports.values())
    )
    return out
