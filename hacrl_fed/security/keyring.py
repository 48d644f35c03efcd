"""Where a run's keys come from: the pinned roster of org public identities and an org's own private identity.

``security.roster_file`` / ``security.roster`` pin ``org id -> public identity`` (``hacrl-fed keys`` writes the
roster and one private identity file per org); a worker finds its own identity at ``security.identity_file``
(``{org}`` replaced by its id). With no roster configured, a run whose orgs all live on this machine (in-process,
launched gRPC workers, Flower simulation) uses ``<run dir>/keys/``: the first process to need it provisions a
fresh identity per org there (atomically, so concurrent processes agree), every later one reads it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hacrl_fed.config import ConfigError, RunConfig
from hacrl_fed.security.identity import (
    IdentityError,
    identity_path,
    load_identity,
    load_roster,
    provision,
    roster_path,
)

log = logging.getLogger(__name__)

AUTO_KEYS_DIR = "keys"


def auto_keys_dir(run_dir: str | Path) -> Path:
    """The per-run key set used when no roster is configured."""
    return Path(run_dir) / AUTO_KEYS_DIR


def uses_auto_keys(cfg: RunConfig) -> bool:
    """True when signing is on and no roster is pinned in the config (keys provisioned per run)."""
    sec = cfg.security
    return sec.signing and not sec.roster and not sec.roster_file


def _org_ids(cfg: RunConfig) -> list[str]:
    return [o.id for o in cfg.orgs]


def load_run_roster(cfg: RunConfig, run_dir: str | Path) -> dict[str, Any] | None:
    """``{org: PublicIdentity}`` for every configured org, or None when signing is off.

    Raises :class:`ConfigError` naming the field when the roster is unreadable or misses a configured org.
    """
    sec = cfg.security
    if not sec.signing:
        return None
    try:
        if sec.roster:
            roster, where = load_roster(dict(sec.roster)), "security.roster"
        elif sec.roster_file:
            roster, where = load_roster(Path(sec.roster_file)), f"security.roster_file ({sec.roster_file})"
        else:
            keys = auto_keys_dir(run_dir)
            provision(keys, _org_ids(cfg))
            roster, where = load_roster(roster_path(keys)), f"the run's key set {keys}"
    except IdentityError as err:
        raise ConfigError(f"security: {err}") from None
    missing = [o for o in _org_ids(cfg) if o not in roster]
    if missing:
        raise ConfigError(f"security: {where} has no public identity for orgs {missing}")
    return {o: roster[o] for o in _org_ids(cfg)}


def load_org_identity(cfg: RunConfig, org_id: str, run_dir: str | Path) -> Any | None:
    """``org_id``'s private :class:`OrgIdentity`, or None when signing is off.

    The identity must match the roster's public identity for ``org_id`` (a mismatch is a ConfigError).
    """
    sec = cfg.security
    if not sec.signing:
        return None
    roster = load_run_roster(cfg, run_dir) or {}
    if uses_auto_keys(cfg):
        path = identity_path(auto_keys_dir(run_dir), org_id)
    elif sec.identity_file:
        path = Path(sec.identity_file.replace("{org}", org_id))
    else:
        raise ConfigError(
            f"security.identity_file: not set, so org {org_id!r} has no signing key (the roster is "
            "pinned; point identity_file at this org's key from 'hacrl-fed keys')"
        )
    try:
        identity = load_identity(path, org_id=org_id)
    except (IdentityError, OSError) as err:
        raise ConfigError(f"security.identity_file: {err}") from None
    if identity.public().to_text() != roster[org_id].to_text():
        raise ConfigError(f"security.identity_file: {path} is not the identity the roster pins for {org_id!r}")
    return identity


# ------------------------------------------------------------------------------------- start-up key check

HEALTH_KEY = "signing_key"  # a worker's Health: the public identity it signs with
HEALTH_ROSTER = "roster_sha256"  # ... and a fingerprint of the roster it verifies others against
ROSTER_FIX = (
    "give the coordinator and every worker the same keys: `hacrl-fed keys --out KEYS --orgs ORG1,ORG2`, then "
    "`--set security.roster_file=KEYS/identity_set/roster.yaml --set "
    "security.identity_file=KEYS/identity_set/identity/{org}.key` on every command (workers on the coordinator's "
    "machine may instead share its run dir: hacrl-fed worker ... --run-dir RUN_DIR)"
)


def roster_fingerprint(roster: dict[str, Any]) -> str:
    """sha256 (hex) of the roster's ``org=public identity`` lines, sorted: equal iff two rosters pin the same keys."""
    import hashlib

    lines = "\n".join(f"{org}={roster[org].to_text()}" for org in sorted(roster))
    return hashlib.sha256(lines.encode()).hexdigest()


def identity_health(roster: dict[str, Any] | None, identity: Any | None) -> dict[str, str]:
    """The key facts a worker adds to its Health reply (empty when signing is off)."""
    if roster is None or identity is None:
        return {}
    return {HEALTH_KEY: identity.public().to_text(), HEALTH_ROSTER: roster_fingerprint(roster)}


def check_worker_keys(
    cfg: RunConfig, run_dir: str | Path, health: dict[str, Any], addresses: dict[str, str] | None = None
) -> None:
    """Before round 1: every worker that reports its keys in Health (:func:`identity_health`) must sign with the
    identity the coordinator's roster pins for its org and verify against the same roster; else a
    :class:`ConfigError` naming the org and the fix (otherwise every batch would fail as ``bad_signature``).
    ``health``: ``{org: Health dict}`` of the workers that answered (errors and workers that report no keys are
    skipped)."""
    roster = load_run_roster(cfg, run_dir)
    if roster is None:
        return
    where = "security.roster" if cfg.security.roster else cfg.security.roster_file or f"{auto_keys_dir(run_dir)}"
    mine = roster_fingerprint(roster)
    for org, info in sorted(health.items()):
        if not isinstance(info, dict) or HEALTH_KEY not in info or org not in roster:
            continue
        at = f" at {addresses[org]}" if addresses and org in addresses else ""
        if info[HEALTH_KEY] != roster[org].to_text():
            raise ConfigError(
                f"org {org!r}: the worker{at} signs with a key the coordinator's roster ({where}) does not pin for "
                f"{org!r}, so every batch it sends would be rejected as bad_signature; {ROSTER_FIX}"
            )
        if info.get(HEALTH_ROSTER, mine) != mine:
            raise ConfigError(
                f"org {org!r}: the worker{at} verifies the other orgs against another roster than the coordinator's "
                f"({where}), so it would reject their batches as bad_signature; {ROSTER_FIX}"
            )
