"""Protocol dataclasses: what crosses between the coordinator and an organization's policy worker.

These are the library-side shapes of the ``hacrl_fed.v1`` protobuf messages (``proto/``). Exactly one module,
``hacrl_fed.wire.codec``, converts between them and protobuf. Nothing here imports torch, flwr or protobuf.

Vocabulary: an *org* is one organization (one agent, one private model). ``org_id`` is its stable string id.
Rollouts carry only text, reward and the source's sequence log-prob (sum and token count): never weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field

FINISH_STOP = "stop"  # the response ended with the source's EOS token (EOS counted in token_count)
FINISH_LENGTH = "length"  # truncated at max_new_tokens
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH)


@dataclass(frozen=True)
class ChatMessage:
    role: str  # "system" | "user" | "assistant"
    content: str


@dataclass(frozen=True)
class Prompt:
    """One task prompt as sent to every org: chat messages plus the reference answer for the verifier."""

    prompt_id: int
    messages: tuple[ChatMessage, ...]
    reference: str


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 64
    num_samples: int = 8  # G: responses per prompt
    seed: int = 0  # per-round seed; each org mixes in its own id


@dataclass(frozen=True)
class RoundPlan:
    """Coordinator → every live org at the start of a round (docs/ARCHITECTURE.md step 1)."""

    run_id: str
    round: int
    task: str  # task / verifier registry name
    prompts: tuple[Prompt, ...]
    sampling: SamplingParams
    # Replay protection: org id -> the latest challenge that org issued (hacrl_fed.security.freshness).
    challenges: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Rollout:
    """One response, as published by its source org (docs/ALGORITHM.md "What an org publishes")."""

    org_id: str
    round: int
    prompt_id: int
    sample_index: int
    response: str  # decoded, special tokens skipped, no trailing EOS
    finish_reason: str  # FINISH_STOP | FINISH_LENGTH
    reward: float  # verified, in [0, 1]
    logprob_sum: float  # sum of the source's token log-probs (pre-update weights, temperature 1)
    token_count: int  # tokens in that sum (EOS included iff finish_reason == "stop")
    # End-to-end encrypted ``response`` (hacrl_fed.security.sealing); ``response`` is then "". Never both set.
    sealed_response: bytes = b""

    @property
    def mean_log_prob(self) -> float:
        """``lbar_j(y)`` = source log-prob sum / source token count."""
        return self.logprob_sum / max(self.token_count, 1)


@dataclass(frozen=True)
class WrappedKey:
    """A batch's content key wrapped for one recipient org (hacrl_fed.security.sealing)."""

    recipient: str  # the recipient's org id
    ephemeral_public: bytes  # raw X25519 public key, 32 bytes
    wrapped: bytes  # AEAD ciphertext + tag of the 32-byte content key


@dataclass(frozen=True)
class RolloutBatch:
    """An org's reply to a RoundPlan (docs/ARCHITECTURE.md step 2).

    ``signature`` is the source org's Ed25519 signature (hacrl_fed.security.envelope; empty when unsigned).
    ``wrapped_keys`` is non-empty when the rollouts' text is sealed (``Rollout.sealed_response``) to recipients.
    """

    run_id: str
    round: int
    org_id: str
    rollouts: tuple[Rollout, ...]
    accuracy: float  # mean reward of this org's rollouts this round (P_k(t))
    metrics: dict[str, float] = field(default_factory=dict)
    signature: bytes = b""
    wrapped_keys: tuple[WrappedKey, ...] = ()
    # Digest of the RoundPlan answered (hacrl_fed.security.freshness.plan_digest); covered by the signature.
    plan_digest: bytes = b""
    # Asynchronous rounds (federation.staleness >= 1; 0 / empty otherwise, so lock-step bytes are unchanged): the
    # source's version (updates done) that generated the batch, and the challenges of the plan it answered (a
    # learner re-derives that plan's digest from its own prompts of the round and these; hacrl_fed.security.freshness).
    version: int = 0
    plan_challenges: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainRequest:
    """Coordinator → org: the other orgs' accepted rollouts of this round and the capability table."""

    run_id: str
    round: int
    org_id: str  # the learner
    prompts: tuple[Prompt, ...]  # the round's prompts (to re-tokenize foreign text with the learner's template)
    foreign: tuple[Rollout, ...]
    capability: dict[str, float]  # org_id -> Phat (effective: all 1.0 during warm-up)
    # The other orgs' batches verbatim (signed, possibly sealed), so the learner can verify end to end.
    source_batches: tuple[RolloutBatch, ...] = ()
    # Unsigned ``foreign`` rollouts the codec counted without decoding them (signing on: they are ignored).
    unread_foreign: int = 0
    # Asynchronous rounds (federation.staleness >= 1; empty / 0 in lock-step rounds; bounded by the codec):
    # round -> {org_id: Phat} for the request's own round and every round its foreign rows come from;
    round_capability: dict[int, dict[str, float]] = field(default_factory=dict)
    # (source, round, version) of every foreign batch in ``foreign``; the learner's version before this update.
    tags: tuple[tuple[str, int, int], ...] = ()
    version: int = 0


# Dataclass fields that never travel: filled in by the receiving codec, or kept in one process
# (tests/test_proto_drift.py).
LOCAL_ONLY_FIELDS: dict[str, tuple[str, ...]] = {
    "TrainRequest": ("unread_foreign",),
    "StepReply": ("raised",),
}


@dataclass(frozen=True)
class TrainReport:
    run_id: str
    round: int
    org_id: str
    metrics: dict[str, float] = field(default_factory=dict)  # namespaced: "hacpo/...", "train/...", "time/..."
    # Ed25519 by org_id's roster key (hacrl_fed.security.reports); b"" when unsigned.
    signature: bytes = b""
    # Blind mode: source org -> the content key of its batch this round, disclosed as evidence of mismatches.
    disclosed_keys: dict[str, bytes] = field(default_factory=dict)
    # A fresh challenge from this org, for its entry in the next RoundPlan.challenges (replay protection).
    challenge: bytes = b""


@dataclass(frozen=True)
class EvalRequest:
    run_id: str
    round: int
    task: str
    prompts: tuple[Prompt, ...]
    max_new_tokens: int = 64  # greedy decoding


@dataclass(frozen=True)
class EvalReport:
    run_id: str
    round: int
    org_id: str
    accuracy: float
    num_prompts: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StepRequest:
    """Coordinator → org: every message of a round is a step (docs/ARCHITECTURE.md "One round").

    ``train`` is round ``r - 1``'s TrainRequest (None in round 1, when the org did not train that round, or in the
    plan-only message of ``federation.protocol: two_message``), ``plan`` round ``r``'s RoundPlan (None after the
    last round, or in the train-only message). ``evaluate`` / ``checkpoint`` (the round to checkpoint) ride with the
    train request of the rounds that evaluate / checkpoint. At least one part is set. The worker trains,
    evaluates, checkpoints, then generates with its updated weights (:func:`hacrl_fed.worker.step.run_step`).
    """

    train: TrainRequest | None = None
    plan: RoundPlan | None = None
    evaluate: EvalRequest | None = None
    checkpoint: int | None = None

    def parts(self) -> int:
        """How many parts the message carries (each keeps its own deadline at the coordinator)."""
        return sum(part is not None for part in (self.train, self.plan, self.evaluate, self.checkpoint))


@dataclass(frozen=True)
class StepReply:
    """The worker's reply to a :class:`StepRequest`: per part sent, its reply or why it failed, never both.

    ``train_error`` / ``generate_error`` / ``eval_error`` / ``checkpoint_error`` are :func:`hacrl_fed.failures.describe`
    texts (``[cause] Type: message``); ``checkpoint`` is the path the worker wrote.
    """

    report: TrainReport | None = None
    batch: RolloutBatch | None = None
    train_error: str = ""
    generate_error: str = ""
    eval_report: EvalReport | None = None
    eval_error: str = ""
    checkpoint: str | None = None
    checkpoint_error: str = ""
    # In one process only: the exception of each failed part ("train", "generate", "evaluate", "checkpoint"), so a
    # caller in the same process (the in-process transport, the deprecated Generate / Train) sees the original.
    raised: dict[str, Exception] = field(default_factory=dict, compare=False, repr=False)
