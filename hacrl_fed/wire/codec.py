"""The one converter between the protocol dataclasses (:mod:`hacrl_fed.types`) and ``hacrl_fed.v1`` protobuf.

Public API:

* ``to_proto(obj) -> Message`` and ``from_proto(msg, limits=...) -> obj`` for every dataclass of
  :mod:`hacrl_fed.types` (and ``from_proto`` for the Health / Checkpoint messages, which map to plain values:
  ``HealthRequest -> None``, ``HealthReply -> dict[str, str]``, ``CheckpointRequest -> int`` (the round),
  ``CheckpointReply -> str`` (the path)); build those four with the ``*_to_proto`` helpers below.
* ``encode(obj) -> bytes``: deterministic serialization (map entries sorted), so equal objects give equal bytes.
* ``decode(kind, data, limits=...)``: ``kind`` is a dataclass (``RolloutBatch``), a generated message class
  (``pb.RolloutBatch``) or a message name (``"RolloutBatch"``).

Encoding fails only on values protobuf cannot hold (wrong types, ints outside int64, unknown finish_reason).
Decoding is the trust boundary, so every decoded field is checked (input hygiene) and the first problem raises
:class:`WireError` naming the message path, e.g. ``RolloutBatch.rollouts[3].reward: 1.5 outside [0, 1]``:

* top-level messages: ``1 <= schema_version <= SCHEMA_VERSION``;
* floats finite; ``reward`` and ``accuracy`` in [0, 1]; ``capability`` values >= 0; ``0 < top_p <= 1``;
  ``temperature >= 0``;
* counts and indices (round, prompt_id, sample_index, token_count, top_k, num_prompts) >= 0;
  ``max_new_tokens`` and ``num_samples`` >= 1;
* ``finish_reason`` is stop or length; ``role`` is system, user or assistant; org ids are non-empty;
* strings, repeated fields, maps, signatures and whole messages are capped by :class:`WireLimits`;
* sealed text (``Rollout.sealed_response``) is capped at ``max_text_chars + 64`` bytes, and a rollout never
  carries both a non-empty ``response`` and a non-empty ``sealed_response`` (also refused when encoding);
* wrapped keys (``RolloutBatch.wrapped_keys``): at most ``max_recipients``, recipients non-empty and distinct
  names, ``ephemeral_public`` exactly 32 bytes, ``wrapped`` at most 128 bytes;
* ``TrainReport.signature`` at most ``max_signature_bytes``; ``TrainReport.disclosed_keys`` and
  ``RoundPlan.challenges`` and ``RolloutBatch.plan_challenges`` at most ``max_recipients`` entries of at most 64
  bytes (the worker bounds the
  challenges further by its roster, :mod:`hacrl_fed.worker.guard`); ``TrainReport.challenge`` and
  ``RolloutBatch.plan_digest`` at most 64 bytes;
* a ``TrainReport``'s mismatch counters (:mod:`hacrl_fed.wire.accusations`) are whole counts >= 0, a per-round
  one names a decimal round; with the receiver's window (``WireLimits.window`` and ``max_sources``) at most
  ``W × max_sources`` per-round counters and disclosed keys (:func:`check_report` applies the same rule, with the
  coordinator's cap, to an in-process report);
* a field the schema does not declare (a reserved or unknown number, at any depth) is refused, never ignored;
* ``TrainRequest.source_batches`` are checked like any ``RolloutBatch``; with
  ``WireLimits.skip_unsigned_foreign`` (a worker with signing on, which ignores unsigned rollouts)
  ``TrainRequest.foreign`` is only counted (``unread_foreign``), never converted;
* a ``TrainRequest``'s asynchronous-rounds fields (docs/ALGORITHM.md "Asynchronous rounds"): ``round_capability``
  and ``tags`` name rounds of the receiver's window (``WireLimits.window`` ``W``: ``round - W + 1 .. round``; none
  set: ``0 .. round``), capability values finite and >= 0, at most ``W × WireLimits.max_sources`` tags and source
  batches (each batch of a round of the window), one tag per (source, round), versions >= 0;
* ``StepRequest`` (every message of a round) carries at least one of ``train``, ``plan``, ``evaluate``,
  ``checkpoint``, each checked as its own message; ``StepReply`` never carries both a part's reply and its error
  (``report`` / ``train_error``, ``batch`` / ``generate_error``, ``eval_report`` / ``eval_error``, ``checkpoint``
  / ``checkpoint_error``).

The codec checks shapes only; signatures and sealed text are checked by :mod:`hacrl_fed.security`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from google.protobuf.message import DecodeError, Message

from hacrl_fed import types as t
from hacrl_fed.limits import MAX_MESSAGE_BYTES
from hacrl_fed.v1 import worker_pb2 as pb
from hacrl_fed.wire.accusations import is_counter, parse_round_counter

SCHEMA_VERSION = 1  # written into every top-level message; receivers accept 1..SCHEMA_VERSION
ROLES = ("system", "user", "assistant")
EPHEMERAL_PUBLIC_BYTES = 32  # a raw X25519 public key
MAX_WRAPPED_BYTES = 128  # a wrapped content key (32-byte key + 16-byte tag today; room for a longer scheme)
SEALED_OVERHEAD_BYTES = 64  # sealed_response may exceed max_text_chars by this much (AEAD tag, future nonce)
MAX_KEY_BYTES = 64  # a disclosed content key, a challenge, a plan digest (32 bytes today)

_FINISH_TO_PB = {t.FINISH_STOP: pb.FINISH_REASON_STOP, t.FINISH_LENGTH: pb.FINISH_REASON_LENGTH}
_FINISH_FROM_PB = {code: name for name, code in _FINISH_TO_PB.items()}


class WireError(ValueError):
    """A message that cannot be encoded, or that fails a decode-time check; the text names message and field."""


@dataclass(frozen=True)
class WireLimits:
    """Decode-time caps. Characters are counted on the decoded ``str``; bytes on the serialized message."""

    max_message_bytes: int = MAX_MESSAGE_BYTES  # one serialized message (the default gRPC limit we set)
    max_text_chars: int = 2**20  # responses, chat contents, references, health values
    max_name_chars: int = 256  # ids, roles, task names, metric / capability / health keys
    max_items: int = 2**20  # elements of any one repeated or map field
    max_signature_bytes: int = 1024
    max_path_chars: int = 4096  # checkpoint paths
    max_recipients: int = 1024  # wrapped keys of one batch
    # signing on: TrainRequest.foreign (unsigned, ignored by the learner) is counted, not decoded (unread_foreign)
    skip_unsigned_foreign: bool = False
    # asynchronous rounds at the receiving worker: its window W (a TrainRequest's rounds lie in round-W+1..round;
    # None: rounds 0..round) and the number of other orgs (at most W x that many source batches and tags)
    window: int | None = None
    max_sources: int | None = None


DEFAULT_LIMITS = WireLimits()


# ----------------------------------------------------------------------------------------------------- checks


def _fail(where: str, problem: str) -> None:
    raise WireError(f"{where}: {problem}")


def _finite(x: float, where: str) -> float:
    if not math.isfinite(x):
        _fail(where, f"non-finite value {x!r}")
    return x


def _in_range(x: float, where: str, low: float, high: float) -> float:
    if not low <= _finite(x, where) <= high:
        _fail(where, f"{x!r} outside [{low:g}, {high:g}]")
    return x


def _at_least(n: int, where: str, minimum: int = 0) -> int:
    if n < minimum:
        _fail(where, f"{n} is below the minimum {minimum}")
    return n


def _string(s: str, where: str, cap: int, *, required: bool = False) -> str:
    if len(s) > cap:
        _fail(where, f"{len(s)} characters exceed the cap of {cap}")
    if required and not s:
        _fail(where, "must not be empty")
    return s


def _bytes(b: bytes, where: str, cap: int) -> bytes:
    if len(b) > cap:
        _fail(where, f"{len(b)} bytes exceed the cap of {cap}")
    return bytes(b)


def _items(seq: Any, where: str, lim: WireLimits) -> Any:
    if len(seq) > lim.max_items:
        _fail(where, f"{len(seq)} entries exceed the cap of {lim.max_items}")
    return seq


def _float_map(m: Mapping[str, float], where: str, lim: WireLimits, low: float = -math.inf) -> dict[str, float]:
    """Map with capped keys and finite values >= ``low``; returns a plain dict."""
    _items(m, where, lim)
    out = dict(m)
    cap = lim.max_name_chars
    if all(0 < len(k) <= cap and math.isfinite(v) and v >= low for k, v in out.items()):  # common case: no paths
        return out
    out = {}
    for key, value in m.items():
        _string(key, f"{where} key {key[:40]!r}", lim.max_name_chars, required=True)
        out[key] = _in_range(value, f"{where}[{key!r}]", low, math.inf)
    return out


def _check_version(msg: Message, where: str) -> None:
    v = msg.schema_version
    if v == 0:
        _fail(f"{where}.schema_version", "missing (0); the sender must set it")
    if v > SCHEMA_VERSION:
        _fail(f"{where}.schema_version", f"{v} is newer than the supported {SCHEMA_VERSION}")


# ------------------------------------------------------------------------------------ dataclass -> protobuf


def _chat_to(m: t.ChatMessage) -> pb.ChatMessage:
    return pb.ChatMessage(role=m.role, content=m.content)


def _prompt_to(p: t.Prompt) -> pb.Prompt:
    return pb.Prompt(prompt_id=p.prompt_id, messages=[_chat_to(m) for m in p.messages], reference=p.reference)


def _sampling_to(s: t.SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_new_tokens=s.max_new_tokens,
        num_samples=s.num_samples,
        seed=s.seed,
    )


def _plan_to(p: t.RoundPlan) -> pb.RoundPlan:
    return pb.RoundPlan(
        schema_version=SCHEMA_VERSION,
        run_id=p.run_id,
        round=p.round,
        task=p.task,
        prompts=[_prompt_to(x) for x in p.prompts],
        sampling=_sampling_to(p.sampling),
        challenges={k: bytes(v) for k, v in p.challenges.items()},
    )


def _rollout_to(r: t.Rollout) -> pb.Rollout:
    if r.finish_reason not in _FINISH_TO_PB:
        raise WireError(f"Rollout.finish_reason: unknown value {r.finish_reason!r} (expected {t.FINISH_REASONS})")
    if r.response and r.sealed_response:
        raise WireError("Rollout: both response and sealed_response are set (sealed text must clear response)")
    return pb.Rollout(
        org_id=r.org_id,
        round=r.round,
        prompt_id=r.prompt_id,
        sample_index=r.sample_index,
        response=r.response,
        finish_reason=_FINISH_TO_PB[r.finish_reason],
        reward=r.reward,
        logprob_sum=r.logprob_sum,
        token_count=r.token_count,
        sealed_response=bytes(r.sealed_response),
    )


def _wrapped_to(w: t.WrappedKey) -> pb.WrappedKey:
    return pb.WrappedKey(recipient=w.recipient, ephemeral_public=bytes(w.ephemeral_public), wrapped=bytes(w.wrapped))


def _batch_to(b: t.RolloutBatch) -> pb.RolloutBatch:
    return pb.RolloutBatch(
        schema_version=SCHEMA_VERSION,
        run_id=b.run_id,
        round=b.round,
        org_id=b.org_id,
        rollouts=[_rollout_to(r) for r in b.rollouts],
        accuracy=b.accuracy,
        metrics=dict(b.metrics),
        signature=bytes(b.signature),
        wrapped_keys=[_wrapped_to(w) for w in b.wrapped_keys],
        plan_digest=bytes(b.plan_digest),
        version=b.version,
        plan_challenges={k: bytes(v) for k, v in b.plan_challenges.items()},
    )


def _train_req_to(r: t.TrainRequest) -> pb.TrainRequest:
    return pb.TrainRequest(
        schema_version=SCHEMA_VERSION,
        run_id=r.run_id,
        round=r.round,
        org_id=r.org_id,
        prompts=[_prompt_to(p) for p in r.prompts],
        foreign=[_rollout_to(x) for x in r.foreign],
        capability=dict(r.capability),
        source_batches=[_batch_to(b) for b in r.source_batches],
        round_capability={int(k): pb.CapabilityTable(capability=dict(v)) for k, v in r.round_capability.items()},
        tags=[pb.BatchTag(source=s, round=rnd, version=v) for s, rnd, v in r.tags],
        version=r.version,
    )


def _train_rep_to(r: t.TrainReport) -> pb.TrainReport:
    return pb.TrainReport(
        schema_version=SCHEMA_VERSION,
        run_id=r.run_id,
        round=r.round,
        org_id=r.org_id,
        metrics=dict(r.metrics),
        signature=bytes(r.signature),
        disclosed_keys={k: bytes(v) for k, v in r.disclosed_keys.items()},
        challenge=bytes(r.challenge),
    )


def _eval_req_to(r: t.EvalRequest) -> pb.EvalRequest:
    return pb.EvalRequest(
        schema_version=SCHEMA_VERSION,
        run_id=r.run_id,
        round=r.round,
        task=r.task,
        prompts=[_prompt_to(p) for p in r.prompts],
        max_new_tokens=r.max_new_tokens,
    )


def _eval_rep_to(r: t.EvalReport) -> pb.EvalReport:
    return pb.EvalReport(
        schema_version=SCHEMA_VERSION,
        run_id=r.run_id,
        round=r.round,
        org_id=r.org_id,
        accuracy=r.accuracy,
        num_prompts=r.num_prompts,
        metrics=dict(r.metrics),
    )


def _step_req_to(r: t.StepRequest) -> pb.StepRequest:
    if not r.parts():
        raise WireError("StepRequest: neither train, plan, evaluate nor checkpoint is set")
    msg = pb.StepRequest(schema_version=SCHEMA_VERSION)
    if r.train is not None:
        msg.train.CopyFrom(_train_req_to(r.train))
    if r.plan is not None:
        msg.plan.CopyFrom(_plan_to(r.plan))
    if r.evaluate is not None:
        msg.evaluate.CopyFrom(_eval_req_to(r.evaluate))
    if r.checkpoint is not None:
        msg.checkpoint.CopyFrom(checkpoint_request_to_proto(r.checkpoint))
    return msg


def _step_rep_to(r: t.StepReply) -> pb.StepReply:
    for part, value, error in (
        ("report", r.report, r.train_error),
        ("batch", r.batch, r.generate_error),
        ("eval_report", r.eval_report, r.eval_error),
        ("checkpoint", r.checkpoint, r.checkpoint_error),
    ):
        if value is not None and error:
            raise WireError(f"StepReply: both {part} and its error are set")
    msg = pb.StepReply(
        schema_version=SCHEMA_VERSION,
        train_error=r.train_error,
        generate_error=r.generate_error,
        eval_error=r.eval_error,
        checkpoint_error=r.checkpoint_error,
    )
    if r.report is not None:
        msg.report.CopyFrom(_train_rep_to(r.report))
    if r.batch is not None:
        msg.batch.CopyFrom(_batch_to(r.batch))
    if r.eval_report is not None:
        msg.eval_report.CopyFrom(_eval_rep_to(r.eval_report))
    if r.checkpoint is not None:
        msg.checkpoint.CopyFrom(checkpoint_reply_to_proto(r.checkpoint))
    return msg


def health_request() -> pb.HealthRequest:
    """An empty, versioned ``HealthRequest``."""
    return pb.HealthRequest(schema_version=SCHEMA_VERSION)


def health_reply_to_proto(info: Mapping[str, str]) -> pb.HealthReply:
    """``worker.health()``'s dict -> ``HealthReply``."""
    return _guarded("HealthReply", lambda: pb.HealthReply(schema_version=SCHEMA_VERSION, info=dict(info)))


def checkpoint_request_to_proto(round: int) -> pb.CheckpointRequest:
    return _guarded("CheckpointRequest", lambda: pb.CheckpointRequest(schema_version=SCHEMA_VERSION, round=round))


def checkpoint_reply_to_proto(path: str) -> pb.CheckpointReply:
    return _guarded("CheckpointReply", lambda: pb.CheckpointReply(schema_version=SCHEMA_VERSION, path=path))


# ------------------------------------------------------------------------------------ protobuf -> dataclass


def _chat_from(m: pb.ChatMessage, where: str, lim: WireLimits) -> t.ChatMessage:
    if m.role not in ROLES:
        _fail(f"{where}.role", f"unknown role {m.role[:40]!r} (expected one of {ROLES})")
    return t.ChatMessage(role=m.role, content=_string(m.content, f"{where}.content", lim.max_text_chars))


def _prompt_from(m: pb.Prompt, where: str, lim: WireLimits) -> t.Prompt:
    _items(m.messages, f"{where}.messages", lim)
    return t.Prompt(
        prompt_id=_at_least(m.prompt_id, f"{where}.prompt_id"),
        messages=tuple(_chat_from(x, f"{where}.messages[{i}]", lim) for i, x in enumerate(m.messages)),
        reference=_string(m.reference, f"{where}.reference", lim.max_text_chars),
    )


def _prompts_from(seq: Any, where: str, lim: WireLimits) -> tuple[t.Prompt, ...]:
    _items(seq, where, lim)
    return tuple(_prompt_from(p, f"{where}[{i}]", lim) for i, p in enumerate(seq))


def _top_p(x: float, where: str) -> float:
    if not 0.0 < _finite(x, where) <= 1.0:
        _fail(where, f"{x!r} outside (0, 1]")
    return x


def _sampling_from(m: pb.SamplingParams, where: str, lim: WireLimits) -> t.SamplingParams:
    return t.SamplingParams(
        temperature=_in_range(m.temperature, f"{where}.temperature", 0.0, math.inf),
        top_p=_top_p(m.top_p, f"{where}.top_p"),
        top_k=_at_least(m.top_k, f"{where}.top_k"),
        max_new_tokens=_at_least(m.max_new_tokens, f"{where}.max_new_tokens", 1),
        num_samples=_at_least(m.num_samples, f"{where}.num_samples", 1),
        seed=m.seed,
    )


def _plan_from(m: pb.RoundPlan, where: str, lim: WireLimits) -> t.RoundPlan:
    _check_version(m, where)
    if not m.HasField("sampling"):
        _fail(f"{where}.sampling", "missing")
    return t.RoundPlan(
        run_id=_string(m.run_id, f"{where}.run_id", lim.max_name_chars),
        round=_at_least(m.round, f"{where}.round"),
        task=_string(m.task, f"{where}.task", lim.max_name_chars),
        prompts=_prompts_from(m.prompts, f"{where}.prompts", lim),
        sampling=_sampling_from(m.sampling, f"{where}.sampling", lim),
        challenges=_key_map(m.challenges, f"{where}.challenges", lim),
    )


def _rollout_problem(r: Any, finish_known: bool, lim: WireLimits) -> tuple[str, str] | None:
    """The one definition of a rollout's wire checks, on a ``pb.Rollout`` or a ``t.Rollout`` (same field names):
    ``(field, problem)`` of the first that fails (``field`` is ``""`` or ``".<name>"``), or None when all pass.
    ``finish_known``: its finish reason is one the wire knows."""
    sealed_cap = lim.max_text_chars + SEALED_OVERHEAD_BYTES
    if not finish_known:
        expected = f"stop={pb.FINISH_REASON_STOP} or length={pb.FINISH_REASON_LENGTH}"
        return ".finish_reason", f"unknown value {r.finish_reason} (expected {expected})"
    if r.response and r.sealed_response:
        return "", "both response and sealed_response are set (sealed text must clear response)"
    if len(r.org_id) > lim.max_name_chars:
        return ".org_id", f"{len(r.org_id)} characters exceed the cap of {lim.max_name_chars}"
    if not r.org_id:
        return ".org_id", "must not be empty"
    for name in ("round", "prompt_id", "sample_index"):
        if getattr(r, name) < 0:
            return f".{name}", f"{getattr(r, name)} is below the minimum 0"
    if len(r.response) > lim.max_text_chars:
        return ".response", f"{len(r.response)} characters exceed the cap of {lim.max_text_chars}"
    if not math.isfinite(r.reward):
        return ".reward", f"non-finite value {r.reward!r}"
    if not 0.0 <= r.reward <= 1.0:
        return ".reward", f"{r.reward!r} outside [0, 1]"
    if not math.isfinite(r.logprob_sum):
        return ".logprob_sum", f"non-finite value {r.logprob_sum!r}"
    if r.token_count < 0:
        return ".token_count", f"{r.token_count} is below the minimum 0"
    if len(r.sealed_response) > sealed_cap:
        return ".sealed_response", f"{len(r.sealed_response)} bytes exceed the cap of {sealed_cap}"
    return None


def _rollout_fast(m: pb.Rollout, lim: WireLimits) -> t.Rollout | None:
    """``m`` as a :class:`~hacrl_fed.types.Rollout` when it passes every check of :func:`_rollout_problem`, else
    None (no field path is built: this runs on every learner for every foreign rollout)."""
    finish = _FINISH_FROM_PB.get(m.finish_reason)
    if finish is None or _rollout_problem(m, True, lim) is not None:
        return None
    return t.Rollout(
        m.org_id, m.round, m.prompt_id, m.sample_index, m.response, finish, m.reward, m.logprob_sum, m.token_count,
        bytes(m.sealed_response),
    )  # fmt: skip


def _rollout_from(m: pb.Rollout, where: str, lim: WireLimits) -> t.Rollout:
    rollout = _rollout_fast(m, lim)
    if rollout is None:
        field, problem = _rollout_problem(m, m.finish_reason in _FINISH_FROM_PB, lim) or ("", "")
        _fail(f"{where}{field}", problem)
    assert rollout is not None
    return rollout


def _rollouts_from(seq: Any, where: str, lim: WireLimits) -> tuple[t.Rollout, ...]:
    _items(seq, where, lim)
    return tuple(_rollout_fast(r, lim) or _rollout_from(r, f"{where}[{i}]", lim) for i, r in enumerate(seq))


def _wrapped_from(m: pb.WrappedKey, where: str, lim: WireLimits) -> t.WrappedKey:
    if len(m.ephemeral_public) != EPHEMERAL_PUBLIC_BYTES:
        _fail(f"{where}.ephemeral_public", f"{len(m.ephemeral_public)} bytes, expected {EPHEMERAL_PUBLIC_BYTES}")
    return t.WrappedKey(
        recipient=_string(m.recipient, f"{where}.recipient", lim.max_name_chars, required=True),
        ephemeral_public=bytes(m.ephemeral_public),
        wrapped=_bytes(m.wrapped, f"{where}.wrapped", MAX_WRAPPED_BYTES),
    )


def _wrapped_keys_from(seq: Any, where: str, lim: WireLimits) -> tuple[t.WrappedKey, ...]:
    if len(seq) > lim.max_recipients:
        _fail(where, f"{len(seq)} entries exceed the cap of {lim.max_recipients}")
    keys = tuple(_wrapped_from(w, f"{where}[{i}]", lim) for i, w in enumerate(seq))
    seen: set[str] = set()
    for i, w in enumerate(keys):
        if w.recipient in seen:
            _fail(f"{where}[{i}].recipient", f"duplicate recipient {w.recipient[:40]!r}")
        seen.add(w.recipient)
    return keys


def _batch_from(m: pb.RolloutBatch, where: str, lim: WireLimits) -> t.RolloutBatch:
    _check_version(m, where)
    _bytes(m.signature, f"{where}.signature", lim.max_signature_bytes)
    return t.RolloutBatch(
        run_id=_string(m.run_id, f"{where}.run_id", lim.max_name_chars),
        round=_at_least(m.round, f"{where}.round"),
        org_id=_string(m.org_id, f"{where}.org_id", lim.max_name_chars, required=True),
        rollouts=_rollouts_from(m.rollouts, f"{where}.rollouts", lim),
        accuracy=_in_range(m.accuracy, f"{where}.accuracy", 0.0, 1.0),
        metrics=_float_map(m.metrics, f"{where}.metrics", lim),
        signature=bytes(m.signature),
        wrapped_keys=_wrapped_keys_from(m.wrapped_keys, f"{where}.wrapped_keys", lim),
        plan_digest=_bytes(m.plan_digest, f"{where}.plan_digest", MAX_KEY_BYTES),
        version=_at_least(m.version, f"{where}.version"),
        plan_challenges=_key_map(m.plan_challenges, f"{where}.plan_challenges", lim),
    )


def _batches_from(seq: Any, where: str, lim: WireLimits) -> tuple[t.RolloutBatch, ...]:
    _items(seq, where, lim)
    return tuple(_batch_from(b, f"{where}[{i}]", lim) for i, b in enumerate(seq))


def _window_of(m: pb.TrainRequest, lim: WireLimits) -> tuple[int, int]:
    """The rounds a TrainRequest of round ``m.round`` may name: ``round - W + 1 .. round`` (``0 .. round`` when the
    receiver set no window)."""
    return (max(m.round - lim.window + 1, 0) if lim.window else 0), m.round


def _in_window(r: int, where: str, window: tuple[int, int]) -> int:
    if not window[0] <= r <= window[1]:
        _fail(where, f"round {r} outside the window [{window[0]}, {window[1]}]")
    return int(r)


def _table_from(m: pb.CapabilityTable, where: str, lim: WireLimits) -> dict[str, float]:
    """One round's capability table: org ids -> finite values >= 0."""
    return _float_map(m.capability, where, lim, low=0.0)


def _tag_from(m: pb.BatchTag, where: str, lim: WireLimits) -> tuple[str, int, int]:
    """``(source, round, version)``: a named source, round and version >= 0."""
    source = _string(m.source, f"{where}.source", lim.max_name_chars, required=True)
    return source, _at_least(m.round, f"{where}.round"), _at_least(m.version, f"{where}.version")


def _round_tables(m: pb.TrainRequest, where: str, lim: WireLimits) -> dict[int, dict[str, float]]:
    """``round_capability``: rounds of the window, each table's values finite and >= 0."""
    _items(m.round_capability, f"{where}.round_capability", lim)
    window = _window_of(m, lim)
    return {
        _in_window(r, f"{where}.round_capability key", window): _table_from(
            table, f"{where}.round_capability[{r}]", lim
        )
        for r, table in sorted(m.round_capability.items())
    }


def _window_cap(lim: WireLimits) -> int | None:
    """``W x max_sources`` with the receiver's window bounds (asynchronous rounds), else None."""
    return lim.window * lim.max_sources if lim.window and lim.max_sources is not None else None


def _tags_from(m: pb.TrainRequest, where: str, lim: WireLimits) -> tuple[tuple[str, int, int], ...]:
    """``tags``: at most ``W x max_sources`` (with the receiver's bounds), rounds of the window, versions >= 0, one
    per (source, round)."""
    cap = lim.window * lim.max_sources if lim.window and lim.max_sources is not None else lim.max_items
    if len(m.tags) > cap:
        _fail(f"{where}.tags", f"{len(m.tags)} tags exceed the cap of {cap} (window x other orgs)")
    window, out, seen = _window_of(m, lim), [], set()
    for i, msg in enumerate(m.tags):
        at = f"{where}.tags[{i}]"
        tag = _tag_from(msg, at, lim)
        _in_window(tag[1], f"{at}.round", window)
        if tag[:2] in seen:
            _fail(at, f"a second tag for ({tag[0][:40]!r}, {tag[1]})")
        seen.add(tag[:2])
        out.append(tag)
    return tuple(out)


def _source_batches_from(m: pb.TrainRequest, where: str, lim: WireLimits) -> tuple[t.RolloutBatch, ...]:
    """``source_batches``: with the receiver's window, at most ``W x max_sources``, each of a round of the window."""
    if lim.window and lim.max_sources is not None:
        cap = lim.window * lim.max_sources
        if len(m.source_batches) > cap:
            _fail(f"{where}.source_batches", f"{len(m.source_batches)} batches exceed the cap of {cap}")
        window = _window_of(m, lim)
        for i, b in enumerate(m.source_batches):
            _in_window(b.round, f"{where}.source_batches[{i}].round", window)
    return _batches_from(m.source_batches, f"{where}.source_batches", lim)


def _train_req_from(m: pb.TrainRequest, where: str, lim: WireLimits) -> t.TrainRequest:
    _check_version(m, where)
    return t.TrainRequest(
        run_id=_string(m.run_id, f"{where}.run_id", lim.max_name_chars),
        round=_at_least(m.round, f"{where}.round"),
        org_id=_string(m.org_id, f"{where}.org_id", lim.max_name_chars, required=True),
        prompts=_prompts_from(m.prompts, f"{where}.prompts", lim),
        foreign=() if lim.skip_unsigned_foreign else _rollouts_from(m.foreign, f"{where}.foreign", lim),
        capability=_float_map(m.capability, f"{where}.capability", lim, low=0.0),
        source_batches=_source_batches_from(m, where, lim),
        unread_foreign=len(m.foreign) if lim.skip_unsigned_foreign else 0,
        round_capability=_round_tables(m, where, lim),
        tags=_tags_from(m, where, lim),
        version=_at_least(m.version, f"{where}.version"),
    )


def _train_rep_from(m: pb.TrainReport, where: str, lim: WireLimits) -> t.TrainReport:
    _check_version(m, where)
    return t.TrainReport(
        run_id=_string(m.run_id, f"{where}.run_id", lim.max_name_chars),
        round=_at_least(m.round, f"{where}.round"),
        org_id=_string(m.org_id, f"{where}.org_id", lim.max_name_chars, required=True),
        metrics=_accusations(
            _float_map(m.metrics, f"{where}.metrics", lim), f"{where}.metrics", _window_cap(lim), m.disclosed_keys
        ),
        signature=_bytes(m.signature, f"{where}.signature", lim.max_signature_bytes),
        disclosed_keys=_key_map(m.disclosed_keys, f"{where}.disclosed_keys", lim),
        challenge=_bytes(m.challenge, f"{where}.challenge", MAX_KEY_BYTES),
    )


def _accusations(
    metrics: dict[str, float], where: str, cap: int | None = None, keys: Mapping[str, bytes] | None = None
) -> dict[str, float]:
    """``metrics`` of a TrainReport, whose mismatch counters (``trust/<source>/mismatches`` and, asynchronous
    rounds in blind mode, ``trust/<source>/round/<round>/mismatches``: :mod:`hacrl_fed.wire.accusations`) must be
    whole counts >= 0 (an accusation is a count >= 1), a per-round one naming a decimal round; with ``cap`` (the
    receiver's ``W x (orgs - 1)``) at most ``cap`` per-round counters and ``cap`` disclosed ``keys``. Raises
    :class:`WireError` naming the counter otherwise."""
    per_round = 0
    for key, value in metrics.items():
        if not is_counter(key):
            continue
        if not accusation_ok(value):
            _fail(f"{where}[{key[:80]!r}]", f"{value!r} is not a whole count >= 0")
        try:
            per_round += parse_round_counter(key) is not None
        except ValueError as err:
            _fail(f"{where}[{key[:80]!r}]", str(err))
    if cap is not None and per_round > cap:
        _fail(where, f"{per_round} per-round mismatch counters exceed the cap of {cap} (window x other orgs)")
    if cap is not None and keys is not None and len(keys) > cap:
        _fail(where.replace("metrics", "disclosed_keys"), f"{len(keys)} keys exceed the cap of {cap}")
    return metrics


def accusation_ok(value: Any) -> bool:
    """Whether ``value`` is a valid mismatch counter: a finite whole number >= 0 (0: no accusation)."""
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok_type and math.isfinite(value) and value >= 0 and float(value).is_integer()


def check_report(report: t.TrainReport, *, cap: int | None = None) -> None:
    """The accusation rule of ``decode(TrainReport, ...)`` (:func:`_accusations`) for an in-process report, whose
    metrics never passed the codec; ``cap``: asynchronous rounds, ``W x (orgs - 1)`` per-round counters and
    disclosed keys at most. Raises :class:`WireError` naming the counter."""
    _accusations(dict(report.metrics), "TrainReport.metrics", cap, dict(report.disclosed_keys))


def _key_map(m: Mapping[str, bytes], where: str, lim: WireLimits) -> dict[str, bytes]:
    """Disclosed content keys or plan challenges: at most ``max_recipients`` entries, org-id keys, values at most
    :data:`MAX_KEY_BYTES` bytes."""
    if len(m) > lim.max_recipients:
        _fail(where, f"{len(m)} entries exceed the cap of {lim.max_recipients}")
    return {
        _string(k, f"{where} key {k[:40]!r}", lim.max_name_chars, required=True): _bytes(
            v, f"{where}[{k!r}]", MAX_KEY_BYTES
        )
        for k, v in m.items()
    }


def _eval_req_from(m: pb.EvalRequest, where: str, lim: WireLimits) -> t.EvalRequest:
    _check_version(m, where)
    return t.EvalRequest(
        run_id=_string(m.run_id, f"{where}.run_id", lim.max_name_chars),
        round=_at_least(m.round, f"{where}.round"),
        task=_string(m.task, f"{where}.task", lim.max_name_chars),
        prompts=_prompts_from(m.prompts, f"{where}.prompts", lim),
        max_new_tokens=_at_least(m.max_new_tokens, f"{where}.max_new_tokens", 1),
    )


def _eval_rep_from(m: pb.EvalReport, where: str, lim: WireLimits) -> t.EvalReport:
    _check_version(m, where)
    return t.EvalReport(
        run_id=_string(m.run_id, f"{where}.run_id", lim.max_name_chars),
        round=_at_least(m.round, f"{where}.round"),
        org_id=_string(m.org_id, f"{where}.org_id", lim.max_name_chars, required=True),
        accuracy=_in_range(m.accuracy, f"{where}.accuracy", 0.0, 1.0),
        num_prompts=_at_least(m.num_prompts, f"{where}.num_prompts"),
        metrics=_float_map(m.metrics, f"{where}.metrics", lim),
    )


def _step_req_from(m: pb.StepRequest, where: str, lim: WireLimits) -> t.StepRequest:
    _check_version(m, where)
    if not any(m.HasField(part) for part in ("train", "plan", "evaluate", "checkpoint")):
        _fail(where, "neither train, plan, evaluate nor checkpoint is set")
    return t.StepRequest(
        train=_train_req_from(m.train, f"{where}.train", lim) if m.HasField("train") else None,
        plan=_plan_from(m.plan, f"{where}.plan", lim) if m.HasField("plan") else None,
        evaluate=_eval_req_from(m.evaluate, f"{where}.evaluate", lim) if m.HasField("evaluate") else None,
        checkpoint=_ckpt_req_from(m.checkpoint, f"{where}.checkpoint", lim) if m.HasField("checkpoint") else None,
    )


def _step_rep_from(m: pb.StepReply, where: str, lim: WireLimits) -> t.StepReply:
    _check_version(m, where)
    for part, error in (
        ("report", "train_error"),
        ("batch", "generate_error"),
        ("eval_report", "eval_error"),
        ("checkpoint", "checkpoint_error"),
    ):
        if m.HasField(part) and getattr(m, error):
            _fail(where, f"both {part} and {error} are set")
    return t.StepReply(
        report=_train_rep_from(m.report, f"{where}.report", lim) if m.HasField("report") else None,
        batch=_batch_from(m.batch, f"{where}.batch", lim) if m.HasField("batch") else None,
        train_error=_string(m.train_error, f"{where}.train_error", lim.max_text_chars),
        generate_error=_string(m.generate_error, f"{where}.generate_error", lim.max_text_chars),
        eval_report=_eval_rep_from(m.eval_report, f"{where}.eval_report", lim) if m.HasField("eval_report") else None,
        eval_error=_string(m.eval_error, f"{where}.eval_error", lim.max_text_chars),
        checkpoint=_ckpt_rep_from(m.checkpoint, f"{where}.checkpoint", lim) if m.HasField("checkpoint") else None,
        checkpoint_error=_string(m.checkpoint_error, f"{where}.checkpoint_error", lim.max_text_chars),
    )


def _health_req_from(m: pb.HealthRequest, where: str, lim: WireLimits) -> None:
    _check_version(m, where)


def _health_rep_from(m: pb.HealthReply, where: str, lim: WireLimits) -> dict[str, str]:
    _check_version(m, where)
    _items(m.info, f"{where}.info", lim)
    out = {}
    for key, value in m.info.items():
        _string(key, f"{where}.info key {key[:40]!r}", lim.max_name_chars, required=True)
        out[key] = _string(value, f"{where}.info[{key!r}]", lim.max_text_chars)
    return out


def _ckpt_req_from(m: pb.CheckpointRequest, where: str, lim: WireLimits) -> int:
    _check_version(m, where)
    return _at_least(m.round, f"{where}.round")


def _ckpt_rep_from(m: pb.CheckpointReply, where: str, lim: WireLimits) -> str:
    _check_version(m, where)
    return _string(m.path, f"{where}.path", lim.max_path_chars, required=True)


# ------------------------------------------------------------------------------------------------ registry

_TO_PROTO: dict[type, Callable[[Any], Message]] = {
    t.ChatMessage: _chat_to,
    t.Prompt: _prompt_to,
    t.SamplingParams: _sampling_to,
    t.RoundPlan: _plan_to,
    t.Rollout: _rollout_to,
    t.WrappedKey: _wrapped_to,
    t.RolloutBatch: _batch_to,
    t.TrainRequest: _train_req_to,
    t.TrainReport: _train_rep_to,
    t.EvalRequest: _eval_req_to,
    t.EvalReport: _eval_rep_to,
    t.StepRequest: _step_req_to,
    t.StepReply: _step_rep_to,
}
_FROM_PROTO: dict[type[Message], Callable[[Any, str, WireLimits], Any]] = {
    pb.ChatMessage: _chat_from,
    pb.Prompt: _prompt_from,
    pb.SamplingParams: _sampling_from,
    pb.RoundPlan: _plan_from,
    pb.Rollout: _rollout_from,
    pb.WrappedKey: _wrapped_from,
    pb.RolloutBatch: _batch_from,
    pb.TrainRequest: _train_req_from,
    pb.TrainReport: _train_rep_from,
    pb.EvalRequest: _eval_req_from,
    pb.EvalReport: _eval_rep_from,
    pb.StepRequest: _step_req_from,
    pb.StepReply: _step_rep_from,
    pb.HealthRequest: _health_req_from,
    pb.HealthReply: _health_rep_from,
    pb.CheckpointRequest: _ckpt_req_from,
    pb.CheckpointReply: _ckpt_rep_from,
    pb.CapabilityTable: _table_from,  # parts of TrainRequest: {org: Phat} and (source, round, version)
    pb.BatchTag: _tag_from,
}
_PROTO_BY_NAME: dict[str, type[Message]] = {cls.DESCRIPTOR.name: cls for cls in _FROM_PROTO}
_PROTO_BY_DATACLASS: dict[type, type[Message]] = {dc: _PROTO_BY_NAME[dc.__name__] for dc in _TO_PROTO}


def _guarded(name: str, build: Callable[[], Message]) -> Message:
    """Run a protobuf constructor, turning its TypeError / ValueError (bad type, int64 overflow) into WireError."""
    try:
        return build()
    except WireError:
        raise
    except (TypeError, ValueError, OverflowError) as err:
        raise WireError(f"{name}: cannot encode: {err}") from None


def proto_class(kind: type | str) -> type[Message]:
    """The generated message class for a dataclass, message class or message name (``"RolloutBatch"``)."""
    if isinstance(kind, str):
        cls = _PROTO_BY_NAME.get(kind)
    elif kind in _FROM_PROTO:
        cls = kind
    else:
        cls = _PROTO_BY_DATACLASS.get(kind)
    if cls is None:
        raise WireError(f"unknown wire kind {kind!r}; expected one of {sorted(_PROTO_BY_NAME)}")
    return cls


def to_proto(obj: Any) -> Message:
    """Dataclass of :mod:`hacrl_fed.types` -> its ``hacrl_fed.v1`` message (top-level ones stamped with the version)."""
    convert = _TO_PROTO.get(type(obj))
    if convert is None:
        raise WireError(f"cannot encode {type(obj).__name__}: not a hacrl_fed.types dataclass")
    return _guarded(type(obj).__name__, lambda: convert(obj))


def from_proto(msg: Message, *, limits: WireLimits = DEFAULT_LIMITS) -> Any:
    """``hacrl_fed.v1`` message -> dataclass (or plain value for Health / Checkpoint), checking every field."""
    convert = _FROM_PROTO.get(type(msg))
    if convert is None:
        raise WireError(f"cannot decode {type(msg).__name__}: not a hacrl_fed.v1 message")
    return convert(msg, type(msg).DESCRIPTOR.name, limits)


def encode(obj: Any) -> bytes:
    """Dataclass (or an already built ``hacrl_fed.v1`` message) -> deterministic protobuf bytes."""
    msg = obj if type(obj) in _FROM_PROTO else to_proto(obj)
    return msg.SerializeToString(deterministic=True)


def decode(kind: type | str, data: bytes, *, limits: WireLimits = DEFAULT_LIMITS) -> Any:
    """Protobuf bytes of message ``kind`` -> checked dataclass / value (see :func:`from_proto`)."""
    cls = proto_class(kind)
    name = cls.DESCRIPTOR.name
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError(f"{name}: expected bytes, got {type(data).__name__}")
    if len(data) > limits.max_message_bytes:
        raise WireError(f"{name}: {len(data)} bytes exceed the cap of {limits.max_message_bytes}")
    msg = cls()
    try:
        msg.ParseFromString(bytes(data))
    except (DecodeError, RuntimeError, ValueError) as err:
        raise WireError(f"{name}: not a valid serialized message ({err})") from None
    size = msg.ByteSize()  # counts the fields this schema does not declare (protobuf keeps them silently)
    msg.DiscardUnknownFields()  # at every depth
    if (extra := size - msg.ByteSize()) != 0:
        _fail(name, f"{extra} bytes of fields schema v{SCHEMA_VERSION} does not declare (reserved or unknown)")
    return from_proto(msg, limits=limits)


def _rollout_ok(r: t.Rollout, lim: WireLimits) -> bool:
    """:func:`_rollout_problem`'s checks on an in-process :class:`~hacrl_fed.types.Rollout` (no protobuf)."""
    return _rollout_problem(r, r.finish_reason in _FINISH_TO_PB, lim) is None


def _wrapped_ok(keys: Any, lim: WireLimits) -> bool:
    recipients = [w.recipient for w in keys]
    return (
        len(keys) <= lim.max_recipients
        and len(set(recipients)) == len(recipients)
        and all(
            0 < len(w.recipient) <= lim.max_name_chars
            and len(w.ephemeral_public) == EPHEMERAL_PUBLIC_BYTES
            and len(w.wrapped) <= MAX_WRAPPED_BYTES
            for w in keys
        )
    )


def check_batch(batch: t.RolloutBatch, data: bytes, *, limits: WireLimits = DEFAULT_LIMITS) -> None:
    """The decode-time hygiene of ``decode(RolloutBatch, data)`` for an in-process ``batch`` whose encoding is
    ``data`` (``encode(batch)``, with or without its signature), without decoding it when every check passes.

    The checks of :func:`_batch_from` run on the dataclass's own values (the encoding succeeded, so every value has
    a type protobuf holds and decoding would give back equal values); when any fails, ``data`` is decoded, which
    raises the :class:`WireError` naming the field. So this raises exactly when decoding ``data`` raises.
    """
    lim = limits
    metrics = dict(batch.metrics)
    ok = (
        len(data) <= lim.max_message_bytes
        and len(batch.signature) <= lim.max_signature_bytes
        and len(batch.run_id) <= lim.max_name_chars
        and 0 < len(batch.org_id) <= lim.max_name_chars
        and batch.round >= 0
        and 0.0 <= batch.accuracy <= 1.0
        and len(metrics) <= lim.max_items
        and all(0 < len(k) <= lim.max_name_chars and math.isfinite(v) for k, v in metrics.items())
        and len(batch.rollouts) <= lim.max_items
        and all(_rollout_ok(r, lim) for r in batch.rollouts)
        and _wrapped_ok(batch.wrapped_keys, lim)
        and batch.version >= 0
        and len(batch.plan_challenges) <= lim.max_recipients
        and all(0 < len(k) <= lim.max_name_chars and len(v) <= MAX_KEY_BYTES for k, v in batch.plan_challenges.items())
    )
    if not ok:
        decode(t.RolloutBatch, data, limits=lim)  # raises the WireError that names the field
