"""What a hacrl-fed Flower message carries: one serialized ``hacrl_fed.v1`` protobuf in a ``ConfigRecord``.

Layout of every request and reply content::

    RecordDict({"hacrl": ConfigRecord({"kind": "<proto message name>", "payload": b"<protobuf bytes>"})})

``kind`` is the protobuf message name (``"RoundPlan"``, ``"RolloutBatch"``, ``"HealthReply"`` ...); ``payload`` is
:func:`hacrl_fed.wire.codec.encode`'s deterministic serialization, decoded (and checked field by field) with
:func:`hacrl_fed.wire.codec.decode`. Nothing else travels: no pickles, no nested records.

Which message type carries which operation (``<category>.<action>``, category train/evaluate/query; the ClientApp
routes ``train`` to ``@app.train()``, ``query.generate`` to ``@app.query("generate")``, ``train.step`` to
``@app.train("step")`` ...) and which kinds its request and reply hold come from the one table of the operations,
:data:`hacrl_fed.wire.operations.OPERATIONS`.
"""

from __future__ import annotations

from typing import Any

from flwr.app import ConfigRecord, RecordDict

from hacrl_fed.wire import codec

RECORD_KEY = "hacrl"
KIND_KEY = "kind"
PAYLOAD_KEY = "payload"


class RecordError(ValueError):
    """A Flower message content that is not a well-formed hacrl-fed record (names what is wrong)."""


def kind_of(obj: Any) -> str:
    """Protobuf message name of ``obj``: a :mod:`hacrl_fed.types` dataclass or a ``hacrl_fed.v1`` message."""
    return codec.proto_class(type(obj)).DESCRIPTOR.name


def pack(obj: Any) -> RecordDict:
    """Dataclass / ``hacrl_fed.v1`` message -> ``RecordDict`` with one ``ConfigRecord`` (kind, payload bytes).

    Raises :class:`hacrl_fed.wire.codec.WireError` for values protobuf cannot hold.
    """
    kind = kind_of(obj)
    return RecordDict({RECORD_KEY: ConfigRecord({KIND_KEY: kind, PAYLOAD_KEY: codec.encode(obj)})})


def payload_of(content: RecordDict) -> tuple[str, bytes]:
    """``(kind, payload)`` of a packed content; :class:`RecordError` naming the missing / mistyped field."""
    if RECORD_KEY not in content.config_records:
        raise RecordError(f"message content has no config record {RECORD_KEY!r} (got {sorted(content.keys())})")
    record = content.config_records[RECORD_KEY]
    kind, payload = record.get(KIND_KEY), record.get(PAYLOAD_KEY)
    if not isinstance(kind, str) or not kind:
        raise RecordError(f"{RECORD_KEY}.{KIND_KEY}: expected a non-empty str, got {type(kind).__name__}")
    if not isinstance(payload, bytes):
        raise RecordError(f"{RECORD_KEY}.{PAYLOAD_KEY}: expected bytes, got {type(payload).__name__}")
    return kind, payload


def payload_size(content: RecordDict) -> int:
    """Bytes of the serialized protobuf in a packed content (0 when there is none)."""
    try:
        return len(payload_of(content)[1])
    except RecordError:
        return 0


def unpack(content: RecordDict, expected_kind: str, *, limits: codec.WireLimits = codec.DEFAULT_LIMITS) -> Any:
    """Packed content -> checked dataclass / value (see :func:`hacrl_fed.wire.codec.decode`).

    Raises :class:`RecordError` if the record is malformed or its kind is not ``expected_kind``, and
    :class:`~hacrl_fed.wire.codec.WireError` if the payload fails decoding or a field check.
    """
    kind, payload = payload_of(content)
    if kind != expected_kind:
        raise RecordError(f"{RECORD_KEY}.{KIND_KEY}: expected {expected_kind!r}, got {kind[:64]!r}")
    return codec.decode(expected_kind, payload, limits=limits)
