"""Addresses and secrets of the agent: listen URIs, TLS material, bearer tokens, certificate-name allow-lists.

This module owns the rules both ends share: which URIs are allowed (TLS off
loopback; plain ``grpc://`` only on a loopback address; ``grpc+unix://`` for
same-host callers), how secret files are read (given as paths only, regular
files of this user that group and others cannot access; their contents are
never logged or shown), the server's bearer-token check (one function for
Flight's middleware and the HTTP port), which name a client certificate goes
by (one rule for both protocols: :func:`certificate_name`), what a
certificate name may do (:func:`allowed`, :func:`consumer_allowed`,
:func:`may_write`), and the rule that an agent reachable from other hosts
authenticates its clients (:func:`check_reachable`). Nothing here imports
pyarrow at module load.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import stat
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from filechannel.errors import ConfigError

__all__ = [
    "ANY_CHANNEL",
    "INSECURE_FLAG",
    "Listen",
    "allowed",
    "bearer_problem",
    "certificate_name",
    "check_reachable",
    "consumer_allowed",
    "host_port",
    "may_write",
    "is_loopback",
    "make_token_middleware",
    "parse_uri",
    "read_public_file",
    "read_secret_file",
]

SCHEMES = ("grpc+tls", "grpc", "grpc+unix")
ANY_CHANNEL = "*"  # an allow-list key: every served channel
TOKEN_HEADER = "authorization"
MAX_SECRET_BYTES = 1 << 20
INSECURE_FLAG = "--insecure-allow-anyone"
# The subjectAltName kinds gRPC reports as a peer's identity, as Python's ssl names them.
_SAN_KINDS = ("DNS", "URI", "email", "IP Address")


@dataclass(frozen=True)
class Listen:
    """A parsed agent URI: ``scheme`` and ``host``/``port``, or ``path`` for ``grpc+unix``."""

    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""

    @property
    def tls(self) -> bool:
        """Whether the URI uses TLS."""
        return self.scheme == "grpc+tls"

    def location(self, port: int | None = None) -> str:
        """The URI as pyarrow.flight takes it (``port`` replaces a ``:0``)."""
        if self.scheme == "grpc+unix":
            return f"grpc+unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port if port is None else port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_port(uri: str) -> tuple[str, int] | None:
    """The host and port of ``SCHEME://HOST:PORT[/]`` (an IPv6 host without its brackets); None if either is missing."""
    parts = urlsplit(uri)
    try:
        port = parts.port
    except ValueError:
        port = None
    host = parts.hostname or ""
    if not host or port is None or parts.path not in ("", "/"):
        return None
    return host, port


def parse_uri(uri: str, option: str = "listen") -> Listen:
    """Parse and check an agent URI.

    Raises:
        ConfigError: Another scheme, no host or port, or plain ``grpc://`` on an address that is not loopback.
    """
    if not isinstance(uri, str) or "://" not in uri:
        raise ConfigError(
            option, f"{uri!r} is not an agent URI (grpc+tls://HOST:PORT, grpc://127.0.0.1:PORT or grpc+unix://PATH)"
        )
    scheme = uri.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise ConfigError(option, f"{uri}: the scheme must be one of {', '.join(SCHEMES)}")
    if scheme == "grpc+unix":
        path = uri.split("://", 1)[1]
        if not path.startswith("/"):
            raise ConfigError(
                option, f"{uri}: a grpc+unix URI needs an absolute socket path (grpc+unix:///run/fc.sock)"
            )
        return Listen(scheme, path=path)
    hp = host_port(uri)
    if hp is None:
        raise ConfigError(option, f"{uri}: give HOST:PORT (port 0 picks a free port)")
    host, port = hp
    if scheme == "grpc" and not is_loopback(host):
        raise ConfigError(
            option,
            f"{uri}: plain grpc:// is for a loopback address only (127.0.0.1, ::1, localhost); "
            "off loopback use grpc+tls:// with --tls-cert and --tls-key",
        )
    return Listen(scheme, host, port)


def _open_checked(path: str, option: str, private: bool) -> bytes:
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(option, f"cannot read {p}: {exc.strerror or type(exc).__name__}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(option, f"{p} is not a regular file")
        if private:
            euid = os.geteuid()
            if st.st_uid not in (euid, 0):
                raise ConfigError(option, f"{p} is owned by uid {st.st_uid}, not by this user (uid {euid}) or root")
            mode = stat.S_IMODE(st.st_mode)
            if mode & 0o077:
                raise ConfigError(
                    option, f"{p} has mode {mode:04o}: group or others can access it; run `chmod 600 {p}`"
                )
        if st.st_size > MAX_SECRET_BYTES:
            raise ConfigError(option, f"{p} is larger than {MAX_SECRET_BYTES} bytes")
        data = b""
        while len(data) <= MAX_SECRET_BYTES:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            data += chunk
    finally:
        os.close(fd)
    if not data.strip():
        raise ConfigError(option, f"{p} is empty")
    return data


def read_secret_file(path: str, option: str) -> bytes:
    """Read a private file (a TLS key, a token): a regular file of this user or root, mode 0600 or narrower.

    Raises:
        ConfigError: Missing, unreadable, not a regular file, open to group or others, or empty.
            The message names the path and the fix, never the contents.
    """
    return _open_checked(path, option, private=True)


def read_public_file(path: str, option: str) -> bytes:
    """Read a certificate or CA file (not secret: no mode check).

    Raises:
        ConfigError: Missing, unreadable, not a regular file, or empty.
    """
    return _open_checked(path, option, private=False)


def read_token(path: str, option: str = "token_file") -> bytes:
    """The bearer token in ``path`` (surrounding whitespace removed; one line of printable ASCII).

    Raises:
        ConfigError: As :func:`read_secret_file`, or the token is not one line of printable ASCII.
    """
    token = read_secret_file(path, option).strip()
    if not all(0x21 <= b <= 0x7E for b in token):
        raise ConfigError(option, f"{path}: a token is one line of printable ASCII without spaces")
    return token


def allowed(allow: Mapping[str, Collection[str]] | None, channel: str, name: str | None) -> bool:
    """Whether certificate name ``name`` may use ``channel`` under ``allow`` (None: every name may)."""
    if not allow:
        return True
    if name is None:
        return False
    names = allow.get(channel)
    if names is not None and name in names:
        return True
    everywhere = allow.get(ANY_CHANNEL)
    return everywhere is not None and name in everywhere


def consumer_allowed(consumers: Mapping[str, Collection[str]] | None, name: str | None, consumer: str) -> bool:
    """Whether certificate name ``name`` may act as ``consumer`` (register it, read under it, acknowledge for it).

    ``consumers`` maps certificate names to the consumer names each may use. A
    name it lists may use only its own; a name it does not list (or no name) may
    use only the consumers no listed name owns, so an unlisted certificate can
    never act as a consumer the list gives to someone. Empty or None: any.
    """
    if not consumers:
        return True
    if name is not None and name in consumers:
        return consumer in consumers[name]
    return not any(consumer in owned for owned in consumers.values())


def may_write(writers: Collection[str] | None, name: str | None) -> bool:
    """Whether certificate name ``name`` may write (put, stage and commit a sink's rows, post over HTTP).

    ``writers`` empty or None: every name let in may (as before such a list existed).
    """
    return not writers or (name is not None and name in writers)


def certificate_name(cert: Mapping[str, Any] | None) -> str | None:
    """The name a client certificate goes by: its first subjectAltName, else its subject CN.

    The rule is gRPC's peer identity (what Flight's ``context.peer_identity()``
    reports): the certificate's subjectAltNames of kind DNS, URI, email or IP
    address, first one in the certificate's order, else the subject's common
    name. ``cert`` is the dict of Python's ``SSLSocket.getpeercert()``, so the
    HTTP port names a certificate exactly as Flight does.
    """
    if not cert:
        return None
    for kind, value in cert.get("subjectAltName", ()):
        if kind in _SAN_KINDS:
            if kind == "IP Address":
                try:
                    return str(ipaddress.ip_address(value.strip()))  # gRPC prints the compressed form
                except ValueError:
                    return str(value)
            return str(value)
    for rdn in cert.get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                return str(v)
    return None


def bearer_problem(expected: bytes, given: Sequence[str | bytes]) -> str | None:
    """Why the ``authorization`` values ``given`` do not carry token ``expected`` (None: they do).

    One check for Flight and HTTP: exactly one value, ``Bearer <token>``,
    compared in constant time. The answer names the problem, never a token.
    """
    if not given:
        return "missing"
    value = given[0]
    raw = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
    if len(given) != 1 or not hmac.compare_digest(raw, b"Bearer " + expected):
        return "wrong"
    return None


def check_reachable(hosts: Mapping[str, str], client_ca: str | None, token_file: str | None, insecure: bool) -> None:
    """Refuse an agent that listens off loopback without authenticating its clients.

    ``hosts``: the addresses it listens on, by option (``listen``, ``http``; a
    ``grpc+unix`` socket is not one).
    Clients authenticate with a certificate (``client_ca``) or a bearer token
    (``token_file``); without either, anyone who can connect may read, write and
    take over consumers, so that takes ``insecure`` (``--insecure-allow-anyone``).

    Raises:
        ConfigError: A non-loopback address, no client authentication, and not ``insecure``.
    """
    if client_ca or token_file or insecure:
        return
    for option, host in hosts.items():
        if is_loopback(host):
            continue
        raise ConfigError(
            option,
            f"{host} is reachable from other hosts and clients are not authenticated, so anyone who can "
            f"connect could read, write and take over consumers: give --client-ca FILE or --token-file FILE "
            f"(or, to run open on purpose, {INSECURE_FLAG})",
        )


def make_token_middleware(token: bytes) -> Any:
    """A ``ServerMiddlewareFactory`` refusing every call without ``authorization: Bearer <token>``."""
    import pyarrow.flight as fl

    class _TokenCheck(fl.ServerMiddlewareFactory):  # type: ignore[misc]
        def start_call(self, info: Any, headers: Mapping[str, list[Any]]) -> None:
            problem = bearer_problem(token, headers.get(TOKEN_HEADER) or [])
            if problem == "missing":
                raise fl.FlightUnauthenticatedError(
                    "this agent requires a bearer token: give the client token_file= (the Spark option tokenFile)"
                )
            if problem is not None:
                raise fl.FlightUnauthenticatedError("the bearer token is wrong: check the client's token file")
            return None

        def __repr__(self) -> str:
            return "<token check>"

    return _TokenCheck()
