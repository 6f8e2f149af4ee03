"""Addresses and secrets of the agent: listen URIs, TLS material, bearer tokens, certificate-name allow-lists.

This module owns the rules both ends share: which URIs are allowed (TLS off
loopback; plain ``grpc://`` only on a loopback address; ``grpc+unix://`` for
same-host callers), how secret files are read (given as paths only, regular
files of this user that group and others cannot access; their contents are
never logged or shown), and the server's bearer-token middleware. Nothing
here imports pyarrow at module load.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import stat
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from filechannel.errors import ConfigError

__all__ = [
    "ANY_CHANNEL",
    "Listen",
    "allowed",
    "consumer_allowed",
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
    parts = urlsplit(uri)
    try:
        port = parts.port
    except ValueError:
        port = None
    host = parts.hostname or ""
    if not host or port is None or parts.path not in ("", "/"):
        raise ConfigError(option, f"{uri}: give HOST:PORT (port 0 picks a free port)")
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

    ``consumers`` maps certificate names to the consumer names each may use; a
    name it does not list may use any consumer (as before such a list existed).
    """
    if not consumers or name is None or name not in consumers:
        return True
    return consumer in consumers[name]


def may_write(writers: Collection[str] | None, name: str | None) -> bool:
    """Whether certificate name ``name`` may write (put, stage and commit a sink's rows, post over HTTP).

    ``writers`` empty or None: every name let in may (as before such a list existed).
    """
    return not writers or (name is not None and name in writers)


def make_token_middleware(token: bytes) -> Any:
    """A ``ServerMiddlewareFactory`` refusing every call without ``authorization: Bearer <token>``."""
    import pyarrow.flight as fl

    expected = b"Bearer " + token

    class _TokenCheck(fl.ServerMiddlewareFactory):  # type: ignore[misc]
        def start_call(self, info: Any, headers: Mapping[str, list[Any]]) -> None:
            given = headers.get(TOKEN_HEADER) or []
            if not given:
                raise fl.FlightUnauthenticatedError(
                    "this agent requires a bearer token: give the client token_file= (the Spark option tokenFile)"
                )
            value = given[0]
            raw = value if isinstance(value, bytes) else str(value).encode()
            if len(given) != 1 or not hmac.compare_digest(raw, expected):
                raise fl.FlightUnauthenticatedError("the bearer token is wrong: check the client's token file")
            return None

        def __repr__(self) -> str:
            return "<token check>"

    return _TokenCheck()
