"""The asynchronous-rounds fields on the wire (hacrl_fed/wire/codec.py, proto TrainRequest 13-15, RolloutBatch
16-17): they round-trip, signatures cover them, lock-step messages are byte-for-byte as before, and hostile values
(a round outside the receiver's window, too many batches or tags, a non-finite capability, a negative version, a
second tag of one (source, round)) are refused with a WireError naming the field."""

from __future__ import annotations

import dataclasses
import math

import pytest

from helpers_fake_workers import fake_config
from hacrl_fed.security.envelope import sign_batch, signed, verify_batch
from hacrl_fed.security.identity import generate_identity
from hacrl_fed.types import Rollout, RolloutBatch, TrainRequest
from hacrl_fed.v1 import worker_pb2 as pb
from hacrl_fed.wire import codec
from hacrl_fed.wire.bounds import max_request_bytes, worker_limits
from hacrl_fed.wire.codec import WireError, WireLimits

B = fake_config(("a", "b", "c"), staleness=1, window=2)  # W = 2, two other orgs: at most 4 batches and tags
LIMITS = worker_limits(B)
ID = generate_identity("b")


def _batch(src="b", rnd=3, version=2):
    rollouts = tuple(Rollout(src, rnd, p, 0, str(p), "stop", 1.0, -1.0, 3) for p in (1, 2))
    batch = RolloutBatch(
        "run", rnd, src, rollouts, 1.0, plan_digest=b"d" * 32, version=version, plan_challenges={"a": b"\x01" * 32}
    )
    return signed(batch, ID.sign_key) if src == "b" else batch


def _request(rnd=4, **kw):
    fields = {
        "source_batches": (_batch("b", 3), _batch("c", 4, 1)),
        "round_capability": {3: {"a": 0.5, "b": 0.25}, 4: {"a": 0.5, "b": 0.5, "c": 1.0}},
        "tags": (("b", 3, 2), ("c", 4, 1)),
        "version": 3,
        **kw,
    }
    return TrainRequest("run", rnd, "a", (), (), {"a": 0.5, "b": 0.5, "c": 1.0}, **fields)


def test_the_worker_limits_follow_the_config():
    assert (LIMITS.window, LIMITS.max_sources, LIMITS.skip_unsigned_foreign) == (2, 2, False)
    lock_step = worker_limits(fake_config(("a", "b", "c")))
    assert (lock_step.window, lock_step.max_sources) == (None, None)
    sync, two = fake_config(("a", "b", "c")), fake_config(("a", "b", "c"), staleness=1)  # W = 2: batches twice
    assert max_request_bytes(two, "a") > max_request_bytes(sync, "a")


def test_an_asynchronous_train_request_round_trips_and_its_batches_still_verify():
    req = _request()
    back = codec.decode("TrainRequest", codec.encode(req), limits=LIMITS)
    assert back == req
    envelope = sign_batch(_batch(), ID)
    got = verify_batch(envelope, {"b": ID.public()}, run_id="run", round=3)
    assert (got.version, got.plan_challenges) == (2, {"a": b"\x01" * 32})
    forged = pb.RolloutBatch.FromString(envelope)
    forged.version = 3  # the signed version changed in transit
    with pytest.raises(ValueError, match="bad signature"):
        verify_batch(forged.SerializeToString(deterministic=True), {"b": ID.public()}, run_id="run", round=3)


def test_lock_step_messages_are_unchanged():
    """The new fields are zero / empty in lock-step rounds, so nothing of them is on the wire."""
    plain = TrainRequest("run", 4, "a", (), (), {"a": 1.0}, (dataclasses.replace(_batch(), version=0,
                                                                                plan_challenges={}),))  # fmt: skip
    msg = pb.TrainRequest.FromString(codec.encode(plain))
    assert {f.name for f, _ in msg.ListFields()} == {"schema_version", "run_id", "round", "org_id", "capability",
                                                     "source_batches"}  # fmt: skip
    assert {f.name for f, _ in msg.source_batches[0].ListFields()} & {"version", "plan_challenges"} == set()
    assert codec.decode("TrainRequest", codec.encode(plain)) == plain


@pytest.mark.parametrize(
    "change,field",
    [
        ({"tags": (("b", 2, 2),)}, r"tags\[0\]\.round: round 2 outside the window \[3, 4\]"),
        ({"tags": (("b", 5, 2),)}, r"tags\[0\]\.round: round 5 outside"),
        ({"round_capability": {1: {"a": 1.0}}}, r"round_capability key: round 1 outside"),
        ({"source_batches": (_batch("b", 2),)}, r"source_batches\[0\]\.round: round 2 outside"),
        ({"source_batches": (_batch("b", 3),) * 5}, r"source_batches: 5 batches exceed the cap of 4"),
        ({"tags": tuple((f"o{i}", 4, 1) for i in range(5))}, r"tags: 5 tags exceed the cap of 4"),
        ({"tags": (("b", 3, 2), ("b", 3, 1))}, r"tags\[1\]: a second tag for \('b', 3\)"),
        ({"tags": (("b", 3, -1),)}, r"tags\[0\]\.version: -1 is below the minimum 0"),
        ({"tags": (("", 3, 1),)}, r"tags\[0\]\.source: must not be empty"),
        ({"round_capability": {4: {"a": math.nan}}}, r"round_capability\[4\]\['a'\]: non-finite value nan"),
        ({"round_capability": {4: {"a": -0.5}}}, r"round_capability\[4\]\['a'\]: -0.5 outside"),
        ({"version": -2}, r"TrainRequest\.version: -2 is below the minimum 0"),
    ],
)
def test_hostile_asynchronous_fields_are_refused_naming_the_field(change, field):
    data = codec.encode(_request(**change))
    with pytest.raises(WireError, match=field):
        codec.decode("TrainRequest", data, limits=LIMITS)


def test_without_a_window_rounds_are_still_bounded_by_the_request_s_round():
    with pytest.raises(WireError, match=r"round 5 outside the window \[0, 4\]"):
        codec.decode("TrainRequest", codec.encode(_request(tags=(("b", 5, 1),))), limits=WireLimits())
    assert codec.decode("TrainRequest", codec.encode(_request(tags=(("b", 1, 1),)))).tags == (("b", 1, 1),)


def test_a_batch_s_version_and_plan_challenges_are_bounded():
    with pytest.raises(WireError, match=r"RolloutBatch\.plan_challenges\['a'\]: 65 bytes exceed"):
        codec.decode("RolloutBatch", codec.encode(dataclasses.replace(_batch("c"), plan_challenges={"a": b"x" * 65})))
    msg = pb.RolloutBatch.FromString(codec.encode(_batch("c")))
    msg.version = -1
    with pytest.raises(WireError, match=r"RolloutBatch\.version: -1 is below the minimum 0"):
        codec.decode("RolloutBatch", msg.SerializeToString())
    with pytest.raises(WireError):  # the in-process check a signature verification runs agrees with decoding
        bad = dataclasses.replace(_batch("c"), version=-1)
        codec.check_batch(bad, codec.encode(bad))
