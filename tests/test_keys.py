"""hacrl_fed.security.keys: the CA / SuperLink certificate / SuperNode keys that flwr 1.42 and TLS stacks accept,
worker server and client certificates (a real mutual-TLS handshake is in test_worker_link.py), and org identities."""

from __future__ import annotations

import argparse
import ipaddress
import socket
import ssl
import stat
import threading
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key, load_ssh_private_key
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store

from hacrl_fed.cli.keys import main as main_keys
from hacrl_fed.security.keys import (
    KeyLayout, KeyToolError, client_name, make_ca, make_client_cert, make_server_cert,
    make_supernode_keypair, parse_orgs, parse_san, write_keys,
)


@pytest.fixture(scope="module")
def layout(tmp_path_factory) -> KeyLayout:
    out = tmp_path_factory.mktemp("keys") / "k"
    assert main_keys(["--out", str(out), "--orgs", "acme,globex", "--san", "127.0.0.1", "--san", "localhost",
                      "--san", "my.host", "--san", "10.1.2.3"]) == 0
    return KeyLayout(out)


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_server_chain_verifies_for_every_san(layout):
    ca, server = _cert(layout.ca_cert), _cert(layout.server_cert)
    server.verify_directly_issued_by(ca)
    store = Store([ca])
    for name in ("127.0.0.1", "10.1.2.3"):
        chain = PolicyBuilder().store(store).build_server_verifier(x509.IPAddress(ipaddress.ip_address(name)))
        assert chain.verify(server, [])[0] == server
    for name in ("localhost", "my.host"):
        PolicyBuilder().store(store).build_server_verifier(x509.DNSName(name)).verify(server, [])
    with pytest.raises(x509.verification.VerificationError):
        PolicyBuilder().store(store).build_server_verifier(x509.DNSName("other.host")).verify(server, [])


def test_sans_and_key_usages(layout):
    ca, server = _cert(layout.ca_cert), _cert(layout.server_cert)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.1.2.3"]
    assert san.get_values_for_type(x509.DNSName) == ["localhost", "my.host"]
    ku = server.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.digital_signature and not ku.key_cert_sign
    assert list(server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    assert server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    ca_bc = ca.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert ca_bc.ca is True and ca_bc.path_length == 0
    ca_ku = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ca_ku.key_cert_sign and ca_ku.crl_sign
    key = load_pem_private_key(layout.server_key.read_bytes(), None)
    assert key.public_key().public_numbers() == server.public_key().public_numbers()


def test_a_real_tls_handshake_verifies_the_server(layout):
    """OpenSSL (Python's ssl) accepts the pair: server side loads cert + key, client checks chain and 127.0.0.1."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(layout.server_cert, layout.server_key)
    client_ctx = ssl.create_default_context(cafile=str(layout.ca_cert))
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        conn, _ = listener.accept()
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            tls.sendall(b"ok")

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with client_ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            assert tls.recv(2) == b"ok"
            assert ("IP Address", "127.0.0.1") in tls.getpeercert()["subjectAltName"]
    thread.join(10)
    listener.close()


def test_supernode_keys_load_with_flwrs_own_parsers(layout):
    from flwr.cli.supernode.register import try_load_public_key
    from flwr.supercore.primitives.asymmetric import bytes_to_public_key
    from flwr.supernode.cli.flower_supernode import _try_setup_client_authentication

    for org in ("acme", "globex"):
        registered = bytes_to_public_key(try_load_public_key(layout.supernode_pub(org)))
        args = argparse.Namespace(auth_supernode_private_key=str(layout.supernode_key(org)),
                                  auth_supernode_public_key=None)
        private, public = _try_setup_client_authentication(args)
        assert isinstance(private.curve, ec.SECP384R1)
        assert public.public_numbers() == registered.public_numbers()
    pubs = {layout.supernode_pub(o).read_text().split()[1] for o in ("acme", "globex")}
    assert len(pubs) == 2  # one key pair per org
    assert layout.supernode_pub("acme").read_text().startswith("ecdsa-sha2-nistp384 ")


def test_private_keys_are_owner_only(layout):
    def mode(p: Path) -> int:
        return stat.S_IMODE(p.stat().st_mode)

    for private in (layout.ca_key, layout.server_key, layout.supernode_key("acme"), layout.supernode_key("globex"),
                    layout.worker_key("acme"), layout.worker_client_key("globex"), layout.identity_key("acme")):
        assert mode(private) == 0o600, private
    for public in (layout.ca_cert, layout.server_cert, layout.supernode_pub("acme"), layout.worker_cert("acme"),
                   layout.worker_client_cert("acme"), layout.roster):
        assert mode(public) == 0o644, public
    for directory in (layout.out, layout.out / "supernodes", layout.out / "workers", layout.identity_key("a").parent):
        assert mode(directory) == 0o700, directory


def test_worker_certificates(layout):
    """Per org: a server certificate for its worker (the --san names, serverAuth) and a client certificate
    (CN ORG-client, clientAuth), each signed by the CA and matching its key."""
    ca = _cert(layout.ca_cert)
    store = Store([ca])
    serials = set()
    for org in ("acme", "globex"):
        server, client = _cert(layout.worker_cert(org)), _cert(layout.worker_client_cert(org))
        for cert, key_path in ((server, layout.worker_key(org)), (client, layout.worker_client_key(org))):
            cert.verify_directly_issued_by(ca)
            key = load_pem_private_key(key_path.read_bytes(), None)
            assert key.public_key().public_numbers() == cert.public_key().public_numbers()
            serials.add(cert.serial_number)
        assert list(server.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
            ExtendedKeyUsageOID.SERVER_AUTH]
        san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1", "10.1.2.3"]
        PolicyBuilder().store(store).build_server_verifier(x509.DNSName("localhost")).verify(server, [])
        assert list(client.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
            ExtendedKeyUsageOID.CLIENT_AUTH]
        cn = client.subject.get_attributes_for_oid(x509.oid.NameOID.COMMON_NAME)[0].value
        assert cn == client_name(org) == f"{org}-client"
        assert PolicyBuilder().store(store).build_client_verifier().verify(client, []).chain[0] == client
    assert len(serials) == 4


def test_signing_identities_and_roster(layout):
    from hacrl_fed.security.identity import load_identity, load_roster

    roster = load_roster(layout.roster)
    assert set(roster) == {"acme", "globex"}
    for org in ("acme", "globex"):
        assert load_identity(layout.identity_key(org), org).public() == roster[org]


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    out = tmp_path / "k"
    assert main_keys(["--out", str(out), "--orgs", "acme"]) == 0
    layout = KeyLayout(out)
    before = {p: p.read_bytes() for p in layout.all_files(["acme"])}
    assert main_keys(["--out", str(out), "--orgs", "acme,globex"]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in before} == before
    assert not layout.supernode_key("globex").exists()
    assert main_keys(["--out", str(out), "--orgs", "acme", "--force"]) == 0
    assert layout.ca_key.read_bytes() != before[layout.ca_key]
    assert layout.identity_key("acme").read_bytes() != before[layout.identity_key("acme")]
    assert load_ssh_private_key(layout.supernode_key("acme").read_bytes(), None)
    layout.worker_client_cert("acme").unlink()
    layout.roster.unlink()
    assert main_keys(["--out", str(out), "--orgs", "acme"]) == 2  # any one file left is refused


def test_summary_names_files_and_next_commands(tmp_path, capsys):
    assert main_keys(["--out", str(tmp_path / "k"), "--orgs", "acme"]) == 0
    out = capsys.readouterr().out
    assert "flwr supernode register" in out and "--enable-supernode-auth" in out
    layout = KeyLayout(tmp_path / "k")
    for path in (layout.supernode_key("acme"), layout.worker_cert("acme"), layout.worker_client_cert("acme"),
                 layout.roster, layout.identity_key("acme")):
        assert str(path) in out, path
    assert "--listen unix:" in out and "--tls-client-name acme-client" in out
    assert "SANs: 127.0.0.1, localhost, ::1" in out  # the loopback defaults


@pytest.mark.parametrize("argv, message", [
    (["--orgs", "acme", "--san", "bad host!"], "--san 'bad host!'"),
    (["--orgs", "acme,acme"], "duplicate org ids ['acme']"),
    (["--orgs", " , "], "no org ids"),
    (["--orgs", "acme,gl/obex"], "bad org id 'gl/obex'"),
    (["--orgs", "x,x-client"], "org ids whose files would collide"),
])
def test_bad_input_is_named_and_writes_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "k"
    assert main_keys(["--out", str(out), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_library_functions():
    ca_key, ca = make_ca(days=10)
    key, cert = make_server_cert(ca_key, ca, ["::1"], days=5000)
    assert cert.not_valid_after_utc <= ca.not_valid_after_utc  # never outlives its CA
    cert.verify_directly_issued_by(ca)
    _, client = make_client_cert(ca_key, ca, "x-client", days=5000)
    assert client.not_valid_after_utc <= ca.not_valid_after_utc
    assert client.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    private, public = make_supernode_keypair(comment="x")
    assert public.endswith(b" x\n") and private.startswith(b"-----BEGIN OPENSSH PRIVATE KEY-----")
    assert isinstance(parse_san("::1"), x509.IPAddress) and isinstance(parse_san("A.example"), x509.DNSName)
    assert parse_orgs("acme, globex") == ["acme", "globex"]
    with pytest.raises(KeyToolError, match="at least one --san"):
        make_server_cert(ca_key, ca, [])
    with pytest.raises(KeyToolError, match="days must be >= 1"):
        make_ca(days=0)


def test_write_keys_generates_before_writing(tmp_path):
    with pytest.raises(KeyToolError, match="not an IP address"):
        write_keys(tmp_path / "k", ["acme"], ["no_underscores_allowed"])
    assert not (tmp_path / "k").exists()


def test_each_worker_gets_its_own_link_secret(layout):
    """``workers/ORG.secret``: mode 600, what the worker link reads, different per org."""
    from hacrl_fed.wire.link_secret import read_secret_file

    secrets = {org: read_secret_file(layout.worker_secret(org)) for org in ("acme", "globex")}
    assert all(stat.S_IMODE(layout.worker_secret(org).stat().st_mode) == 0o600 for org in secrets)
    assert len(set(secrets.values())) == 2
