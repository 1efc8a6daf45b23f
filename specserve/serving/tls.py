"""TLS for every gRPC hop, mutual between the services, configured by file paths.

Each service has one certificate and key (`tls_cert_file`, `tls_key_file`): it serves them to its
callers and presents them to the services it calls. `tls_ca_file` is the CA that signs its peers: it
verifies the servers this service dials and, with `tls_client_auth`, the clients that dial it. The
internal services then also check *who* calls (`PeerInterceptor`): the certificate's common name must
be one their settings allow (the target: the router, plus the draft for StreamKV only; the draft: the
router), so a certificate from the same CA for anything else is refused.

`make_local_ca` issues such a set with the `cryptography` library for the local stack and the tests;
in a cluster, cert-manager (or any CA) writes the same three files into a Secret (docs/security.md).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from specserve.errors import InvalidArgument
from specserve.serving.handlers import Continuation, around_calls
from specserve.serving.private_files import private_directory, write_private

logger = logging.getLogger(__name__)

# The common names the local CA issues, and the defaults the services' settings allow.
ROUTER_NAME = "specserve-router"
TARGET_NAME = "specserve-target"
DRAFT_NAME = "specserve-draft"
CLIENT_NAME = "specserve-client"
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1", "[::1]")


@dataclass(frozen=True)
class TlsFiles:
    cert_file: str
    key_file: str
    ca_file: str

    def env(self, prefix: str) -> dict[str, str]:
        """As SPECSERVE_<ROLE>_TLS_* variables."""
        return {
            f"{prefix}TLS_CERT_FILE": self.cert_file,
            f"{prefix}TLS_KEY_FILE": self.key_file,
            f"{prefix}TLS_CA_FILE": self.ca_file,
        }


def _read(path: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise InvalidArgument(f"cannot read TLS file {path!r}: {e.strerror}") from None


def tls_enabled(settings: Any) -> bool:
    return bool(getattr(settings, "tls_cert_file", ""))


def server_credentials(settings: Any) -> grpc.ServerCredentials | None:
    """None for plaintext. With a CA and `tls_client_auth`, callers must present a certificate it signed."""
    if not tls_enabled(settings):
        return None
    ca = _read(settings.tls_ca_file)
    return grpc.ssl_server_credentials(
        [(_read(settings.tls_key_file), _read(settings.tls_cert_file))],
        root_certificates=ca,
        require_client_auth=bool(ca) and settings.tls_client_auth,
    )


def channel_credentials(settings: Any) -> grpc.ChannelCredentials | None:
    """For the calls a service makes to the others: verify them with the CA, present our certificate."""
    if not tls_enabled(settings):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(settings.tls_ca_file),
        private_key=_read(settings.tls_key_file),
        certificate_chain=_read(settings.tls_cert_file),
    )


def server_name_options(name: str) -> list[tuple[str, str]]:
    """Verify the server's certificate against `name` rather than the address's host: replicas are
    dialled by pod IP (dns:/// entries expand to ip:port), which no certificate names."""
    return [("grpc.ssl_target_name_override", name)] if name else []


def open_channel(
    address: str, settings: Any, options: list[tuple[str, Any]], server_name: str = ""
) -> grpc.Channel:
    credentials = channel_credentials(settings)
    if credentials is None:
        return grpc.insecure_channel(address, options=options)
    return grpc.secure_channel(address, credentials, options=[*options, *server_name_options(server_name)])


def is_loopback(host: str) -> bool:
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def peer_name(context: grpc.ServicerContext) -> str:
    """The common name of the caller's verified certificate ("" without one)."""
    names = context.auth_context().get("x509_common_name") or []
    return names[0].decode() if names else ""


class PeerInterceptor(grpc.ServerInterceptor):
    """Only callers whose certificate names an allowed peer get through (PERMISSION_DENIED otherwise).

    `allowed` applies to every method; `per_method` (a method's short name, e.g. "StreamKV") replaces it
    for that method. Health checks are open to all (probes carry no client certificate).
    """

    def __init__(self, allowed: Iterable[str], per_method: dict[str, Iterable[str]] | None = None) -> None:
        self.allowed = frozenset(allowed)
        self.per_method = {name: frozenset(names) for name, names in (per_method or {}).items()}

    def intercept_service(self, continuation: Continuation, details: Any) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or details.method.startswith("/grpc.health.v1."):
            return handler
        allowed = self.per_method.get(details.method.rsplit("/", 1)[-1], self.allowed)

        def check(context: grpc.ServicerContext) -> None:
            if peer_name(context) not in allowed:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, "this caller may not call this method")

        return around_calls(handler, lambda _, context: check(context))


# -- a local CA (the stack and the tests) ---------------------------------------------------------------


def make_local_ca(
    directory: Path,
    names: Iterable[str] = (ROUTER_NAME, TARGET_NAME, DRAFT_NAME, CLIENT_NAME),
    hosts: Iterable[str] = ("localhost", "127.0.0.1"),
    valid_days: int = 30,
) -> dict[str, TlsFiles]:
    """A fresh CA and one certificate per name (server and client use, valid for `hosts`), as PEM files
    in `directory` (made private: 0700, each file 0600). Returns each name's files."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    private_directory(directory)
    now = datetime.datetime.now(datetime.UTC)
    validity = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=valid_days))

    def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
        encoding, pkcs8 = serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8
        write_private(path, key.private_bytes(encoding, pkcs8, serialization.NoEncryption()))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "specserve local CA")])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(validity[0])
        .not_valid_after(validity[1])
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
        .sign(ca_key, hashes.SHA256())
    )
    ca_file = directory / "ca.crt"
    write_private(ca_file, ca_cert.public_bytes(serialization.Encoding.PEM))

    alt_names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            alt_names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            alt_names.append(x509.DNSName(host))
    issued = {}
    for name in names:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(validity[0])
            .not_valid_after(validity[1])
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(name), *alt_names]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
        write_private(cert_file, cert.public_bytes(serialization.Encoding.PEM))
        write_key(key_file, key)
        issued[name] = TlsFiles(str(cert_file), str(key_file), str(ca_file))
    return issued
