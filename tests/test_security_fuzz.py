"""Property-based fuzzing of the trust boundary: every wire decoder, envelope verification and sealed-batch opening.

Properties (hypothesis, derandomized, so every run checks the same cases):

* ``codec.decode`` of any message kind, on arbitrary bytes and on mutated valid encodings, returns or raises
  ``WireError``: nothing else;
* ``verify_batch`` on arbitrary bytes, and on valid (plain and sealed) envelopes with random byte flips,
  overwrites, insertions, deletions, truncations and extensions, raises only ``RejectedBatch``, and accepts a
  mutated envelope only when the mutation left the bytes unchanged;
* ``open_batch`` on mutated sealed batches raises only ``RejectedBatch`` and, when it succeeds, every opened
  rollout holds exactly the text its sender sealed at that position.

Generated cases (max_examples x parametrizations; each test reaches its max_examples, as
``--hypothesis-show-statistics`` shows):
  arbitrary bytes per kind      19 kinds x 250 =  4,750
  mutated encodings per kind    19 kinds x 200 =  3,800
  verify_batch on bytes                        =  1,000
  verify_batch on mutations  2 envelopes x 2000 =  4,000
  open_batch on mutations                      =  2,000
  open_batch on forged seals                   =    500
  total                                        = 16,050   (about 20 s on one core)
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hacrl_fed import types as t
from hacrl_fed.security import sealing
from hacrl_fed.security.envelope import RejectedBatch, sign_batch, verify_batch
from hacrl_fed.security.identity import OrgIdentity
from hacrl_fed.security.sealing import open_batch, seal_batch
from hacrl_fed.v1 import worker_pb2 as pb
from hacrl_fed.wire import codec
from hacrl_fed.wire.codec import WireError

RUN, ROUND = "fuzz-run", 5
TEXTS = ("42", "Ünïcödé 数学 🚀", "", "a longer answer: \\boxed{7}")
KINDS = sorted(pb.DESCRIPTOR.message_types_by_name)

N_BYTES_PER_KIND = 250
N_MUTATED_PER_KIND = 200
N_VERIFY_BYTES = 1_000
N_VERIFY_MUTATED = 2_000
N_OPEN_MUTATED = 2_000
N_OPEN_FORGED = 500
TOTAL = (len(KINDS) * (N_BYTES_PER_KIND + N_MUTATED_PER_KIND) + N_VERIFY_BYTES + 2 * N_VERIFY_MUTATED
         + N_OPEN_MUTATED + N_OPEN_FORGED)


def _fuzz(n: int):
    return settings(max_examples=n, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --------------------------------------------------------------------------------- deterministic fixtures


def _identity(org: str, seed: int) -> OrgIdentity:
    return OrgIdentity(org, Ed25519PrivateKey.from_private_bytes(bytes([seed]) * 32),
                       X25519PrivateKey.from_private_bytes(bytes([seed + 100]) * 32))


IDS = {org: _identity(org, i + 1) for i, org in enumerate(("acme", "beta", "gamma"))}
ROSTER = {org: i.public() for org, i in IDS.items()}


def _batch() -> t.RolloutBatch:
    rollouts = tuple(t.Rollout("acme", ROUND, 3 + i, i % 2, text, t.FINISH_LENGTH, 0.25 * i, -2.5 * i, 3 * i)
                     for i, text in enumerate(TEXTS))
    return t.RolloutBatch(RUN, ROUND, "acme", rollouts, accuracy=0.375, metrics={"time/generate": 0.5})


def _deterministic_seal(batch: t.RolloutBatch) -> t.RolloutBatch:
    """seal_batch with its randomness (content key, ephemeral keys) pinned, so the fuzzed bytes never vary."""
    counter = iter(range(200, 256))

    class _Ephemeral:
        @staticmethod
        def generate() -> X25519PrivateKey:
            return X25519PrivateKey.from_private_bytes(bytes([next(counter)]) * 32)

    with mock.patch.object(sealing.os, "urandom", lambda n: bytes(range(n))), \
            mock.patch.object(sealing, "X25519PrivateKey", _Ephemeral):
        return seal_batch(batch, {"beta": ROSTER["beta"], "gamma": ROSTER["gamma"]})


PLAIN_ENVELOPE = sign_batch(_batch(), IDS["acme"])
SEALED_BATCH = _deterministic_seal(_batch())
SEALED_ENVELOPE = sign_batch(SEALED_BATCH, IDS["acme"])
ENVELOPES = {"plain": PLAIN_ENVELOPE, "sealed": SEALED_ENVELOPE}


def _valid_encodings() -> dict[str, bytes]:
    """One valid encoding of every message kind (the nested ones hold the sealed batch's parts)."""
    batch = codec.decode(t.RolloutBatch, SEALED_ENVELOPE)
    prompt = t.Prompt(9, (t.ChatMessage("system", "Be brief."), t.ChatMessage("user", "2+2?")), "4")
    sampling = t.SamplingParams(0.7, 0.9, 5, 16, 4, 123)
    objects = [
        prompt.messages[1], prompt, sampling, batch.rollouts[1], batch.wrapped_keys[0], batch,
        t.RoundPlan(RUN, ROUND, "arithmetic", (prompt,), sampling),
        t.TrainRequest(RUN, ROUND, "beta", (prompt,), (batch.rollouts[0],), {"acme": 0.5}, source_batches=(batch,)),
        t.TrainReport(RUN, ROUND, "beta", {"hacpo/loss": 0.25}),
        t.EvalRequest(RUN, ROUND, "arithmetic", (prompt,), 8),
        t.EvalReport(RUN, ROUND, "beta", 0.5, 2, {"eval/x": 1.0}),
    ]
    objects += [  # the fused round: a train request with the next plan, a report with the next (sealed) batch
        t.StepRequest(train=objects[7], plan=dataclasses.replace(objects[6], round=ROUND + 1)),
        t.StepReply(report=objects[8], batch=batch, train_error="", generate_error=""),
    ]
    out = {type(o).__name__: codec.encode(o) for o in objects}
    out["HealthRequest"] = codec.encode(codec.health_request())
    out["HealthReply"] = codec.encode(codec.health_reply_to_proto({"org_id": "beta", "status": "ok"}))
    out["CheckpointRequest"] = codec.encode(codec.checkpoint_request_to_proto(ROUND))
    out["CheckpointReply"] = codec.encode(codec.checkpoint_reply_to_proto("/ckpt/beta/round-5"))
    out["CapabilityTable"] = codec.encode(pb.CapabilityTable(capability={"acme": 0.5, "beta": 1.0}))
    out["BatchTag"] = codec.encode(pb.BatchTag(source="acme", round=ROUND, version=2))
    return out


VALID = _valid_encodings()


def test_fixtures_cover_every_kind_and_are_valid():
    assert sorted(VALID) == KINDS and len(KINDS) == 19 and TOTAL == 16_050
    for kind, data in VALID.items():
        codec.decode(kind, data)
    assert verify_batch(SEALED_ENVELOPE, ROSTER, run_id=RUN, round=ROUND) == codec.decode(t.RolloutBatch,
                                                                                          SEALED_ENVELOPE)
    assert [r.response for r in open_batch(SEALED_BATCH, "beta", IDS["beta"].box_key).rollouts] == list(TEXTS)
    assert SEALED_ENVELOPE == sign_batch(_deterministic_seal(_batch()), IDS["acme"])  # deterministic


# ----------------------------------------------------------------------------------------------- mutations


def _op(data: st.DataObject, buf: bytearray) -> None:
    """Apply one random edit to ``buf`` in place."""
    kind = data.draw(st.sampled_from(("flip", "set", "insert", "delete", "truncate", "extend")))
    n = len(buf)
    if kind in ("flip", "set") and n:
        i = data.draw(st.integers(0, n - 1))
        buf[i] = buf[i] ^ (1 << data.draw(st.integers(0, 7))) if kind == "flip" else data.draw(st.integers(0, 255))
    elif kind == "insert":
        i = data.draw(st.integers(0, n))
        buf[i:i] = data.draw(st.binary(min_size=1, max_size=8))
    elif kind == "delete" and n:
        i = data.draw(st.integers(0, n - 1))
        del buf[i:i + data.draw(st.integers(1, 8))]
    elif kind == "truncate":
        del buf[data.draw(st.integers(0, n)):]
    elif kind == "extend":
        buf.extend(data.draw(st.binary(min_size=1, max_size=16)))


def _mutate(data: st.DataObject, original: bytes) -> bytes:
    buf = bytearray(original)
    for _ in range(data.draw(st.integers(1, 3))):
        _op(data, buf)
    return bytes(buf)


# ------------------------------------------------------------------------------------------------ decoders


@pytest.mark.parametrize("kind", KINDS)
@_fuzz(N_BYTES_PER_KIND)
@given(blob=st.binary(max_size=400))
def test_decode_arbitrary_bytes_raises_only_wire_errors(kind, blob):
    try:
        codec.decode(kind, blob)
    except WireError:
        pass


@pytest.mark.parametrize("kind", KINDS)
@_fuzz(N_MUTATED_PER_KIND)
@given(data=st.data())
def test_decode_mutated_encodings_raises_only_wire_errors(kind, data):
    mutated = _mutate(data, VALID[kind])
    try:
        obj = codec.decode(kind, mutated)
    except WireError:
        return
    if kind in ("RolloutBatch", "TrainRequest", "Rollout", "WrappedKey", "RoundPlan"):
        codec.encode(obj)  # whatever decodes also encodes again (no half-valid objects)


# ---------------------------------------------------------------------------------------------- envelopes


@_fuzz(N_VERIFY_BYTES)
@given(blob=st.one_of(st.binary(max_size=600), st.binary(max_size=40).map(lambda b: PLAIN_ENVELOPE[:60] + b)))
def test_verify_arbitrary_bytes_is_always_rejected(blob):
    with pytest.raises(RejectedBatch):
        verify_batch(blob, ROSTER, run_id=RUN, round=ROUND)


@pytest.mark.parametrize("which", sorted(ENVELOPES))
@_fuzz(N_VERIFY_MUTATED)
@given(data=st.data())
def test_no_mutated_envelope_is_ever_accepted(which, data):
    original = ENVELOPES[which]
    mutated = _mutate(data, original)
    if mutated == original:  # e.g. "set" wrote the same byte back
        assert verify_batch(mutated, ROSTER, run_id=RUN, round=ROUND) == codec.decode(t.RolloutBatch, original)
        return
    with pytest.raises(RejectedBatch) as info:
        verify_batch(mutated, ROSTER, run_id=RUN, round=ROUND)
    assert info.value.reason in ("malformed", "bad_signature", "unknown_org", "wrong_run", "wrong_round")


# ------------------------------------------------------------------------------------------------ opening


@_fuzz(N_OPEN_MUTATED)
@given(data=st.data())
def test_open_mutated_sealed_batches(data):
    """Skipping the signature check on purpose: opening alone never yields text the sender did not seal there."""
    try:
        batch = codec.decode(t.RolloutBatch, _mutate(data, SEALED_ENVELOPE))
    except WireError:
        return
    recipient = data.draw(st.sampled_from(("beta", "gamma", "acme")))
    try:
        opened = open_batch(batch, recipient, IDS[recipient].box_key)
    except RejectedBatch as err:
        assert err.reason in ("undecryptable", "malformed")
        return
    assert recipient != "acme" or not sealing.is_sealed(batch)
    for i, r in enumerate(opened.rollouts):
        if sealing.is_sealed(batch):
            assert r.response == TEXTS[i] and r.sealed_response == b""


_wrapped = st.builds(t.WrappedKey, st.sampled_from(("beta", "gamma", "x")), st.binary(min_size=32, max_size=32),
                     st.binary(max_size=64))


@_fuzz(N_OPEN_FORGED)
@given(sealed=st.lists(st.binary(max_size=48), min_size=0, max_size=4), keys=st.lists(_wrapped, max_size=3),
       real_key=st.booleans())
def test_open_forged_seals_is_always_rejected(sealed, keys, real_key):
    """Random ciphertext under a real or random wrapped key never opens (AEAD tags are unforgeable)."""
    base = SEALED_BATCH
    rollouts = tuple(dataclasses.replace(base.rollouts[i], sealed_response=s) for i, s in enumerate(sealed))
    wrapped = (base.wrapped_keys[0], *keys) if real_key else tuple(keys)
    batch = dataclasses.replace(base, rollouts=rollouts, wrapped_keys=wrapped)
    if not sealing.is_sealed(batch):
        assert open_batch(batch, "beta", IDS["beta"].box_key) is batch
        return
    try:
        opened = open_batch(batch, "beta", IDS["beta"].box_key)
    except RejectedBatch as err:
        assert err.reason == "undecryptable"
        return
    assert real_key and not rollouts and opened.rollouts == ()  # the real key, but nothing to decrypt
