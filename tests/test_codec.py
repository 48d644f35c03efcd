"""hacrl_fed.wire.codec: exact round trips for every protocol type, deterministic bytes, and decode-time hygiene."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hacrl_fed import types as t
from hacrl_fed.v1 import worker_pb2 as pb
from hacrl_fed.wire import codec
from hacrl_fed.wire.codec import WireError, WireLimits

UNICODE = "Ünïcödé ✓ 数学 🚀 \u0301e\u200d \\boxed{42} \"quoted\" \n\t end"


def _prompt(pid: int = 7) -> t.Prompt:
    return t.Prompt(
        prompt_id=pid,
        messages=(t.ChatMessage("system", "Be brief."), t.ChatMessage("user", f"Solve {UNICODE}")),
        reference="42",
    )


def _rollout(i: int = 0, org: str = "acme") -> t.Rollout:
    return t.Rollout(
        org_id=org, round=3, prompt_id=7, sample_index=i, response=f"answer {i}: {UNICODE}",
        finish_reason=t.FINISH_STOP if i % 2 == 0 else t.FINISH_LENGTH, reward=[0.0, 1.0, 0.1][i % 3],
        logprob_sum=-123.456789012345678 * (i + 1), token_count=17 + i,
    )


def _sealed_batch() -> t.RolloutBatch:
    """A batch shaped like a sealed one (the codec checks shapes only; the bytes need not decrypt)."""
    rollouts = tuple(replace(_rollout(i), response="", sealed_response=bytes([i]) * (20 + i)) for i in range(3))
    keys = (
        t.WrappedKey("beta", bytes(range(32)), b"\x01" * 48),
        t.WrappedKey("gamma", b"\xff" * 32, b""),
        t.WrappedKey("ünï", bytes(32), b"\x02" * 128),
    )
    return t.RolloutBatch(run_id="run-1", round=3, org_id="acme", rollouts=rollouts, accuracy=0.5,
                          signature=b"\x07" * 64, wrapped_keys=keys)


def _samples() -> list[object]:
    """One instance of every dataclass, including empty collections and awkward floats."""
    sampling = t.SamplingParams(temperature=0.7, top_p=0.95, top_k=50, max_new_tokens=128, num_samples=4, seed=2**62)
    return [
        t.ChatMessage("assistant", UNICODE),
        t.ChatMessage("user", ""),
        _prompt(),
        t.Prompt(prompt_id=0, messages=(), reference=""),
        sampling,
        t.SamplingParams(),
        t.RoundPlan(run_id="run-1", round=3, task="arithmetic", prompts=(_prompt(1), _prompt(2)), sampling=sampling),
        t.RoundPlan(run_id="", round=0, task="", prompts=(), sampling=t.SamplingParams()),
        _rollout(0),
        replace(_rollout(1), logprob_sum=-5e-324, response=""),  # subnormal survives exactly
        t.RolloutBatch(
            run_id="run-1", round=3, org_id="acme", rollouts=tuple(_rollout(i) for i in range(5)), accuracy=0.4,
            metrics={"time/generate": 1.25, "gen/len_mean": 33.0, "ünï/cödé": -1e300}, signature=bytes(range(64)),
        ),
        t.RolloutBatch(run_id="r", round=0, org_id="b", rollouts=(), accuracy=0.0),
        t.TrainRequest(
            run_id="run-1", round=3, org_id="acme", prompts=(_prompt(),),
            foreign=(_rollout(0, "beta"), _rollout(1, "gamma")), capability={"acme": 0.25, "beta": 1.0, "gamma": 0.0},
        ),
        t.TrainRequest(run_id="r", round=1, org_id="acme", prompts=(), foreign=(), capability={}),
        t.TrainReport(run_id="run-1", round=3, org_id="acme", metrics={"hacpo/loss": -0.0123, "train/grad_norm": 3.5}),
        t.TrainReport(run_id="run-1", round=3, org_id="acme"),
        t.EvalRequest(run_id="run-1", round=3, task="arithmetic", prompts=(_prompt(),), max_new_tokens=32),
        t.EvalReport(run_id="run-1", round=3, org_id="acme", accuracy=1.0, num_prompts=200, metrics={"eval/x": 0.5}),
        t.EvalReport(run_id="run-1", round=0, org_id="acme", accuracy=0.0, num_prompts=0),
        # end-to-end encryption fields (shapes only; hacrl_fed.security makes real ones)
        _sealed_batch(),
        t.WrappedKey("beta", bytes(range(32)), b"\x00" * 48),
        replace(_rollout(2), response="", sealed_response=b"\x00\xff" * 40),
        t.TrainRequest(
            run_id="run-1", round=3, org_id="beta", prompts=(_prompt(),), foreign=(), capability={"acme": 0.5},
            source_batches=(_sealed_batch(), t.RolloutBatch("run-1", 3, "gamma", (_rollout(0, "gamma"),), 1.0)),
        ),
        # replay protection (hacrl_fed.security.freshness): challenges, the plan digest a batch signs
        t.RoundPlan("run-1", 3, "arithmetic", (_prompt(1),), sampling, challenges={"acme": b"\x01" * 32, "b": b""}),
        t.RolloutBatch("run-1", 3, "acme", (_rollout(0),), 1.0, plan_digest=bytes(range(32))),
        t.TrainReport("run-1", 3, "acme", {"train/loss": 0.5}, challenge=b"\xff" * 32),
    ]


def _first(cls: type) -> object:
    return next(o for o in _samples() if type(o) is cls)


@pytest.mark.parametrize("obj", _samples(), ids=lambda o: type(o).__name__)
def test_round_trip_is_exact(obj):
    msg = codec.to_proto(obj)
    assert type(msg).DESCRIPTOR.name == type(obj).__name__
    assert codec.from_proto(msg) == obj
    data = codec.encode(obj)
    for kind in (type(obj), type(obj).__name__, type(msg)):
        back = codec.decode(kind, data)
        assert back == obj and type(back) is type(obj)


def test_decoded_sequences_are_tuples_and_maps_plain_dicts():
    batch = codec.decode(t.RolloutBatch, codec.encode(_first(t.RolloutBatch)))
    assert isinstance(batch.rollouts, tuple) and type(batch.metrics) is dict
    assert batch.rollouts[1].mean_log_prob == _rollout(1).mean_log_prob


def test_top_level_messages_are_stamped_with_schema_version():
    for obj in _samples():
        msg = codec.to_proto(obj)
        if "schema_version" in type(msg).DESCRIPTOR.fields_by_name:
            assert msg.schema_version == codec.SCHEMA_VERSION


def test_encoding_is_deterministic_whatever_the_dict_order():
    a = t.TrainReport("r", 1, "acme", metrics={"a": 1.0, "b": 2.0, "c": 3.0})
    b = t.TrainReport("r", 1, "acme", metrics={"c": 3.0, "a": 1.0, "b": 2.0})
    assert codec.encode(a) == codec.encode(b)


def test_health_and_checkpoint_messages_round_trip():
    info = {"org_id": "acme", "status": "ok", "round": "12", "note": UNICODE}
    assert codec.decode("HealthReply", codec.encode(codec.health_reply_to_proto(info))) == info
    assert codec.decode("HealthRequest", codec.encode(codec.health_request())) is None
    assert codec.decode("CheckpointRequest", codec.encode(codec.checkpoint_request_to_proto(12))) == 12
    path = "/ckpt/acme/round-000012"
    assert codec.decode(pb.CheckpointReply, codec.encode(codec.checkpoint_reply_to_proto(path))) == path


@settings(max_examples=150, deadline=None)
@given(
    response=st.text(max_size=200),
    reward=st.floats(0.0, 1.0),
    logprob=st.floats(allow_nan=False, allow_infinity=False),
    tokens=st.integers(0, 2**63 - 1),
    org=st.text(min_size=1, max_size=30),
)
def test_rollout_round_trip_property(response, reward, logprob, tokens, org):
    r = t.Rollout(org, 2, 5, 1, response, t.FINISH_LENGTH, reward, logprob, tokens)
    back = codec.decode(t.Rollout, codec.encode(r))
    assert back == r and math.copysign(1.0, back.reward) == math.copysign(1.0, reward)  # -0.0 kept


# -------------------------------------------------------------------------------------------- decode hygiene


def _batch_msg() -> pb.RolloutBatch:
    return codec.to_proto(_first(t.RolloutBatch))


def _set(path: str, value):
    """A mutator setting attribute ``path`` (dots; ``[i]`` indexes a repeated field) on a message."""

    def mutate(msg):
        *parents, leaf = path.split(".")
        for part in parents:
            name, _, idx = part.partition("[")
            msg = getattr(msg, name)
            if idx:
                msg = msg[int(idx[:-1])]
        setattr(msg, leaf, value)

    return mutate


BATCH_CASES = [
    (_set("rollouts[1].reward", 1.5), r"RolloutBatch\.rollouts\[1\]\.reward: 1\.5 outside \[0, 1\]"),
    (_set("rollouts[2].reward", -0.01), r"rollouts\[2\]\.reward: -0\.01 outside"),
    (_set("rollouts[0].reward", math.nan), r"rollouts\[0\]\.reward: non-finite value nan"),
    (_set("rollouts[0].logprob_sum", -math.inf), r"rollouts\[0\]\.logprob_sum: non-finite value -inf"),
    (_set("rollouts[3].token_count", -1), r"rollouts\[3\]\.token_count: -1 is below the minimum 0"),
    (_set("rollouts[0].prompt_id", -4), r"rollouts\[0\]\.prompt_id: -4 is below"),
    (_set("rollouts[0].finish_reason", 0), r"rollouts\[0\]\.finish_reason: unknown value 0"),
    (_set("rollouts[0].finish_reason", 9), r"rollouts\[0\]\.finish_reason: unknown value 9"),
    (_set("rollouts[4].org_id", ""), r"rollouts\[4\]\.org_id: must not be empty"),
    (_set("accuracy", math.inf), r"RolloutBatch\.accuracy: non-finite value inf"),
    (_set("accuracy", 1.0000001), r"RolloutBatch\.accuracy: 1\.0000001 outside"),
    (_set("round", -1), r"RolloutBatch\.round: -1 is below"),
    (_set("org_id", ""), r"RolloutBatch\.org_id: must not be empty"),
    (_set("schema_version", 0), r"RolloutBatch\.schema_version: missing"),
    (_set("schema_version", 2), r"RolloutBatch\.schema_version: 2 is newer than the supported 1"),
    (_set("signature", b"x" * 1025), r"RolloutBatch\.signature: 1025 bytes exceed the cap of 1024"),
    (lambda m: m.metrics.__setitem__("time/x", math.nan), r"RolloutBatch\.metrics\['time/x'\]: non-finite"),
    (lambda m: m.metrics.__setitem__("", 1.0), r"RolloutBatch\.metrics key '': must not be empty"),
]


@pytest.mark.parametrize(("mutate", "pattern"), BATCH_CASES)
def test_decode_rejects_bad_batch_fields(mutate, pattern):
    msg = _batch_msg()
    mutate(msg)
    data = msg.SerializeToString()
    with pytest.raises(WireError, match=pattern):
        codec.decode(t.RolloutBatch, data)


def _sealed_msg() -> pb.RolloutBatch:
    return codec.to_proto(_sealed_batch())


SEALED_CASES = [
    (_set("rollouts[1].response", "leak"), r"RolloutBatch\.rollouts\[1\]: both response and sealed_response"),
    (_set("wrapped_keys[1].ephemeral_public", b"x" * 31),
     r"RolloutBatch\.wrapped_keys\[1\]\.ephemeral_public: 31 bytes, expected 32"),
    (_set("wrapped_keys[0].ephemeral_public", b""), r"wrapped_keys\[0\]\.ephemeral_public: 0 bytes, expected 32"),
    (_set("wrapped_keys[0].ephemeral_public", b"x" * 33), r"wrapped_keys\[0\]\.ephemeral_public: 33 bytes"),
    (_set("wrapped_keys[2].wrapped", b"x" * 129), r"wrapped_keys\[2\]\.wrapped: 129 bytes exceed the cap of 128"),
    (_set("wrapped_keys[0].recipient", ""), r"wrapped_keys\[0\]\.recipient: must not be empty"),
    (_set("wrapped_keys[2].recipient", "beta"), r"wrapped_keys\[2\]\.recipient: duplicate recipient 'beta'"),
    (_set("wrapped_keys[0].recipient", "x" * 257), r"wrapped_keys\[0\]\.recipient: 257 characters exceed"),
]


@pytest.mark.parametrize(("mutate", "pattern"), SEALED_CASES)
def test_decode_rejects_bad_sealed_fields(mutate, pattern):
    msg = _sealed_msg()
    mutate(msg)
    with pytest.raises(WireError, match=pattern):
        codec.decode(t.RolloutBatch, msg.SerializeToString())


def test_sealed_caps_are_configurable():
    data = codec.encode(_sealed_batch())
    with pytest.raises(WireError, match=r"RolloutBatch\.wrapped_keys: 3 entries exceed the cap of 2"):
        codec.decode(t.RolloutBatch, data, limits=WireLimits(max_recipients=2))
    assert codec.decode(t.RolloutBatch, data, limits=WireLimits(max_recipients=3)) == _sealed_batch()
    # sealed text may exceed max_text_chars by 64 bytes (the AEAD tag and room to spare), no more
    rollout = replace(_rollout(), response="", sealed_response=b"\x00" * 75)
    with pytest.raises(WireError, match=r"Rollout\.sealed_response: 75 bytes exceed the cap of 74"):
        codec.decode(t.Rollout, codec.encode(rollout), limits=WireLimits(max_text_chars=10))
    assert codec.decode(t.Rollout, codec.encode(rollout), limits=WireLimits(max_text_chars=11)) == rollout


def test_source_batches_are_checked_like_batches():
    req = codec.to_proto(_first(t.TrainRequest))
    req.source_batches.append(_sealed_msg())
    req.source_batches[0].rollouts[1].reward = 2.0
    with pytest.raises(WireError, match=r"TrainRequest\.source_batches\[0\]\.rollouts\[1\]\.reward: 2\.0 outside"):
        codec.from_proto(req)
    req = codec.to_proto(_first(t.TrainRequest))
    req.source_batches.append(_sealed_msg())
    req.source_batches[0].wrapped_keys[0].ephemeral_public = b""
    with pytest.raises(WireError, match=r"TrainRequest\.source_batches\[0\]\.wrapped_keys\[0\]\.ephemeral_public"):
        codec.from_proto(req)
    req = codec.to_proto(_first(t.TrainRequest))
    req.source_batches.append(_sealed_msg())
    req.source_batches[0].schema_version = 0
    with pytest.raises(WireError, match=r"TrainRequest\.source_batches\[0\]\.schema_version: missing"):
        codec.from_proto(req)
    data = codec.encode(t.TrainRequest("r", 1, "a", (), (), {}, source_batches=(_sealed_batch(),) * 3))
    with pytest.raises(WireError, match=r"TrainRequest\.source_batches: 3 entries exceed the cap of 2"):
        codec.decode(t.TrainRequest, data, limits=WireLimits(max_items=2))


def test_source_batches_keep_their_bytes_verbatim():
    """A forwarded batch re-encodes to exactly the bytes its source produced (so its signature still checks)."""
    batch = _sealed_batch()
    req = codec.decode(t.TrainRequest, codec.encode(t.TrainRequest("r", 1, "beta", (), (), {}, (batch, batch))))
    assert [codec.encode(b) for b in req.source_batches] == [codec.encode(batch)] * 2


def _plan_msg() -> pb.RoundPlan:
    return codec.to_proto(_first(t.RoundPlan))


PLAN_CASES = [
    (_set("sampling.top_p", 0.0), r"RoundPlan\.sampling\.top_p: 0\.0 outside \(0, 1\]"),
    (_set("sampling.top_p", 1.5), r"sampling\.top_p: 1\.5 outside"),
    (_set("sampling.temperature", -1.0), r"sampling\.temperature: -1\.0 outside"),
    (_set("sampling.temperature", math.nan), r"sampling\.temperature: non-finite"),
    (_set("sampling.max_new_tokens", 0), r"sampling\.max_new_tokens: 0 is below the minimum 1"),
    (_set("sampling.num_samples", 0), r"sampling\.num_samples: 0 is below the minimum 1"),
    (_set("sampling.top_k", -1), r"sampling\.top_k: -1 is below"),
    (lambda m: m.ClearField("sampling"), r"RoundPlan\.sampling: missing"),
    (_set("prompts[1].messages[0].role", "tool"), r"RoundPlan\.prompts\[1\]\.messages\[0\]\.role: unknown role 'tool'"),
    (_set("prompts[0].prompt_id", -2), r"RoundPlan\.prompts\[0\]\.prompt_id: -2 is below"),
]


@pytest.mark.parametrize(("mutate", "pattern"), PLAN_CASES)
def test_decode_rejects_bad_plan_fields(mutate, pattern):
    msg = _plan_msg()
    mutate(msg)
    with pytest.raises(WireError, match=pattern):
        codec.from_proto(msg)


def test_decode_rejects_bad_capability_and_reports():
    req = codec.to_proto(_first(t.TrainRequest))
    req.capability["beta"] = -0.5
    with pytest.raises(WireError, match=r"TrainRequest\.capability\['beta'\]: -0\.5 outside \[0, inf\]"):
        codec.from_proto(req)
    req = codec.to_proto(_first(t.TrainRequest))
    req.foreign[1].reward = 2.0
    with pytest.raises(WireError, match=r"TrainRequest\.foreign\[1\]\.reward"):
        codec.from_proto(req)
    rep = codec.to_proto(_first(t.EvalReport))
    rep.num_prompts = -3
    with pytest.raises(WireError, match=r"EvalReport\.num_prompts: -3"):
        codec.from_proto(rep)
    ereq = codec.to_proto(_first(t.EvalRequest))
    ereq.max_new_tokens = 0
    with pytest.raises(WireError, match=r"EvalRequest\.max_new_tokens: 0 is below the minimum 1"):
        codec.from_proto(ereq)
    with pytest.raises(WireError, match=r"CheckpointReply\.path: must not be empty"):
        codec.from_proto(codec.checkpoint_reply_to_proto(""))
    with pytest.raises(WireError, match=r"CheckpointRequest\.round: -1"):
        codec.from_proto(codec.checkpoint_request_to_proto(-1))
    with pytest.raises(WireError, match=r"HealthRequest\.schema_version: missing"):
        codec.from_proto(pb.HealthRequest())


def test_configurable_caps_name_the_field():
    data = codec.encode(_first(t.RolloutBatch))
    with pytest.raises(WireError, match=r"RolloutBatch\.rollouts\[0\]\.response: \d+ characters exceed the cap of 10"):
        codec.decode(t.RolloutBatch, data, limits=WireLimits(max_text_chars=10))
    with pytest.raises(WireError, match=r"RolloutBatch\.rollouts: 5 entries exceed the cap of 4"):
        codec.decode(t.RolloutBatch, data, limits=WireLimits(max_items=4))
    with pytest.raises(WireError, match=r"RolloutBatch\.run_id: 5 characters exceed the cap of 3"):
        codec.decode(t.RolloutBatch, data, limits=WireLimits(max_name_chars=3))
    with pytest.raises(WireError, match=rf"RolloutBatch: {len(data)} bytes exceed the cap of 100"):
        codec.decode(t.RolloutBatch, data, limits=WireLimits(max_message_bytes=100))
    assert codec.decode(t.RolloutBatch, data, limits=WireLimits(max_items=5)) == _first(t.RolloutBatch)


def test_decode_rejects_garbage_and_invalid_utf8():
    with pytest.raises(WireError, match=r"RoundPlan: not a valid serialized message"):
        codec.decode(t.RoundPlan, b"\x0a\xff\xff\xff")
    bad_utf8 = b"\x08\x01" + b"\x12\x02\xff\xfe"  # schema_version=1, run_id = invalid UTF-8
    with pytest.raises(WireError, match=r"TrainReport: not a valid serialized message"):
        codec.decode(t.TrainReport, bad_utf8)
    with pytest.raises(WireError, match=r"expected bytes, got str"):
        codec.decode(t.TrainReport, "not bytes")


_UNKNOWN_FIELD = b"\xc0\x3e\x01"  # field 1000 (declared by no message), varint 1


@pytest.mark.parametrize("obj", _samples(), ids=lambda o: type(o).__name__)
def test_a_field_the_schema_does_not_declare_is_refused(obj):
    data = codec.encode(obj)
    assert codec.decode(type(obj), data) == obj
    with pytest.raises(WireError, match=rf"^{type(obj).__name__}: 3 bytes of fields schema v1 does not declare"):
        codec.decode(type(obj), data + _UNKNOWN_FIELD)


def test_a_reserved_field_is_refused_at_any_depth():
    msg = codec.to_proto(_first(t.TrainRequest))
    reserved = codec.to_proto(_first(t.TrainRequest))
    reserved.MergeFromString(b"\x48\x01")  # TrainRequest field 9: reserved
    nested = codec.to_proto(_first(t.TrainRequest))
    nested.prompts[0].MergeFromString(b"\x20\x01")  # Prompt field 4: reserved (planned verifier_metadata)
    assert codec.decode(t.TrainRequest, msg.SerializeToString()) == _first(t.TrainRequest)
    for bad in (reserved, nested):
        with pytest.raises(WireError, match=r"^TrainRequest: \d+ bytes of fields schema v1 does not declare"):
            codec.decode(t.TrainRequest, bad.SerializeToString())


def test_unknown_kinds_and_types_are_rejected():
    with pytest.raises(WireError, match=r"unknown wire kind 'Nope'; expected one of \[.*'RolloutBatch'"):
        codec.decode("Nope", b"")
    with pytest.raises(WireError, match=r"cannot encode dict: not a hacrl_fed.types dataclass"):
        codec.to_proto({"a": 1})
    with pytest.raises(WireError, match=r"cannot decode Struct"):
        from google.protobuf import struct_pb2

        codec.from_proto(struct_pb2.Struct())


def test_encode_errors_are_wire_errors():
    with pytest.raises(WireError, match=r"Rollout\.finish_reason: unknown value 'eos'"):
        codec.encode(replace(_rollout(), finish_reason="eos"))
    with pytest.raises(WireError, match=r"Rollout\.finish_reason: unknown value 'length '"):
        codec.encode(t.RolloutBatch("r", 1, "a", (replace(_rollout(), finish_reason="length "),), 0.0))
    with pytest.raises(WireError, match=r"Rollout: cannot encode"):
        codec.encode(replace(_rollout(), prompt_id=1.5))  # no silent float -> int truncation
    with pytest.raises(WireError, match=r"Rollout: cannot encode"):
        codec.encode(replace(_rollout(), token_count=2**63))
    with pytest.raises(WireError, match=r"ChatMessage: cannot encode"):
        codec.encode(t.ChatMessage(role=123, content="x"))
    with pytest.raises(WireError, match=r"Rollout: both response and sealed_response are set"):
        codec.encode(replace(_rollout(), sealed_response=b"\x00" * 20))
    with pytest.raises(WireError, match=r"Rollout: cannot encode"):
        codec.encode(replace(_rollout(), response="", sealed_response="text, not bytes"))
    with pytest.raises(WireError, match=r"RolloutBatch: cannot encode"):
        codec.encode(replace(_sealed_batch(), wrapped_keys=(t.WrappedKey("beta", "not bytes", b""),)))


# -------------------------------------------------------------- fast paths (no field path built per check)


def _rollout_msg(**fields) -> pb.Rollout:
    m = codec.to_proto(_rollout(0))
    for name, value in fields.items():
        setattr(m, name, value)
    return m


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"reward": 1.0, "logprob_sum": 0.0, "token_count": 0, "round": 0, "prompt_id": 0},
        {"reward": 1.5},
        {"reward": -0.1},
        {"reward": math.nan},
        {"reward": math.inf},
        {"logprob_sum": -math.inf},
        {"logprob_sum": math.nan},
        {"round": -1},
        {"prompt_id": -1},
        {"sample_index": -2},
        {"token_count": -1},
        {"org_id": ""},
        {"org_id": "o" * 257},
        {"finish_reason": 0},
        {"finish_reason": 9},
        {"sealed_response": b"x"},  # with a non-empty response: both set
        {"response": "", "sealed_response": b"s" * (2**20 + 65)},
        {"response": "", "sealed_response": b"s" * (2**20 + 64)},
        {"response": "r" * (2**20 + 1)},
    ],
)
def test_rollout_fast_path_accepts_exactly_what_the_checked_path_accepts(fields):
    """The fast path returns None iff the checked decoder raises, and otherwise an equal rollout."""
    m = _rollout_msg(**fields)
    fast = codec._rollout_fast(m, codec.DEFAULT_LIMITS)
    try:
        checked = codec._rollout_from(m, "Rollout", codec.DEFAULT_LIMITS)
    except WireError:
        assert fast is None
    else:
        assert fast == checked and type(fast.sealed_response) is bytes


@pytest.mark.parametrize(
    ("values", "low", "ok"),
    [
        ({"a": 1.0, "b": -2.5}, -math.inf, True),
        ({"a": -math.inf}, -math.inf, False),
        ({"a": math.inf}, -math.inf, False),
        ({"a": math.nan}, -math.inf, False),
        ({"a": -0.5}, 0.0, False),
        ({"a": 0.0}, 0.0, True),
        ({"": 1.0}, -math.inf, False),
        ({"k" * 257: 1.0}, -math.inf, False),
    ],
)
def test_float_map_fast_path_keeps_every_check(values, low, ok):
    if ok:
        assert codec._float_map(values, "M", codec.DEFAULT_LIMITS, low) == values
    else:
        with pytest.raises(WireError, match=r"^M"):
            codec._float_map(values, "M", codec.DEFAULT_LIMITS, low)


def test_a_bad_rollout_in_a_batch_is_still_named_by_its_path():
    batch = t.RolloutBatch("run", 3, "acme", (_rollout(0), _rollout(1)), 0.5)
    msg = codec.to_proto(batch)
    msg.rollouts[1].reward = 2.0
    with pytest.raises(WireError, match=r"RolloutBatch\.rollouts\[1\]\.reward: 2\.0 outside \[0, 1\]"):
        codec.decode(t.RolloutBatch, msg.SerializeToString())


def _batch_with(**fields) -> t.RolloutBatch:
    rollout_fields = {k[2:]: v for k, v in fields.items() if k.startswith("r_")}
    batch_fields = {k: v for k, v in fields.items() if not k.startswith("r_")}
    rollouts = (_rollout(0), replace(_rollout(1), **rollout_fields))
    return replace(t.RolloutBatch("run", 3, "acme", rollouts, 0.5, {"m": 1.0}), **batch_fields)


BATCH_CASES = [
    {},
    {"r_reward": 1.5}, {"r_reward": math.nan}, {"r_reward": -math.inf}, {"r_logprob_sum": math.inf},
    {"r_round": -1}, {"r_prompt_id": -3}, {"r_sample_index": -1}, {"r_token_count": -1},
    {"r_org_id": ""}, {"r_org_id": "o" * 257}, {"r_response": "x" * (2**20 + 1)},
    {"r_response": "", "r_sealed_response": b"s" * (2**20 + 65)}, {"r_response": "", "r_sealed_response": b"s" * 9},
    {"accuracy": 1.01}, {"accuracy": math.nan}, {"round": -1}, {"org_id": ""}, {"run_id": "r" * 257},
    {"metrics": {"m": math.inf}}, {"metrics": {"": 1.0}}, {"metrics": {"k" * 257: 0.0}}, {"metrics": {}},
    {"signature": b"s" * 1025}, {"signature": b"s" * 64},
    {"wrapped_keys": (t.WrappedKey("beta", bytes(32), b"w" * 48),)},
    {"wrapped_keys": (t.WrappedKey("beta", bytes(31), b"w" * 48),)},
    {"wrapped_keys": (t.WrappedKey("beta", bytes(32), b"w" * 129),)},
    {"wrapped_keys": (t.WrappedKey("", bytes(32), b"w"),)},
    {"wrapped_keys": (t.WrappedKey("beta", bytes(32), b"w"), t.WrappedKey("beta", bytes(32), b"v"))},
]


@pytest.mark.parametrize("fields", BATCH_CASES)
def test_check_batch_raises_exactly_what_decoding_raises(fields):
    """check_batch (no decode when every check passes) agrees with decode(encode(batch)), message included."""
    batch = _batch_with(**fields)
    data = codec.encode(batch)
    try:
        codec.decode(t.RolloutBatch, data)
    except WireError as err:
        with pytest.raises(WireError) as got:
            codec.check_batch(batch, data)
        assert str(got.value) == str(err)
    else:
        assert codec.check_batch(batch, data) is None


def test_check_batch_holds_the_message_size_cap():
    batch = _batch_with()
    data = codec.encode(batch)
    with pytest.raises(WireError, match="exceed the cap"):
        codec.check_batch(batch, data, limits=WireLimits(max_message_bytes=len(data) - 1))


@settings(max_examples=200, deadline=None)
@given(reward=st.floats(allow_nan=True, allow_infinity=True), logprob=st.floats(allow_nan=True),
       accuracy=st.floats(allow_nan=True), index=st.integers(-3, 3), tokens=st.integers(-2, 40))
def test_check_batch_agrees_with_decode_property(reward, logprob, accuracy, index, tokens):
    batch = _batch_with(r_reward=reward, r_logprob_sum=logprob, accuracy=accuracy, r_sample_index=index,
                        r_token_count=tokens)
    data = codec.encode(batch)
    try:
        codec.decode(t.RolloutBatch, data)
        decoded_ok = True
    except WireError:
        decoded_ok = False
    try:
        codec.check_batch(batch, data)
        checked_ok = True
    except WireError:
        checked_ok = False
    assert checked_ok == decoded_ok
