"""The committed hacrl_fed/v1 modules match proto/hacrl_fed/v1/worker.proto and the dataclasses they mirror.

Offline, always: the descriptors compiled into ``worker_pb2`` (protobuf's own descriptor pool) against the
``.proto`` source, field by field (name, number, type, ``repeated``/``map``), and against the dataclasses.

Marked ``protoc``: ``scripts/gen_proto.sh --check`` regenerates the modules with the pinned generator
(grpcio-tools 1.70.0 in ``.cache/protoc-venv``) and diffs them byte for byte. They run when that venv exists
(``make proto`` builds it once, from the package index) and are skipped with that reason otherwise;
``HACRL_PROTOC_BUILD=1`` lets them build it themselves.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hacrl_fed import types as t
from hacrl_fed.v1 import worker_pb2 as pb

REPO = Path(__file__).resolve().parents[1]
PROTO = REPO / "proto" / "hacrl_fed" / "v1" / "worker.proto"
SCRIPT = REPO / "scripts" / "gen_proto.sh"
GENERATED = ("worker_pb2.py", "worker_pb2.pyi", "worker_pb2_grpc.py")
MIRRORED = (t.ChatMessage, t.Prompt, t.SamplingParams, t.RoundPlan, t.Rollout, t.WrappedKey, t.RolloutBatch,
            t.TrainRequest, t.TrainReport, t.EvalRequest, t.EvalReport, t.StepRequest, t.StepReply)

_FIELD = re.compile(r"^\s*(?:repeated\s+)?(?:map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*(\d+)\s*;", re.M)
_TYPED_FIELD = re.compile(r"^\s*(repeated\s+)?(map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*(\d+)\s*;", re.M)


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


def _proto_blocks(kind: str) -> dict[str, str]:
    """Top-level ``message`` / ``enum`` / ``service`` blocks of worker.proto: name -> body (no nesting used)."""
    text = _strip_comments(PROTO.read_text())
    return {m.group(1): m.group(2) for m in re.finditer(rf"^{kind}\s+(\w+)\s*\{{(.*?)^\}}", text, re.M | re.S)}


def _run_check(root: Path, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, **(env_extra or {})}
    return subprocess.run(["bash", str(root / "scripts" / "gen_proto.sh"), "--check"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)


def _declared_type(repeated: bool, type_name: str) -> tuple[str, str]:
    """``(label, type)`` of a field as the .proto spells it: ``map<K, V>`` is a repeated ``map<K,V>``."""
    if type_name.startswith("map<"):
        return "repeated", re.sub(r"\s+", "", type_name)
    return ("repeated" if repeated else "single"), type_name


def _compiled_type(field) -> tuple[str, str]:
    """The same ``(label, type)`` read from a compiled FieldDescriptor."""
    from google.protobuf.descriptor import FieldDescriptor

    label = "repeated" if field.label == FieldDescriptor.LABEL_REPEATED else "single"
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        key, value = (_compiled_type(f)[1] for f in field.message_type.fields)
        return label, f"map<{key},{value}>"
    if field.message_type is not None:
        return label, field.message_type.name
    if field.enum_type is not None:
        return label, field.enum_type.name
    names = {getattr(FieldDescriptor, n): n.removeprefix("TYPE_").lower() for n in dir(FieldDescriptor)
             if n.startswith("TYPE_")}
    return label, names[field.type]


def test_compiled_field_types_match_the_proto_source():
    """Offline: every field's type and label as compiled into worker_pb2 is the one the .proto declares (a
    changed type, a field made repeated or a map's value type would all show here)."""
    checked = 0
    for name, body in _proto_blocks("message").items():
        desc = pb.DESCRIPTOR.message_types_by_name[name]
        for repeated, type_name, field, number in _TYPED_FIELD.findall(body):
            compiled = desc.fields_by_name[field]
            assert compiled.number == int(number), (name, field)
            assert _compiled_type(compiled) == _declared_type(bool(repeated), type_name), (name, field)
            checked += 1
    assert checked == sum(len(d.fields) for d in pb.DESCRIPTOR.message_types_by_name.values())


@pytest.mark.protoc
def test_generated_code_matches_proto():
    proc = _run_check(REPO)
    assert proc.returncode == 0, f"gen_proto.sh --check exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert "generated code matches proto/" in proc.stdout


@pytest.mark.protoc
def test_check_fails_on_drift(tmp_path):
    """A copy of the tree whose .proto gained a field must fail the check (reusing the cached generator venv)."""
    venv = Path(os.environ.get("HACRL_PROTOC_VENV", REPO / ".cache" / "protoc-venv"))
    if not (venv / "bin" / "python").exists():
        assert _run_check(REPO).returncode == 0  # builds the venv; fails the test if pip cannot
    shutil.copytree(REPO / "proto", tmp_path / "proto")
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts")
    (tmp_path / "hacrl_fed" / "v1").mkdir(parents=True)
    for name in GENERATED:
        shutil.copy(REPO / "hacrl_fed" / "v1" / name, tmp_path / "hacrl_fed" / "v1")
    proto = tmp_path / "proto" / "hacrl_fed" / "v1" / "worker.proto"
    proto.write_text(proto.read_text().replace("  string path = 2;", "  string path = 2;\n  string note = 3;"))
    proc = _run_check(tmp_path, {"HACRL_PROTOC_VENV": str(venv)})
    assert proc.returncode == 1, proc.stderr
    assert "out of date with proto/" in proc.stderr and "note" in proc.stderr


def test_generated_modules_import_without_warnings():
    code = "import hacrl_fed.v1.worker_pb2, hacrl_fed.v1.worker_pb2_grpc"
    proc = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_descriptors_match_the_proto_source():
    messages = _proto_blocks("message")
    assert set(pb.DESCRIPTOR.message_types_by_name) == set(messages)
    for name, body in messages.items():
        declared = {f: int(n) for f, n in _FIELD.findall(body)}
        actual = {f.name: f.number for f in pb.DESCRIPTOR.message_types_by_name[name].fields}
        assert actual == declared, name
    enums = _proto_blocks("enum")
    assert set(pb.DESCRIPTOR.enum_types_by_name) == set(enums) == {"FinishReason"}
    assert {v.name for v in pb.FinishReason.DESCRIPTOR.values} == set(re.findall(r"(\w+)\s*=", enums["FinishReason"]))
    service = pb.DESCRIPTOR.services_by_name["PolicyWorker"]
    rpcs = re.findall(r"rpc\s+(\w+)\((\w+)\)\s+returns\s+\((\w+)\)", _proto_blocks("service")["PolicyWorker"])
    assert [(m.name, m.input_type.name, m.output_type.name) for m in service.methods] == rpcs
    assert [r[0] for r in rpcs] == ["Generate", "Train", "Evaluate", "Health", "Checkpoint", "Step"]


@pytest.mark.parametrize("dc", MIRRORED, ids=lambda c: c.__name__)
def test_every_dataclass_field_has_a_proto_field(dc):
    desc = pb.DESCRIPTOR.message_types_by_name[dc.__name__]
    wire = {f.name for f in desc.fields} - {"schema_version"}
    local = set(t.LOCAL_ONLY_FIELDS.get(dc.__name__, ()))  # filled in by the receiving codec, never sent
    assert wire == {f.name for f in dataclasses.fields(dc)} - local


def test_top_level_messages_are_versioned_and_keep_room_to_grow():
    for name in ("RoundPlan", "RolloutBatch", "TrainRequest", "TrainReport", "EvalRequest", "EvalReport",
                 "HealthRequest", "HealthReply", "CheckpointRequest", "CheckpointReply", "StepRequest", "StepReply"):
        field = pb.DESCRIPTOR.message_types_by_name[name].fields_by_name["schema_version"]
        assert field.number == 1, name
    from google.protobuf import descriptor_pb2

    def reserved(name: str) -> set[int]:
        proto = descriptor_pb2.DescriptorProto()
        pb.DESCRIPTOR.message_types_by_name[name].CopyToProto(proto)
        return {n for r in proto.reserved_range for n in range(r.start, r.end)}

    assert 9 in reserved("RolloutBatch")  # key_id
    assert {7, 8, 9} <= reserved("RoundPlan")  # deadline, recipients, roster epoch
    assert {11, 13, 14} <= reserved("Rollout")  # text digest, verifier, extracted answer
    assert 9 in reserved("TrainRequest")  # reverify_rewards
    assert 4 in reserved("Prompt")  # verifier metadata for reward re-verification
    assert 4 in reserved("WrappedKey")  # recipient key id


def test_planned_numbers_taken_by_the_security_fields():
    """The numbers worker.proto reserved for signed / sealed rollouts are now these fields, nothing else."""
    fields = {name: desc.fields_by_name for name, desc in pb.DESCRIPTOR.message_types_by_name.items()}
    assert fields["Rollout"]["sealed_response"].number == 10
    assert fields["RolloutBatch"]["signature"].number == 8
    assert fields["RolloutBatch"]["wrapped_keys"].number == 10
    assert fields["RolloutBatch"]["wrapped_keys"].message_type.name == "WrappedKey"
    assert fields["TrainRequest"]["source_batches"].number == 8
    assert fields["TrainRequest"]["source_batches"].message_type.name == "RolloutBatch"
    # replay protection (hacrl_fed.security.freshness): the planned plan digest, the challenges around it
    assert fields["RolloutBatch"]["plan_digest"].number == 11
    assert fields["RoundPlan"]["challenges"].number == 10
    assert fields["TrainReport"]["challenge"].number == 9
    wrapped_key = {f: d.number for f, d in fields["WrappedKey"].items()}
    assert wrapped_key == {"recipient": 1, "ephemeral_public": 2, "wrapped": 3}


def test_the_protoc_gate_pins_the_scripts_generator():
    from conftest import PROTOC_TOOLS

    assert f'TOOLS_VERSION="{PROTOC_TOOLS}"' in SCRIPT.read_text()
