"""hacrl_fed.security: signed envelopes, coordinator-blind sealing, identity files, rosters and provisioning.

Round trips (sign/verify; seal/sign/verify/open for 2 and 3 recipients), one test per rejection reason
(tampering, forgery, unknown org, replayed run / round, truncated or garbage bytes), who can open what, that the
relay never sees plaintext, 0600 identity files, strict public identity text, and provision() idempotent and
safe under concurrent callers. Everything is in memory or under tmp_path; no network.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from hacrl_fed import types as t
from hacrl_fed.security import identity as ident
from hacrl_fed.security import sealing
from hacrl_fed.security.envelope import (
    DOMAIN, REASONS, RejectedBatch, canonical_bytes, sign_batch, signed, verify_batch, verify_signed,
)
from hacrl_fed.security.identity import (
    IdentityError, PublicIdentity, generate_identity, identity_path, load_identity, load_roster, provision,
    roster_path, save_identity, save_roster,
)
from hacrl_fed.security.sealing import is_sealed, open_batch, seal_batch
from hacrl_fed.v1 import worker_pb2 as pb
from hacrl_fed.wire import codec

RUN, ROUND = "run-7", 3
ORGS = ("acme", "beta", "gamma")
TEXTS = ("The answer is \\boxed{42}", "Ünïcödé 数学 🚀 reasoning", "", "x" * 300)


@pytest.fixture(scope="module")
def ids() -> dict[str, ident.OrgIdentity]:
    return {o: generate_identity(o) for o in (*ORGS, "mallory")}


@pytest.fixture(scope="module")
def roster(ids) -> dict[str, PublicIdentity]:
    return {o: ids[o].public() for o in ORGS}  # mallory is not pinned


def _batch(org: str = "acme", round: int = ROUND, run: str = RUN) -> t.RolloutBatch:
    rollouts = tuple(
        t.Rollout(org, round, 11 + i // 2, i % 2, text, t.FINISH_STOP, [1.0, 0.0, 0.5, 0.25][i], -1.5 * (i + 1), 7 + i)
        for i, text in enumerate(TEXTS)
    )
    return t.RolloutBatch(run, round, org, rollouts, accuracy=0.4375, metrics={"time/generate": 1.5})


def _reject(reason: str, fn, *args, **kwargs) -> RejectedBatch:
    with pytest.raises(RejectedBatch) as info:
        fn(*args, **kwargs)
    assert info.value.reason == reason, str(info.value)
    assert str(info.value).startswith(REASONS[reason]), str(info.value)
    return info.value


def _retouched(envelope: bytes, mutate) -> bytes:
    """What a relay that edits a field (and re-serializes canonically, signature untouched) would forward."""
    msg = pb.RolloutBatch()
    msg.ParseFromString(envelope)
    mutate(msg)
    return msg.SerializeToString(deterministic=True)


# --------------------------------------------------------------------------------------------- round trips


def test_sign_and_verify_round_trip(ids, roster):
    batch = _batch()
    envelope = sign_batch(batch, ids["acme"])
    got = verify_batch(envelope, roster, run_id=RUN, round=ROUND)
    assert dataclasses.replace(got, signature=b"") == batch and len(got.signature) == 64
    assert got == signed(batch, ids["acme"]) == codec.decode(t.RolloutBatch, envelope)  # Ed25519 is deterministic
    assert verify_signed(got, roster, run_id=RUN, round=ROUND) is got


def test_raw_keys_work_on_both_sides(ids):
    batch = _batch("beta")
    envelope = sign_batch(batch, ids["beta"].sign_key)
    assert verify_batch(envelope, {"beta": ids["beta"].sign_key.public_key()}, run_id=RUN, round=ROUND).org_id == "beta"


def test_canonical_bytes_cover_everything_but_the_signature(ids):
    batch = _batch()
    body = canonical_bytes(batch)
    assert body.startswith(DOMAIN) and body == canonical_bytes(signed(batch, ids["acme"]))
    reordered = dataclasses.replace(batch, metrics={"b": 2.0, "a": 1.0})
    assert canonical_bytes(reordered) == canonical_bytes(dataclasses.replace(batch, metrics={"a": 1.0, "b": 2.0}))
    for change in ({"run_id": "other"}, {"round": 4}, {"org_id": "beta"}, {"accuracy": 0.5}, {"metrics": {}},
                   {"rollouts": batch.rollouts[:-1]},
                   {"wrapped_keys": (t.WrappedKey("beta", bytes(32), bytes(48)),)}):
        assert canonical_bytes(dataclasses.replace(batch, **change)) != body, change


@pytest.mark.parametrize("recipients", [("beta", "gamma"), ("acme", "beta", "gamma")], ids=["2", "3"])
def test_seal_sign_verify_open(ids, roster, recipients):
    batch = _batch()
    sealed = seal_batch(batch, {o: roster[o] for o in recipients})
    assert is_sealed(sealed) and not is_sealed(batch)
    assert [w.recipient for w in sealed.wrapped_keys] == sorted(recipients)
    assert all(r.response == "" and len(r.sealed_response) == len(p.response.encode()) + 16
               for r, p in zip(sealed.rollouts, batch.rollouts))
    envelope = sign_batch(sealed, ids["acme"])
    verified = verify_batch(envelope, roster, run_id=RUN, round=ROUND)
    for org in recipients:
        opened = open_batch(verified, org, ids[org].box_key)
        assert opened.rollouts == batch.rollouts and opened.wrapped_keys == ()
        assert opened.signature == verified.signature and not is_sealed(opened)
        assert open_batch(verified, org, ids[org]).rollouts == batch.rollouts  # an OrgIdentity works too


def test_the_relay_never_sees_plaintext(ids, roster):
    batch = _batch()
    envelope = sign_batch(seal_batch(batch, {"beta": roster["beta"], "gamma": roster["gamma"]}), ids["acme"])
    forwarded = codec.encode(t.TrainRequest(RUN, ROUND, "beta", (), (), {}, source_batches=(
        codec.decode(t.RolloutBatch, envelope),)))
    for text in TEXTS:
        for data in (envelope, forwarded):
            for piece in (text, text[:12], text[-12:]):
                if len(piece.encode()) >= 8:
                    assert piece.encode() not in data
    # what stays visible: rewards, counts, ids, sizes
    seen = codec.decode(t.RolloutBatch, envelope)
    assert [r.reward for r in seen.rollouts] == [r.reward for r in batch.rollouts]


def test_seals_of_the_same_batch_differ(roster):
    a, b = (seal_batch(_batch(), {"beta": roster["beta"]}) for _ in range(2))
    assert a.rollouts[0].sealed_response != b.rollouts[0].sealed_response
    assert a.wrapped_keys[0].ephemeral_public != b.wrapped_keys[0].ephemeral_public


def test_forwarded_source_batches_verify_end_to_end(ids, roster):
    """The learner verifies and opens the batches the coordinator forwards in TrainRequest.source_batches."""
    envelope = sign_batch(seal_batch(_batch(), {"beta": roster["beta"]}), ids["acme"])
    request = codec.decode(t.TrainRequest, codec.encode(t.TrainRequest(
        RUN, ROUND, "beta", (), (), {}, source_batches=(codec.decode(t.RolloutBatch, envelope),))))
    source = verify_signed(request.source_batches[0], roster, run_id=RUN, round=ROUND)
    assert open_batch(source, "beta", ids["beta"].box_key).rollouts == _batch().rollouts


# ---------------------------------------------------------------------------------------------- rejections


def _sealed_envelope(ids, roster) -> bytes:
    return sign_batch(seal_batch(_batch(), {"beta": roster["beta"], "gamma": roster["gamma"]}), ids["acme"])


def _flip_sealed(m):
    m.rollouts[1].sealed_response = bytes([m.rollouts[1].sealed_response[0] ^ 1]) + m.rollouts[1].sealed_response[1:]


TAMPERING = {
    "reward": lambda m: setattr(m.rollouts[1], "reward", 1.0),
    "text": lambda m: setattr(m.rollouts[0], "response", "The answer is \\boxed{43}"),
    "logprob": lambda m: setattr(m.rollouts[0], "logprob_sum", 0.0),
    "dropped rollout": lambda m: m.rollouts.pop(),
    "accuracy": lambda m: setattr(m, "accuracy", 1.0),
    "metric": lambda m: m.metrics.__setitem__("time/generate", 0.1),
    "signature bit": lambda m: setattr(m, "signature", bytes([m.signature[0] ^ 1]) + m.signature[1:]),
    "empty signature": lambda m: setattr(m, "signature", b""),
    "short signature": lambda m: setattr(m, "signature", m.signature[:63]),
}
SEALED_TAMPERING = {
    "sealed bytes": _flip_sealed,
    "swapped sealed text": lambda m: m.rollouts[0].__setattr__("sealed_response", m.rollouts[1].sealed_response),
    "wrapped key": lambda m: setattr(m.wrapped_keys[0], "wrapped", bytes(48)),
    "dropped recipient": lambda m: m.wrapped_keys.pop(),
}


@pytest.mark.parametrize("mutate", TAMPERING.values(), ids=TAMPERING)
def test_tampering_is_a_bad_signature(ids, roster, mutate):
    envelope = sign_batch(_batch(), ids["acme"])
    err = _reject("bad_signature", verify_batch, _retouched(envelope, mutate), roster, run_id=RUN, round=ROUND)
    assert "acme" in str(err)


@pytest.mark.parametrize("mutate", SEALED_TAMPERING.values(), ids=SEALED_TAMPERING)
def test_tampered_sealed_batches_are_bad_signatures(ids, roster, mutate):
    envelope = _retouched(_sealed_envelope(ids, roster), mutate)
    _reject("bad_signature", verify_batch, envelope, roster, run_id=RUN, round=ROUND)


def test_forged_by_another_orgs_key(ids, roster):
    forged = sign_batch(_batch("acme"), ids["mallory"].sign_key)  # claims to be acme
    _reject("bad_signature", verify_batch, forged, roster, run_id=RUN, round=ROUND)
    by_beta = sign_batch(_batch("acme"), ids["beta"].sign_key)  # a pinned org impersonating another
    _reject("bad_signature", verify_batch, by_beta, roster, run_id=RUN, round=ROUND)
    with pytest.raises(ValueError, match="identity of org 'beta' cannot sign a batch of org 'acme'"):
        sign_batch(_batch("acme"), ids["beta"])
    with pytest.raises(TypeError, match="Ed25519PrivateKey or OrgIdentity"):
        sign_batch(_batch("acme"), ids["acme"].box_key)


def test_unknown_org(ids, roster):
    err = _reject("unknown_org", verify_batch, sign_batch(_batch("mallory"), ids["mallory"]), roster,
                  run_id=RUN, round=ROUND)
    assert "'mallory' is not in the roster" in str(err)
    _reject("unknown_org", verify_batch, sign_batch(_batch(), ids["acme"]), {"acme": "not a key"},
            run_id=RUN, round=ROUND)


def test_wrong_run_and_replayed_round(ids, roster):
    err = _reject("wrong_run", verify_batch, sign_batch(_batch(run="run-6"), ids["acme"]), roster,
                  run_id=RUN, round=ROUND)
    assert "'run-6'" in str(err) and repr(RUN) in str(err)
    earlier = sign_batch(_batch(round=ROUND - 1), ids["acme"])  # a valid batch of the previous round, replayed
    assert verify_batch(earlier, roster, run_id=RUN, round=ROUND - 1).round == ROUND - 1
    err = _reject("wrong_round", verify_batch, earlier, roster, run_id=RUN, round=ROUND)
    assert f"round {ROUND - 1}, expected {ROUND}" in str(err)


def test_signature_is_checked_before_the_header(ids, roster):
    """A forged batch for another run is a bad signature, not a wrong run: headers are trusted only once signed."""
    forged = sign_batch(_batch(run="elsewhere", round=99), ids["mallory"].sign_key)
    _reject("bad_signature", verify_batch, forged, roster, run_id=RUN, round=ROUND)


def test_rollouts_must_belong_to_the_batch(ids, roster):
    batch = _batch()
    foreign = dataclasses.replace(batch.rollouts[0], org_id="beta")
    stray = dataclasses.replace(batch, rollouts=(*batch.rollouts, foreign))
    _reject("malformed", verify_batch, sign_batch(stray, ids["acme"]), roster, run_id=RUN, round=ROUND)
    late = dataclasses.replace(batch, rollouts=(dataclasses.replace(batch.rollouts[0], round=ROUND - 1),))
    _reject("malformed", verify_signed, signed(late, ids["acme"]), roster, run_id=RUN, round=ROUND)


@pytest.mark.parametrize("cut", [1, 10, 64, 100])
def test_truncated_envelope(ids, roster, cut):
    envelope = sign_batch(_batch(), ids["acme"])
    with pytest.raises(RejectedBatch) as info:
        verify_batch(envelope[:-cut], roster, run_id=RUN, round=ROUND)
    assert info.value.reason in ("malformed", "bad_signature")


@pytest.mark.parametrize("garbage", [b"", b"garbage", b"\x0a\xff\xff\xff", bytes(range(256)), b"\x08\x01" * 40,
                                     "text", None, 42, [b"x"]])
def test_garbage_is_malformed(roster, garbage):
    _reject("malformed", verify_batch, garbage, roster, run_id=RUN, round=ROUND)


def test_non_canonical_envelopes_are_malformed(ids, roster):
    envelope = sign_batch(_batch(), ids["acme"])
    unknown_field = envelope + b"\xf8\x06\x01"  # field 111 (varint) = 1: the codec refuses undeclared fields
    with pytest.raises(codec.WireError, match="3 bytes of fields schema v1 does not declare"):
        codec.decode(t.RolloutBatch, unknown_field)
    _reject("malformed", verify_batch, unknown_field, roster, run_id=RUN, round=ROUND)
    repeated_header = envelope + b"\x18" + bytes([ROUND])  # round repeated at the end (last one wins)
    _reject("malformed", verify_batch, repeated_header, roster, run_id=RUN, round=ROUND)


def test_verify_raises_nothing_but_rejected_batch(ids, roster):
    good = sign_batch(_batch(), ids["acme"])
    for bad_roster in (None, [], "acme", {"acme": None}, {"acme": ids["acme"]}):
        with pytest.raises(RejectedBatch):
            verify_batch(good, bad_roster, run_id=RUN, round=ROUND)
    for thing in (None, "batch", _batch().rollouts[0], dataclasses.replace(_batch(), signature="x" * 64),
                  dataclasses.replace(_batch(), org_id=None, signature=bytes(64)),
                  dataclasses.replace(signed(_batch(), ids["acme"]), accuracy=float("nan"))):
        with pytest.raises(RejectedBatch):
            verify_signed(thing, roster, run_id=RUN, round=ROUND)


def test_in_process_batches_get_the_wire_hygiene(ids, roster):
    """A signed dataclass that never crossed the wire is held to the codec's decode checks too."""
    bad = signed(dataclasses.replace(_batch(), accuracy=1.5), ids["acme"])
    err = _reject("malformed", verify_signed, bad, roster, run_id=RUN, round=ROUND)
    assert "accuracy" in str(err)
    bad_rollout = dataclasses.replace(_batch().rollouts[0], reward=float("nan"))
    bad = signed(dataclasses.replace(_batch(), rollouts=(bad_rollout,)), ids["acme"])
    err = _reject("malformed", verify_signed, bad, roster, run_id=RUN, round=ROUND)
    assert "rollouts[0].reward" in str(err)


def test_in_process_verification_encodes_the_batch_once(ids, roster, monkeypatch):
    """A valid batch is encoded once (the signed body) and its hygiene checked without decoding it; an invalid
    one is decoded, for the error that names the field."""
    from hacrl_fed.security import envelope

    calls = {"encode": 0, "decode": []}
    encode, decode = codec.encode, codec.decode

    def counting_encode(obj):
        calls["encode"] += 1
        return encode(obj)

    def recording_decode(kind, data, **kw):
        calls["decode"].append(bytes(data))
        return decode(kind, data, **kw)

    monkeypatch.setattr(envelope.codec, "encode", counting_encode)
    monkeypatch.setattr(codec, "decode", recording_decode)
    batch = signed(_batch(), ids["acme"])
    calls["encode"] = 0
    assert verify_signed(batch, roster, run_id=RUN, round=ROUND) is batch
    assert calls["encode"] == 1 and calls["decode"] == []
    bad = signed(dataclasses.replace(_batch(), accuracy=1.5), ids["acme"])
    calls["encode"] = 0
    _reject("malformed", verify_signed, bad, roster, run_id=RUN, round=ROUND)
    assert calls["encode"] == 1 and calls["decode"] == [canonical_bytes(bad)[len(DOMAIN):]]


def test_rejected_batch_reasons_and_pickling():
    import pickle

    for code, words in REASONS.items():
        err = pickle.loads(pickle.dumps(RejectedBatch(code, "detail here")))
        assert err.reason == code and str(err) == f"{words}: detail here" and isinstance(err, ValueError)
    assert str(RejectedBatch("wrong_run")) == "wrong run"
    with pytest.raises(ValueError, match="unknown rejection reason"):
        RejectedBatch("because")


# ---------------------------------------------------------------------------------------------- opening


def test_only_recipients_can_open(ids, roster):
    verified = verify_batch(sign_batch(seal_batch(_batch(), {"beta": roster["beta"]}), ids["acme"]), roster,
                            run_id=RUN, round=ROUND)
    err = _reject("undecryptable", open_batch, verified, "gamma", ids["gamma"].box_key)
    assert "no content key is wrapped for this org" in str(err)
    _reject("undecryptable", open_batch, verified, "acme", ids["acme"])  # not even the source, unless a recipient
    _reject("undecryptable", open_batch, verified, "beta", ids["mallory"].box_key)  # beta's entry, wrong key


SEALED_EDITS = {
    "tampered sealed bytes": lambda b: _edit_rollout(b, 1, sealed_response=bytes([b.rollouts[1].sealed_response[0] ^ 4])
                                                     + b.rollouts[1].sealed_response[1:]),
    "moved to another prompt": lambda b: _edit_rollout(b, 0, prompt_id=99),
    "moved to another sample": lambda b: _edit_rollout(b, 0, sample_index=5),
    "swapped positions": lambda b: dataclasses.replace(b, rollouts=(b.rollouts[1], b.rollouts[0], *b.rollouts[2:])),
    "another run": lambda b: dataclasses.replace(b, run_id="run-8"),
    "another round": lambda b: dataclasses.replace(b, round=ROUND + 1),
    "another sender": lambda b: dataclasses.replace(b, org_id="gamma"),
    "missing sealed text": lambda b: _edit_rollout(b, 2, sealed_response=b""),
    "plaintext next to it": lambda b: _edit_rollout(b, 2, response="leak"),
    "truncated tag": lambda b: _edit_rollout(b, 3, sealed_response=b.rollouts[3].sealed_response[:-1]),
    "wrapped key": lambda b: dataclasses.replace(b, wrapped_keys=(
        dataclasses.replace(b.wrapped_keys[0], wrapped=bytes(48)),)),
    "ephemeral key": lambda b: dataclasses.replace(b, wrapped_keys=(
        dataclasses.replace(b.wrapped_keys[0], ephemeral_public=bytes(32)),)),  # low-order point
    "no wrapped keys": lambda b: dataclasses.replace(b, wrapped_keys=()),
}


def _edit_rollout(batch: t.RolloutBatch, i: int, **change) -> t.RolloutBatch:
    rollouts = list(batch.rollouts)
    rollouts[i] = dataclasses.replace(rollouts[i], **change)
    return dataclasses.replace(batch, rollouts=tuple(rollouts))


@pytest.mark.parametrize("edit", SEALED_EDITS.values(), ids=SEALED_EDITS)
def test_open_refuses_tampered_or_moved_ciphertext(ids, roster, edit):
    """Even without the signature check, ciphertext is bound to its run, round, sender, prompt, sample, position."""
    sealed = seal_batch(_batch(), {"beta": roster["beta"]})
    assert open_batch(sealed, "beta", ids["beta"].box_key).rollouts == _batch().rollouts
    _reject("undecryptable", open_batch, edit(sealed), "beta", ids["beta"].box_key)


def test_open_refuses_invalid_utf8(ids, roster):
    batch = _batch()
    key = os.urandom(32)
    wrapped = sealing._wrap(key, batch, "beta", roster["beta"].box)
    r = batch.rollouts[0]
    bad = ChaCha20Poly1305(key).encrypt(sealing._nonce(0), b"\xff\xfe not utf-8", sealing._response_ad(batch, r))
    sealed = dataclasses.replace(batch, rollouts=(dataclasses.replace(r, response="", sealed_response=bad),),
                                 wrapped_keys=(wrapped,))
    _reject("undecryptable", open_batch, sealed, "beta", ids["beta"].box_key)


def test_open_passes_unsealed_batches_through_and_checks_its_key(ids):
    batch = signed(_batch(), ids["acme"])
    assert open_batch(batch, "beta", ids["beta"].box_key) is batch
    with pytest.raises(TypeError, match="X25519PrivateKey or OrgIdentity"):
        open_batch(batch, "beta", ids["beta"].sign_key)
    _reject("malformed", open_batch, "not a batch", "beta", ids["beta"].box_key)


def test_seal_batch_preconditions(ids, roster):
    sealed = seal_batch(signed(_batch(), ids["acme"]), {"beta": roster["beta"].box})  # raw X25519 key works
    assert sealed.signature == b""  # sealing invalidates a signature: sign after sealing
    with pytest.raises(ValueError, match="already sealed"):
        seal_batch(sealed, {"beta": roster["beta"]})
    with pytest.raises(ValueError, match="no recipients"):
        seal_batch(_batch(), {})
    with pytest.raises(TypeError, match="recipient 'beta'"):
        seal_batch(_batch(), {"beta": roster["beta"].sign})
    with pytest.raises(ValueError, match="non-empty string"):
        seal_batch(_batch(), {"": roster["beta"]})


# -------------------------------------------------------------------------------------- identity files


def test_identity_file_round_trip_and_modes(tmp_path):
    me = generate_identity("acme")
    path = save_identity(tmp_path / "new" / "acme.key", me)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    back = load_identity(path, org_id="acme")
    assert back.org_id == "acme" and back.public() == me.public()
    assert "PRIVATE" not in repr(back) and me.public().to_text() in repr(back)
    with pytest.raises(IdentityError, match="already exists .*overwrite=True"):
        save_identity(path, generate_identity("acme"))
    other = generate_identity("acme")
    save_identity(path, other, overwrite=True)
    assert load_identity(path).public() == other.public() and stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o601])
def test_loose_identity_files_are_refused(tmp_path, mode):
    path = save_identity(tmp_path / "acme.key", generate_identity("acme"))
    path.chmod(mode)
    with pytest.raises(IdentityError, match=rf"accessible by group or others \(mode 0{mode:o}\).*chmod 600 {path}"):
        load_identity(path)


def test_identity_file_errors(tmp_path):
    path = save_identity(tmp_path / "acme.key", generate_identity("acme"))
    with pytest.raises(IdentityError, match=rf"{path} belongs to org 'acme', not 'beta'"):
        load_identity(path, org_id="beta")
    with pytest.raises(IdentityError, match="no identity file at"):
        load_identity(tmp_path / "missing.key")

    def write(name: str, text: str) -> Path:
        p = tmp_path / name
        fd = os.open(p, os.O_CREAT | os.O_WRONLY, 0o600)
        os.write(fd, text.encode())
        os.close(fd)
        return p

    doc = path.read_text()
    cases = {
        "not json": ("{", "is not JSON"),
        "wrong format": (doc.replace("hacrl-fed-identity-v1", "v0"), "not a hacrl-fed-identity-v1 file"),
        "bad org": (doc.replace('"acme"', '"../etc"'), "not a valid org id"),
        "bad base64": (doc.replace('"ed25519_private": "', '"ed25519_private": "!'),
                       "ed25519_private: not valid base64"),
        "long key": (doc.replace('"x25519_private": "', '"x25519_private": "AAAA'), "x25519_private: 35 bytes"),
        "wrong public": (doc.replace('"public": "ed25519:', '"public": "x'), "does not match its private keys"),
    }
    for name, (text, pattern) in cases.items():
        with pytest.raises(IdentityError, match=pattern):
            load_identity(write(name.replace(" ", "_"), text))
    link = tmp_path / "link.key"
    link.symlink_to(path)
    with pytest.raises(IdentityError, match="cannot open identity file"):
        load_identity(link)


# ---------------------------------------------------------------------------------- public identity text


def test_public_identity_text_round_trip(ids):
    pub = ids["acme"].public()
    text = pub.to_text()
    assert text.startswith("ed25519:") and " x25519:" in text and len(text) == 8 + 44 + 1 + 7 + 44
    assert PublicIdentity.from_text(text) == pub and hash(PublicIdentity.from_text(text)) == hash(pub)
    assert pub != ids["beta"].public()


@pytest.mark.parametrize(("text", "pattern"), [
    ("", "expected 'ed25519:<base64> x25519:<base64>'"),
    ("ed25519:AAAA", "expected 'ed25519:<base64> x25519:<base64>'"),
    ("x25519:{b} ed25519:{b}", "expected 'ed25519:<base64> x25519:<base64>'"),
    ("ed25519:{b}  x25519:{b}", "expected"),
    ("ed25519:{b} x25519:{b} extra", "expected"),
    ("ed25519:{b}\nx25519:{b}", "expected"),
    ("ed25519:!!!! x25519:{b}", "ed25519 key: not valid base64"),
    ("ed25519:{b} x25519:AAAA", "x25519 key: 3 bytes, expected 32"),
    ("ed25519:{b}AAAA x25519:{b}", "ed25519 key: (not valid base64|\\d+ bytes)"),
    ("ed25519:{nc} x25519:{b}", "ed25519 key: not canonical base64"),
    (42, "expected text, got int"),
])
def test_public_identity_text_is_strict(text, pattern):
    b = "A" * 43 + "="
    nc = "A" * 42 + "B="  # same length, non-zero padding bits: decodes, but is not the canonical form
    if isinstance(text, str):
        text = text.format(b=b, nc=nc)
    with pytest.raises(IdentityError, match=pattern):
        PublicIdentity.from_text(text)


# ---------------------------------------------------------------------------------------------- rosters


def test_roster_round_trip(tmp_path, roster):
    numeric = generate_identity("123").public()  # one key per org: a shared key is refused (test_security_edges)
    path = save_roster(tmp_path / "roster.yaml", {**roster, "123": numeric})
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert load_roster(path) == {**roster, "123": numeric}  # "123" stays a string id
    assert load_roster(str(path)) == load_roster({o: p.to_text() for o, p in load_roster(path).items()})
    assert load_roster({"acme": roster["acme"]}) == {"acme": roster["acme"]}


def test_roster_errors_name_the_org_and_the_file(tmp_path, roster):
    path = tmp_path / "roster.yaml"
    path.write_text(f'acme: "{roster["acme"].to_text()}"\nbeta: "ed25519:AAAA x25519:AAAA"\n')
    with pytest.raises(IdentityError, match=rf"roster {path}: org 'beta': public identity: ed25519 key: 3 bytes"):
        load_roster(path)
    with pytest.raises(IdentityError, match=r"roster: org 'gamma': public identity: expected text, got int"):
        load_roster({"gamma": 5})
    bad_id = f'"a b": "{roster["acme"].to_text()}"'
    for text, pattern in [("", "no orgs|got NoneType"), ("- a\n- b\n", "expected a mapping"),
                          ("acme: [\n", "not valid YAML"), (bad_id, "not a valid org id")]:
        path.write_text(text)
        with pytest.raises(IdentityError, match=pattern):
            load_roster(path)
    with pytest.raises(IdentityError, match=r"cannot read roster .*nope.yaml"):
        load_roster(tmp_path / "nope.yaml")
    with pytest.raises(IdentityError, match="roster: no orgs"):
        load_roster({})


# ------------------------------------------------------------------------------------------- provisioning


def _tree(root: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(root)): (stat.S_IMODE(p.stat().st_mode), p.read_bytes() if p.is_file() else b"")
            for p in sorted(root.rglob("*"))}


def test_provision_layout_and_idempotence(tmp_path):
    keys = tmp_path / "run" / "keys"
    assert provision(keys, ORGS) == roster_path(keys) == keys / "roster.yaml"
    tree = _tree(keys)
    assert tree["identity"][0] == 0o700 and tree["roster.yaml"][0] == 0o644
    roster = load_roster(roster_path(keys))
    for org in ORGS:
        assert identity_path(keys, org) == keys / "identity" / f"{org}.key" and tree[f"identity/{org}.key"][0] == 0o600
        assert load_identity(identity_path(keys, org), org).public() == roster[org]
    assert provision(keys, ORGS) == roster_path(keys) and provision(keys, ORGS[:2]) == roster_path(keys)
    assert _tree(keys) == tree  # unchanged
    assert not [p for p in keys.parent.iterdir() if p.name != "keys"]  # no temp dirs left behind


def test_provision_refuses_an_incomplete_set_unless_overwrite(tmp_path):
    keys = tmp_path / "keys"
    provision(keys, ORGS[:2])
    with pytest.raises(IdentityError, match=r"incomplete key set .*org 'gamma'.*overwrite=True"):
        provision(keys, ORGS)
    identity_path(keys, "beta").unlink()
    with pytest.raises(IdentityError, match=r"incomplete key set .*beta\.key"):
        provision(keys, ORGS[:2])
    old = load_roster(roster_path(keys))
    provision(keys, ORGS, overwrite=True)
    new = load_roster(roster_path(keys))
    assert set(new) == set(ORGS) and new["acme"] != old["acme"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys"]


def test_provision_validates_org_ids(tmp_path):
    for orgs, pattern in [([], "no orgs"), (["acme", "acme"], "duplicate"), (["../x"], "not a valid org id"),
                          (["a b"], "not a valid org id")]:
        with pytest.raises(IdentityError, match=pattern):
            provision(tmp_path / "keys", orgs)
    with pytest.raises(IdentityError, match="not a valid org id"):
        identity_path(tmp_path, "../../etc/passwd")


def test_provision_into_an_existing_empty_directory(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    provision(keys, ORGS)
    assert set(load_roster(roster_path(keys))) == set(ORGS)


def test_provision_loser_of_a_race_adopts_the_winners_set(tmp_path, monkeypatch):
    """Deterministic race: another process installs its set between our build and our rename."""
    keys = tmp_path / "keys"
    real_rename = os.rename
    winner: list[dict] = []

    def rename(src, dst):
        if Path(dst) == keys and not winner:
            winner.append({})
            provision(keys, ORGS)  # the winner (its own rename goes through)
            winner[0] = _tree(keys)
        return real_rename(src, dst)  # the loser's rename then fails: keys/ is not empty

    monkeypatch.setattr(ident.os, "rename", rename)
    assert provision(keys, ORGS) == roster_path(keys)
    assert winner and _tree(keys) == winner[0]  # the loser kept the winner's set as it was
    for org in ORGS:
        assert load_identity(identity_path(keys, org), org).public() == load_roster(roster_path(keys))[org]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys"]  # the loser's temp set is gone


def _provision_in_child(barrier, keys: str, queue) -> None:
    barrier.wait(timeout=20)
    path = provision(keys, ORGS)
    queue.put(Path(path).read_text())


def test_provision_is_safe_with_concurrent_processes(tmp_path):
    ctx = multiprocessing.get_context("fork")
    for attempt in range(3):
        keys = tmp_path / f"keys{attempt}"
        barrier, queue = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_provision_in_child, args=(barrier, str(keys), queue)) for _ in range(4)]
        for p in procs:
            p.start()
        rosters = [queue.get(timeout=30) for _ in procs]
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        assert len(set(rosters)) == 1 and rosters[0] == roster_path(keys).read_text()
        roster = load_roster(roster_path(keys))
        for org in ORGS:
            assert load_identity(identity_path(keys, org), org).public() == roster[org]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keys0", "keys1", "keys2"]
