"""hacrl_fed.flower.records: pack/unpack round trips at the RecordDict level, through Flower's own wire format,
and clear errors for malformed contents."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

from hacrl_fed import types as t
from hacrl_fed.flower import records
from hacrl_fed.flower.records import RecordError
from hacrl_fed.wire.operations import OPERATIONS
from hacrl_fed.v1 import worker_pb2 as pb
from hacrl_fed.wire import codec
from hacrl_fed.wire.codec import WireError, WireLimits


def _prompt(pid: int) -> t.Prompt:
    messages = (t.ChatMessage("system", "Be brief."), t.ChatMessage("user", f"{pid} + 1 = ? ✓ 数学"))
    return t.Prompt(pid, messages, str(pid + 1))


def _rollout(i: int, org: str = "acme") -> t.Rollout:
    return t.Rollout(org, 3, 7, i, f"answer {i} \\boxed{{8}}", t.FINISH_STOP if i % 2 else t.FINISH_LENGTH,
                     float(i % 2), -12.5 * (i + 1), 5 + i)


SAMPLING = t.SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=32, num_samples=4, seed=2**40)
VALUES = [
    t.RoundPlan("run-1", 3, "arithmetic", (_prompt(1), _prompt(2)), SAMPLING),
    t.RolloutBatch("run-1", 3, "acme", tuple(_rollout(i) for i in range(6)), 0.5, {"time/generate": 1.5},
                   bytes(range(64))),
    t.TrainRequest("run-1", 3, "acme", (_prompt(7),), (_rollout(0, "beta"), _rollout(1, "gamma")),
                   {"acme": 0.25, "beta": 1.0, "gamma": 0.0}),
    t.TrainReport("run-1", 3, "acme", {"hacpo/loss": -0.0123}),
    t.EvalRequest("run-1", 3, "arithmetic", (_prompt(5),), 16),
    t.EvalReport("run-1", 3, "acme", 0.75, 4, {"eval/len": 9.0}),
]
EXPECTED_KIND = ["RoundPlan", "RolloutBatch", "TrainRequest", "TrainReport", "EvalRequest", "EvalReport"]


def _over_flower_wire(content: RecordDict) -> RecordDict:
    """Deflate ``content`` into Flower's object store format and inflate it back (what the SuperLink relays)."""
    objects = get_all_nested_objects(content)
    blobs = {object_id: obj.deflate() for object_id, obj in objects.items()}
    return inflate_object_from_contents(content.object_id, blobs)


@pytest.mark.parametrize("value, kind", list(zip(VALUES, EXPECTED_KIND)), ids=EXPECTED_KIND)
def test_dataclass_round_trip(value, kind):
    content = records.pack(value)
    record = content.config_records[records.RECORD_KEY]
    assert record[records.KIND_KEY] == kind
    assert record[records.PAYLOAD_KEY] == codec.encode(value)
    assert records.payload_size(content) == len(codec.encode(value))
    assert records.unpack(content, kind) == value
    assert records.unpack(_over_flower_wire(content), kind) == value


def test_health_and_checkpoint_round_trip():
    assert records.unpack(records.pack(codec.health_request()), "HealthRequest") is None
    info = {"org_id": "acme", "status": "ok", "round": "3"}
    assert records.unpack(_over_flower_wire(records.pack(codec.health_reply_to_proto(info))), "HealthReply") == info
    assert records.unpack(records.pack(codec.checkpoint_request_to_proto(12)), "CheckpointRequest") == 12
    path = "/runs/x/acme/round-12"
    assert records.unpack(records.pack(codec.checkpoint_reply_to_proto(path)), "CheckpointReply") == path


def test_operations_route_to_flower_message_types():
    assert {op.name: op.message_type for op in OPERATIONS.values()} == {
        "generate": "query.generate", "train": "train", "evaluate": "evaluate",
        "health": "query.health", "checkpoint": "query.checkpoint", "step": "train.step",
    }
    for op in OPERATIONS.values():  # every kind is a real hacrl_fed.v1 message
        assert codec.proto_class(op.request_kind).DESCRIPTOR.name == op.request_kind
        assert codec.proto_class(op.reply_kind).DESCRIPTOR.name == op.reply_kind


def test_wrong_kind_is_rejected_before_decoding():
    content = records.pack(VALUES[3])  # a TrainReport
    with pytest.raises(RecordError, match="expected 'RolloutBatch', got 'TrainReport'"):
        records.unpack(content, "RolloutBatch")


@pytest.mark.parametrize("content, message", [
    (RecordDict(), "no config record 'hacrl'"),
    (RecordDict({"other": ConfigRecord({"kind": "TrainReport"})}), "no config record 'hacrl'"),
    (RecordDict({"hacrl": MetricRecord({"x": 1.0})}), "no config record 'hacrl'"),
    (RecordDict({"hacrl": ConfigRecord({"payload": b"x"})}), r"hacrl.kind: expected a non-empty str, got NoneType"),
    (RecordDict({"hacrl": ConfigRecord({"kind": "", "payload": b"x"})}), "hacrl.kind: expected a non-empty str"),
    (RecordDict({"hacrl": ConfigRecord({"kind": "TrainReport", "payload": "text"})}),
     "hacrl.payload: expected bytes, got str"),
    (RecordDict({"hacrl": ConfigRecord({"kind": "TrainReport"})}), "hacrl.payload: expected bytes, got NoneType"),
])
def test_malformed_contents_name_the_problem(content, message):
    with pytest.raises(RecordError, match=message):
        records.unpack(content, "TrainReport")
    assert records.payload_size(content) == 0


def test_payload_is_checked_by_the_codec():
    bad = pb.TrainReport(schema_version=1, run_id="r", round=1, org_id="acme", metrics={"loss": float("nan")})
    content = RecordDict({"hacrl": ConfigRecord({"kind": "TrainReport", "payload": bad.SerializeToString()})})
    with pytest.raises(WireError, match=r"TrainReport.metrics\['loss'\]: non-finite"):
        records.unpack(content, "TrainReport")
    garbage = RecordDict({"hacrl": ConfigRecord({"kind": "TrainReport", "payload": b"\xff\xff\xff"})})
    with pytest.raises(WireError, match="not a valid serialized message"):
        records.unpack(garbage, "TrainReport")


def test_size_limit_applies():
    content = records.pack(VALUES[1])
    with pytest.raises(WireError, match="exceed the cap of 100"):
        records.unpack(content, "RolloutBatch", limits=WireLimits(max_message_bytes=100))


def test_pack_rejects_non_protocol_values():
    with pytest.raises(WireError, match="unknown wire kind"):
        records.pack({"not": "a dataclass"})
    with pytest.raises(WireError, match="Rollout.finish_reason: unknown value 'eos'"):
        records.pack(t.RolloutBatch("r", 1, "a", (t.Rollout("a", 1, 0, 0, "x", "eos", 1.0, -1.0, 1),), 1.0))
