"""The ``security`` section: trust between the organizations (signing, rosters, coordinator-blind mode)."""

from __future__ import annotations

from pydantic import Field, model_validator

from hacrl_fed.config.section import _d, _Section
from hacrl_fed.limits import MAX_BYTES_PER_TOKEN


class SecurityConfig(_Section):
    """Trust between organizations (SECURITY.md).

    ``signing``: every RolloutBatch is signed by its org (Ed25519) and verified by the coordinator and by every
    receiving worker against the pinned roster. ``roster_file`` / ``roster`` pin ``org id -> public identity``
    (``hacrl-fed keys`` writes both the roster and each org's private identity file); ``identity_file`` is where
    a worker finds its own private identity (``{org}`` is replaced by the org id). With neither roster set, a
    run on one machine provisions a fresh key set under ``<run dir>/keys/`` (every key on one machine: it proves
    the plumbing, not trust between separate organizations).
    ``encrypt``: coordinator-blind mode; rollout text is sealed end to end for the other orgs.
    """

    removed_fields = {
        "max_round_step": "a worker accepts a plan at most MAX_ROUND_STEP = 1000 rounds ahead of its last trained "
        "round (hacrl_fed/worker/guard.py)"
    }

    signing: bool = Field(
        True,
        description=_d(
            "every rollout batch is signed by its org (Ed25519) and verified by the coordinator and every receiver"
        ),
    )
    encrypt: bool = Field(
        False,
        description=_d(
            "coordinator-blind mode: rollout text is sealed end to end for the other orgs (needs signing and "
            "reverify_rewards)"
        ),
    )
    roster_file: str | None = Field(
        None,
        description=_d(
            "file pinning org id -> public identity (written by hacrl-fed keys); null with no roster = fresh keys "
            "under <run dir>/keys/"
        ),
    )
    roster: dict[str, str] = Field(
        default_factory=dict,
        description=_d(
            'the roster inline: org id -> "ed25519:<b64> x25519:<b64>" (at most one of roster and roster_file)'
        ),
    )
    identity_file: str | None = Field(
        None,
        description=_d(
            "where a worker finds its private identity; {org} is replaced by the org id (e.g. keys/identity/{org}.key)"
        ),
    )
    reverify_rewards: bool = Field(
        True, description=_d("every receiver re-verifies the claimed rewards of foreign rollouts with its own verifier")
    )
    max_mismatch_rate: float = Field(
        0.1,
        ge=0,
        le=1,
        description=_d(
            "an org whose share of contradicted reward claims in one round exceeds this is excluded for the rest of "
            "the run"
        ),
    )
    max_screen_drop_rate: float = Field(
        1.0,
        ge=0,
        le=1,
        description=_d(
            "an org whose rows the receivers' likelihood screens left out at more than this rate (over the run, the "
            "median over receivers) is excluded for the rest of the run; 1 never excludes"
        ),
    )
    screen_min_rows: int = Field(
        64,
        ge=1,
        description=_d("rows a receiver must have screened of an org before its screen drop rate can exclude it"),
    )
    pad_sealed: bool = Field(
        False,
        description=_d(
            "coordinator-blind mode: pad each sealed text to a power-of-two size bucket (at most the plan's text "
            "bound), so the coordinator does not see each response's exact length"
        ),
    )
    max_stale_rounds: int = Field(
        2,
        ge=1,
        description=_d(
            "a plan at most this many rounds behind a worker's last trained round is a coordinator restart "
            "(stale_round); further behind, the worker was driven ahead by someone else (round_ahead, an attack)"
        ),
    )
    max_bytes_per_token: int = Field(
        MAX_BYTES_PER_TOKEN,
        ge=4,
        description=_d("response text may hold at most max_new_tokens times this many UTF-8 bytes"),
    )

    @model_validator(mode="after")
    def _consistent(self) -> SecurityConfig:
        if self.roster and self.roster_file:
            raise ValueError("set at most one of 'roster' and 'roster_file'")
        if self.encrypt and not self.signing:
            raise ValueError("encrypt needs signing (encrypt-then-sign)")
        if self.pad_sealed and not self.encrypt:
            raise ValueError("pad_sealed needs encrypt (only sealed text is padded)")
        if self.encrypt and not self.reverify_rewards:
            raise ValueError("encrypt needs reverify_rewards (capability comes from receivers' verification)")
        return self
