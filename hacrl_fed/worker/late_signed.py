"""Asynchronous rounds with ``security.signing``: which signed source batches of the window a learner takes
(docs/SECURITY.md "Asynchronous rounds", docs/ALGORITHM.md "Asynchronous rounds").

Several plans are in flight at once, so a learner's train request of round ``t`` carries the other orgs' signed
batches of rounds ``t - W + 1 … t`` verbatim (``TrainRequest.source_batches``) and the coordinator's tag
``(source, round, version)`` of each (``TrainRequest.tags``). Every batch signs its source, round, the source's
``version`` (updates done when it generated it), the digest of the plan it answered and that plan's challenges.
:func:`split_signed` takes a batch only when, in this order (the first failure is its counted reason,
``trust/<source>/rejected/<reason>``):

1. its signature holds against the pinned roster for this run (``bad_signature``, ``unknown_org``, ``wrong_run``,
   ``malformed``): nothing in its header is trusted before;
2. its round is in the window and this learner generated it (``future_round``, ``beyond_window``,
   ``not_generated``), and this learner has not taken that (source, round) before, in this request or an earlier
   one (``already_used``: a replay across rounds of the window);
3. the coordinator issued a plan of that round to that source (a tag for it: else ``not_issued``) with the version
   the batch signs (``version_mismatch``);
4. it answers a plan of this run carrying a challenge this learner issued lately (``stale_plan``,
   :func:`~hacrl_fed.security.freshness.check_fresh_late`), and opens when sealed (``undecryptable``).

A (source, round) is marked used only when its batch is taken, so a forged or stale copy cannot burn the honest
one. More batches than ``W × (orgs - 1)`` or more rows than ``W`` honest rounds hold are refused whole
(``too_many_foreign``); loose unsigned rows are ``unsigned`` (from ``coordinator``), as in lock-step rounds.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hacrl_fed.config import RunConfig
from hacrl_fed.security.envelope import RejectedBatch
from hacrl_fed.types import Rollout, RolloutBatch, TrainRequest
from hacrl_fed.worker.intake import OwnRound, max_foreign
from hacrl_fed.worker.ledger import UNSIGNED, Ledger
from hacrl_fed.worker.recent_rounds import RecentRounds, round_refusal


def split_signed(
    cfg: RunConfig,
    org_id: str,
    request: TrainRequest,
    own: OwnRound,
    recent: RecentRounds,
    ledger: Ledger,
    opener: Any,
) -> tuple[TrainRequest, dict[int, dict[str, list[Rollout]]]]:
    """``request`` with only its own round's taken batches (``source_batches``, already verified and opened: the
    intake screens them without an opener), and the late rows ``{round: {source: rows}}`` of the taken batches of
    earlier rounds; every other batch is refused and counted (module docstring). ``opener``: the identity border's
    :class:`~hacrl_fed.worker.identity_border.LateOpener`."""
    unsigned = len(request.foreign) + request.unread_foreign
    if unsigned:
        ledger.receive("coordinator", unsigned)
        ledger.reject("coordinator", UNSIGNED, unsigned)
    batches = request.source_batches
    total = sum(len(getattr(b, "rollouts", ()) or ()) for b in batches)
    others = sum(1 for o in cfg.orgs if o.id != org_id)
    if len(batches) > recent.window * others or total > recent.window * max_foreign(cfg, org_id, len(own.prompts)):
        ledger.receive("*", total)
        ledger.reject("*", "too_many_foreign", total)
        return _only(request, ()), {}
    tags = {(str(s), int(r)): int(v) for s, r, v in request.tags}
    current: list[RolloutBatch] = []
    late: dict[int, dict[str, list[Rollout]]] = {}
    for batch in batches:
        src = str(getattr(batch, "org_id", "?"))[:64]
        n = len(getattr(batch, "rollouts", ()) or ())
        taken, reason = _take(batch, src, own, recent, tags, opener)
        if taken is None:  # a taken batch is counted received by the stage that screens it
            ledger.receive(src, n)
            ledger.reject(src, reason, n)
            continue
        recent.used.add((src, taken.round))
        if taken.round == own.round:
            current.append(taken)
        else:
            late.setdefault(taken.round, {})[src] = list(taken.rollouts)
    return _only(request, tuple(current)), late


def _take(
    batch: Any, src: str, own: OwnRound, recent: RecentRounds, tags: dict[tuple[str, int], int], opener: Any
) -> tuple[RolloutBatch | None, str]:
    """``(the verified, opened batch, "")`` or ``(None, the refusal reason)``."""
    try:
        batch = opener.verify(batch)
    except RejectedBatch as err:
        return None, err.reason
    reason = round_refusal(src, batch.round, own.round, recent)
    if reason is None and (src, batch.round) not in tags:
        reason = "not_issued"
    elif reason is None and tags[(src, batch.round)] != batch.version:
        reason = "version_mismatch"
    if reason is not None:
        return None, reason
    try:
        return opener.open(batch), ""
    except RejectedBatch as err:
        return None, err.reason


def _only(request: TrainRequest, batches: tuple[RolloutBatch, ...]) -> TrainRequest:
    return dataclasses.replace(request, foreign=(), unread_foreign=0, source_batches=batches)
