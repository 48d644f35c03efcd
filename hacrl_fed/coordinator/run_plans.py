"""A run's id and each round's sampling settings, as the coordinator hands them to the orgs."""

from __future__ import annotations

import secrets

from hacrl_fed.config import RunConfig, config_hash, org_generation
from hacrl_fed.seeding import stable_seed
from hacrl_fed.types import SamplingParams


def make_run_id(cfg: RunConfig) -> str:
    """A new run's id, ``<name>-<config hash>-<6 random hex digits>``: every new run gets its own, even with an
    identical config (a resumed run keeps the id saved in ``coordinator_state.json``)."""
    return f"{cfg.name}-{config_hash(cfg)}-{secrets.token_hex(3)}"


def sampling_params(cfg: RunConfig, org_id: str, round: int) -> SamplingParams:
    """The org's generation settings as SamplingParams, seed derived from (cfg.seed, round) (same for every org;
    workers mix in their own id)."""
    gen = org_generation(cfg, org_id)
    seed = stable_seed("sampling", cfg.seed, round) % 2**31
    return SamplingParams(gen.temperature, gen.top_p, gen.top_k, gen.max_new_tokens, gen.num_samples, seed)
