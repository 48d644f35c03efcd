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
    from hacrl_fed.security.identity import IdentityError, load_roster, provision, roster_path

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
    from hacrl_fed.security.identity import IdentityError, identity_path, load_identity

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
