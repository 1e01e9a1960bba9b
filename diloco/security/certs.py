"""A run's certificates: one CA, and a certificate per worker naming its role and its name.

    diloco certs init --out DIR                         DIR/ca.crt, DIR/ca.key
    diloco certs issue --out DIR --role learner --name host-3 [--host 10.0.0.5]

Each certificate's subject carries the worker's name (common name) and its role (organizational
unit); the coordinator's also names the addresses it serves (subject alternative names). With a
CA set, the coordinator requires a client certificate signed by it on every connection and takes
the caller's role and name from it (diloco.security.transport). Keys are EC P-256, written 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from diloco.errors import DilocoError
from diloco.plugins import a_or_an

ROLES = ("coordinator", "learner", "data", "evaluator", "observer", "operator")
VALID_DAYS = 365


@dataclass(frozen=True)
class TlsFiles:
    """A role's certificate, its key, and the CA that signed every certificate of the run."""

    cert: str
    key: str
    ca: str

    def read(self) -> tuple[bytes, bytes, bytes]:
        try:
            return Path(self.cert).read_bytes(), Path(self.key).read_bytes(), Path(self.ca).read_bytes()
        except OSError as e:
            raise DilocoError(f"cannot read TLS files: {e}") from e


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def init_ca(out: str | Path, name: str = "diloco run CA") -> Path:
    """A new CA in `out` (ca.crt, ca.key); refuses to overwrite one."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if (out / "ca.key").exists():
        raise DilocoError(
            f"{out} already holds a CA (ca.key): issue certificates with it, or use another --out"
        )
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS * 5))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    _write_key(out / "ca.key", key)
    (out / "ca.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return out / "ca.crt"


def issue(
    ca_dir: str | Path, role: str, name: str, out: str | Path | None = None, hosts: tuple[str, ...] = ()
) -> TlsFiles:
    """A certificate for `name` in `role`, signed by the CA in `ca_dir`, written as
    `<out>/<name>.crt` and `<out>/<name>.key` (out: the CA's directory). A coordinator's names the
    hosts it serves (127.0.0.1 and localhost always)."""
    if role not in ROLES:
        raise DilocoError(f"--role must be one of {', '.join(ROLES)}, not {role!r}")
    if not name or "/" in name or len(name) > 64:
        raise DilocoError(f"a certificate name is 1-64 characters without '/', not {name!r}")
    ca_dir = Path(ca_dir)
    out = Path(out) if out is not None else ca_dir
    out.mkdir(parents=True, exist_ok=True)
    try:
        ca_cert = x509.load_pem_x509_certificate((ca_dir / "ca.crt").read_bytes())
        ca_key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    except (OSError, ValueError) as e:
        raise DilocoError(f"no usable CA in {ca_dir} (run `diloco certs init --out {ca_dir}`): {e}") from e
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
    ]
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    now = datetime.datetime.now(datetime.UTC)
    usage = [ExtendedKeyUsageOID.CLIENT_AUTH] + (
        [ExtendedKeyUsageOID.SERVER_AUTH] if role == "coordinator" else []
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.COMMON_NAME, name),
                    x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    _write_key(out / f"{name}.key", key)
    (out / f"{name}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return TlsFiles(str(out / f"{name}.crt"), str(out / f"{name}.key"), str(ca_dir / "ca.crt"))


def serving_problem(pem: bytes) -> str:
    """Why a certificate cannot be a TLS server's ("" when it can): clients check its extended
    key usage, and only a coordinator's is issued with serverAuth. Without the check, the
    coordinator would start and every client would fail "unsupported certificate purpose"."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError:
        return "is not a PEM certificate"
    try:
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        return ""  # no restriction: any purpose (a certificate from another PKI, say)
    if ExtendedKeyUsageOID.SERVER_AUTH in usage:
        return ""
    role, name = subject_of(pem)
    whose = f"{a_or_an(role)}'s certificate ({name})" if role else f"a client's certificate ({name})"
    return f"is {whose}, not a server's: clients refuse it (unsupported certificate purpose)"


def subject_of(pem: bytes) -> tuple[str, str]:
    """(role, name) of a certificate: its organizational unit and common name."""
    cert = x509.load_pem_x509_certificate(pem)

    def first(oid: x509.ObjectIdentifier) -> str:
        values = cert.subject.get_attributes_for_oid(oid)
        return str(values[0].value) if values else ""

    return first(NameOID.ORGANIZATIONAL_UNIT_NAME), first(NameOID.COMMON_NAME)
