"""A throwaway certificate authority for tests, demos and soaks: a CA and the certificates it signs, as files.

:class:`PKI` writes a self-signed CA certificate and, on request, server and
client certificates signed by it (keys mode 0600, as the agent demands), so
mutual TLS between agents, producers and Spark can be set up on one machine
without a real PKI. Needs the ``cryptography`` package (the ``crypto`` extra).
Not for production: the keys are unencrypted and valid for ten days.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

__all__ = ["PKI", "write_file"]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def write_file(path: Path, data: bytes, mode: int = 0o644) -> str:
    """Write ``data`` to ``path``, created with ``mode`` (a key is never readable by others, even briefly)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, mode)  # an existing file keeps its mode through O_CREAT, and the umask narrows a new one
    return str(path)


class PKI:
    """A throwaway CA with certificates written as files under ``root`` (keys mode 0600).

    ``self.ca`` is the CA certificate's path (``root/<ca_file or cn>.pem``).
    """

    def __init__(self, root: Path, cn: str = "test-ca", *, ca_file: str | None = None) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(_name(cn))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=10))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.ca = write_file(root / f"{ca_file or cn}.pem", self.cert.public_bytes(serialization.Encoding.PEM))

    def issue(
        self,
        cn: str,
        *,
        server: bool = False,
        san: str | list[x509.GeneralName] | None = None,
        stem: str | None = None,
    ) -> tuple[str, str]:
        """Write ``cn``'s certificate and key (``root/<stem or cn>.crt`` and ``.key``); return their paths.

        ``server``: subjectAltNames ``localhost`` and ``127.0.0.1`` (a loopback server's names).
        ``san``: subjectAltNames too (a string: one DNS name).
        """
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        b = (
            x509.CertificateBuilder()
            .subject_name(_name(cn))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=10))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        )
        if server:
            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
        if san is not None:
            names = [x509.DNSName(san)] if isinstance(san, str) else san
            b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = b.sign(self.key, hashes.SHA256())
        pem_key = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        stem = stem or cn
        return (
            write_file(self.root / f"{stem}.crt", cert.public_bytes(serialization.Encoding.PEM)),
            write_file(self.root / f"{stem}.key", pem_key, 0o600),
        )
