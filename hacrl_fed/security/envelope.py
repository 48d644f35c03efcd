"""Signed rollout batches: every org signs what it publishes; every receiver verifies against the pinned roster.

What is signed. The source org signs, with its Ed25519 identity key (:mod:`hacrl_fed.security.identity`),

    canonical_bytes(batch) = b"hacrl-fed/v1/RolloutBatch\\x00" + codec.encode(batch with signature = b"")

that is, the deterministic protobuf encoding of the whole ``RolloutBatch`` except the signature itself: run id,
round, org id, accuracy, metrics, every rollout (text or sealed text, reward, log-prob, token count, ...) and the
wrapped content keys of a sealed batch. The prefix separates these signatures from any other use of the key.
Batches are sealed first and signed after (encrypt-then-sign: ``signed(seal_batch(...), key)``), so the
signature also covers the ciphertext and anyone, the coordinator included, can verify without decrypting.

The envelope is the ``RolloutBatch`` protobuf with ``signature`` set (:func:`sign_batch`). A receiver checks, in
this order (:func:`verify_batch` / :func:`verify_signed`), and raises :class:`RejectedBatch` with a short
``reason`` code on the first failure:

1. the bytes decode under the codec's hygiene rules and are exactly the canonical encoding (``malformed``);
2. ``org_id`` is in the receiver's roster (``unknown_org``);
3. the 64-byte signature verifies over ``canonical_bytes`` with that org's roster key (``bad_signature``);
4. ``run_id`` and ``round`` are the ones the receiver expects (``wrong_run``, ``wrong_round``: replays of another
   run or an earlier round);
5. every rollout names the batch's org and round (``malformed``).

Header fields are trusted only after the signature checks. Verification is pure: no I/O, no clock.
What signing does not hide: everything is readable by whoever relays the batch unless the text is sealed
(:mod:`hacrl_fed.security.sealing`), and even then rewards, log-probs, counts and sizes stay visible.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NoReturn

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from hacrl_fed.security.identity import OrgIdentity, PublicIdentity
from hacrl_fed.types import RolloutBatch
from hacrl_fed.wire import codec
from hacrl_fed.wire.codec import WireError

DOMAIN = b"hacrl-fed/v1/RolloutBatch\x00"
SIGNATURE_BYTES = 64

REASONS = {
    "bad_signature": "bad signature",
    "unknown_org": "unknown org",
    "wrong_run": "wrong run",
    "wrong_round": "wrong round",
    "malformed": "malformed",
    "undecryptable": "undecryptable",
    "stale_plan": "stale plan",  # hacrl_fed.security.freshness: not made for the learner's own fresh plan
}


class RejectedBatch(ValueError):
    """A batch a receiver refuses. ``reason`` is a short code (a key of :data:`REASONS`), ``detail`` the specifics.

    The message reads ``"<reason in words>: <detail>"``, e.g. ``"bad signature: batch from 'acme' ..."``.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        if reason not in REASONS:
            raise ValueError(f"unknown rejection reason {reason!r} (expected one of {sorted(REASONS)})")
        self.reason, self.detail = reason, detail
        super().__init__(f"{REASONS[reason]}: {detail}" if detail else REASONS[reason])

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across processes (Flower, multiprocessing)
        return (type(self), (self.reason, self.detail))


def _reject(reason: str, detail: str) -> NoReturn:
    raise RejectedBatch(reason, detail)


def canonical_bytes(batch: RolloutBatch) -> bytes:
    """The bytes a signature covers: :data:`DOMAIN` + the deterministic encoding of ``batch`` without signature.

    Raises :class:`~hacrl_fed.wire.codec.WireError` when ``batch`` cannot be encoded.
    """
    if not isinstance(batch, RolloutBatch):
        raise WireError(f"canonical_bytes: expected a RolloutBatch, got {type(batch).__name__}")
    return DOMAIN + codec.encode(dataclasses.replace(batch, signature=b""))


def _signing_key(private_key: Ed25519PrivateKey | OrgIdentity, batch: RolloutBatch) -> Ed25519PrivateKey:
    if isinstance(private_key, OrgIdentity):
        if private_key.org_id != batch.org_id:
            raise ValueError(f"identity of org {private_key.org_id!r} cannot sign a batch of org {batch.org_id!r}")
        return private_key.sign_key
    if isinstance(private_key, Ed25519PrivateKey):
        return private_key
    raise TypeError(f"expected an Ed25519PrivateKey or OrgIdentity, got {type(private_key).__name__}")


def signed(batch: RolloutBatch, private_key: Ed25519PrivateKey | OrgIdentity) -> RolloutBatch:
    """``batch`` with ``signature`` = Ed25519 over :func:`canonical_bytes` (the in-process form of an envelope).

    An :class:`OrgIdentity` must belong to ``batch.org_id`` (ValueError). Sign after sealing.
    """
    key = _signing_key(private_key, batch)
    return dataclasses.replace(batch, signature=key.sign(canonical_bytes(batch)))


def sign_batch(batch: RolloutBatch, private_key: Ed25519PrivateKey | OrgIdentity) -> bytes:
    """The envelope: the serialized ``RolloutBatch`` protobuf of :func:`signed` ``(batch, private_key)``."""
    return codec.encode(signed(batch, private_key))


def _public_key(roster: Mapping[str, Any], org_id: str) -> Ed25519PublicKey:
    try:
        entry = roster.get(org_id) if isinstance(roster, Mapping) else None
    except Exception:  # a roster type whose lookup fails: treat as no entry
        entry = None
    if entry is None:
        _reject("unknown_org", f"org {org_id[:64]!r} is not in the roster")
    if isinstance(entry, PublicIdentity):
        return entry.sign
    if isinstance(entry, Ed25519PublicKey):
        return entry
    _reject("unknown_org", f"roster entry for {org_id!r} is a {type(entry).__name__}, not a public identity")


def _check_signature(batch: RolloutBatch, roster: Mapping[str, Any]) -> bytes:
    """Raises RejectedBatch unless ``batch`` is signed by its org's roster key; returns the signed body
    (:func:`canonical_bytes`), so the caller need not encode the batch again."""
    if not isinstance(batch.org_id, str):
        _reject("malformed", f"org_id is a {type(batch.org_id).__name__}")
    key = _public_key(roster, batch.org_id)
    if not isinstance(batch.signature, (bytes, bytearray)) or len(batch.signature) != SIGNATURE_BYTES:
        size = len(batch.signature) if isinstance(batch.signature, (bytes, bytearray)) else "no"
        _reject("bad_signature", f"batch from {batch.org_id!r} has {size} signature bytes, expected {SIGNATURE_BYTES}")
    try:
        body = canonical_bytes(batch)
    except WireError as err:
        _reject("malformed", f"batch from {batch.org_id!r} cannot be encoded ({err})")
    try:
        key.verify(bytes(batch.signature), body)
    except InvalidSignature:
        _reject("bad_signature", f"batch from {batch.org_id!r} is not signed by that org's roster key")
    return body


def _check_header(batch: RolloutBatch, run_id: str, round: int) -> None:
    if batch.run_id != run_id:
        _reject("wrong_run", f"batch from {batch.org_id!r} is for run {batch.run_id[:64]!r}, expected {run_id!r}")
    if batch.round != round:
        _reject("wrong_round", f"batch from {batch.org_id!r} is for round {batch.round}, expected {round}")
    for i, r in enumerate(batch.rollouts):
        if r.org_id != batch.org_id or r.round != batch.round:
            _reject(
                "malformed",
                f"batch from {batch.org_id!r} round {batch.round}: rollouts[{i}] names org "
                f"{str(r.org_id)[:64]!r} round {r.round}",
            )


def _check_shapes(batch: RolloutBatch, body: bytes) -> None:
    """Run the codec's decode-time hygiene on an in-process batch (it never crossed the wire): exactly the checks
    of decoding its signed ``body`` (:func:`canonical_bytes`: the batch's encoding less the 64 signature bytes,
    whose size the signature check already held to exactly 64), on the batch's own values
    (:func:`hacrl_fed.wire.codec.check_batch`)."""
    try:
        codec.check_batch(batch, body[len(DOMAIN) :])
    except WireError as err:
        _reject("malformed", f"batch from {batch.org_id!r}: {err}")


def _verify(batch: Any, roster: Mapping[str, Any], run_id: str, round: int, *, decoded: bool) -> RolloutBatch:
    if not isinstance(batch, RolloutBatch):
        _reject("malformed", f"expected a RolloutBatch, got {type(batch).__name__}")
    body = _check_signature(batch, roster)
    if not decoded:
        _check_shapes(batch, body)
    _check_header(batch, run_id, round)
    return batch


def _guard(fn: Any, *args: Any, **kwargs: Any) -> RolloutBatch:
    """Call ``fn``; anything but :class:`RejectedBatch` it raises becomes ``RejectedBatch("malformed")``."""
    try:
        return fn(*args, **kwargs)
    except RejectedBatch:
        raise
    except Exception as err:  # noqa: BLE001 - the contract: verify_* raise nothing else, whatever the input
        raise RejectedBatch("malformed", f"{type(err).__name__}: {err}") from None


def verify_signed(batch: RolloutBatch, roster: Mapping[str, Any], *, run_id: str, round: int) -> RolloutBatch:
    """Check an in-process signed ``batch`` (see the module docstring for the order) and return it.

    ``roster`` maps org id -> :class:`PublicIdentity` or ``Ed25519PublicKey``. Raises only :class:`RejectedBatch`
    (reasons ``unknown_org``, ``bad_signature``, ``wrong_run``, ``wrong_round``, ``malformed``).
    """
    return _guard(_verify, batch, roster, run_id, round, decoded=False)


def _decode_envelope(envelope: Any) -> RolloutBatch:
    if not isinstance(envelope, (bytes, bytearray, memoryview)):
        _reject("malformed", f"expected envelope bytes, got {type(envelope).__name__}")
    data = bytes(envelope)
    try:
        batch = codec.decode(RolloutBatch, data)
    except WireError as err:
        _reject("malformed", str(err))
    if codec.encode(batch) != data:  # unknown fields, duplicates, non-minimal varints: not what was signed
        _reject("malformed", "the envelope is not the canonical encoding of its batch")
    return batch


def _verify_envelope(envelope: Any, roster: Mapping[str, Any], run_id: str, round: int) -> RolloutBatch:
    return _verify(_decode_envelope(envelope), roster, run_id, round, decoded=True)


def verify_batch(envelope: bytes, roster: Mapping[str, Any], *, run_id: str, round: int) -> RolloutBatch:
    """Decode an envelope from :func:`sign_batch` and verify it; returns the (still sealed, if sealed) batch.

    Any decode problem, or bytes that are not exactly the canonical encoding, is ``malformed``; then as
    :func:`verify_signed`. Raises only :class:`RejectedBatch`, whatever ``envelope`` is.
    """
    return _guard(_verify_envelope, envelope, roster, run_id, round)
