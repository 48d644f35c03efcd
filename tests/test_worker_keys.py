"""The start-up key check (hacrl_fed.security.keyring.check_worker_keys) against fabricated Health replies: a
worker signing with another key, or verifying against another roster, is one line naming the org and the fix;
a matching worker, a worker that reports no keys and signing off pass."""

from __future__ import annotations

import pytest

from hacrl_fed.config import ConfigError, load_config
from hacrl_fed.security.identity import generate_identity
from hacrl_fed.security.keyring import (
    HEALTH_KEY,
    HEALTH_ROSTER,
    check_worker_keys,
    identity_health,
    load_org_identity,
    load_run_roster,
    roster_fingerprint,
)

ORGS = [{"id": "acme", "model": {"zoo": "micro-qwen-char"}}, {"id": "globex", "model": {"zoo": "micro-gpt2-bpe"}}]


def _health(cfg, run_dir) -> dict[str, dict[str, str]]:
    roster = load_run_roster(cfg, run_dir)
    return {o: identity_health(roster, load_org_identity(cfg, o, run_dir)) for o in ("acme", "globex")}


def test_matching_workers_pass_and_mismatches_name_the_org_and_the_fix(tmp_path):
    cfg = load_config({"name": "k", "orgs": ORGS})
    health = _health(cfg, tmp_path / "run")
    assert set(health["acme"]) == {HEALTH_KEY, HEALTH_ROSTER}
    check_worker_keys(cfg, tmp_path / "run", health)  # same run dir: the same provisioned keys
    other = _health(cfg, tmp_path / "elsewhere")  # a worker that provisioned its own keys
    with pytest.raises(ConfigError, match=r"^org 'globex': the worker at 127\.0\.0\.1:5 signs with a key the "
                                          r"coordinator's roster \(.*run/keys\) does not pin for 'globex'.*"
                                          r"hacrl-fed keys --out KEYS"):
        check_worker_keys(cfg, tmp_path / "run", {"acme": health["acme"], "globex": other["globex"]},
                          {"globex": "127.0.0.1:5"})
    forged = dict(health["acme"], **{HEALTH_ROSTER: "0" * 64})
    with pytest.raises(ConfigError, match=r"^org 'acme': the worker verifies the other orgs against another roster"):
        check_worker_keys(cfg, tmp_path / "run", {"acme": forged})
    check_worker_keys(cfg, tmp_path / "run", {"acme": {"org_id": "acme"}, "globex": RuntimeError("down")})


def test_signing_off_reports_and_checks_nothing(tmp_path):
    cfg = load_config({"name": "k", "orgs": ORGS, "security": {"signing": False}})
    assert identity_health(load_run_roster(cfg, tmp_path), load_org_identity(cfg, "acme", tmp_path)) == {}
    check_worker_keys(cfg, tmp_path, {"acme": {HEALTH_KEY: "anything"}})


def test_roster_fingerprint_depends_on_every_pinned_key():
    a, b = generate_identity("a"), generate_identity("b")
    r1 = {"a": a.public(), "b": b.public()}
    assert roster_fingerprint(r1) == roster_fingerprint(dict(reversed(r1.items())))
    assert roster_fingerprint(r1) != roster_fingerprint({"a": a.public(), "b": generate_identity("b").public()})
