"""Asynchronous rounds at the learner: foreign batches of earlier rounds of the window (docs/ALGORITHM.md
"Asynchronous rounds", "Capability per round").

With ``federation.staleness`` ``K >= 1`` a train request for the learner's round ``t`` may carry foreign rows of
rounds ``t - W + 1 … t`` (``W = federation.window``). The rows of round ``t`` go through the intake as in
lock-step rounds; this module handles the others:

- :class:`RecentRounds` keeps what the learner generated in its last ``W`` rounds (prompts as its own plans carried
  them, its tokens of them, its own rows with their rewards), the no-token copies of the foreign rows it admitted
  of each (their rewards), and every (source, round) it has received, so a batch is used at most once.
- :func:`split_rounds` refuses, with a counted reason (``trust/<source>/rejected/<reason>``), rows of a round
  after the request's (``future_round``), before the window (``beyond_window``), of a round this learner did not
  generate (``not_generated``) or of a (source, round) it already received (``already_used``); the rest of the
  late rows are grouped per (round, source).
- :func:`screen_late` checks each late batch against the plan **of its own round**, re-derived from the learner's
  own prompts of that round (``screen_batch`` with the learner's verifier), and excludes a source whose share of
  contradicted rewards exceeds ``security.max_mismatch_rate``. In coordinator-blind mode every batch's counts
  (late or of the request's own round) are also kept per (source, round) (``trust/<source>/round/<round>/...``,
  :class:`~hacrl_fed.worker.ledger.Ledger`), so the learner's accusations name the batch they are about.
- A late row of round ``r`` joins the joint group ``late_group(r, prompt)``: its baseline and standard deviation
  count the learner's own rewards of that prompt of round ``r`` and the foreign rows of that round it admitted in
  earlier steps (:func:`baseline_rows`: rows without tokens, not trained on again, like rows without tokens in
  lock-step rounds). Rows of the request's own round keep their prompt id as group, as today.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from hacrl_fed.config import RunConfig
from hacrl_fed.plan.screening import Screened, screen_batch
from hacrl_fed.trainer import TrainRow
from hacrl_fed.types import Rollout, RolloutBatch, TrainRequest
from hacrl_fed.worker.intake import Admitted, Intake, OwnRound, max_foreign, source_plan
from hacrl_fed.worker.ledger import Ledger
from hacrl_fed.worker.recent_rounds import (  # noqa: F401  (re-exported: the late-round names in one place)
    LATE_GROUP_STRIDE,
    KeptRound,
    RecentRounds,
    group_round,
    late_group,
    round_refusal,
)
from hacrl_fed.worker.row_ages import trained_row_ages


def split_rounds(
    cfg: RunConfig, org_id: str, request: TrainRequest, own: OwnRound, recent: RecentRounds, ledger: Ledger
) -> tuple[TrainRequest, dict[int, dict[str, list[Rollout]]]]:
    """``request`` with only its own round's foreign rows, and the late rows ``{round: {source: rows}}`` that may
    join; every other row is refused and counted (module docstring). More rows than ``W`` honest rounds hold are
    refused whole (``too_many_foreign``)."""
    if len(request.foreign) > recent.window * max_foreign(cfg, org_id, len(own.prompts)):
        ledger.receive("*", len(request.foreign))
        ledger.reject("*", "too_many_foreign", len(request.foreign))
        return dataclasses.replace(request, foreign=()), {}
    grouped: dict[tuple[str, int], list[Rollout]] = {}
    for r in request.foreign:
        grouped.setdefault((str(r.org_id)[:64], int(r.round)), []).append(r)
    current: list[Rollout] = []
    late: dict[int, dict[str, list[Rollout]]] = {}
    for (src, rnd), rows in grouped.items():
        reason = round_refusal(src, rnd, own.round, recent)
        if rnd == own.round and reason is None:
            current.extend(rows)
        elif reason is None:
            late.setdefault(rnd, {})[src] = rows
        else:
            ledger.receive(src, len(rows))
            ledger.reject(src, reason, len(rows))
        recent.used.add((src, rnd))
    return dataclasses.replace(request, foreign=tuple(current)), late


def screen_late(
    cfg: RunConfig,
    org_id: str,
    request: TrainRequest,
    late: Mapping[int, Mapping[str, list[Rollout]]],
    recent: RecentRounds,
    verify: Callable[[str, str], float] | None,
    ledger: Ledger,
) -> list[Rollout]:
    """The late rows that pass ``screen_batch`` against the plan of their own round, each with its prompt id
    replaced by its joint group (:func:`late_group`), in (round, arrival) order."""
    known = {o.id for o in cfg.orgs if o.id != org_id}
    out: list[Rollout] = []
    for rnd in sorted(late):
        own = recent.rounds[rnd].own
        for src, rows in late[rnd].items():
            ledger.receive(src, len(rows))
            if src not in known:
                ledger.reject(src, "unknown_org", len(rows))
                continue
            batch = RolloutBatch(request.run_id, rnd, src, tuple(rows), 0.0)
            plan = source_plan(cfg, src, request.run_id, rnd, own.task, own.prompts)
            result = screen_batch(batch, plan, src, verify=verify, max_bytes_per_token=cfg.security.max_bytes_per_token)
            ledger.screened_round(src, rnd, result)
            merge_screened(ledger, src, result, len(rows))
            if result.mismatch_rate > cfg.security.max_mismatch_rate and not ledger.entry(src).excluded:
                ledger.exclude(src)
            out += [dataclasses.replace(r, prompt_id=late_group(rnd, r.prompt_id)) for r in result.accepted]
    return [r for r in out if not ledger.entry(str(r.org_id)).excluded]


def merge_screened(ledger: Ledger, src: str, result: Screened, rows: int) -> None:
    """Record ``result`` for ``src`` in ``ledger``, added to what the source's other batches of this request got."""
    before = ledger.entry(src).screened
    ledger.screened(src, result, rows)
    if before is not None:
        ledger.entry(src).screened = Screened(
            before.accepted + result.accepted,
            before.rejected + result.rejected,
            before.checked + result.checked,
            before.mismatches + result.mismatches,
            before.verified_reward_sum + result.verified_reward_sum,
            before.shortfall + result.shortfall,
        )


def late_tokens(late: Sequence[Rollout], recent: RecentRounds) -> dict[int, list[int]]:
    """``{late group: the learner's tokens of that prompt}`` for the late rows (re-tokenization)."""
    out = {}
    for r in late:
        rnd, prompt = group_round(r.prompt_id, 0)
        out[r.prompt_id] = recent.rounds[rnd].own.tokens_by_prompt[prompt]
    return out


def baseline_rows(groups: Iterable[int], recent: RecentRounds, learner: int, agents: list[str]) -> list[TrainRow]:
    """Rows without tokens for the late joint ``groups``: the learner's own rows of those prompts of their round and
    the foreign rows of that round it admitted before (module docstring)."""
    out = []
    for group in sorted(set(groups), reverse=True):
        rnd, prompt = group_round(group, 0)
        kept = recent.rounds[rnd]
        for row in kept.own.rows:
            if row.group == prompt:
                out.append(
                    dataclasses.replace(
                        row, prompt_token_ids=[], response_ids=[], group=group, source=learner, round=rnd
                    )
                )
        for name, row in kept.taken:
            if row.group == group and name in agents:
                out.append(dataclasses.replace(row, source=agents.index(name)))
    return out


@dataclasses.dataclass
class LateRounds:
    """:meth:`~hacrl_fed.worker.intake.Intake.admit`'s :class:`~hacrl_fed.worker.intake.Rounds` in asynchronous
    rounds (no lazy screen: the config refuses it with ``federation.staleness >= 1``): the request's own round
    through stages 1-4 as in lock-step rounds, the late rows through :func:`split_rounds` (signing on: the signed
    batches through :func:`~hacrl_fed.worker.late_signed.split_signed` with ``opener``) and :func:`screen_late`, then
    the outcome guard's quarantine over both (``leave_out``, the learner's current round decides, whatever round a
    row answers); selection, re-tokenization, the likelihood screen and the context fit then run over both, with the
    late groups' baselines (:func:`baseline_rows`); each row's round, age and per-round capability figures set."""

    intake: Intake
    request: TrainRequest
    own: OwnRound
    recent: RecentRounds
    opener: Any
    late_rows: list[Rollout] = dataclasses.field(default_factory=list)
    leave_out: Any = None  # the outcome guard's quarantine (hacrl_fed.worker.intake.LeaveOut); None: the guard is off

    def gather(self, ledger: Ledger) -> tuple[list[Rollout], dict[str, float]]:
        """Stages 1-4 of the request's own round and :func:`screen_late` of the earlier rounds' rows."""
        intake, own, recent = self.intake, self.own, self.recent
        if intake.cfg.security.signing:
            from hacrl_fed.worker.late_signed import split_signed

            current, late = split_signed(intake.cfg, intake.org_id, self.request, own, recent, ledger, self.opener)
        else:
            current, late = split_rounds(intake.cfg, intake.org_id, self.request, own, recent, ledger)
        ledger.by_round = intake.cfg.security.encrypt  # blind mode: accusations name (source, round)
        foreign = intake.screen(current, own, ledger, opener=None, lazy=None)  # stages 1-4, the request's own round
        for src, entry in list(ledger.sources.items()):  # so far only this round's batches were screened
            if entry.screened is not None:
                ledger.screened_round(src, own.round, entry.screened)
        self.late_rows = screen_late(intake.cfg, intake.org_id, self.request, late, recent, intake.verifier(), ledger)
        for row in own.rows:
            row.round = own.round
        rows = [r for r in foreign if not ledger.entry(str(r.org_id)).excluded] + self.late_rows
        if self.leave_out is None:
            return rows, {}
        rows, outcome = self.leave_out(rows, ledger)
        admitted = {id(r) for r in rows}
        self.late_rows = [r for r in self.late_rows if id(r) in admitted]  # a quarantined source's late rows too
        return rows, outcome

    def offer(self, agents: list[str], learner: int) -> tuple[OwnRound, list[TrainRow]]:
        """The own round with the late groups' prompt tokens, and the learner's own rows of those groups."""
        tokens = {**self.own.tokens_by_prompt, **late_tokens(self.late_rows, self.recent)}
        offered = baseline_rows((r.prompt_id for r in self.late_rows), self.recent, learner, agents)
        return dataclasses.replace(self.own, tokens_by_prompt=tokens), [r for r in offered if r.is_self]

    def finish(self, admitted: Admitted) -> None:
        """Rounds and ages (and their histogram), the kept late groups' baseline rows, the admitted rows noted,
        per-row figures."""
        rows, agents, own_round = admitted.rows, admitted.agents, self.own.round
        set_rounds(rows, self.request, own_round, agents)
        admitted.staleness = trained_row_ages(rows, agents)  # the foreign rows' ages (docs/METRICS.md "Staleness")
        baseline = baseline_rows({r.group for r in rows if r.group < 0}, self.recent, admitted.learner, agents)
        self.recent.note_admitted(rows, agents, own_round)  # after: this step's rows are not their own baseline
        rows += baseline
        admitted.row_capability = row_figures(rows, self.request, own_round, agents, admitted.learner)


def set_rounds(rows: Sequence[TrainRow], request: TrainRequest, own_round: int, agents: Sequence[str]) -> None:
    """Each row's round (from its group) and each cross row's age: the learner's version before the update minus
    its batch's (the request's tags; ``own_round - round`` where a tag is missing)."""
    versions = {(s, r): v for s, r, v in request.tags}
    for row in rows:
        row.round, _ = group_round(row.group, own_round)
        if not row.is_self:
            version = versions.get((agents[row.source], row.round))
            row.age = request.version - version if version is not None else own_round - row.round


def row_figures(
    rows: Sequence[TrainRow], request: TrainRequest, own_round: int, agents: Sequence[str], learner: int
) -> tuple[list[float], list[float]]:
    """Per row ``(Phat_learner(t(y)), Phat_source(t(y)))`` from the request's per-round table (the request's own
    round's ``capability`` where the table lacks the round; 1 where it lacks the org)."""
    learner_fig, source_fig = [], []
    for row in rows:
        table = request.round_capability.get(row.round or own_round, request.capability)
        learner_fig.append(float(table.get(agents[learner], 1.0)))
        source_fig.append(float(table.get(agents[row.source], 1.0)))
    return learner_fig, source_fig
