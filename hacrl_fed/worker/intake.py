"""The one door for foreign rows: how a learner admits the other orgs' rollouts of a TrainRequest.

:meth:`Intake.admit` runs the stages top to bottom, each a method of its own (docs/ARCHITECTURE.md step 5):

1. **bound**: more foreign rows than an honest round holds, or more source batches than orgs, are dropped whole
   (``too_many_foreign``); a second batch of one source is ``duplicate_source``, loose rollouts in a signed run
   ``unsigned``;
2. **open** (the identity border, :mod:`hacrl_fed.worker.identity_border`): the signature against the pinned
   roster, freshness (``stale_plan``) and decryption;
3. **screen_batch** (:mod:`hacrl_fed.plan.screening`) against the plan the source answered, with this org's own
   verifier re-checking every claimed reward;
4. **exclude** a source whose share of contradicted rewards exceeds ``security.max_mismatch_rate``; with
   ``trainer.outcome_guard`` on, leave out the rows of a source it quarantines (:mod:`hacrl_fed.worker.outcome`,
   ledger stage ``outcome``);
5. **select** by the org's ``trainer.selection`` rule and budget (:mod:`hacrl_fed.algorithm.selection`), the
   budget pooled or split into per-source shares (``budget_split``, :mod:`hacrl_fed.algorithm.budget_split`: a
   share is fixed here, before stage 7, so rows the likelihood screen drops spend only their own source's); a
   source-ordered rule (``peer_sample``) screens lazily (:class:`LazyTake`): sources it never reaches are never
   opened (``unscreened``);
6. **re-tokenize** the selected text with this learner's template and tokenizer;
7. **likelihood screen** (:mod:`hacrl_fed.algorithm.likelihood_screen`) with the scorer the trainer hands in
   (:class:`Scoring`);
8. **fit the context**: rows longer than the learner's context are not trained on (they still count in their
   joint group's advantage statistics, as rows without tokens do).

An algorithm that uses no foreign rows (its registry spec's ``uses_cross``: gspo, grpo) still runs stages 1-4,
so its trust counters are written, and skips 5-7. One :class:`~hacrl_fed.worker.ledger.Ledger` records what each
stage dropped and why and writes the metrics. The update (:meth:`hacrl_fed.trainer.LocalTrainer.update`) then
optimizes exactly the rows admitted.

The stages are run here once for lock-step and asynchronous rounds; what differs (which rows reach stages 1-4, the
own view and baseline rows selection sees, the steps after admission) is a :class:`Rounds`: :class:`LockStep`, or
:class:`~hacrl_fed.worker.late_rounds.LateRounds`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from hacrl_fed.algorithm.likelihood_screen import REASONS, GapHistory, ScreenParams, likelihood_screen
from hacrl_fed.algorithm.selection import resolve_budget, select_rollouts, source_order, source_ordered
from hacrl_fed.config import LikelihoodScreenConfig, RunConfig, SelectionConfig, org_generation
from hacrl_fed.models.context import fits
from hacrl_fed.plan.screening import screen_batch
from hacrl_fed.scoring import response_token_ids
from hacrl_fed.trainer import TrainRow
from hacrl_fed.types import Prompt, Rollout, RolloutBatch, RoundPlan, SamplingParams, TrainRequest
from hacrl_fed.worker.ledger import UNSIGNED, Ledger

log = logging.getLogger(__name__)

FOREIGN_LENGTH_FACTOR = 8  # foreign responses longer than this × max_new_tokens (learner tokens) are not trained on

Opener = Callable[[RolloutBatch], RolloutBatch]  # verifies (and decrypts) one signed batch; raises RejectedBatch
# the outcome guard's quarantine (hacrl_fed.worker.outcome): the rows it admits and its outcome/<source>/... counts
LeaveOut = Callable[[list[Rollout], Ledger], tuple[list[Rollout], dict[str, float]]]


@dataclasses.dataclass
class OwnRound:
    """What :meth:`PolicyWorker.generate` keeps for this round's train."""

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


@dataclasses.dataclass(frozen=True)
class LazyTake:
    """Screen sources lazily for a source-ordered selection rule (``peer_sample``): in ``order(names)``, and no
    further once ``budget`` rows are accepted; a source not reached is counted ``trust/<source>/unscreened``."""

    order: Callable[[list[str]], list[str]]
    budget: int


def lazy_take(sel: SelectionConfig, own_rows: int, seed: int) -> LazyTake | None:
    """The lazy screen of a source-ordered rule with its budget; None for every other rule."""
    if not source_ordered(sel.rule):
        return None
    budget = resolve_budget(sel.budget, sel.budget_multiple, own_rows)
    assert budget is not None  # the config requires one for these rules
    return LazyTake(order=lambda names: source_order(names, seed), budget=budget)


@dataclasses.dataclass(frozen=True)
class Scoring:
    """What the trainer hands the intake: ``score`` (the learner's sequence log-prob sums of rows, no gradient,
    pre-update weights: [N] floats), its ``context`` (None: unbounded) and the likelihood screen's per-source
    history (state the trainer checkpoints; the intake updates it)."""

    score: Callable[[Sequence[TrainRow]], list[float]]
    context: int | None
    history: dict[str, GapHistory]

    @classmethod
    def of(cls, trainer: Any) -> Scoring:
        """A :class:`~hacrl_fed.trainer.LocalTrainer`'s scorer, context and screen history."""
        return cls(trainer.log_prob_sums, trainer.context, trainer.screen_history)


@dataclasses.dataclass
class Admitted:
    """The rows the update trains on (own rows first), the agents (``learner`` indexes them, ``capability`` per
    agent), the ledger, the re-tokenized foreign tokens and the stages' timings."""

    rows: list[TrainRow]
    agents: list[str]
    learner: int
    capability: list[float]
    ledger: Ledger
    scored_tokens: int
    times: dict[str, float]
    outcome: dict[str, float] = dataclasses.field(default_factory=dict)  # the outcome guard's quarantine counts
    staleness: dict[str, float] = dataclasses.field(default_factory=dict)  # async: hacrl_fed.worker.row_ages
    # asynchronous rounds: per row, (Phat_learner, Phat_source) of the row's round (None: one figure per agent)
    row_capability: tuple[list[float], list[float]] | None = None
    # the foreign rows that passed stages 1-4 and those stage 5 selected (the sample book's fates, worker.samples)
    offered: list[Rollout] = dataclasses.field(default_factory=list)
    selected: list[Rollout] = dataclasses.field(default_factory=list)

    def update_metrics(self, update: dict[str, float]) -> dict[str, float]:
        """The update's metrics with the last two stages' counts (:func:`update_metrics`)."""
        return update_metrics(update, self.rows, self.ledger)

    def metrics(self, request: TrainRequest) -> dict[str, float]:
        """The ledger's trust and selection counts, the intake's own ``train/foreign_*`` counts and its timings."""
        received = len(request.foreign) + request.unread_foreign + sum(len(b.rollouts) for b in request.source_batches)
        return {
            **self.ledger.trust_metrics(),
            **self.ledger.row_metrics(),
            **self.ledger.select_metrics,
            **self.times,
            **self.staleness,
            **self.outcome,
            "train/foreign_received": float(received),
            "train/foreign_unscored": float(self.ledger.unscored()),
        }


class Rounds(Protocol):
    """What differs between lock-step and asynchronous rounds in :meth:`Intake.admit` (the stages stay there):
    :class:`LockStep`, :class:`~hacrl_fed.worker.late_rounds.LateRounds`."""

    def gather(self, ledger: Ledger) -> tuple[list[Rollout], dict[str, float]]:
        """Stages 1-4: the foreign rows that passed them, and the outcome guard's counts."""
        ...

    def offer(self, agents: list[str], learner: int) -> tuple[OwnRound, list[TrainRow]]:
        """For stages 5-6: the own round re-tokenization reads prompt tokens from, and own rows of earlier rounds
        the selection rule sees beside this round's."""
        ...

    def finish(self, admitted: Admitted) -> None:
        """After stages 7-8: whatever the rounds add to the admitted rows."""
        ...


@dataclasses.dataclass
class LockStep:
    """Lock-step rounds: the request's foreign rows of its own round through stages 1-4 (with the lazy screen of a
    source-ordered rule and the outcome guard's quarantine), nothing added before or after."""

    intake: Intake
    request: TrainRequest
    own: OwnRound
    seed: int
    opener: Opener | None
    leave_out: LeaveOut | None

    def gather(self, ledger: Ledger) -> tuple[list[Rollout], dict[str, float]]:
        lazy = lazy_take(self.intake.selection, len(self.own.rows), self.seed)
        foreign = self.intake.screen(self.request, self.own, ledger, opener=self.opener, lazy=lazy)
        return self.leave_out(foreign, ledger) if self.leave_out is not None else (foreign, {})

    def offer(self, agents: list[str], learner: int) -> tuple[OwnRound, list[TrainRow]]:
        return self.own, []

    def finish(self, admitted: Admitted) -> None:
        return None


class Intake:
    """One learner's door for foreign rows (module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        org_id: str,
        *,
        selection: SelectionConfig,
        screen: LikelihoodScreenConfig,
        uses_cross: bool,
        task: Any,
        tokenizer: Any,
        eos_id: int | None,
    ) -> None:
        self.cfg, self.org_id, self.selection, self.screen_cfg = cfg, org_id, selection, screen
        self.uses_cross, self.task, self.tokenizer, self.eos_id = uses_cross, task, tokenizer, eos_id

    def admit(
        self,
        request: TrainRequest,
        own: OwnRound,
        *,
        seed: int,
        opener: Opener | Any | None,
        scoring: Scoring,
        leave_out: LeaveOut | None = None,
        late: Rounds | None = None,
    ) -> Admitted:
        """Every stage in order (module docstring); ``seed``: the round's selection seed; ``opener``: the identity
        border's check of a signed batch (None: signing off); ``leave_out``: the outcome guard's quarantine, after
        stage 4 (None: the guard is off); ``late``: asynchronous rounds, the caller's
        :class:`~hacrl_fed.worker.late_rounds.LateRounds` over the learner's recent rounds (rows of earlier rounds of
        the window may join; it carries its own opener, the identity border's
        :class:`~hacrl_fed.worker.identity_border.LateOpener`), in place of the lock-step stages 1-4."""
        rounds = (
            late if late is not None else LockStep(self, request, own, seed=seed, opener=opener, leave_out=leave_out)
        )
        t0, c0 = time.perf_counter(), time.process_time()
        ledger = Ledger()
        foreign, outcome = rounds.gather(ledger)  # stages 1-4
        offered, selected = list(foreign), []
        t1, c1 = time.perf_counter(), time.process_time()
        agents, learner, capability = self.agents(request, foreign)
        for row in own.rows:
            row.source = learner
        rows: list[TrainRow] = list(own.rows)
        if self.uses_cross:
            view, baseline = rounds.offer(agents, learner)
            foreign = selected = self.select(foreign, own.rows, ledger, seed, baseline)
            rows += self.retokenize(foreign, view, agents, ledger)
        else:
            for r in foreign:
                ledger.drop(str(r.org_id), "unused", "no_cross_rows")
        scored = sum(len(r.response_ids) for r in rows if not r.is_self)
        t2 = time.perf_counter()
        rows = admit_rows(rows, agents, scoring, self.screen_cfg, ledger)  # stages 7-8
        times = {"time/trust": t1 - t0, "time/score": t2 - t1, "cpu/trust": c1 - c0}
        admitted = Admitted(rows, agents, learner, capability, ledger, scored, times, outcome)
        admitted.offered, admitted.selected = offered, list(selected)
        rounds.finish(admitted)
        return admitted

    def verifier(self) -> Callable[[str, str], float] | None:
        """The task's own verifier when ``security.reverify_rewards`` is on (stage 3), else None."""
        return self.task.verify if self.cfg.security.reverify_rewards else None

    def agents(self, request: TrainRequest, foreign: Sequence[Rollout]) -> tuple[list[str], int, list[float]]:
        """The agents of the round (sorted: the capability table's configured orgs, this org, the screened
        sources), this learner's index among them and each one's capability (1 where the table has none)."""
        known = {o.id for o in self.cfg.orgs}
        agents = sorted({a for a in request.capability if a in known} | {self.org_id} | {r.org_id for r in foreign})
        return agents, agents.index(self.org_id), [float(request.capability.get(a, 1.0)) for a in agents]

    def screen(
        self,
        request: TrainRequest,
        own: OwnRound,
        ledger: Ledger,
        *,
        opener: Opener | None,
        lazy: LazyTake | None,
    ) -> list[Rollout]:
        """Stages 1-4: bound, open, screen_batch, exclude (:func:`screen_sources`)."""
        return screen_sources(
            self.cfg,
            self.org_id,
            request,
            prompts=own.prompts,
            task=own.task,
            verify=self.verifier(),
            open_source=opener,
            lazy=lazy,
            ledger=ledger,
        )[0]

    def select(
        self,
        foreign: list[Rollout],
        own_rows: Sequence[TrainRow],
        ledger: Ledger,
        seed: int,
        baseline: Sequence[TrainRow] = (),
    ) -> list[Rollout]:
        """Stage 5: the rows this learner's selection rule and budget take, before any tokenization.
        ``baseline``: own rows of earlier rounds (asynchronous rounds) the rules see; the budget counts ``own_rows``."""
        sel = self.selection
        if baseline:
            budget = resolve_budget(sel.budget, sel.budget_multiple, len(own_rows))
            kept, ledger.select_metrics = select_rollouts(
                foreign, [*own_rows, *baseline], sel.rule, budget, None, seed, sel.budget_split
            )
        else:
            kept, ledger.select_metrics = select_rollouts(
                foreign, own_rows, sel.rule, sel.budget, sel.budget_multiple, seed, sel.budget_split
            )
        offered = Counter(str(r.org_id) for r in foreign)
        offered.subtract(str(r.org_id) for r in kept)
        for src, dropped in offered.items():  # what the budget left, the rest the rule's filter
            budget = int(ledger.select_metrics.get(f"select/{src}/dropped_budget", 0))
            ledger.drop(src, "select", "dropped_budget", budget)
            ledger.drop(src, "select", "dropped_rule", dropped - budget)
        return kept

    def retokenize(self, foreign: list[Rollout], own: OwnRound, agents: list[str], ledger: Ledger) -> list[TrainRow]:
        """Stage 6: the selected responses in this learner's tokens (EOS iff the source stopped); a row of a prompt
        not in this round's plan is dropped (``unknown_prompt``), one without tokens (``no_tokens``) or longer than
        ``FOREIGN_LENGTH_FACTOR × max_new_tokens`` (``too_long_text``) is kept with no tokens: in its group's
        baseline, not trained on."""
        usable = []
        for r in foreign:
            if r.prompt_id in own.tokens_by_prompt:
                usable.append(r)
            else:
                ledger.drop(str(r.org_id), "train", "unknown_prompt")
        if not usable:
            return []
        responses = response_token_ids(
            self.tokenizer, [r.response for r in usable], [r.finish_reason for r in usable], eos_token_id=self.eos_id
        )
        cap = FOREIGN_LENGTH_FACTOR * own.max_new_tokens
        rows = []
        for r, resp in zip(usable, responses):
            if not resp or len(resp) > cap:
                ledger.drop(str(r.org_id), "train", "too_long_text" if resp else "no_tokens")
                resp = []
            rows.append(self._row(r, resp, own, agents))
        return rows

    def _row(self, r: Rollout, resp: list[int], own: OwnRound, agents: list[str]) -> TrainRow:
        """A foreign rollout as a cross row; ``per_byte``: both sides' sequence log-prob is its sum over the
        response's UTF-8 bytes (>= 1)."""
        per_byte = self.cfg.algorithm.logprob_norm == "per_byte"
        n_bytes = float(max(len(r.response.encode("utf-8")), 1)) if per_byte else 0.0
        return TrainRow(
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


def admit_rows(
    rows: list[TrainRow], agents: list[str], scoring: Scoring, screen: LikelihoodScreenConfig, ledger: Ledger
) -> list[TrainRow]:
    """Stages 7-8 on rows in the learner's tokens (own rows and cross rows; ``agents`` names their sources): the
    likelihood screen when on and a cross row is present, then the context fit; the ledger counts what the update
    keeps."""
    if screen.enabled and not all(r.is_self for r in rows):
        rows = screen_likelihood(rows, agents, scoring, screen, ledger)
    rows = fit_context(rows, scoring.context, agents, ledger)
    for r in rows:
        if not r.is_self and r.response_ids:
            ledger.keep(agents[r.source])
    return rows


def update_metrics(update: dict[str, float], rows: Sequence[TrainRow], ledger: Ledger) -> dict[str, float]:
    """The update's metrics (of ``rows``) with the last two stages' counts, as the update wrote them when it ran
    those stages itself: the likelihood screen's unless no row had tokens, ``train/num_too_long`` unless there were
    no rows."""
    out = dict(update)
    if not rows:
        out.update(ledger.screen_metrics)
        return out
    out["train/num_too_long"] = float(ledger.too_long())
    if any(r.response_ids for r in rows):
        out.update(ledger.screen_metrics)
    return out


def screen_likelihood(
    rows: list[TrainRow], agents: list[str], scoring: Scoring, cfg: LikelihoodScreenConfig, ledger: Ledger
) -> list[TrainRow]:
    """Stage 7: score the scorable cross rows with the trainer's scorer and leave out those the screen drops
    (they leave their joint group too); ``screen/<source>/...`` metrics."""
    t0 = time.perf_counter()
    cand = [
        i
        for i, r in enumerate(rows)
        if r.response_ids and (r.is_self or fits(len(r.prompt_token_ids), len(r.response_ids), scoring.context))
    ]
    cross = [i for i in cand if not rows[i].is_self]
    learner_sum = dict(zip(cross, scoring.score([rows[i] for i in cross]))) if cross else {}
    lp, lengths, claimed = _screen_inputs(rows, cand, learner_sum)
    history = {s: h for s in {r.source for r in rows} if (h := scoring.history.get(agents[s])) is not None}
    res = likelihood_screen(
        lp,
        lengths,
        [rows[i].is_self for i in cand],
        [rows[i].group for i in cand],
        [rows[i].source for i in cand],
        claimed,
        ScreenParams(margin_nats=cfg.margin_nats, claim_z=cfg.claim_z),  # the other thresholds: ScreenParams
        history,
    )
    scoring.history.update({agents[s]: h for s, h in res.history.items()})
    drop = {i for i, k in zip(cand, res.keep) if not k}
    out: dict[str, float] = {}
    for s, n_checked in res.checked.items():
        counts = res.dropped.get(s, {})
        out[f"screen/{agents[s]}/checked"] = float(n_checked)
        for reason in REASONS:
            out[f"screen/{agents[s]}/dropped_{reason}"] = float(counts.get(reason, 0))
            ledger.drop(agents[s], "screen", reason, counts.get(reason, 0))
        if s in res.gap_median:
            out[f"screen/{agents[s]}/gap_median"] = res.gap_median[s]
        if s in res.deficit_max:
            out[f"screen/{agents[s]}/deficit_max"] = res.deficit_max[s]
    out["screen/dropped"] = float(len(drop))
    out["time/screen"] = time.perf_counter() - t0
    ledger.screen_metrics = out
    # each kept cross row carries its score as the pre-update log-prob sum (the weights do not change before the
    # update), so the in-band baseline does not score it again (hacrl_fed.algorithm.pre_update)
    return [_scored_row(r, learner_sum.get(i)) for i, r in enumerate(rows) if i not in drop]


def _scored_row(row: TrainRow, log_prob_sum: float | None) -> TrainRow:
    """``row`` with ``pre_log_prob_sum`` set to the screen's score of it (unchanged without one)."""
    if log_prob_sum is None or row.pre_log_prob_sum is not None:
        return row
    return dataclasses.replace(row, pre_log_prob_sum=float(log_prob_sum))


def fit_context(rows: list[TrainRow], context: int | None, agents: list[str], ledger: Ledger) -> list[TrainRow]:
    """Stage 8: a row whose prompt plus response exceeds the learner's context keeps no tokens (counted in its
    joint group's advantage statistics, not trained on: ``train/num_too_long``)."""
    out = []
    for r in rows:
        if r.response_ids and not fits(len(r.prompt_token_ids), len(r.response_ids), context):
            if r.is_self:
                ledger.own_too_long += 1
            else:
                ledger.drop(agents[r.source], "train", "context")
            r = dataclasses.replace(r, response_ids=[])
        out.append(r)
    return out


def _screen_inputs(
    rows: Sequence[TrainRow], cand: Sequence[int], learner_sum: dict[int, float]
) -> tuple[list[float], list[float], list[float | None]]:
    """Per candidate row: its learner log-prob sum (own rows: their published one), its length in the screen's
    unit (UTF-8 bytes of the response: comparable across tokenizers) and the source's claimed per-byte log-prob
    (None for own rows)."""
    lp: list[float] = []
    lengths: list[float] = []
    claimed: list[float | None] = []
    for i in cand:
        r = rows[i]
        n = float(max(r.n_bytes, 1))
        if r.is_self:
            lp.append(sum(r.old_token_log_probs) if r.old_token_log_probs else r.old_seq_log_prob * n)
            claimed.append(None)
        else:
            lp.append(learner_sum[i])
            c = r.claimed_log_prob_sum
            claimed.append(None if c is None else c / n)
        lengths.append(n)
    return lp, lengths, claimed


# ------------------------------------------------------------------------------------ stages 1-4: the screen


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


def _collect_sources(request: TrainRequest, *, signing: bool, ledger: Ledger) -> dict[str, RolloutBatch]:
    """Foreign batches by claimed source org, in arrival order, none opened yet: the signed envelopes when signing
    (a second batch of one source is ``duplicate_source``, loose rollouts are ``unsigned``), else the flat list
    grouped by org id."""
    batches: dict[str, RolloutBatch] = {}
    if signing:
        unsigned = len(request.foreign) + request.unread_foreign
        if unsigned:
            ledger.receive("coordinator", unsigned)
            ledger.reject("coordinator", UNSIGNED, unsigned)
        for batch in request.source_batches:
            src = str(getattr(batch, "org_id", "?"))[:64]
            n = len(getattr(batch, "rollouts", ()) or ())
            ledger.receive(src, n)
            if src in batches:
                ledger.reject(src, "duplicate_source", len(batch.rollouts))
                continue
            batches[src] = batch
        return batches
    grouped: dict[str, list[Rollout]] = {}
    for r in request.foreign:
        grouped.setdefault(str(r.org_id), []).append(r)
    for src, rollouts in grouped.items():
        ledger.receive(src, len(rollouts))
        batches[src] = RolloutBatch(request.run_id, request.round, src, tuple(rollouts), 0.0)
    return batches


def screen_sources(
    cfg: RunConfig,
    org_id: str,
    request: TrainRequest,
    *,
    prompts: tuple[Prompt, ...],
    task: str,
    verify: Callable[[str, str], float] | None,
    open_source: Opener | None = None,
    lazy: LazyTake | None = None,
    ledger: Ledger | None = None,
) -> tuple[list[Rollout], dict[str, float]]:
    """Stages 1-4: the foreign rollouts that pass the screen, and the ``trust/...`` metrics of what was dropped.

    ``prompts`` are this round's prompts as the worker received them in its own plan (never the train
    request's copy); ``open_source`` verifies (and decrypts) one signed source batch, raising RejectedBatch.
    ``lazy``: screen only as many sources as a source-ordered selection takes (:class:`LazyTake`). The accepted
    rollouts keep the sources' arrival order either way; a lazy screen returns the accepted rollouts of the
    sources it reached, which hold every row the selection would take after a full screen. ``ledger``: where
    the drops are recorded (a new one when None).
    """
    ledger = Ledger() if ledger is None else ledger
    signing = cfg.security.signing
    total = sum(len(b.rollouts) for b in request.source_batches) if signing else len(request.foreign)
    known = {o.id for o in cfg.orgs if o.id != org_id}
    too_many_batches = signing and len(request.source_batches) > len(known)
    if total > max_foreign(cfg, org_id, len(prompts)) or too_many_batches:
        ledger.receive("*", total)
        ledger.reject("*", "too_many_foreign", total)
        return [], ledger.trust_metrics()
    batches = _collect_sources(request, signing=signing, ledger=ledger)
    kept: dict[str, list[Rollout]] = {}
    taken = 0
    for src in batches if lazy is None else lazy.order(list(batches)):
        batch = batches[src]
        if lazy is not None:
            ledger.entry(src).unscreened = 0
            if taken >= lazy.budget:  # the selection is full: this source is never opened or checked
                ledger.unscreened(src, len(batch.rollouts))
                continue
        accepted = _screen_one(cfg, src, batch, request, prompts, task, verify, open_source, known, ledger)
        if accepted is not None:
            kept[src] = accepted
            taken += len(accepted)
    rollouts = [r for src in batches if src in kept for r in kept[src]]  # arrival order of the sources
    return rollouts, ledger.trust_metrics()


def _screen_one(
    cfg: RunConfig,
    src: str,
    batch: RolloutBatch,
    request: TrainRequest,
    prompts: tuple[Prompt, ...],
    task: str,
    verify: Callable[[str, str], float] | None,
    open_source: Opener | None,
    known: set[str],
    ledger: Ledger,
) -> list[Rollout] | None:
    """One source's batch through open, screen_batch and exclusion: its accepted rollouts, None when dropped."""
    if cfg.security.signing and open_source is not None:
        try:
            batch = open_source(batch)
        except ValueError as err:  # RejectedBatch: bad signature, unknown org, wrong run/round, undecryptable
            ledger.reject(src, getattr(err, "reason", "malformed"), len(batch.rollouts))
            return None
    if src not in known:
        ledger.reject(src, "unknown_org", len(batch.rollouts))
        return None
    plan = source_plan(cfg, src, request.run_id, request.round, task, prompts)
    result = screen_batch(batch, plan, src, verify=verify, max_bytes_per_token=cfg.security.max_bytes_per_token)
    ledger.screened(src, result, len(batch.rollouts))
    if result.mismatch_rate > cfg.security.max_mismatch_rate:
        ledger.exclude(src)
        return None
    return result.accepted
