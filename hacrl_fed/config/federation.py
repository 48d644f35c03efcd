"""The ``federation`` section: the round loop the coordinator runs, lock-step or asynchronous.

The checks that need other sections (the orgs ``org_rounds`` names, what asynchronous rounds need of the protocol,
security and trainer) are the run's cross-field checks (:mod:`hacrl_fed.config.run`). The in-process virtual clock
(an org's step duration, deaths and rejoins) is a benchmark's setting, not this section's
(:mod:`hacrl_fed.coordinator.virtual_clock`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from hacrl_fed.config.section import _d, _refuse_bench_only, _Section
from hacrl_fed.limits import MAX_MESSAGE_MB


class FederationConfig(_Section):
    """The round loop run by the coordinator."""

    rounds: int = Field(100, ge=1, description="rounds to run")
    prompts_per_round: int = Field(16, ge=1, description="B: prompts every org answers per round")
    eval_every: int = Field(
        10,
        ge=0,
        description=_d(
            "greedy held-out evaluation every this many rounds (also before round 1 and after the last); 0 = only "
            "before and after"
        ),
    )
    min_orgs: int = Field(1, ge=1, description="orgs that must reply for a round to train")
    round_timeout_s: float = Field(600.0, gt=0, description="seconds each phase of a round waits for the orgs")
    transport: Literal["inprocess", "grpc", "flower"] = Field(
        "inprocess",
        description=_d(
            "how the coordinator reaches the workers with hacrl-fed run: inprocess or grpc (flower: hacrl-fed simulate "
            "or flwr run)"
        ),
    )
    protocol: Literal["fused", "two_message"] = Field(
        "fused",
        description=_d(
            "fused: one step message per org per round (round r-1's train request, its evaluation and checkpoint when "
            "due, and round r's plan; the worker trains, then generates); two_message: a plan-only step, then a "
            "train-only step (same numbers)"
        ),
    )
    checkpoint_every: int = Field(0, ge=0, description="worker checkpoints every this many rounds; 0 = only at the end")
    max_failed_rounds: int = Field(3, ge=1, description=_d("consecutive rounds below min_orgs before the run aborts"))
    max_message_mb: int = Field(MAX_MESSAGE_MB, ge=1, description="largest gRPC / Flower message, in MB")
    staleness: int = Field(
        0,
        ge=0,
        description=_d(
            "K: asynchronous rounds when >= 1 (in-process, gRPC and Flower): an org may plan round t once every "
            "live org has published round t-K-1, so no org runs more than K rounds ahead of the slowest; 0 = today's "
            "lock-step rounds (docs/ALGORITHM.md 'Asynchronous rounds')"
        ),
    )
    window: int | None = Field(
        None,
        ge=1,
        description=_d(
            "W: a step planning round t takes the foreign batches of rounds t-W..t-1 it has not used; null = K+1"
        ),
    )
    org_rounds: dict[str, int] = Field(
        default_factory=dict,
        description=_d(
            "asynchronous rounds: org id -> the rounds that org runs (default federation.rounds, which stays the "
            "run's nominal length): a fast org may keep stepping while a slow one runs; each org evaluates every "
            "eval_every of its own rounds and after its own last round"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _bench_only(cls, data: Any) -> Any:
        where = "a method's set in configs/bench/matrix.yaml, or InProcessTransport(clock=VirtualClock(...))"
        return _refuse_bench_only(data, {f"virtual_{k}": where for k in ("step_s", "dies", "rejoins")})

    @property
    def effective_window(self) -> int:
        """``W``: ``window``, or ``K + 1`` when unset."""
        return self.staleness + 1 if self.window is None else self.window

    @property
    def last_round(self) -> int:
        """The last round any org runs: ``rounds``, or the largest ``org_rounds`` value above it."""
        return max([self.rounds, *self.org_rounds.values()])

    def rounds_of(self, org: str) -> int:
        """The rounds ``org`` runs: its ``org_rounds`` entry, else ``rounds``."""
        return self.org_rounds.get(org, self.rounds)

    @field_validator("org_rounds")
    @classmethod
    def _positive_rounds(cls, value: dict[str, int]) -> dict[str, int]:
        bad = {org: n for org, n in value.items() if n < 1}
        if bad:
            raise ValueError(f"every org's rounds must be >= 1, got {bad}")
        return value
