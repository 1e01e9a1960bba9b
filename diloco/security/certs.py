"""A run's certificates: one CA, and a certificate per worker naming its role and its name.

    diloco certs init --out DIR                         DIR/ca.crt, DIR/ca.key
    diloco certs issue --out DIR --role learner --name host-3 [--host 10.0.0.5]

Each certificate's subject carries the worker's name (common name) and its role (organizational
unit); the coordinator's also names the addresses it serves (subject alternative names). With a
CA set, the coordinator requires a client certificate signed by it on every connection and takes
the caller's role and name from it (diloco.security.transport). Keys are EC P-256, written 0600.

A name is a file name in the CA's directory, so it is one plain token and never `ca`; issuing
over another identity's files is refused without --force (re-issuing the same role and name is
rotation and replaces them). Every file is written to a temporary file beside it and renamed into
place: a key never keeps an older file's permissions, and a symlink at its path is not followed.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from diloco.errors import DilocoError
from diloco.plugins import a_or_an

ROLES = ("coordinator", "learner", "data", "evaluator", "observer", "operator")
VALID_DAYS = 365
CRL_NAME = "ca.crl"  # the CA's certificate revocation list, beside ca.crt
# A name is both a worker id and `<name>.crt`/`<name>.key` beside ca.crt: a DNS-label-like token
# (and '_', '.') cannot climb out of the directory (`..`, `a/b`), hide (`.x`) or be empty.
NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62}[A-Za-z0-9])?")
# The CA's own files; compared without case, for file systems that ignore it.
RESERVED = ("ca",)


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


def _write_file(path: Path, data: bytes, mode: int) -> None:
    """`data` at `path` with `mode`, by a temporary file beside it renamed over it: the rename
    replaces a symlink at `path` instead of writing where it points, and a file already there
    keeps neither its content nor its permissions (O_CREAT's mode applies only to a new file)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)  # mkstemp makes it 0600; a certificate is public
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write_file(path, data, 0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    _write_file(path, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def name_problem(name: str) -> str:
    """Why `name` cannot name a certificate ("" when it can)."""
    if name.lower() in RESERVED:
        return f"--name {name!r} is the CA's own file name (ca.crt, ca.key): choose another"
    if not NAME.fullmatch(name):
        return (
            "--name must be 1-64 letters, digits, '-', '_' or '.', starting and ending with a letter "
            f"or digit, not {name!r}"
        )
    return ""


def _identity(cert: x509.Certificate) -> tuple[str, str]:
    def first(oid: x509.ObjectIdentifier) -> str:
        values = cert.subject.get_attributes_for_oid(oid)
        return str(values[0].value) if values else ""

    return first(NameOID.ORGANIZATIONAL_UNIT_NAME), first(NameOID.COMMON_NAME)


def replace_problem(crt: Path, key: Path, role: str, name: str, ca: x509.Certificate) -> str:
    """Why writing `crt`/`key` would destroy something ("" when nothing is there, or when they hold
    this same role and name from this same CA: issuing again is rotation, and changes no one's
    rights). Another role's files, a symlink, or what is not this CA's certificate is kept."""
    for path in (crt, key):
        if path.is_symlink():
            return f"{path} is a symbolic link"
    if not crt.exists():
        return f"{key} holds a key without its certificate" if key.exists() else ""
    try:
        held = x509.load_pem_x509_certificate(crt.read_bytes())
    except (OSError, ValueError):
        return f"{crt} exists and is not a certificate"
    held_role, held_name = _identity(held)
    if not signed_by(held, ca):
        return f"{crt} holds a certificate from another CA"
    if (held_role, held_name) != (role, name):
        return f"{crt} holds {a_or_an(held_role or 'unknown')}'s certificate ({held_name})"
    return ""


def signed_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    # By signature: two CAs made by `certs init` carry the same subject name.
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """The CA in `ca_dir`; refused when its key does not sign for its certificate (a directory
    whose ca.crt/ca.key a worker's replaced) rather than issuing certificates nobody trusts."""
    hint = f"(run `diloco certs init --out {ca_dir}`)"
    try:
        cert = x509.load_pem_x509_certificate((ca_dir / "ca.crt").read_bytes())
        key = serialization.load_pem_private_key((ca_dir / "ca.key").read_bytes(), password=None)
    except (OSError, ValueError, TypeError, UnsupportedAlgorithm) as e:
        raise DilocoError(f"no usable CA in {ca_dir} {hint}: {e}") from e
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca or not _same_key(cert, key):
        raise DilocoError(
            f"no usable CA in {ca_dir}: ca.key is not the key of a CA certificate in ca.crt "
            "(restore both from where the CA was made, or make a new CA in another directory)"
        )
    return cert, key  # type: ignore[return-value]


def _same_key(cert: x509.Certificate, key: object) -> bool:
    spki = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    public = getattr(key, "public_key", None)
    return public is not None and public().public_bytes(*spki) == cert.public_key().public_bytes(*spki)


def init_ca(out: str | Path, name: str = "diloco run CA") -> Path:
    """A new CA in `out` (ca.crt, ca.key, and an empty revocation list ca.crl, for a coordinator's
    --tls-crl before anything is revoked); refuses to overwrite one."""
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
    _write_cert(out / "ca.crt", cert)
    write_crl(out, cert, key, set())
    return out / "ca.crt"


def write_crl(
    ca_dir: Path, ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, serials: set[int]
) -> Path:
    """The CA's revocation list (`<ca_dir>/ca.crl`) revoking `serials`, replaced whole: a
    coordinator may read it at any moment (diloco.security.revocation)."""
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - datetime.timedelta(minutes=5))
        # A list must say when the next comes; ours is replaced at every revocation, and read as
        # long as the CA is valid.
        .next_update(ca_cert.not_valid_after_utc)
    )
    for serial in sorted(serials):
        revoked = x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now).build()
        builder = builder.add_revoked_certificate(revoked)
    path = ca_dir / CRL_NAME
    tmp = path.with_suffix(".crl.tmp")
    tmp.write_bytes(builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    os.replace(tmp, path)
    return path


def issue(
    ca_dir: str | Path,
    role: str,
    name: str,
    out: str | Path | None = None,
    hosts: tuple[str, ...] = (),
    force: bool = False,
) -> TlsFiles:
    """A certificate for `name` in `role`, signed by the CA in `ca_dir`, written as
    `<out>/<name>.crt` and `<out>/<name>.key` (out: the CA's directory). A coordinator's names the
    hosts it serves (127.0.0.1 and localhost always). Files already there are replaced only when
    they are this role's and name's from this CA (rotation), or with `force`."""
    if role not in ROLES:
        raise DilocoError(f"--role must be one of {', '.join(ROLES)}, not {role!r}")
    if problem := name_problem(name):
        raise DilocoError(problem)
    ca_dir = Path(ca_dir)
    out = Path(out) if out is not None else ca_dir
    ca_cert, ca_key = load_ca(ca_dir)
    out.mkdir(parents=True, exist_ok=True)
    crt_path, key_path = out / f"{name}.crt", out / f"{name}.key"
    if not force and (problem := replace_problem(crt_path, key_path, role, name, ca_cert)):
        raise DilocoError(f"{problem}: choose another --name, or give --force to replace it")
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
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(key_path, key)
    _write_cert(crt_path, cert)
    return TlsFiles(str(crt_path), str(key_path), str(ca_dir / "ca.crt"))


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
    return _identity(x509.load_pem_x509_certificate(pem))


# -- checks of a role's files, before gRPC sees them (it says only "handshaker" or "port in use") --


def certificate_problem(pem: bytes, bundle: bool = False) -> str:
    """Why `pem` is not a certificate ("" when it is); `bundle`: one or more (the run's CA file)."""
    load = x509.load_pem_x509_certificates if bundle else x509.load_pem_x509_certificate
    try:
        load(pem)
    except ValueError:
        return "is not a PEM certificate"
    return ""


def ca_dates_problem(pem: bytes, now: datetime.datetime) -> str:
    """validity_problem of the first out-of-date certificate in a CA file ("" when all are in date)."""
    found = (validity_problem(c, now) for c in x509.load_pem_x509_certificates(pem))
    return next(filter(None, found), "")


def key_problem(cert_pem: bytes, key_pem: bytes) -> str:
    """Why `key_pem` is not the private key of the certificate `cert_pem` ("" when it is)."""
    try:
        key = serialization.load_pem_private_key(key_pem, password=None)
    except TypeError:
        return "is encrypted: gRPC takes only an unencrypted key"
    except (ValueError, UnsupportedAlgorithm):
        return "is not a PEM private key"
    if not _same_key(x509.load_pem_x509_certificate(cert_pem), key):
        return "is not the key of that certificate"
    return ""


def dates_problem(pem: bytes, now: datetime.datetime) -> str:
    """validity_problem of a PEM certificate."""
    return validity_problem(x509.load_pem_x509_certificate(pem), now)


def validity_problem(cert: x509.Certificate, now: datetime.datetime) -> str:
    """Why `cert` is out of date at `now` ("" when it is in date): peers refuse it, saying only
    that they do not trust it."""
    if now > cert.not_valid_after_utc:
        return f"expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
    if now < cert.not_valid_before_utc:
        return f"is not valid before {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (is this machine's clock right?)"
    return ""
