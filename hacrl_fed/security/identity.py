"""Org identities: the keys that sign and open rollout batches, their files, and the roster that pins them.

An org's identity is two Curve25519 keys (the ``cryptography`` package):

* an **Ed25519** signing key: the org signs every batch it publishes (:mod:`hacrl_fed.security.envelope`);
* an **X25519** key-agreement ("box") key: other orgs wrap the content key of sealed rollout text to it
  (:mod:`hacrl_fed.security.sealing`).

Formats:

* public identity, one line: ``"ed25519:<base64 of the raw 32 bytes> x25519:<base64 of the raw 32 bytes>"``
  (standard base64 with padding; :meth:`PublicIdentity.to_text` / :meth:`PublicIdentity.from_text`);
* identity file (private, mode 0600, in a 0700 directory): JSON ``{"format": "hacrl-fed-identity-v1",
  "org_id": ..., "ed25519_private": <base64 raw 32 bytes>, "x25519_private": <base64 raw 32 bytes>,
  "public": <the public identity line>}``;
* roster (public, 0644): YAML mapping ``org_id: "<public identity line>"``; every org pins every other org's
  public identity from it, out of band of the coordinator.

:func:`provision` writes a whole key set (``DIR/identity/<org>.key`` + ``DIR/roster.yaml``) atomically, so
processes that start together agree on one set. Every problem raises :class:`IdentityError` naming the file,
the org and what is wrong.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, NoEncryption, PrivateFormat, PublicFormat

from hacrl_fed.fsio import write_atomic
from hacrl_fed.unique_yaml import DuplicateKey, load_unique

KEY_FILE_FORMAT = "hacrl-fed-identity-v1"
KEY_BYTES = 32  # raw Ed25519 / X25519 keys, private and public
IDENTITY_DIR = "identity"
ROSTER_FILE = "roster.yaml"
_MAX_FILE_BYTES = 1 << 20  # identity files are ~300 bytes; rosters a few KiB per hundred orgs
_ORG_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # same rule as OrgConfig.id (and safe as a file name)


class IdentityError(ValueError):
    """A bad key, identity file or roster; the message names the file / org and what is wrong."""


# ------------------------------------------------------------------------------------------------ raw bytes


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _unb64(text: Any, what: str) -> bytes:
    """Strict base64 of exactly KEY_BYTES bytes (canonical: re-encoding gives the same text)."""
    if not isinstance(text, str):
        raise IdentityError(f"{what}: expected base64 text, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise IdentityError(f"{what}: not valid base64") from None
    if len(raw) != KEY_BYTES:
        raise IdentityError(f"{what}: {len(raw)} bytes, expected {KEY_BYTES}")
    if _b64(raw) != text:
        raise IdentityError(f"{what}: not canonical base64")
    return raw


def _raw_public(key: Ed25519PublicKey | X25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _raw_private(key: Ed25519PrivateKey | X25519PrivateKey) -> bytes:
    return key.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())


def check_org_id(org_id: Any, where: str = "org id") -> str:
    """``org_id`` if it is a valid org id (letters, digits, ``_.-``, at most 64, starting alphanumeric)."""
    if not isinstance(org_id, str) or not _ORG_ID.match(org_id):
        raise IdentityError(
            f"{where}: {org_id!r} is not a valid org id (letters, digits, '_', '.', '-'; "
            "at most 64; starting with a letter or digit)"
        )
    return org_id


# --------------------------------------------------------------------------------------------- identities


@dataclass(frozen=True, eq=False)
class PublicIdentity:
    """An org's public keys: ``sign`` verifies its batches, ``box`` receives content keys wrapped to it.

    Equality and hashing compare the raw key bytes.
    """

    sign: Ed25519PublicKey
    box: X25519PublicKey

    def to_text(self) -> str:
        """``"ed25519:<base64 32 bytes> x25519:<base64 32 bytes>"``."""
        return f"ed25519:{_b64(_raw_public(self.sign))} x25519:{_b64(_raw_public(self.box))}"

    @classmethod
    def from_text(cls, text: Any) -> PublicIdentity:
        """Parse :meth:`to_text`'s format strictly; :class:`IdentityError` says which part is wrong."""
        if not isinstance(text, str):
            raise IdentityError(f"public identity: expected text, got {type(text).__name__}")
        parts = text.split(" ")
        if len(parts) != 2 or not parts[0].startswith("ed25519:") or not parts[1].startswith("x25519:"):
            shown = text if len(text) <= 120 else text[:117] + "..."
            raise IdentityError(f"public identity: expected 'ed25519:<base64> x25519:<base64>', got {shown!r}")
        sign = _unb64(parts[0][len("ed25519:") :], "public identity: ed25519 key")
        box = _unb64(parts[1][len("x25519:") :], "public identity: x25519 key")
        try:
            return cls(Ed25519PublicKey.from_public_bytes(sign), X25519PublicKey.from_public_bytes(box))
        except ValueError as err:
            raise IdentityError(f"public identity: invalid key ({err})") from None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PublicIdentity) and self.to_text() == other.to_text()

    def __hash__(self) -> int:
        return hash(self.to_text())

    def __repr__(self) -> str:
        return f"PublicIdentity({self.to_text()!r})"


@dataclass(frozen=True)
class OrgIdentity:
    """An org's private identity: its id, Ed25519 signing key and X25519 key-agreement key."""

    org_id: str
    sign_key: Ed25519PrivateKey
    box_key: X25519PrivateKey

    def public(self) -> PublicIdentity:
        """The public half, as pinned in the roster."""
        return PublicIdentity(self.sign_key.public_key(), self.box_key.public_key())

    def __repr__(self) -> str:  # never print private keys
        return f"OrgIdentity(org_id={self.org_id!r}, public={self.public().to_text()!r})"


def generate_identity(org_id: str) -> OrgIdentity:
    """A fresh random identity for ``org_id`` (a valid org id, else :class:`IdentityError`)."""
    return OrgIdentity(check_org_id(org_id), Ed25519PrivateKey.generate(), X25519PrivateKey.generate())


# ------------------------------------------------------------------------------------------ identity files


def _mkdir_private(path: Path) -> None:
    """Create ``path`` (and parents) with mode 0700 for the new leaf; an existing directory is left as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        if not path.is_dir():
            raise IdentityError(f"{path} exists and is not a directory") from None


def _write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` exclusively with ``mode`` (umask not applied) and write ``data``; no partial file left."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            fd = -1
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        if fd >= 0:
            os.close(fd)
        path.unlink(missing_ok=True)
        raise


def _write_file(path: Path, data: bytes, mode: int, overwrite: bool) -> None:
    """Write ``data`` to ``path`` with ``mode``: exclusively, or atomically replacing it when ``overwrite``."""
    if not overwrite:
        try:
            _write_new(path, data, mode)
        except FileExistsError:
            raise IdentityError(f"{path} already exists (pass overwrite=True to replace it)") from None
        return
    write_atomic(path, data, mode=mode)


def _identity_json(identity: OrgIdentity) -> bytes:
    doc = {
        "format": KEY_FILE_FORMAT,
        "org_id": identity.org_id,
        "ed25519_private": _b64(_raw_private(identity.sign_key)),
        "x25519_private": _b64(_raw_private(identity.box_key)),
        "public": identity.public().to_text(),
    }
    return (json.dumps(doc, indent=2) + "\n").encode("utf-8")


def save_identity(path: str | Path, identity: OrgIdentity, *, overwrite: bool = False) -> Path:
    """Write ``identity`` to ``path`` (JSON, mode 0600; a new parent directory gets 0700); returns the path.

    Refuses to replace an existing file unless ``overwrite`` (then the file is replaced atomically).
    """
    path = Path(path)
    check_org_id(identity.org_id, f"{path}: org id")
    _mkdir_private(path.parent)
    _write_file(path, _identity_json(identity), 0o600, overwrite)
    return path


def _read_private_file(path: Path) -> bytes:
    """The bytes of ``path``, refusing a symlink, a non-regular file or one group/others can access."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        raise IdentityError(f"no identity file at {path}") from None
    except OSError as err:
        raise IdentityError(f"cannot open identity file {path}: {err.strerror or err}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise IdentityError(f"identity file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise IdentityError(
                f"identity file {path} is accessible by group or others (mode "
                f"{stat.S_IMODE(st.st_mode):04o}); private keys must be 0600: run 'chmod 600 {path}'"
            )
        return f.read(_MAX_FILE_BYTES + 1)


def _parse_identity(data: bytes, path: Path) -> OrgIdentity:
    if len(data) > _MAX_FILE_BYTES:
        raise IdentityError(f"identity file {path} is larger than {_MAX_FILE_BYTES} bytes")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise IdentityError(f"identity file {path} is not JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != KEY_FILE_FORMAT:
        raise IdentityError(f"identity file {path}: not a {KEY_FILE_FORMAT} file (its 'format' field)")
    org_id = check_org_id(doc.get("org_id"), f"identity file {path}: org_id")
    sign = _unb64(doc.get("ed25519_private"), f"identity file {path}: ed25519_private")
    box = _unb64(doc.get("x25519_private"), f"identity file {path}: x25519_private")
    identity = OrgIdentity(org_id, Ed25519PrivateKey.from_private_bytes(sign), X25519PrivateKey.from_private_bytes(box))
    if "public" in doc and doc["public"] != identity.public().to_text():
        raise IdentityError(f"identity file {path}: 'public' does not match its private keys (corrupt file)")
    return identity


def load_identity(path: str | Path, org_id: str | None = None) -> OrgIdentity:
    """Read an identity file written by :func:`save_identity`.

    Raises :class:`IdentityError` when the file is missing, accessible by group/others (``mode & 0o077``; the
    message says to ``chmod 600`` it), malformed, or holds another org than ``org_id`` (when given).
    """
    path = Path(path)
    identity = _parse_identity(_read_private_file(path), path)
    if org_id is not None and identity.org_id != org_id:
        raise IdentityError(f"identity file {path} belongs to org {identity.org_id!r}, not {org_id!r}")
    return identity


# ----------------------------------------------------------------------------------------------- rosters

Roster = Mapping[str, PublicIdentity]
RosterSource = str | os.PathLike | Mapping[str, Any]


def _roster_entries(doc: Any, where: str) -> dict[str, PublicIdentity]:
    if not isinstance(doc, Mapping):
        raise IdentityError(f"{where}: expected a mapping of org id -> public identity, got {type(doc).__name__}")
    if not doc:
        raise IdentityError(f"{where}: no orgs")
    out: dict[str, PublicIdentity] = {}
    for org, value in doc.items():
        check_org_id(org, f"{where}: org id")
        try:
            out[org] = value if isinstance(value, PublicIdentity) else PublicIdentity.from_text(value)
        except IdentityError as err:
            raise IdentityError(f"{where}: org {org!r}: {err}") from None
    _distinct_keys(out, where)
    return out


def _distinct_keys(roster: Mapping[str, PublicIdentity], where: str) -> None:
    """One key, one org: the holder of a key listed for two orgs could speak for both (IdentityError)."""
    for kind in ("sign", "box"):
        seen: dict[bytes, str] = {}
        for org, entry in roster.items():
            raw = _raw_public(getattr(entry, kind))
            if raw in seen:
                raise IdentityError(f"{where}: orgs {seen[raw]!r} and {org!r} share one {kind} key (one key per org)")
            seen[raw] = org


def load_roster(source: RosterSource) -> dict[str, PublicIdentity]:
    """``{org_id: PublicIdentity}`` from a YAML roster file (path) or an already parsed ``{org_id: text}`` mapping.

    Values in a mapping may also be :class:`PublicIdentity`. Errors name the file (or "roster") and the org.
    """
    if isinstance(source, Mapping):
        return _roster_entries(source, "roster")
    path = Path(source)
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_FILE_BYTES + 1)
    except OSError as err:
        raise IdentityError(f"cannot read roster {path}: {err.strerror or err}") from None
    if len(data) > _MAX_FILE_BYTES:
        raise IdentityError(f"roster {path} is larger than {_MAX_FILE_BYTES} bytes")
    try:
        doc = load_unique(data)
    except DuplicateKey as err:
        raise IdentityError(f"roster {path}: org {err}") from None
    except yaml.YAMLError as err:
        raise IdentityError(f"roster {path} is not valid YAML ({err})") from None
    return _roster_entries(doc, f"roster {path}")


def _roster_yaml(roster: Roster) -> bytes:
    entries = _roster_entries(roster, "roster")
    lines = ["# hacrl-fed roster: org id -> public identity (Ed25519 signing key, X25519 box key). Public."]
    lines += [f'"{org}": "{entries[org].to_text()}"' for org in sorted(entries)]  # quoted: "123" stays a str
    return ("\n".join(lines) + "\n").encode("utf-8")


def save_roster(path: str | Path, roster: Roster, *, overwrite: bool = True) -> Path:
    """Write ``roster`` as YAML (mode 0644, orgs sorted), atomically; refuses an existing file unless ``overwrite``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_file(path, _roster_yaml(roster), 0o644, overwrite)
    return path


# -------------------------------------------------------------------------------------------- provisioning


def identity_path(keys_dir: str | Path, org: str) -> Path:
    """``keys_dir/identity/<org>.key``: where :func:`provision` puts ``org``'s private identity."""
    return Path(keys_dir) / IDENTITY_DIR / f"{check_org_id(org)}.key"


def roster_path(keys_dir: str | Path) -> Path:
    """``keys_dir/roster.yaml``: where :func:`provision` puts the public roster."""
    return Path(keys_dir) / ROSTER_FILE


def _missing(out_dir: Path, orgs: list[str]) -> list[str]:
    """What ``out_dir`` lacks of a complete key set for ``orgs`` (empty when complete)."""
    roster_file = roster_path(out_dir)
    if not roster_file.is_file():
        return [str(roster_file)]
    try:
        roster = load_roster(roster_file)
    except IdentityError as err:
        return [str(err)]
    lacking = [f"org {o!r} in {roster_file}" for o in orgs if o not in roster]
    return lacking + [str(identity_path(out_dir, o)) for o in orgs if not identity_path(out_dir, o).is_file()]


def _build_key_set(tmp: Path, orgs: list[str]) -> None:
    identities = [generate_identity(o) for o in orgs]
    for identity in identities:
        save_identity(identity_path(tmp, identity.org_id), identity)
    save_roster(roster_path(tmp), {i.org_id: i.public() for i in identities}, overwrite=False)
    os.chmod(tmp, 0o755)  # the roster is public; identity/ stays 0700


def _install(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Move the finished ``tmp`` set to ``out_dir`` with one rename (an old set goes aside first if overwriting)."""
    old = None
    if overwrite and out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}-{os.urandom(4).hex()}")
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)  # atomic; fails if another process installed a (non-empty) set first
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _check_orgs(orgs: Iterable[str]) -> list[str]:
    orgs = list(orgs)
    if not orgs:
        raise IdentityError("provision: no orgs given")
    for org in orgs:
        check_org_id(org, "provision: org id")
    if len(set(orgs)) != len(orgs):
        raise IdentityError(f"provision: duplicate org ids in {orgs}")
    return orgs


def provision(out_dir: str | Path, orgs: Iterable[str], *, overwrite: bool = False) -> Path:
    """Create a key set for ``orgs`` in ``out_dir``; returns ``out_dir/roster.yaml``.

    Writes ``out_dir/identity/<org>.key`` (0600, directory 0700) per org and ``out_dir/roster.yaml`` (0644).
    The set is built in a temporary directory next to ``out_dir`` and renamed into place, so concurrent callers
    end with one consistent set. A complete existing set (roster + every org's key) is returned unchanged; an
    incomplete one raises :class:`IdentityError` unless ``overwrite`` (which replaces it with a fresh set).
    """
    out_dir, orgs = Path(out_dir), _check_orgs(orgs)
    if not overwrite and _exists_nonempty(out_dir):
        return _existing_set(out_dir, orgs)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        _build_key_set(tmp, orgs)
        try:
            _install(tmp, out_dir, overwrite)
        except OSError:
            if not _exists_nonempty(out_dir):
                raise
            return _existing_set(out_dir, orgs)  # another process won the race
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return roster_path(out_dir)


def _exists_nonempty(path: Path) -> bool:
    return path.exists() and (not path.is_dir() or any(path.iterdir()))


def _existing_set(out_dir: Path, orgs: list[str]) -> Path:
    missing = _missing(out_dir, orgs)
    if missing:
        raise IdentityError(
            f"{out_dir} holds an incomplete key set (missing: {', '.join(missing)}); "
            "pass overwrite=True to replace it with a fresh one"
        )
    return roster_path(out_dir)
