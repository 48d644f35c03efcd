"""Fresh plans: a learner trains only on source batches made for the plan it answered itself, this round.

Signatures show who said something, not when: a coordinator that reuses an old run id could send a worker that
holds no state of that run an old round's plan and then forward an absent org's old signed batches of that round
(signature, run and round all check). Freshness therefore comes from the receiver (SECURITY.md "Fresh plans"):

1. every worker issues a fresh random challenge (:data:`CHALLENGE_BYTES` bytes from :func:`secrets.token_bytes`) in
   every ``TrainReport`` (``challenge``), and reports the latest one it issued in its Health reply
   (``info["challenge"]``, hex; one is issued if it has issued none), for its first round;
2. the coordinator puts every live org's latest challenge in the next round's plans (``RoundPlan.challenges``,
   the same map for every org);
3. every org signs, in its batch, :func:`plan_digest` of the plan it answered (``RolloutBatch.plan_digest``);
4. a learner accepts a source batch only when its ``plan_digest`` is the digest of the plan the learner itself
   answered that round and that plan carried the challenge the learner had issued last when the plan arrived
   (:func:`check_fresh`, reason ``stale_plan``). A batch made for any earlier plan cannot carry a challenge issued
   after it was made. A learner whose plan did not carry its latest challenge (it just joined and the coordinator
   had none of it, or the plan is a replay) trains that round on its own rollouts only.

With the fused protocol the plan of round ``r`` travels with the train request of round ``r - 1``, so it carries
the challenge of the reply before (round ``r - 2``'s report, or Health): "issued last" is judged when the message
arrives, before its train half issues the next one (:class:`ChallengeBook`).

The digest covers everything the orgs' plans of a round share: run id, round, task, prompts and challenges; the
sampling parameters are cleared first (they are per org: each org has its own generation settings; the learner
bounds a source's batch by its own copy of that source's settings anyway). Pure functions, no I/O.
"""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
from collections import deque
from collections.abc import Iterable, Mapping

from hacrl_fed.security.envelope import RejectedBatch
from hacrl_fed.types import Prompt, RolloutBatch, RoundPlan, SamplingParams
from hacrl_fed.wire import codec

CHALLENGE_BYTES = 32
DIGEST_BYTES = 32  # SHA-256
PLAN_DOMAIN = b"hacrl-fed/v1/RoundPlan\x00"
HEALTH_KEY = "challenge"  # the Health reply's info key (hex of the latest challenge)


def new_challenge() -> bytes:
    """:data:`CHALLENGE_BYTES` fresh random bytes (the OS CSPRNG; never the seeded RNGs training uses)."""
    return secrets.token_bytes(CHALLENGE_BYTES)


def plan_digest(plan: RoundPlan) -> bytes:
    """``SHA-256(PLAN_DOMAIN + codec.encode(plan with sampling = SamplingParams()))``: 32 bytes.

    Equal for the plans of one round that differ only in their per-org sampling parameters; any change of run id,
    round, task, a prompt or a challenge changes it.
    """
    shared = dataclasses.replace(plan, sampling=SamplingParams())
    return hashlib.sha256(PLAN_DOMAIN + codec.encode(shared)).digest()


def parse_challenge(value: object) -> bytes | None:
    """A challenge as it arrives (bytes from a TrainReport, hex text from a Health reply): exactly
    :data:`CHALLENGE_BYTES` bytes, or None when it is anything else (missing, wrong size, not hex)."""
    if isinstance(value, str):
        if len(value) != 2 * CHALLENGE_BYTES:
            return None
        try:
            value = bytes.fromhex(value)
        except ValueError:
            return None
    if isinstance(value, (bytes, bytearray)) and len(value) == CHALLENGE_BYTES:
        return bytes(value)
    return None


def challenges_problem(challenges: Mapping[str, bytes], orgs: Iterable[str]) -> str | None:
    """Why a plan's challenge map is out of bounds, or None: at most one entry per org of the run, none for an org
    outside it, every value exactly :data:`CHALLENGE_BYTES` bytes."""
    known = set(orgs)
    if len(challenges) > len(known):
        return f"{len(challenges)} challenges for {len(known)} orgs"
    unknown = sorted(str(k)[:40] for k in challenges if k not in known)
    if unknown:
        return f"challenges for orgs not in the run: {unknown[:4]}"
    bad = sorted(k for k, v in challenges.items() if not isinstance(v, bytes) or len(v) != CHALLENGE_BYTES)
    if bad:
        return f"challenges of {bad[:4]} are not {CHALLENGE_BYTES} bytes"
    return None


class ChallengeBook:
    """A worker's challenges: the one it issued last, and the one a plan must carry.

    ``expect()`` is what a plan arriving now must carry (None: this worker has issued none yet). With the fused
    protocol a message carries a train request (whose report issues a new challenge) and the next plan, which
    the coordinator built before it saw that report: :meth:`hold` freezes the expectation at the message's
    arrival until :meth:`release`.
    """

    def __init__(self, keep: int = 1) -> None:
        self.latest: bytes | None = None
        self._held: tuple[bytes | None] | None = None
        self.recent: deque[bytes] = deque(maxlen=max(int(keep), 1))  # the last ``keep`` issued, latest last

    def issue(self) -> bytes:
        """A fresh challenge, now the latest (for a TrainReport)."""
        self.latest = new_challenge()
        self.recent.append(self.latest)
        return self.latest

    def for_health(self) -> bytes:
        """The latest challenge, issuing one if there is none (a Health reply does not replace it)."""
        return self.latest if self.latest is not None else self.issue()

    def hold(self) -> None:
        self._held = (self.latest,)

    def release(self) -> None:
        self._held = None

    def expect(self) -> bytes | None:
        return self._held[0] if self._held is not None else self.latest


def fresh_digest(plan: RoundPlan, org_id: str, expected: bytes | None) -> bytes | None:
    """The digest source batches must sign for ``org_id`` to train on them, or None when ``plan`` does not carry
    ``expected`` (the challenge ``org_id`` issued last) as ``org_id``'s challenge: then it trains on its own
    rollouts only."""
    got = plan.challenges.get(org_id)
    if expected is None or got is None or not secrets.compare_digest(got, expected):
        return None
    return plan_digest(plan)


def check_fresh(batch: RolloutBatch, expected_digest: bytes | None) -> None:
    """Refuse (``RejectedBatch("stale_plan")``) a source batch not made for the learner's own fresh plan.

    ``expected_digest``: :func:`fresh_digest` of the plan the learner answered this round (None: that plan did
    not carry the learner's latest challenge, so no source batch can be shown to be current).
    """
    if expected_digest is None:
        raise RejectedBatch(
            "stale_plan", f"batch from {batch.org_id!r}: this learner's plan did not carry its latest challenge"
        )
    if not secrets.compare_digest(bytes(batch.plan_digest), expected_digest):
        raise RejectedBatch(
            "stale_plan", f"batch from {batch.org_id!r} answers another plan than this learner's round {batch.round}"
        )


def recent_keep(staleness: int, window: int) -> int:
    """How many of its last challenges a learner accepts in asynchronous rounds: ``2 (K + W + 2)``. A source's plan
    of round ``r`` is issued once the learner has published round ``r - K - 1``, and a batch of round ``r`` reaches
    the learner at the latest in its step planning ``r + W``: at most ``K + W + 1`` of the learner's steps (one
    challenge each) lie between; the factor 2 is slack for a challenge the coordinator got late."""
    return 2 * (staleness + window + 2)


def check_fresh_late(
    batch: RolloutBatch, learner: str, run_id: str, task: str, prompts: tuple[Prompt, ...], recent: Iterable[bytes]
) -> None:
    """Asynchronous rounds: refuse (``RejectedBatch("stale_plan")``) a signed source batch not made for a plan of
    this run that carried one of the learner's ``recent`` challenges.

    The plans of one round differ per org there (each is issued when its org may step, with the challenges known
    then), so the learner re-derives the plan ``batch`` answered from its own copy of the round (``run_id``,
    ``task``, ``prompts``: its own plan of ``batch.round``) and the challenges the batch signs
    (``batch.plan_challenges``): that plan's digest must be ``batch.plan_digest``, and its challenge for
    ``learner`` one the learner issued among its last :func:`recent_keep`. A batch made for any plan of an earlier
    incarnation of the run cannot carry a challenge this learner issued since.
    """
    plan = RoundPlan(run_id, batch.round, task, prompts, SamplingParams(), dict(batch.plan_challenges))
    if not secrets.compare_digest(bytes(batch.plan_digest), plan_digest(plan)):
        raise RejectedBatch(
            "stale_plan", f"batch from {batch.org_id!r} round {batch.round} does not answer this learner's prompts"
        )
    got = batch.plan_challenges.get(learner)
    if got is None or not any(secrets.compare_digest(got, c) for c in recent):
        raise RejectedBatch(
            "stale_plan", f"batch from {batch.org_id!r} round {batch.round}: its plan carried no recent challenge"
        )
