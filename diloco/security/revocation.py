"""Taking a certificate back during a run: a certificate revocation list (CRL), signed by the
run's CA, that the coordinator reads at start and again whenever the file changes.

    diloco certs revoke --out pki --name host-3      adds host-3.crt's serial to pki/ca.crl
    diloco coordinator ... --tls-crl pki/ca.crl       every call of a revoked certificate refused

gRPC's Python server has no CRL setting, so the check is the guard's (diloco.security.guard), per
call, by the serial number of the certificate the caller presented. A learner whose key has
leaked, or whose host is found pushing deltas that steer the model, is cut off at its next call,
without restarting the run or making a new CA; its worker is lost at that call (its leases back
in the pool, no round waiting for it: service/membership.caller_revoked). A
certificate issued again under the same name (rotation) has a new serial, and is not revoked.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cryptography import x509

from diloco.errors import DilocoError
from diloco.security.certs import CRL_NAME, load_ca, signed_by, subject_of, write_crl
from diloco.security.watched import WatchedFile

log = logging.getLogger("diloco.security")

# How the guard's refusal of a revoked certificate ends: a client tells it from other identity
# refusals by this (compute/rpc_outcome), as only the refusal's text crosses the wire.
REVOKED = "is revoked"


def revoked_refusal(role: str, name: str, serial: int) -> str:
    return f"the certificate of {name} ({role}, serial {serial:x}) {REVOKED}"


def serial_of(pem: bytes) -> int:
    return x509.load_pem_x509_certificate(pem).serial_number


def revoke(ca_dir: str | Path, cert_path: str | Path) -> tuple[Path, int, str, str]:
    """Add the certificate at `cert_path` to the CA's revocation list (`<ca_dir>/ca.crl`, made
    if absent; the serials already in it are kept). Returns (the list's path, the serial, the
    certificate's role and name). Refused for a certificate this CA did not issue."""
    ca_dir = Path(ca_dir)
    ca_cert, ca_key = load_ca(ca_dir)
    try:
        pem = Path(cert_path).read_bytes()
        cert = x509.load_pem_x509_certificate(pem)
    except (OSError, ValueError) as e:
        raise DilocoError(f"cannot read the certificate to revoke ({cert_path}): {e}") from e
    if not signed_by(cert, ca_cert):
        raise DilocoError(f"{cert_path} was not issued by the CA in {ca_dir}: revoke it with its own CA")
    crl_path = ca_dir / CRL_NAME
    serials = {cert.serial_number}
    if crl_path.exists():
        try:
            serials |= revoked_serials(crl_path.read_bytes(), ca_cert)
        except DilocoError as e:
            raise DilocoError(f"{crl_path} {e}: move it away to start a new list") from e
    write_crl(ca_dir, ca_cert, ca_key, serials)
    role, name = subject_of(pem)
    return crl_path, cert.serial_number, role, name


def revoked_serials(crl_pem: bytes, ca: x509.Certificate) -> frozenset[int]:
    """The serials a CRL revokes, once its signature is checked against the CA's key."""
    try:
        crl = x509.load_pem_x509_crl(crl_pem)
    except ValueError as e:
        raise DilocoError("is not a PEM certificate revocation list") from e
    if crl.issuer != ca.subject or not crl.is_signature_valid(ca.public_key()):
        raise DilocoError("is not signed by the run's CA (--tls-ca)")
    return frozenset(r.serial_number for r in crl)


class RevocationList:
    """The serials the file at `path` revokes (a CRL signed by the CA of `ca_pem`), read again
    when it changes. A version that is unreadable or not the CA's keeps the last good list: a
    half-copied file must not let revoked certificates back in, nor lock everyone out."""

    def __init__(self, path: str | Path, ca_pem: bytes):
        ca = x509.load_pem_x509_certificates(ca_pem)[0]
        self.path = Path(path)
        self._file = WatchedFile(path, lambda pem: revoked_serials(pem, ca), "--tls-crl")

    @property
    def serials(self) -> frozenset[int]:
        return self._file.value

    def revoked(self, serial: int, now: float) -> bool:
        serials, changed = self._file.get(now)
        if changed:
            log.warning("--tls-crl %s read again: %d certificate(s) revoked", self.path, len(serials))
        return serial in serials
