"""Coordinator-blind rollouts: the response text is encrypted end to end, from the source org to the learners.

Scheme (per batch, all primitives from the ``cryptography`` package):

* a fresh random 32-byte **content key** ``K``;
* every rollout's response (UTF-8) is encrypted with **ChaCha20-Poly1305** under ``K``. The nonce is the
  rollout's position in the batch (12 bytes, big-endian), unique within the batch; ``K`` is never reused, so it is
  never stored: ``Rollout.sealed_response = ciphertext || 16-byte tag`` and ``response = ""``. The associated
  data binds the text to its place: ``"hacrl-fed/v1/sealed-response\\0"`` + length-prefixed run id, round, source
  org id, prompt id and sample index, so sealed text cannot be moved to another run, round, org, prompt, sample or
  position without failing to decrypt;
* ``K`` is **wrapped** for each recipient org: a fresh ephemeral X25519 key pair, the shared secret with the
  recipient's roster X25519 key, **HKDF-SHA256** (salt ``"hacrl-fed/v1/wrap\\0"``, info binding run id, round,
  sender org, recipient org, the ephemeral and the recipient public keys) -> a single-use key-encryption key,
  ChaCha20-Poly1305 of ``K`` (zero nonce: the key is used once) -> ``WrappedKey(recipient, ephemeral_public,
  wrapped)`` (32 + 16 = 48 bytes wrapped).

Seal first, then sign (``envelope.signed(seal_batch(batch, recipients), identity)``): the signature covers the
ciphertext and the wrapped keys, so a relay can verify a batch it cannot read, and a receiver verifies before it
decrypts (:func:`open_batch` trusts the header fields it binds, so call it on a verified batch).

What the coordinator (or any non-recipient) still sees: run id, round, source org, recipients, accuracy,
metrics, and per rollout the prompt id, sample index, finish reason, reward, log-prob sum, token count and the
ciphertext, whose length is the UTF-8 length of the text plus 16 — or, with ``security.pad_sealed``, only the
size bucket of the text (the next power of two above its length, at least 64 bytes, at most the plan's text bound
plus one: ISO/IEC 7816-4 padding, a ``0x80`` byte then zeros, inside the ciphertext). It never sees the text.
This module does no I/O; randomness comes from the OS (``os.urandom`` and the key generators).
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Mapping
from typing import NoReturn

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from hacrl_fed.security.envelope import RejectedBatch
from hacrl_fed.security.identity import OrgIdentity, PublicIdentity
from hacrl_fed.types import Rollout, RolloutBatch, WrappedKey

CONTENT_KEY_BYTES = 32
NONCE_BYTES = 12
TAG_BYTES = 16
RESPONSE_DOMAIN = b"hacrl-fed/v1/sealed-response\x00"
WRAP_SALT = b"hacrl-fed/v1/wrap\x00"
WRAP_INFO_DOMAIN = b"hacrl-fed/v1/wrap-info\x00"
_ZERO_NONCE = bytes(NONCE_BYTES)
MIN_BUCKET = 64  # the smallest padded size (security.pad_sealed)


def _field(value: str | bytes) -> bytes:
    """A length-prefixed field: 4-byte big-endian length + bytes (UTF-8 for text)."""
    raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return struct.pack(">I", len(raw)) + raw


def _int(value: int) -> bytes:
    return _field(int(value).to_bytes(8, "big", signed=True))


def _raw(key: X25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _nonce(position: int) -> bytes:
    return position.to_bytes(NONCE_BYTES, "big")


def _response_ad(batch: RolloutBatch, rollout: Rollout) -> bytes:
    return RESPONSE_DOMAIN + b"".join(
        [
            _field(batch.run_id),
            _int(batch.round),
            _field(batch.org_id),
            _int(rollout.prompt_id),
            _int(rollout.sample_index),
        ]
    )


def _kek(shared: bytes, batch: RolloutBatch, recipient: str, ephemeral: bytes, recipient_public: bytes) -> bytes:
    info = WRAP_INFO_DOMAIN + b"".join(
        [
            _field(batch.run_id),
            _int(batch.round),
            _field(batch.org_id),
            _field(recipient),
            _field(ephemeral),
            _field(recipient_public),
        ]
    )
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=WRAP_SALT, info=info).derive(shared)


def _box_public(recipient: str, key: X25519PublicKey | PublicIdentity) -> X25519PublicKey:
    if isinstance(key, PublicIdentity):
        return key.box
    if isinstance(key, X25519PublicKey):
        return key
    raise TypeError(f"recipient {recipient!r}: expected an X25519PublicKey or PublicIdentity, got {type(key).__name__}")


def _wrap(content_key: bytes, batch: RolloutBatch, recipient: str, public: X25519PublicKey) -> WrappedKey:
    ephemeral = X25519PrivateKey.generate()
    eph_raw, recipient_raw = _raw(ephemeral.public_key()), _raw(public)
    try:
        shared = ephemeral.exchange(public)
    except ValueError as err:  # a low-order point: no shared secret
        raise ValueError(f"recipient {recipient!r}: unusable X25519 key ({err})") from None
    kek = _kek(shared, batch, recipient, eph_raw, recipient_raw)
    return WrappedKey(recipient, eph_raw, ChaCha20Poly1305(kek).encrypt(_ZERO_NONCE, content_key, None))


def is_sealed(batch: RolloutBatch) -> bool:
    """True when ``batch`` carries wrapped keys or any sealed response text."""
    return bool(batch.wrapped_keys) or any(r.sealed_response for r in batch.rollouts)


def padded_size(n: int, limit: int) -> int:
    """The bucket a text of ``n`` bytes is padded to (marker included): the next power of two ``>= n + 1``, at
    least :data:`MIN_BUCKET`, at most ``limit + 1`` (the plan's text bound plus the marker), never below
    ``n + 1``."""
    bucket = max(MIN_BUCKET, 1 << n.bit_length())  # a power of two > n
    return max(n + 1, min(bucket, limit + 1))


def pad(text: bytes, limit: int) -> bytes:
    """``text`` + ``0x80`` + zero bytes up to :func:`padded_size` (ISO/IEC 7816-4 padding)."""
    return text + b"\x80" + bytes(padded_size(len(text), limit) - len(text) - 1)


def unpad(data: bytes) -> bytes:
    """Inverse of :func:`pad`; ValueError when ``data`` carries no padding marker."""
    body = data.rstrip(b"\x00")
    if not body.endswith(b"\x80"):
        raise ValueError("no padding marker")
    return body[:-1]


def seal_batch(
    batch: RolloutBatch,
    recipients: Mapping[str, X25519PublicKey | PublicIdentity],
    *,
    pad_limit: int | None = None,
) -> RolloutBatch:
    """Encrypt every rollout's text for ``recipients`` (org id -> X25519 public key or PublicIdentity).

    Returns the batch with ``response = ""`` and ``sealed_response`` set on every rollout, one
    :class:`WrappedKey` per recipient (sorted by org id) and an empty ``signature`` (sign after sealing).
    ``pad_limit`` (``security.pad_sealed``: the plan's text bound in bytes): every text is padded to a size
    bucket before encryption (:func:`padded_size`), so a relay sees only the bucket, not the exact length; open
    with ``padded=True``. Raises ValueError for an already sealed batch, no recipients or an unusable recipient
    key, TypeError for a recipient value of the wrong type.
    """
    if is_sealed(batch):
        raise ValueError(f"batch from {batch.org_id!r} round {batch.round} is already sealed")
    if not recipients:
        raise ValueError("seal_batch: no recipients (nobody could ever read the text)")
    publics = {org: _box_public(org, key) for org, key in recipients.items()}
    for org in publics:
        if not isinstance(org, str) or not org:
            raise ValueError(f"seal_batch: recipient org id {org!r} must be a non-empty string")
    content_key = os.urandom(CONTENT_KEY_BYTES)
    aead = ChaCha20Poly1305(content_key)
    rollouts = tuple(
        dataclasses.replace(
            r,
            response="",
            sealed_response=aead.encrypt(_nonce(i), _plain(r.response, pad_limit), _response_ad(batch, r)),
        )
        for i, r in enumerate(batch.rollouts)
    )
    keys = tuple(_wrap(content_key, batch, org, publics[org]) for org in sorted(publics))
    return dataclasses.replace(batch, rollouts=rollouts, wrapped_keys=keys, signature=b"")


def _plain(text: str, pad_limit: int | None) -> bytes:
    raw = text.encode("utf-8")
    return raw if pad_limit is None else pad(raw, pad_limit)


def _undecryptable(batch: RolloutBatch, org_id: str, why: str) -> NoReturn:
    raise RejectedBatch("undecryptable", f"batch from {batch.org_id!r} round {batch.round} for {org_id!r}: {why}")


def _unwrap(batch: RolloutBatch, org_id: str, box_key: X25519PrivateKey) -> bytes:
    entry = next((w for w in batch.wrapped_keys if w.recipient == org_id), None)
    if entry is None:
        _undecryptable(batch, org_id, "no content key is wrapped for this org")
    try:
        shared = box_key.exchange(X25519PublicKey.from_public_bytes(entry.ephemeral_public))
        kek = _kek(shared, batch, org_id, entry.ephemeral_public, _raw(box_key.public_key()))
        content_key = ChaCha20Poly1305(kek).decrypt(_ZERO_NONCE, entry.wrapped, None)
    except Exception:  # noqa: BLE001 - bad point, wrong key, tampered bytes: all the same to the caller
        _undecryptable(batch, org_id, "the wrapped content key does not open with this org's key")
    if len(content_key) != CONTENT_KEY_BYTES:
        _undecryptable(batch, org_id, f"the content key is {len(content_key)} bytes, expected {CONTENT_KEY_BYTES}")
    return content_key


def _open_rollout(
    aead: ChaCha20Poly1305, batch: RolloutBatch, i: int, r: Rollout, org_id: str, padded: bool
) -> Rollout:
    if not r.sealed_response or r.response:
        _undecryptable(batch, org_id, f"rollouts[{i}] carries no sealed text (or plaintext next to it)")
    try:
        plain = aead.decrypt(_nonce(i), bytes(r.sealed_response), _response_ad(batch, r))
        text = (unpad(plain) if padded else plain).decode("utf-8")
    except Exception:  # noqa: BLE001 - InvalidTag, no padding marker, bad UTF-8
        _undecryptable(batch, org_id, f"rollouts[{i}] does not decrypt (tampered, moved, or padding mismatch)")
    return dataclasses.replace(r, response=text, sealed_response=b"")


def _open(batch: RolloutBatch, org_id: str, box_key: X25519PrivateKey, padded: bool) -> RolloutBatch:
    if not isinstance(batch, RolloutBatch):
        raise RejectedBatch("malformed", f"expected a RolloutBatch, got {type(batch).__name__}")
    if not is_sealed(batch):
        return batch
    aead = ChaCha20Poly1305(_unwrap(batch, org_id, box_key))
    rollouts = tuple(_open_rollout(aead, batch, i, r, org_id, padded) for i, r in enumerate(batch.rollouts))
    return dataclasses.replace(batch, rollouts=rollouts, wrapped_keys=())


def content_key(batch: RolloutBatch, org_id: str, box_key: X25519PrivateKey) -> bytes:
    """The batch's 32-byte content key, unwrapped by recipient ``org_id``: what a learner discloses as evidence
    (TrainReport.disclosed_keys) so the coordinator can open that one batch. RejectedBatch when it does not
    unwrap."""
    return _unwrap(batch, org_id, box_key)


def open_with_content_key(batch: RolloutBatch, key: bytes, *, padded: bool = False) -> RolloutBatch:
    """Open a sealed ``batch`` with its content key itself (the coordinator, given a disclosed key). A wrong key
    fails every rollout's authentication tag: RejectedBatch (``undecryptable``)."""
    if not isinstance(key, (bytes, bytearray)) or len(key) != CONTENT_KEY_BYTES:
        _undecryptable(batch, "coordinator", f"a disclosed content key must be {CONTENT_KEY_BYTES} bytes")
    aead = ChaCha20Poly1305(bytes(key))
    try:
        rollouts = tuple(_open_rollout(aead, batch, i, r, "coordinator", padded) for i, r in enumerate(batch.rollouts))
    except RejectedBatch:
        raise
    except Exception as err:  # noqa: BLE001 - odd field types
        raise RejectedBatch("undecryptable", f"{type(err).__name__}: {err}") from None
    return dataclasses.replace(batch, rollouts=rollouts, wrapped_keys=())


def open_batch(
    batch: RolloutBatch, org_id: str, box_key: X25519PrivateKey | OrgIdentity, *, padded: bool = False
) -> RolloutBatch:
    """Decrypt a sealed ``batch`` as recipient ``org_id`` with its X25519 private key (or its OrgIdentity).

    Returns the batch with plaintext ``response``, empty ``sealed_response`` and no ``wrapped_keys``; the
    ``signature`` is kept (it covers the sealed form, so verify before opening). A batch that is not sealed is
    returned unchanged. Raises :class:`RejectedBatch` (``undecryptable``: no key wrapped for ``org_id``, a wrong
    key, tampered or moved ciphertext, a rollout without sealed text, bad UTF-8; ``malformed``: not a batch) and
    TypeError for a ``box_key`` of the wrong type. ``padded``: the texts were sealed with ``pad_limit`` (the
    run's ``security.pad_sealed``); a mismatch either way is ``undecryptable``.
    """
    if isinstance(box_key, OrgIdentity):
        box_key = box_key.box_key
    if not isinstance(box_key, X25519PrivateKey):
        raise TypeError(f"expected an X25519PrivateKey or OrgIdentity, got {type(box_key).__name__}")
    try:
        return _open(batch, org_id, box_key, padded)
    except RejectedBatch:
        raise
    except Exception as err:  # noqa: BLE001 - odd field types in an in-process batch
        raise RejectedBatch("undecryptable", f"{type(err).__name__}: {err}") from None
