"""Key and certificate tooling for a Flower deployment: ``hacrl-fed keys --out DIR --orgs acme,globex``.

What it writes (private keys mode 600, the rest 644; ``DIR``, ``DIR/supernodes`` and ``DIR/workers`` 700)::

    DIR/ca.pem                      CA certificate: every SuperNode and `flwr` gets it (--root-certificates)
    DIR/ca.key                      CA private key: keep it with the coordinator's operator, offline if possible
    DIR/server.pem                  SuperLink TLS certificate signed by the CA, SANs = --san values
    DIR/server.key                  SuperLink TLS private key
    DIR/supernodes/ORG.key          ORG's SuperNode auth private key (OpenSSH, ECDSA P-384): only ORG gets it
    DIR/supernodes/ORG.pub          its public key (OpenSSH): the coordinator registers it (`flwr supernode register`)
    DIR/workers/ORG.pem, ORG.key    ORG's policy-worker TLS certificate (SANs = --san values, serverAuth) and key
    DIR/workers/ORG-client.pem/.key the client certificate (common name ``ORG-client``, clientAuth) and key that
                                    ORG's SuperNode / coordinator presents to that worker (mutual TLS)
    DIR/workers/ORG.secret          the link secret every call to ORG's worker carries (``hacrl-fed worker
                                    --secret-file``; the coordinator's ``--worker-secret ORG=FILE``, the SuperNode's
                                    ``worker-secret-file``): what an ``--insecure`` loopback worker requires
    DIR/identity_set/roster.yaml    every org's public signing identity (:func:`hacrl_fed.security.identity.provision`)
    DIR/identity_set/identity/ORG.key  ORG's private signing identity: only ORG gets it

Formats are those flwr 1.42 reads: ``flower-superlink --ssl-ca-certfile/--ssl-certfile/--ssl-keyfile`` take PEM;
``flower-supernode --auth-supernode-private-key`` parses the file with ``load_ssh_private_key`` and requires an EC
key; ``flwr supernode register`` parses the public key with ``load_ssh_public_key`` and requires a NIST curve.

TLS keys are ECDSA P-256 (universally supported by TLS stacks); certificates use SHA-256 signatures. The server
certificate carries ``subjectAltName`` (IP entries for IP literals, DNS entries otherwise), ``serverAuth`` extended
key usage, ``digitalSignature`` key usage, and subject / authority key identifiers; the CA is ``CA:TRUE,
pathlen:0`` with ``keyCertSign`` / ``cRLSign``. Worker certificates are built the same way; worker client
certificates carry ``clientAuth`` instead and a URI SAN (workers check their common name: ``--tls-client-name``).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hacrl_fed.security.identity import provision
from hacrl_fed.wire.link_secret import SECRET_BYTES

DEFAULT_SANS = ("127.0.0.1", "localhost", "::1")
CA_DAYS = 3650
SERVER_DAYS = 825  # the longest validity browsers and many TLS stacks still accept for leaf certificates
_CLOCK_SKEW = dt.timedelta(minutes=5)
_ORG_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")  # same rule as OrgConfig.id
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_DNS_NAME = re.compile(rf"^(?=.{{1,253}}$)(\*\.)?{_LABEL}(\.{_LABEL})*$")  # optional leading wildcard label


class KeyToolError(ValueError):
    """Bad input to the key tool (names the bad value) or a refused overwrite."""


# ------------------------------------------------------------------------------------------------ primitives


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "hacrl-fed"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def parse_san(value: str) -> x509.GeneralName:
    """``"127.0.0.1"`` / ``"::1"`` -> ``IPAddress``; ``"my.host"`` -> ``DNSName``; anything else -> KeyToolError."""
    text = value.strip()
    try:
        return x509.IPAddress(ipaddress.ip_address(text))
    except ValueError:
        pass
    if not _DNS_NAME.match(text):
        raise KeyToolError(f"--san {value!r}: not an IP address nor a valid DNS name")
    return x509.DNSName(text.lower())


def make_ca(
    common_name: str = "hacrl-fed CA", days: int = CA_DAYS
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A fresh CA: ECDSA P-256 key and a self-signed ``CA:TRUE, pathlen:0`` certificate valid ``days`` days."""
    if days < 1:
        raise KeyToolError(f"days must be >= 1, got {days}")
    key = ec.generate_private_key(ec.SECP256R1())
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - _CLOCK_SKEW)
        .not_valid_after(_now() + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf_cert(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    common_name: str,
    usage: x509.ObjectIdentifier,
    names: list[x509.GeneralName],
    days: int,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A P-256 key and a CA-signed end-entity certificate with extended key usage ``usage`` and SANs ``names``."""
    if days < 1:
        raise KeyToolError(f"days must be >= 1, got {days}")
    key = ec.generate_private_key(ec.SECP256R1())
    not_after = min(_now() + dt.timedelta(days=days), ca_cert.not_valid_after_utc)
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now() - _CLOCK_SKEW)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    cert = (
        builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def make_server_cert(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    sans: list[str] | tuple[str, ...] = DEFAULT_SANS,
    common_name: str = "hacrl-fed superlink",
    days: int = SERVER_DAYS,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A TLS server key (P-256) and certificate signed by the CA, valid for every name/IP in ``sans``.

    Used for the SuperLink and for each policy worker. Raises KeyToolError for an empty ``sans``, a malformed
    entry, or ``days`` < 1.
    """
    if not sans:
        raise KeyToolError("at least one --san is needed (the host name or IP the SuperNodes dial)")
    names = list(dict.fromkeys(parse_san(s) for s in sans))  # parsed (errors name the bad value), deduplicated
    return _leaf_cert(ca_key, ca_cert, common_name, ExtendedKeyUsageOID.SERVER_AUTH, names, days)


def client_name(org: str) -> str:
    """Common name of ``org``'s worker client certificate (what ``hacrl-fed worker --tls-client-name`` pins)."""
    return f"{org}-client"


def make_client_cert(
    ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, common_name: str, days: int = SERVER_DAYS
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A TLS client key (P-256) and certificate signed by the CA: ``clientAuth``, subject CN ``common_name`` and
    the URI SAN ``urn:hacrl-fed:client:<common_name>`` (web-PKI client verifiers require a SAN)."""
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(f"urn:hacrl-fed:client:{common_name}")]
    return _leaf_cert(ca_key, ca_cert, common_name, ExtendedKeyUsageOID.CLIENT_AUTH, names, days)


def make_supernode_keypair(comment: str = "") -> tuple[bytes, bytes]:
    """A SuperNode auth key pair, ECDSA P-384, as ``(OpenSSH private key bytes, OpenSSH public key line)``.

    The public line is ``ecdsa-sha2-nistp384 <base64> [comment]\\n``; flwr 1.42 loads the private file with
    ``load_ssh_private_key`` and the public one with ``load_ssh_public_key``.
    """
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
    )
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
    if comment:
        public += b" " + comment.encode()
    return private, public + b"\n"


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    """Unencrypted PKCS#8 PEM of a private key (what ``--ssl-keyfile`` reads)."""
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def cert_pem(cert: x509.Certificate) -> bytes:
    """PEM of a certificate."""
    return cert.public_bytes(serialization.Encoding.PEM)


# ------------------------------------------------------------------------------------------------ files


@dataclass(frozen=True)
class KeyLayout:
    """Where ``hacrl-fed keys`` puts each file under ``out``."""

    out: Path

    @property
    def ca_cert(self) -> Path:
        return self.out / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.out / "ca.key"

    @property
    def server_cert(self) -> Path:
        return self.out / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.out / "server.key"

    def supernode_key(self, org: str) -> Path:
        return self.out / "supernodes" / f"{org}.key"

    def supernode_pub(self, org: str) -> Path:
        return self.out / "supernodes" / f"{org}.pub"

    def worker_cert(self, org: str) -> Path:
        """``org``'s policy-worker TLS certificate (``hacrl-fed worker --tls-cert``)."""
        return self.out / "workers" / f"{org}.pem"

    def worker_key(self, org: str) -> Path:
        """Its private key (``--tls-key``)."""
        return self.out / "workers" / f"{org}.key"

    def worker_secret(self, org: str) -> Path:
        """The link secret of ``org``'s worker (:mod:`hacrl_fed.wire.link_secret`, ``--secret-file``)."""
        return self.out / "workers" / f"{org}.secret"

    def worker_client_cert(self, org: str) -> Path:
        """The client certificate ``org``'s SuperNode / coordinator presents to that worker (``worker-cert``)."""
        return self.out / "workers" / f"{org}-client.pem"

    def worker_client_key(self, org: str) -> Path:
        """Its private key (``worker-key``)."""
        return self.out / "workers" / f"{org}-client.key"

    @property
    def identity_set(self) -> Path:
        """Directory of the orgs' signing identities (:func:`hacrl_fed.security.identity.provision`)."""
        return self.out / "identity_set"

    @property
    def roster(self) -> Path:
        return self.identity_set / "roster.yaml"

    def identity_key(self, org: str) -> Path:
        return self.identity_set / "identity" / f"{org}.key"

    def org_files(self, org: str) -> list[Path]:
        """Every file made for ``org`` (TLS and SuperNode keys, and its identity key)."""
        return [
            self.supernode_key(org),
            self.supernode_pub(org),
            self.worker_cert(org),
            self.worker_key(org),
            self.worker_client_cert(org),
            self.worker_client_key(org),
            self.worker_secret(org),
            self.identity_key(org),
        ]

    def all_files(self, orgs: list[str]) -> list[Path]:
        files = [self.ca_cert, self.ca_key, self.server_cert, self.server_key, self.roster]
        for org in orgs:
            files += self.org_files(org)
        return files


def parse_orgs(text: str) -> list[str]:
    """``"acme,globex"`` -> ``["acme", "globex"]``; KeyToolError for an empty list, a bad id or a duplicate."""
    orgs = [o.strip() for o in text.split(",") if o.strip()]
    if not orgs:
        raise KeyToolError(f"--orgs {text!r}: no org ids (expected e.g. acme,globex)")
    for org in orgs:
        if not _ORG_ID.match(org):
            raise KeyToolError(f"--orgs: bad org id {org!r} (letters, digits, '_', '.', '-'; at most 64)")
    dupes = sorted({o for o in orgs if orgs.count(o) > 1})
    if dupes:
        raise KeyToolError(f"--orgs: duplicate org ids {dupes}")
    return orgs


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` created with ``mode`` (never briefly world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)  # the umask may have cleared bits of a 644 file


def write_keys(
    out: str | Path, orgs: list[str], sans: list[str] | tuple[str, ...] = DEFAULT_SANS, *, force: bool = False
) -> KeyLayout:
    """Create the CA, the SuperLink certificate, and per org a SuperNode key pair, a worker certificate, a worker
    client certificate and a signing identity, under ``out`` (see the module docstring for the layout).

    Refuses (KeyToolError listing them) if any target file exists, unless ``force``. Everything is generated
    before anything is written, so bad input leaves ``out`` untouched.
    """
    layout = KeyLayout(Path(out))
    files = layout.all_files(orgs)
    clashes = sorted({str(p) for p in files if files.count(p) > 1})
    if clashes:
        raise KeyToolError(f"--orgs: org ids whose files would collide {clashes} (e.g. 'x' and 'x-client')")
    existing = [str(p) for p in files if p.exists()]
    if existing and not force:
        raise KeyToolError(f"refusing to overwrite existing key files {existing} (pass --force to replace them)")
    ca_key, ca_cert = make_ca()
    pems = {layout.ca_key: key_pem(ca_key), layout.ca_cert: cert_pem(ca_cert)}
    pems.update(_tls_pair(layout.server_key, layout.server_cert, make_server_cert(ca_key, ca_cert, sans)))
    for org in orgs:
        private, public = make_supernode_keypair(comment=f"hacrl-fed-supernode-{org}")
        pems.update({layout.supernode_key(org): private, layout.supernode_pub(org): public})
        worker = make_server_cert(ca_key, ca_cert, sans, common_name=f"hacrl-fed worker {org}")
        pems.update(_tls_pair(layout.worker_key(org), layout.worker_cert(org), worker))
        client = make_client_cert(ca_key, ca_cert, client_name(org))
        pems.update(_tls_pair(layout.worker_client_key(org), layout.worker_client_cert(org), client))
        pems[layout.worker_secret(org)] = (secrets.token_hex(SECRET_BYTES) + "\n").encode()
    for directory in (layout.out, layout.out / "supernodes", layout.out / "workers"):
        directory.mkdir(parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
    write_identities(layout, orgs, force=force)  # may refuse (an incomplete old set): before any TLS file
    for path, data in pems.items():
        _write(path, data, 0o600 if path.suffix in (".key", ".secret") else 0o644)
    return layout


def _tls_pair(
    key_path: Path, cert_path: Path, pair: tuple[ec.EllipticCurvePrivateKey, x509.Certificate]
) -> dict[Path, bytes]:
    return {key_path: key_pem(pair[0]), cert_path: cert_pem(pair[1])}


def write_identities(layout: KeyLayout, orgs: list[str], *, force: bool = False) -> Path:
    """Each org's signing identity and the roster under ``layout.identity_set``; the roster path."""
    try:
        return provision(layout.identity_set, orgs, overwrite=force)
    except ValueError as err:  # IdentityError: names the file and the problem
        raise KeyToolError(f"signing identities: {err}") from None


def summary(layout: KeyLayout, orgs: list[str], sans: list[str] | tuple[str, ...]) -> str:
    """Human-readable list of the files written and the commands that use them."""
    d = layout
    lines = [
        f"wrote keys to {d.out}/ (SANs: {', '.join(sans)})",
        f"  {d.ca_cert}      CA certificate -> every organization and every `flwr` user",
        f"  {d.ca_key}      CA private key -> keep it safe (mode 600), it is needed only to re-issue certificates",
        f"  {d.server_cert}  SuperLink certificate",
        f"  {d.server_key}  SuperLink private key (mode 600)",
    ]
    for org in orgs:
        lines.append(f"  {d.supernode_key(org)}  {org}'s SuperNode auth key (mode 600) -> give only to {org}")
        lines.append(f"  {d.supernode_pub(org)}  {org}'s public key -> register it on the SuperLink")
        lines.append(
            f"  {d.worker_cert(org)}, {d.worker_key(org).name}  {org}'s worker TLS certificate and key "
            f"(mode 600) -> give only to {org}"
        )
        lines.append(
            f"  {d.worker_client_cert(org)}, {d.worker_client_key(org).name}  client certificate "
            f"({client_name(org)}) and key for {org}'s SuperNode -> give only to {org}"
        )
        lines.append(
            f"  {d.worker_secret(org)}  {org}'s worker link secret (mode 600) -> {org}'s worker and its caller"
        )
    if d.roster.exists():
        lines.append(f"  {d.roster}  every org's public signing identity -> every organization")
        lines += [f"  {d.identity_key(org)}  {org}'s signing identity (mode 600) -> give only to {org}" for org in orgs]
    lines += [
        "next (see docs/DEPLOYMENT.md):",
        f"  coordinator: flower-superlink --ssl-ca-certfile {d.ca_cert} --ssl-certfile {d.server_cert} "
        f"--ssl-keyfile {d.server_key} --enable-supernode-auth --port 9093",
    ]
    lines += [f"  coordinator: flwr supernode register {d.supernode_pub(org)} NAME" for org in orgs]
    org = orgs[0]
    lines.append(
        f"  org {org}:    hacrl-fed worker --config RUN.yaml --org {org} --listen unix:/PRIVATE/DIR/{org}.sock"
    )
    lines.append(
        f"     or TCP:   hacrl-fed worker --config RUN.yaml --org {org} --listen 127.0.0.1:50051 "
        f"--tls-cert {d.worker_cert(org)} --tls-key {d.worker_key(org)} --tls-ca {d.ca_cert} "
        f"--tls-client-name {client_name(org)}"
    )
    lines.append(
        f"  org {org}:    flower-supernode --superlink HOST:9093 --root-certificates ca.pem "
        f"--auth-supernode-private-key {org}.key "
        f'--node-config \'org="{org}" worker="unix:/PRIVATE/DIR/{org}.sock"\''
    )
    return "\n".join(lines)
